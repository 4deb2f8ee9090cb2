/// \file softmax.hpp
/// \brief Numerically stable softmax and log-sum-exp (max subtraction, double accumulation): the
/// row-wise toolkit of the library, and the small building blocks it shares with the streaming
/// kernel of `online_softmax.hpp`.
///
/// For a row x of logits, with M = max_j x_j,
/// \f[ \mathrm{lse}(x) = M + \log \sum_j e^{x_j - M}, \qquad
///     \mathrm{softmax}(x)_j = e^{x_j - M} / \sum_{j'} e^{x_{j'} - M}. \f]
/// Subtracting M keeps every exponential in (0, 1] (no overflow, and the largest term is 1, so
/// the sum cannot underflow); the sums are accumulated in double even when the scalar is float.
///
/// Conventions: logits equal to -inf are masked entries (probability exactly 0). A row whose
/// entries are all -inf has no defined softmax: these helpers leave it as all zeros with
/// log-sum-exp -inf, and callers that can meet such rows must decide what that means (exact
/// attention rejects them up front).
///
/// Masked entries are zeroed explicitly: Eigen's vectorised exp clamps its argument (to about
/// -88.7 in float, -709.8 in double), so exp(-inf) evaluates to ~1e-38 / ~1e-308, not 0.
#pragma once

#include <cmath>
#include <limits>

#include "types.hpp"

namespace effattn {

namespace detail {

/// exp(x - shift) with exact zeros where x = -inf (see the file documentation), as a lazy
/// expression; `shift` is a scalar or an array of x's shape. O(size). Eigen 3.4 evaluates
/// select() coefficient by coefficient, so this form calls the scalar (libm) exp: where speed
/// matters, take it only for data holding a -inf (`has_neg_inf`, `for_each_exp_column`).
template <typename Derived, typename Shift>
auto masked_exp(const Eigen::ArrayBase<Derived>& x, const Shift& shift) {
  using Scalar = typename Derived::Scalar;
  return (x == -std::numeric_limits<Scalar>::infinity()).select(Scalar(0), (x - shift).exp());
}

/// Whether `x` holds -inf. The masked form above is exact but not vectorised (scalar libm exp:
/// 31% of KEP-SVGP's time in a profile); columns without -inf take the vectorised exp() instead.
/// One vectorised min reduction, O(size).
template <typename Derived>
bool has_neg_inf(const Eigen::DenseBase<Derived>& x) {
  return x.size() > 0 && x.minCoeff() == -std::numeric_limits<typename Derived::Scalar>::infinity();
}

/// The shift of the row functions below: the row maximum where it is finite, else 0. An all
/// -inf row would otherwise compute exp(-inf - (-inf)) = NaN; a row whose maximum is +inf
/// (overflowed logits) gets log-sum-exp +inf instead of NaN.
template <typename Derived>
auto finite_or_zero(const Eigen::ArrayBase<Derived>& mx) {
  using Scalar = typename Derived::Scalar;
  return mx.isFinite().select(mx, Scalar(0));
}

/// The shift of the streaming kernel (`online_softmax_block`): the running maximum, or 0 where it
/// is still -inf (the row has seen no visible key yet), so that exp(x - shift) never evaluates
/// -inf - (-inf). Unlike `finite_or_zero`, a +inf maximum stays the shift: such a row's output is
/// non-finite with either shift (reported as `Info::NumericalIssue`), but its bits differ, so the
/// two shifts are kept apart to keep every method's output unchanged.
template <typename Derived>
auto neg_inf_to_zero(const Eigen::ArrayBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  return (m == -std::numeric_limits<Scalar>::infinity()).select(Scalar(0), m);
}

/// mx = the row maxima of S (at least one column), computed column by column so it vectorises;
/// `mx` is a preallocated column array (or block of one) of S.rows() entries. O(rows cols).
template <typename DerivedS, typename DerivedM>
void row_max_into(const Eigen::MatrixBase<DerivedS>& S, Eigen::ArrayBase<DerivedM>& mx) {
  mx = S.col(0).array();
  for (Index c = 1; c < S.cols(); ++c) mx = mx.max(S.col(c).array());
}

/// Calls f(j, E_j) for every column j of S, with E_j the array expression exp(S_j - shift) (shift:
/// one value per row) that is exactly 0 where S_j is -inf: the masked, scalar form for columns
/// holding a -inf and the vectorised exp for the others. f decides where E_j goes (summed,
/// stored back in S_j, ...), so both row functions evaluate the same expressions.
template <typename Derived, typename Shift, typename F>
void for_each_exp_column(const Eigen::MatrixBase<Derived>& S, const Shift& shift, F&& f) {
  for (Index j = 0; j < S.cols(); ++j) {
    if (has_neg_inf(S.col(j)))
      f(j, masked_exp(S.col(j).array(), shift.array()));
    else
      f(j, (S.col(j).array() - shift.array()).exp());
  }
}

/// Log-sum-exp of a row from its shift and sum = sum_j exp(x_j - shift) (in double):
/// shift + log(sum), evaluated in double. sum = 0 (all masked) gives -inf.
template <typename Scalar>
double lse_from_sum(Scalar shift, double sum) {
  return static_cast<double>(shift) + std::log(sum);
}

}  // namespace detail

/// log(sum_i exp(x_i)) of a vector or array, computed as max + log(sum exp(x - max)) with the sum
/// in double. Returns -inf for an empty input or when every entry is -inf; +inf if any is +inf;
/// NaN if any is NaN. O(size), one copy of x in double.
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

/// Row-wise maximum of a (column-major) matrix, computed column by column so it vectorises:
/// n values, -inf for a matrix without columns. O(n m).
template <typename Derived>
Vector<typename Derived::Scalar> row_max(const Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  Vector<Scalar> mx = Vector<Scalar>::Constant(S.rows(), -std::numeric_limits<Scalar>::infinity());
  for (Index j = 0; j < S.cols(); ++j) mx = mx.cwiseMax(S.col(j));
  return mx;
}

/// Log-sum-exp of every row of `S` (n x m): lse_i = M_i + log sum_j exp(S_ij - M_i) with M_i the
/// row maximum (0 if not finite) and the sum in double; -inf for an all -inf row. O(n m) time,
/// O(n) extra memory; `S` is not modified.
template <typename Derived>
Vector<typename Derived::Scalar> row_logsumexp(const Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  const Vector<Scalar> shift = detail::finite_or_zero(row_max(S).array());
  Eigen::Array<double, Eigen::Dynamic, 1> sum =
      Eigen::Array<double, Eigen::Dynamic, 1>::Zero(S.rows());
  detail::for_each_exp_column(S, shift,
                              [&](Index, const auto& e) { sum += e.template cast<double>(); });
  Vector<Scalar> lse(S.rows());
  for (Index i = 0; i < S.rows(); ++i)
    lse(i) = static_cast<Scalar>(detail::lse_from_sum(shift(i), sum(i)));
  return lse;
}

/// Replaces every row of `S` (n x m) by its softmax, in place: P_ij = exp(S_ij - M_i) / sum_j'
/// exp(S_ij' - M_i), masked (-inf) entries exactly 0. Returns the row log-sum-exp values, as
/// `row_logsumexp` up to round-off. Rows that are entirely -inf become all zeros (log-sum-exp
/// -inf). O(n m) time, O(n) extra memory; `S` may be a block of a larger matrix.
template <typename Derived>
Vector<typename Derived::Scalar> row_softmax_inplace(Eigen::MatrixBase<Derived>& S) {
  using Scalar = typename Derived::Scalar;
  const Index n = S.rows();
  const Vector<Scalar> shift = detail::finite_or_zero(row_max(S).array());
  Eigen::Array<double, Eigen::Dynamic, 1> sum = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
  detail::for_each_exp_column(S, shift, [&](Index j, const auto& e) {
    S.col(j).array() = e;
    sum += S.col(j).array().template cast<double>();
  });
  Vector<Scalar> lse(n);
  Eigen::Array<Scalar, Eigen::Dynamic, 1> inv(n);
  for (Index i = 0; i < n; ++i) {
    lse(i) = static_cast<Scalar>(detail::lse_from_sum(shift(i), sum(i)));
    inv(i) = sum(i) > 0 ? static_cast<Scalar>(1.0 / sum(i)) : Scalar(0);
  }
  for (Index j = 0; j < S.cols(); ++j) S.col(j).array() *= inv;
  return lse;
}

/// Row softmax of `S` as a new matrix (`row_softmax_inplace` on a copy: identical bits).
template <typename Derived>
Matrix<typename Derived::Scalar> row_softmax(const Eigen::MatrixBase<Derived>& S) {
  Matrix<typename Derived::Scalar> P = S;
  row_softmax_inplace(P);
  return P;
}

}  // namespace effattn
