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
///
/// This file holds the driver (`fused_decode_run`) and the per-thread state it reuses; the forms
/// are in `fused_decode_fma.hpp`, `fused_decode_wide.hpp` (`vdpbf16ps`) and `fused_decode_amx.hpp`,
/// what they share in `fused_decode_common.hpp`.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "../../core/isa.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "bf16_amx.hpp"
#include "bf16_avx512.hpp"
#include "bf16_pack.hpp"
#include "decode_avx512.hpp"
#include "fused_decode_amx.hpp"
#include "fused_decode_common.hpp"
#include "fused_decode_fma.hpp"
#include "fused_decode_wide.hpp"

#if EFFATTN_BF16_X86

namespace effattn {
namespace detail {

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
