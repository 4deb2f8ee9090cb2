/// \file types.hpp
/// \brief Matrix aliases, the status enum and the result base shared by every functor.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <limits>
#include <ostream>
#include <type_traits>
#include <vector>

#include "../config.hpp"
#ifdef EFFATTN_EXTERN_EIGEN_KERNELS  // effattn's own targets only
#include "../detail/linalg/eigen_kernels.hpp"
#endif

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
  NoConvergence,   ///< An iterative routine reached its iteration limit (reserved: no method
                   ///< iterates to a tolerance today, so none returns it).
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

/// Writes `to_string(info)`.
inline std::ostream& operator<<(std::ostream& os, Info info) {
  return os << to_string(info);
}

/// One named scalar diagnostic of a Result, e.g. {"rank", 256}. `name` is a string literal.
struct Diagnostic {
  const char* name;  ///< identifier-like name, unique within one Result
  double value;      ///< the value (counts and flags as doubles)
};

/// The uniform diagnostics of a Result: the method's scalar diagnostics, in a fixed order, which
/// generic code prints without knowing the method (`Result::diagnostics()`).
using Diagnostics = std::vector<Diagnostic>;

/// Fields every method's `Result` has. Generic tests and benchmarks read only these two and
/// `diagnostics()`, which each method's Result redefines with its own scalars.
template <typename Scalar>
struct AttentionResult {
  Matrix<Scalar> output;          ///< n x dv attention output.
  Info info = Info::NotComputed;  ///< Status; `output` is meaningful only when `Success`.
  /// The method's scalar diagnostics (none at this level).
  Diagnostics diagnostics() const { return {}; }
};

namespace detail {
/// Compile-time guard used by every public class template.
template <typename Scalar>
constexpr bool is_supported_scalar_v =
    std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value;

/// True for the functor instantiations that `effattn::compiled` carries: the method headers
/// specialise it next to their `extern template` declarations (compiled mode only).
template <typename Functor>
struct in_compiled_library : std::false_type {};
}  // namespace detail

/// In a compiled-mode TU without `EFFATTN_ALL_POLICIES` (see config.hpp) the member definitions of
/// the functors are not included: a class template body states with this macro that it is one of
/// the instantiations of the compiled library, or fails with the fix in the message.
#define EFFATTN_REQUIRE_DEFINITIONS(Class)                                                        \
  static_assert(EFFATTN_DETAIL_WITH_IMPL || ::effattn::detail::in_compiled_library<Class>::value, \
                "effattn: this TU uses effattn::compiled (EFFATTN_COMPILED), which carries only " \
                "the default-policy functors, and so does not include the implementation "        \
                "headers: define EFFATTN_ALL_POLICIES before including effattn (or link the "     \
                "header-only effattn::effattn) to instantiate other policies")

/// Declares one instantiation of effattn::compiled (compiled mode, at namespace effattn scope):
/// `extern template` plus the trait above.
#define EFFATTN_EXTERN_INSTANCE(...)                           \
  namespace detail {                                           \
  template <>                                                  \
  struct in_compiled_library<__VA_ARGS__> : std::true_type {}; \
  }                                                            \
  extern template class __VA_ARGS__;

}  // namespace effattn
