/// \file bf16_attention.hpp
/// \brief The `policy::TiledBf16` driver: bf16 products with fp32 accumulation around the shared
/// fp32 online softmax (`online_softmax_update`), on the kernel path of `core/isa.hpp`.
///
/// Per query block and key tile: S = bf16(s Q_b) bf16(K_t)^T accumulated in fp32 (AMX tiles,
/// `vdpbf16ps`, or Eigen's float GEMM on the bf16 values), plus the key bias; then the fp32
/// online-softmax update (running max, row sums in double, rescaled accumulator, P = exp(S - m));
/// then P is rounded to bf16 and acc += bf16(P) bf16(V_t), accumulated in fp32. At the end
/// O = acc / l and lse = m + log l. On the x86 paths a tile without hidden entries (no causal
/// diagonal, no key bias) takes a fused update instead (`softmax_pack_unmasked`: the row max,
/// exp as a degree-5 polynomial of 2^f (~3 ulp), sums, and P written as bf16 pairs in one pass).
/// The three paths multiply the same bf16 operands and differ in the fp32 summation order and
/// in the last bits of exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/isa.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../x86/bf16_amx.hpp"
#include "../x86/bf16_avx512.hpp"
#include "../x86/bf16_pack.hpp"
#include "../x86/fused_decode_avx512.hpp"
#include "exact_dispatch.hpp"

namespace effattn {
namespace detail {

#if EFFATTN_BF16_X86
// The fused decoding kernel's forms take as many queries as `choose_exact_kernel` gives them.
static_assert(kFusedDecodeWideRows == kExactDecodeMaxQueries, "one bound for decoding calls");
static_assert(kFusedDecodeFp32MaxRows == kExactDecodeMaxQueries, "one bound for decoding calls");
#endif

/// The tile plan of the bf16 kernels: as `plan_tiles`, with block sizes that are multiples of 32
/// (a user's `block_q` / `block_k` is rounded up; a block covering all rows or keys may be
/// shorter). Automatic: 256 query rows x 256 keys (1024 keys when decoding). Measured at
/// n = m = 4096, 1 thread, AMX: 256 x 256 took 13.5 / 19.5 ms (d = 64 / 128), 128 x 512 13.5 /
/// 20.2, 128 x 256 14.7 / 22.3, 64 x 256 16.2 / 24.3: the shared online-softmax update works
/// column by column, so taller tiles amortise its per-column cost; the 256 KiB score tile stays
/// in the 2 MiB L2. O(1).
inline TilePlan plan_bf16_tiles(Index n, Index m, Index d, Index dv, Index block_q, Index block_k) {
  const Index bq = block_q > 0 ? round_up(block_q, 32) : 256;
  // Decoding streams K and V column by column: 1024-key tiles read 4 KiB (a page) per column
  // and key tile, which the prefetchers follow (256-key tiles reached 20% of the bandwidth).
  const Index bk = block_k > 0 ? round_up(block_k, 32) : n <= kExactDecodeMaxQueries ? 1024 : 256;
  return plan_tiles(n, m, d, dv, 2, bq, bk);
}

/// Per-thread buffers of the bf16 driver: the fp32 tile workspace (score tile padded to
/// multiples of 32 rows and columns), the fp32 accumulator (bq_pad x acc_cols) and the bf16 VNNI
/// copy of P. The accumulator is kept out of `t` (which gets zero accumulator columns) and
/// rescaled by `rescale_accumulator`: the rescale inside `online_softmax_update`
/// (`acc.topRows(bq).array().colwise() *= alpha`) compiles to scalar code, ~10% of the bf16 run
/// time at d = 128; a column-by-column product is vectorised and rounds identically.
struct Bf16Workspace {
  TileWorkspace<float> t;
  Matrix<float> acc;
  Bf16Buffer pv;
  Matrix<float> k_tile, v_tile;  ///< streaming kernel only: the rounded K and V tiles
  Bf16Workspace(Index bq_pad, Index bk_pad, Index acc_cols, Index k_tile_cols = 0,
                Index v_tile_cols = 0)
      : t(bq_pad, bk_pad, 1, 0),
        acc(bq_pad, acc_cols),
        pv(bk_pad * bq_pad),
        k_tile(bk_pad, k_tile_cols),
        v_tile(bk_pad, v_tile_cols) {}
};

/// acc rows [0, rows) *= alpha, the rescale factors exp(m_old - m_new) that
/// `online_softmax_update` leaves in ws.t.alpha; skipped when every factor is 1. O(rows dv).
template <typename = void>  // instantiated where used (compile cost)
inline void rescale_accumulator(Index rows, Bf16Workspace& ws) {
  const auto alpha = ws.t.alpha.head(rows);
  if ((alpha == 1.0f).all()) return;
  for (Index c = 0; c < ws.acc.cols(); ++c) ws.acc.col(c).head(rows).array() *= alpha;
}

/// The generic path: Eigen float GEMMs on the bf16-rounded operands, P rounded to bf16. A
/// template only so that its two GEMMs are instantiated where the kernel is used, not in every
/// translation unit that includes exact.hpp (1-1.5 s of a compiled-mode user TU).
template <typename Rounded = Bf16RoundedFloats>
struct GenericBf16Kernel {
  const Rounded& r;
  static constexpr bool kFusedSoftmax = false;  ///< the shared update on every tile
  Index acc_cols() const { return r.v.cols(); }
  Bf16Workspace workspace(Index bq_pad, Index bk_pad) const {
    return Bf16Workspace(bq_pad, bk_pad, acc_cols());
  }
  template <typename F>
  void task(F&& f) const {
    f();
  }
  void scores(Index i0, Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    gemm(Update::Assign, ws.t.s.topLeftCorner(rows, cols), r.q.middleRows(i0, rows),
         r.kt.middleCols(j0, cols));
  }
  void accumulate(Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    round_tile_to_bf16(ws.t.s.data(), ws.t.s.rows(), rows, cols);
    gemm(Update::Add, ws.acc.topRows(rows), ws.t.s.topLeftCorner(rows, cols),
         r.v.middleRows(j0, cols));
  }
};

#if EFFATTN_BF16_X86
/// Lanes 8-15 (AVX512F: `_mm512_extractf32x8_ps` needs AVX512DQ).
EFFATTN_TARGET_AVX512 inline __m256 high_half(__m512 x) noexcept {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}

/// 2^t for 16 lanes of t <= 0: 2^n 2^f with n = round(t), f = t - n in [-1/2, 1/2] and 2^f a
/// degree-5 polynomial (coefficients fitted to the relative error on [-1/2, 1/2]: at most
/// 3.2e-7, about 3 ulp, measured in fp32 arithmetic over t in [-20, 0]), scaled by `vscalefps`.
/// t is first raised to -200 (so -inf gives 0, as exp(-inf) does); a NaN stays NaN (the max
/// returns its second operand when either is NaN). 10 instructions against 15 of
/// `decode_exp16`: P is rounded to bf16 (2^-9) right after.
EFFATTN_TARGET_AVX512 inline __m512 exp2_16(__m512 t) noexcept {
  t = _mm512_max_ps(_mm512_set1_ps(-200.0f), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.326092170e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.670175612e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550712347e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402222455e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470037e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/// The online-softmax update of a tile without hidden entries (no causal diagonal, no key bias)
/// fused with the rounding of P into the VNNI pairs of `pack_p_vnni`, for the x86 kernels: per
/// strip of 16 rows of the column-major score tile (leading dimension `ld`), the tile's row
/// maximum, the new running maximum m', alpha = exp(m - m'), P = exp(S - m') rounded to bf16
/// pairs straight into `pv` (columns >= `cols` zero) and l = l alpha + the fp32 row sum of this
/// tile (even and odd columns summed apart, then added: a fixed order), in two
/// passes over the tile instead of four (`row_max_into`, the update, its sums, the packing: 42%
/// of a 1-thread AMX call at d = 128, measured with perf). exp of P is `exp2_16` (~3 ulp), of
/// alpha `decode_exp16` (Cephes' polynomial, ~2 ulp). Leaves alpha in ws.t.alpha
/// for `rescale_accumulator`. Non-finite scores (an overflow of finite inputs) come out as from
/// the shared update: a NaN score (which the max may drop) is NaN after `exp2_16`, so its row's
/// sum and output are; a row with a +inf score has m' = +inf and that score exp(inf - inf) =
/// NaN; -inf scores give 0. O(rows cols_pad).
EFFATTN_TARGET_AVX512 inline void softmax_pack_unmasked(Index rows, Index cols, Index cols_pad,
                                                        Index ld, TileWorkspace<float>& t,
                                                        std::uint16_t* pv) noexcept {
  const float* s = t.s.data();
  const Index rows_pad = round_up(rows, 32);
  for (Index i = 0; i < rows_pad; i += 16) {
    const __mmask16 valid = lanes_below(rows - i);
    if (valid == 0) {  // padding rows: P = 0
      for (Index c = 0; c < cols_pad; c += 2)
        _mm512_storeu_si512(pv + ((c / 2) * ld + i) * 2, _mm512_setzero_si512());
      continue;
    }
    // Four independent maxima (a single one is a chain of dependent maxps over the strip's
    // columns, each load an L2 line).
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 mx0 = ninf, mx1 = ninf, mx2 = ninf, mx3 = ninf;
    Index c = 0;
    for (; c + 4 <= cols; c += 4) {
      const __m512 v0 = _mm512_loadu_ps(s + c * ld + i), v1 = _mm512_loadu_ps(s + (c + 1) * ld + i),
                   v2 = _mm512_loadu_ps(s + (c + 2) * ld + i),
                   v3 = _mm512_loadu_ps(s + (c + 3) * ld + i);
      mx0 = _mm512_max_ps(mx0, v0);
      mx1 = _mm512_max_ps(mx1, v1);
      mx2 = _mm512_max_ps(mx2, v2);
      mx3 = _mm512_max_ps(mx3, v3);
    }
    for (; c < cols; ++c) {
      const __m512 v = _mm512_loadu_ps(s + c * ld + i);
      mx0 = _mm512_max_ps(mx0, v);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));
    const __m512 m_old = _mm512_mask_loadu_ps(mx, valid, t.m.data() + i);
    const __m512 m_new = _mm512_maskz_max_ps(valid, mx, m_old);
    const __m512 alpha = decode_exp16(_mm512_sub_ps(m_old, m_new));
    // P of the even and of the odd columns summed apart (two addition chains). Rows past `rows`
    // (zero queries, scores 0) get finite P that only reaches discarded accumulator rows.
    // exp(s - m') = 2^(s log2(e) - m' log2(e)), the exponent in one fma (its rounding error,
    // ~2^-24 |s log2(e)|, matters only where exp(s - m') is negligible).
    const __m512 log2e = _mm512_set1_ps(1.44269504089f), m_log2e = _mm512_mul_ps(m_new, log2e);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (Index c2 = 0; c2 < cols_pad; c2 += 2) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      if (c2 < cols) {
        a = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + c2 * ld + i), log2e, m_log2e));
        sum0 = _mm512_add_ps(sum0, a);
      }
      if (c2 + 1 < cols) {
        b = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + (c2 + 1) * ld + i), log2e, m_log2e));
        sum1 = _mm512_add_ps(sum1, b);
      }
      _mm512_storeu_si512(pv + ((c2 / 2) * ld + i) * 2, bf16_vnni_pairs(a, b));
    }
    __m512 sum = _mm512_add_ps(sum0, sum1);
    _mm512_mask_storeu_ps(t.m.data() + i, valid, m_new);
    _mm512_mask_storeu_ps(t.alpha.data() + i, valid, alpha);
    double* l = t.l.data() + i;
    const __mmask8 lo = static_cast<__mmask8>(valid & 0xFF), hi = static_cast<__mmask8>(valid >> 8);
    const __m512d l_lo = _mm512_fmadd_pd(_mm512_maskz_loadu_pd(lo, l),
                                         _mm512_cvtps_pd(_mm512_castps512_ps256(alpha)),
                                         _mm512_cvtps_pd(_mm512_castps512_ps256(sum)));
    const __m512d l_hi =
        _mm512_fmadd_pd(_mm512_maskz_loadu_pd(hi, l + 8), _mm512_cvtps_pd(high_half(alpha)),
                        _mm512_cvtps_pd(high_half(sum)));
    _mm512_mask_storeu_pd(l, lo, l_lo);
    _mm512_mask_storeu_pd(l + 8, hi, l_hi);
  }
}

/// The x86 paths on `Bf16Panels`: `Amx` true for the tile kernels, false for `vdpbf16ps`.
template <bool Amx>
struct X86Bf16Kernel {
  const Bf16Panels& p;
  Index acc_cols() const { return p.dvpad; }
  Bf16Workspace workspace(Index bq_pad, Index bk_pad) const {
    return Bf16Workspace(bq_pad, bk_pad, acc_cols());
  }
  template <typename F>
  void task(F&& f) const {
    if constexpr (Amx) {
      AmxTileScope tiles;  // configure the tiles for this task, release them at its end
      f();
    } else {
      f();
    }
  }
  void scores(Index i0, Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    const Index ld = ws.t.s.rows();
    if constexpr (Amx)
      amx_scores(p, i0 / 16, j0, round_up(rows, 32), round_up(cols, 32), ws.t.s.data(), ld);
    else
      avx512_scores(p, i0 / 16, j0, round_up(rows, 32), round_up(cols, 32), ws.t.s.data(), ld);
  }
  void accumulate(Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    const Index ld = ws.t.s.rows(), rows_pad = round_up(rows, 32), cols_pad = round_up(cols, 32);
    pack_p_vnni(ws.t.s.data(), ld, rows_pad, cols, cols_pad, ws.pv.data());
    multiply_p(rows, j0, cols, ws);
  }
  /// Unmasked tiles: the fused update (`softmax_pack_unmasked`), then `multiply_p`.
  static constexpr bool kFusedSoftmax = true;
  void softmax_pack(Index rows, Index cols, Bf16Workspace& ws) const {
    softmax_pack_unmasked(rows, cols, round_up(cols, 32), ws.t.s.rows(), ws.t, ws.pv.data());
  }
  /// acc += P V with P already packed in ws.pv.
  void multiply_p(Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    const Index ld = ws.t.s.rows(), rows_pad = round_up(rows, 32), cols_pad = round_up(cols, 32);
    if constexpr (Amx)
      amx_accumulate(p, j0, rows_pad, cols_pad, ws.pv.data(), ws.acc.data(), ld);
    else
      avx512_accumulate(p, j0, rows_pad, cols_pad, ws.pv.data(), ws.acc.data(), ld);
  }
};
#endif

/// Decoding (`streams_kv`: a single block of few queries, so every key tile is visited once):
/// K and V are read once, straight from the inputs, each tile rounded to bf16 into a cache-
/// resident buffer as it streams by, and multiplied by Eigen's float GEMM. A product of two bf16
/// values is exact in fp32, so this is the same arithmetic as the matrix-engine paths (bf16
/// operands, fp32 sums), at the memory bandwidth: the panels would read K and V twice.
template <typename In>
struct StreamingBf16Kernel {
  static constexpr bool kFusedSoftmax = false;  ///< the shared update on every tile
  const Eigen::Ref<const Matrix<In>>& K;
  const Eigen::Ref<const Matrix<In>>& V;
  const Matrix<float>& q;  ///< bf16-rounded scale Q
  Index acc_cols() const { return V.cols(); }
  Bf16Workspace workspace(Index bq_pad, Index bk_pad) const {
    return Bf16Workspace(bq_pad, bk_pad, acc_cols(), K.cols(), V.cols());
  }
  template <typename F>
  void task(F&& f) const {
    f();
  }
  void scores(Index i0, Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    for (Index c = 0; c < K.cols(); ++c)
      round_floats(K.data() + c * K.outerStride() + j0, cols, ws.k_tile.col(c).data());
    gemm<Op::N, Op::T>(Update::Assign, ws.t.s.topLeftCorner(rows, cols), q.middleRows(i0, rows),
                       ws.k_tile.topRows(cols));
  }
  void accumulate(Index rows, Index j0, Index cols, Bf16Workspace& ws) const {
    for (Index c = 0; c < V.cols(); ++c)
      round_floats(V.data() + c * V.outerStride() + j0, cols, ws.v_tile.col(c).data());
    round_tile_to_bf16(ws.t.s.data(), ws.t.s.rows(), rows, cols);
    gemm(Update::Add, ws.acc.topRows(rows), ws.t.s.topLeftCorner(rows, cols),
         ws.v_tile.topRows(cols));
  }
};

/// Online-softmax pass of query rows [i0, i0 + rows) over keys [k_begin, k_end) with `kern`'s
/// products (k_begin a multiple of 32, or 0). Same contract as `online_softmax_block`: leaves
/// ws.t.m, ws.t.l and the unnormalised accumulator. 2 rows (k_end - k_begin) (d + dv) flops in
/// bf16 (tiles past the causal diagonal skipped), no allocation.
template <typename Kernel>
void bf16_block(const Kernel& kern, const float* bias, bool causal, Index n, Index m, Index i0,
                Index rows, Index k_begin, Index k_end, Index bk, Bf16Workspace& ws) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  const Index off = m - n;  // causal: row i sees keys j <= i + off
  if (causal) k_end = std::min(k_end, i0 + rows + off);
  begin_rows(ws.t, rows);
  ws.acc.setZero();
  for (Index j0 = k_begin; j0 < k_end; j0 += bk) {
    const Index cols = std::min(bk, k_end - j0);
    kern.scores(i0, rows, j0, cols, ws);
    auto S = ws.t.s.topLeftCorner(rows, cols);
    if (bias != nullptr)
      for (Index c = 0; c < cols; ++c) S.col(c).array() += bias[j0 + c];
    // Diagonal tile: key j is hidden from local rows r < j - off - i0 (a prefix of the column).
    const bool diagonal = causal && j0 + cols - 1 > i0 + off;
    auto hide = [&](Index c, auto column, float value) {
      if (diagonal)
        column.head(std::max<Index>(0, std::min(rows, j0 + c - off - i0))).setConstant(value);
      if (bias != nullptr && bias[j0 + c] == ninf) column.setConstant(value);
    };
    const bool masked = diagonal || bias != nullptr;
    if constexpr (Kernel::kFusedSoftmax) {
      if (!masked) {
        kern.softmax_pack(rows, cols, ws);
        rescale_accumulator(rows, ws);
        kern.multiply_p(rows, j0, cols, ws);
        continue;
      }
    }
    online_softmax_update<float>(rows, cols, masked, hide, ws.t);
    rescale_accumulator(rows, ws);
    kern.accumulate(rows, j0, cols, ws);
  }
}

/// Runs the whole problem with `kern`, split as `plan` says (query blocks, times 32-aligned key
/// splits merged by `merge_split_states`). Thread-count independent.
template <typename Kernel>
void bf16_attention_run(const Kernel& kern, Index n, Index m, Index dv, const float* bias,
                        bool causal, const TilePlan& plan, Matrix<float>& out, Vector<float>& lse) {
  const Index off = m - n;
  out.resize(n, dv);
  lse.resize(n);
  const Index bq = plan.bq, bk = plan.bk, splits = plan.kv_splits;
  const Index bq_pad = round_up(bq, 32), bk_pad = round_up(bk, 32);
  auto make_ws = [&] { return kern.workspace(bq_pad, bk_pad); };
  if (splits == 1) {
    parallel_for(plan.q_blocks, make_ws, [&](Index b, Bf16Workspace& ws) {
      const Index i0 = b * bq, rows = std::min(bq, n - i0);
      kern.task([&] { bf16_block(kern, bias, causal, n, m, i0, rows, 0, m, bk, ws); });
      finish_rows(ws.t, rows, ws.acc.topLeftCorner(rows, dv), out.middleRows(i0, rows),
                  lse.segment(i0, rows));
    });
    return;
  }
  Matrix<float> part_m(n, splits);
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> part_l(n, splits);
  std::vector<Matrix<float>> part_acc(static_cast<std::size_t>(splits), Matrix<float>(n, dv));
  parallel_for(plan.q_blocks * splits, make_ws, [&](Index t, Bf16Workspace& ws) {
    const Index b = t / splits, s = t % splits;
    const Index i0 = b * bq, rows = std::min(bq, n - i0);
    const Index visible = causal ? std::min(m, i0 + rows + off) : m;
    // Split starts on 32-key boundaries (the kernels' key chunks); the last split ends at m.
    const Index k0 = visible * s / splits / 32 * 32;
    const Index k1 = s + 1 == splits ? visible : visible * (s + 1) / splits / 32 * 32;
    kern.task([&] { bf16_block(kern, bias, causal, n, m, i0, rows, k0, k1, bk, ws); });
    part_m.col(s).segment(i0, rows) = ws.t.m.head(rows).matrix();
    part_l.col(s).segment(i0, rows) = ws.t.l.head(rows).matrix();
    part_acc[static_cast<std::size_t>(s)].middleRows(i0, rows) = ws.acc.topLeftCorner(rows, dv);
  });
  merge_split_states(part_m, part_l, part_acc, out, lse);
}

/// The operands of the split score product (`Bf16Scores::Split`): with q = scale Q split as
/// q_h = bf16(q), q_l = bf16(q - q_h) and K as k_h = bf16(K), k_l = bf16(K - k_h),
/// q3 = [q_h, q_h, q_l] (n x 3d) and k3 = [k_h, k_l, k_h] (m x 3d), every entry a bf16 value held
/// in a float. Then q3 k3^T = q_h k_h^T + q_h k_l^T + q_l k_h^T, and the bf16 kernels, run on q3
/// and k3 with scale 1, round nothing further (their rounding is exact on these values): every
/// path gets the split product without a kernel of its own. Q, K finite. O((n + m) d).
inline void split_bf16_operands(const Eigen::Ref<const Matrix<float>>& Q,
                                const Eigen::Ref<const Matrix<float>>& K, float scale,
                                Matrix<float>& q3, Matrix<float>& k3) {
  const Index d = Q.cols();
  auto split = [d](const Eigen::Ref<const Matrix<float>>& X, float s, Matrix<float>& out, Index hi2,
                   Index lo) {
    out.resize(X.rows(), 3 * d);
    for (Index c = 0; c < d; ++c)
      for (Index i = 0; i < X.rows(); ++i) {
        const float x = X(i, c) * s, h = rounded_float(x, 1.0f);
        out(i, c) = h;
        out(i, hi2 + c) = h;
        out(i, lo + c) = rounded_float(x - h, 1.0f);
      }
  };
  split(Q, scale, q3, d, 2 * d);  // [q_h, q_h, q_l]
  split(K, 1.0f, k3, 2 * d, d);   // [k_h, k_l, k_h]
}

/// bf16 exact attention: out (n x dv) and lse (n) for Q, K, V of scalar In (float or
/// Eigen::bfloat16), converted to bf16 once (scale folded into Q) and multiplied on path `isa`
/// (which must be available: `isa_available(isa)`). Inputs are validated by the caller, except
/// the finiteness of K and V when `fused_decode_applies` (the kernel checks them as it reads them).
/// O((n + m) d) packed panels plus the workspaces of `bf16_attention_run`. \returns false if the
/// fused decoding kernel saw a non-finite score (a non-finite key), true otherwise. `split`
/// (float inputs; ignored for bf16 ones): the split score product of `Bf16Scores::Split`, on
/// the operands of `split_bf16_operands` (O((n + m) d) more memory), or the fp32 form of the
/// fused decoding kernel where that runs.
template <typename In>
bool tiled_attention_bf16(const Eigen::Ref<const Matrix<In>>& Q,
                          const Eigen::Ref<const Matrix<In>>& K,
                          const Eigen::Ref<const Matrix<In>>& V, const float* bias, float scale,
                          bool causal, const TilePlan& plan, Isa isa, Matrix<float>& out,
                          Vector<float>& lse, bool split = false) {
  const Index n = Q.rows(), m = K.rows(), dv = V.cols();
  // Also runs the detection (and the AMX permission request) if nothing did yet.
  EFFATTN_CHECK(isa_available(isa), cat("ExactAttention: the bf16 kernel path '", isa_name(isa),
                                        "' is not available on this machine (highest: '",
                                        isa_name(detected_isa()), "')"));
  constexpr bool fp32_inputs = std::is_same_v<In, float>;
  const ExactKernel kernel =
      choose_exact_kernel(ExactFamily::TiledBf16, fp32_inputs, fp32_inputs && split, n, plan, isa);
  if constexpr (fp32_inputs) {
    if (split && kernel != ExactKernel::FusedDecodeFp32) {
      // The split score product: the kernel below on the split operands.
      Matrix<float> q3, k3;
      split_bf16_operands(Q, K, scale, q3, k3);
      return tiled_attention_bf16<float>(q3, k3, V, bias, 1.0f, causal, plan, isa, out, lse);
    }
  }
  switch (kernel) {
    case ExactKernel::FusedDecodeFp32:
      // The decoding kernel reads the fp32 K and V either way: its fp32 form computes the
      // scores (and P V) in fp32, at the same memory rate.
#if EFFATTN_BF16_X86
      if constexpr (fp32_inputs)
        return fused_decode_run<false, float>(Q, K, V, bias, scale, causal, plan, out, lse);
#endif
      break;
    case ExactKernel::FusedDecodeBf16:
#if EFFATTN_BF16_X86
      return fused_decode_run<true, In>(Q, K, V, bias, scale, causal, plan, out, lse,
                                        isa == Isa::Amx);
#endif
      break;
    case ExactKernel::StreamingBf16: {
      Matrix<float> q(n, Q.cols());
      for (Index c = 0; c < Q.cols(); ++c)
        for (Index i = 0; i < n; ++i) q(i, c) = rounded_float(Q(i, c), scale);
      bf16_attention_run(StreamingBf16Kernel<In>{K, V, q}, n, m, dv, bias, causal, plan, out, lse);
      return true;
    }
    case ExactKernel::Bf16Panels: {
#if EFFATTN_BF16_X86
      Bf16Panels panels;
      pack_bf16_panels<In>(Q, K, V, scale, panels);
      if (isa == Isa::Amx)
        bf16_attention_run(X86Bf16Kernel<true>{panels}, n, m, dv, bias, causal, plan, out, lse);
      else
        bf16_attention_run(X86Bf16Kernel<false>{panels}, n, m, dv, bias, causal, plan, out, lse);
      return true;
#endif
      break;
    }
    case ExactKernel::GenericBf16: {
      Bf16RoundedFloats rounded;
      round_to_bf16_floats<In>(Q, K, V, scale, rounded);
      bf16_attention_run(GenericBf16Kernel<>{rounded}, n, m, dv, bias, causal, plan, out, lse);
      return true;
    }
    case ExactKernel::Naive:
    case ExactKernel::Tiled:
      break;
  }
  EFFATTN_CHECK(false, cat("ExactAttention: no bf16 kernel for path '", isa_name(isa), "'"));
  return false;
}

}  // namespace detail
}  // namespace effattn
