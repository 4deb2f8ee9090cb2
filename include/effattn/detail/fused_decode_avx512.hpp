/// \file fused_decode_avx512.hpp
/// \brief The fused decoding kernel of exact attention on AVX-512: a few queries against a
/// column-major K and V (float or bf16), read once, column segment by column segment, with the
/// products and the online softmax fused into the read. Four forms: bf16 with 1-4 queries, with
/// 5-16 queries on the avx512bf16 path (`vdpbf16ps`) and with 5-16 queries on the AMX path (tile
/// products, `fused_decode_keys_amx`), all `policy::TiledBf16`, and fp32 with 1-16 queries (float
/// `policy::Tiled`, the FMA form without the roundings, 1, 2, 4, 8 or 16 rows).
///
/// Decoding reads the whole cache for a handful of flops per key, so the read is the cost. The
/// tile kernels this replaces rounded a 1024-key tile of K or V into a cache-resident buffer and
/// then multiplied it (the read and the products took turns on a core), and the caller scanned
/// K and V for NaN/Inf before the call (a second read): 30-49% of the streaming-read rate for one
/// query (bf16), 7-9% for fp32 Tiled (GEMMs of 1-4 rows). This kernel keeps the arithmetic of
/// the other paths (bf16: q = bf16(scale Q), bf16 keys and values, products exact in fp32, fp32
/// sums, P rounded to bf16 before the P V product) and computes while it reads:
/// - keys, in blocks of `kFusedDecodeBlock` (512): for each column c the block's segment
///   K[j0 : j0 + 512, c] (2 KiB of float, contiguous) is rounded to bf16 in registers and
///   s_i += q_ic K[., c] accumulated into the scores of the rows, held in L1: 1-4 rows (fp32:
///   up to 16) with FMAs, 4 columns per pass over the scores; 5-16 rows (16 score rows, the extra
///   queries zero) with `vdpbf16ps` on pairs of columns, 8 columns per pass (the AMX form:
///   `fused_decode_keys_amx`);
/// - softmax per block (`decode_block_softmax`): bias, causal mask, block maximum, a lazy
///   running maximum (the accumulator is rescaled only when a block's maximum exceeds the
///   reference by more than `kDecodeLazyMax`, as in decode_avx512.hpp), p = exp(s - m) summed in
///   fp32 per block and into a double row sum across blocks, p rounded to bf16;
/// - values: for each column c, o_ic += sum_j p_ij V[j, c] over the block's segment: FMA forms
///   with 1, 2 or 4 independent 16-lane partial sums per row, reduced once per column; 5-16 rows
///   with `vdpbf16ps` on pairs of neighbouring keys (a bf16 column is already in that layout),
///   16 accumulators reduced by one shuffle tree per column.
/// Column segments are read in the order K columns, V columns, next block's K columns, with
/// software prefetches of the segments a few columns ahead: each segment starts in a new page (a
/// column of a long cache is its own run of pages), where the hardware prefetchers stop.
/// The scores are checked for NaN/Inf as they are produced (before bias and mask), which with
/// finite queries catches every non-finite key; a non-finite value makes the output non-finite,
/// so the callers scan K and V only when something was not finite.
///
/// The FMA forms need AVX512F/BW/VL (both x86 bf16 paths imply them), the `vdpbf16ps` form
/// AVX512-BF16 (both x86 bf16 paths have it), the AMX form AMX-TILE and AMX-BF16.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "../core/isa.hpp"
#include "../core/online_softmax.hpp"
#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "bf16_amx.hpp"
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
/// Measured (16 queries, d = 128, 2 threads, Intel Xeon with AMX, 2026-12-04): 8 segments ahead
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
/// m = 32768, alternating with a parallel sum of the same bytes, 2026-12-04): one prefetch per
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

/// 16 bf16 pairs (x_k, y_k) of two key columns as `decode_column_pairs`, rounded by
/// `vcvtne2ps2bf16` and interleaved by one word permutation (fewer instructions than the integer
/// rounding; the same bits for finite inputs other than denormals, which the tile products treat
/// as zero anyway). bf16 inputs are only interleaved.
EFFATTN_TARGET_AVX512BF16 inline __m512i decode_column_pairs_cvt(const float* x, const float* y,
                                                                 __mmask16 k) noexcept {
  const __m512bh h =
      _mm512_cvtne2ps_pbh(y != nullptr ? _mm512_maskz_loadu_ps(k, y) : _mm512_setzero_ps(),
                          _mm512_maskz_loadu_ps(k, x));
  return _mm512_permutexvar_epi16(_mm512_load_si512(kDecodeInterleave), (__m512i)h);
}
EFFATTN_TARGET_AVX512BF16 inline __m512i decode_column_pairs_cvt(const Eigen::bfloat16* x,
                                                                 const Eigen::bfloat16* y,
                                                                 __mmask16 k) noexcept {
  return decode_column_pairs(x, y, k);
}

/// Transposes the 16 x 16 matrix of 32-bit lanes r[i] (row i) in place: r[k] lane i becomes the
/// old r[i] lane k. 64 shuffles (unpacks within 128-bit lanes, then 128-bit lane shuffles).
EFFATTN_TARGET_AVX512 inline void transpose16_epi32(__m512i r[16]) noexcept {
  __m512i a[16], b[16];
  for (int j = 0; j < 8; ++j) {
    a[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    a[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  // b[4 j + e], 128-bit lane L: rows 4 j .. 4 j + 3 of column 4 L + e.
  for (int j = 0; j < 4; ++j) {
    b[4 * j] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
    b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88),
                  x1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xDD),
                  y0 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88),
                  y1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

/// Column segment t of the AMX form's read order around the block at j0 (`cnt` keys, `next` in
/// the following block): K's columns over the block's first half, over its second half, V's
/// columns over the first half, over the second, then the next block's K columns over its first
/// half; null past those or where a half is empty. `valid` receives the segment's length.
template <typename In>
inline const In* amx_segment(const FusedDecodeProblem<In>& P, Index t, Index j0, Index cnt,
                             Index next, Index& valid) noexcept {
  constexpr Index H = kAmxHalf;
  const Index d = P.d, dv = P.dv;
  const In* p = nullptr;
  valid = 0;
  if (t < 2 * d) {
    const Index h = t / d;
    valid = h == 0 ? std::min(H, cnt) : cnt - H;
    p = P.K + (t - h * d) * P.ldk + j0 + h * H;
  } else if ((t -= 2 * d) < 2 * dv) {
    const Index h = t / dv;
    valid = h == 0 ? std::min(H, cnt) : cnt - H;
    p = P.V + (t - h * dv) * P.ldv + j0 + h * H;
  } else if ((t -= 2 * dv) < d) {
    valid = std::min(H, next);
    p = P.K + t * P.ldk + j0 + kFusedDecodeBlock;
  }
  return valid > 0 ? p : nullptr;
}

/// The AMX form of `fused_decode_keys` (bf16 arithmetic, `rows` = 1 to 16 queries; the caller
/// holds an `AmxTileScope`): per 512-key block, in two halves of `kAmxHalf` keys for the
/// roundings,
/// - per half and d-tile (32 columns of K: one "item"), the column pairs (two contiguous
///   segments) rounded into the 16 rows of `tdpbf16ps` B tiles (st.kb, two buffers of 17 KiB:
///   pair p's 16-key chunk ch at (p kAmxKStride + ch) 16, a tile is 16 rows of stride
///   kAmxKStride 64 bytes), and the partial scores of the half's chunks (st.s, row i at
///   s + i kFusedDecodeScoreStride) += the query tile of the d-tile (qt: 16 rows x 32 bf16 per
///   d-tile, row stride dq 64 bytes) times the K tiles, 4 chunks at a time (the first d-tile
///   starts from zero tiles, the others load the partial sums: the same sums in the same order
///   as one accumulator tile per chunk over all d-tiles). The tile products of item k - 1 run
///   interleaved with the rounding of item k into the other buffer;
/// - the block softmax of the `rows` rows, P rounded to bf16 pairs of neighbouring keys and
///   transposed into P^T B tiles (st.pt: chunk t at t 256, row k = the pairs of keys 2 k, 2 k + 1
///   of the 16 rows; rows past `rows` stay zero), with the first value item rounded in between;
/// - per half and `kAmxValueGroups` groups of 16 value columns (an item), V's segments rounded
///   into V^T A tiles (st.vb, two buffers of 18 KiB: column r's 32-key chunk t at
///   (r kAmxVStride + t) 16) and, interleaved with the rounding of the next item, acc^T (the
///   column-major st.acc, 16 columns x 16 rows per tile) += V^T P^T.
/// The buffers are 64-byte aligned and fit L1 together. Measured (16 queries, d = 128, m = 32768,
/// 2 threads): with whole-block buffers (128 KiB of K pairs, 64 KiB of V^T per 4 groups) the
/// stores that rounded K and V missed L1 and took two thirds of the time (50-57% of the
/// streaming read; now 60-64%). The products are exact and accumulated in fp32 as in the other
/// forms, in another order (the results differ from them by fp32 round-off). 2 x 16 (k1 - k0)
/// (d + dv) flops of tile products; reads each key and value once.
template <typename In>
EFFATTN_TARGET_AMX bool fused_decode_keys_amx(const FusedDecodeProblem<In>& P,
                                              const std::uint32_t* qt, Index rows, Index k0,
                                              Index k1, FusedDecodeState& st) {
  constexpr Index B = kFusedDecodeBlock, H = kAmxHalf, PF = kAmxPrefetch, R = FusedDecodeState::R;
  constexpr Index KS = kAmxKStride, VS = kAmxVStride, NG = kAmxValueGroups;
  constexpr Index KBUF = 16 * KS * 16, VBUF = 16 * NG * VS * 16;  // words per buffer
  static_assert(NG == 2, "the value pass runs two accumulator tiles");
  // The score tiles of an item run as 4 groups of 4 chunks, one group after every 4 of its 16
  // pairs: at most 16 chunks (256 keys) per half.
  static_assert(H % 32 == 0 && H / 16 <= 16, "a half is at most 16 chunks of 16 keys");
  const Index d = P.d, dv = P.dv, dq = (d + 31) / 32, dp = (d + 1) / 2, groups = (dv + 15) / 16;
  const Index ngp = (groups + NG - 1) / NG;  // value-column group pairs
  float* s = st.s.data();
  float* acc = st.acc.data();
  std::uint32_t* kb = st.kb.data();
  std::uint32_t* vb = st.vb.data();
  std::uint32_t* pt = st.pt.data();
  __mmask16 bad = 0;
  for (Index j0 = k0; j0 < k1; j0 += B) {
    const DecodeBlock blk(j0, k1, B);
    const Index cnt = blk.cnt, c32 = blk.c32, next = blk.next, halves = (cnt + H - 1) / H;
    // --- Scores. Item k = (half k / dq, d-tile k % dq); step k rounds item k into buffer k % 2
    // and, interleaved with it (one 4-chunk group after every 4 pairs), runs the tile products
    // of item k - 1 from the other buffer, so that the tile unit works while the loads of the
    // roundings wait for memory.
    const Index kitems = halves * dq;
    auto k_pair = [&](Index item, Index pl) EFFATTN_TARGET_AMX {
      const Index h = item / dq, t = item % dq, hk = h * H, hc = std::min(H, cnt - hk);
      const Index hchunks = (hc + 15) / 16, p = 16 * t + pl;
      std::uint32_t* dst = kb + (item % 2) * KBUF + pl * KS * 16;
      if (p >= dp) {  // pairs past d: zero rows
        for (Index ch = 0; ch < hchunks; ++ch)
          _mm512_storeu_si512(dst + ch * 16, _mm512_setzero_si512());
        return;
      }
      const Index c = 2 * p;
      const In* x = P.K + c * P.ldk + j0 + hk;
      const In* y = c + 1 < d ? x + P.ldk : nullptr;
      Index v0 = 0, v1 = 0;
      // Prefetches may run past a short segment: they never fault.
      const In* pf0 = amx_segment(P, h * d + c + PF, j0, cnt, next, v0);
      const In* pf1 = amx_segment(P, h * d + c + 1 + PF, j0, cnt, next, v1);
      if (hc == H && y != nullptr) {
        // A whole half: no masks, and prefetches without bounds (past a short or missing
        // segment they fetch lines that are not needed, and never fault).
        const In* q0 = pf0 != nullptr ? pf0 : x;
        const In* q1 = pf1 != nullptr ? pf1 : y;
        EFFATTN_UNROLL16
        for (Index ch = 0; ch < H / 16; ++ch) {
          if (sizeof(In) == 4 || ch % 2 == 0) {  // one per 64-byte line
            _mm_prefetch(reinterpret_cast<const char*>(q0 + ch * 16), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(q1 + ch * 16), _MM_HINT_T0);
          }
          _mm512_storeu_si512(dst + ch * 16,
                              decode_column_pairs_cvt(x + ch * 16, y + ch * 16, kDecodeAll));
        }
        return;
      }
      const __mmask16 tail = lanes_below(hc - 16 * (hchunks - 1));
      for (Index ch = 0; ch < hchunks; ++ch) {
        const __mmask16 k = ch + 1 < hchunks ? kDecodeAll : tail;
        prefetch_chunk<true>(pf0, ch, v0);
        prefetch_chunk<true>(pf1, ch, v1);
        _mm512_storeu_si512(
            dst + ch * 16,
            decode_column_pairs_cvt(x + ch * 16, y != nullptr ? y + ch * 16 : nullptr, k));
      }
    };
    // Partial scores of item's chunks 4 g .. 4 g + 3: tiles 0-3 accumulate (the first d-tile
    // starts from zero, the others load the partial sums: the same sums in the same order as one
    // accumulator per chunk over all d-tiles), 4 holds the query tile, 5-7 the key tiles.
    auto k_tiles = [&](Index item, Index g) EFFATTN_TARGET_AMX {
      const Index h = item / dq, t = item % dq, hk = h * H, hc = std::min(H, cnt - hk);
      const Index hchunks = (hc + 15) / 16, ch = 4 * g;
      if (ch >= hchunks) return;
      const Index nc = std::min<Index>(4, hchunks - ch);
      float* sc = s + hk + ch * 16;
      if (t == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, sc, kFusedDecodeScoreStride * 4);
        if (nc > 1) _tile_loadd(1, sc + 16, kFusedDecodeScoreStride * 4);
        if (nc > 2) _tile_loadd(2, sc + 32, kFusedDecodeScoreStride * 4);
        if (nc > 3) _tile_loadd(3, sc + 48, kFusedDecodeScoreStride * 4);
      }
      const std::uint32_t* kt = kb + (item % 2) * KBUF + ch * 16;
      _tile_loadd(5, kt, KS * 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nc > 1) {
        _tile_loadd(6, kt + 16, KS * 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nc > 2) {
        _tile_loadd(7, kt + 32, KS * 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (nc > 3) {
        _tile_loadd(5, kt + 48, KS * 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, sc, kFusedDecodeScoreStride * 4);
      if (nc > 1) _tile_stored(1, sc + 16, kFusedDecodeScoreStride * 4);
      if (nc > 2) _tile_stored(2, sc + 32, kFusedDecodeScoreStride * 4);
      if (nc > 3) _tile_stored(3, sc + 48, kFusedDecodeScoreStride * 4);
    };
    for (Index k = 0; k <= kitems; ++k) {
      if (k > 0) _tile_loadd(4, qt + ((k - 1) % dq) * 16, dq * 64);
      for (Index pl = 0; pl < 16; ++pl) {
        if (k < kitems) k_pair(k, pl);
        if (k > 0 && pl % 4 == 3) k_tiles(k - 1, pl / 4);
      }
      EFFATTN_TILE_MEMORY_BARRIER();
    }
    // --- Values. Item k = (half k / ngp, group pair k % ngp): step k rounds item k's value
    // columns into V^T buffer k % 2 (item 0 during the softmax) and, interleaved with it, runs
    // the acc^T += V^T P^T steps of item k - 1 (the rows of a partial last group are stale values
    // that only reach acc's padding columns).
    const Index vitems = halves * ngp;
    auto v_cols = [&](Index item) {
      const Index g0 = NG * (item % ngp);
      return std::min(dv, 16 * (g0 + NG)) - 16 * g0;
    };
    auto v_col = [&](Index item, Index cl) EFFATTN_TARGET_AMX {
      const Index h = item / ngp, g0 = NG * (item % ngp), hk = h * H, hc = std::min(H, cnt - hk);
      const Index h32 = (hc + 31) / 32, c = 16 * g0 + cl;
      const In* vc = P.V + c * P.ldv + j0 + hk;
      Index pfv = 0;
      const In* pf = amx_segment(P, 2 * d + h * dv + c + PF, j0, cnt, next, pfv);
      std::uint32_t* dst = vb + (item % 2) * VBUF + cl * VS * 16;
      const Index full = hc / 32;  // chunks of 32 keys without a tail
      if (full == H / 32) {
        const In* q = pf != nullptr ? pf : vc;  // unbounded prefetches, as for K
        EFFATTN_UNROLL16
        for (Index t = 0; t < H / 32; ++t) {
          _mm_prefetch(reinterpret_cast<const char*>(q + 32 * t), _MM_HINT_T0);
          if (sizeof(In) == 4)  // one per 64-byte line
            _mm_prefetch(reinterpret_cast<const char*>(q + 32 * t + 16), _MM_HINT_T0);
          _mm512_storeu_si512(dst + t * 16, (__m512i)decode_key_pairs(vc + 32 * t, Index(32)));
        }
        return;
      }
      for (Index t = 0; t < full; ++t) {
        prefetch_chunk<true>(pf, 2 * t, pfv);
        prefetch_chunk<true>(pf, 2 * t + 1, pfv);
        _mm512_storeu_si512(dst + t * 16, (__m512i)decode_key_pairs(vc + 32 * t, Index(32)));
      }
      if (full < h32)
        _mm512_storeu_si512(dst + full * 16,
                            (__m512i)decode_key_pairs(vc + 32 * full, hc - 32 * full));
    };
    // One 32-key step t of item's tile products (tiles 0, 1: acc^T of the two groups, 4: P^T,
    // 5, 6: V^T).
    auto v_tiles = [&](Index item, Index t) EFFATTN_TARGET_AMX {
      const Index hk = (item / ngp) * H, two = v_cols(item) > 16;
      const std::uint32_t* vt = vb + (item % 2) * VBUF + t * 16;
      _tile_loadd(4, pt + (hk / 32 + t) * 256, 64);
      _tile_loadd(5, vt, VS * 64);
      _tile_dpbf16ps(0, 5, 4);
      if (two) {
        _tile_loadd(6, vt + 16 * VS * 16, VS * 64);
        _tile_dpbf16ps(1, 6, 4);
      }
    };
    // Value item 0 is rounded while the softmax and the transposes run (vector arithmetic on
    // data in L1, while the roundings wait for memory): spread over the rows and the chunks.
    const Index cols0 = v_cols(0), slots = rows + c32;
    Index vdone = 0, slot = 0;
    auto v_ahead = [&](Index) EFFATTN_TARGET_AMX {
      ++slot;
      for (; vdone < cols0 && vdone * slots < slot * cols0; ++vdone) v_col(0, vdone);
    };
    decode_block_softmax<R, false>(P, j0, cnt, blk.chunks, st, bad, rows, v_ahead);
    // P^T: row i's 32-key chunk t as 16 pairs (zero past `rows`), transposed into the tile
    // (k, i).
    for (Index t = 0; t < c32; ++t) {
      __m512i r[16];
      const __mmask16 lo = lanes_below(cnt - 32 * t), hi = lanes_below(cnt - 32 * t - 16);
      EFFATTN_UNROLL16
      for (Index i = 0; i < 16; ++i) {
        const float* si = s + i * kFusedDecodeScoreStride + 32 * t;
        r[i] = i < rows ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, si + 16),
                                                       _mm512_maskz_loadu_ps(lo, si))
                        : _mm512_setzero_si512();
      }
      v_ahead(t);
      transpose16_epi32(r);
      EFFATTN_UNROLL16
      for (Index k = 0; k < 16; ++k) _mm512_storeu_si512(pt + t * 256 + k * 16, r[k]);
    }
    for (; vdone < cols0; ++vdone) v_col(0, vdone);
    EFFATTN_TILE_MEMORY_BARRIER();
    for (Index k = 1; k <= vitems; ++k) {
      const Index cols = k < vitems ? v_cols(k) : 0;
      Index steps = 0, h32 = 0, two = 0;
      float* a = nullptr;
      if (k > 0) {
        const Index it = k - 1, hk = (it / ngp) * H;
        h32 = (std::min(H, cnt - hk) + 31) / 32;
        two = v_cols(it) > 16;
        a = acc + NG * (it % ngp) * 256;
        _tile_loadd(0, a, 64);
        if (two) _tile_loadd(1, a + 256, 64);
      }
      for (Index cl = 0; cl < cols; ++cl) {
        v_col(k, cl);
        // Spread item k - 1's steps evenly over the columns of item k.
        for (; k > 0 && steps < h32 && steps * cols < (cl + 1) * h32; ++steps)
          v_tiles(k - 1, steps);
      }
      if (k > 0) {
        for (; steps < h32; ++steps) v_tiles(k - 1, steps);
        _tile_stored(0, a, 64);
        if (two) _tile_stored(1, a + 256, 64);
      }
      EFFATTN_TILE_MEMORY_BARRIER();
    }
  }
  return bad == 0;
}

/// This thread's `FusedDecodeState` for (dv, wide, amx_d), kept across calls (one per thread;
/// rebuilt when the form or the widths change). The AMX form's tile buffers are about 250 KiB at
/// d = 128: allocated per call, glibc handed the thread's arena back to the OS after each call and
/// every call page-faulted it in again (measured, 16 queries, d = 128, one thread, m = 1024:
/// 90 -> 49 us per call with allocation kept; m = 32768, 2 threads: 27.6 -> 29.5 GB/s). Every
/// buffer is rewritten before it is read, except the zero padding of `kb` (the pairs past d),
/// which no call writes for the same d, and the rows of `vb` past dv, which reach only the
/// padding columns of `acc` (as in a fresh state). \returns a reference valid until this
/// thread's next call.
inline FusedDecodeState& fused_decode_state(Index dv, bool wide, Index amx_d) {
  struct Cached {
    std::unique_ptr<FusedDecodeState> st;
    Index dv = -1, amx_d = -1;
    bool wide = false;
  };
  thread_local Cached c;
  if (!c.st || c.dv != dv || c.wide != wide || c.amx_d != amx_d) {
    c.st.reset();  // the old buffers go before the new ones are allocated
    c.st = std::make_unique<FusedDecodeState>(dv, wide, amx_d);
    c.dv = dv;
    c.wide = wide;
    c.amx_d = amx_d;
  }
  return *c.st;
}

/// Fused decoding (`Bf16`: the TiledBf16 arithmetic; otherwise fp32, In = float): out (n x dv)
/// and lse (n) for n <= `kFusedDecodeFp32MaxRows` queries (`kFusedDecodeWideRows` when Bf16;
/// `amx`: the AMX form from `kFusedDecodeAmxMinRows` queries), key ranges as `plan.kv_splits` says
/// (32-aligned, as the tile kernels split), merged by log-sum-exp. Thread-count independent. Needs
/// AVX512F (an x86 bf16 path was selected). O(splits n dv) memory. \returns false if a raw score
/// was not finite (see `fused_decode_keys`): K and V are checked by the kernel and the caller's
/// look at the output, not scanned beforehand.
template <bool Bf16, typename In>
bool fused_decode_run(const Eigen::Ref<const Matrix<In>>& Q, const Eigen::Ref<const Matrix<In>>& K,
                      const Eigen::Ref<const Matrix<In>>& V, const float* bias, float scale,
                      bool causal, const TilePlan& plan, Matrix<float>& out, Vector<float>& lse,
                      bool amx = false) {
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  amx = Bf16 && amx && n >= kFusedDecodeAmxMinRows;
  // FMA forms (bf16: 1-4 rows; fp32: 1-16): the scaled queries (rounded to bf16 when Bf16),
  // row-major, zero rows up to the form's. bf16 with 5-16 rows: 16 rows of query pairs
  // (bf16(s Q_i,2p), bf16(s Q_i,2p+1)), zero past the queries and d, with a row stride of
  // ceil(d / 2) pairs (vdpbf16ps form) or of whole 16-pair d-tiles (AMX form: 32 bf16 per tile
  // row).
  const bool wide = Bf16 && !amx && n > kFusedDecodeMaxRows, pairs = wide || amx;
  // The rows of the FMA form that runs (the extra rows are zero queries).
  const Index nr = n <= 2 ? n : n <= 4 ? 4 : n <= 8 ? 8 : 16;
  const Index dp = (d + 1) / 2, qs = amx ? round_up(d, 32) / 2 : dp;
  std::vector<float> q(pairs ? 0 : static_cast<std::size_t>(nr * d), 0.0f);
  std::vector<std::uint32_t> qp(pairs ? static_cast<std::size_t>(kFusedDecodeWideRows * qs) : 0,
                                0u);
  for (Index i = 0; i < n; ++i)
    for (Index c = 0; c < d; ++c) {
      if (pairs)
        qp[static_cast<std::size_t>(i * qs + c / 2)] |= std::uint32_t(to_bf16(Q(i, c), scale))
                                                        << (16 * (c % 2));
      else
        q[static_cast<std::size_t>(i * d + c)] =
            Bf16 ? rounded_float(Q(i, c), scale) : static_cast<float>(Q(i, c)) * scale;
    }
  FusedDecodeProblem<In> P;
  P.q = q.data();
  P.rows = n;
  P.d = d;
  P.dv = dv;
  P.K = K.data();
  P.V = V.data();
  P.ldk = K.outerStride();
  P.ldv = V.outerStride();
  P.bias = bias;
  P.causal = causal;
  P.off = m - n;
  const Index splits = std::max<Index>(1, plan.kv_splits);
  Matrix<float> part_m(n, splits);
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> part_l(n, splits);
  std::vector<Matrix<float>> part_acc(static_cast<std::size_t>(splits), Matrix<float>(n, dv));
  std::vector<char> finite(static_cast<std::size_t>(splits), 1);
  parallel_for(
      splits, [&] { return &fused_decode_state(dv, wide, amx ? d : 0); },
      [&](Index sp, FusedDecodeState* stp) {
        FusedDecodeState& st = *stp;
        const Index k0 = sp == 0 ? 0 : m * sp / splits / 32 * 32;
        const Index k1 = sp + 1 == splits ? m : m * (sp + 1) / splits / 32 * 32;
        st.reset();
        bool ok = true;
        if constexpr (Bf16) {
          if (amx) {
            const AmxTileScope tiles;
            ok = fused_decode_keys_amx<In>(P, qp.data(), n, k0, k1, st);
          } else if (wide) {
            ok = fused_decode_keys_wide<In>(P, qp.data(), k0, k1, st);
          }
        }
        if (!wide && !amx) switch (nr) {
            case 1:
              ok = fused_decode_keys<Bf16, 1>(P, k0, k1, st);
              break;
            case 2:
              ok = fused_decode_keys<Bf16, 2>(P, k0, k1, st);
              break;
            case 4:
              ok = fused_decode_keys<Bf16, 4>(P, k0, k1, st);
              break;
            default:
              if constexpr (!Bf16) {  // bf16 runs the pair or tile forms from 5 rows
                if (nr == 8)
                  ok = fused_decode_keys<false, 8>(P, k0, k1, st);
                else
                  ok = fused_decode_keys<false, 16>(P, k0, k1, st);
              }
              break;
          }
        for (Index i = 0; i < n; ++i) {
          part_m(i, sp) = st.m[i];
          part_l(i, sp) = st.l[i];
        }
        part_acc[static_cast<std::size_t>(sp)] = st.acc.topLeftCorner(n, dv);
        finite[static_cast<std::size_t>(sp)] = ok ? 1 : 0;
      });
  out.resize(n, dv);
  lse.resize(n);
  merge_split_states(part_m, part_l, part_acc, out, lse);
  return std::find(finite.begin(), finite.end(), 0) == finite.end();
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
