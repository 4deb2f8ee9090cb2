/// \file wildcat_attend.hpp
/// \brief Internal: WildCat's weighted attention over a compressed KV set: the per-call context
/// and per-thread workspace, the bf16 products of a query tile, the tiled attention with its
/// fallbacks, and `wildcat_attend`, which runs it with the a-posteriori error bound. Include
/// <effattn/wildcat.hpp> instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/gemm.hpp"
#include "../../core/isa.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../wildcat.hpp"
#include "../x86/bf16_avx512.hpp"
#include "../x86/bf16_pack.hpp"

namespace effattn {
namespace detail {

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

}  // namespace detail
}  // namespace effattn
