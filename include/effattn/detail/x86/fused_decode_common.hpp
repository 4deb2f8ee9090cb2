/// \file fused_decode_common.hpp
/// \brief Internal: what the forms of the fused decoding kernel share (see
/// `fused_decode_avx512.hpp`): the row limits, block and prefetch constants, the problem and
/// per-thread state (`FusedDecodeProblem`, `FusedDecodeState`), the column-segment loads and
/// prefetches, the block softmax (`decode_block_softmax`) and the bf16 pair layouts of key columns
/// (`decode_column_pairs`, `decode_key_pairs`). Include <effattn/exact.hpp> instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "bf16_avx512.hpp"
#include "bf16_pack.hpp"
#include "decode_avx512.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

/// The most query rows of the FMA forms of the kernel (bf16 and fp32).
constexpr Index kFusedDecodeMaxRows = 4;
/// The most query rows of the fp32 form (FMA, instantiated for 1, 2, 4, 8 and 16 rows; a call
/// with 3, 5-7 or 9-15 queries runs the next larger form with zero queries in the extra rows).
constexpr Index kFusedDecodeFp32MaxRows = 16;
/// The most query rows of the bf16 form, whose products are `vdpbf16ps` on bf16 pairs (5 to 16
/// rows: 16 score rows per block, padded with zero queries).
constexpr Index kFusedDecodeWideRows = 16;
/// The fewest query rows for which the AMX path runs the AMX form (`fused_decode_keys_amx`: tile
/// products of 16 rows, whose cost hardly depends on the row count). Measured (2 threads,
/// d = 128, m = 32768 / 262144, % of the streaming read): 16 rows 54-56% / 71-74% against
/// 26-29% / 49-50% for the vdpbf16ps form; 4 rows 62% / 75% against 48-56% / 78-82% for the FMA
/// form; 1 row 61% / 76% against 74-83% / 87-101%. From 5 rows, where the AMX form wins at both
/// sizes.
constexpr Index kFusedDecodeAmxMinRows = 5;
/// Keys per block: a 2 KiB column segment of float; 4 (16) x 2 KiB of scores in L1.
constexpr Index kFusedDecodeBlock = 512;
/// Row stride (floats) of the block's scores: 16 floats more than a block, so that the 16 rows
/// of a score tile (AMX form: one 64-byte row per query) fall into different L1 sets instead of
/// two (measured, 16 queries from L3: 3-4% of the time of the AMX form).
constexpr Index kFusedDecodeScoreStride = kFusedDecodeBlock + 16;
/// Column segments prefetched ahead.
constexpr Index kFusedDecodePrefetch = 4;

/// The AMX form's sub-block: keys per pass of the K and V roundings (half a block), so that the
/// tile buffers of a pass (16 KiB of K pairs, 16 KiB of V^T) stay in L1 with the scores.
constexpr Index kAmxHalf = kFusedDecodeBlock / 2;
/// Row strides (in 64-byte rows) of the AMX form's K and V^T tile buffers: one more than the
/// chunks of a half block, so that the 16 rows of a tile fall into different L1 sets.
constexpr Index kAmxKStride = kAmxHalf / 16 + 1;
constexpr Index kAmxVStride = kAmxHalf / 32 + 1;
/// Value-column groups of 16 whose tile products run together in the AMX form.
constexpr Index kAmxValueGroups = 2;
/// Column segments (of a half block) the AMX form prefetches ahead in its read order, into L1
/// (`prefetcht0`, also in the partial halves of a range's last block: `prefetch_chunk<true>`).
/// Measured (16 queries, d = 128, 2 threads, Intel AMX): 8 segments ahead
/// into L2 (`prefetcht1`, before) cost 3-5% from L3 (m = 32768) and 2-3% from DRAM (m = 262144)
/// against 4 ahead into L1; a bare rounding loop in this read order ran at the streaming-read rate
/// with 2-4 segments into L1 and 10% below it with 8 into L2 (a prefetch into L2 holds a fill
/// buffer as a demand miss does, and the load then misses L1 again).
constexpr Index kAmxPrefetch = 4;

/// 16 values of a column (lanes outside `k` zero) as bf16 values in fp32: float inputs rounded,
/// bf16 inputs widened.
EFFATTN_TARGET_AVX512 inline __m512 load16_bf16(const float* p, __mmask16 k) noexcept {
  return bf16_round16(_mm512_maskz_loadu_ps(k, p));
}
EFFATTN_TARGET_AVX512 inline __m512 load16_bf16(const Eigen::bfloat16* p, __mmask16 k) noexcept {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(sll16(_mm512_maskz_cvtepu16_epi32(kDecodeAll, h)));
}

/// The lanes below `count` (all when count >= 16, none when count <= 0).
inline __mmask16 lanes_below(Index count) noexcept {
  return count >= 16 ? kDecodeAll : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1u);
}

/// The keys of the block at j0 of the key range [.., k1): `cnt` keys in `chunks` 16-key chunks
/// (`c32` 32-key chunks), the lanes of the last 16-key chunk (`tail`) and the keys of the next
/// block (`next`, 0 at the end; its K columns are prefetched).
struct DecodeBlock {
  Index cnt, chunks, c32, next;
  __mmask16 tail;
  DecodeBlock(Index j0, Index k1, Index block) noexcept
      : cnt(std::min(block, k1 - j0)),
        chunks((cnt + 15) / 16),
        c32((cnt + 31) / 32),
        next(std::min(block, std::max<Index>(0, k1 - j0 - block))),
        tail(lanes_below(cnt - 16 * (chunks - 1))) {}
};

/// One decoding problem: the scaled queries and the column-major inputs.
template <typename In>
struct FusedDecodeProblem {
  const float* q = nullptr;  ///< rows x d, row-major: bf16(scale Q), or scale Q in fp32
  Index rows = 0, d = 0, dv = 0;
  const In* K = nullptr;  ///< m x d, column-major, leading dimension ldk
  const In* V = nullptr;  ///< m x dv, column-major, leading dimension ldv
  Index ldk = 0, ldv = 0;
  const float* bias = nullptr;  ///< m key biases or null
  bool causal = false;
  Index off = 0;  ///< causal: row i sees keys j <= i + off
};

/// Zero-initialised 32-bit words whose first word is 64-byte aligned, so that no zmm store or
/// tile row straddles two cache lines (std::vector gives 16 bytes: measured, the AMX form's K
/// buffer started 48 bytes into a line and its P^T tiles 16). Not copyable (the pointer points
/// into the owned storage).
class AlignedWords {
 public:
  explicit AlignedWords(std::size_t n) : m_v(n > 0 ? n + 15 : 0, 0u) {
    if (n > 0) {
      const auto a = reinterpret_cast<std::uintptr_t>(m_v.data());
      m_p = m_v.data() + (64 - a % 64) % 64 / sizeof(std::uint32_t);
    }
  }
  AlignedWords(const AlignedWords&) = delete;
  AlignedWords& operator=(const AlignedWords&) = delete;
  std::uint32_t* data() noexcept { return m_p; }

 private:
  std::vector<std::uint32_t> m_v;
  std::uint32_t* m_p = nullptr;
};

/// The state of one key range: the scores of a block (column i = row i), the unnormalised output
/// (row i = query row i, so that an output column of all rows is one vector), the running
/// maxima and row sums, and (16-row form) the probabilities in bf16 pairs.
struct FusedDecodeState {
  static constexpr Index R = kFusedDecodeWideRows;
  Matrix<float> s, acc;
  AlignedWords pp;  ///< R x (block / 2) pairs: row i's 32-key chunk t at (i c32 + t) 16
  /// AMX form (`fused_decode_keys_amx`): the block's K as `tdpbf16ps` B tiles (kb), the V^T A
  /// tiles of `kAmxValueGroups` groups of 16 value columns (vb) and the P^T B tiles (pt).
  AlignedWords kb, vb, pt;
  float m[R];
  double l[R];
  /// acc has dv columns, rounded up to a multiple of 16 for the AMX form (`amx_d` = d > 0).
  FusedDecodeState(Index dv, bool wide, Index amx_d = 0)
      : s(kFusedDecodeScoreStride, R),
        acc(R, amx_d > 0 ? round_up(dv, 16) : dv),
        pp(wide ? static_cast<std::size_t>(R * kFusedDecodeBlock / 2) : 0),
        kb(amx_d > 0 ? static_cast<std::size_t>(2 * 16 * kAmxKStride * 16) : 0),
        vb(amx_d > 0 ? static_cast<std::size_t>(2 * 16 * kAmxValueGroups * kAmxVStride * 16) : 0),
        pt(amx_d > 0 ? static_cast<std::size_t>(R * kFusedDecodeBlock / 2) : 0) {}
  void reset() {
    acc.setZero();
    std::fill(m, m + R, -std::numeric_limits<float>::infinity());
    std::fill(l, l + R, 0.0);
  }
};

/// Prefetches the 16-value chunk `ch` of the column segment at `p` (null: none) when it lies
/// within the segment's first `valid` values: into L2, or into L1 when `IntoL1` (the AMX form,
/// see `kAmxPrefetch`).
///
/// For bf16 inputs a chunk is half a 64-byte line, so the FMA forms prefetch each line twice, a
/// chunk apart; that stays on purpose. Measured (Intel Xeon with AMX, 2 threads, d = 128,
/// m = 32768, alternating with a parallel sum of the same bytes): one prefetch per
/// line (even chunks only) ran 4 queries at 0.47-0.53 of the sum's rate against 0.56-0.60 (1
/// query: no change), unlike the AMX form's L1 prefetches (`fused_decode_keys_amx`), where one
/// per line was a little faster. Prefetching into L1 instead of L2 in the FMA forms was 5-10%
/// faster from L3 (m = 32768; float and bf16 inputs, 1 and 4 queries) and 2-15% slower from
/// DRAM (m = 262144); 8 segments ahead into L1 as fast as 4 into L2 in both; a prefetch of
/// every line into L2 8 segments ahead plus into L1 4 ahead 10-40% slower. So L2, 4 ahead.
template <bool IntoL1 = false, typename In>
EFFATTN_TARGET_AVX512 inline void prefetch_chunk(const In* p, Index ch, Index valid) noexcept {
  if (p != nullptr && ch * 16 < valid) {
    if constexpr (IntoL1)
      _mm_prefetch(reinterpret_cast<const char*>(p + ch * 16), _MM_HINT_T0);
    else
      _mm_prefetch(reinterpret_cast<const char*>(p + ch * 16), _MM_HINT_T1);
  }
}

/// Column segment t of the read order around the block at key j0 (`cnt` keys, `next` keys in
/// the following block): t < d is K's column t, then V's columns, then the next block's K
/// columns; null past those. `valid` receives the segment's length.
template <typename In>
inline const In* decode_segment(const FusedDecodeProblem<In>& P, Index t, Index j0, Index cnt,
                                Index next, Index& valid) noexcept {
  valid = cnt;
  if (t < P.d) return P.K + t * P.ldk + j0;
  if ((t -= P.d) < P.dv) return P.V + t * P.ldv + j0;
  valid = next;
  if (next > 0 && (t -= P.dv) < P.d) return P.K + t * P.ldk + j0 + kFusedDecodeBlock;
  valid = 0;
  return nullptr;
}

/// 16 values of a column (lanes outside `k` zero): rounded to bf16 when `Bf16`, as they are
/// otherwise (float inputs only).
template <bool Bf16, typename In>
EFFATTN_TARGET_AVX512 inline __m512 load16_values(const In* p, __mmask16 k) noexcept {
  if constexpr (Bf16)
    return load16_bf16(p, k);
  else
    return _mm512_maskz_loadu_ps(k, p);
}

/// Zeroes the first `chunks` 16-key chunks of the score rows 0 .. rows - 1 (row i at s + i B).
EFFATTN_TARGET_AVX512 inline void clear_scores(float* s, Index rows, Index chunks) noexcept {
  for (Index i = 0; i < rows; ++i)
    for (Index ch = 0; ch < chunks; ++ch)
      _mm512_storeu_ps(s + i * kFusedDecodeScoreStride + ch * 16, _mm512_setzero_ps());
}

/// Softmax of the block at j0 (`cnt` keys in `chunks` 16-key chunks) for NR rows (the first
/// `rows` of them), whose scores
/// are in st.s (column i = row i): adds the bias, hides the keys a causal row does not see,
/// collects in `bad` the lanes whose raw score was not finite, updates the lazy running maximum
/// (rescaling st.acc and st.l when a block exceeds it by more than `kDecodeLazyMax`), adds the
/// block's sum of exp(s - m) to st.l and leaves P = exp(s - m) in st.s, rounded to bf16 when
/// `RoundP`, 0 for hidden keys and the lanes past the block.
struct DecodeNoHook {
  void operator()(Index) const noexcept {}
};
template <int NR, bool RoundP, typename In, typename Hook = DecodeNoHook>
EFFATTN_TARGET_AVX512 inline void decode_block_softmax(const FusedDecodeProblem<In>& P, Index j0,
                                                       Index cnt, Index chunks,
                                                       FusedDecodeState& st, __mmask16& bad,
                                                       Index rows = NR, Hook hook = Hook()) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  float* s = st.s.data();
  for (int i = 0; i < static_cast<int>(rows); ++i) {
    float* si = s + i * kFusedDecodeScoreStride;
    const Index visible = P.causal ? std::min(cnt, i + P.off + 1 - j0) : cnt;
    // Four independent maxima (the maximum is exact in any order: 16 rows x 32 dependent max
    // instructions were a chain of ~2000 cycles per block); a chunk without a bias whose keys
    // are all visible is left as it is (no store).
    __m512 mx[4] = {_mm512_set1_ps(ninf), _mm512_set1_ps(ninf), _mm512_set1_ps(ninf),
                    _mm512_set1_ps(ninf)};
    for (Index c0 = 0; c0 < chunks; c0 += 4) {
      EFFATTN_UNROLL8
      for (Index u = 0; u < 4; ++u) {
        const Index ch = c0 + u;
        if (ch >= chunks) break;
        const __mmask16 k = lanes_below(visible - ch * 16);
        __m512 v = _mm512_loadu_ps(si + ch * 16);
        // x - x is NaN exactly for NaN and +-inf (lanes past the block's keys hold 0).
        bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (P.bias != nullptr || k != kDecodeAll) {
          if (P.bias != nullptr)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, P.bias + j0 + ch * 16));
          v = _mm512_mask_blend_ps(k, _mm512_set1_ps(ninf), v);
          _mm512_storeu_ps(si + ch * 16, v);
        }
        mx[u] = _mm512_maskz_max_ps(kDecodeAll, mx[u], v);
      }
    }
    const float bm =
        decode_hmax16(_mm512_maskz_max_ps(kDecodeAll, _mm512_maskz_max_ps(kDecodeAll, mx[0], mx[1]),
                                          _mm512_maskz_max_ps(kDecodeAll, mx[2], mx[3])));
    if (bm == ninf) {  // no visible key in this block
      for (Index ch = 0; ch < chunks; ++ch) _mm512_storeu_ps(si + ch * 16, _mm512_setzero_ps());
      hook(i);
      continue;
    }
    if (!(bm <= st.m[i] + kDecodeLazyMax)) {  // first block, or a maximum far above m
      const float alpha = st.m[i] == ninf ? 0.0f : std::exp(st.m[i] - bm);
      st.acc.row(i) *= alpha;
      st.l[i] *= static_cast<double>(alpha);
      st.m[i] = bm;
    }
    const __m512 mv = _mm512_set1_ps(st.m[i]);
    __m512 sum = _mm512_setzero_ps();
    for (Index ch = 0; ch < chunks; ++ch) {
      const __m512 e = decode_exp16(_mm512_sub_ps(_mm512_loadu_ps(si + ch * 16), mv));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(si + ch * 16, RoundP ? bf16_round16(e) : e);
    }
    st.l[i] += static_cast<double>(decode_hsum16(sum));
    hook(i);
  }
}

/// 16 bf16 pairs (x_k, y_k) in 32-bit lanes (x in the low half) from two key columns (lanes
/// outside `k` zero, y null: zeros): floats rounded to nearest even, bf16 widened.
EFFATTN_TARGET_AVX512 inline __m512i decode_column_pairs(const float* x, const float* y,
                                                         __mmask16 k) noexcept {
  return bf16_vnni_pairs(_mm512_maskz_loadu_ps(k, x),
                         y != nullptr ? _mm512_maskz_loadu_ps(k, y) : _mm512_setzero_ps());
}
/// The word order that interleaves two halves of 16 words (x in words 0-15, y in 16-31) into
/// pairs (x_k, y_k): as `vcvtne2ps2bf16 (y, x)` leaves them.
alignas(64) inline constexpr std::uint16_t kDecodeInterleave[32] = {
    0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
/// bf16 inputs: the two 16-word loads side by side, interleaved by one word permutation (2
/// instructions besides the loads; widening both to 32 bits, shifting and or-ing took 4, which
/// for bf16 inputs was most of the rounding pass's arithmetic). The same bits.
EFFATTN_TARGET_AVX512 inline __m512i decode_column_pairs(const Eigen::bfloat16* x,
                                                         const Eigen::bfloat16* y,
                                                         __mmask16 k) noexcept {
  const __m256i hi = y != nullptr ? _mm256_maskz_loadu_epi16(k, y) : _mm256_setzero_si256();
  return _mm512_permutexvar_epi16(
      _mm512_load_si512(kDecodeInterleave),
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi16(k, x)), hi, 1));
}

/// 32 consecutive values of a column (the first `count` of them; the rest zero) as 16 bf16 pairs
/// of neighbouring keys, (v_2k, v_2k+1) in lane k: the layout of `vdpbf16ps` operands that pair
/// keys. Floats rounded to nearest even.
EFFATTN_TARGET_AVX512BF16 inline __m512bh decode_key_pairs(const float* v, Index count) noexcept {
  return _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(lanes_below(count - 16), v + 16),
                             _mm512_maskz_loadu_ps(lanes_below(count), v));
}
EFFATTN_TARGET_AVX512BF16 inline __m512bh decode_key_pairs(const Eigen::bfloat16* v,
                                                           Index count) noexcept {
  const __mmask32 k = count >= 32  ? ~__mmask32(0)
                      : count <= 0 ? __mmask32(0)
                                   : static_cast<__mmask32>((std::uint32_t(1) << count) - 1u);
  return (__m512bh)_mm512_maskz_loadu_epi16(k, v);
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
