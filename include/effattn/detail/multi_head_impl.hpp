/// \file multi_head_impl.hpp
/// \brief Implementation of `MultiHead<F>`: packed views of the inputs, offset validation, the
/// per-(sequence, head) driver every functor uses, and the multi-head exact Tiled kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/online_softmax.hpp"
#include "../core/parallel.hpp"
#include "../multi_head.hpp"
#include "decode_avx512.hpp"

namespace effattn {
namespace detail {

template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename Scalar>
using ColMap = Eigen::Map<const Matrix<Scalar>, 0, Eigen::OuterStride<>>;
template <typename Scalar>
using RowMap = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// A dense matrix with unit inner stride, read in place: element (r, c) is at
/// data[r * outer + c] (row-major) or data[r + c * outer] (column-major).
template <typename Scalar, typename Ptr = const Scalar*>
struct PackedView {
  Ptr data = nullptr;
  Index rows = 0, cols = 0, outer = 0;
  bool row_major = false;
  Ptr at(Index r, Index c) const { return row_major ? data + r * outer + c : data + r + c * outer; }
};

/// The packed view of x: x itself when it has direct access with inner stride 1, otherwise x
/// evaluated once into `tmp_col` / `tmp_row` (its own storage order).
template <typename Derived, typename Scalar = typename Derived::Scalar>
PackedView<Scalar> packed_view(const Eigen::MatrixBase<Derived>& x, Matrix<Scalar>& tmp_col,
                               RowMatrix<Scalar>& tmp_row) {
  constexpr bool row_major = Derived::IsRowMajor;
  if constexpr ((Derived::Flags & Eigen::DirectAccessBit) != 0) {
    if (x.innerStride() == 1)
      return {x.derived().data(), x.rows(), x.cols(), x.outerStride(), row_major};
  }
  if constexpr (row_major) {
    tmp_row = x;
    return {tmp_row.data(), tmp_row.rows(), tmp_row.cols(), tmp_row.cols(), true};
  } else {
    tmp_col = x;
    return {tmp_col.data(), tmp_col.rows(), tmp_col.cols(), tmp_col.rows(), false};
  }
}

/// Calls fn(ref) with a `ConstRef` of rows [r0, r0 + nr) and columns [c0, c0 + nc) of v: a view
/// for column-major storage, a copy of the slice for row-major storage.
template <typename Scalar, typename Fn>
void with_slice_ref(const PackedView<Scalar>& v, Index r0, Index nr, Index c0, Index nc, Fn&& fn) {
  const Scalar* p = v.at(r0, c0);
  if (v.row_major) {
    const ConstRef<Scalar> ref(RowMap<Scalar>(p, nr, nc, Eigen::OuterStride<>(v.outer)));
    fn(ref);
  } else {
    const ConstRef<Scalar> ref(ColMap<Scalar>(p, nr, nc, Eigen::OuterStride<>(v.outer)));
    fn(ref);
  }
}

/// Writes `x` (nr x nc) into rows [r0, ...) and columns [c0, ...) of the output view.
template <typename Scalar, typename Derived>
void write_slice(const PackedView<Scalar, Scalar*>& out, Index r0, Index c0,
                 const Eigen::MatrixBase<Derived>& x) {
  Scalar* p = out.at(r0, c0);
  using RowOut = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
  using ColOut = Eigen::Map<Matrix<Scalar>, 0, Eigen::OuterStride<>>;
  if (out.row_major)
    RowOut(p, x.rows(), x.cols(), Eigen::OuterStride<>(out.outer)) = x;
  else
    ColOut(p, x.rows(), x.cols(), Eigen::OuterStride<>(out.outer)) = x;
}

/// Checks that `v` is a whole number of `heads` heads of width >= 1; returns the head width.
inline Index head_width(Index cols, Index heads, const char* arg, const char* heads_name) {
  EFFATTN_CHECK(cols >= heads && cols % heads == 0,
                cat("MultiHead: ", arg, " has ", cols, " columns, not a multiple (>= 1) of ",
                    heads_name, " = ", heads));
  return cols / heads;
}

/// The offsets `cu` validated against `rows` (an empty vector: one sequence of every row).
inline SeqOffsets resolve_offsets(const SeqOffsets& cu, Index rows, const char* arg) {
  if (cu.empty()) return {0, rows};
  EFFATTN_CHECK(cu.size() >= 2, cat("MultiHead: ", arg, " must hold B + 1 >= 2 offsets; got ",
                                    static_cast<Index>(cu.size())));
  EFFATTN_CHECK(cu.front() == 0, cat("MultiHead: ", arg, "[0] must be 0; got ", cu.front()));
  for (std::size_t b = 1; b < cu.size(); ++b)
    EFFATTN_CHECK(cu[b] >= cu[b - 1], cat("MultiHead: ", arg, " must be non-decreasing; got ", arg,
                                          "[", static_cast<Index>(b - 1), "] = ", cu[b - 1], " > ",
                                          arg, "[", static_cast<Index>(b), "] = ", cu[b]));
  EFFATTN_CHECK(cu.back() == rows,
                cat("MultiHead: ", arg, " must end at the row count ", rows, "; got ", cu.back()));
  return cu;
}

/// True when rows [r0, r0 + nr) and columns [c0, c0 + nc) of v are finite, read in storage
/// order (a row-major slice through its transpose).
template <typename Scalar>
bool slice_finite(const PackedView<Scalar>& v, Index r0, Index nr, Index c0, Index nc) {
  if (nr == 0 || nc == 0) return true;
  const Scalar* p = v.at(r0, c0);
  if (v.row_major) return all_finite(ColMap<Scalar>(p, nc, nr, Eigen::OuterStride<>(v.outer)));
  return all_finite(ColMap<Scalar>(p, nr, nc, Eigen::OuterStride<>(v.outer)));
}

/// Throws `invalid_argument` naming `name` and the first non-finite entry of v, if any.
template <typename Scalar>
void check_finite_view(const PackedView<Scalar>& v, const char* name) {
  if (EFFATTN_LIKELY(slice_finite(v, 0, v.rows, 0, v.cols))) return;
  if (v.row_major)
    check_finite(RowMap<Scalar>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.outer)), name);
  else
    check_finite(ColMap<Scalar>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.outer)), name);
}

/// The batch of one call: validated query and key offsets, head widths.
struct MultiHeadBatch {
  SeqOffsets q, k;           ///< B + 1 offsets each (k: where each sequence's key rows start)
  std::vector<Index> k_len;  ///< B key counts (k[b + 1] - k[b], or seqused_k[b])
  Index d = 0, dv = 0;       ///< head widths
  Index batch() const { return static_cast<Index>(q.size()) - 1; }
  /// Queries of sequence b.
  Index nq(Index b) const {
    return q[static_cast<std::size_t>(b) + 1] - q[static_cast<std::size_t>(b)];
  }
  /// Keys of sequence b.
  Index nk(Index b) const { return k_len[static_cast<std::size_t>(b)]; }
};

/// Validates the packed inputs of `MultiHead::compute` (see its documentation).
template <typename Scalar>
MultiHeadBatch check_multi_head(const PackedView<Scalar>& Q, const PackedView<Scalar>& K,
                                const PackedView<Scalar>& V, const HeadLayout& layout,
                                const SeqOffsets& cu_q, const SeqOffsets& cu_k,
                                const std::vector<Index>& seqused_k, bool check_q = true) {
  MultiHeadBatch mb;
  mb.d = head_width(Q.cols, layout.heads, "Q", "heads");
  const Index dk = head_width(K.cols, layout.kv_heads, "K", "kv_heads");
  EFFATTN_CHECK(dk == mb.d, cat("MultiHead: K must have kv_heads * d = ", layout.kv_heads * mb.d,
                                " columns (d = ", mb.d, " from Q); got ", K.cols));
  mb.dv = head_width(V.cols, layout.kv_heads, "V", "kv_heads");
  EFFATTN_CHECK(V.rows == K.rows,
                cat("MultiHead: V must have the rows of K (", K.rows, "); got ", V.rows));
  mb.q = resolve_offsets(cu_q, Q.rows, "cu_seqlens_q");
  if (cu_k.empty() && mb.q.size() > 2) {
    EFFATTN_CHECK(K.rows == Q.rows, cat("MultiHead: cu_seqlens_k is needed when K has other rows (",
                                        K.rows, ") than Q (", Q.rows, ") in a batch of ",
                                        static_cast<Index>(mb.q.size() - 1), " sequences"));
    mb.k = mb.q;
  } else {
    mb.k = resolve_offsets(cu_k, K.rows, "cu_seqlens_k");
  }
  EFFATTN_CHECK(mb.q.size() == mb.k.size(),
                cat("MultiHead: cu_seqlens_q and cu_seqlens_k must describe the same batch; got ",
                    static_cast<Index>(mb.q.size() - 1), " and ",
                    static_cast<Index>(mb.k.size() - 1), " sequences"));
  EFFATTN_CHECK(seqused_k.empty() || static_cast<Index>(seqused_k.size()) == mb.batch(),
                cat("MultiHead: seqused_k must hold one value per sequence (", mb.batch(),
                    "); got ", static_cast<Index>(seqused_k.size())));
  for (Index b = 0; b < mb.batch(); ++b) {
    const std::size_t i = static_cast<std::size_t>(b);
    const Index region = mb.k[i + 1] - mb.k[i];
    if (seqused_k.empty()) {
      mb.k_len.push_back(region);
    } else {
      EFFATTN_CHECK(
          seqused_k[i] >= 0 && seqused_k[i] <= region,
          cat("MultiHead: seqused_k[", b, "] = ", seqused_k[i], " must lie in [0, cu_seqlens_k[",
              b + 1, "] - cu_seqlens_k[", b, "] = ", region, "]"));
      mb.k_len.push_back(seqused_k[i]);
    }
    EFFATTN_CHECK(mb.nq(b) == 0 || mb.nk(b) > 0,
                  cat("MultiHead: sequence ", b, " has ", mb.nq(b), " queries but no keys"));
  }
  if (check_q) check_finite_view(Q, "Q");
  return mb;
}

/// Rethrows an `invalid_argument` from one (sequence, head) call with its position.
[[noreturn]] EFFATTN_COLD inline void rethrow_for_head(const char* method, const char* what_,
                                                       Index b, Index h, const char* head_kind) {
  std::string what(what_);
  const std::string prefix = "effattn: ";
  if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
  throw_invalid_argument(
      cat("MultiHead<", method, ">: sequence ", b, ", ", head_kind, " ", h, ": ", what));
}

/// Runs `head_call(b, h, q)` (returning F::Result) for every (sequence b, query head h) with q
/// the head's query rows as a ConstRef, in parallel over (b, h), each call serial inside its
/// task; writes each Result's output into `out`, keeps the Result without it, and sets `info`
/// (the first failure in (b, h) order).
template <typename F, typename HeadCall>
void run_per_head(const PackedView<typename F::Scalar>& Q, const SeqOffsets& oq, Index heads,
                  Index d, Index dv, const PackedView<typename F::Scalar, typename F::Scalar*>& out,
                  std::vector<typename F::Result>& results, Info& info, HeadCall&& head_call) {
  using Scalar = typename F::Scalar;
  const Index batch = static_cast<Index>(oq.size()) - 1;
  results.assign(static_cast<std::size_t>(batch * heads), typename F::Result{});
  parallel_for(
      batch * heads, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / heads, h = t % heads;
        const Index q0 = oq[static_cast<std::size_t>(b)];
        const Index nq = oq[static_cast<std::size_t>(b + 1)] - q0;
        typename F::Result& res = results[static_cast<std::size_t>(t)];
        if (nq == 0) {
          res.info = Info::Success;
          return;
        }
        try {
          with_slice_ref(Q, q0, nq, h * d, d,
                         [&](const ConstRef<Scalar>& q) { res = head_call(b, h, q); });
        } catch (const ::effattn::invalid_argument& e) {
          rethrow_for_head(F::name, e.what(), b, h, "head");
        }
        EFFATTN_ASSERT(res.output.rows() == nq && res.output.cols() == dv);
        write_slice(out, q0, h * dv, res.output);
        res.output.resize(0, 0);
      });
  info = Info::Success;
  for (const auto& r : results)
    if (r.info != Info::Success) {
      info = r.info;
      break;
    }
}

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
/// `decode_stream/row/32768` (per-run ratio 0.97-1.32, median 1.19; AMD Zen 5, 2 threads,
/// 2026-12-02). A second, near prefetch into L1 (the next kv head's slices of the current
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

template <typename F>
MultiHead<F>::MultiHead(Options opts, HeadLayout layout) : m_functor(opts), m_layout(layout) {
  EFFATTN_CHECK(m_layout.heads >= 1,
                detail::cat("MultiHead: HeadLayout::heads must be >= 1; got ", m_layout.heads));
  EFFATTN_CHECK(m_layout.kv_heads >= 0,
                detail::cat("MultiHead: HeadLayout::kv_heads must be >= 0 (0 = heads); got ",
                            m_layout.kv_heads));
  if (m_layout.kv_heads == 0) m_layout.kv_heads = m_layout.heads;
  EFFATTN_CHECK(m_layout.heads % m_layout.kv_heads == 0,
                detail::cat("MultiHead: HeadLayout::heads (", m_layout.heads,
                            ") must be a multiple of kv_heads (", m_layout.kv_heads, ")"));
}

namespace detail {

/// Whether the memory spans of two packed views overlap.
template <typename Scalar, typename PtrA, typename PtrB>
bool views_overlap(const PackedView<Scalar, PtrA>& a, const PackedView<Scalar, PtrB>& b) {
  if (a.rows == 0 || a.cols == 0 || b.rows == 0 || b.cols == 0) return false;
  const auto lo = [](const auto& v) { return reinterpret_cast<std::uintptr_t>(v.at(0, 0)); };
  const auto hi = [](const auto& v) {
    return reinterpret_cast<std::uintptr_t>(v.at(v.rows - 1, v.cols - 1) + 1);
  };
  return lo(a) < hi(b) && lo(b) < hi(a);
}

/// The packed views of Q, K and V (each evaluated once into the buffers here when it is an
/// expression or has an inner stride) and the checked batch, as the forward calls read them.
template <typename Scalar>
struct MhInputs {
  Matrix<Scalar> tq, tk, tv;
  RowMatrix<Scalar> rq, rk, rv;
  PackedView<Scalar> q, k, v;
  MultiHeadBatch mb;
  template <typename DQ, typename DK, typename DV>
  MhInputs(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
           const Eigen::MatrixBase<DV>& V, const HeadLayout& layout, const SeqOffsets& cu_q,
           const SeqOffsets& cu_k, const std::vector<Index>& seqused_k, bool check_q)
      : q(packed_view(Q, tq, rq)),
        k(packed_view(K, tk, rk)),
        v(packed_view(V, tv, rv)),
        mb(check_multi_head(q, k, v, layout, cu_q, cu_k, seqused_k, check_q)) {}
  MhInputs(const MhInputs&) = delete;  // the views may point into the buffers
  MhInputs& operator=(const MhInputs&) = delete;
};

/// The forward pass of `MultiHead<F>::compute` and `compute_into` on packed views of checked
/// inputs (`mb`): writes the output into `ov` (T_q x heads dv) and fills r's status and
/// per-head Results (not `r.output`).
template <typename F, int Order>
void multi_head_forward(const F& functor, const HeadLayout& layout,
                        const PackedView<typename F::Scalar>& qv,
                        const PackedView<typename F::Scalar>& kv,
                        const PackedView<typename F::Scalar>& vv, const MultiHeadBatch& mb,
                        const PackedView<typename F::Scalar, typename F::Scalar*>& ov,
                        MultiHeadResult<F, Order>& r) {
  using Scalar = typename F::Scalar;
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const Index H = layout.heads, group = layout.heads / layout.kv_heads;
  r.batch = mb.batch();
  r.heads = H;
  r.kv_heads = layout.kv_heads;
  if constexpr (kExactTiled) {
    const ExactOptions& o = functor.options();
    for (Index b = 0; b < mb.batch(); ++b) {
      const std::size_t i = static_cast<std::size_t>(b);
      EFFATTN_CHECK(!o.causal || mb.k_len[i] >= mb.q[i + 1] - mb.q[i],
                    cat("MultiHead<", F::name,
                        ">: causal attention needs as many keys "
                        "as queries in every sequence; sequence ",
                        b, " has ", mb.q[i + 1] - mb.q[i], " queries and ", mb.k_len[i], " keys"));
    }
    bool scores_finite = true;
    multi_head_exact<Scalar>(o, layout, qv, kv, vv, ov, mb, r.head_results, r.tasks, scores_finite);
    // Each block's rows were checked for finiteness in cache by the kernel.
    r.info = Info::Success;
    for (const auto& hr : r.head_results)
      if (hr.info != Info::Success) r.info = Info::NumericalIssue;
    // Non-finite queries, scores or output: a non-finite query, key or value throws
    // invalid_argument here (the inputs are scanned only then); otherwise it was an overflow
    // (info says so).
    if (!scores_finite || r.info != Info::Success) {
      check_finite_view(qv, "Q");
      check_finite_view(kv, "K");
      check_finite_view(vv, "V");
    }
  } else {
    check_finite_view(kv, "K");
    check_finite_view(vv, "V");
    r.tasks = mb.batch() * H;
    run_per_head<F>(qv, mb.q, H, mb.d, mb.dv, ov, r.head_results, r.info,
                    [&](Index b, Index h, const ConstRef<Scalar>& q) {
                      const std::size_t i = static_cast<std::size_t>(b);
                      const Index k0 = mb.k[i], nk = mb.k_len[i], g = h / group;
                      typename F::Result res;
                      with_slice_ref(kv, k0, nk, g * mb.d, mb.d, [&](const ConstRef<Scalar>& k) {
                        with_slice_ref(
                            vv, k0, nk, g * mb.dv, mb.dv,
                            [&](const ConstRef<Scalar>& v) { res = functor.compute(q, k, v); });
                      });
                      return res;
                    });
  }
}

}  // namespace detail

template <typename F>
template <typename DQ, typename DK, typename DV>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)> MultiHead<F>::compute(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const SeqOffsets& cu_seqlens_q, const SeqOffsets& cu_seqlens_k,
    const std::vector<Index>& seqused_k) const {
  static_assert(std::is_same_v<typename DQ::Scalar, Scalar> &&
                    std::is_same_v<typename DK::Scalar, Scalar> &&
                    std::is_same_v<typename DV::Scalar, Scalar>,
                "effattn: MultiHead<F>::compute takes Q, K, V of F's scalar type");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  // The exact kernel checks each query block as it loads it (Q is not scanned beforehand).
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const detail::MhInputs<Scalar> in(Q, K, V, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    /*check_q=*/!kExactTiled);
  const detail::PackedView<Scalar>&qv = in.q, &kv = in.k, &vv = in.v;
  const detail::MultiHeadBatch& mb = in.mb;
  MultiHeadResult<F, order> r;
  r.output.resize(qv.rows, m_layout.heads * mb.dv);
  // A prefill output is large (64 MiB at B = 8, L = 512, 32 heads of 128) and written once:
  // its page faults were 6% of the exact kernel's time with 4 KiB pages. Its pages are then
  // mapped in one call before the kernel (see populate_pages).
  detail::advise_huge_pages(r.output);
  detail::populate_pages(r.output);
  const detail::PackedView<Scalar, Scalar*> ov{
      r.output.data(), r.output.rows(), r.output.cols(),
      order == Eigen::RowMajor ? r.output.cols() : r.output.rows(), order == Eigen::RowMajor};
  detail::multi_head_forward(m_functor, m_layout, qv, kv, vv, mb, ov, r);
  return r;
}

template <typename F>
template <typename DQ, typename DK, typename DV, typename DOut>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)> MultiHead<F>::compute_into(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DOut>& out, const SeqOffsets& cu_seqlens_q,
    const SeqOffsets& cu_seqlens_k, const std::vector<Index>& seqused_k) const {
  static_assert(std::is_same_v<typename DQ::Scalar, Scalar> &&
                    std::is_same_v<typename DK::Scalar, Scalar> &&
                    std::is_same_v<typename DV::Scalar, Scalar> &&
                    std::is_same_v<typename DOut::Scalar, Scalar>,
                "effattn: MultiHead<F>::compute_into takes Q, K, V and out of F's scalar type");
  static_assert(
      (DOut::Flags & Eigen::DirectAccessBit) != 0 && (DOut::Flags & Eigen::LvalueBit) != 0,
      "effattn: MultiHead<F>::compute_into writes into a Matrix, a Map or a block of "
      "one (a writable expression with direct access)");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const detail::MhInputs<Scalar> in(Q, K, V, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    /*check_q=*/!kExactTiled);
  const detail::PackedView<Scalar>&qv = in.q, &kv = in.k, &vv = in.v;
  const detail::MultiHeadBatch& mb = in.mb;
  // Eigen's idiom for an output argument that may be a temporary Block or Map.
  DOut& o = const_cast<DOut&>(out.derived());
  const Index T = qv.rows, width = m_layout.heads * mb.dv;
  EFFATTN_CHECK(o.rows() == T && o.cols() == width,
                detail::cat("MultiHead<", F::name, ">::compute_into: out must be ", T, " x ", width,
                            " (T_q x heads dv); got ", o.rows(), " x ", o.cols()));
  EFFATTN_CHECK(
      o.innerStride() == 1,
      detail::cat("MultiHead<", F::name, ">::compute_into: out must have inner stride 1; got ",
                  o.innerStride()));
  const detail::PackedView<Scalar, Scalar*> ov{o.data(), T, width, o.outerStride(),
                                               static_cast<bool>(DOut::IsRowMajor)};
  for (const auto* view : {&qv, &kv, &vv})
    EFFATTN_CHECK(!detail::views_overlap(ov, *view),
                  detail::cat("MultiHead<", F::name, ">::compute_into: out overlaps ",
                              view == &qv   ? "Q"
                              : view == &kv ? "K"
                                            : "V"));
  MultiHeadResult<F, order> r;
  detail::multi_head_forward(m_functor, m_layout, qv, kv, vv, mb, ov, r);
  return r;
}

namespace detail {
/// Whether F has `backward(Q, K, V, result, dO)`.
template <typename F, typename = void>
struct has_backward : std::false_type {};
template <typename F>
struct has_backward<F, std::void_t<decltype(std::declval<const F&>().backward(
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const typename F::Result&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>()))>>
    : std::true_type {};
}  // namespace detail

template <typename F>
template <typename DQ, typename DK, typename DV, int ResultOrder, typename DO>
MultiHeadGradients<typename F::Scalar, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
MultiHead<F>::backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V,
                       const MultiHeadResult<F, ResultOrder>& result,
                       const Eigen::MatrixBase<DO>& dO, const SeqOffsets& cu_seqlens_q,
                       const SeqOffsets& cu_seqlens_k, const std::vector<Index>& seqused_k) const {
  static_assert(detail::has_backward<F>::value,
                "effattn: MultiHead<F>::backward needs a functor with backward (exact attention, "
                "Conv-Basis, Performer, EVA)");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  Matrix<Scalar> tq, tk, tv, to, tdo;
  detail::RowMatrix<Scalar> rq, rk, rv, ro, rdo;
  const detail::PackedView<Scalar> qv = detail::packed_view(Q, tq, rq);
  const detail::PackedView<Scalar> kv = detail::packed_view(K, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V, tv, rv);
  const detail::MultiHeadBatch mb =
      detail::check_multi_head(qv, kv, vv, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k);
  const Index H = m_layout.heads, G = m_layout.kv_heads, group = H / G, B = mb.batch();
  const Index d = mb.d, dv = mb.dv;
  EFFATTN_CHECK(result.info == Info::Success,
                detail::cat("MultiHead<", F::name,
                            ">: backward needs the result of a successful forward call; got info ",
                            static_cast<int>(result.info)));
  EFFATTN_CHECK(
      result.heads == H && result.kv_heads == G && result.batch == B &&
          result.head_results.size() == static_cast<std::size_t>(B * H) &&
          result.output.rows() == qv.rows && result.output.cols() == H * dv,
      detail::cat("MultiHead<", F::name, ">: result must be the forward result of these inputs (",
                  B, " sequences, ", H, " heads, ", G, " kv heads, output ", qv.rows, " x ", H * dv,
                  "); got ", result.batch, " sequences, ", result.heads, " heads, ",
                  result.kv_heads, " kv heads, output ", detail::shape(result.output)));
  const detail::PackedView<Scalar> ov = detail::packed_view(result.output, to, ro);
  const detail::PackedView<Scalar> dov = detail::packed_view(dO, tdo, rdo);
  EFFATTN_CHECK(
      dov.rows == qv.rows && dov.cols == H * dv,
      detail::cat("MultiHead<", F::name, ">: dO must be T_q x heads dv = ", qv.rows, " x ", H * dv,
                  " (the output's shape); got ", dov.rows, " x ", dov.cols));
  detail::check_finite_view(dov, "dO");

  MultiHeadGradients<Scalar, order> g;
  g.dQ.setZero(qv.rows, H * d);
  g.dK.setZero(kv.rows, G * d);
  g.dV.setZero(vv.rows, G * dv);
  auto view = [](auto& x) {
    return detail::PackedView<Scalar, Scalar*>{x.data(), x.rows(), x.cols(),
                                               order == Eigen::RowMajor ? x.cols() : x.rows(),
                                               order == Eigen::RowMajor};
  };
  const auto dqv = view(g.dQ), dkv = view(g.dK), dvv = view(g.dV);
  // Tasks (sequence, kv head): each owns its dK, dV slice and its query heads' dQ slices.
  detail::parallel_for(
      B * G, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / G, kvh = t % G;
        const std::size_t i = static_cast<std::size_t>(b);
        const Index q0 = mb.q[i], nq = mb.q[i + 1] - q0, k0 = mb.k[i], nk = mb.k_len[i];
        if (nq == 0) return;
        Matrix<Scalar> dk = Matrix<Scalar>::Zero(nk, d), dvs = Matrix<Scalar>::Zero(nk, dv);
        for (Index h = kvh * group; h < (kvh + 1) * group; ++h) {
          typename F::Result hr = result.head(b, h);
          detail::with_slice_ref(ov, q0, nq, h * dv, dv,
                                 [&](const ConstRef<Scalar>& o) { hr.output = o; });
          try {
            detail::with_slice_ref(qv, q0, nq, h * d, d, [&](const ConstRef<Scalar>& q) {
              detail::with_slice_ref(kv, k0, nk, kvh * d, d, [&](const ConstRef<Scalar>& k) {
                detail::with_slice_ref(vv, k0, nk, kvh * dv, dv, [&](const ConstRef<Scalar>& v) {
                  detail::with_slice_ref(dov, q0, nq, h * dv, dv, [&](const ConstRef<Scalar>& go) {
                    const auto gr = m_functor.backward(q, k, v, hr, go);
                    detail::write_slice(dqv, q0, h * d, gr.dQ);
                    dk += gr.dK;
                    dvs += gr.dV;
                  });
                });
              });
            });
          } catch (const ::effattn::invalid_argument& e) {
            detail::rethrow_for_head(F::name, e.what(), b, h, "head");
          }
        }
        detail::write_slice(dkv, k0, kvh * d, dk);
        detail::write_slice(dvv, k0, kvh * dv, dvs);
      });
  return g;
}

template <typename F>
template <typename DK, typename DV>
auto MultiHead<F>::compress_kv(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                               const SeqOffsets& cu_seqlens_k, double q_radius) const {
  using Cache = std::decay_t<decltype(m_functor.compress_kv(
      std::declval<const ConstRef<Scalar>&>(), std::declval<const ConstRef<Scalar>&>(), 0.0))>;
  Matrix<Scalar> tk, tv;
  detail::RowMatrix<Scalar> rk, rv;
  const detail::PackedView<Scalar> kv = detail::packed_view(K, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V, tv, rv);
  const Index G = m_layout.kv_heads;
  const Index d = detail::head_width(kv.cols, G, "K", "kv_heads");
  const Index dv = detail::head_width(vv.cols, G, "V", "kv_heads");
  EFFATTN_CHECK(vv.rows == kv.rows,
                detail::cat("MultiHead: V must have the rows of K (", kv.rows, "); got ", vv.rows));
  const SeqOffsets ok = detail::resolve_offsets(cu_seqlens_k, kv.rows, "cu_seqlens_k");
  MultiHeadCache<Cache> cache;
  cache.batch = static_cast<Index>(ok.size()) - 1;
  cache.kv_heads = G;
  cache.caches.resize(static_cast<std::size_t>(cache.batch * G));
  detail::parallel_for(
      cache.batch * G, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / G, g = t % G;
        const Index k0 = ok[static_cast<std::size_t>(b)];
        const Index nk = ok[static_cast<std::size_t>(b + 1)] - k0;
        try {
          detail::with_slice_ref(kv, k0, nk, g * d, d, [&](const ConstRef<Scalar>& k) {
            detail::with_slice_ref(vv, k0, nk, g * dv, dv, [&](const ConstRef<Scalar>& v) {
              cache.caches[static_cast<std::size_t>(t)] = m_functor.compress_kv(k, v, q_radius);
            });
          });
        } catch (const ::effattn::invalid_argument& e) {
          detail::rethrow_for_head(F::name, e.what(), b, g, "kv head");
        }
      });
  return cache;
}

template <typename F>
template <typename Cache, typename DK, typename DV>
void MultiHead<F>::append(MultiHeadCache<Cache>& cache, const Eigen::MatrixBase<DK>& K_new,
                          const Eigen::MatrixBase<DV>& V_new,
                          const SeqOffsets& cu_seqlens_new) const {
  Matrix<Scalar> tk, tv;
  detail::RowMatrix<Scalar> rk, rv;
  const detail::PackedView<Scalar> kv = detail::packed_view(K_new, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V_new, tv, rv);
  const Index G = m_layout.kv_heads;
  EFFATTN_CHECK(cache.kv_heads == G, detail::cat("MultiHead: the cache has ", cache.kv_heads,
                                                 " kv heads, the layout ", G));
  const Index d = detail::head_width(kv.cols, G, "K_new", "kv_heads");
  const Index dv = detail::head_width(vv.cols, G, "V_new", "kv_heads");
  EFFATTN_CHECK(vv.rows == kv.rows, detail::cat("MultiHead: V_new must have the rows of K_new (",
                                                kv.rows, "); got ", vv.rows));
  const SeqOffsets on = detail::resolve_offsets(cu_seqlens_new, kv.rows, "cu_seqlens_new");
  EFFATTN_CHECK(
      static_cast<Index>(on.size()) - 1 == cache.batch,
      detail::cat("MultiHead: cu_seqlens_new describes ", static_cast<Index>(on.size()) - 1,
                  " sequences, the cache ", cache.batch));
  for (Index b = 0; b < cache.batch; ++b) {
    const Index k0 = on[static_cast<std::size_t>(b)];
    const Index nk = on[static_cast<std::size_t>(b + 1)] - k0;
    if (nk == 0) continue;
    for (Index g = 0; g < G; ++g) {
      try {
        detail::with_slice_ref(kv, k0, nk, g * d, d, [&](const ConstRef<Scalar>& k) {
          detail::with_slice_ref(vv, k0, nk, g * dv, dv,
                                 [&](const ConstRef<Scalar>& v) { cache.at(b, g).append(k, v); });
        });
      } catch (const ::effattn::invalid_argument& e) {
        detail::rethrow_for_head(F::name, e.what(), b, g, "kv head");
      }
    }
  }
}

template <typename F>
template <typename Cache, typename DQ>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
MultiHead<F>::weighted_attention(const Eigen::MatrixBase<DQ>& Q, const MultiHeadCache<Cache>& cache,
                                 const SeqOffsets& cu_seqlens_q) const {
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  Matrix<Scalar> tq;
  detail::RowMatrix<Scalar> rq;
  const detail::PackedView<Scalar> qv = detail::packed_view(Q, tq, rq);
  const Index H = m_layout.heads, G = m_layout.kv_heads, group = H / G;
  EFFATTN_CHECK(cache.kv_heads == G, detail::cat("MultiHead: the cache has ", cache.kv_heads,
                                                 " kv heads, the layout ", G));
  const Index d = detail::head_width(qv.cols, H, "Q", "heads");
  const SeqOffsets oq = detail::resolve_offsets(cu_seqlens_q, qv.rows, "cu_seqlens_q");
  EFFATTN_CHECK(static_cast<Index>(oq.size()) - 1 == cache.batch,
                detail::cat("MultiHead: cu_seqlens_q describes ", static_cast<Index>(oq.size()) - 1,
                            " sequences, the cache ", cache.batch));
  EFFATTN_CHECK(!cache.caches.empty(), "MultiHead: the cache is empty");
  const Index dv = cache.caches.front().values.cols();
  MultiHeadResult<F, order> r;
  r.batch = cache.batch;
  r.heads = H;
  r.kv_heads = G;
  r.tasks = cache.batch * H;
  r.output.resize(qv.rows, H * dv);
  const detail::PackedView<Scalar, Scalar*> ov{
      r.output.data(), r.output.rows(), r.output.cols(),
      order == Eigen::RowMajor ? r.output.cols() : r.output.rows(), order == Eigen::RowMajor};
  detail::run_per_head<F>(qv, oq, H, d, dv, ov, r.head_results, r.info,
                          [&](Index b, Index h, const ConstRef<Scalar>& q) {
                            return m_functor.weighted_attention(q, cache.at(b, h / group));
                          });
  return r;
}

}  // namespace effattn
