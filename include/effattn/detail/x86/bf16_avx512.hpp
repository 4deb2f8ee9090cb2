/// \file bf16_avx512.hpp
/// \brief The AVX512-BF16 kernels of `policy::TiledBf16` (`vdpbf16ps`: 16 fp32 lanes, each
/// adding the dot product of one bf16 pair of each operand), for CPUs without AMX or when
/// `EFFATTN_ISA=avx512bf16`.
///
/// Lanes are 16 query rows, so every result vector is a contiguous piece of one column of the
/// column-major Eigen tile. The vector operand is a VNNI query group (scores) or a VNNI pair
/// block of P (`pack_p_vnni`); the broadcast operand is one bf16 pair of a key row (scores) or
/// two adjacent keys of one value column (P V). Register block: 2 query groups x 8 columns =
/// 16 accumulators, 2 loads and 8 broadcasts per 16 `vdpbf16ps`.
#pragma once

#include <cstdint>
#include <cstring>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "bf16_pack.hpp"

#if EFFATTN_BF16_X86

/// Target attribute of the AVX512-BF16 kernels.
#define EFFATTN_TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace effattn {
namespace detail {

/// Broadcast of the 32-bit bf16 pair at `p`.
EFFATTN_TARGET_AVX512BF16 inline __m512bh bf16_pair_broadcast(const std::uint16_t* p) noexcept {
  std::int32_t x;
  std::memcpy(&x, p, sizeof x);
  return (__m512bh)_mm512_set1_epi32(x);
}

/// Vector of 16 bf16 pairs at `p`.
EFFATTN_TARGET_AVX512BF16 inline __m512bh bf16_pairs_load(const std::uint16_t* p) noexcept {
  return (__m512bh)_mm512_loadu_si512(p);
}

/// As `amx_scores`, with `vdpbf16ps`: S rows [0, rows_pad) x columns [0, cols_pad) (column-major,
/// leading dimension `ld`; rows_pad, cols_pad multiples of 32) for query groups from g0 and keys
/// from j0.
EFFATTN_TARGET_AVX512BF16 inline void avx512_scores(const Bf16Panels& p, Index g0, Index j0,
                                                    Index rows_pad, Index cols_pad, float* s,
                                                    Index ld) noexcept {
  const Index pairs = p.dpad / 2;
  for (Index qq = 0; qq < rows_pad; qq += 32) {
    const std::uint16_t* q0 = p.q_group(g0 + qq / 16);
    const std::uint16_t* q1 = p.q_group(g0 + qq / 16 + 1);
    for (Index kk = 0; kk < cols_pad; kk += 8) {
      __m512 a0[8], a1[8];
      EFFATTN_UNROLL8
      for (int t = 0; t < 8; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
      const std::uint16_t* k = p.k_row(j0 + kk);
      for (Index pr = 0; pr < pairs; ++pr) {
        const __m512bh x0 = bf16_pairs_load(q0 + pr * 32), x1 = bf16_pairs_load(q1 + pr * 32);
        EFFATTN_UNROLL8
        for (int t = 0; t < 8; ++t) {
          const __m512bh y = bf16_pair_broadcast(k + t * p.dpad + 2 * pr);
          a0[t] = _mm512_dpbf16_ps(a0[t], x0, y);
          a1[t] = _mm512_dpbf16_ps(a1[t], x1, y);
        }
      }
      EFFATTN_UNROLL8
      for (int t = 0; t < 8; ++t) {
        _mm512_storeu_ps(s + (kk + t) * ld + qq, a0[t]);
        _mm512_storeu_ps(s + (kk + t) * ld + qq + 16, a1[t]);
      }
    }
  }
}

/// As `amx_accumulate`, with `vdpbf16ps`: acc (column-major, leading dimension `ld`) += P V_t
/// for rows [0, rows_pad), all dvpad value columns, `cols_pad` keys from j0 (multiples of 32).
EFFATTN_TARGET_AVX512BF16 inline void avx512_accumulate(const Bf16Panels& p, Index j0,
                                                        Index rows_pad, Index cols_pad,
                                                        const std::uint16_t* pv, float* acc,
                                                        Index ld) noexcept {
  for (Index qq = 0; qq < rows_pad; qq += 32) {
    for (Index cc = 0; cc < p.dvpad; cc += 8) {
      __m512 a0[8], a1[8];
      EFFATTN_UNROLL8
      for (int t = 0; t < 8; ++t) {
        a0[t] = _mm512_loadu_ps(acc + (cc + t) * ld + qq);
        a1[t] = _mm512_loadu_ps(acc + (cc + t) * ld + qq + 16);
      }
      for (Index kc = 0; kc < cols_pad; kc += 32) {
        const std::uint16_t* v = p.v_chunk(j0 + kc) + cc * 32;
        for (Index pr = 0; pr < 16; ++pr) {
          const std::uint16_t* b = pv + ((kc / 2 + pr) * ld + qq) * 2;
          const __m512bh x0 = bf16_pairs_load(b), x1 = bf16_pairs_load(b + 32);
          EFFATTN_UNROLL8
          for (int t = 0; t < 8; ++t) {
            const __m512bh y = bf16_pair_broadcast(v + t * 32 + 2 * pr);
            a0[t] = _mm512_dpbf16_ps(a0[t], x0, y);
            a1[t] = _mm512_dpbf16_ps(a1[t], x1, y);
          }
        }
      }
      EFFATTN_UNROLL8
      for (int t = 0; t < 8; ++t) {
        _mm512_storeu_ps(acc + (cc + t) * ld + qq, a0[t]);
        _mm512_storeu_ps(acc + (cc + t) * ld + qq + 16, a1[t]);
      }
    }
  }
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
