/// \file gemm.hpp
/// \brief One entry point for the library's matrix-matrix products: C (=, +=, -=) alpha op(A)
/// op(B) on column-major operands, each an Eigen `Matrix`, `Ref`, `Map` or a block of one.
///
/// Why it exists: every distinct operand type of an Eigen product instantiates its own product
/// evaluator, GEMM functor and OpenMP-parallel driver (`parallelize_gemm`), about half a second
/// of g++ -O2 each. Written inline, the methods' products came to 44 such drivers in a user file
/// that calls every functor once. Funnelled through `gemm` they bind to `Eigen::Ref` (no copy: a
/// static check refuses operands that would need one) and instantiate once per scalar type,
/// transposition pair and update (=, +=, -=): 10 drivers in that file.
///
/// Inside a parallel region the result is bit-identical to writing `C.noalias() = alpha * op(A) *
/// op(B)` (or `+=`, `-=`) inline there: Eigen's blocking, its small-product (coefficient-based)
/// path and the final scaling by alpha depend on the run-time sizes only, never on the operand's
/// expression type. Outside every region a large product is cut into panels fixed by its shape
/// (`gemm_ref`), so that its bits do not depend on the thread count, which Eigen's own
/// multithreaded GEMM does not promise.
#pragma once

#include <algorithm>
#include <type_traits>

#include "parallel.hpp"
#include "types.hpp"

namespace effattn {
namespace detail {

/// Whether an operand enters the product as stored or transposed.
enum class Op { N, T };

/// What `gemm` does with the product P: `Update::Assign` (C = P), `Update::Add` (C += P) or
/// `Update::Sub` (C -= P). Each is a distinct type, so a call instantiates only its own update.
template <int K>
struct UpdateKind {};
struct Update {
  static constexpr UpdateKind<0> Assign{};  ///< C = P
  static constexpr UpdateKind<1> Add{};     ///< C += P
  static constexpr UpdateKind<2> Sub{};     ///< C -= P
};

/// True when `Ref<const Matrix<Scalar>>` binds to an expression of type D without a copy: direct
/// access to column-major storage (a column block of a matrix is fine, a row of one is not).
template <typename D>
inline constexpr bool gemm_operand_v =
    (int(Eigen::internal::traits<D>::Flags) & Eigen::DirectAccessBit) != 0 &&
    (int(Eigen::internal::traits<D>::Flags) & Eigen::RowMajorBit) == 0 &&
    int(Eigen::internal::traits<D>::InnerStrideAtCompileTime) == 1;

/// Eigen's product C (=, +=, -=) alpha op(A) op(B), evaluated by the calling thread alone (the
/// caller makes sure Eigen does not split it over threads: see `gemm_ref`).
template <Op OA, Op OB, int U, typename Scalar>
void gemm_serial(Eigen::Ref<Matrix<Scalar>> C, const ConstRef<Scalar>& A, const ConstRef<Scalar>& B,
                 Scalar alpha) {
  const auto run = [&](const auto& a, const auto& b) {
    if constexpr (U == 0)
      C.noalias() = alpha * a * b;
    else if constexpr (U == 1)
      C.noalias() += alpha * a * b;
    else
      C.noalias() -= alpha * a * b;
  };
  if constexpr (OA == Op::N && OB == Op::N)
    run(A, B);
  else if constexpr (OA == Op::N)
    run(A, B.transpose());
  else if constexpr (OB == Op::N)
    run(A.transpose(), B);
  else
    run(A.transpose(), B.transpose());
}

/// Width of the column (or row) panels of C that `gemm_ref` computes as separate serial
/// products outside a parallel region: a multiple of every Eigen GEBP register block width.
inline constexpr Index kGemmPanel = 128;

/// The instantiated kernel behind `gemm` (one per Scalar, OA, OB, U); kept out of line so each call
/// site compiles to a call, not to another copy of Eigen's product.
///
/// Inside a parallel region (every `parallel_for` body) Eigen keeps a product on the calling
/// thread, with the blocking it chooses for one thread. Outside every region, Eigen would split a
/// large product over the threads itself, with a depth blocking chosen for their number, so the
/// bits would depend on the thread count (measured on an AMD EPYC with 32 KiB of L1 data cache,
/// double, depth 256: one thread sums the depth as 136 + 120, two threads as 248 + 8). There, C is
/// cut into panels of `kGemmPanel` columns (or rows, when C has fewer than two panels of columns)
/// fixed by the shape alone, each a serial product in a `parallel_for`: the same bits for any
/// thread count (one thread included).
template <Op OA, Op OB, int U, typename Scalar>
EIGEN_DONT_INLINE void gemm_ref(Eigen::Ref<Matrix<Scalar>> C, const ConstRef<Scalar>& A,
                                const ConstRef<Scalar>& B, Scalar alpha) {
#if EFFATTN_HAS_OPENMP
  const Index rows = C.rows(), cols = C.cols(), depth = OA == Op::N ? A.cols() : A.rows();
  // Eigen stays serial below 2 x 50000 multiply-adds (its parallelize_gemm) or with one thread.
  // omp_get_level() counts inactive (one-thread) regions too, so a `parallel_for` body takes the
  // serial branch below whatever the thread count.
  if (omp_get_level() == 0 &&
      static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(depth) >=
          100000.0) {
    const bool by_cols = cols >= 2 * kGemmPanel;
    const Index extent = by_cols ? cols : rows;
    if (extent < 2 * kGemmPanel) {
      // One panel: a region of its own, inside which Eigen keeps the product serial.
      run_serial([&] { gemm_serial<OA, OB, U, Scalar>(C, A, B, alpha); });
      return;
    }
    parallel_for(
        (extent + kGemmPanel - 1) / kGemmPanel, [] { return 0; },
        [&](Index p, int) {
          const Index p0 = p * kGemmPanel, w = std::min(kGemmPanel, extent - p0);
          if (by_cols) {
            if constexpr (OB == Op::N)
              gemm_serial<OA, OB, U, Scalar>(C.middleCols(p0, w), A, B.middleCols(p0, w), alpha);
            else
              gemm_serial<OA, OB, U, Scalar>(C.middleCols(p0, w), A, B.middleRows(p0, w), alpha);
          } else {
            if constexpr (OA == Op::N)
              gemm_serial<OA, OB, U, Scalar>(C.middleRows(p0, w), A.middleRows(p0, w), B, alpha);
            else
              gemm_serial<OA, OB, U, Scalar>(C.middleRows(p0, w), A.middleCols(p0, w), B, alpha);
          }
        });
    return;
  }
#endif
  gemm_serial<OA, OB, U, Scalar>(C, A, B, alpha);
}

/// C (=, +=, -=) alpha op(A) op(B), with `op` chosen by OA and OB (`Op::T` transposes) and the
/// update by the first argument (`Update::Assign`, `Add` or `Sub`). C, A and B are column-major
/// with unit inner stride (a `Matrix`, `Ref`, `Map` or a block of one; checked at compile time, so
/// nothing is copied) and C must not alias A or B. Cost: Eigen's GEMM (or GEMV when C has one
/// column), 2 m n k flops.
template <Op OA = Op::N, Op OB = Op::N, int U, typename DC, typename DA, typename DB>
inline void gemm(UpdateKind<U>, DC&& C, const DA& A, const DB& B,
                 typename DA::Scalar alpha = typename DA::Scalar(1)) {
  using Scalar = typename DA::Scalar;
  using C_t = std::remove_cv_t<std::remove_reference_t<DC>>;
  static_assert(
      std::is_same_v<typename DB::Scalar, Scalar> && std::is_same_v<typename C_t::Scalar, Scalar>,
      "gemm: operands of one scalar type");
  static_assert(gemm_operand_v<DA> && gemm_operand_v<DB> && gemm_operand_v<C_t>,
                "gemm: operands must be column-major with direct access (no hidden copy)");
  // A compile-time vector takes Eigen's GEMV product, whose small-size path differs from the
  // GEMM's in rounding: such products stay inline where they are written.
  static_assert(DA::RowsAtCompileTime != 1 && DA::ColsAtCompileTime != 1 &&
                    DB::RowsAtCompileTime != 1 && DB::ColsAtCompileTime != 1 &&
                    C_t::RowsAtCompileTime != 1 && C_t::ColsAtCompileTime != 1,
                "gemm: matrix-matrix products only");
  if constexpr (std::is_base_of_v<Eigen::PlainObjectBase<C_t>, C_t>) {
    // A plain destination is resized as `C.noalias() = ...` would (a Ref or a block cannot be).
    if constexpr (U == 0)
      C.resize(OA == Op::N ? A.rows() : A.cols(), OB == Op::N ? B.cols() : B.rows());
  }
  gemm_ref<OA, OB, U, Scalar>(Eigen::Ref<Matrix<Scalar>>(C), ConstRef<Scalar>(A),
                              ConstRef<Scalar>(B), alpha);
}

/// x as a double operand of `gemm` / `matmul`: x itself when its scalar is double (no copy), its
/// cast materialised into a column-major matrix otherwise (as Eigen evaluates a product of the
/// cast expression, so the bits are those of that product either way). The returned reference
/// lives as long as x: use it within the full expression that holds x.
template <typename Derived>
decltype(auto) as_double(const Derived& x) {
  if constexpr (std::is_same_v<typename Derived::Scalar, double>)
    return (x);
  else
    return Matrix<double>(x.template cast<double>());
}

/// alpha op(A) op(B) as a new matrix, through `gemm` (same operand rules). Inside a parallel region
/// equal, bit for bit, to Eigen's evaluation of the product expression `op(A) * op(B)` (or `alpha
/// * (op(A) * op(B))`), also where Eigen would evaluate it into a temporary as an operand of a
/// larger expression; outside, the panels of `gemm_ref`.
template <Op OA = Op::N, Op OB = Op::N, typename DA, typename DB>
Matrix<typename DA::Scalar> matmul(const DA& A, const DB& B,
                                   typename DA::Scalar alpha = typename DA::Scalar(1)) {
  Matrix<typename DA::Scalar> C(OA == Op::N ? A.rows() : A.cols(),
                                OB == Op::N ? B.cols() : B.rows());
  gemm<OA, OB>(Update::Assign, C, A, B, alpha);
  return C;
}

}  // namespace detail
}  // namespace effattn
