/// \file bf16_amx.hpp
/// \brief The AMX kernels of `policy::TiledBf16`: the score tile S = (s Q_b) K_t^T and the
/// product acc += P V_t with `tdpbf16ps` (bf16 operands, fp32 accumulation).
///
/// A tile register holds up to 16 rows of 64 bytes; `tdpbf16ps C, A, B` computes
/// C[i][j] += sum_k A[i][2k] B[k][2j] + A[i][2k+1] B[k][2j+1] for a 16 x 16 fp32 C, a 16 x 32
/// bf16 A and a B in VNNI layout (16 rows of 16 bf16 pairs). Both products are computed
/// transposed, so that a C tile row is a column of the column-major Eigen tile:
/// - S^T (keys x queries) = K_t (A, row-major keys) times (s Q_b)^T (B, the VNNI query groups);
/// - acc^T (value columns x queries) += V_t^T (A, the transposed 32-key chunks of V) times P^T
///   (B, the VNNI pairs of `pack_p_vnni`).
/// Each step uses a 2 x 2 block of C tiles (tiles 0-3), two A tiles (4, 5) and two B tiles
/// (6, 7): 4 tile products per 4 tile loads. The tile configuration (palette 1, all eight tiles
/// 16 x 64 bytes) is loaded per thread by `AmxTileScope` and released when it ends.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../core/isa.hpp"
#include "../../core/types.hpp"
#include "bf16_pack.hpp"

#if EFFATTN_BF16_X86

/// Target attribute of the AMX kernels.
#define EFFATTN_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

/// Compiler memory barrier at the entry of every tile kernel. GCC's `_tile_loadd` is an asm
/// statement without a memory operand (and `_tile_loadconfig` names only 8 of its 64 bytes), so
/// the optimiser may sink or drop stores whose only reader is a tile load once the packing code
/// is inlined next to it; the barrier makes every earlier store happen first. No instruction.
#define EFFATTN_TILE_MEMORY_BARRIER() asm volatile("" : : : "memory")

namespace effattn {
namespace detail {

/// Loads the palette-1 tile configuration (eight 16 x 64-byte tiles) on this thread for its
/// lifetime and releases the tile state (`tilerelease`) at the end. Only construct it when
/// `detected_isa()` is `Isa::Amx` (the OS then granted the tile data).
class AmxTileScope {
 public:
  EFFATTN_TARGET_AMX AmxTileScope() noexcept {
    // Palette 1; colsb[t] = 64 bytes (bytes 16 + 2t), rows[t] = 16 (bytes 48 + t) for t < 8.
    // In static storage and behind a compiler barrier: GCC's `ldtilecfg` builtin does not tell
    // the optimiser that it reads the 64 bytes, so stores into a local array were dropped as dead
    // (seen without -march: palette 0 was loaded and the first tile instruction raised SIGILL).
    alignas(64) static const unsigned char cfg[64] = {
        1,  0,  0,  0,  0,  0,  0,  0,  0,  0, 0,  0, 0,  0, 0,  0,   // palette, start row
        64, 0,  64, 0,  64, 0,  64, 0,  64, 0, 64, 0, 64, 0, 64, 0,   // colsb, tiles 0-7
        0,  0,  0,  0,  0,  0,  0,  0,  0,  0, 0,  0, 0,  0, 0,  0,   // colsb, tiles 8-15
        16, 16, 16, 16, 16, 16, 16, 16, 0,  0, 0,  0, 0,  0, 0,  0};  // rows
    EFFATTN_TILE_MEMORY_BARRIER();
    _tile_loadconfig(cfg);
  }
  EFFATTN_TARGET_AMX ~AmxTileScope() { _tile_release(); }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

/// Scores of one tile: S (column-major, leading dimension `ld`) rows [0, rows_pad) x columns
/// [0, cols_pad) = the bf16 products of query groups g0 .. g0 + rows_pad / 16 and keys
/// j0 .. j0 + cols_pad (rows_pad, cols_pad multiples of 32). fp32 accumulation.
EFFATTN_TARGET_AMX inline void amx_scores(const Bf16Panels& p, Index g0, Index j0, Index rows_pad,
                                          Index cols_pad, float* s, Index ld) noexcept {
  EFFATTN_TILE_MEMORY_BARRIER();
  const Index kstride = p.dpad * 2, sstride = ld * 4;
  for (Index kk = 0; kk < cols_pad; kk += 32) {
    const std::uint16_t* k0 = p.k_row(j0 + kk);
    const std::uint16_t* k1 = p.k_row(j0 + kk + 16);
    for (Index qq = 0; qq < rows_pad; qq += 32) {
      const std::uint16_t* q0 = p.q_group(g0 + qq / 16);
      const std::uint16_t* q1 = p.q_group(g0 + qq / 16 + 1);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (Index dc = 0; dc < p.dpad; dc += 32) {
        _tile_loadd(4, k0 + dc, kstride);
        _tile_loadd(5, k1 + dc, kstride);
        _tile_loadd(6, q0 + dc * 16, 64);
        _tile_loadd(7, q1 + dc * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* c = s + kk * ld + qq;
      _tile_stored(0, c, sstride);
      _tile_stored(1, c + 16, sstride);
      _tile_stored(2, c + 16 * ld, sstride);
      _tile_stored(3, c + 16 * ld + 16, sstride);
    }
  }
}

/// acc (column-major, leading dimension `ld`, rows [0, rows_pad) x the dvpad value columns) +=
/// P V_t, with P the VNNI pairs `pv` (leading dimension `ld`, `cols_pad` keys from key j0, a
/// multiple of 32). fp32 accumulation in the tiles; acc is loaded and stored once per call.
EFFATTN_TARGET_AMX inline void amx_accumulate(const Bf16Panels& p, Index j0, Index rows_pad,
                                              Index cols_pad, const std::uint16_t* pv, float* acc,
                                              Index ld) noexcept {
  EFFATTN_TILE_MEMORY_BARRIER();
  const Index astride = ld * 4, pstride = ld * 4;
  for (Index cc = 0; cc < p.dvpad; cc += 32) {
    for (Index qq = 0; qq < rows_pad; qq += 32) {
      float* c = acc + cc * ld + qq;
      _tile_loadd(0, c, astride);
      _tile_loadd(1, c + 16, astride);
      _tile_loadd(2, c + 16 * ld, astride);
      _tile_loadd(3, c + 16 * ld + 16, astride);
      for (Index kc = 0; kc < cols_pad; kc += 32) {
        const std::uint16_t* v = p.v_chunk(j0 + kc) + cc * 32;
        const std::uint16_t* b = pv + ((kc / 2) * ld + qq) * 2;
        _tile_loadd(4, v, 64);
        _tile_loadd(5, v + 16 * 32, 64);
        _tile_loadd(6, b, pstride);
        _tile_loadd(7, b + 32, pstride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, astride);
      _tile_stored(1, c + 16, astride);
      _tile_stored(2, c + 16 * ld, astride);
      _tile_stored(3, c + 16 * ld + 16, astride);
    }
  }
}

/// The bare `tdpbf16ps` loop (no loads: 4 accumulator tiles, `iters` x 4 tile products of
/// 16 x 16 x 32), the machine's peak for the benchmarks: 2 * 16 * 16 * 32 * 4 * iters flops.
/// Returns one value of the result so the loop is not optimised away. Needs an `AmxTileScope`.
EFFATTN_TARGET_AMX inline float amx_peak_loop(long iters) noexcept {
  alignas(64) std::uint16_t ones[16 * 32];
  for (auto& x : ones) x = 0x3F80;  // 1.0 in bf16
  EFFATTN_TILE_MEMORY_BARRIER();    // the tile loads read `ones`
  alignas(64) float out[16 * 16];
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  return out[0];
}

}  // namespace detail
}  // namespace effattn

#endif  // EFFATTN_BF16_X86
