/// \file fused_decode_wide.hpp
/// \brief Internal: the `vdpbf16ps` form of the fused decoding kernel (see
/// `fused_decode_avx512.hpp`): `fused_decode_keys_wide`, bf16 with 5-16 queries on the avx512bf16
/// path, and its key-pair pass `decode_key_pairs_pass`. Include <effattn/exact.hpp> instead.
#pragma once

#include <cstdint>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "bf16_avx512.hpp"
#include "decode_avx512.hpp"
#include "fused_decode_common.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

/// Scores of the 16 rows of the block at j0 from the key-column pairs [p0, p0 + G) (columns
/// 2 p0 ... 2 (p0 + G) - 1; a missing last column of an odd d is zero): s_i += sum over the pairs
/// of `vdpbf16ps` with the broadcast query pair qp[i dp + p]; each row's chunk loaded and stored
/// once per G pairs.
template <int G, typename In>
EFFATTN_TARGET_AVX512BF16 inline void decode_key_pairs_pass(const FusedDecodeProblem<In>& P,
                                                            const std::uint32_t* qp, Index dp,
                                                            Index p0, Index j0, Index cnt,
                                                            Index next, Index chunks,
                                                            __mmask16 tail, float* s) {
  constexpr Index NR = kFusedDecodeWideRows;
  const In* x[G];
  const In* y[G];
  const In* pf[2 * G];
  Index pf_valid[2 * G];
  EFFATTN_UNROLL16
  for (int g = 0; g < G; ++g) {
    const Index c = 2 * (p0 + g);
    x[g] = P.K + c * P.ldk + j0;
    y[g] = c + 1 < P.d ? P.K + (c + 1) * P.ldk + j0 : nullptr;
    for (int e = 0; e < 2; ++e)
      // A pass reads 8 columns: the next pass's (measured at m = 262144, 16 rows: 0.50 of the
      // streaming rate 4 columns ahead, 0.54 8 ahead, 0.56 16 ahead).
      pf[2 * g + e] =
          decode_segment(P, c + e + 2 * kFusedDecodePrefetch, j0, cnt, next, pf_valid[2 * g + e]);
  }
  for (Index ch = 0; ch < chunks; ++ch) {
    const __mmask16 k = ch + 1 < chunks ? kDecodeAll : tail;
    __m512bh kp[G];
    EFFATTN_UNROLL16
    for (int g = 0; g < G; ++g) {
      prefetch_chunk(pf[2 * g], ch, pf_valid[2 * g]);
      prefetch_chunk(pf[2 * g + 1], ch, pf_valid[2 * g + 1]);
      kp[g] = (__m512bh)decode_column_pairs(x[g] + ch * 16,
                                            y[g] != nullptr ? y[g] + ch * 16 : nullptr, k);
    }
    EFFATTN_UNROLL16
    for (Index i = 0; i < NR; ++i) {
      float* sp = s + i * kFusedDecodeScoreStride + ch * 16;
      __m512 a = _mm512_loadu_ps(sp);
      EFFATTN_UNROLL16
      for (int g = 0; g < G; ++g)
        a = _mm512_dpbf16_ps(a, kp[g],
                             (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * dp + p0 + g])));
      _mm512_storeu_ps(sp, a);
    }
  }
}

/// The 16-row bf16 form of `fused_decode_keys` (5 to 16 queries, rows past them zero): the
/// scores by `vdpbf16ps` on pairs of key columns (8 columns per pass over the scores), the same
/// block softmax, P converted to pairs of neighbouring keys, and per value column c the 16
/// output entries as 16 accumulators of `vdpbf16ps` over 32-key chunks (pairs of neighbouring
/// keys: a bf16 column is already in that layout), reduced by one shuffle tree into a vector
/// added to st.acc's column c. qp: 16 x dp query pairs (dp = ceil(d / 2)), row-major.
template <typename In>
EFFATTN_TARGET_AVX512BF16 bool fused_decode_keys_wide(const FusedDecodeProblem<In>& P,
                                                      const std::uint32_t* qp, Index k0, Index k1,
                                                      FusedDecodeState& st) {
  constexpr Index B = kFusedDecodeBlock, PF = kFusedDecodePrefetch;
  constexpr int NR = static_cast<int>(kFusedDecodeWideRows);
  const Index d = P.d, dv = P.dv, dp = (d + 1) / 2;
  float* s = st.s.data();
  float* acc = st.acc.data();
  std::uint32_t* pp = st.pp.data();
  __mmask16 bad = 0;
  for (Index j0 = k0; j0 < k1; j0 += B) {
    const DecodeBlock blk(j0, k1, B);
    const Index cnt = blk.cnt, chunks = blk.chunks, c32 = blk.c32, next = blk.next;
    const __mmask16 tail = blk.tail;
    clear_scores(s, NR, chunks);
    Index p = 0;
    for (; p + 4 <= dp; p += 4)
      decode_key_pairs_pass<4>(P, qp, dp, p, j0, cnt, next, chunks, tail, s);
    for (; p < dp; ++p) decode_key_pairs_pass<1>(P, qp, dp, p, j0, cnt, next, chunks, tail, s);
    // P rounded to bf16 when converted to pairs below.
    decode_block_softmax<NR, false>(P, j0, cnt, chunks, st, bad);
    for (int i = 0; i < NR; ++i)
      for (Index t = 0; t < c32; ++t) {
        const float* si = s + i * kFusedDecodeScoreStride + 32 * t;
        const __m512bh pair =
            _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(lanes_below(cnt - 32 * t - 16), si + 16),
                                _mm512_maskz_loadu_ps(lanes_below(cnt - 32 * t), si));
        _mm512_storeu_si512(pp + (i * c32 + t) * 16, (__m512i)pair);
      }
    for (Index c = 0; c < dv; ++c) {
      const In* vc = P.V + c * P.ldv + j0;
      Index pf_valid = 0;
      const In* pf = decode_segment(P, d + c + PF, j0, cnt, next, pf_valid);
      // 16 accumulators in registers: the row loops are unrolled (GCC keeps a[] in memory
      // otherwise, a store per vdpbf16ps).
      __m512 a[NR];
      EFFATTN_UNROLL16
      for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
      for (Index t = 0; t < c32; ++t) {
        prefetch_chunk(pf, 2 * t, pf_valid);
        prefetch_chunk(pf, 2 * t + 1, pf_valid);
        const __m512bh vp = decode_key_pairs(vc + 32 * t, cnt - 32 * t);
        EFFATTN_UNROLL16
        for (int i = 0; i < NR; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(pp + (i * c32 + t) * 16), vp);
      }
      // decode_reduce16 sums input 4 k + q into lane 4 q + k: feed row 4 q + k there.
      __m512 r[NR];
      EFFATTN_UNROLL16
      for (int j = 0; j < NR; ++j) r[j] = a[4 * (j % 4) + j / 4];
      float* ac = acc + c * NR;
      _mm512_storeu_ps(ac, _mm512_add_ps(_mm512_loadu_ps(ac), decode_reduce16(r)));
    }
  }
  return bad == 0;
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
