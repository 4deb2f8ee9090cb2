/// \file wildcat_impl.hpp
/// \brief Internals of effattn/wildcat.hpp: the eq. (12) temperature, per-bin RPNys compression,
/// the error-targeted driver, and the out-of-class definitions of `WildcatAttention`,
/// `CompressedKV::append` and the free functions. The tiled weighted attention with its
/// a-posteriori error bound is in `wildcat_attend.hpp`. Not a public header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/parallel.hpp"
#include "../../core/probe.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../numerics/lambert_w.hpp"
#include "../../numerics/nystrom.hpp"
#include "../../numerics/rp_cholesky.hpp"
#include "../../wildcat.hpp"
#include "wildcat_attend.hpp"

namespace effattn {

namespace wildcat {

inline double rho0() {
  return std::sqrt(1.0 + std::exp(lambert_w0(2.0 * std::exp(-2.0)) + 2.0));
}

inline double temperature_squared(double beta, double q_radius, double k_radius, Index m_bin) {
  EFFATTN_CHECK(std::isfinite(beta) && beta > 0 && std::isfinite(q_radius) && q_radius >= 0 &&
                    std::isfinite(k_radius) && k_radius >= 0 && m_bin >= 1,
                detail::cat("wildcat::temperature_squared: need beta > 0, radii >= 0 (finite) and "
                            "m_bin >= 1; got beta = ",
                            beta, ", R_Q = ", q_radius, ", R_K = ", k_radius, ", m_bin = ", m_bin));
  const double gamma = beta * q_radius * k_radius;
  if (!(gamma > 0)) return 1.0;
  const double b0 = std::log(static_cast<double>(m_bin)) / gamma + 2.0;
  if (!std::isfinite(b0)) return 1.0;
  const double rho = b0 / (2.0 * lambert_w0(b0 / (2.0 * rho0())));
  return k_radius / q_radius * rho;
}

}  // namespace wildcat

namespace detail {

inline void check_wildcat_options(const WildcatOptions& opts, const char* who) {
  const WildcatOptions o = resolve_renamed(opts, who);
  check_scale_option(o.scale, who);
  EFFATTN_CHECK(o.rank >= 1, cat(who, ": Options::rank must be >= 1; got ", o.rank));
  EFFATTN_CHECK(o.bins >= 1, cat(who, ": Options::bins must be >= 1; got ", o.bins));
  EFFATTN_CHECK(o.rel_tol >= 0 && o.rel_tol < 1,
                cat(who, ": Options::rel_tol must be in [0, 1); got ", o.rel_tol));
  EFFATTN_CHECK(std::isfinite(o.q_radius) && o.q_radius >= 0,
                cat(who, ": Options::q_radius must be finite and >= 0; got ", o.q_radius));
  EFFATTN_CHECK(
      std::isfinite(o.denominator_tol) && o.denominator_tol >= 0,
      cat(who, ": Options::denominator_tol must be finite and >= 0; got ", o.denominator_tol));
  EFFATTN_CHECK(o.proposal_block >= 0, cat(who,
                                           ": Options::proposal_block must be >= 0 (0 = "
                                           "automatic); got ",
                                           o.proposal_block));
  EFFATTN_CHECK(is_one_of(o.fallback, {wildcat::Fallback::Zero, wildcat::Fallback::Midpoint}),
                cat(who, ": Options::fallback is not a valid enumerator"));
  EFFATTN_CHECK(std::isfinite(o.target_error) && o.target_error >= 0,
                cat(who, ": Options::target_error must be finite and >= 0; got ", o.target_error));
  EFFATTN_CHECK(o.error_sample_rows >= 1,
                cat(who, ": Options::error_sample_rows must be >= 1; got ", o.error_sample_rows));
}

template <typename Scalar>
void check_kv(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V, const char* who) {
  EFFATTN_CHECK(K.rows() > 0 && K.cols() > 0,
                cat(who, ": K must be m x d with m, d >= 1; got K ", shape(K)));
  EFFATTN_CHECK(V.rows() == K.rows() && V.cols() > 0,
                cat(who, ": V must be m x dv with m = K.rows() = ", K.rows(),
                    " and dv >= 1; got V ", shape(V)));
  check_finite(K, "K");
  check_finite(V, "V");
}

/// How the keys are cut into contiguous bins: `full` bins of `base` keys, plus one remainder bin
/// of m - full * base keys when that is not zero. Every bin gets `per_bin` = ceil(rank / bins)
/// pivots (the remainder bin too, so the coreset can exceed rank by one bin's budget), or all of
/// its keys if it has no more than that (the exact path, w = 1).
struct WildcatBins {
  Index full = 1, base = 0, rem = 0, per_bin = 1;
  Index count() const noexcept { return full + (rem > 0 ? 1 : 0); }
  Index begin(Index b) const noexcept { return b * base; }
  Index size(Index b) const noexcept { return b < full ? base : rem; }
};

inline WildcatBins wildcat_bins(Index m, Index bins, Index rank) {
  WildcatBins p;
  p.full = std::max<Index>(1, std::min(bins, m));  // more bins than keys: one key per bin
  p.base = m / p.full;
  p.rem = m - p.full * p.base;
  p.per_bin = (rank + p.full - 1) / p.full;
  return p;
}

/// The output of one bin (filled in parallel, concatenated in bin order).
template <typename Scalar>
struct WildcatBinOut {
  Matrix<Scalar> keys, values;
  Vector<Scalar> weights, log_scale;
  std::vector<Index> pivots;
  WildcatBlock block;
  bool ok = true;
};

/// Compresses rows [k0, k0 + mb) of the centred keys Kc (double) and of V into `out`.
/// `q_radius` < 0 means R_Q := R_K of the bin (the KV-cache default). Keys are stored in the
/// frame `Kc + shift` (shift = kbar: original units, or 0: the centred frame of the module).
template <typename Rule, typename Scalar>
void wildcat_compress_bin(const Matrix<double>& Kc, const ConstRef<Scalar>& V, Index k0, Index mb,
                          Index per_bin, double beta, double q_radius, const WildcatOptions& o,
                          std::uint64_t seed, const RowVector<double>& shift,
                          WildcatBinOut<Scalar>& out) {
  const Index d = Kc.cols(), dv = V.cols();
  const auto Kbd = Kc.middleRows(k0, mb);  // a view: the kernel copies what it needs
  WildcatBlock& blk = out.block;
  blk.tokens = mb;
  blk.first_token = k0;
  blk.centre = shift.transpose();  // the bin is centred at the global mean: 0 + shift
  blk.key_radius = std::sqrt(row_squared_norms(Kbd).maxCoeff());
  const double rq = q_radius < 0 ? blk.key_radius : q_radius;
  if (mb <= per_bin) {  // exact path: every key kept with weight 1
    blk.exact = true;
    blk.tau2 = 1;
    blk.log_residual_trace = -std::numeric_limits<double>::infinity();
    out.keys = (Kbd.rowwise() + shift).template cast<Scalar>();
    out.values = V.middleRows(k0, mb);
    out.weights = Vector<Scalar>::Ones(mb);
    out.log_scale = Vector<Scalar>::Zero(mb);
    out.pivots.resize(static_cast<std::size_t>(mb));
    for (Index l = 0; l < mb; ++l) out.pivots[static_cast<std::size_t>(l)] = k0 + l;
    return;
  }
  blk.exact = false;
  blk.tau2 = o.temperature ? wildcat::temperature_squared(beta, rq, blk.key_radius, mb) : 1.0;
  RpCholeskyOptions ro;
  ro.rank = per_bin;
  ro.rel_tol = o.rel_tol;
  ro.seed = seed;
  ro.proposal_block = o.proposal_block;
  // The selection runs in Scalar (float for float attention): kernel rows, the factor and its
  // block updates, and the Nystrom product F [diag(e) V | e] are Scalar GEMMs, while RPCholesky
  // keeps its residuals, sampling and traces in double (numerics/rp_cholesky.hpp). Measured
  // (sphere and clustered, n = 4096 / 16384, r = 256 / 1024, 5 seeds): the errors of float
  // selection are those of double selection within the seed spread, at about half the time.
  using Kern = ExpDotKernel<double, Scalar>;
  // tr(H_tau - Hhat_tau) = exp(max sq) * (weighted residual trace of G). Residuals the
  // factorisation zeroed as round-off (<= roundoff_factor eps(Scalar) each, weights <= 1) are
  // added back, so the logged trace bounds the true one.
  const double zeroed = ro.roundoff_factor *
                        static_cast<double>(std::numeric_limits<Scalar>::epsilon()) *
                        static_cast<double>(mb);
  auto log_trace = [&](const Kern& k, const RpCholeskyResult<Scalar>& f) {
    return k.log_trace_scale() + std::log(f.residual_trace.back() + zeroed);
  };
  // h_tau(x, y) = exp(beta <x, y> / tau^2) on the centred keys, in Gaussian coordinates.
  std::optional<Kern> kern(std::in_place, Kbd, beta / blk.tau2);
  RpCholeskyResult<Scalar> rpc = RpCholesky<Rule>(ro).compute(*kern);
  if (o.fit_temperature && rq > 0 && rpc.info == Info::Success) {
    // Data-driven temperature: among tau^2 in {t12, t12 / 2, t12 / 4, t12 / 8, 1} (t12 = the
    // choice above), the one whose Lemma 2 bound on this bin's squared row error,
    // e^{beta tau^2 R_Q^2} tr(H_tau - Hhat_tau), is smallest at the bin's rank (the residual
    // trace alone always prefers larger tau: H_tau tends to rank one).
    double best = beta * blk.tau2 * rq * rq + log_trace(*kern, rpc);
    const double t12 = blk.tau2;
    for (const double t2 : {t12 / 2, t12 / 4, t12 / 8, 1.0}) {
      if (!(t2 > 0) || t2 == t12) continue;
      std::optional<Kern> k2(std::in_place, Kbd, beta / t2);
      RpCholeskyResult<Scalar> f2 = RpCholesky<Rule>(ro).compute(*k2);
      if (f2.info != Info::Success || f2.rank() < 1) continue;
      const double obj = beta * t2 * rq * rq + log_trace(*k2, f2);
      if (obj < best) {
        best = obj;
        blk.tau2 = t2;
        kern.swap(k2);
        rpc = std::move(f2);
      }
    }
  }
  const Index k = rpc.rank();
  out.ok = rpc.info == Info::Success && k >= 1;
  blk.log_residual_trace = log_trace(*kern, rpc);
  if (!out.ok) return;
  // Nystrom weights of h_tau (numerics/nystrom.hpp) in log-scaled form, applied to [V | 1]:
  // rows Wt [V | 1] with Wt(i, l) = W_G(i, l) exp(hs_l - c) and log-scales ell_i = c - hs_{s_i},
  // so nothing overflows whatever the logit range. Only these products are needed, so W itself
  // is never formed: A^{-1} (F [diag(e) V | e]), one (k x m)(m x (dv + 1)) GEMM and a
  // back-substitution instead of the O(k^2 m) solve for W.
  const LogScaledProduct<Scalar> nys =
      detail::exp_dot_log_scaled_product_of(*kern, rpc, V.middleRows(k0, mb), "compress_kv");
  out.values = nys.product.leftCols(dv);
  out.weights = nys.product.col(dv);
  out.log_scale = nys.log_scale;
  out.keys.resize(k, d);
  out.pivots.resize(static_cast<std::size_t>(k));
  for (Index i = 0; i < k; ++i) {
    const Index s = rpc.pivots[static_cast<std::size_t>(i)];
    out.keys.row(i) = (Kbd.row(s) + shift).template cast<Scalar>();
    out.pivots[static_cast<std::size_t>(i)] = k0 + s;
  }
  out.ok = all_finite(out.values) && all_finite(out.weights);
}

/// Compresses the m keys of Kc (centred, double) and values V into coreset rows appended to
/// `ckv` (bins in parallel). Returns false if a bin broke down numerically.
template <typename Rule, typename Scalar>
bool wildcat_compress(const Matrix<double>& Kc, const ConstRef<Scalar>& V, double beta,
                      double q_radius, const WildcatOptions& o, std::uint64_t seed,
                      const RowVector<double>& shift, Index token_offset,
                      CompressedKV<Scalar>& ckv) {
  const Index m = Kc.rows(), d = Kc.cols(), dv = V.cols();
  const WildcatBins plan = wildcat_bins(m, o.bins, o.rank);
  const Index nb = plan.count();
  std::vector<WildcatBinOut<Scalar>> bins(static_cast<std::size_t>(nb));
  auto run = [&](Index b) {
    wildcat_compress_bin<Rule>(Kc, V, plan.begin(b), plan.size(b), plan.per_bin, beta, q_radius, o,
                               derive_seed(seed, static_cast<std::uint64_t>(b)), shift,
                               bins[static_cast<std::size_t>(b)]);
  };
  if (nb == 1)
    run(0);  // a single bin keeps RPCholesky's own parallel tiles
  else
    parallel_for(
        nb, [] { return 0; }, [&](Index b, int&) { run(b); });
  Index add = 0;
  bool ok = true;
  for (const auto& b : bins) {
    add += b.keys.rows();
    ok = ok && b.ok;
  }
  if (!ok) return false;
  Index row = ckv.keys.rows();
  ckv.keys.conservativeResize(row + add, d);
  ckv.values.conservativeResize(row + add, dv);
  ckv.weights.conservativeResize(row + add);
  ckv.log_scale.conservativeResize(row + add);
  for (auto& b : bins) {
    const Index k = b.keys.rows();
    ckv.keys.middleRows(row, k) = b.keys;
    ckv.values.middleRows(row, k) = b.values;
    ckv.weights.segment(row, k) = b.weights;
    ckv.log_scale.segment(row, k) = b.log_scale;
    for (Index p : b.pivots) ckv.pivots.push_back(p + token_offset);
    b.block.row_begin = row;
    b.block.rows = k;
    b.block.first_token += token_offset;
    ckv.blocks.push_back(std::move(b.block));
    row += k;
  }
  return true;
}

/// Compresses K, V (original units) into a fresh CompressedKV whose keys live in the frame
/// K - kbar + (add_back ? kbar : 0). q_radius < 0 means per-bin R_K.
template <typename Rule, typename Scalar>
bool wildcat_compress_all(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V, double beta,
                          double q_radius, const WildcatOptions& o, bool add_back,
                          CompressedKV<Scalar>& ckv) {
  const Index m = K.rows(), d = K.cols(), dv = V.cols();
  RowVector<double> kbar(d);
  Matrix<double> Kc(m, d);
  advise_huge_pages(Kc);
  ckv = CompressedKV<Scalar>();
  ckv.keys.resize(0, d);
  ckv.values.resize(0, dv);
  ckv.vmin.resize(dv);
  ckv.vmax.resize(dv);
  // Column by column in parallel (these O(m (d + dv)) passes were serial: about 5% of WildCat's
  // time at n = 65536); each column is computed the same way on any thread.
  parallel_for(
      std::max(d, dv), [] { return 0; },
      [&](Index c, int&) {
        if (c < d) {
          kbar(c) = K.col(c).template cast<double>().mean();
          Kc.col(c) = K.col(c).template cast<double>().array() - kbar(c);
        }
        if (c < dv) {
          ckv.vmin(c) = V.col(c).minCoeff();
          ckv.vmax(c) = V.col(c).maxCoeff();
        }
      });
  const bool ok = wildcat_compress<Rule, Scalar>(
      Kc, V, beta, q_radius, o, o.seed, add_back ? kbar : RowVector<double>::Zero(d), 0, ckv);
  ckv.tokens = m;
  ckv.tail_begin = ckv.size();
  return ok;
}

/// WildCat with an error target (Options::target_error > 0; see there): compress with a
/// residual-trace tolerance, estimate the relative Frobenius error on sampled query rows against
/// their exact attention, tighten and recompress until the estimate meets the target (or the
/// budget / round limit is reached), then attend with every query. Returns false on a failed
/// compression.
template <typename Rule, typename Scalar>
bool wildcat_compute_targeted(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                              const ConstRef<Scalar>& V, double beta, double rq,
                              const WildcatOptions& o, CompressedKV<Scalar>& ckv,
                              WildcatResult<Scalar>& res) {
  const Index n = Q.rows();
  const Index s = std::min(n, o.error_sample_rows);
  // The sampled rows and their exact attention: core/probe.hpp (shared with AutoAttention).
  const std::vector<Index> rows = sample_rows(n, s, o.seed, 0x7a26e7ULL);
  const Matrix<Scalar> Qs = gather_rows<Scalar>(Q, rows);
  const Matrix<double> exact = exact_rows<Scalar>(Qs, rows, n, K, V, beta, false);
  const double ref = std::max(exact.norm(), std::numeric_limits<double>::min());
  constexpr int kMaxRounds = 4;
  WildcatOptions oi = o;
  oi.rel_tol = o.rel_tol > 0 ? o.rel_tol : std::clamp(o.target_error, 1e-15, 0.5);
  const Index per_bin = wildcat_bins(K.rows(), o.bins, o.rank).per_bin;
  Index last_rank = -1;
  for (int round = 1; round <= kMaxRounds; ++round) {
    if (!wildcat_compress_all<Rule, Scalar>(K, V, beta, rq, oi, false, ckv)) return false;
    bool capped = true;  // every bin used its whole budget (or is kept exactly)
    for (const WildcatBlock& b : ckv.blocks) capped = capped && (b.exact || b.rows >= per_bin);
    WildcatResult<Scalar> probe;
    wildcat_attend<Scalar>(ConstRef<Scalar>(Qs), ckv, beta, oi, probe);
    const double est = (probe.output.template cast<double>() - exact).norm() / ref;
    res.estimated_error = std::isfinite(est) ? est : std::numeric_limits<double>::infinity();
    res.target_rel_tol = oi.rel_tol;
    res.target_rounds = round;
    if (res.estimated_error <= o.target_error || capped || ckv.size() == last_rank) break;
    last_rank = ckv.size();
    const double ratio = o.target_error / res.estimated_error;
    oi.rel_tol *= std::clamp(0.5 * ratio * ratio, 1e-4, 0.5);
  }
  return true;
}

}  // namespace detail

// ---- CompressedKV ----

template <typename Scalar>
void CompressedKV<Scalar>::append(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V) {
  EFFATTN_CHECK(K.rows() == V.rows() && K.cols() == keys.cols() && V.cols() == values.cols(),
                detail::cat("CompressedKV::append: need K t x ", keys.cols(), " and V t x ",
                            values.cols(), "; got K ", detail::shape(K), ", V ", detail::shape(V)));
  detail::check_finite(K, "K");
  detail::check_finite(V, "V");
  const Index r = size(), t = K.rows();
  keys.conservativeResize(r + t, Eigen::NoChange);
  values.conservativeResize(r + t, Eigen::NoChange);
  weights.conservativeResize(r + t);
  log_scale.conservativeResize(r + t);
  keys.bottomRows(t) = K;
  values.bottomRows(t) = V;
  weights.tail(t).setOnes();
  log_scale.tail(t).setZero();
  for (Index j = 0; j < t; ++j) pivots.push_back(tokens + j);
  tokens += t;
  if (t > 0) {
    vmin = vmin.cwiseMin(V.colwise().minCoeff());
    vmax = vmax.cwiseMax(V.colwise().maxCoeff());
  }
}

// ---- WildcatAttention ----

template <typename Scalar_, typename PivotRule>
WildcatAttention<Scalar_, PivotRule>::WildcatAttention(Options opts)
    : m_opts(detail::resolve_renamed(opts, "WildcatAttention")) {
  detail::check_wildcat_options(m_opts, "WildcatAttention");
}

template <typename Scalar_, typename PivotRule>
WildcatResult<Scalar_> WildcatAttention<Scalar_, PivotRule>::compute(const Ref& Q, const Ref& K,
                                                                     const Ref& V) const {
  detail::check_attention_inputs(Q, K, V, "WildcatAttention");
  const double beta = detail::resolve_scale(m_opts.scale, Q.cols());
  const double rq =
      m_opts.q_radius > 0 ? m_opts.q_radius : std::sqrt(detail::row_squared_norms(Q).maxCoeff());
  CompressedKV<Scalar> ckv;
  Result res;
  const bool ok =
      m_opts.target_error > 0
          ? detail::wildcat_compute_targeted<PivotRule, Scalar>(Q, K, V, beta, rq, m_opts, ckv, res)
          : detail::wildcat_compress_all<PivotRule, Scalar>(K, V, beta, rq, m_opts, false, ckv);
  if (!ok) {
    // NaN, not zeros: a zero row is finite and outside V's range, so it could pass for a result
    // (found by fuzz_wildcat; regression test "WildCat reports a failed compression as NaN").
    res.output =
        Matrix<Scalar>::Constant(Q.rows(), V.cols(), std::numeric_limits<Scalar>::quiet_NaN());
    res.info = Info::NumericalIssue;
    return res;
  }
  detail::wildcat_attend<Scalar>(Q, ckv, beta, m_opts, res);
  res.rank = ckv.size();
  res.bins = static_cast<Index>(ckv.blocks.size());
  res.pivots = std::move(ckv.pivots);
  res.blocks = std::move(ckv.blocks);
  return res;
}

template <typename Scalar_, typename PivotRule>
CompressedKV<Scalar_> WildcatAttention<Scalar_, PivotRule>::compress_kv(const Ref& K, const Ref& V,
                                                                        double q_radius) const {
  EFFATTN_CHECK(std::isfinite(q_radius) && q_radius >= 0,
                detail::cat("compress_kv: q_radius must be finite and >= 0; got ", q_radius));
  detail::check_kv<Scalar>(K, V, "compress_kv");
  const double beta = detail::resolve_scale(m_opts.scale, K.cols());
  CompressedKV<Scalar> ckv;
  if (!detail::wildcat_compress_all<PivotRule, Scalar>(K, V, beta, q_radius > 0 ? q_radius : -1,
                                                       m_opts, true, ckv))
    ckv = CompressedKV<Scalar>();
  return ckv;
}

template <typename Scalar_, typename PivotRule>
WildcatResult<Scalar_> WildcatAttention<Scalar_, PivotRule>::weighted_attention(
    const Ref& Q, const CompressedKV<Scalar>& ckv) const {
  EFFATTN_CHECK(ckv.size() > 0, "weighted_attention: the compressed cache is empty");
  EFFATTN_CHECK(Q.rows() > 0 && Q.cols() == ckv.keys.cols(),
                detail::cat("weighted_attention: Q must be n x d with n >= 1 and d = ",
                            ckv.keys.cols(), "; got Q ", detail::shape(Q)));
  detail::check_finite(Q, "Q");
  Result res;
  detail::wildcat_attend<Scalar>(Q, ckv, detail::resolve_scale(m_opts.scale, Q.cols()), m_opts,
                                 res);
  res.pivots = ckv.pivots;
  res.rank = ckv.size();
  res.bins = static_cast<Index>(ckv.blocks.size());
  res.blocks = ckv.blocks;
  return res;
}

template <typename Scalar_, typename PivotRule>
bool WildcatAttention<Scalar_, PivotRule>::recompress_tail(CompressedKV<Scalar>& ckv,
                                                           double q_radius) const {
  EFFATTN_CHECK(std::isfinite(q_radius) && q_radius >= 0,
                detail::cat("recompress_tail: q_radius must be finite and >= 0; got ", q_radius));
  const Index t = ckv.tail_size();
  if (t == 0) return true;
  const Index t0 = ckv.tail_begin, d = ckv.keys.cols();
  const Matrix<Scalar> Vt = ckv.values.bottomRows(t);
  const RowVector<double> kbar = ckv.keys.bottomRows(t).template cast<double>().colwise().mean();
  const Matrix<double> Kc = ckv.keys.bottomRows(t).template cast<double>().rowwise() - kbar;
  const Index first = ckv.pivots[static_cast<std::size_t>(t0)];
  CompressedKV<Scalar> piece;
  piece.keys.resize(0, d);
  piece.values.resize(0, Vt.cols());
  const std::uint64_t seed = derive_seed(m_opts.seed, 0x7a11ULL + ckv.blocks.size());
  if (!detail::wildcat_compress<PivotRule, Scalar>(Kc, Vt, detail::resolve_scale(m_opts.scale, d),
                                                   q_radius > 0 ? q_radius : -1, m_opts, seed, kbar,
                                                   first, piece))
    return false;
  const Index k = piece.size();
  ckv.keys.conservativeResize(t0 + k, Eigen::NoChange);
  ckv.values.conservativeResize(t0 + k, Eigen::NoChange);
  ckv.weights.conservativeResize(t0 + k);
  ckv.log_scale.conservativeResize(t0 + k);
  ckv.keys.bottomRows(k) = piece.keys;
  ckv.values.bottomRows(k) = piece.values;
  ckv.weights.tail(k) = piece.weights;
  ckv.log_scale.tail(k) = piece.log_scale;
  ckv.pivots.resize(static_cast<std::size_t>(t0));
  ckv.pivots.insert(ckv.pivots.end(), piece.pivots.begin(), piece.pivots.end());
  for (WildcatBlock& b : piece.blocks) {
    b.row_begin += t0;
    ckv.blocks.push_back(std::move(b));
  }
  ckv.tail_begin = ckv.size();
  return true;
}

// ---- Free functions ----

template <typename PivotRule, typename DK, typename DV>
CompressedKV<typename DK::Scalar> compress_kv(const Eigen::MatrixBase<DK>& K,
                                              const Eigen::MatrixBase<DV>& V, double q_radius,
                                              const WildcatOptions& opts) {
  using Scalar = typename DK::Scalar;
  static_assert(
      detail::is_supported_scalar_v<Scalar> && std::is_same_v<Scalar, typename DV::Scalar>,
      "effattn: compress_kv needs K and V of the same scalar, float or double");
  detail::check_wildcat_options(opts, "compress_kv");
  return WildcatAttention<Scalar, PivotRule>(opts).compress_kv(ConstRef<Scalar>(K),
                                                               ConstRef<Scalar>(V), q_radius);
}

template <typename PivotRule, typename Scalar>
bool recompress_tail(CompressedKV<Scalar>& ckv, double q_radius, const WildcatOptions& opts) {
  detail::check_wildcat_options(opts, "recompress_tail");
  return WildcatAttention<Scalar, PivotRule>(opts).recompress_tail(ckv, q_radius);
}

template <typename DQ>
WildcatResult<typename DQ::Scalar> weighted_attention(const Eigen::MatrixBase<DQ>& Q,
                                                      const CompressedKV<typename DQ::Scalar>& ckv,
                                                      const WildcatOptions& opts) {
  using Scalar = typename DQ::Scalar;
  detail::check_wildcat_options(opts, "weighted_attention");
  return WildcatAttention<Scalar>(opts).weighted_attention(ConstRef<Scalar>(Q), ckv);
}

}  // namespace effattn
