/// \file fused_decode_amx.hpp
/// \brief Internal: the AMX form of the fused decoding kernel (see `fused_decode_avx512.hpp`):
/// `fused_decode_keys_amx`, bf16 with 5-16 queries on the AMX path (tile products), with its
/// pair rounding, transpose and segment helpers. Include <effattn/exact.hpp> instead.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "bf16_amx.hpp"
#include "bf16_avx512.hpp"
#include "decode_avx512.hpp"
#include "fused_decode_common.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

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

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
