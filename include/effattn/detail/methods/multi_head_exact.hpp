/// \file multi_head_exact.hpp
/// \brief Internal: the multi-head exact Tiled kernel of `MultiHead<ExactAttention<Scalar,
/// policy::Tiled>>`: its blocks and tasks, the online-softmax pass over stacked heads, the decoding
/// kernel for blocks of few queries, and the driver that plans the blocks, runs the (block, split)
/// tasks and merges the split states. Include <effattn/multi_head.hpp> instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../exact.hpp"
#include "../../multi_head.hpp"
#include "../x86/decode_avx512.hpp"
#include "multi_head_views.hpp"

namespace effattn {
namespace detail {

/// One unit of the multi-head exact kernel: query rows [i0, i0 + rows) of sequence `seq` for the
/// `nh` consecutive query heads h0, ... (of one or several key/value heads), stacked in the
/// workspace (head s in rows [s rows, (s + 1) rows)), over `splits` key ranges; `part` indexes its
/// split states.
struct MhBlock {
  Index seq = 0, h0 = 0, nh = 1, i0 = 0, rows = 0, splits = 1, part = -1;
  bool stacked = false;  ///< a decoding block (few queries, heads stacked)
};

/// The partial online-softmax states of a split block (see `merge_split_states`).
template <typename Scalar>
struct MhSplitState {
  Matrix<Scalar> m;                                         ///< R x splits running maxima
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> l;  ///< R x splits row sums
  std::vector<Matrix<Scalar>> acc;                          ///< splits x (R x dv)
};

/// Everything a task of the multi-head exact kernel reads.
template <typename Scalar>
struct MhExactProblem {
  PackedView<Scalar> Q, K, V;
  PackedView<Scalar, Scalar*> out;
  const MultiHeadBatch* batch = nullptr;
  Index heads = 0, group = 1, bk = 0;
  Scalar scale = 0;
  bool causal = false;
};

/// The index ranges of one (block, split) task.
struct MhTask {
  Index q0 = 0, nq = 0, kb = 0, nk = 0;  ///< query / key rows of the sequence
  Index off = 0;                         ///< causal: row i sees keys j <= i + off
  Index rows = 0, R = 0, i0 = 0;         ///< rows per head, stacked rows, first position
  Index k_begin = 0, k_end = 0;          ///< the split's key range
  Index g_first = 0, g_last = 0;         ///< the key/value heads the block reads

  MhTask(const MultiHeadBatch& mb, Index group, bool causal, const MhBlock& blk, Index split) {
    const std::size_t sb = static_cast<std::size_t>(blk.seq);
    q0 = mb.q[sb];
    nq = mb.q[sb + 1] - q0;
    kb = mb.k[sb];
    nk = mb.k_len[sb];
    off = nk - nq;
    rows = blk.rows;
    R = blk.nh * rows;
    i0 = blk.i0;
    const Index visible = causal ? std::min(nk, i0 + rows + off) : nk;
    k_begin = visible * split / blk.splits;
    k_end = visible * (split + 1) / blk.splits;
    g_first = blk.h0 / group;
    g_last = (blk.h0 + blk.nh - 1) / group;
  }
  /// Stacked rows [first, first + count) of the block's heads that read key/value head g.
  std::pair<Index, Index> group_rows(const MhBlock& blk, Index group, Index g) const {
    const Index hs = std::max(blk.h0, g * group) - blk.h0;
    const Index he = std::min(blk.h0 + blk.nh, (g + 1) * group) - blk.h0;
    return {hs * rows, (he - hs) * rows};
  }
  /// Writes the block's scaled queries into `q` (R x d, head s in rows [s rows, (s + 1) rows)).
  /// \returns whether they are finite (checked here, in cache: `compute` does not scan Q first).
  template <typename Scalar, typename Dst>
  bool load_queries(const PackedView<Scalar>& Q, Scalar scale, const MhBlock& blk, Index d,
                    Dst&& q) const {
    for (Index s = 0; s < blk.nh; ++s) {
      const Scalar* p = Q.at(q0 + i0, (blk.h0 + s) * d);
      if (Q.row_major)
        q.middleRows(s * rows, rows).noalias() =
            RowMap<Scalar>(p, rows, d, Eigen::OuterStride<>(Q.outer)) * scale;
      else
        q.middleRows(s * rows, rows).noalias() =
            ColMap<Scalar>(p, rows, d, Eigen::OuterStride<>(Q.outer)) * scale;
    }
    return all_finite(q.topRows(blk.nh * rows));
  }
  /// The causal mask of tile [j0, ...): key j hidden from the rows of position < j - off (a
  /// prefix of each stacked head's rows); `hide(c, column, value)` for online_softmax_update.
  auto hider(const MhBlock& blk, Index j0) const {
    return [this, &blk, j0](Index c, auto column, auto value) {
      const Index hidden = std::max<Index>(0, std::min(rows, j0 + c - off - i0));
      for (Index s = 0; s < blk.nh; ++s) column.segment(s * rows, hidden).setConstant(value);
    };
  }
};

/// Prefetches part `part` of `parts` of block `blk`'s query rows of a row-major Q into L2.
/// Each query row of a packed Q lies on its own page (heads x d floats wide), where the hardware
/// prefetchers stop, so gathering a block on demand waits for one page walk and DRAM access per
/// row: measured 7% of a GQA prefill (L = 512, 32 heads of 128), with the other thread's traffic.
/// The multi-head kernel prefetches the block a thread probably runs next during the current
/// one's key tiles. A column-major Q is read by contiguous columns and is left to the hardware.
template <typename Scalar>
void prefetch_queries(const PackedView<Scalar>& Q, const MultiHeadBatch& mb, const MhBlock& blk,
                      Index d, Index part, Index parts) {
  if (!Q.row_major) return;
  constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));
  const Index q0 = mb.q[static_cast<std::size_t>(blk.seq)] + blk.i0, width = blk.nh * d;
  for (Index r = blk.rows * part / parts; r < blk.rows * (part + 1) / parts; ++r) {
    const Scalar* p = Q.at(q0 + r, blk.h0 * d);
    for (Index x = 0; x < width; x += kLine) __builtin_prefetch(p + x, 0, 2);
  }
}

/// Per-thread buffers of the multi-head kernel: the tile workspace; with a row-major V
/// (`row_acc`), the accumulator in row-major storage (`accr`, in place of the tile workspace's
/// column-major `acc`); with a row-major K (`row_q`, the GEMM form) or for the decoding kernel
/// (allocated only when a call has stacked blocks), the scaled queries in row-major storage (in
/// place of `q`), so that they are gathered from a row-major Q by contiguous rows and the
/// decoding kernel's dot products and rank-1 updates run along contiguous rows.
template <typename Scalar>
struct MhWorkspace : TileWorkspace<Scalar> {
  RowMatrix<Scalar> qr;    ///< R x d scaled queries (row-major K, or decoding kernel)
  RowMatrix<Scalar> accr;  ///< R x dv unnormalised output (row-major V)
  Vector<Scalar> sv;       ///< bk scores of one row (decoding kernel, unmasked tiles)
  MhWorkspace(Index bq, Index bk, Index d, Index dv, bool row_q, bool decode, bool row_acc)
      : TileWorkspace<Scalar>(bq, bk, row_q ? 0 : d, row_acc ? 0 : dv),
        qr(row_q || decode ? bq : 0, row_q || decode ? d : 0),
        accr(row_acc ? bq : 0, row_acc ? dv : 0),
        sv(decode ? bk : 0) {}
};

/// Online-softmax pass of one block over key split `split` (see `online_softmax_block`, of which
/// this is the multi-head form: stacked heads, K and V read through strided maps). K is read as
/// K^T tiles: a row-major K's head slice transposed is a column-major map (no copy); a
/// column-major K is multiplied transposed. Leaves m, l, acc of the R = nh rows stacked rows in
/// ws. 2 R (keys) (d + dv) flops, no allocation. `next` (or null): the block whose queries to
/// prefetch, a share after each key tile (see `prefetch_queries`). \returns false if a score was
/// not finite (a non-finite key, or an overflow).
template <typename Scalar, bool KRowMajor, bool VRowMajor>
bool mh_exact_pass(const MhExactProblem<Scalar>& P, const MhBlock& blk, Index split,
                   const MhBlock* next, MhWorkspace<Scalar>& ws) {
  const MultiHeadBatch& mb = *P.batch;
  const MhTask t(mb, P.group, P.causal, blk, split);
  const Index d = mb.d, dv = mb.dv, R = t.R;
  // With a row-major K (and so, in a model's packed layout, a row-major Q) the scaled query
  // block is row-major too: gathering it is then a copy of contiguous head rows (into a
  // column-major block it was a transpose reading one float per row a page apart, measured 7%
  // of a GQA prefill, L = 512). The GEMM packs either storage into the same panels, so the
  // scores are bit-identical.
  auto q = [&] {
    if constexpr (KRowMajor)
      return ws.qr.topRows(R);
    else
      return ws.q.topRows(R);
  }();
  // With a row-major V the accumulator is row-major too: Eigen then runs acc^T += V_t^T P^T, whose
  // packed operand V_t^T is read along V's contiguous rows; packing V_t itself as the right-hand
  // side of P V_t reads four columns at a time across bk rows a page apart (measured: the packing
  // was 7.5% of a GQA prefill, L = 512, and the store of a column-major accumulator into a
  // row-major output another 4%).
  auto acc = [&] {
    if constexpr (VRowMajor)
      return ws.accr.topRows(R);
    else
      return ws.acc.topRows(R);
  }();
  bool finite = t.load_queries(P.Q, P.scale, blk, d, q);
  begin_rows(ws, R);
  acc.setZero();
  for (Index j0 = t.k_begin; j0 < t.k_end; j0 += P.bk) {
    const Index cols = std::min(P.bk, t.k_end - j0);
    auto S = ws.s.topLeftCorner(R, cols);
    // The block's heads may span several key/value heads (decoding stacks every head of a
    // sequence): S's rows of the heads of group g are q_g K_g^T.
    for (Index g = t.g_first; g <= t.g_last; ++g) {
      const auto [r0, nr] = t.group_rows(blk, P.group, g);
      const Scalar* kp = P.K.at(t.kb + j0, g * d);
      if constexpr (KRowMajor)
        S.middleRows(r0, nr).noalias() =
            q.middleRows(r0, nr) * ColMap<Scalar>(kp, d, cols, Eigen::OuterStride<>(P.K.outer));
      else
        S.middleRows(r0, nr).noalias() =
            q.middleRows(r0, nr) *
            ColMap<Scalar>(kp, cols, d, Eigen::OuterStride<>(P.K.outer)).transpose();
    }
    // A non-finite key makes its whole score column non-finite (q is finite): checking the
    // small score tile replaces a scan of K (decoding is bandwidth-bound). A non-finite value
    // makes the output non-finite (0 * inf is NaN), which `compute` checks.
    finite = finite && all_finite(S);
    if (next != nullptr) {
      const Index tiles = (t.k_end - t.k_begin + P.bk - 1) / P.bk;
      prefetch_queries(P.Q, mb, *next, d, (j0 - t.k_begin) / P.bk, tiles);
    }
    const bool diagonal = P.causal && j0 + cols - 1 > t.i0 + t.off;
    online_softmax_update<Scalar>(R, cols, diagonal, t.hider(blk, j0), ws, acc);
    for (Index g = t.g_first; g <= t.g_last; ++g) {
      const auto [r0, nr] = t.group_rows(blk, P.group, g);
      const Scalar* vp = P.V.at(t.kb + j0, g * dv);
      if constexpr (VRowMajor)
        acc.middleRows(r0, nr).noalias() +=
            S.middleRows(r0, nr) * RowMap<Scalar>(vp, cols, dv, Eigen::OuterStride<>(P.V.outer));
      else
        acc.middleRows(r0, nr).noalias() +=
            S.middleRows(r0, nr) * ColMap<Scalar>(vp, cols, dv, Eigen::OuterStride<>(P.V.outer));
    }
  }
  return finite;
}

#if EFFATTN_BF16_X86
/// An unmasked key tile [j0, j0 + cols) of `mh_decode_pass` with the fp32 AVX-512 kernel
/// (`decode_rows16`, see decode_avx512.hpp): 16-key sub-tiles, each read for every kv head of
/// the block in turn (whole cache rows, in order), every group's rows 4 at a time. While kv head
/// g of one sub-tile is computed, the kernel prefetches a share of the next sub-tile, one
/// prefetch beside each load (`kpf`, `vpf`): a cache row is often a page (kv_heads d = 1024
/// floats) and the hardware prefetchers stop at page boundaries. The share is in cache-row order:
/// the next sub-tile's (key, kv head) slices numbered along the rows, the i-th kv head of the
/// block prefetching slices 16 i to 16 i + 15 (8 kv heads in the block: two whole rows), so memory
/// sees whole rows in order. Against prefetching each kv head's own slices of the next 16 rows (one
/// slice per page, 16 pages at a time; `decode_order` reads in that order at 0.64-0.75 of the
/// rate of whole rows): 27.0 -> 31.3 GB/s, median of 8 alternating runs of
/// `decode_stream/row/32768` (per-run ratio 0.97-1.32, median 1.19; 2 threads).
/// A second, near prefetch into L1 (the next kv head's slices of the current
/// sub-tile) or prefetching into L2 only gained nothing beyond the noise. Earlier, on Zen 5,
/// m = 32768, G = 8, d = 128, 2 threads, `bench_multi_head --benchmark_filter=decode_stream`
/// (cache rates in the same runs; the machine's streaming rate varied 35-62 GB/s): 26-31 GB/s
/// against 18-23 GB/s when the same prefetches were issued in one burst per kv head before its
/// compute (the miss buffers filled, then the memory idled while the kernel computed). One
/// sub-tile ahead is enough: two or three gave the same or less.
inline bool mh_decode_tile_avx512(const MhExactProblem<float>& P, const MhTask& t,
                                  const MhBlock& blk, Index j0, Index cols,
                                  MhWorkspace<float>& ws) {
  const Index d = P.batch->d, dv = P.batch->dv;
  const Index ldq = ws.qr.outerStride(), lda = ws.accr.outerStride();
  bool finite = true;
  const float* kp[16];
  const float* vp[16];
  const float* kpf[16];
  const float* vpf[16];
  const Index ng = t.g_last - t.g_first + 1;  // kv heads of the block
  for (Index c0 = 0; c0 < cols; c0 += 16) {
    const Index kc = std::min<Index>(16, cols - c0);
    // The next sub-tile starts where this one ends (kc < 16 also inside a task when the key
    // tile is not a multiple of 16 keys).
    const Index next = j0 + c0 + kc, next_end = std::min(next + 16, t.k_end);
    for (Index g = t.g_first; g <= t.g_last; ++g) {
      for (Index u = 0; u < 16; ++u) {
        const Index key = t.kb + j0 + c0 + std::min<Index>(u, kc - 1);
        kp[u] = P.K.at(key, g * d);
        vp[u] = P.V.at(key, g * dv);
      }
      // This kv head's share of the next sub-tile, in row order (repeating the last row past
      // the end), or nothing after the last sub-tile; only the group's first 4-row call issues
      // them.
      const float* const* kpf_use = nullptr;
      const float* const* vpf_use = nullptr;
      if (next < next_end) {
        // Slice c = 16 i + u is kv head c % ng of key c / ng (one division per kv head: a
        // division per slice was 4% of the kernel's time).
        Index key = (g - t.g_first) * 16 / ng, gg = (g - t.g_first) * 16 % ng;
        for (Index u = 0; u < 16; ++u) {
          const Index row = t.kb + std::min(next + key, next_end - 1);
          kpf[u] = P.K.at(row, (t.g_first + gg) * d);
          vpf[u] = P.V.at(row, (t.g_first + gg) * dv);
          if (++gg == ng) {
            gg = 0;
            ++key;
          }
        }
        kpf_use = kpf;
        vpf_use = vpf;
      }
      const auto [r0, nr] = t.group_rows(blk, P.group, g);
      for (Index r = r0; r < r0 + nr; r += 4) {
        const Index rows = std::min<Index>(4, r0 + nr - r);
        const float* q = ws.qr.data() + r * ldq;
        float* acc[4];
        for (Index i = 0; i < rows; ++i) acc[i] = ws.accr.data() + (r + i) * lda;
        float* m = ws.m.data() + r;
        double* l = ws.l.data() + r;
        bool ok = true;
        switch (rows) {
          case 4:
            ok = decode_rows16<4>(q, ldq, d, kp, vp, kc, dv, m, l, acc, kpf_use, vpf_use);
            break;
          case 3:
            ok = decode_rows16<3>(q, ldq, d, kp, vp, kc, dv, m, l, acc, kpf_use, vpf_use);
            break;
          case 2:
            ok = decode_rows16<2>(q, ldq, d, kp, vp, kc, dv, m, l, acc, kpf_use, vpf_use);
            break;
          default:
            ok = decode_rows16<1>(q, ldq, d, kp, vp, kc, dv, m, l, acc, kpf_use, vpf_use);
            break;
        }
        finite = finite && ok;
        kpf_use = nullptr;
        vpf_use = nullptr;
      }
    }
  }
  return finite;
}
#endif

/// The decoding form of `mh_exact_pass` for row-major K and V and few stacked query rows:
/// the same online softmax without GEMMs, whose packing would copy every K and V tile to
/// multiply it by a handful of rows. Same flops as the GEMM form.
///
/// Tiles without a mask (all of them for one query per head) run row by row: each stacked
/// row's scores are one GEMV of the K tile (row-major, contiguous head slices) with its query,
/// its online-softmax update is vectorised along the keys (max, exp and sum of one contiguous
/// score row), and its accumulator gets one GEMV of the V tile; the tile stays in L1 for the
/// other rows of its group. (The column-wise update of the GEMM form works on columns of R
/// rows, which for R = 2-8 stacked rows cost more than the products; measured 0.09 of the
/// streaming rate at H = 4, G = 2, d = 64, m = 2304 before this path.) Masked (causal diagonal)
/// tiles go key by key: each stacked head's scores are dot products of contiguous rows
/// (q_r . k_j), its accumulator gets the rank-1 update p_rj v_j.
template <typename Scalar>
bool mh_decode_pass(const MhExactProblem<Scalar>& P, const MhBlock& blk, Index split,
                    MhWorkspace<Scalar>& ws) {
  const MultiHeadBatch& mb = *P.batch;
  const MhTask t(mb, P.group, P.causal, blk, split);
  const Index d = mb.d, dv = mb.dv, R = t.R;
  auto qr = ws.qr.topRows(R);
  auto accr = ws.accr.topRows(R);
  bool finite = t.load_queries(P.Q, P.scale, blk, d, qr);
  begin_rows(ws, R);
  accr.setZero();
  // Software prefetch kPrefetch keys ahead, whole rows: a row of a row-major cache is often a
  // page (kv_heads d = 1024 floats), and the hardware prefetchers stop at page boundaries
  // (measured: +15% bandwidth at m = 32768, kv_heads = 8, d = 128).
  constexpr Index kPrefetch = 4;
  auto prefetch_row = [&](const PackedView<Scalar>& X, Index key, Index width) {
    if (key >= t.k_end) return;
    const Scalar* pf = X.at(t.kb + key, t.g_first * width);
    const Index n = (t.g_last - t.g_first + 1) * width;
    for (Index i = 0; i < n; i += 64 / static_cast<Index>(sizeof(Scalar)))
      __builtin_prefetch(pf + i, 0, 3);
  };
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
#if EFFATTN_BF16_X86
  bool avx512 = false;
  if constexpr (std::is_same_v<Scalar, float>) avx512 = decode_avx512_usable(d, mb.dv);
#endif
  for (Index j0 = t.k_begin; j0 < t.k_end; j0 += P.bk) {
    const Index cols = std::min(P.bk, t.k_end - j0);
    const bool diagonal = P.causal && j0 + cols - 1 > t.i0 + t.off;  // the mask cuts this tile
#if EFFATTN_BF16_X86
    if constexpr (std::is_same_v<Scalar, float>) {
      if (avx512 && !diagonal) {
        finite = mh_decode_tile_avx512(P, t, blk, j0, cols, ws) && finite;
        continue;
      }
    }
#endif
    if (!diagonal) {  // no mask in this tile: row by row
      for (Index g = t.g_first; g <= t.g_last; ++g) {
        const auto [r0, nr] = t.group_rows(blk, P.group, g);
        const RowMap<Scalar> Kt(P.K.at(t.kb + j0, g * d), cols, d, Eigen::OuterStride<>(P.K.outer));
        const RowMap<Scalar> Vt(P.V.at(t.kb + j0, g * dv), cols, dv,
                                Eigen::OuterStride<>(P.V.outer));
        for (Index r = r0; r < r0 + nr; ++r) {
          auto sv = ws.sv.head(cols);
          sv.noalias() = Kt * qr.row(r).transpose();
          finite = finite && all_finite(sv);  // a non-finite key (q is finite)
          const Scalar tmax = sv.maxCoeff();
          const Scalar mnew = std::max(ws.m(r), tmax);
          const Scalar shift = mnew == ninf ? Scalar(0) : mnew;
          const Scalar alpha = ws.m(r) == ninf ? Scalar(0) : std::exp(ws.m(r) - shift);
          sv.array() = (sv.array() - shift).exp();
          ws.l(r) = ws.l(r) * static_cast<double>(alpha) + static_cast<double>(sv.sum());
          if (alpha != Scalar(1)) accr.row(r) *= alpha;
          accr.row(r).noalias() += sv.transpose() * Vt;
          ws.m(r) = mnew;
        }
      }
      continue;
    }
    auto S = ws.s.topLeftCorner(R, cols);
    for (Index c = 0; c < cols; ++c) {
      prefetch_row(P.K, j0 + c + kPrefetch, d);
      const Scalar* krow = P.K.at(t.kb + j0 + c, 0);
      for (Index g = t.g_first; g <= t.g_last; ++g) {
        const auto [r0, nr] = t.group_rows(blk, P.group, g);
        const Eigen::Map<const Vector<Scalar>> k(krow + g * d, d);
        S.col(c).segment(r0, nr).noalias() = qr.middleRows(r0, nr).lazyProduct(k);
      }
    }
    finite = finite && all_finite(S);
    online_softmax_update<Scalar>(R, cols, diagonal, t.hider(blk, j0), ws, accr);
    // Rank-4 updates (four keys at a time): each accumulator row is loaded and stored once per
    // four keys.
    for (Index c = 0; c < cols; c += 4) {
      const Index ku = std::min<Index>(4, cols - c);
      for (Index u = 0; u < ku; ++u) prefetch_row(P.V, j0 + c + u + kPrefetch, dv);
      for (Index g = t.g_first; g <= t.g_last; ++g) {
        const auto [r0, nr] = t.group_rows(blk, P.group, g);
        using RowV = Eigen::Map<const RowVector<Scalar>>;
        if (ku == 4) {
          const RowV v0(P.V.at(t.kb + j0 + c, g * dv), dv),
              v1(P.V.at(t.kb + j0 + c + 1, g * dv), dv), v2(P.V.at(t.kb + j0 + c + 2, g * dv), dv),
              v3(P.V.at(t.kb + j0 + c + 3, g * dv), dv);
          for (Index r = r0; r < r0 + nr; ++r)
            accr.row(r) += S(r, c) * v0 + S(r, c + 1) * v1 + S(r, c + 2) * v2 + S(r, c + 3) * v3;
        } else {
          for (Index u = 0; u < ku; ++u) {
            const RowV v(P.V.at(t.kb + j0 + c + u, g * dv), dv);
            for (Index r = r0; r < r0 + nr; ++r) accr.row(r) += S(r, c + u) * v;
          }
        }
      }
    }
  }
  return finite;
}

/// The multi-head exact Tiled kernel (see `MultiHead`): plans the blocks, runs every (block,
/// split) task, merges the split states, and fills each (sequence, head)'s `lse`.
template <typename Scalar>
void multi_head_exact(const ExactOptions& opts, const HeadLayout& layout,
                      const PackedView<Scalar>& Q, const PackedView<Scalar>& K,
                      const PackedView<Scalar>& V, const PackedView<Scalar, Scalar*>& out,
                      const MultiHeadBatch& mb, std::vector<ExactResult<Scalar>>& results,
                      Index& tasks, bool& scores_finite) {
  const Index H = layout.heads, G = layout.kv_heads, group = H / G, B = mb.batch();
  const Index d = mb.d, dv = mb.dv;
  Index max_nk = 1;
  for (Index b = 0; b < B; ++b) max_nk = std::max(max_nk, mb.nk(b));
  // The kernel checks every key and value it reads; a sequence without queries reads none.
  for (Index b = 0; b < B; ++b) {
    const std::size_t i = static_cast<std::size_t>(b);
    if (mb.q[i + 1] > mb.q[i]) continue;
    if (!slice_finite(K, mb.k[i], mb.k_len[i], 0, K.cols)) check_finite_view(K, "K");
    if (!slice_finite(V, mb.k[i], mb.k_len[i], 0, V.cols)) check_finite_view(V, "V");
  }
  // Row capacity of a block and key tile, as the single-head kernel chooses them.
  const TilePlan tiles = plan_tiles(Index(1) << 30, max_nk, d, dv,
                                    static_cast<Index>(sizeof(Scalar)), opts.block_q, opts.block_k);
  const Index cap = tiles.bq, bk = tiles.bk;

  // Blocks in (sequence, kv head, query block, head chunk) order: consecutive tasks read the
  // same key/value head.
  std::vector<MhBlock> blocks;
  results.assign(static_cast<std::size_t>(B * H), ExactResult<Scalar>{});
  for (Index b = 0; b < B; ++b) {
    const Index nq = mb.q[static_cast<std::size_t>(b + 1)] - mb.q[static_cast<std::size_t>(b)];
    for (Index h = 0; h < H; ++h) {
      ExactResult<Scalar>& r = results[static_cast<std::size_t>(b * H + h)];
      r.lse.resize(nq);
      r.info = Info::Success;
    }
    if (nq == 0) continue;
    // Few queries (decoding): stack the query heads into one block (whole GQA groups when
    // they fit), so each key/value tile is read once per block, and the heads' K and V rows for
    // the same keys are read together: whole rows of a row-major cache, contiguous memory.
    if (2 * nq <= cap) {
      Index hpb = std::min(H, cap / nq);
      if (hpb >= group) hpb -= hpb % group;
      for (Index c = 0; c < H; c += hpb) {
        MhBlock blk;
        blk.seq = b;
        blk.h0 = c;
        blk.nh = std::min(hpb, H - c);
        blk.rows = nq;
        blk.stacked = true;
        blocks.push_back(blk);
      }
      continue;
    }
    // Prefill: with GQA, the query heads of a group are stacked (cap / group rows each, at
    // least 16), so every K and V tile a GEMM packs serves the whole group: a quarter of the
    // packing of one head per block at GQA 4 (row-major K and V tiles are a page per key).
    // Otherwise one head per block. (kv head, query block, head chunk) order: consecutive tasks
    // read the same key/value tiles.
    const Index hpg = group > 1 && cap / group >= 16 ? group : 1;
    const Index bqh = cap / hpg;
    for (Index g = 0; g < G; ++g)
      for (Index i0 = 0; i0 < nq; i0 += bqh)
        for (Index c = 0; c < group; c += hpg) {
          MhBlock blk;
          blk.seq = b;
          blk.h0 = g * group + c;
          blk.nh = hpg;
          blk.i0 = i0;
          blk.rows = std::min(bqh, nq - i0);
          blocks.push_back(blk);
        }
  }
  // Split-KV when there are too few blocks to feed the cores (decoding): the number of splits
  // depends on the shapes only (>= 4 key tiles per split).
  constexpr Index kMinTasks = 32;
  const Index nblocks = static_cast<Index>(blocks.size());
  const Index want =
      nblocks >= kMinTasks ? 1 : (kMinTasks + nblocks - 1) / std::max<Index>(1, nblocks);
  std::vector<Index> task_block, task_split;
  std::vector<MhSplitState<Scalar>> states;
  for (Index i = 0; i < nblocks; ++i) {
    MhBlock& blk = blocks[static_cast<std::size_t>(i)];
    const std::size_t sb = static_cast<std::size_t>(blk.seq);
    const Index nq = mb.q[sb + 1] - mb.q[sb], nk = mb.k_len[sb];
    const Index visible = opts.causal ? std::min(nk, blk.i0 + blk.rows + nk - nq) : nk;
    blk.splits = std::max<Index>(1, std::min(want, visible / (4 * bk)));
    if (blk.splits > 1) {
      blk.part = static_cast<Index>(states.size());
      MhSplitState<Scalar> st;
      const Index R = blk.nh * blk.rows;
      st.m.resize(R, blk.splits);
      st.l.resize(R, blk.splits);
      st.acc.assign(static_cast<std::size_t>(blk.splits), Matrix<Scalar>(R, dv));
      states.push_back(std::move(st));
    }
    for (Index s = 0; s < blk.splits; ++s) {
      task_block.push_back(i);
      task_split.push_back(s);
    }
    for (Index s = 0; s < blk.nh; ++s) {
      ExactResult<Scalar>& r = results[static_cast<std::size_t>(blk.seq * H + blk.h0 + s)];
      r.block_q = std::max(r.block_q, blk.rows);
      r.block_k = std::min(bk, nk);
      r.kv_splits = std::max(r.kv_splits, blk.splits);
    }
  }
  tasks = static_cast<Index>(task_block.size());

  MhExactProblem<Scalar> P;
  P.Q = Q;
  P.K = K;
  P.V = V;
  P.out = out;
  P.batch = &mb;
  P.heads = H;
  P.group = group;
  P.bk = bk;
  P.scale = static_cast<Scalar>(resolve_scale(opts.scale, d));
  P.causal = opts.causal;
  using Pass = bool (*)(const MhExactProblem<Scalar>&, const MhBlock&, Index, const MhBlock*,
                        MhWorkspace<Scalar>&);
  const Pass pass =
      K.row_major
          ? (V.row_major ? &mh_exact_pass<Scalar, true, true> : &mh_exact_pass<Scalar, true, false>)
          : (V.row_major ? &mh_exact_pass<Scalar, false, true>
                         : &mh_exact_pass<Scalar, false, false>);

  // Writes rows [0, R) of a finished block (normalised output `o`, log-sum-exp `lse`) and records
  // whether they are finite (checked here, in cache, rather than by a serial scan of the whole
  // output afterwards) in head_ok[first[i] + s] for head s of block i. Each block is stored by
  // exactly one task.
  std::vector<std::size_t> first(static_cast<std::size_t>(nblocks) + 1, 0);
  for (Index i = 0; i < nblocks; ++i)
    first[static_cast<std::size_t>(i) + 1] =
        first[static_cast<std::size_t>(i)] +
        static_cast<std::size_t>(blocks[static_cast<std::size_t>(i)].nh);
  std::vector<char> head_ok(first.back(), 1);
  auto store = [&](const MhBlock& blk, const auto& o, const auto& lse) {
    const Index q0 = mb.q[static_cast<std::size_t>(blk.seq)];
    const std::size_t f = first[static_cast<std::size_t>(&blk - blocks.data())];
    for (Index s = 0; s < blk.nh; ++s) {
      const auto os = o.middleRows(s * blk.rows, blk.rows);
      const auto ls = lse.segment(s * blk.rows, blk.rows);
      const bool ok = all_finite(ls) && all_finite(os);
      head_ok[f + static_cast<std::size_t>(s)] = ok ? 1 : 0;
      write_slice(out, q0 + blk.i0, (blk.h0 + s) * dv, os);
      results[static_cast<std::size_t>(blk.seq * H + blk.h0 + s)].lse.segment(blk.i0, blk.rows) =
          ls;
    }
  };
  bool any_stacked = false;
  for (const MhBlock& blk : blocks) any_stacked = any_stacked || blk.stacked;
  const bool decode_kernel = any_stacked && K.row_major && V.row_major;
  auto make_ws = [&] {
    return MhWorkspace<Scalar>(cap, bk, d, dv, K.row_major, decode_kernel, V.row_major);
  };
  std::vector<char> finite(static_cast<std::size_t>(tasks), 1);
  const Index team = std::max<Index>(1, std::min<Index>(tasks, region_threads()));
  parallel_for(tasks, make_ws, [&](Index t, MhWorkspace<Scalar>& ws) {
    const MhBlock& blk = blocks[static_cast<std::size_t>(task_block[static_cast<std::size_t>(t)])];
    const Index split = task_split[static_cast<std::size_t>(t)];
    // The block this thread probably runs next (tasks go to threads in turn): its queries are
    // prefetched during this one. A wrong guess costs only the prefetches.
    const Index tn = t + team;
    const MhBlock* next =
        tn < tasks ? &blocks[static_cast<std::size_t>(task_block[static_cast<std::size_t>(tn)])]
                   : nullptr;
    if (next == &blk || (next != nullptr && next->stacked)) next = nullptr;
    const bool ok = decode_kernel && blk.stacked ? mh_decode_pass(P, blk, split, ws)
                                                 : pass(P, blk, split, next, ws);
    finite[static_cast<std::size_t>(t)] = ok ? 1 : 0;
    const Index R = blk.nh * blk.rows;
    auto finish = [&](auto acc) {
      if (blk.splits == 1) {
        finish_rows(ws, R, acc, acc, ws.shift.head(R));
        store(blk, acc, ws.shift.head(R).matrix());
      } else {
        MhSplitState<Scalar>& st = states[static_cast<std::size_t>(blk.part)];
        st.m.col(split) = ws.m.head(R).matrix();
        st.l.col(split) = ws.l.head(R).matrix();
        st.acc[static_cast<std::size_t>(split)] = acc;
      }
    };
    if (V.row_major)
      finish(ws.accr.topRows(R));
    else
      finish(ws.acc.topRows(R));
  });
  scores_finite = std::find(finite.begin(), finite.end(), 0) == finite.end();
  if (!states.empty()) {
    std::vector<Index> split_blocks;
    for (Index i = 0; i < nblocks; ++i)
      if (blocks[static_cast<std::size_t>(i)].splits > 1) split_blocks.push_back(i);
    parallel_for(
        static_cast<Index>(split_blocks.size()), [] { return 0; },
        [&](Index t, int&) {
          const MhBlock& blk =
              blocks[static_cast<std::size_t>(split_blocks[static_cast<std::size_t>(t)])];
          const MhSplitState<Scalar>& st = states[static_cast<std::size_t>(blk.part)];
          Matrix<Scalar> o(st.m.rows(), dv);
          Vector<Scalar> lse(st.m.rows());
          merge_split_states(st.m, st.l, st.acc, o, lse);
          store(blk, o, lse);
        });
  }
  for (Index i = 0; i < nblocks; ++i) {
    const MhBlock& blk = blocks[static_cast<std::size_t>(i)];
    for (Index s = 0; s < blk.nh; ++s)
      if (!head_ok[first[static_cast<std::size_t>(i)] + static_cast<std::size_t>(s)])
        results[static_cast<std::size_t>(blk.seq * H + blk.h0 + s)].info = Info::NumericalIssue;
  }
}

}  // namespace detail
}  // namespace effattn
