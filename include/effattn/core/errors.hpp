/// \file errors.hpp
/// \brief Exceptions, `EFFATTN_CHECK` (always on) and `EFFATTN_ASSERT` (debug only).
///
/// Policy (see README "Guarantees"): precondition violations (shapes, empty inputs, NaN/Inf
/// inputs, bad options, impossible budgets) throw `effattn::invalid_argument`; numerical trouble
/// during a computation is reported in `Result::info`, and the throwing convenience path
/// `operator()` turns it into `effattn::numerical_error`.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include "types.hpp"

namespace effattn {

/// Thrown on bad arguments: wrong shapes, empty or non-finite inputs, invalid options.
struct invalid_argument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// Thrown by the convenience `operator()` of a functor when `Result::info != Info::Success`.
struct numerical_error : std::runtime_error {
  numerical_error(const std::string& what, Info info_) : std::runtime_error(what), info(info_) {}
  Info info;  ///< The status that caused the error.
};

namespace detail {

[[noreturn]] EFFATTN_COLD EFFATTN_NOINLINE inline void throw_invalid_argument(
    const std::string& msg) {
  throw ::effattn::invalid_argument("effattn: " + msg);
}

[[noreturn]] EFFATTN_COLD EFFATTN_NOINLINE inline void throw_numerical_error(
    const std::string& method, Info info) {
  throw ::effattn::numerical_error("effattn: " + method + " failed with Info::" + to_string(info),
                                   info);
}

[[noreturn]] EFFATTN_COLD EFFATTN_NOINLINE inline void assertion_failed(const char* cond,
                                                                        const char* file,
                                                                        int line) {
  std::fprintf(stderr, "effattn: internal assertion failed: %s (%s:%d)\n", cond, file, line);
  std::abort();
}

/// "rows x cols" of any Eigen object, for messages.
template <typename Derived>
std::string shape(const Eigen::EigenBase<Derived>& m) {
  std::ostringstream s;
  s << m.rows() << " x " << m.cols();
  return s.str();
}

/// Concatenate streamable pieces into a string (used only on the cold error path).
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (void)std::initializer_list<int>{((void)(s << args), 0)...};
  return s.str();
}

}  // namespace detail
}  // namespace effattn

/// Always-on precondition check: throws `effattn::invalid_argument` with `msg` (a std::string
/// expression, evaluated only on failure) when `cond` is false.
#define EFFATTN_CHECK(cond, msg)                                   \
  do {                                                             \
    if (EFFATTN_UNLIKELY(!(cond))) {                               \
      ::effattn::detail::throw_invalid_argument(std::string(msg)); \
    }                                                              \
  } while (false)

/// Debug-only internal invariant; compiled out by `EFFATTN_NO_DEBUG` (implied by `NDEBUG`).
/// May be predefined by the user.
#ifndef EFFATTN_ASSERT
#ifdef EFFATTN_NO_DEBUG
#define EFFATTN_ASSERT(cond) ((void)0)
#else
#define EFFATTN_ASSERT(cond) \
  ((cond) ? (void)0 : ::effattn::detail::assertion_failed(#cond, __FILE__, __LINE__))
#endif
#endif
