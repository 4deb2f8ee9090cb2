/// \file wildcat_impl.hpp
/// \brief Internals of effattn/wildcat.hpp: the eq. (12) temperature, per-bin RPNys compression,
/// the tiled weighted attention with its a-posteriori error bound, and the out-of-class
/// definitions of `WildcatAttention`, `CompressedKV::append` and the free functions. Not a public
/// header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/checks.hpp"
#include "../core/errors.hpp"
#include "../core/gemm.hpp"
#include "../core/parallel.hpp"
#include "../core/probe.hpp"
#include "../core/random.hpp"
#include "../core/types.hpp"
#include "../numerics/lambert_w.hpp"
#include "../numerics/nystrom.hpp"
#include "../numerics/rp_cholesky.hpp"
#include "../wildcat.hpp"
#include "bf16_avx512.hpp"
#include "bf16_pack.hpp"

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

inline void check_wildcat_options(const WildcatOptions& o, const char* who) {
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
  EFFATTN_CHECK(o.block_size >= 0,
                cat(who, ": Options::block_size must be >= 0 (0 = automatic); got ", o.block_size));
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
  ro.block_size = o.block_size;
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
  // bf16 coreset attention (Options::bf16_attention, float only): the operands rounded once.
  bool bf16 = false;
  Isa isa = Isa::Generic;
#if EFFATTN_BF16_X86
  Bf16Panels panels;  // AVX512-BF16: beta Q, keys, values in the kernels' layouts
#endif
  // Portable path: bf16(beta Q) (row-major), bf16(keys)^T and bf16(values) widened to float,
  // multiplied by `gemm<Op::T>` with the row-major operand transposed (the product RP-Cholesky
  // already instantiates).
  RowMajorMatrix<float> qr;
  Matrix<float> kt, vr;
  Vector<float> w, absw;  // weights and |weights| (fp32 denominators)
};

constexpr Index kWtdTile = 128;  // queries per task

/// Workspace of one thread (`bf16`: the tiles of the bf16 path instead of Z, N, O).
template <typename Scalar>
struct WtdWorkspace {
  Matrix<Scalar> Z, N, O;
  Matrix<double> C, Lmin, L;
  Matrix<float> S, acc, den;  // bf16 path: kWtdTile x rpad scores / P, kWtdTile x dvpad, x 2
  Bf16Buffer pv;              // bf16 path (AVX512-BF16): P in VNNI pairs
  RowMajorMatrix<float> Pr;   // bf16 path (portable): the rounded P, row-major
  WtdWorkspace(Index r, Index dv, Index nblocks, Index ninexact, bool bf16)
      : Z(bf16 ? 0 : r, kWtdTile),
        N(bf16 ? 0 : dv + 2, kWtdTile),
        O(bf16 ? 0 : dv, kWtdTile),
        C(kWtdTile, nblocks),
        Lmin(kWtdTile, nblocks),
        L(kWtdTile, ninexact) {
    if (!bf16) return;
    S.resize(kWtdTile, round_up(r, 32));
    acc.resize(kWtdTile, round_up(dv, 32));
    den.resize(kWtdTile, 2);
    pv.resize(kWtdTile * round_up(r, 32));
  }
};

/// The bf16 path of `wtd_tile` (Scalar = float): S = bf16(beta Q_t) bf16(K_S)^T + ell (fp32
/// accumulation; t x r, queries as rows, the layout of the TiledBf16 kernels), P = exp(S - max)
/// per row in fp32, P [w, |w|] in fp32, then bf16(P) bf16(V_S) accumulated in fp32. Sets
/// tail_min (the smallest logit of the exact tail per row, when there is one).
template <typename Scalar>
void wtd_products_bf16(const WtdContext<Scalar>& cx, const WildcatOptions& o, Index i0, Index t,
                       WtdWorkspace<Scalar>& ws, Matrix<Scalar>& out, Vector<double>& tail_min,
                       Vector<unsigned char>& fell_back) {
  if constexpr (std::is_same_v<Scalar, float>) {
    const Index r = cx.ell.size(), dv = cx.dv, ld = kWtdTile;
    const Index tp = round_up(t, 32), rp = round_up(r, 32);
    float* s = ws.S.data();
#if EFFATTN_BF16_X86
    if (cx.isa != Isa::Generic) avx512_scores(cx.panels, i0 / 16, 0, tp, rp, s, ld);
#endif
    if (cx.isa == Isa::Generic)
      gemm<Op::T>(Update::Assign, ws.S.topLeftCorner(t, r), cx.qr.middleRows(i0, t).transpose(),
                  cx.kt);
    auto S = ws.S.topLeftCorner(t, r);
    Vector<float> mx = Vector<float>::Constant(t, -std::numeric_limits<float>::infinity());
    for (Index j = 0; j < r; ++j) {
      S.col(j).array() += cx.ell(j);
      mx = mx.cwiseMax(S.col(j));
    }
    if (cx.tail_begin < r) {
      Vector<float> tm = S.col(cx.tail_begin);
      for (Index j = cx.tail_begin + 1; j < r; ++j) tm = tm.cwiseMin(S.col(j));
      tail_min = tm.template cast<double>();
    }
    // P = exp(S - max) and the fp32 denominators P w, P |w| from the unrounded P, column by
    // column (vectorised along the queries; no product expression to instantiate).
    auto D = ws.den.topRows(t);
    D.setZero();
    for (Index j = 0; j < r; ++j) {
      S.col(j) = (S.col(j) - mx).array().exp().matrix();
      D.col(0) += cx.w(j) * S.col(j);
      D.col(1) += cx.absw(j) * S.col(j);
    }
    auto A = ws.acc.topLeftCorner(tp, round_up(dv, 32));
    A.setZero();
#if EFFATTN_BF16_X86
    if (cx.isa != Isa::Generic) {
      // Padded query rows of the tile hold raw scores (finite); their accumulator rows are unused.
      pack_p_vnni(s, ld, tp, r, rp, ws.pv.data());
      avx512_accumulate(cx.panels, 0, tp, rp, ws.pv.data(), ws.acc.data(), ld);
    }
#endif
    if (cx.isa == Isa::Generic) {
      round_tile_to_bf16(s, ld, t, r);
      ws.Pr = S;
      gemm<Op::T>(Update::Assign, ws.acc.topLeftCorner(t, dv), ws.Pr.transpose(), cx.vr);
    }
    // O = acc / den per row, with the fallback and clipping of the fp32 path, column by column
    // (contiguous in the column-major tile and output).
    Vector<float> inv(t);
    for (Index j = 0; j < t; ++j) {
      const bool ok = D(j, 0) > static_cast<float>(cx.tol) * D(j, 1) && D(j, 0) > 0.0f;
      fell_back(i0 + j) = ok ? 0 : 1;
      inv(j) = ok ? 1.0f / D(j, 0) : 0.0f;
    }
    auto O = ws.acc.topLeftCorner(t, dv);
    O.array().colwise() *= inv.array();
    if (o.fallback == wildcat::Fallback::Midpoint)
      for (Index j = 0; j < t; ++j)
        if (fell_back(i0 + j)) O.row(j) = cx.mid.transpose();
    for (Index c = 0; c < dv; ++c) {
      if (o.clip) O.col(c) = O.col(c).cwiseMax(cx.lo(c)).cwiseMin(cx.hi(c));
      out.col(c).segment(i0, t) = O.col(c);
    }
  } else {
    (void)cx, (void)o, (void)i0, (void)t, (void)ws, (void)out, (void)tail_min, (void)fell_back;
  }
}

/// Rows [i0, i0 + t) of the weighted attention (paper Alg. 3) and of the row error bounds.
template <typename Scalar>
void wtd_tile(const WtdContext<Scalar>& cx, const ConstRef<Scalar>& Q, const WildcatOptions& o,
              Index i0, Index t, WtdWorkspace<Scalar>& ws, Matrix<Scalar>& out,
              Vector<double>& row_bound, Vector<unsigned char>& fell_back) {
  const Index r = cx.ell.size(), dv = cx.dv;
  const bool tail = cx.tail_begin < r;
  Vector<double> tail_min(t);
  if (cx.bf16) {
    wtd_products_bf16<Scalar>(cx, o, i0, t, ws, out, tail_min, fell_back);
  } else {
    auto Z = ws.Z.leftCols(t);
    auto N = ws.N.leftCols(t);
    gemm<Op::N, Op::T>(Update::Assign, Z, cx.ks, Q.middleRows(i0, t));  // r x t logits
    Z.colwise() += cx.ell;
    for (Index j = 0; j < t; ++j) {
      auto z = Z.col(j);
      if (tail) tail_min(j) = static_cast<double>(z.tail(r - cx.tail_begin).minCoeff());
      const Scalar mx = z.maxCoeff();
      z = (z.array() - mx).exp();  // max-shifted: every entry in (0, 1]
    }
    gemm(Update::Assign, N, cx.augT, Z);  // (dv + 2) x t: numerators, denominator, |w|-denominator
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
  }
  if (cx.centresT.size() > 0)
    gemm(Update::Assign, ws.C.topRows(t), as_double(Q.middleRows(i0, t)), cx.centresT);
  const Vector<double> qnorm = row_squared_norms(Q.middleRows(i0, t)).cwiseSqrt();
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

/// Weighted attention of Q over the rows of `ckv` (paper Alg. 3, WtdAttn) into `res`.
/// `bf16_isa`: the kernel path of Options::bf16_attention (tests force Isa::Generic with it).
template <typename Scalar>
void wildcat_attend(const ConstRef<Scalar>& Q, const CompressedKV<Scalar>& ckv, double beta,
                    const WildcatOptions& o, WildcatResult<Scalar>& res,
                    Isa bf16_isa = selected_isa()) {
  const Index n = Q.rows(), r = ckv.size(), dv = ckv.values.cols();
  WtdContext<Scalar> cx;
  cx.beta = beta;
  cx.dv = dv;
  cx.tol = o.denominator_tol;
  cx.tail_begin = ckv.tail_begin;
  cx.log_m = std::log(static_cast<double>(std::max<Index>(1, ckv.tokens)));
  cx.ell = ckv.log_scale;
  if constexpr (std::is_same_v<Scalar, float>) cx.bf16 = o.bf16_attention;
  if (cx.bf16) {
    // The operands rounded to bf16 once per call (O((n + r) d)); beta folded into Q as in
    // TiledBf16. AVX512-BF16 (also on AMX machines: the WtdAttn tiles are too small for AMX's
    // tile setup to pay) or the portable path, as EFFATTN_ISA selects.
    cx.isa = EFFATTN_BF16_X86 && bf16_isa != Isa::Generic && isa_available(bf16_isa)
                 ? Isa::Avx512Bf16
                 : Isa::Generic;
    cx.w = ckv.weights.template cast<float>();
    cx.absw = cx.w.cwiseAbs();
    if constexpr (std::is_same_v<Scalar, float>) {
#if EFFATTN_BF16_X86
      if (cx.isa != Isa::Generic)
        pack_bf16_panels<float>(Q, ckv.keys, ckv.values, static_cast<float>(beta), cx.panels);
#endif
      if (cx.isa == Isa::Generic)
        round_to_bf16_floats<float>(Q, ckv.keys, ckv.values, static_cast<float>(beta), cx.qr, cx.kt,
                                    cx.vr);
    }
  } else {
    cx.ks = ckv.keys * static_cast<Scalar>(beta);
  }
  cx.lo = ckv.vmin.transpose();
  cx.hi = ckv.vmax.transpose();
  cx.mid = (cx.lo + cx.hi) * Scalar(0.5);
  cx.range = static_cast<double>((cx.hi - cx.lo).maxCoeff());
  cx.vmax_abs =
      static_cast<double>(std::max(cx.hi.cwiseAbs().maxCoeff(), cx.lo.cwiseAbs().maxCoeff()));
  if (!cx.bf16) {
    cx.augT.resize(dv + 2, r);
    cx.augT.topRows(dv) = ckv.values.transpose();
    cx.augT.row(dv) = ckv.weights.transpose();
    cx.augT.row(dv + 1) = ckv.weights.cwiseAbs().transpose();
  }
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
      tasks, [&] { return WtdWorkspace<Scalar>(r, dv, std::max<Index>(nb, 1), ni, cx.bf16); },
      [&](Index task, WtdWorkspace<Scalar>& ws) {
        const Index i0 = task * kWtdTile;
        wtd_tile(cx, Q, o, i0, std::min(kWtdTile, n - i0), ws, res.output, res.row_error_bound,
                 fell);
      });
  res.fallback_rows = fell.template cast<Index>().sum();
  res.error_bound = n > 0 ? res.row_error_bound.maxCoeff() : 0.0;
  res.bf16 = cx.bf16;
  res.info = all_finite(res.output) ? Info::Success : Info::NumericalIssue;
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
WildcatAttention<Scalar_, PivotRule>::WildcatAttention(Options opts) : m_opts(opts) {
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
