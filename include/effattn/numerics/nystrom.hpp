/// \file nystrom.hpp
/// \brief Nystrom weights W = K(S, S)^{-1} K(S, :) for a landmark set S: from an RPCholesky
/// factor by back-substitution, or through a Cholesky factorisation of K(S, S) for any landmark
/// set; applied to a matrix without forming W; and the overflow-free (log-scaled) forms for the
/// exponential dot-product kernel that WildCat uses.
///
/// For a PSD kernel matrix K (m x m) and r landmarks S, the Nystrom weights
/// \f[ W = K(S, S)^{-1} K(S, :) \quad (r \times m) \f]
/// give the Nystrom approximation K ~ K(:, S) W; column l of W holds the coefficients of the
/// RKHS projection of k(., x_l) onto span{k(., x_s) : s in S}, i.e. the least-squares optimal
/// reweighting of the landmarks. **Interpolation:** W(:, S) = I, so the approximation is exact on
/// the landmark columns. Weights are often negative and can be large; nothing here clamps them.
///
/// **One implementation.** Every path computes W as the back-substitution W = A^{-1} F with an
/// upper-triangular r x r matrix A and an r x m matrix F such that K(S, S) = A^T A and
/// K(S, :) = A^T F; then W = (A^T A)^{-1} A^T F = A^{-1} F, and no conditioning is squared (unlike
/// the inverse-update form of the WildCat paper's Alg. 1). The paths differ only in where A and F
/// come from:
/// - `nystrom_weights(rpc)`: F is the RPCholesky factor (k x m) and A = F(:, S) (in pivot order
///   row i of F vanishes at the earlier pivots, and the factorisation stores those zeros
///   exactly). O(k^2 m). W(:, S) = A^{-1} A = I holds to round-off (measured <= 2e-16).
/// - `nystrom_apply(rpc, B)` = W B, formed as A^{-1} (F B): O(k m c + k^2 c) for B m x c instead
///   of O(k^2 m) for W itself.
/// - `nystrom_weights(kernel, landmarks)`: any landmark set, through the Kernel concept of
///   `RpCholesky` (rows only): the Cholesky factor L of K(S, S) gives A = L^T and
///   F = L^{-1} K(S, :), O(r m d + r^2 m + r^3). Only if K(S, S) is not numerically positive
///   definite, a jitter delta I is added, with delta = eps * max_s K_ss * 10^j for j = 0, 1, ...
///   while delta <= sqrt(eps) * max_s K_ss. The jitter used is reported (it perturbs the
///   interpolation property by O(delta)); `info` is NumericalIssue if no jitter in that range
///   suffices.
///
/// For `ExpDotKernel` (H(x, y) = exp(s <x, y>) factorised through the Gaussian-coordinate kernel G
/// = D^{-1} H D^{-1}, D = diag(e^{hs}), hs = `half_sq_norms()`) these are the weights W_G of G; the
/// weights of H are W_H(i, l) = W_G(i, l) e^{hs_l - hs_{s_i}}. Both factors overflow for large
/// logits, so `exp_dot_log_scaled_weights` and `exp_dot_log_scaled_product` return them with a
/// per-landmark log-scale instead (see `LogScaledWeights`).
#pragma once

#include <Eigen/Cholesky>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/checks.hpp"
#include "../core/errors.hpp"
#include "../core/gemm.hpp"
#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "rp_cholesky.hpp"

namespace effattn {

/// Nystrom weights and how they were obtained.
template <typename Scalar>
struct NystromResult {
  RowMajorMatrix<Scalar> weights;  ///< W, r x m, W = K(S, S)^{-1} K(S, :); W(:, S) = I
  std::vector<Index> landmarks;    ///< S (row i of W belongs to landmarks[i])
  double jitter = 0;               ///< delta added to K(S, S)'s diagonal (plain path; 0 = none)
  Info info = Info::NotComputed;   ///< Success, or NumericalIssue (non-finite or no factorisation)
};

/// Overflow-free form of the exp-dot Nystrom weights: W_H(i, l) = weights(i, l) *
/// exp(log_scale(i)) with |weights| <= |W_G|. A consumer adds log_scale(i) to the logits of
/// landmark i instead of forming exp(hs) (e.g. WildCat's weighted attention).
template <typename Scalar>
struct LogScaledWeights {
  RowMajorMatrix<Scalar> weights;  ///< W_G(i, l) exp(hs_l - c), r x m, c = max_l hs_l
  Vector<Scalar> log_scale;        ///< c - hs_{s_i} (>= 0), r entries
};

/// The log-scaled exp-dot Nystrom weights applied to [B | 1] (see `exp_dot_log_scaled_product`).
template <typename Scalar>
struct LogScaledProduct {
  /// r x (c + 1): the first c columns are Wt B, the last is Wt 1, where Wt = `weights` of
  /// `LogScaledWeights` (so W_H B = diag(exp(log_scale)) Wt B).
  Matrix<Scalar> product;
  Vector<Scalar> log_scale;       ///< c - hs_{s_i} (>= 0), r entries (as in LogScaledWeights)
  Info info = Info::NotComputed;  ///< Success, or NumericalIssue (a non-finite entry)
};

namespace detail {

/// T in a non-deduced context (std::type_identity_t of C++20): lets an Eigen expression bind to a
/// `ConstRef<Scalar>` parameter whose Scalar is deduced from another argument.
template <typename T>
struct non_deduced {
  using type = T;
};
template <typename T>
using non_deduced_t = typename non_deduced<T>::type;

/// A = F(:, S) (k x k, upper triangular in pivot order) of an RPCholesky result.
/// \throws effattn::invalid_argument if the factor is not k x m with k = pivots.size() or a pivot
///         is out of range (i.e. `rpc` is not an RpCholesky result).
/// Gathered row by row in increasing column order (`gather_columns`). \tparam Out the scalar of A.
template <typename Scalar, typename Out = Scalar>
RowMajorMatrix<Out> nystrom_pivot_block(const RpCholeskyResult<Scalar>& rpc, const char* who) {
  const Index k = rpc.rank(), m = rpc.factor.cols();
  EFFATTN_CHECK(rpc.factor.rows() == k, cat(who, ": the factor must have one row per pivot (", k,
                                            "); got ", shape(rpc.factor)));
  for (Index s : rpc.pivots)
    EFFATTN_CHECK(s >= 0 && s < m, cat(who, ": pivot ", s, " out of range [0, ", m, ")"));
  RowMajorMatrix<Out> A;
  gather_columns(rpc.factor, k, rpc.pivots, A);
  return A;
}

/// X <- A^{-1} X for the upper-triangular A (any Eigen expression, e.g. a transposed lower
/// factor): the back-substitution W = A^{-1} F every Nystrom path ends with.
template <typename TriangularFactor, typename Rhs>
void nystrom_back_substitute(const TriangularFactor& A, Rhs& X) {
  if (A.rows() > 0) A.template triangularView<Eigen::Upper>().solveInPlace(X);
}

/// X = F B (k x c) by chunks of 32 rows of F inside one parallel region: each chunk is a serial
/// GEMM whose blocking does not depend on the thread count (a threaded Eigen GEMM picks its
/// k-blocking from the thread count, which changes the summation order and hence the bits). Both
/// callers pass a column-major matrix, which B binds without a copy.
template <typename Scalar>
void factor_times(const RowMajorMatrix<Scalar>& F, const ConstRef<Scalar>& B, Matrix<Scalar>& X) {
  const Index k = F.rows();
  constexpr Index kRows = 32;
  X.resize(k, B.cols());
  parallel_for((k + kRows - 1) / kRows, [] { return 0; },
               [&](Index t, int&) {
                 const Index i0 = t * kRows, rows = std::min(kRows, k - i0);
                 // F's rows transposed: a column-major view, multiplied as its transpose.
                 gemm<Op::T>(Update::Assign, X.middleRows(i0, rows),
                             F.middleRows(i0, rows).transpose(), B);
               });
}

/// log_scale(i) = c - hs(S_i) with c = max hs (the exp-dot log-scales).
/// \throws effattn::invalid_argument on a landmark out of range.
template <typename Scalar>
Vector<Scalar> exp_dot_log_scales(const Vector<Scalar>& hs, Scalar c,
                                  const std::vector<Index>& landmarks, const char* who) {
  const auto r = static_cast<Index>(landmarks.size());
  Vector<Scalar> out(r);
  for (Index i = 0; i < r; ++i) {
    const Index s = landmarks[static_cast<std::size_t>(i)];
    EFFATTN_CHECK(s >= 0 && s < hs.size(),
                  cat(who, ": landmark ", s, " out of range [0, ", hs.size(), ")"));
    out(i) = c - hs(s);
  }
  return out;
}

/// W B = A^{-1} (F B) (see `nystrom_apply`); B is any dense matrix type with m rows. The k x c
/// back-substitution runs in double whatever Scalar (O(k^2 c), small next to the O(k m c) GEMM):
/// A is as ill-conditioned as the pivot residuals are small, and a float solve would add its own
/// cond(A) eps_f on top of the rounding of F B.
template <typename Scalar, typename RhsB>
Matrix<Scalar> nystrom_apply_to(const RpCholeskyResult<Scalar>& rpc, const RhsB& B,
                                const char* who) {
  EFFATTN_CHECK(B.rows() == rpc.factor.cols(),
                cat(who, ": B must have m = ", rpc.factor.cols(), " rows; got ", shape(B)));
  const RowMajorMatrix<double> A = nystrom_pivot_block<Scalar, double>(rpc, who);
  Matrix<Scalar> X;
  factor_times<Scalar>(rpc.factor, B, X);
  if constexpr (std::is_same_v<Scalar, double>) {
    nystrom_back_substitute(A, X);
  } else {
    Matrix<double> Xd = X.template cast<double>();
    nystrom_back_substitute(A, Xd);
    X = Xd.template cast<Scalar>();
  }
  return X;
}

}  // namespace detail

/// \brief Nystrom weights W = A^{-1} F from an RPCholesky result (A = F(:, pivots), upper
/// triangular). O(k^2 m) time, k x m memory.
///
/// Works for every pivot rule and for a run that stopped early (k < rank): A's diagonal is
/// sqrt(res(s_i)) > sqrt(tol) > 0, so A is invertible.
/// \throws effattn::invalid_argument if the factor is not k x m with k = pivots.size() or a pivot
///         is out of range (i.e. `rpc` is not an RpCholesky result).
template <typename Scalar>
[[nodiscard]] NystromResult<Scalar> nystrom_weights(const RpCholeskyResult<Scalar>& rpc) {
  const RowMajorMatrix<Scalar> A = detail::nystrom_pivot_block(rpc, "nystrom_weights");
  NystromResult<Scalar> out;
  out.landmarks = rpc.pivots;
  out.weights = rpc.factor;
  detail::nystrom_back_substitute(A, out.weights);
  const bool ok = (A.diagonal().array() > Scalar(0)).all() && detail::all_finite(out.weights);
  out.info = ok ? Info::Success : Info::NumericalIssue;
  return out;
}

/// \brief W B for the Nystrom weights W of an RPCholesky result, without forming W:
/// A^{-1} (F B), one (k x m)(m x c) GEMM and a k x c back-substitution (in double for a float
/// factor), O(k m c + k^2 c) instead of O(k^2 m). The GEMM runs by row chunks, so the result is
/// the same for any thread count.
/// \throws effattn::invalid_argument if `rpc` is not an RpCholesky result or B has not m rows.
template <typename Scalar>
[[nodiscard]] Matrix<Scalar> nystrom_apply(const RpCholeskyResult<Scalar>& rpc,
                                           const ConstRef<detail::non_deduced_t<Scalar>>& B) {
  return detail::nystrom_apply_to(rpc, B, "nystrom_apply");
}

/// \brief Nystrom weights W = K(S, S)^{-1} K(S, :) for an arbitrary landmark set S through the
/// Cholesky factor L of K(S, S) (A = L^T, F = L^{-1} K(S, :), then the shared back-substitution;
/// jitter only if K(S, S) is not numerically positive definite, see the file docs).
///
/// \param kernel a model of the RPCholesky Kernel concept (only `size` and `rows` are used).
/// \param landmarks r >= 1 distinct indices in [0, m), in any order (row i of W is landmark i).
/// Cost: one r x m block of kernel rows, an r x r Cholesky and two r x m triangular solves:
/// O(r m d + r^2 m + r^3).
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
  llt.matrixL().solveInPlace(out.weights);                                    // F = L^{-1} K(S, :)
  detail::nystrom_back_substitute(llt.matrixLLT().transpose(), out.weights);  // A = L^T
  out.info = detail::all_finite(out.weights) ? Info::Success : Info::NumericalIssue;
  return out;
}

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
  out.log_scale = detail::exp_dot_log_scales(hs, c, nys.landmarks, "exp_dot_log_scaled_weights");
  return out;
}

namespace detail {
/// `exp_dot_log_scaled_product` for any dense expression B (e.g. a cast of float values: [diag(e)
/// B | e] is then formed in one pass, without a double copy of B first).
template <typename InScalar, typename Scalar, typename DB>
LogScaledProduct<Scalar> exp_dot_log_scaled_product_of(const ExpDotKernel<InScalar, Scalar>& kernel,
                                                       const RpCholeskyResult<Scalar>& rpc,
                                                       const Eigen::MatrixBase<DB>& B,
                                                       const char* who) {
  const Index m = kernel.size(), c = B.cols();
  EFFATTN_CHECK(rpc.factor.cols() == m && B.rows() == m,
                cat(who, ": need a factor and B with m = ", m, " columns / rows; got factor ",
                    shape(rpc.factor), ", B ", shape(B)));
  const Vector<Scalar>& hs = kernel.half_sq_norms();
  const Scalar top = hs.maxCoeff();
  Matrix<Scalar> Be(m, c + 1);  // [diag(e) B | e]
  advise_huge_pages(Be);
  Be.col(c) = (hs.array() - top).exp().matrix();
  // Column by column in parallel (an O(m c) pass, serial before).
  parallel_for_if(m > 4096, c, [&](Index j) { Be.col(j) = Be.col(c).cwiseProduct(B.col(j)); });
  LogScaledProduct<Scalar> out;
  out.product = nystrom_apply_to(rpc, Be, who);
  out.log_scale = exp_dot_log_scales(hs, top, rpc.pivots, who);
  out.info = all_finite(out.product) ? Info::Success : Info::NumericalIssue;
  return out;
}
}  // namespace detail

/// \brief The log-scaled exp-dot Nystrom weights of an RPCholesky run on `kernel` applied to
/// [B | 1], without forming them: `product` = Wt [B | 1] with Wt as in `LogScaledWeights`, so
/// that W_H B = diag(e^{log_scale}) Wt B and W_H 1 = diag(e^{log_scale}) Wt 1.
///
/// Formed as A^{-1} (F [diag(e) B | e]) with e_l = e^{hs_l - c} in (0, 1]: `nystrom_apply` on the
/// rescaled values, one (k x m)(m x (c + 1)) GEMM and a k x (c + 1) back-substitution, O(k m c +
/// k^2 c), nothing overflows. This is WildCat's compression of a bin: keys -> pivots, values B ->
/// W B, and the softmax weights W 1.
/// \throws effattn::invalid_argument if `rpc` does not come from `kernel` (factor shape, pivot
///         range) or B has not m rows.
template <typename InScalar, typename Scalar>
[[nodiscard]] LogScaledProduct<Scalar> exp_dot_log_scaled_product(
    const ExpDotKernel<InScalar, Scalar>& kernel, const RpCholeskyResult<Scalar>& rpc,
    const ConstRef<detail::non_deduced_t<Scalar>>& B) {
  return detail::exp_dot_log_scaled_product_of(kernel, rpc, B, "exp_dot_log_scaled_product");
}

}  // namespace effattn
