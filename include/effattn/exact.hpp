/// \file exact.hpp
/// \brief Exact softmax attention: a materialised reference and a tiled streaming kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/softmax.hpp"
#include "core/types.hpp"

namespace effattn {

/// \defgroup Policies Policies
/// Tag types selecting an algorithm at compile time.
namespace policy {
/// \ingroup Policies
/// Materialise the n x m score matrix in double precision, softmax it row by row, multiply by V.
/// O(n m) memory. The reference every other method is tested against.
struct Naive {};
/// \ingroup Policies
/// Streaming online softmax over key blocks for each query block (flash-attention style).
/// O((n + m) d) memory; both products are GEMMs on cache-sized tiles.
struct Tiled {};
}  // namespace policy

/// Options of `ExactAttention`.
struct ExactOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal mask, bottom-right aligned as in FlashAttention: query i sees keys
  /// j <= i + (m - n). Requires m >= n (otherwise the first n - m queries would see no key).
  bool causal = false;
  /// Query rows per tile (Tiled only). 0 = automatic.
  Index block_q = 0;
  /// Keys per tile (Tiled only). 0 = automatic.
  Index block_k = 0;
};

namespace detail {

/// How the Tiled kernel splits one problem. It depends only on the shapes and options, never on
/// the number of threads, which keeps results bit-identical across thread counts.
struct ExactTilePlan {
  Index bq = 0;         ///< query rows per block
  Index bk = 0;         ///< keys per tile
  Index q_blocks = 0;   ///< ceil(n / bq)
  Index kv_splits = 1;  ///< key-range splits per query block (split-KV for few query blocks)
};

inline ExactTilePlan plan_exact_tiles(Index n, Index m, Index d, Index dv, Index scalar_bytes,
                                      const ExactOptions& o) {
  ExactTilePlan p;
  // Automatic tiles: 128 query rows, and as many keys (<= 256) as keep the score tile within
  // Eigen's stack-allocation limit (128 KiB by default), because Eigen packs a GEMM operand of
  // that size on the stack but heap-allocates larger ones on every call (measured: one malloc
  // per tile for double 128 x 256 tiles). Float: 128 x 256, double: 128 x 128; the query block
  // halves for very wide heads so the packed Q tile obeys the same limit. A tile that size sits
  // well inside the L2 cache. The choice was timed with bench_exact (README "Exact attention").
  const Index limit = EIGEN_STACK_ALLOCATION_LIMIT;
  const Index width = std::min<Index>(std::max(d, dv), 256);
  Index bq = 128;
  while (bq > 16 && bq * width * scalar_bytes > limit) bq /= 2;
  const Index bk = std::max<Index>(16, std::min<Index>(256, limit / (bq * scalar_bytes)));
  p.bq = std::min(n, o.block_q > 0 ? o.block_q : bq);
  p.bk = std::min(m, o.block_k > 0 ? o.block_k : bk);
  p.q_blocks = (n + p.bq - 1) / p.bq;
  // Too few query blocks to keep several cores busy (decode, short prompts against a long
  // cache): also split the key range, then merge the partial softmax states by log-sum-exp.
  constexpr Index kMinTasks = 8;
  if (p.q_blocks < kMinTasks) {
    const Index want = (kMinTasks + p.q_blocks - 1) / p.q_blocks;
    const Index can = std::max<Index>(1, m / (4 * p.bk));  // keep >= 4 tiles per split
    p.kv_splits = std::min(want, can);
  }
  return p;
}

/// Per-thread buffers of the Tiled kernel, allocated once per thread per call.
template <typename Scalar>
struct ExactWorkspace {
  using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  Matrix<Scalar> q;    ///< bq x d, scaled query block
  Matrix<Scalar> s;    ///< bq x bk, scores then probabilities
  Matrix<Scalar> acc;  ///< bq x dv, unnormalised output
  Array m, shift, alpha, tile_max, tile_sum;
  Eigen::Array<double, Eigen::Dynamic, 1> l;  ///< running row sums, in double

  ExactWorkspace(Index bq, Index bk, Index d, Index dv)
      : q(bq, d),
        s(bq, bk),
        acc(bq, dv),
        m(bq),
        shift(bq),
        alpha(bq),
        tile_max(bq),
        tile_sum(bq),
        l(bq) {}
};

/// Online-softmax pass of query rows [i0, i0 + bq) over keys [k_begin, k_end). Leaves the
/// running max in ws.m, the row sums (relative to ws.m) in ws.l and the unnormalised output in
/// ws.acc. Rows that saw no visible key keep m = -inf, l = 0, acc = 0.
template <typename Scalar>
void exact_tiled_block(const ConstRef<Scalar>& Q, const Matrix<Scalar>& Kt,
                       const ConstRef<Scalar>& V, const Scalar* bias, Scalar scale, bool causal,
                       Index i0, Index bq, Index k_begin, Index k_end, Index bk,
                       ExactWorkspace<Scalar>& ws) {
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
  const Index off = Kt.cols() - Q.rows();  // causal: row i sees keys j <= i + off
  // Keys beyond the last row's diagonal are never visible to this block: stop early.
  if (causal) k_end = std::min(k_end, i0 + bq + off);

  auto q = ws.q.topRows(bq);
  auto acc = ws.acc.topRows(bq);
  auto m = ws.m.head(bq);
  auto shift = ws.shift.head(bq);
  auto alpha = ws.alpha.head(bq);
  auto tmax = ws.tile_max.head(bq);
  auto tsum = ws.tile_sum.head(bq);
  auto l = ws.l.head(bq);
  q.noalias() = Q.middleRows(i0, bq) * scale;
  m.setConstant(ninf);
  l.setZero();
  acc.setZero();

  for (Index j0 = k_begin; j0 < k_end; j0 += bk) {
    const Index cols = std::min(bk, k_end - j0);
    auto S = ws.s.topLeftCorner(bq, cols);
    S.noalias() = q * Kt.middleCols(j0, cols);
    if (bias != nullptr)
      for (Index c = 0; c < cols; ++c) S.col(c).array() += bias[j0 + c];
    // Diagonal tile: key j is hidden from local rows r < j - off - i0 (a prefix of the column).
    const bool diagonal = causal && j0 + cols - 1 > i0 + off;
    auto hidden_rows = [&](Index c) { return std::max<Index>(0, std::min(bq, j0 + c - off - i0)); };
    if (diagonal)
      for (Index c = 0; c < cols; ++c) S.col(c).head(hidden_rows(c)).setConstant(ninf);
    tmax = S.col(0).array();
    for (Index c = 1; c < cols; ++c) tmax = tmax.max(S.col(c).array());
    tmax = tmax.max(m);  // new running max
    // Rows that have seen no visible key yet keep max -inf; shift them by 0 to avoid inf - inf.
    shift = (tmax == ninf).select(Scalar(0), tmax);
    alpha = (m - shift).exp();  // rescale factor of the old state (0 when m was -inf)
    tsum.setZero();
    for (Index c = 0; c < cols; ++c) {
      S.col(c).array() = (S.col(c).array() - shift).exp();
      // Masked entries must be exactly 0: Eigen's vectorised exp clamps its argument, so
      // exp(-inf) would give ~1e-38 (float), which a huge value could still turn into a bias.
      if (diagonal) S.col(c).head(hidden_rows(c)).setZero();
      if (bias != nullptr && bias[j0 + c] == ninf) S.col(c).setZero();
      tsum += S.col(c).array();
    }
    l = l * alpha.template cast<double>() + tsum.template cast<double>();
    if (!(alpha == Scalar(1)).all()) acc.array().colwise() *= alpha;
    acc.noalias() += S * V.middleRows(j0, cols);
    m = tmax;
  }
}

/// The Tiled kernel: out (n x dv) and lse (n) for the whole problem.
template <typename Scalar>
void exact_tiled(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K, const ConstRef<Scalar>& V,
                 const Scalar* bias, Scalar scale, bool causal, const ExactTilePlan& plan,
                 Matrix<Scalar>& out, Vector<Scalar>& lse) {
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  const Index off = m - n;
  out.resize(n, dv);
  lse.resize(n);
  const Index bq = plan.bq, bk = plan.bk, splits = plan.kv_splits;
  auto make_ws = [&] { return ExactWorkspace<Scalar>(bq, bk, d, dv); };
  // K^T (d x m) once per call, O(m d): every key tile K_t^T is then a contiguous column block,
  // which Eigen packs with unit-stride reads (packing K_t^T from the column-major K strided by m
  // cost ~8% of the run time at n = m = 4096, d = 64).
  const Matrix<Scalar> Kt = K.transpose();

  if (splits == 1) {
    parallel_for(plan.q_blocks, make_ws, [&](Index b, ExactWorkspace<Scalar>& ws) {
      const Index i0 = b * bq, rows = std::min(bq, n - i0);
      exact_tiled_block<Scalar>(Q, Kt, V, bias, scale, causal, i0, rows, 0, m, bk, ws);
      // Normalise through a workspace vector: a broadcast cast expression would be evaluated
      // into a heap temporary once per block.
      ws.alpha.head(rows) = ws.l.head(rows).inverse().template cast<Scalar>();
      out.middleRows(i0, rows).array() =
          ws.acc.topRows(rows).array().colwise() * ws.alpha.head(rows);
      lse.segment(i0, rows).array() =
          ws.m.head(rows) + ws.l.head(rows).log().template cast<Scalar>();
    });
    return;
  }

  // Split-KV: task (b, s) handles query block b against key range s; partial states are merged
  // afterwards in a fixed order (s = 0, 1, ...), so the result does not depend on scheduling.
  Matrix<Scalar> part_m(n, splits);
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> part_l(n, splits);
  std::vector<Matrix<Scalar>> part_acc(static_cast<std::size_t>(splits), Matrix<Scalar>(n, dv));
  parallel_for(plan.q_blocks * splits, make_ws, [&](Index t, ExactWorkspace<Scalar>& ws) {
    const Index b = t / splits, s = t % splits;
    const Index i0 = b * bq, rows = std::min(bq, n - i0);
    const Index visible = causal ? std::min(m, i0 + rows + off) : m;
    const Index k0 = visible * s / splits, k1 = visible * (s + 1) / splits;
    exact_tiled_block<Scalar>(Q, Kt, V, bias, scale, causal, i0, rows, k0, k1, bk, ws);
    part_m.col(s).segment(i0, rows) = ws.m.head(rows).matrix();
    part_l.col(s).segment(i0, rows) = ws.l.head(rows).matrix();
    part_acc[static_cast<std::size_t>(s)].middleRows(i0, rows) = ws.acc.topRows(rows);
  });
  const Vector<Scalar> mx = part_m.rowwise().maxCoeff();  // finite: every row sees a key
  Eigen::Array<double, Eigen::Dynamic, 1> total = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
  out.setZero();
  for (Index s = 0; s < splits; ++s) {
    // Splits in which a row saw no key have m = -inf and contribute exp(-inf) = 0.
    const Eigen::Array<Scalar, Eigen::Dynamic, 1> w = (part_m.col(s) - mx).array().exp();
    total += part_l.col(s).array() * w.template cast<double>();
    out.array() += part_acc[static_cast<std::size_t>(s)].array().colwise() * w;
  }
  out.array().colwise() /= total.template cast<Scalar>();
  lse.array() = mx.array() + total.log().template cast<Scalar>();
}

/// The Naive kernel, computed entirely in double.
template <typename Scalar>
void exact_naive(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K, const ConstRef<Scalar>& V,
                 const Scalar* bias, double scale, bool causal, Matrix<Scalar>& out,
                 Vector<Scalar>& lse) {
  using MatD = Matrix<double>;
  const Index n = Q.rows(), m = K.rows();
  const Index off = m - n;
  MatD S = (Q.template cast<double>() * scale) * K.template cast<double>().transpose();
  if (bias != nullptr)
    for (Index j = 0; j < m; ++j) S.col(j).array() += static_cast<double>(bias[j]);
  if (causal)
    for (Index j = 0; j < m; ++j) {
      const Index hidden = std::min(n, std::max<Index>(0, j - off));  // rows i < j - off
      S.col(j).head(hidden).setConstant(-std::numeric_limits<double>::infinity());
    }
  const Vector<double> lse_d = row_softmax_inplace(S);
  const MatD O = S * V.template cast<double>();
  out = O.template cast<Scalar>();
  lse = lse_d.template cast<Scalar>();
}

}  // namespace detail

/// Result of `ExactAttention::compute`, shared by both policies.
template <typename Scalar>
struct ExactResult : AttentionResult<Scalar> {
  Vector<Scalar> lse;   ///< n values log sum_j exp(logit_ij) over the visible keys.
  Index block_q = 0;    ///< query rows per block used (Tiled; 0 for Naive)
  Index block_k = 0;    ///< keys per tile used (Tiled; 0 for Naive)
  Index kv_splits = 1;  ///< key-range splits per query block (Tiled)
};

/// \ingroup Methods
/// \brief Exact softmax attention O = softmax(scale Q K^T + 1 b^T [+ causal mask]) V.
///
/// \f[ O_{i,:} = \sum_j \frac{\exp(s\,\langle q_i, k_j\rangle + b_j)}{\sum_{j'}
///     \exp(s\,\langle q_i, k_{j'}\rangle + b_{j'})} v_j, \qquad
///     \mathrm{lse}_i = \log \sum_j \exp(s\,\langle q_i, k_j\rangle + b_j) \f]
///
/// \tparam Scalar_ float or double.
/// \tparam Policy `policy::Tiled` (default) or `policy::Naive`.
///
/// - **Tiled** (default): for each block of `block_q` queries, loop over tiles of `block_k` keys,
///   S = (s Q_b) K_t^T (GEMM), running row max m and sum l with rescaling of the accumulator by
///   exp(m_old - m_new), then acc += exp(S - m) V_t (GEMM); finally O = acc / l. This is the
///   online softmax of Milakov & Gimelshein (2018) as used by FlashAttention (Dao et al., 2022).
///   Cost 4 n m d flops (about half with `causal`), memory O((n + m) d + threads * block_q *
///   (block_k + d + dv)): nothing n x m is ever allocated. Query blocks run in parallel under
///   OpenMP; when there are fewer than 8 query blocks the key range is split too and the partial
///   states are merged by log-sum-exp. The decomposition depends only on shapes and options, so
///   results are bit-identical for any thread count.
/// - **Naive**: materialises the n x m scores in double, stable row softmax, O = P V. O(n m)
///   memory; the reference. Computed in double even for float inputs.
///
/// With `causal`, query i sees keys j <= i + (m - n) (bottom-right aligned); key tiles beyond
/// the diagonal are skipped and the diagonal tile is masked.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/exact.hpp>
/// Eigen::MatrixXf Q = Eigen::MatrixXf::Random(512, 64), K = Eigen::MatrixXf::Random(1024, 64),
///                 V = Eigen::MatrixXf::Random(1024, 64);
/// effattn::ExactAttentionf::Options o;
/// o.causal = true;                                  // query i sees keys j <= i + 512
/// auto r = effattn::ExactAttentionf(o).compute(Q, K, V);
/// // r.output: 512 x 64, r.lse: 512 log-sum-exp values
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state: one functor may be shared by any number of threads.
template <typename Scalar_, typename Policy = policy::Tiled>
class ExactAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same<Policy, policy::Tiled>::value ||
                    std::is_same<Policy, policy::Naive>::value,
                "effattn: ExactAttention policy must be policy::Tiled or policy::Naive");

 public:
  using Scalar = Scalar_;
  using Options = ExactOptions;
  using MatrixType = Matrix<Scalar>;
  using Ref = ConstRef<Scalar>;

  /// Result of `compute` (the same type for both policies).
  using Result = ExactResult<Scalar>;

  /// \throws effattn::invalid_argument if `scale` is negative or non-finite, or a block size < 0.
  explicit ExactAttention(Options opts = {}) : m_opts(opts) {
    detail::check_scale_option(m_opts.scale, "ExactAttention");
    EFFATTN_CHECK(m_opts.block_q >= 0,
                  detail::cat("ExactAttention: Options::block_q must be >= 0 (0 = automatic); got ",
                              m_opts.block_q));
    EFFATTN_CHECK(m_opts.block_k >= 0,
                  detail::cat("ExactAttention: Options::block_k must be >= 0 (0 = automatic); got ",
                              m_opts.block_k));
  }

  /// Attention of Q (n x d) over K (m x d), V (m x dv).
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, and for
  ///         `causal` with m < n.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const {
    return run(Q, K, V, nullptr);
  }

  /// Attention with an additive per-key logit bias b (m values): logit_ij = s <q_i, k_j> + b_j.
  /// b_j = log c_j is the log-count correction of a key standing for c_j identical keys, and
  /// b_j = -inf masks key j (padding). Every query must keep at least one visible key.
  /// \throws effattn::invalid_argument as `compute(Q, K, V)`, and if `key_bias` has the wrong
  ///         length, contains NaN or +inf, or masks every key of some query.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const ConstVectorRef<Scalar>& key_bias) const {
    EFFATTN_CHECK(key_bias.size() == K.rows(),
                  detail::cat("ExactAttention: key_bias must have m = K.rows() = ", K.rows(),
                              " entries; got ", key_bias.size()));
    Index first_visible = -1;
    for (Index j = 0; j < key_bias.size(); ++j) {
      const Scalar b = key_bias(j);
      EFFATTN_CHECK(!std::isnan(b) && b != std::numeric_limits<Scalar>::infinity(),
                    detail::cat("ExactAttention: key_bias must be finite or -inf (a masked key); "
                                "got ",
                                b, " at index ", j));
      if (first_visible < 0 && std::isfinite(b)) first_visible = j;
    }
    const Index last_allowed = m_opts.causal ? K.rows() - Q.rows() : K.rows() - 1;
    EFFATTN_CHECK(first_visible >= 0 && first_visible <= last_allowed,
                  detail::cat("ExactAttention: key_bias masks every key visible to query 0 (first "
                              "unmasked key: ",
                              first_visible, ")"));
    return run(Q, K, V, key_bias.data());
  }

  /// Convenience: `compute(Q, K, V).output`.
  /// \throws effattn::numerical_error if the result is not finite (logits overflowed).
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V) const {
    Result r = compute(Q, K, V);
    if (r.info != Info::Success) detail::throw_numerical_error("ExactAttention", r.info);
    return std::move(r.output);
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Result run(const Ref& Q, const Ref& K, const Ref& V, const Scalar* bias) const {
    detail::check_attention_inputs(Q, K, V, "ExactAttention");
    EFFATTN_CHECK(
        !m_opts.causal || K.rows() >= Q.rows(),
        detail::cat("ExactAttention: causal attention needs m >= n (query i sees keys "
                    "j <= i + m - n, so the first n - m queries would see none); got n = ",
                    Q.rows(), ", m = ", K.rows()));
    const double scale = detail::resolve_scale(m_opts.scale, Q.cols());
    Result r;
    if (std::is_same<Policy, policy::Naive>::value) {
      detail::exact_naive<Scalar>(Q, K, V, bias, scale, m_opts.causal, r.output, r.lse);
    } else {
      const detail::ExactTilePlan plan = detail::plan_exact_tiles(
          Q.rows(), K.rows(), Q.cols(), V.cols(), static_cast<Index>(sizeof(Scalar)), m_opts);
      detail::exact_tiled<Scalar>(Q, K, V, bias, static_cast<Scalar>(scale), m_opts.causal, plan,
                                  r.output, r.lse);
      r.block_q = plan.bq;
      r.block_k = plan.bk;
      r.kv_splits = plan.kv_splits;
    }
    r.info = detail::all_finite(r.output) && detail::all_finite(r.lse) ? Info::Success
                                                                       : Info::NumericalIssue;
    return r;
  }

  Options m_opts;
};

/// Exact attention with the Tiled kernel, float.
using ExactAttentionf = ExactAttention<float>;
/// Exact attention with the Tiled kernel, double.
using ExactAttentiond = ExactAttention<double>;
/// Materialised reference, float inputs (computed in double).
using NaiveAttentionf = ExactAttention<float, policy::Naive>;
/// Materialised reference, double.
using NaiveAttentiond = ExactAttention<double, policy::Naive>;

}  // namespace effattn
