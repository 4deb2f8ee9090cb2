/// \file decode_avx512.hpp
/// \brief The fp32 AVX-512 kernel of multi-head decoding (`MultiHead<ExactAttention<float>>`
/// with few queries against a row-major KV cache): up to 4 stacked query rows of one key/value
/// head against 16 keys, online softmax included.
///
/// Decoding is a read of the cache: 2 (d + dv) flops per stacked row per key against
/// 4 (d + dv) bytes per key and kv head. At GQA 4 that is 2 flops per byte, so the kernel must
/// run well above the memory rate for the read to be the limit. The Eigen GEMV form (one GEMV of
/// the K tile per query row, one of the V tile per row) reads each tile once per row and reduces
/// every dot product horizontally: measured 13-16 GB/s per core on an L3-resident cache, about
/// the DRAM rate, so decoding reached 0.47-0.56 of the streaming rate. This kernel reads each key
/// and value row once for all the rows of a group:
/// - scores: register block of 4 rows x 4 keys (16 accumulators over d in 16-lane chunks, one
///   load of each key chunk and query chunk per 16 FMAs), reduced to one vector of 16 dot
///   products by a 4-level shuffle tree (15 adds), 4 key blocks per 16-key tile;
/// - softmax: one vector of 16 scores per row; the running maximum m is lazy: the accumulator is
///   rescaled only when a tile's maximum exceeds m by more than `kDecodeLazyMax` (8, so every
///   probability is at most e^8 < 3000: no overflow in float), which after the first tiles of a
///   long cache is almost never. Any reference m gives the same softmax
///   (acc = sum exp(s_j - m) v_j, l = sum exp(s_j - m), out = acc / l, lse = m + log l), so the
///   masked tiles (`online_softmax_update`) and the split merge take the state as it is;
/// - values: 4 rows x 64 output columns (16 accumulators), one load of each value chunk per 4
///   FMAs with broadcast probabilities.
///
/// Every intrinsic whose plain form passes `_mm512_undefined_ps()` through (shuffles, max,
/// roundscale, scalef, GCC's horizontal reductions) is written in its zero-masked form with all
/// lanes on, the same instruction: the plain forms trip -Wuninitialized in user code built
/// without -mavx512f (GCC PR 105593, as for the bf16 packing).
///
/// exp is a Cody-Waite reduction and the degree-6 polynomial of Cephes' expf (relative error
/// about 2 ulp), 0 below -87.3 (where float's exp underflows to denormals).
#pragma once

#include <cmath>
#include <limits>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

/// How far a tile's maximum score may exceed the running reference before the accumulator is
/// rescaled (natural-log units: probabilities stay below e^8).
constexpr float kDecodeLazyMax = 8.0f;

/// True when the fp32 AVX-512 decoding kernel may run: head widths multiples of 16 and the
/// selected ISA path (`active_isa()`) `avx512bf16` or `amx` (both imply AVX512F/BW/VL;
/// `EFFATTN_ISA=generic` turns the kernel off, which the tests use to check the Eigen path).
inline bool decode_avx512_usable(Index d, Index dv) noexcept {
  return d % 16 == 0 && dv % 16 == 0 &&
         static_cast<int>(selected_isa()) >= static_cast<int>(Isa::Avx512Bf16);
}

/// All 16 lanes.
constexpr __mmask16 kDecodeAll = 0xFFFF;

/// Sum of the 16 lanes (256-bit halves, 128-bit pairs, then 64- and 32-bit elements folded).
EFFATTN_TARGET_AVX512 inline float decode_hsum16(__m512 x) noexcept {
  x = _mm512_add_ps(x, _mm512_maskz_shuffle_f32x4(kDecodeAll, x, x, 0x4E));
  x = _mm512_add_ps(x, _mm512_maskz_shuffle_f32x4(kDecodeAll, x, x, 0xB1));
  x = _mm512_add_ps(x, _mm512_maskz_shuffle_ps(kDecodeAll, x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_maskz_shuffle_ps(kDecodeAll, x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}

/// Maximum of the 16 lanes (the same folding).
EFFATTN_TARGET_AVX512 inline float decode_hmax16(__m512 x) noexcept {
  x = _mm512_maskz_max_ps(kDecodeAll, x, _mm512_maskz_shuffle_f32x4(kDecodeAll, x, x, 0x4E));
  x = _mm512_maskz_max_ps(kDecodeAll, x, _mm512_maskz_shuffle_f32x4(kDecodeAll, x, x, 0xB1));
  x = _mm512_maskz_max_ps(kDecodeAll, x,
                          _mm512_maskz_shuffle_ps(kDecodeAll, x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_maskz_max_ps(kDecodeAll, x,
                          _mm512_maskz_shuffle_ps(kDecodeAll, x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}

/// e^x for 16 lanes (see the file documentation); lanes below -87.3 give 0.
EFFATTN_TARGET_AVX512 inline __m512 decode_exp16(__m512 x) noexcept {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_maskz_max_ps(kDecodeAll, x, lo);
  const __m512 n =
      _mm512_maskz_roundscale_ps(kDecodeAll, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~under), p, n);
}

/// The 16 sums of the accumulators c[4 k + q] (row q, key k of a 4 x 4 block) in one vector,
/// lane 4 q + k: pairs of vectors are folded by 128-bit lanes, then by 64- and 32-bit elements.
EFFATTN_TARGET_AVX512 inline __m512 decode_reduce16(const __m512* c) noexcept {
  __m512 x[8], y[4], z[2];
  EFFATTN_UNROLL8
  for (int i = 0; i < 8; ++i)  // [a.l0 + a.l2, a.l1 + a.l3, b.l0 + b.l2, b.l1 + b.l3]
    x[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kDecodeAll, c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_maskz_shuffle_f32x4(kDecodeAll, c[2 * i], c[2 * i + 1], 0xEE));
  EFFATTN_UNROLL8
  for (int i = 0; i < 4; ++i)  // 128-bit lane j: 4 partial sums of c[4 i + j]
    y[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kDecodeAll, x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(kDecodeAll, x[2 * i], x[2 * i + 1], 0xDD));
  EFFATTN_UNROLL8
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(
        _mm512_maskz_shuffle_ps(kDecodeAll, y[2 * i], y[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_maskz_shuffle_ps(kDecodeAll, y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_maskz_shuffle_ps(kDecodeAll, z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_maskz_shuffle_ps(kDecodeAll, z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/// acc[q][0, U 16) += sum_k p[q][k] v_k[0, U 16) for NR rows over `cols` keys (U 16-lane chunks
/// per pass: NR x U accumulators); with `vpf`, each value load is paired with a prefetch of the
/// same columns of row vpf[k].
template <int NR, int U>
EFFATTN_TARGET_AVX512 inline void decode_accumulate(const float (*p)[16], const float* const* vp,
                                                    Index cols, Index x, float* const* acc,
                                                    const float* const* vpf) noexcept {
  __m512 a[NR][U];
  EFFATTN_UNROLL8
  for (int q = 0; q < NR; ++q) EFFATTN_UNROLL8
  for (int u = 0; u < U; ++u) a[q][u] = _mm512_loadu_ps(acc[q] + x + 16 * u);
  for (Index k = 0; k < cols; ++k) {
    __m512 v[U];
    EFFATTN_UNROLL8
    for (int u = 0; u < U; ++u) v[u] = _mm512_loadu_ps(vp[k] + x + 16 * u);
    if (vpf != nullptr) {
      EFFATTN_UNROLL8
      for (int u = 0; u < U; ++u) __builtin_prefetch(vpf[k] + x + 16 * u, 0, 3);
    }
    EFFATTN_UNROLL8
    for (int q = 0; q < NR; ++q) {
      const __m512 b = _mm512_set1_ps(p[q][k]);
      EFFATTN_UNROLL8
      for (int u = 0; u < U; ++u) a[q][u] = _mm512_fmadd_ps(b, v[u], a[q][u]);
    }
  }
  EFFATTN_UNROLL8
  for (int q = 0; q < NR; ++q) EFFATTN_UNROLL8
  for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc[q] + x + 16 * u, a[q][u]);
}

/// NR (1-4) stacked query rows of one kv head against `cols` (1-16) keys: q rows at q + r ldq
/// (scaled), key and value rows at kp[k], vp[k] (k < 16; entries from `cols` on may repeat a
/// valid row: their scores are masked), state m[r], l[r], acc[r] (the unnormalised output row,
/// dv columns), updated in place with the lazy maximum of the file documentation. `kpf`, `vpf`
/// (16 rows each, or null): rows to prefetch, one prefetch beside each key or value load, so
/// the prefetches of the next keys are spread over this call's arithmetic.
/// \returns false if a score of the `cols` keys was not finite.
template <int NR>
EFFATTN_TARGET_AVX512 inline bool decode_rows16(const float* q, Index ldq, Index d,
                                                const float* const* kp, const float* const* vp,
                                                Index cols, Index dv, float* m, double* l,
                                                float* const* acc, const float* const* kpf,
                                                const float* const* vpf) noexcept {
  static_assert(NR >= 1 && NR <= 4, "1 to 4 rows");
  __m512 blk[4];
  for (int b = 0; b < 4; ++b) {
    __m512 c[16];
    EFFATTN_UNROLL8
    for (int i = 0; i < 16; ++i) c[i] = _mm512_setzero_ps();
    const float* k0 = kp[4 * b];
    const float* k1 = kp[4 * b + 1];
    const float* k2 = kp[4 * b + 2];
    const float* k3 = kp[4 * b + 3];
    for (Index x = 0; x < d; x += 16) {
      const __m512 v0 = _mm512_loadu_ps(k0 + x), v1 = _mm512_loadu_ps(k1 + x),
                   v2 = _mm512_loadu_ps(k2 + x), v3 = _mm512_loadu_ps(k3 + x);
      if (kpf != nullptr) {
        __builtin_prefetch(kpf[4 * b] + x, 0, 3);
        __builtin_prefetch(kpf[4 * b + 1] + x, 0, 3);
        __builtin_prefetch(kpf[4 * b + 2] + x, 0, 3);
        __builtin_prefetch(kpf[4 * b + 3] + x, 0, 3);
      }
      EFFATTN_UNROLL8
      for (int r = 0; r < NR; ++r) {
        const __m512 qv = _mm512_loadu_ps(q + r * ldq + x);
        c[r] = _mm512_fmadd_ps(qv, v0, c[r]);
        c[4 + r] = _mm512_fmadd_ps(qv, v1, c[4 + r]);
        c[8 + r] = _mm512_fmadd_ps(qv, v2, c[8 + r]);
        c[12 + r] = _mm512_fmadd_ps(qv, v3, c[12 + r]);
      }
    }
    blk[b] = decode_reduce16(c);  // lane 4 r + k: row r, key 4 b + k
  }
  // 4 x 4 transpose of 128-bit lanes: row r's 16 scores, key order.
  const __m512 t0 = _mm512_maskz_shuffle_f32x4(kDecodeAll, blk[0], blk[1], 0x44),
               t1 = _mm512_maskz_shuffle_f32x4(kDecodeAll, blk[0], blk[1], 0xEE),
               t2 = _mm512_maskz_shuffle_f32x4(kDecodeAll, blk[2], blk[3], 0x44),
               t3 = _mm512_maskz_shuffle_f32x4(kDecodeAll, blk[2], blk[3], 0xEE);
  const __m512 rows[4] = {_mm512_maskz_shuffle_f32x4(kDecodeAll, t0, t2, 0x88),
                          _mm512_maskz_shuffle_f32x4(kDecodeAll, t0, t2, 0xDD),
                          _mm512_maskz_shuffle_f32x4(kDecodeAll, t1, t3, 0x88),
                          _mm512_maskz_shuffle_f32x4(kDecodeAll, t1, t3, 0xDD)};
  const __mmask16 valid = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  bool finite = true;
  alignas(64) float p[NR][16];
  EFFATTN_UNROLL8
  for (int r = 0; r < NR; ++r) {
    const __m512 s = _mm512_mask_mov_ps(ninf, valid, rows[r]);
    // x - x is 0 exactly for finite x (NaN for +-inf and NaN)
    const __mmask16 fin =
        _mm512_cmp_ps_mask(_mm512_sub_ps(rows[r], rows[r]), _mm512_setzero_ps(), _CMP_EQ_OQ);
    finite = finite && (fin & valid) == valid;
    const float mx = decode_hmax16(s);
    if (m[r] == -std::numeric_limits<float>::infinity() || mx > m[r] + kDecodeLazyMax) {
      if (m[r] != -std::numeric_limits<float>::infinity()) {
        const float alpha = std::exp(m[r] - mx);
        l[r] *= static_cast<double>(alpha);
        const __m512 a = _mm512_set1_ps(alpha);
        for (Index x = 0; x < dv; x += 16)
          _mm512_storeu_ps(acc[r] + x, _mm512_mul_ps(a, _mm512_loadu_ps(acc[r] + x)));
      }
      m[r] = mx;
    }
    const __m512 e =
        _mm512_maskz_mov_ps(valid, decode_exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[r]))));
    l[r] += static_cast<double>(decode_hsum16(e));
    _mm512_store_ps(p[r], e);
  }
  Index x = 0;
  for (; x + 64 <= dv; x += 64) decode_accumulate<NR, 4>(p, vp, cols, x, acc, vpf);
  for (; x < dv; x += 16) decode_accumulate<NR, 1>(p, vp, cols, x, acc, vpf);
  return finite;
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
