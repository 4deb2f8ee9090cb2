/// \file fused_decode_fma.hpp
/// \brief Internal: the FMA forms of the fused decoding kernel (see `fused_decode_avx512.hpp`):
/// `fused_decode_keys`, bf16 with 1-4 queries and fp32 with 1-16, and its key-column pass
/// `decode_key_columns`. Include <effattn/exact.hpp> instead.
#pragma once

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "decode_avx512.hpp"
#include "fused_decode_common.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

/// Scores of the block at j0 from key columns [c, c + G): s_i += sum_g q_i,c+g K[., c + g] for
/// the NR rows (column i of s, `chunks` 16-key chunks, the last one `tail`), each row's chunk
/// loaded and stored once per G columns; prefetches the segments `kFusedDecodePrefetch` ahead.
template <bool Bf16, int NR, int G, typename In>
EFFATTN_TARGET_AVX512 inline void decode_key_columns(const FusedDecodeProblem<In>& P, Index c,
                                                     Index j0, Index cnt, Index next, Index chunks,
                                                     __mmask16 tail, float* s) {
  const In* kc[G];
  const In* pf[G];
  Index pf_valid[G];
  __m512 qv[NR][G];
  EFFATTN_UNROLL16
  for (int g = 0; g < G; ++g) {
    kc[g] = P.K + (c + g) * P.ldk + j0;
    pf[g] = decode_segment(P, c + g + kFusedDecodePrefetch, j0, cnt, next, pf_valid[g]);
    EFFATTN_UNROLL16
    for (int i = 0; i < NR; ++i) qv[i][g] = _mm512_set1_ps(P.q[i * P.d + c + g]);
  }
  for (Index ch = 0; ch < chunks; ++ch) {
    const __mmask16 k = ch + 1 < chunks ? kDecodeAll : tail;
    __m512 kv[G];
    EFFATTN_UNROLL16
    for (int g = 0; g < G; ++g) {
      prefetch_chunk(pf[g], ch, pf_valid[g]);
      kv[g] = load16_values<Bf16>(kc[g] + ch * 16, k);
    }
    EFFATTN_UNROLL16
    for (int i = 0; i < NR; ++i) {
      float* sp = s + i * kFusedDecodeScoreStride + ch * 16;
      __m512 a = _mm512_loadu_ps(sp);
      EFFATTN_UNROLL16
      for (int g = 0; g < G; ++g) a = _mm512_fmadd_ps(qv[i][g], kv[g], a);
      _mm512_storeu_ps(sp, a);
    }
  }
}

/// Keys [k0, k1) for NR rows: updates st (acc, m, l). 2 NR (k1 - k0) (d + dv) flops; reads each
/// key and value once. \returns false if a raw score (before bias and mask) was not finite: with
/// finite queries, a non-finite key (the caller does not scan K beforehand). `Bf16`: K, V and P
/// rounded to bf16 (the TiledBf16 arithmetic); otherwise fp32 throughout.
template <bool Bf16, int NR, typename In>
EFFATTN_TARGET_AVX512 bool fused_decode_keys(const FusedDecodeProblem<In>& P, Index k0, Index k1,
                                             FusedDecodeState& st) {
  constexpr Index B = kFusedDecodeBlock, PF = kFusedDecodePrefetch;
  // Independent partial sums per row in the value pass (8 and 16 rows: one, to stay within the
  // 32 vector registers).
  constexpr int U = NR == 1 ? 4 : NR <= 4 ? 2 : 1;
  const Index d = P.d, dv = P.dv;
  float* s = st.s.data();
  float* acc = st.acc.data();
  __mmask16 bad = 0;
  for (Index j0 = k0; j0 < k1; j0 += B) {
    const DecodeBlock blk(j0, k1, B);
    const Index cnt = blk.cnt, chunks = blk.chunks, next = blk.next;
    const __mmask16 tail = blk.tail;
    // Scores: s_i = q_i K_block^T, column segment by column segment.
    clear_scores(s, NR, chunks);
    // Four columns (four contiguous streams) per pass over the scores; two for 8 and 16 rows,
    // whose NR x G broadcast queries do not fit the registers otherwise (fp32, d = 128, 2
    // threads, m = 32768: 16 rows 9.4 -> 12.1 GB/s, 8 rows 15.3 -> 20.9 GB/s; the same FMAs in
    // the same order, so the same bits).
    constexpr int G = NR >= 8 ? 2 : 4;
    Index kc = 0;
    for (; kc + G <= d; kc += G)
      decode_key_columns<Bf16, NR, G>(P, kc, j0, cnt, next, chunks, tail, s);
    for (; kc < d; ++kc) decode_key_columns<Bf16, NR, 1>(P, kc, j0, cnt, next, chunks, tail, s);
    // Softmax of the block: s_i becomes bf16(exp(s_i - m_i)), 0 for hidden or absent keys.
    decode_block_softmax<NR, Bf16>(P, j0, cnt, chunks, st, bad, P.rows);
    // Values: acc_i += p_i V_block, column segment by column segment.
    for (Index c = 0; c < dv; ++c) {
      const In* vc = P.V + c * P.ldv + j0;
      Index pf_valid = 0;
      const In* pf = decode_segment(P, d + c + PF, j0, cnt, next, pf_valid);
      __m512 a[NR][U];
      // The loops over rows and partial sums are unrolled so that `a` lives in registers: GCC
      // -O2 left them rolled, with `a` on the stack and a load, FMA and store per row and chunk
      // (fp32, 16 queries, d = 128, m = 32768, 2 threads, AMD Zen 5: 9 GB/s rolled, 22 GB/s
      // unrolled; the same operations in the same order).
      EFFATTN_UNROLL16
      for (int i = 0; i < NR; ++i) {
        EFFATTN_UNROLL16
        for (int u = 0; u < U; ++u) a[i][u] = _mm512_setzero_ps();
      }
      Index ch = 0;
      for (; ch + U <= chunks; ch += U) {
        EFFATTN_UNROLL16
        for (int u = 0; u < U; ++u) {
          prefetch_chunk(pf, ch + u, pf_valid);
          const __m512 vv =
              load16_values<Bf16>(vc + (ch + u) * 16, ch + u + 1 < chunks ? kDecodeAll : tail);
          EFFATTN_UNROLL16
          for (int i = 0; i < NR; ++i)
            a[i][u] = _mm512_fmadd_ps(
                _mm512_loadu_ps(s + i * kFusedDecodeScoreStride + (ch + u) * 16), vv, a[i][u]);
        }
      }
      for (; ch < chunks; ++ch) {
        prefetch_chunk(pf, ch, pf_valid);
        const __m512 vv = load16_values<Bf16>(vc + ch * 16, ch + 1 < chunks ? kDecodeAll : tail);
        EFFATTN_UNROLL16
        for (int i = 0; i < NR; ++i)
          a[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(s + i * kFusedDecodeScoreStride + ch * 16), vv,
                                    a[i][0]);
      }
      EFFATTN_UNROLL16
      for (int i = 0; i < NR; ++i) {
        __m512 t = a[i][0];
        EFFATTN_UNROLL16
        for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, a[i][u]);
        acc[c * FusedDecodeState::R + i] += decode_hsum16(t);
      }
    }
  }
  return bad == 0;
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
