/// \file wildcat_impl.hpp
/// \brief Internals of effattn/wildcat.hpp: per-bin RPNys compression and the tiled weighted
/// attention with its a-posteriori error bound. Not a public header.
#pragma once

#ifndef EFFATTN_WILDCAT_INTERNAL
#error "Include effattn/wildcat.hpp instead of effattn/detail/wildcat_impl.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace effattn {
namespace detail {

/// How the keys are cut into contiguous bins (spec 2.7 and pitfall 11): `full` bins of `base`
/// keys, plus one remainder bin of m - full * base keys when that is not zero. Every bin gets
/// `per_bin` = ceil(rank / bins) pivots (the remainder bin too), or all of its keys if it has no
/// more than that (the exact path, w = 1).
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
  const auto Kb = Kc.middleRows(k0, mb);
  const Matrix<double> Kbd = Kb;
  WildcatBlock& blk = out.block;
  blk.tokens = mb;
  blk.first_token = k0;
  blk.centre = shift.transpose();  // the bin is centred at the global mean: 0 + shift
  blk.key_radius = std::sqrt(Kbd.rowwise().squaredNorm().maxCoeff());
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
  // h_tau(x, y) = exp(beta <x, y> / tau^2) on the centred keys, in Gaussian coordinates.
  const ExpDotKernel<double, double> kern(Kbd, beta / blk.tau2);
  RpCholeskyOptions ro;
  ro.rank = per_bin;
  ro.rel_tol = o.rel_tol;
  ro.seed = seed;
  ro.block_size = o.block_size;
  RpCholeskyResult<double> rpc = RpCholesky<Rule>(ro).compute(kern);
  const Index k = rpc.rank();
  out.ok = rpc.info == Info::Success && k >= 1;
  // tr(H_tau - Hhat_tau) = exp(max sq) * (weighted residual trace of G). Residuals the
  // factorisation zeroed as round-off (<= 100 eps each, weights <= 1) are added back, so the
  // logged trace bounds the true one.
  const double zeroed =
      ro.roundoff_factor * std::numeric_limits<double>::epsilon() * static_cast<double>(mb);
  blk.log_residual_trace = kern.log_trace_scale() + std::log(rpc.residual_trace.back() + zeroed);
  if (!out.ok) return;
  // Nystrom weights W_G = A^{-1} F (A = F(:, S), upper triangular; spec 2.4) in the log-scaled
  // form Wt(i, l) = W_G(i, l) exp(hs_l - c), ell_i = c - hs_{s_i} (spec 2.8: nothing overflows).
  // Only Wt [V | 1] is needed, so it is formed as A^{-1} (F [diag(e) V | e]) with
  // e_l = exp(hs_l - c) in (0, 1]: one (k x m)(m x (dv + 1)) GEMM and a k x (dv + 1)
  // back-substitution instead of the O(k^2 m) solve for W itself (same triangular system).
  const RowMajorMatrix<double>& F = rpc.factor;
  Matrix<double> A(k, k);
  for (Index j = 0; j < k; ++j) A.col(j) = F.col(rpc.pivots[static_cast<std::size_t>(j)]);
  const Vector<double>& hs = kern.half_sq_norms();
  const double c = hs.maxCoeff();
  Matrix<double> Ve(mb, dv + 1);
  Ve.col(dv) = (hs.array() - c).exp().matrix();
  Ve.leftCols(dv) = Ve.col(dv).asDiagonal() * V.middleRows(k0, mb).template cast<double>();
  // Row chunks of F inside one parallel region: each chunk is a serial GEMM whose blocking does
  // not depend on the thread count (a threaded Eigen GEMM picks its k-blocking from the thread
  // count, which changes the summation order and hence the bits).
  Matrix<double> X(k, dv + 1);
  constexpr Index kRows = 32;
  parallel_for((k + kRows - 1) / kRows, [] { return 0; },
               [&](Index t, int&) {
                 const Index i0 = t * kRows, rows = std::min(kRows, k - i0);
                 X.middleRows(i0, rows).noalias() = F.middleRows(i0, rows) * Ve;
               });
  A.template triangularView<Eigen::Upper>().solveInPlace(X);
  out.values = X.leftCols(dv).template cast<Scalar>();
  out.weights = X.col(dv).template cast<Scalar>();
  out.log_scale.resize(k);
  out.keys.resize(k, d);
  out.pivots.resize(static_cast<std::size_t>(k));
  for (Index i = 0; i < k; ++i) {
    const Index s = rpc.pivots[static_cast<std::size_t>(i)];
    out.log_scale(i) = static_cast<Scalar>(c - hs(s));
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

/// Per-call state of the weighted attention (read-only in the parallel loop).
template <typename Scalar>
struct WtdContext {
  Matrix<Scalar> ks;           // r x d: beta * keys
  Matrix<Scalar> augT;         // (dv + 2) x r: [values | w | |w|]^T
  Vector<Scalar> ell;          // r log-scales
  Vector<Scalar> lo, hi, mid;  // dv clip range and its midpoint
  double range = 0, vmax_abs = 0;
  Matrix<double> centresT;            // d x blocks (block centres), or empty when all are 0
  RowVector<double> radius;           // R_K per block
  std::vector<Index> inexact;         // compressed (non-exact) blocks
  RowVector<double> tau2, log_trace;  // per compressed block
  Index tail_begin = 0;               // rows >= this are exact appended tokens
  double beta = 0, log_m = 0, tol = 0;
  Index dv = 0;
};

constexpr Index kWtdTile = 128;  // queries per task

/// Workspace of one thread.
template <typename Scalar>
struct WtdWorkspace {
  Matrix<Scalar> Z, N, O;
  Matrix<double> C, Lmin, L;
  WtdWorkspace(Index r, Index dv, Index nblocks, Index ninexact)
      : Z(r, kWtdTile),
        N(dv + 2, kWtdTile),
        O(dv, kWtdTile),
        C(kWtdTile, nblocks),
        Lmin(kWtdTile, nblocks),
        L(kWtdTile, ninexact) {}
};

/// Rows [i0, i0 + t) of the weighted attention (spec 2.8) and of the row error bounds.
template <typename Scalar>
void wtd_tile(const WtdContext<Scalar>& cx, const ConstRef<Scalar>& Q, const WildcatOptions& o,
              Index i0, Index t, WtdWorkspace<Scalar>& ws, Matrix<Scalar>& out,
              Vector<double>& row_bound, Vector<unsigned char>& fell_back) {
  const Index r = cx.ks.rows(), dv = cx.dv;
  auto Z = ws.Z.leftCols(t);
  auto N = ws.N.leftCols(t);
  Z.noalias() = cx.ks * Q.middleRows(i0, t).transpose();  // r x t logits
  Z.colwise() += cx.ell;
  const bool tail = cx.tail_begin < r;
  Vector<double> tail_min(t);
  for (Index j = 0; j < t; ++j) {
    auto z = Z.col(j);
    if (tail) tail_min(j) = static_cast<double>(z.tail(r - cx.tail_begin).minCoeff());
    const Scalar mx = z.maxCoeff();
    z = (z.array() - mx).exp();  // max-shifted: every entry in (0, 1]
  }
  N.noalias() = cx.augT * Z;  // (dv + 2) x t: numerators, denominator, |w|-denominator
  if (cx.centresT.size() > 0)
    ws.C.topRows(t).noalias() = Q.middleRows(i0, t).template cast<double>() * cx.centresT;
  const Vector<double> qnorm = Q.middleRows(i0, t).template cast<double>().rowwise().norm();
  auto O = ws.O.leftCols(t);
  for (Index j = 0; j < t; ++j) {
    const Scalar den = N(dv, j), absden = N(dv + 1, j);
    if (den > static_cast<Scalar>(cx.tol) * absden && den > Scalar(0)) {
      O.col(j) = N.col(j).head(dv) / den;
      fell_back(i0 + j) = 0;
    } else {
      fell_back(i0 + j) = 1;
      if (o.fallback == wildcat::Fallback::Midpoint)
        O.col(j) = cx.mid;
      else
        O.col(j).setZero();
    }
    if (o.clip) O.col(j) = O.col(j).cwiseMax(cx.lo).cwiseMin(cx.hi);
  }
  out.middleRows(i0, t) = O.transpose();
  // Error bound (Lemmas 1 + 2, rows independently; see WildcatResult::error_bound), vectorised
  // over blocks. L(j, k): log of compressed block k's bound on ||a_k - ahat_k||_2^2 (uncentred
  // frame: a_k = e^{beta <q, c_k>} times the centred row, whose squared error Lemma 2 bounds by
  // e^{beta tau_k^2 |q|^2} tr_k); min_l a_l >= e^{beta (<q, c_b> - |q| R_b)} over block b's keys.
  auto C = ws.C.topRows(t);
  if (cx.centresT.size() == 0) C.setZero();
  auto Lmin = ws.Lmin.topRows(t);
  Lmin.noalias() = qnorm * cx.radius;
  Lmin = cx.beta * (C - Lmin);
  Vector<double> log_min = Lmin.rowwise().minCoeff();
  if (tail) log_min = log_min.cwiseMin(tail_min);
  const Index ni = static_cast<Index>(cx.inexact.size());
  Vector<double> log_e2 = Vector<double>::Constant(t, -std::numeric_limits<double>::infinity());
  if (ni > 0) {
    auto L = ws.L.topRows(t);
    const Vector<double> bq2 = cx.beta * qnorm.cwiseAbs2();
    for (Index k = 0; k < ni; ++k)
      L.col(k) = (2 * cx.beta) * C.col(cx.inexact[static_cast<std::size_t>(k)]) + cx.tau2(k) * bq2 +
                 Vector<double>::Constant(t, cx.log_trace(k));
    const Vector<double> mx = L.rowwise().maxCoeff();  // finite: every log_trace is finite
    log_e2 = mx.array() + (L.colwise() - mx).array().exp().rowwise().sum().log();
  }
  for (Index j = 0; j < t; ++j) {
    // x >= ||a - ahat||_1 / (a 1): ||e||_1 <= sqrt(m) ||e||_2 and a 1 >= m min_l a_l.
    const double x = std::exp(0.5 * log_e2(j) - 0.5 * cx.log_m - log_min(j));
    double bound = x < 1 ? cx.range * x / (1 - x) : std::numeric_limits<double>::infinity();
    if (o.clip) bound = std::min({bound, cx.range, cx.vmax_abs * 3 * x});
    row_bound(i0 + j) = bound;
  }
}

/// Weighted attention of Q over the rows of `ckv` (spec 2.8, WtdAttn) into `res`.
template <typename Scalar>
void wildcat_attend(const ConstRef<Scalar>& Q, const CompressedKV<Scalar>& ckv, double beta,
                    const WildcatOptions& o, WildcatResult<Scalar>& res) {
  const Index n = Q.rows(), r = ckv.size(), dv = ckv.values.cols();
  WtdContext<Scalar> cx;
  cx.beta = beta;
  cx.dv = dv;
  cx.tol = o.denominator_tol;
  cx.tail_begin = ckv.tail_begin;
  cx.log_m = std::log(static_cast<double>(std::max<Index>(1, ckv.tokens)));
  cx.ks = ckv.keys * static_cast<Scalar>(beta);
  cx.ell = ckv.log_scale;
  cx.lo = ckv.vmin.transpose();
  cx.hi = ckv.vmax.transpose();
  cx.mid = (cx.lo + cx.hi) * Scalar(0.5);
  cx.range = static_cast<double>((cx.hi - cx.lo).maxCoeff());
  cx.vmax_abs =
      static_cast<double>(std::max(cx.hi.cwiseAbs().maxCoeff(), cx.lo.cwiseAbs().maxCoeff()));
  cx.augT.resize(dv + 2, r);
  cx.augT.topRows(dv) = ckv.values.transpose();
  cx.augT.row(dv) = ckv.weights.transpose();
  cx.augT.row(dv + 1) = ckv.weights.cwiseAbs().transpose();
  const Index nb = static_cast<Index>(ckv.blocks.size());
  bool centred = true;
  for (const auto& b : ckv.blocks) centred = centred && (b.centre.array() == 0.0).all();
  if (!centred) {
    cx.centresT.resize(ckv.keys.cols(), nb);
    for (Index b = 0; b < nb; ++b)
      cx.centresT.col(b) = ckv.blocks[static_cast<std::size_t>(b)].centre;
  }
  cx.radius.resize(nb);
  std::vector<double> tau2, log_trace;
  for (Index b = 0; b < nb; ++b) {
    const WildcatBlock& blk = ckv.blocks[static_cast<std::size_t>(b)];
    cx.radius(b) = blk.key_radius;
    if (blk.exact) continue;
    cx.inexact.push_back(b);
    tau2.push_back(blk.tau2);
    log_trace.push_back(blk.log_residual_trace);
  }
  const auto ni = static_cast<Index>(cx.inexact.size());
  cx.tau2 = Eigen::Map<const RowVector<double>>(tau2.data(), ni);
  cx.log_trace = Eigen::Map<const RowVector<double>>(log_trace.data(), ni);
  res.output.resize(n, dv);
  res.row_error_bound.resize(n);
  Vector<unsigned char> fell(n);
  const Index tasks = (n + kWtdTile - 1) / kWtdTile;
  parallel_for(
      tasks, [&] { return WtdWorkspace<Scalar>(r, dv, std::max<Index>(nb, 1), ni); },
      [&](Index task, WtdWorkspace<Scalar>& ws) {
        const Index i0 = task * kWtdTile;
        wtd_tile(cx, Q, o, i0, std::min(kWtdTile, n - i0), ws, res.output, res.row_error_bound,
                 fell);
      });
  res.fallback_rows = fell.template cast<Index>().sum();
  res.error_bound = n > 0 ? res.row_error_bound.maxCoeff() : 0.0;
  res.info = all_finite(res.output) ? Info::Success : Info::NumericalIssue;
}

}  // namespace detail
}  // namespace effattn
