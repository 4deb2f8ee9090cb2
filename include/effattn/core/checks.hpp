/// \file checks.hpp
/// \brief Input validation shared by every attention functor.
#pragma once

#include <cmath>
#include <initializer_list>

#include "errors.hpp"

namespace effattn {
namespace detail {

/// True when every entry is finite. One vectorised reduction per column (per row of a row-major
/// expression): x - x is 0 for finite x and NaN for NaN/Inf, so a sum is 0 exactly when the
/// column is finite (IEEE arithmetic; not valid under -ffast-math). About 20x faster than Eigen's
/// allFinite() on a strided block.
template <typename Derived>
bool all_finite(const Eigen::DenseBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  // Along the storage order: a row-major block scanned by columns reads one float per row
  // (measured 4% of a multi-head prefill on its row-major query block).
  if constexpr (Derived::IsRowMajor) {
    for (Index i = 0; i < m.rows(); ++i)
      if (!((m.row(i).array() - m.row(i).array()).sum() == Scalar(0))) return false;
  } else {
    for (Index j = 0; j < m.cols(); ++j)
      if (!((m.col(j).array() - m.col(j).array()).sum() == Scalar(0))) return false;
  }
  return true;
}

/// Throws `invalid_argument` naming `name` and the position of the first NaN/Inf entry.
template <typename Derived>
void check_finite(const Eigen::MatrixBase<Derived>& m, const char* name) {
  if (EFFATTN_LIKELY(all_finite(m))) return;
  for (Index j = 0; j < m.cols(); ++j)
    for (Index i = 0; i < m.rows(); ++i)
      if (!std::isfinite(static_cast<double>(m(i, j))))
        throw_invalid_argument(cat(name, " (", shape(m), ") contains a non-finite value (",
                                   static_cast<double>(m(i, j)), ") at row ", i, ", column ", j));
}

/// Validates the usual attention triple: Q (n x d), K (m x d), V (m x dv), all non-empty and
/// finite. `method` names the caller in the message. `check_kv = false` leaves the finiteness of
/// K and V to a kernel that checks them as it reads them (and rescans them when it saw a problem).
template <typename DQ, typename DK, typename DV>
void check_attention_inputs(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                            const Eigen::MatrixBase<DV>& V, const char* method,
                            bool check_kv = true) {
  EFFATTN_CHECK(Q.rows() > 0 && Q.cols() > 0,
                cat(method, ": Q must be n x d with n, d >= 1; got Q ", shape(Q)));
  EFFATTN_CHECK(K.rows() > 0 && K.cols() > 0,
                cat(method, ": K must be m x d with m, d >= 1; got K ", shape(K)));
  EFFATTN_CHECK(V.rows() > 0 && V.cols() > 0,
                cat(method, ": V must be m x dv with m, dv >= 1; got V ", shape(V)));
  EFFATTN_CHECK(K.cols() == Q.cols(), cat(method, ": K must be m x d with d = Q.cols() = ",
                                          Q.cols(), "; got Q ", shape(Q), ", K ", shape(K)));
  EFFATTN_CHECK(V.rows() == K.rows(), cat(method, ": V must be m x dv with m = K.rows() = ",
                                          K.rows(), "; got K ", shape(K), ", V ", shape(V)));
  check_finite(Q, "Q");
  if (!check_kv) return;
  check_finite(K, "K");
  check_finite(V, "V");
}

/// True when `e` is one of `all` (the enumerators of its type): validates enum options without
/// casting to an integer and comparing with the last enumerator's value.
template <typename Enum>
bool is_one_of(Enum e, std::initializer_list<Enum> all) noexcept {
  for (const Enum x : all)
    if (e == x) return true;
  return false;
}

/// Validates the `scale` option (0 = automatic 1/sqrt(d); otherwise finite and > 0).
inline void check_scale_option(double scale, const char* method) {
  EFFATTN_CHECK(
      std::isfinite(scale) && scale >= 0,
      cat(method, ": Options::scale must be finite and >= 0 (0 = 1/sqrt(d)); got ", scale));
}

/// The effective logit scale: `scale` or 1/sqrt(d) when it is 0.
inline double resolve_scale(double scale, Index d) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d));
}

}  // namespace detail
}  // namespace effattn
