/// \file multi_head_views.hpp
/// \brief Internal: packed views of `MultiHead`'s inputs (a matrix with unit inner stride read in
/// place, or evaluated once into a buffer), slices of them, their finiteness checks, and the
/// validation of the packed batch (heads, sequence offsets, `seqused_k`). Include
/// <effattn/multi_head.hpp> instead.
#pragma once

#include <cstdint>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../multi_head.hpp"

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

}  // namespace detail
}  // namespace effattn
