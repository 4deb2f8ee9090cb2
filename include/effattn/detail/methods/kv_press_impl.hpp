/// \file kv_press_impl.hpp
/// \brief Implementation of kv_press.hpp (included at its end): the scores of the selection
/// presses, the cache assembly and `KvPress`'s members. Not a public header.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "../../core/gemm.hpp"
#include "../../core/random.hpp"

namespace effattn {

namespace kv_press {

inline const char* name(Kind k) {
  switch (k) {
    case Kind::Drop:
      return "drop";
    case Kind::Streaming:
      return "streaming";
    case Kind::Uniform:
      return "uniform";
    case Kind::Knorm:
      return "knorm";
    case Kind::SnapKv:
      return "snapkv";
    case Kind::Observed:
      return "observed";
    case Kind::Wildcat:
      return "wildcat";
    case Kind::Vcc:
      return "vcc";
  }
  return "unknown";
}

inline Kind from_name(const std::string& n) {
  std::string list;
  for (const Kind k : all()) {
    if (n == name(k)) return k;
    list += list.empty() ? "" : ", ";
    list += name(k);
  }
  detail::throw_invalid_argument(
      detail::cat("kv_press: unknown press '", n, "' (presses: ", list, ")"));
}

}  // namespace kv_press

namespace detail {

/// The row of a prompt that a cache row built from it carries no certificate for: a finite
/// stand-in for +infinity as `WildcatBlock::log_residual_trace` (the bound's arithmetic needs
/// finite logs), which makes `weighted_attention`'s bound the clip bound (the value range).
constexpr double kNoCertificateLogTrace = std::numeric_limits<double>::max() / 16;

/// A cache of the given rows of K, V kept exactly (weight 1, log-scale 0), in the given order.
template <typename Scalar>
CompressedKV<Scalar> press_exact_rows(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V,
                                      const std::vector<Index>& rows) {
  const auto r = static_cast<Index>(rows.size());
  CompressedKV<Scalar> c;
  c.keys.resize(r, K.cols());
  c.values.resize(r, V.cols());
  for (Index s = 0; s < r; ++s) {
    c.keys.row(s) = K.row(rows[static_cast<std::size_t>(s)]);
    c.values.row(s) = V.row(rows[static_cast<std::size_t>(s)]);
  }
  c.weights = Vector<Scalar>::Ones(r);
  c.log_scale = Vector<Scalar>::Zero(r);
  c.pivots = rows;
  return c;
}

/// Fills the bookkeeping of a pressed cache of a prompt K, V: the value range of every prompt
/// row (the clip), the token count, no tail, and one block (exact when every row is kept,
/// otherwise without a certificate; also for an empty cache, whose appended rows
/// `weighted_attention` then reads with the bound of a dropped prompt).
template <typename Scalar>
void press_finish(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V, bool exact,
                  CompressedKV<Scalar>& c) {
  const Index m = K.rows(), r = c.size();
  c.vmin = V.colwise().minCoeff();
  c.vmax = V.colwise().maxCoeff();
  c.tokens = m;
  c.tail_begin = r;
  c.blocks.clear();
  WildcatBlock b;
  b.row_begin = 0;
  b.rows = r;
  b.first_token = 0;
  b.tokens = m;
  b.exact = exact;
  b.centre = Vector<double>::Zero(K.cols());
  b.key_radius = std::sqrt(row_squared_norms(K).maxCoeff());
  if (!exact) b.log_residual_trace = kNoCertificateLogTrace;
  c.blocks.push_back(std::move(b));
}

/// The `b` indices of the largest scores (ties: the later position), ascending.
inline std::vector<Index> top_positions(const Vector<double>& score, Index b) {
  std::vector<Index> idx(static_cast<std::size_t>(score.size()));
  std::iota(idx.begin(), idx.end(), Index(0));
  const auto better = [&](Index x, Index y) {
    return score(x) > score(y) || (score(x) == score(y) && x > y);
  };
  std::partial_sort(idx.begin(), idx.begin() + b, idx.end(), better);
  idx.resize(static_cast<std::size_t>(b));
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// Attention received by each key from the queries of Q (query_heads blocks of w rows; with
/// causal, query j of a block sees keys 0 .. m - w + j), summed over the queries (double).
/// `counts` gets the number of queries that see each key. Tiles of 128 queries: O(n_q m d) time,
/// O(128 m) memory.
template <typename Scalar>
void press_attention_received(const ConstRef<Scalar>& K, const ConstRef<Scalar>& Q, Index heads,
                              bool causal, double scale, Vector<double>& sum,
                              Vector<double>& counts) {
  const Index m = K.rows(), nq = Q.rows(), w = nq / heads;
  constexpr Index kTile = 128;
  sum = Vector<double>::Zero(m);
  counts = Vector<double>::Zero(m);
  Matrix<Scalar> S;
  for (Index i0 = 0; i0 < nq; i0 += kTile) {
    const Index t = std::min(kTile, nq - i0);
    // Panels fixed by the shape (core/gemm.hpp): the same bits for every thread count.
    gemm<Op::N, Op::T>(Update::Assign, S, Q.middleRows(i0, t), K, static_cast<Scalar>(scale));
    for (Index j = 0; j < t; ++j) {
      const Index row = i0 + j;
      const Index last = causal ? m - w + row % w : m - 1;  // the last key the query sees
      auto s = S.row(j).head(last + 1);
      const double mx = static_cast<double>(s.maxCoeff());
      const Vector<double> p = (s.transpose().template cast<double>().array() - mx).exp().matrix();
      sum.head(last + 1) += p / p.sum();
      counts.head(last + 1).array() += 1.0;
    }
  }
}

/// The TwoLevel block size of the vcc press: `k` if set, else the power of two k >= 2 whose
/// partition is longest within the budget b (|J| = ceil(m / k) coarse blocks plus k - 1 rows
/// per fine block; ties: the larger k), so that as much of the budget as possible is used.
inline Index press_vcc_block(Index m, Index b, Index k) {
  if (k > 0) return k;
  Index best = 0, best_len = -1;
  for (Index c = 2; c / 2 < m; c *= 2) {
    const Index coarse = (m + c - 1) / c;
    if (coarse > b) continue;
    const Index len = coarse + std::min(coarse, (b - coarse) / (c - 1)) * (c - 1);
    if (len >= best_len) best = c, best_len = len;
  }
  return best > 0 ? best : 2;
}

/// Validates a prompt K and the queries Q of a press; returns the queries per head block.
template <typename Scalar>
Index press_check(const ConstRef<Scalar>& K, const ConstRef<Scalar>& Q, const KvPressOptions& o) {
  const char* who = "KvPress";
  EFFATTN_CHECK(K.rows() > 0 && K.cols() > 0,
                cat(who, ": K must be m x d with m, d >= 1; got K ", shape(K)));
  check_finite(K, "K");
  const Index m = K.rows();
  EFFATTN_CHECK(
      Q.rows() == 0 || Q.cols() == K.cols(),
      cat(who, ": Q must be n_q x d with d = K.cols() = ", K.cols(), "; got Q ", shape(Q)));
  EFFATTN_CHECK(
      Q.rows() % o.query_heads == 0,
      cat(who, ": Q's ", Q.rows(), " rows are not a multiple of query_heads = ", o.query_heads));
  const Index w = Q.rows() / o.query_heads;
  EFFATTN_CHECK(!o.causal || w <= m,
                cat(who, ": with causal, each head block of Q holds at most m = ", m,
                    " queries (the prompt's last positions); got ", w));
  check_finite(Q, "Q");
  const bool needs_q = o.press == kv_press::Kind::SnapKv || o.press == kv_press::Kind::Observed;
  EFFATTN_CHECK(!needs_q || w >= 1, cat(who, ": press '", kv_press::name(o.press),
                                        "' ranks keys by the attention of queries; pass Q"));
  return w;
}

}  // namespace detail

template <typename Scalar_>
KvPress<Scalar_>::KvPress(Options opts) : m_opts(opts) {
  using kv_press::Kind;
  const Options& o = m_opts;
  EFFATTN_CHECK(
      detail::is_one_of(o.press, {Kind::Drop, Kind::Streaming, Kind::Uniform, Kind::Knorm,
                                  Kind::SnapKv, Kind::Observed, Kind::Wildcat, Kind::Vcc}),
      "KvPress: Options::press must be a kv_press::Kind");
  EFFATTN_CHECK(o.rows >= 0,
                detail::cat("KvPress: Options::rows must be >= 0 (0 = use keep); got ", o.rows));
  EFFATTN_CHECK(
      o.rows > 0 || (std::isfinite(o.keep) && o.keep > 0 && o.keep <= 1),
      detail::cat("KvPress: Options::keep must be in (0, 1] when rows is 0; got ", o.keep));
  EFFATTN_CHECK(o.sinks >= 0, detail::cat("KvPress: Options::sinks must be >= 0; got ", o.sinks));
  EFFATTN_CHECK(o.observation >= 1,
                detail::cat("KvPress: Options::observation must be >= 1; got ", o.observation));
  EFFATTN_CHECK(o.pool >= 1 && o.pool % 2 == 1,
                detail::cat("KvPress: Options::pool must be odd and >= 1; got ", o.pool));
  EFFATTN_CHECK(o.query_heads >= 1,
                detail::cat("KvPress: Options::query_heads must be >= 1; got ", o.query_heads));
  detail::check_scale_option(o.scale, "KvPress");
  EFFATTN_CHECK(
      std::isfinite(o.q_radius) && o.q_radius >= 0,
      detail::cat("KvPress: Options::q_radius must be finite and >= 0; got ", o.q_radius));
  EFFATTN_CHECK(
      o.block_size == 0 || (o.block_size >= 1 && (o.block_size & (o.block_size - 1)) == 0),
      detail::cat("KvPress: Options::block_size must be 0 or a power of two; got ", o.block_size));
}

template <typename Scalar_>
Index KvPress<Scalar_>::budget(Index m) const {
  if (m_opts.rows > 0) return std::min(m, m_opts.rows);
  const auto b = static_cast<Index>(std::llround(m_opts.keep * static_cast<double>(m)));
  return std::clamp<Index>(b, std::min<Index>(1, m), m);
}

template <typename Scalar_>
std::vector<Index> KvPress<Scalar_>::select(const Ref& K, const Ref& Q) const {
  using kv_press::Kind;
  const Options& o = m_opts;
  const Index w = detail::press_check<Scalar>(K, Q, o);
  const Index m = K.rows(), b = budget(m);
  std::vector<Index> all(static_cast<std::size_t>(m));
  std::iota(all.begin(), all.end(), Index(0));
  if (b >= m) return all;
  const double scale = detail::resolve_scale(o.scale, K.cols());
  switch (o.press) {
    case Kind::Drop:
      return {};
    case Kind::Streaming: {
      const Index s = std::min(o.sinks, b);
      std::vector<Index> rows(all.begin(), all.begin() + s);
      rows.insert(rows.end(), all.end() - (b - s), all.end());
      return rows;
    }
    case Kind::Uniform: {
      // Partial Fisher-Yates with effattn's own bounded integers (toolchain-independent).
      Rng rng = make_rng(o.seed, 0x756e69ULL);
      for (Index i = 0; i < b; ++i)
        std::swap(all[static_cast<std::size_t>(i)],
                  all[static_cast<std::size_t>(i + uniform_index(rng, m - i))]);
      all.resize(static_cast<std::size_t>(b));
      std::sort(all.begin(), all.end());
      return all;
    }
    case Kind::Knorm: {
      const Vector<double> score = -detail::row_squared_norms(K).template cast<double>();
      return detail::top_positions(score, b);
    }
    case Kind::SnapKv: {
      // The last `observation` queries of every head block rank the keys; with causal their own
      // rows (the prompt's last positions) are always kept (score +inf, later positions first).
      const Index ow = std::min(o.observation, w);
      Matrix<Scalar> Qo(ow * o.query_heads, K.cols());
      for (Index h = 0; h < o.query_heads; ++h)
        Qo.middleRows(h * ow, ow) = Q.middleRows(h * w + w - ow, ow);
      Vector<double> sum, counts;
      detail::press_attention_received<Scalar>(K, Qo, o.query_heads, o.causal, scale, sum, counts);
      Vector<double> score(m);
      const Index half = o.pool / 2;
      for (Index i = 0; i < m; ++i) {  // average pooling, the window clipped at the ends
        const Index lo = std::max<Index>(0, i - half), hi = std::min(m - 1, i + half);
        score(i) = sum.segment(lo, hi - lo + 1).mean();
      }
      if (o.causal) score.tail(ow).setConstant(std::numeric_limits<double>::infinity());
      return detail::top_positions(score, b);
    }
    case Kind::Observed: {
      Vector<double> sum, counts;
      detail::press_attention_received<Scalar>(K, Q, o.query_heads, o.causal, scale, sum, counts);
      // Keys no query sees keep score 0 (ranked after every key that received attention).
      const Vector<double> score = sum.cwiseQuotient(counts.cwiseMax(1.0));
      return detail::top_positions(score, b);
    }
    case Kind::Wildcat:
    case Kind::Vcc:
      break;
  }
  detail::throw_invalid_argument(detail::cat("KvPress::select: press '", kv_press::name(o.press),
                                             "' is not a selection press; the prompt rows behind "
                                             "its cache are the cache's pivots"));
}

template <typename Scalar_>
CompressedKV<Scalar_> KvPress<Scalar_>::compress(const Ref& K, const Ref& V, const Ref& Q) const {
  using kv_press::Kind;
  const Options& o = m_opts;
  detail::press_check<Scalar>(K, Q, o);
  EFFATTN_CHECK(V.rows() == K.rows() && V.cols() > 0,
                detail::cat("KvPress: V must be m x dv with m = K.rows() = ", K.rows(), "; got K ",
                            detail::shape(K), ", V ", detail::shape(V)));
  detail::check_finite(V, "V");
  const Index m = K.rows(), b = budget(m);
  Cache c;
  if ((o.press != Kind::Wildcat && o.press != Kind::Vcc) || b >= m) {
    const std::vector<Index> rows = select(K, Q);
    c = detail::press_exact_rows<Scalar>(K, V, rows);
    detail::press_finish<Scalar>(K, V, static_cast<Index>(rows.size()) == m, c);
    return c;
  }
  if (o.press == Kind::Wildcat) {
    WildcatOptions wo;
    wo.rank = b;
    wo.seed = o.seed;
    wo.scale = o.scale;
    double qr = o.q_radius;
    if (qr == 0 && Q.rows() > 0)
      qr = std::sqrt(static_cast<double>(detail::row_squared_norms(Q).maxCoeff()));
    c = compress_kv(K, V, qr, wo);  // its blocks carry WildCat's certificate
    if (c.size() == 0) detail::throw_numerical_error("KvPress (wildcat)", Info::NumericalIssue);
    return c;
  }
  // vcc: the TwoLevel partition guided by the queries (Uniform without them), one row per
  // segment: mean key, mean value, log-scale log(count), weight 1 (so the row stands for count
  // copies of its mean in both sums of the softmax).
  const VccTree<Scalar> tree(K);
  VccSelectOptions so;
  so.select = Q.rows() > 0 ? vcc::SelectKind::TwoLevel : vcc::SelectKind::Uniform;
  so.segments = b;
  so.block_size = detail::press_vcc_block(m, b, o.block_size);
  so.scale = o.scale;
  const std::vector<VccSegment> J = tree.select(Q, so);
  const auto r = static_cast<Index>(J.size());
  c.keys.resize(r, K.cols());
  c.values.resize(r, V.cols());
  c.weights = Vector<Scalar>::Ones(r);
  c.log_scale.resize(r);
  for (Index s = 0; s < r; ++s) {
    const VccSegment& seg = J[static_cast<std::size_t>(s)];
    const double inv = 1.0 / static_cast<double>(seg.count);
    c.keys.row(s) =
        (K.middleRows(seg.begin, seg.count).template cast<double>().colwise().sum() * inv)
            .template cast<Scalar>();
    c.values.row(s) =
        (V.middleRows(seg.begin, seg.count).template cast<double>().colwise().sum() * inv)
            .template cast<Scalar>();
    c.log_scale(s) = static_cast<Scalar>(std::log(static_cast<double>(seg.count)));
    c.pivots.push_back(seg.begin);
  }
  detail::press_finish<Scalar>(K, V, r == m, c);
  return c;
}

}  // namespace effattn
