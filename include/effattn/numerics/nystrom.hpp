/// \file nystrom.hpp
/// \brief Nystrom weights W = K(S, S)^{-1} K(S, :) for a landmark set S: from an RPCholesky
/// factor by back-substitution, or by a plain Cholesky solve for any landmark set.
///
/// For a PSD kernel matrix K (m x m) and r landmarks S, the Nystrom weights
/// \f[ W = K(S, S)^{-1} K(S, :) \quad (r \times m) \f]
/// give the Nystrom approximation K ~ K(:, S) W; column l of W holds the coefficients of the
/// RKHS projection of k(., x_l) onto span{k(., x_s) : s in S} (the optimal, least-squares
/// reweighting of WildCat spec 2.2). **Interpolation:** W(:, S) = I, so the approximation is
/// exact on the landmark columns. Weights are often negative and can be large; nothing here
/// clamps them.
///
/// - `nystrom_weights(rpc)`: from an RPCholesky result with pivots S and factor F (k x m). In
///   pivot order A = F(:, S) is upper triangular (row i of F vanishes at the earlier pivots; the
///   factorisation stores those zeros exactly) and K(S, :) = A^T F, K(S, S) = A^T A, so
///   W = (A^T A)^{-1} A^T F = A^{-1} F: one back-substitution, O(k^2 m), no conditioning is
///   squared (unlike the inverse-update form of WildCat Alg. 1). W(:, S) = A^{-1} A = I holds
///   to round-off (measured <= 2e-16 in the tests).
/// - `nystrom_weights(kernel, landmarks)`: any landmark set, through the Kernel concept of
///   `RpCholesky` (rows only): an LLT of K(S, S) and a solve, O(r m d + r^2 m + r^3). Only if
///   K(S, S) is not numerically positive definite (LLT fails), a jitter delta I is added, with
///   delta = eps * max_s K_ss * 10^j for j = 0, 1, ... while delta <= sqrt(eps) * max_s K_ss.
///   The jitter used is reported (it perturbs the interpolation property by O(delta)); `info` is
///   NumericalIssue if no jitter in that range suffices.
///
/// For `ExpDotKernel` both paths give the weights of the Gaussian-coordinate kernel G; the
/// weights of H(x, y) = exp(s <x, y>) are W_H(i, l) = W_G(i, l) exp((sq_l - sq_{s_i}) / 2), see
/// `ExpDotKernel::original_weights` (WildCat spec 2.4).
#pragma once

#include <Eigen/Cholesky>
#include <algorithm>
#include <cmath>
#include <vector>

#include "../core/errors.hpp"
#include "rp_cholesky.hpp"
#include "../core/types.hpp"

namespace effattn {

/// Nystrom weights and how they were obtained.
template <typename Scalar>
struct NystromResult {
  RowMajorMatrix<Scalar> weights;  ///< W, r x m, W = K(S, S)^{-1} K(S, :); W(:, S) = I
  std::vector<Index> landmarks;    ///< S (row i of W belongs to landmarks[i])
  double jitter = 0;               ///< delta added to K(S, S)'s diagonal (plain path; 0 = none)
  Info info = Info::NotComputed;   ///< Success, or NumericalIssue (non-finite or no factorisation)
};

/// \brief Nystrom weights W = A^{-1} F from an RPCholesky result (A = F(:, pivots), upper
/// triangular). O(k^2 m) time, k x m memory.
///
/// Works for every pivot rule and for a run that stopped early (k < rank): A's diagonal is
/// sqrt(res(s_i)) > sqrt(tol) > 0, so A is invertible.
/// \throws effattn::invalid_argument if the factor is not k x m with k = pivots.size() or a pivot
///         is out of range (i.e. `rpc` is not an RpCholesky result).
template <typename Scalar>
[[nodiscard]] NystromResult<Scalar> nystrom_weights(const RpCholeskyResult<Scalar>& rpc) {
  const Index k = rpc.rank(), m = rpc.factor.cols();
  EFFATTN_CHECK(rpc.factor.rows() == k,
                detail::cat("nystrom_weights: the factor must have one row per pivot (", k,
                            "); got ", detail::shape(rpc.factor)));
  Matrix<Scalar> A(k, k);
  for (Index j = 0; j < k; ++j) {
    const Index s = rpc.pivots[static_cast<std::size_t>(j)];
    EFFATTN_CHECK(s >= 0 && s < m,
                  detail::cat("nystrom_weights: pivot ", s, " out of range [0, ", m, ")"));
    A.col(j) = rpc.factor.col(s);
  }
  NystromResult<Scalar> out;
  out.landmarks = rpc.pivots;
  out.weights = rpc.factor;
  if (k > 0) A.template triangularView<Eigen::Upper>().solveInPlace(out.weights);
  const bool ok =
      (k == 0 || (A.diagonal().array() > Scalar(0)).all()) && detail::all_finite(out.weights);
  out.info = ok ? Info::Success : Info::NumericalIssue;
  return out;
}

/// \brief Nystrom weights W = K(S, S)^{-1} K(S, :) for an arbitrary landmark set S by a Cholesky
/// solve (jitter only if K(S, S) is not numerically positive definite; see the file docs).
///
/// \param kernel a model of the RPCholesky Kernel concept (only `size` and `rows` are used).
/// \param landmarks r >= 1 distinct indices in [0, m), in any order (row i of W is landmark i).
/// Cost: one r x m block of kernel rows, an r x r LLT and an r x m solve: O(r m d + r^2 m + r^3).
/// \throws effattn::invalid_argument if `landmarks` is empty, has an index out of range or a
///         duplicated index (K(S, S) would be singular).
template <typename Kernel>
[[nodiscard]] NystromResult<detail::kernel_scalar_t<Kernel>> nystrom_weights(
    const Kernel& kernel, const std::vector<Index>& landmarks) {
  detail::static_check_kernel<Kernel>();
  using S = detail::kernel_scalar_t<Kernel>;
  const auto m = static_cast<Index>(kernel.size());
  const auto r = static_cast<Index>(landmarks.size());
  EFFATTN_CHECK(r >= 1, "nystrom_weights: landmarks must not be empty");
  for (Index s : landmarks)
    EFFATTN_CHECK(s >= 0 && s < m,
                  detail::cat("nystrom_weights: landmark ", s, " out of range [0, ", m, ")"));
  std::vector<Index> sorted = landmarks;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  EFFATTN_CHECK(dup == sorted.end(),
                detail::cat("nystrom_weights: landmark ", dup == sorted.end() ? 0 : *dup,
                            " is repeated (landmarks must be distinct)"));

  NystromResult<S> out;
  out.landmarks = landmarks;
  out.weights.resize(r, m);
  kernel.rows(landmarks, out.weights);  // K(S, :)
  Matrix<S> Kss(r, r);
  for (Index j = 0; j < r; ++j)
    Kss.col(j) = out.weights.col(landmarks[static_cast<std::size_t>(j)]);
  const double eps = static_cast<double>(std::numeric_limits<S>::epsilon());
  const double top = std::max(static_cast<double>(Kss.diagonal().maxCoeff()), 0.0);
  Eigen::LLT<Matrix<S>> llt(Kss);
  double delta = eps * top;
  while (llt.info() != Eigen::Success && top > 0 && delta <= std::sqrt(eps) * top) {
    Matrix<S> shifted = Kss;
    shifted.diagonal().array() += static_cast<S>(delta);
    llt.compute(shifted);
    if (llt.info() == Eigen::Success) out.jitter = delta;
    delta *= 10;
  }
  if (llt.info() != Eigen::Success) {
    out.info = Info::NumericalIssue;
    return out;
  }
  llt.solveInPlace(out.weights);
  out.info = detail::all_finite(out.weights) ? Info::Success : Info::NumericalIssue;
  return out;
}

/// Overflow-free form of the exp-dot Nystrom weights: W_H(i, l) = weights(i, l) *
/// exp(log_scale(i)) with |weights| <= |W_G| (WildCat spec 2.8: carry a per-landmark log-scale
/// next to the weights instead of forming exp(sq / 2)).
template <typename Scalar>
struct LogScaledWeights {
  RowMajorMatrix<Scalar> weights;  ///< W_G(i, l) exp(sq_l / 2 - c), r x m, c = max_l sq_l / 2
  Vector<Scalar> log_scale;        ///< c - sq_{s_i} / 2 (>= 0), r entries
};

/// \brief Weights of H(x, y) = exp(s <x, y>) in log-scaled form from weights of the Gaussian-
/// coordinate kernel G (either `nystrom_weights` path applied to `kernel`).
///
/// With hs = sq / 2 = `kernel.half_sq_norms()` and c = max_l hs_l:
/// \f[ W_H(i, l) = W_G(i, l)\, e^{hs_l - hs_{s_i}}
///               = \underbrace{W_G(i, l)\, e^{hs_l - c}}_{\texttt{weights}(i, l)}\,
///                 e^{\,\overbrace{c - hs_{s_i}}^{\texttt{log\_scale}(i)}}. \f]
/// Every factor e^{hs_l - c} lies in (0, 1], so nothing overflows whatever the logit range; a
/// consumer adds log_scale(i) to the logits of landmark i (e.g. WildCat's weighted attention).
/// `kernel.original_weights(W_G, S)` is the direct (possibly overflowing) product. O(r m).
/// \throws effattn::invalid_argument if `nys` does not match the kernel (shape or landmark range).
template <typename InScalar, typename Scalar>
[[nodiscard]] LogScaledWeights<Scalar> exp_dot_log_scaled_weights(
    const ExpDotKernel<InScalar, Scalar>& kernel, const NystromResult<Scalar>& nys) {
  const Index r = nys.weights.rows(), m = kernel.size();
  EFFATTN_CHECK(r == static_cast<Index>(nys.landmarks.size()) && nys.weights.cols() == m,
                detail::cat("exp_dot_log_scaled_weights: weights must be |landmarks| x m = ",
                            nys.landmarks.size(), " x ", m, "; got ", detail::shape(nys.weights)));
  const Vector<Scalar>& hs = kernel.half_sq_norms();
  const Scalar c = hs.maxCoeff();
  LogScaledWeights<Scalar> out;
  out.weights = nys.weights * (hs.array() - c).exp().matrix().asDiagonal();
  out.log_scale.resize(r);
  for (Index i = 0; i < r; ++i) {
    const Index s = nys.landmarks[static_cast<std::size_t>(i)];
    EFFATTN_CHECK(s >= 0 && s < m, detail::cat("exp_dot_log_scaled_weights: landmark ", s,
                                               " out of range [0, ", m, ")"));
    out.log_scale(i) = c - hs(s);
  }
  return out;
}

}  // namespace effattn
