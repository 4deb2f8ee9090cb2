/// \file householder.hpp
/// \brief Private: Householder QR (compact form, blocked) and the application of its Q, for
/// KEP-SVGP's range finder, its small SVDs (detail/linalg/jacobi_svd.hpp) and its factorised
/// engine.
///
/// Why not `Eigen::HouseholderQR`: instantiating it (its blocked factorisation and its
/// `HouseholderSequence` with their triangular block updates) cost about 4.5 s and 200 MB of
/// g++ -O2 in every translation unit that calls `KepSvgpAttention<float>` (measured:
/// 12.4 s for such a TU, 7.7 s with every QR taken out). This file reuses the
/// library's `gemm` (already instantiated by the methods) for everything larger than a vector
/// operation.
///
/// Algorithm (LAPACK's geqrf/larft/larfb, Golub and Van Loan 5.2): panels of `kQrPanel` columns;
/// within a panel, column by column, the reflector H = I - tau v v^T (v(0) = 1) that maps the
/// column's tail to beta e_1 (|beta| = its norm, sign opposite to its first entry, so no
/// cancellation) is formed and applied to the panel's remaining columns; the panel's reflectors
/// are then accumulated as I - V T V^T (T upper triangular, forward columnwise) and applied to the
/// trailing columns by three GEMMs. A zero tail gives tau = 0 (H = I). Backward stable; Q is
/// orthogonal to working precision whatever the rank of A. Cost 2 rows cols^2 - 2/3 cols^3 flops
/// (tall), about two thirds of it in the trailing GEMMs.
///
/// Against Eigen's HouseholderQR (which KEP-SVGP used before): the same reflectors
/// (same sign convention and scaling), summed in another order, so R, Q and every KEP-SVGP
/// output differ from before by Scalar round-off (relative 6e-7 to 3e-6 in float, 4e-15 to 6e-15
/// in double on the test suite's workloads; errors against exact attention unchanged).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "../../core/gemm.hpp"
#include "../../core/types.hpp"

namespace effattn {
namespace detail {

/// Columns per panel of `householder_qr` and `householder_apply_q`.
inline constexpr Index kQrPanel = 32;

/// The unit lower trapezoidal V (rows x nb) of the reflectors stored below the diagonal of
/// qr(k :, k : k + nb), and the upper triangular T (nb x nb) with H_k ... H_{k+nb-1} =
/// I - V T V^T (LAPACK larft, forward, columnwise: T(0:i, i) = -tau_i T(0:i, 0:i) V(:, 0:i)^T v_i).
template <typename Scalar>
void householder_block(const Matrix<Scalar>& qr, const Vector<Scalar>& tau, Index k, Index nb,
                       Matrix<Scalar>& V, Matrix<Scalar>& T) {
  const Index rows = qr.rows() - k;
  V.setZero(rows, nb);
  for (Index j = 0; j < nb; ++j) {
    V(j, j) = Scalar(1);
    for (Index i = j + 1; i < rows; ++i) V(i, j) = qr(k + i, k + j);
  }
  T.setZero(nb, nb);
  Matrix<Scalar> z(nb, 1);
  for (Index i = 0; i < nb; ++i) {
    const Scalar t = tau(k + i);
    T(i, i) = t;
    if (i == 0 || t == Scalar(0)) continue;
    // z = V(:, 0:i)^T v_i (rows i.. of v_i only: v_i is zero above row i).
    auto zi = z.topRows(i);
    gemm<Op::T, Op::N>(Update::Assign, zi, V.block(i, 0, rows - i, i), V.block(i, i, rows - i, 1));
    for (Index r = 0; r < i; ++r) {
      Scalar acc(0);
      for (Index c = r; c < i; ++c) acc += T(r, c) * z(c, 0);
      T(r, i) = -t * acc;
    }
  }
}

/// Householder QR of A (rows x cols) in place, in LAPACK's compact form: R on and above the
/// diagonal, the essential parts of the reflectors v_j (v_j(j) = 1 implied) below it, and their
/// coefficients in tau (min(rows, cols)); A = H_0 H_1 ... H_{k-1} R with H_j = I - tau_j v_j v_j^T.
template <typename Scalar>
void householder_qr(Matrix<Scalar>& A, Vector<Scalar>& tau) {
  const Index rows = A.rows(), cols = A.cols(), size = std::min(rows, cols);
  tau.setZero(size);
  Matrix<Scalar> w, V, T, W;
  for (Index k = 0; k < size; k += kQrPanel) {
    const Index nb = std::min(kQrPanel, size - k), pend = k + nb;
    for (Index j = k; j < pend; ++j) {
      // The reflector of column j's tail x = A(j :, j): beta = -sign(x_0) ||x||, v = x / (x_0 -
      // beta) with v_0 = 1, tau = (beta - x_0) / beta (Eigen's makeHouseholder convention).
      // The squared norm of the tail is summed in double.
      Scalar* x = A.data() + j * rows + j;
      const Index len = rows - j;
      double part[4] = {0, 0, 0, 0};  // four independent sums (a single chain is latency-bound)
      Index i = 1;
      for (; i + 4 <= len; i += 4)
        for (int u = 0; u < 4; ++u)
          part[u] += static_cast<double>(x[i + u]) * static_cast<double>(x[i + u]);
      for (; i < len; ++i) part[0] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      const double tail = (part[0] + part[1]) + (part[2] + part[3]);
      const Scalar x0 = x[0];
      if (tail <= static_cast<double>(std::numeric_limits<Scalar>::min())) {
        tau(j) = Scalar(0);  // H = I; x stays (R(j, j) = x_0)
        for (Index r = 1; r < len; ++r) x[r] = Scalar(0);
      } else {
        const double x0d = static_cast<double>(x0);
        Scalar beta = static_cast<Scalar>(std::sqrt(x0d * x0d + tail));
        if (x0 >= Scalar(0)) beta = -beta;
        // Divided, not multiplied by the reciprocal: one rounding per entry (a constant column
        // then gives an exactly constant v, and a rank-one kernel an exactly zero residual).
        const Scalar den = x0 - beta;
        for (Index r = 1; r < len; ++r) x[r] /= den;
        tau(j) = (beta - x0) / beta;
        x[0] = beta;
      }
      // Apply H_j to the panel's remaining columns: B -= tau v (v^T B).
      const Index rest = pend - j - 1;
      if (rest == 0 || tau(j) == Scalar(0)) continue;
      const Scalar saved = x[0];
      x[0] = Scalar(1);
      auto v = A.block(j, j, len, 1);
      auto B = A.block(j, j + 1, len, rest);
      w.resize(1, rest);
      gemm<Op::T, Op::N>(Update::Assign, w, v, B);
      gemm(Update::Sub, B, v, w, tau(j));
      x[0] = saved;
    }
    // Trailing columns: C <- (I - V T V^T)^T C = C - V (T^T (V^T C)).
    const Index tc = cols - pend;
    if (tc == 0) continue;
    householder_block(A, tau, k, nb, V, T);
    auto C = A.block(k, pend, rows - k, tc);
    W.resize(nb, tc);
    gemm<Op::T, Op::N>(Update::Assign, W, V, C);
    const Matrix<Scalar> TW = matmul<Op::T, Op::N>(T, W);
    gemm(Update::Sub, C, V, TW);
  }
}

/// dst <- Q dst for the Q = H_0 ... H_{k-1} of `householder_qr`'s output (qr, tau), dst with
/// qr.rows() rows: panels from the last to the first, each dst(k :, :) -= V (T (V^T dst(k :, :))).
/// `identity`: dst holds the first columns of I, so a panel at k leaves its columns < k as they
/// are (zero from row k on: V^T of them is zero) and skips them.
template <typename Scalar>
void householder_apply_q(const Matrix<Scalar>& qr, const Vector<Scalar>& tau, Matrix<Scalar>& dst,
                         bool identity = false) {
  const Index size = tau.size(), rows = qr.rows(), cols = dst.cols();
  if (size == 0 || cols == 0) return;
  Matrix<Scalar> V, T, W;
  for (Index k = ((size - 1) / kQrPanel) * kQrPanel; k >= 0; k -= kQrPanel) {
    const Index nb = std::min(kQrPanel, size - k);
    householder_block(qr, tau, k, nb, V, T);
    const Index c0 = identity ? std::min(k, cols) : 0;
    auto D = dst.block(k, c0, rows - k, cols - c0);
    if (D.cols() == 0) continue;
    W.resize(nb, D.cols());
    gemm<Op::T, Op::N>(Update::Assign, W, V, D);
    const Matrix<Scalar> TW = matmul(T, W);
    gemm(Update::Sub, D, V, TW);
  }
}

/// The first `cols` columns of Q (qr.rows() x cols, orthonormal): Q applied to those of I.
template <typename Scalar>
Matrix<Scalar> householder_thin_q(const Matrix<Scalar>& qr, const Vector<Scalar>& tau, Index cols) {
  Matrix<Scalar> Q = Matrix<Scalar>::Identity(qr.rows(), cols);
  householder_apply_q(qr, tau, Q, true);
  return Q;
}

}  // namespace detail
}  // namespace effattn
