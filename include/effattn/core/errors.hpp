/// \file errors.hpp
/// \brief Exceptions, `EFFATTN_CHECK` (always on) and `EFFATTN_ASSERT` (debug only).
///
/// Policy (see docs/guarantees.md): precondition violations (shapes, empty inputs, NaN/Inf
/// inputs, bad options, impossible budgets) throw `effattn::invalid_argument`; numerical trouble
/// during a computation is reported in `Result::info`, and the throwing convenience path
/// `operator()` turns it into `effattn::numerical_error`.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "types.hpp"

namespace effattn {

/// Thrown on bad arguments: wrong shapes, empty or non-finite inputs, invalid options.
struct invalid_argument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// Thrown by the convenience `operator()` of a functor when `Result::info != Info::Success`.
struct numerical_error : std::runtime_error {
  /// `what`: the message; `info_`: the status of the failed computation.
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

/// One piece of an error message, converted where it is built: the message builder below is then
/// one non-template function, and `cat(...)` instantiates only a trivial forwarding wrapper per
/// argument list (string literals decay to `const char*`, every integer to `long long`, every
/// floating-point value to `double`) instead of one `std::ostringstream` pipeline per signature.
class MessagePiece {
 public:
  MessagePiece(const char* s) : m_text(s != nullptr ? s : "(null)") {}  // NOLINT: implicit
  MessagePiece(const std::string& s) : m_text(s) {}                     // NOLINT: implicit
  MessagePiece(char c) : m_text(1, c) {}                                // NOLINT: implicit
  MessagePiece(bool b) : m_text(b ? "true" : "false") {}                // NOLINT: implicit
  template <typename T,
            typename std::enable_if<std::is_integral<T>::value && !std::is_same<T, bool>::value &&
                                        !std::is_same<T, char>::value,
                                    int>::type = 0>
  MessagePiece(T v) : m_text(integer(static_cast<long long>(v))) {}  // NOLINT: implicit
  template <typename T, typename std::enable_if<std::is_floating_point<T>::value, int>::type = 0>
  MessagePiece(T v) : m_text(floating(static_cast<double>(v))) {}  // NOLINT: implicit
  MessagePiece(Info info) : m_text(to_string(info)) {}             // NOLINT: implicit

  const std::string& text() const noexcept { return m_text; }

 private:
  static std::string integer(long long v) { return std::to_string(v); }
  // As `std::ostream << double` prints it (6 significant digits, %g).
  static std::string floating(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  }
  std::string m_text;
};

/// Joins message pieces (not a template: compiled once per translation unit).
inline std::string join_message(std::initializer_list<MessagePiece> pieces) {
  std::string out;
  for (const MessagePiece& p : pieces) out += p.text();
  return out;
}

/// Concatenates the pieces of an error message (used only on the cold error path). The
/// arguments are taken by value so that string literals of every length decay to one type.
template <typename... Args>
std::string cat(Args... args) {
  return join_message({MessagePiece(args)...});
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
