/// \file types.hpp
/// \brief Matrix aliases, the status enum and the result base shared by every functor.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <limits>
#include <ostream>
#include <type_traits>

#include "../config.hpp"

namespace effattn {

/// Index type used everywhere (never `int` or `size_t`).
using Index = Eigen::Index;

/// Column-major dynamic matrix. Tokens are rows: Q is n x d, K is m x d, V is m x dv.
template <typename Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;

/// Dynamic column vector.
template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// Dynamic row vector.
template <typename Scalar>
using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

/// The input type of every functor. `MatrixX`, `Map` (inner stride 1, any outer stride) and
/// column blocks such as one head `X.middleCols(h * d, d)` of a packed matrix bind without a copy;
/// row-major matrices and expressions are evaluated once into a temporary.
template <typename Scalar>
using ConstRef = Eigen::Ref<const Matrix<Scalar>>;

/// Read-only vector argument (e.g. a per-key logit bias).
template <typename Scalar>
using ConstVectorRef = Eigen::Ref<const Vector<Scalar>>;

/// Outcome of a computation (after Eigen's `ComputationInfo` and Spectra's `CompInfo`).
/// Bad *inputs* throw `effattn::invalid_argument`; numerical trouble is reported here.
enum class Info {
  Success,         ///< The result is valid.
  NumericalIssue,  ///< Non-finite values or a breakdown (e.g. a kernel matrix not positive
                   ///< definite).
  NoConvergence,   ///< An iterative routine reached its iteration limit.
  NotComputed      ///< Nothing was computed yet.
};

/// Human-readable name of an `Info` value.
inline const char* to_string(Info info) noexcept {
  switch (info) {
    case Info::Success:
      return "Success";
    case Info::NumericalIssue:
      return "NumericalIssue";
    case Info::NoConvergence:
      return "NoConvergence";
    case Info::NotComputed:
      return "NotComputed";
  }
  return "Unknown";
}

inline std::ostream& operator<<(std::ostream& os, Info info) {
  return os << to_string(info);
}

/// Fields every method's `Result` has. Generic tests and benchmarks read only these two.
template <typename Scalar>
struct AttentionResult {
  Matrix<Scalar> output;          ///< n x dv attention output.
  Info info = Info::NotComputed;  ///< Status; `output` is meaningful only when `Success`.
};

/// Per-scalar constants. `Accum` is the type sensitive reductions use (double for float).
template <typename Scalar>
struct ScalarTraits {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "effattn: Scalar must be float or double");
  using Accum = double;
  static constexpr Scalar epsilon() noexcept { return std::numeric_limits<Scalar>::epsilon(); }
};

namespace detail {
/// Compile-time guard used by every public class template.
template <typename Scalar>
constexpr bool is_supported_scalar_v =
    std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value;
}  // namespace detail

}  // namespace effattn
