/// \file exact_dispatch.hpp
/// \brief Internal: the one place that chooses which kernel computes single-head exact attention
/// (`choose_exact_kernel`), from the policy, the input type, the score mode, the query count, the
/// tile plan and the kernel path (`Isa`).
///
/// | policy | condition | kernel |
/// |---|---|---|
/// | Naive | always | `Naive`: materialised scores in double (`exact_naive`) |
/// | Tiled | float, x86 path, 1-16 queries in one query block | `FusedDecodeFp32` |
/// | Tiled | otherwise | `Tiled`: GEMM tiles with the online softmax (`tiled_attention`) |
/// | TiledBf16 | x86 path, 1-16 queries in one query block | `FusedDecodeFp32` with split scores
/// (`Bf16Scores`), else `FusedDecodeBf16` | | TiledBf16 | 1-16 queries in one block, generic path |
/// `StreamingBf16` | | TiledBf16 | x86 path (AVX512-BF16 or AMX) | `Bf16Panels`: packed bf16 tiles
/// | | TiledBf16 | generic path | `GenericBf16`: bf16-rounded fp32 tiles |
///
/// With split scores (float inputs, `Bf16Scores::Split`, or `Auto` at small d) a kernel other
/// than `FusedDecodeFp32` runs on the split operands (`split_bf16_operands`). The x86 path is the
/// one `selected_isa()` reports (AVX512-BF16 or AMX; built without x86 kernels it is always
/// generic). Multi-head exact attention (`MultiHead<ExactAttention<...>>`) has its own kernel
/// over all heads (`multi_head_exact.hpp`), which takes the AVX-512 decoding kernel under the
/// same rule of few queries (`decode_avx512_usable`).
#pragma once

#include "../../core/isa.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/types.hpp"

namespace effattn {
namespace detail {

/// The exact-attention policies, as a value (policy::Naive, policy::Tiled, policy::TiledBf16).
enum class ExactFamily { Naive, Tiled, TiledBf16 };

/// The kernels of single-head exact attention (see the file documentation).
enum class ExactKernel {
  Naive,            ///< materialised scores in double
  Tiled,            ///< fp32 / fp64 GEMM tiles, online softmax
  FusedDecodeFp32,  ///< x86 fused decoding kernel with fp32 scores (`fused_decode_run<false>`)
  FusedDecodeBf16,  ///< x86 fused decoding kernel on bf16 operands (`fused_decode_run<true>`)
  StreamingBf16,    ///< generic decoding on bf16-rounded operands (`StreamingBf16Kernel`)
  Bf16Panels,       ///< x86 tiles on packed bf16 panels, AMX or AVX512-BF16 (`X86Bf16Kernel`)
  GenericBf16,      ///< portable tiles on bf16-rounded fp32 operands (`GenericBf16Kernel`)
};

/// The most queries of a decoding call (one query block) that the decoding kernels take: the
/// fused kernel on the x86 paths, `StreamingBf16Kernel` on the generic path.
constexpr Index kExactDecodeMaxQueries = 16;

/// Whether the fused x86 decoding kernel applies to n queries with `plan` on path `isa`: an x86
/// path, at most `kExactDecodeMaxQueries` queries, one query block (the caller has checked that
/// the inputs are not empty).
inline bool fused_decode_applies(Index n, const TilePlan& plan, Isa isa) noexcept {
#if EFFATTN_BF16_X86
  return isa != Isa::Generic && n <= kExactDecodeMaxQueries && plan.q_blocks == 1;
#else
  (void)n, (void)plan, (void)isa;
  return false;
#endif
}

/// The kernel for a problem of n queries (see the table of the file documentation).
/// `fp32_inputs`: the inputs are float (not bf16, not double); `split_scores`: the score product
/// is split (`Bf16Scores`; TiledBf16 with float inputs only). `plan` is the tile plan the kernel
/// family uses (`plan_tiles` for Tiled, `plan_bf16_tiles` for TiledBf16). O(1).
inline ExactKernel choose_exact_kernel(ExactFamily family, bool fp32_inputs, bool split_scores,
                                       Index n, const TilePlan& plan, Isa isa) noexcept {
  const bool fused = fused_decode_applies(n, plan, isa);
  switch (family) {
    case ExactFamily::Naive:
      return ExactKernel::Naive;
    case ExactFamily::Tiled:
      return fp32_inputs && fused ? ExactKernel::FusedDecodeFp32 : ExactKernel::Tiled;
    case ExactFamily::TiledBf16:
      break;
  }
  if (fused) return split_scores ? ExactKernel::FusedDecodeFp32 : ExactKernel::FusedDecodeBf16;
  if (n <= kExactDecodeMaxQueries && plan.q_blocks == 1) return ExactKernel::StreamingBf16;
  return EFFATTN_BF16_X86 && isa != Isa::Generic ? ExactKernel::Bf16Panels
                                                 : ExactKernel::GenericBf16;
}

/// True for the kernels that check K and V as they read them (the fused decoding kernel), so
/// that the caller does not scan them beforehand.
constexpr bool reads_kv_checked(ExactKernel k) noexcept {
  return k == ExactKernel::FusedDecodeFp32 || k == ExactKernel::FusedDecodeBf16;
}

}  // namespace detail
}  // namespace effattn
