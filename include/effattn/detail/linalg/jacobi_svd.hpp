/// \file jacobi_svd.hpp
/// \brief Private: thin SVD of a tall or wide matrix by Householder QR and one-sided (Hestenes)
/// Jacobi on the triangular factor, in double. KEP-SVGP's randomized and factorised engines
/// (detail/methods/kep_svgp_ksvd.hpp) take it for their small SVDs (n x (s + p) and p x p), and the
/// dense oracle for the whole kernel.
///
/// Why not Eigen's BDCSVD: instantiating `BDCSVD<MatrixXf>` (with the JacobiSVD and the two
/// column-pivoting QR preconditioners it pulls in) was the most expensive code of the library to
/// compile: about 25 s and 1 GB of g++ -O2 per scalar type, most of the 44 s a user TU paid for
/// `KepSvgpAttention<float>` (measured). This file costs about 1 s:
/// Householder QR (already used by the range finder) and a loop of plane rotations.
///
/// Accuracy: the QR runs in Scalar (backward stable, as BDCSVD is); the Jacobi sweeps run in double
/// on the k x k factor and stop when every pair of columns is orthogonal to
/// sqrt(k) * eps(double) relative to their norms, so they add nothing visible at Scalar = float and
/// little at double (one-sided Jacobi is the more accurate algorithm for the small singular
/// values, Demmel and Veselic 1992). Cost: 2 rows k^2 (QR) + about 3.5 k^3 per sweep, 6-10 sweeps;
/// fine for the sketch widths of KEP-SVGP (k = s + p = 20 by default; 0.5 s at k = 512). The
/// dense oracle (policy::DenseSvd) takes it too, on the whole n x m kernel (9 s at n = m = 1024):
/// Eigen 3.4's BDCSVD is faster but not reliable on near-degenerate kernels
/// (detail/methods/kep_svgp_ksvd.hpp, `kep_thin_svd_dense`).
#pragma once

#include <Eigen/Jacobi>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "../../core/types.hpp"
#include "householder.hpp"

namespace effattn {
namespace detail {

/// One-sided Jacobi on the columns of A (k x k, double): on return A = U diag(sigma) (columns
/// pairwise orthogonal) and V (k x k, orthogonal) such that A_in V = A_out. Cyclic row order,
/// deterministic. Column norms are updated with each rotation and recomputed every sweep.
/// Returns the number of sweeps (at most max_sweeps; 60 is far beyond the 6-10 that convergence
/// takes: quadratic once the columns are nearly orthogonal).
template <typename = void>  // instantiated where used (compile cost)
int jacobi_orthogonalize_columns(Eigen::MatrixXd& A, Eigen::MatrixXd& V, int max_sweeps = 60) {
  const Index k = A.cols();
  V.setIdentity(k, k);
  if (k < 2) return 0;
  const double tol = std::sqrt(static_cast<double>(k)) * std::numeric_limits<double>::epsilon();
  Eigen::VectorXd nrm2(k);
  int sweep = 0;
  while (sweep < max_sweeps) {
    ++sweep;
    for (Index j = 0; j < k; ++j) nrm2(j) = A.col(j).squaredNorm();
    bool rotated = false;
    for (Index p = 0; p + 1 < k; ++p) {
      for (Index q = p + 1; q < k; ++q) {
        const double app = nrm2(p), aqq = nrm2(q);
        const double apq = A.col(p).dot(A.col(q));
        // Skips zero columns (0 > 0 is false) and NaN (every comparison false): no endless loop.
        if (!(std::abs(apq) > tol * std::sqrt(app * aqq))) continue;
        rotated = true;
        // Zero the (p, q) entry of the 2 x 2 Gram [[app, apq], [apq, aqq]]: t is the smaller root
        // of t^2 + 2 zeta t - 1 = 0 (|t| <= 1, the rotation angle at most pi / 4).
        const double zeta = (aqq - app) / (2.0 * apq);
        const double t =
            (zeta >= 0.0 ? 1.0 : -1.0) / (std::abs(zeta) + std::sqrt(1.0 + zeta * zeta));
        const double c = 1.0 / std::sqrt(1.0 + t * t), s = c * t;
        // [a_p a_q] <- [c a_p - s a_q, s a_p + c a_q] (Eigen's convention for applyOnTheRight).
        const Eigen::JacobiRotation<double> rot(c, s);
        A.applyOnTheRight(p, q, rot);
        V.applyOnTheRight(p, q, rot);
        nrm2(p) = app - t * apq;
        nrm2(q) = aqq + t * apq;
      }
    }
    if (!rotated) break;
  }
  return sweep;
}

/// Thin SVD X = U diag(s) W^T of a rows x cols matrix (k = min(rows, cols); U rows x k, s
/// descending, W cols x k) by Householder QR of X (or X^T when wide) and one-sided Jacobi on the
/// k x k triangular factor. A zero singular value gets a zero column in U (or W when wide):
/// callers use only the columns of nonzero singular values (or multiply them by s).
template <typename Scalar>
void thin_svd_qr_jacobi(const Matrix<Scalar>& X, Matrix<Scalar>& U, Vector<Scalar>& s,
                        Matrix<Scalar>& W) {
  const bool wide = X.cols() > X.rows();
  const Index rows = wide ? X.cols() : X.rows(), k = wide ? X.rows() : X.cols();
  if (k == 0) {
    U.resize(X.rows(), 0);
    W.resize(X.cols(), 0);
    s.resize(0);
    return;
  }
  // T = Q R, T = X (tall) or X^T (wide); R (k x k) upper triangular.
  Matrix<Scalar> qr;
  if (wide)
    qr = X.transpose();
  else
    qr = X;
  Vector<Scalar> tau;
  householder_qr(qr, tau);
  Eigen::MatrixXd A = qr.topRows(k).template cast<double>();
  A.template triangularView<Eigen::StrictlyLower>().setZero();
  Eigen::MatrixXd V;
  jacobi_orthogonalize_columns(A, V);  // R V = A = U_R diag(sigma), so R = U_R diag(sigma) V^T
  Eigen::VectorXd sigma(k);
  for (Index j = 0; j < k; ++j) sigma(j) = A.col(j).norm();
  std::vector<Index> order(static_cast<std::size_t>(k));
  std::iota(order.begin(), order.end(), Index(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](Index a, Index b) { return sigma(a) > sigma(b); });
  // T = (Q U_R) diag(sigma) V^T: left factor Q U_R (rows x k), right factor V (k x k).
  Matrix<Scalar> left = Matrix<Scalar>::Zero(rows, k), right(k, k);
  s.resize(k);
  for (Index j = 0; j < k; ++j) {
    const Index o = order[static_cast<std::size_t>(j)];
    s(j) = static_cast<Scalar>(sigma(o));
    if (sigma(o) > 0.0) left.col(j).head(k) = (A.col(o) / sigma(o)).template cast<Scalar>();
    right.col(j) = V.col(o).template cast<Scalar>();
  }
  householder_apply_q(qr, tau, left);
  if (wide) {  // X = T^T = V diag(sigma) (Q U_R)^T
    U = std::move(right);
    W = std::move(left);
  } else {
    U = std::move(left);
    W = std::move(right);
  }
}

}  // namespace detail
}  // namespace effattn
