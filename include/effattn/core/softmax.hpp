/// \file softmax.hpp
/// \brief Numerically stable softmax and log-sum-exp (max subtraction, double accumulation).
///
/// Conventions: logits equal to -inf are masked entries (probability exactly 0). A row whose
/// entries are all -inf has no defined softmax: these helpers leave it as all zeros with
/// log-sum-exp -inf, and callers that can meet such rows must decide what that means (exact
/// attention rejects them up front). Sums are accumulated in double even when the scalar is float.
///
/// Masked entries are zeroed explicitly: Eigen's vectorised exp clamps its argument (to about
/// -88.7 in float, -709.8 in double), so exp(-inf) evaluates to ~1e-38 / ~1e-308, not 0.
#pragma once

#include <cmath>
#include <limits>

#include "types.hpp"

namespace effattn {

namespace detail {
/// exp(x - shift) with exact zeros where x = -inf (see the file documentation).
template <typename Derived, typename Shift>
auto masked_exp(const Eigen::ArrayBase<Derived>& x, const Shift& shift) {
  using Scalar = typename Derived::Scalar;
  return (x == -std::numeric_limits<Scalar>::infinity()).select(Scalar(0), (x - shift).exp());
}

/// Whether a column holds -inf. The masked form above is exact but not vectorised (Eigen 3.4's
/// select() evaluates coefficient by coefficient, so exp() falls back to scalar libm calls: 31%
/// of KEP-SVGP's time in a profile); columns without -inf take the vectorised exp() instead.
/// (Eigen's vectorised exp(-inf) is the smallest normal, not 0, hence the masked form at all.)
template <typename Derived>
bool has_neg_inf(const Eigen::DenseBase<Derived>& x) {
  return x.size() > 0 && x.minCoeff() == -std::numeric_limits<typename Derived::Scalar>::infinity();
}
}  // namespace detail

/// log(sum_i exp(x_i)) of a vector or array, computed as max + log(sum exp(x - max)) with the sum
/// in double. Returns -inf for an empty input or when every entry is -inf; +inf if any is +inf;
/// NaN if any is NaN.
template <typename Derived>
double logsumexp(const Eigen::DenseBase<Derived>& x) {
  constexpr double ninf = -std::numeric_limits<double>::infinity();
  if (x.size() == 0) return ninf;
  const auto xd = x.derived().template cast<double>().eval();
  const double mx = xd.maxCoeff();
  if (std::isnan(mx) || xd.hasNaN()) return std::numeric_limits<double>::quiet_NaN();
  if (mx == ninf || mx == -ninf) return mx;
  return mx + std::log(detail::masked_exp(xd.array(), mx).sum());
}

/// Row-wise maximum of a (column-major) matrix, computed column by column so it vectorises.
template <typename Derived>
Vector<typename Derived::Scalar> row_max(const Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  Vector<Scalar> mx = Vector<Scalar>::Constant(S.rows(), -std::numeric_limits<Scalar>::infinity());
  for (Index j = 0; j < S.cols(); ++j) mx = mx.cwiseMax(S.col(j));
  return mx;
}

/// Log-sum-exp of every row of `S` (n values), max-subtracted, accumulated in double.
template <typename Derived>
Vector<typename Derived::Scalar> row_logsumexp(const Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  const Vector<Scalar> mx = row_max(S);
  // Rows whose max is -inf (all masked) would produce exp(-inf - -inf) = NaN: shift by 0 there.
  const Vector<Scalar> shift = mx.array().isFinite().select(mx, Vector<Scalar>::Zero(S.rows()));
  Eigen::Array<double, Eigen::Dynamic, 1> sum =
      Eigen::Array<double, Eigen::Dynamic, 1>::Zero(S.rows());
  for (Index j = 0; j < S.cols(); ++j) {
    if (detail::has_neg_inf(S.col(j)))
      sum += detail::masked_exp(S.col(j).array(), shift.array()).template cast<double>();
    else
      sum += (S.col(j).array() - shift.array()).exp().template cast<double>();
  }
  Vector<Scalar> lse(S.rows());
  for (Index i = 0; i < S.rows(); ++i)
    lse(i) = static_cast<Scalar>(static_cast<double>(shift(i)) + std::log(sum(i)));
  return lse;
}

/// Replaces every row of `S` by its softmax, in place. Returns the row log-sum-exp values.
/// Rows that are entirely -inf become all zeros (their log-sum-exp is -inf).
template <typename Derived>
Vector<typename Derived::Scalar> row_softmax_inplace(Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  const Index n = S.rows();
  const Vector<Scalar> mx = row_max(S);
  const Vector<Scalar> shift = mx.array().isFinite().select(mx, Vector<Scalar>::Zero(n));
  Eigen::Array<double, Eigen::Dynamic, 1> sum = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
  for (Index j = 0; j < S.cols(); ++j) {
    if (detail::has_neg_inf(S.col(j)))
      S.col(j) = detail::masked_exp(S.col(j).array(), shift.array()).matrix();
    else
      S.col(j).array() = (S.col(j).array() - shift.array()).exp();
    sum += S.col(j).array().template cast<double>();
  }
  Vector<Scalar> lse(n);
  Eigen::Array<Scalar, Eigen::Dynamic, 1> inv(n);
  for (Index i = 0; i < n; ++i) {
    lse(i) = static_cast<Scalar>(static_cast<double>(shift(i)) + std::log(sum(i)));
    inv(i) = sum(i) > 0 ? static_cast<Scalar>(1.0 / sum(i)) : Scalar(0);
  }
  for (Index j = 0; j < S.cols(); ++j) S.col(j).array() *= inv;
  return lse;
}

/// Row softmax of `S` as a new matrix.
template <typename Derived>
Matrix<typename Derived::Scalar> row_softmax(const Eigen::MatrixBase<Derived>& S) {
  Matrix<typename Derived::Scalar> P = S;
  row_softmax_inplace(P);
  return P;
}

}  // namespace effattn
