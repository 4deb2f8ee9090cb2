/// \file test_utils.hpp
/// \brief Shared helpers of the effattn tests. All Catch2-version-specific includes live here.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <effattn/core/errors.hpp>
#include <effattn/core/random.hpp>
#include <effattn/core/types.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace effattn {
namespace testing {

/// True when the environment variable EFFATTN_TEST_VERBOSE is set: tests then print the measured
/// quantities their tolerance comments quote.
inline bool verbose() {
  return std::getenv("EFFATTN_TEST_VERBOSE") != nullptr;
}

/// True for Scalar = float (the tests' float / double tolerance switch).
template <typename Scalar>
constexpr bool is_float() {
  return std::is_same<Scalar, float>::value;
}

/// rows x cols matrix of N(0, sd^2) entries from the library's seeded generator
/// (`make_rng(seed, stream)`, `fill_normal`): the per-method tests' random inputs.
template <typename Scalar>
Matrix<Scalar> randn(Index rows, Index cols, std::uint64_t seed, double sd = 1.0,
                     std::uint64_t stream = 0) {
  Rng rng = make_rng(seed, stream);
  Matrix<Scalar> m(rows, cols);
  fill_normal(m, rng, 0.0, sd);
  return m;
}

/// rows x cols matrix of independent N(0, sd^2) entries from std::mt19937_64(seed), drawn column
/// by column (the same values for the same arguments on every platform's libstdc++).
template <typename Scalar>
Matrix<Scalar> gaussian(Index rows, Index cols, std::uint64_t seed, double sd = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> nd(0.0, sd);
  Matrix<Scalar> x(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) x(i, j) = static_cast<Scalar>(nd(gen));
  return x;
}

/// Runs `call()` and checks that it throws `effattn::invalid_argument` whose message contains
/// `needle` (the argument or position the message must name).
template <typename Call>
void require_invalid_argument(Call&& call, const std::string& needle) {
  try {
    call();
  } catch (const effattn::invalid_argument& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
    return;
  } catch (...) {
    FAIL("threw something other than effattn::invalid_argument");
  }
  FAIL("expected effattn::invalid_argument containing '" << needle << "'");
}

/// ||A - B||_F / ||B||_F, in double.
template <typename DA, typename DB>
double rel_fro_error(const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DB>& B) {
  const auto a = A.template cast<double>().eval();
  const auto b = B.template cast<double>().eval();
  const double nb = b.norm();
  return nb > 0 ? (a - b).norm() / nb : (a - b).norm();
}

/// max |A - B|, in double.
template <typename DA, typename DB>
double max_abs_error(const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DB>& B) {
  return (A.template cast<double>() - B.template cast<double>()).cwiseAbs().maxCoeff();
}

/// True when the two matrices have the same shape and identical bits.
template <typename DA, typename DB>
bool bitwise_equal(const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DB>& B) {
  if (A.rows() != B.rows() || A.cols() != B.cols()) return false;
  for (Index j = 0; j < A.cols(); ++j)
    for (Index i = 0; i < A.rows(); ++i) {
      const auto a = A(i, j), b = B(i, j);
      if (std::memcmp(&a, &b, sizeof(a)) != 0) return false;
    }
  return true;
}

/// Independent oracle: softmax attention by plain loops in long double (no Eigen products, no
/// effattn code). Optional per-key bias; causal is bottom-right aligned (j <= i + m - n).
template <typename DQ, typename DK, typename DV>
Matrix<double> loop_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, double scale, bool causal,
                              const std::vector<double>& bias = {},
                              std::vector<double>* lse = nullptr) {
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  Matrix<double> out(n, dv);
  if (lse) lse->assign(static_cast<std::size_t>(n), 0.0);
  std::vector<long double> logit(static_cast<std::size_t>(m));
  for (Index i = 0; i < n; ++i) {
    const Index last = causal ? i + (m - n) : m - 1;
    long double mx = -std::numeric_limits<long double>::infinity();
    for (Index j = 0; j <= last; ++j) {
      long double dot = 0;
      for (Index k = 0; k < d; ++k)
        dot += static_cast<long double>(Q(i, k)) * static_cast<long double>(K(j, k));
      long double z = static_cast<long double>(scale) * dot;
      if (!bias.empty()) z += static_cast<long double>(bias[static_cast<std::size_t>(j)]);
      logit[static_cast<std::size_t>(j)] = z;
      if (z > mx) mx = z;
    }
    long double total = 0;
    for (Index j = 0; j <= last; ++j) total += std::exp(logit[static_cast<std::size_t>(j)] - mx);
    for (Index c = 0; c < dv; ++c) {
      long double acc = 0;
      for (Index j = 0; j <= last; ++j)
        acc +=
            std::exp(logit[static_cast<std::size_t>(j)] - mx) * static_cast<long double>(V(j, c));
      out(i, c) = static_cast<double>(acc / total);
    }
    if (lse) (*lse)[static_cast<std::size_t>(i)] = static_cast<double>(mx + std::log(total));
  }
  return out;
}

/// Round-off scale of a scalar type: the tolerance tests multiply by a problem-dependent factor.
template <typename Scalar>
constexpr double eps() {
  return static_cast<double>(std::numeric_limits<Scalar>::epsilon());
}

/// Runs `f` with OpenMP limited to `threads` threads (a no-op without OpenMP), restoring after.
template <typename F>
auto with_threads(int threads, F&& f) -> decltype(f()) {
#if defined(_OPENMP)
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  struct Restore {
    int n;
    ~Restore() { omp_set_num_threads(n); }
  } restore{saved};
#else
  (void)threads;
#endif
  return f();
}

/// Calls f(bad, row, col) for one non-finite entry at a time of a rows x cols operand: NaN, +inf
/// and -inf at the first, middle and last row and the first and last column (the fused decoding
/// kernels do not scan K and V beforehand, so the tests put them where block and chunk edges
/// are), with INFO naming the entry.
template <typename F>
void for_each_nonfinite_entry(Index rows, Index cols, F&& f) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf})
    for (const Index row : {Index(0), rows / 2, rows - 1})
      for (const Index col : {Index(0), cols - 1}) {
        INFO("value " << bad << " at (" << row << ", " << col << ")");
        f(bad, row, col);
      }
}

/// Whether this test binary was built with OpenMP (thread-count tests are vacuous otherwise).
constexpr bool has_openmp() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

}  // namespace testing
}  // namespace effattn
