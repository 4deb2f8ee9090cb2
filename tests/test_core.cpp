// Tests of the core layer: errors and input checks, the seeded random layer, the stable softmax
// helpers and the parallel loop. Every expected value is either a mathematical fact, a value fixed
// by a standard or reference implementation (cited in place), or an independent oracle computed
// here in long double; statistical checks use fixed seeds and bounds of several standard errors.
#include "test_utils.hpp"

#include <effattn/core/checks.hpp>
#include <effattn/core/errors.hpp>
#include <effattn/core/gemm.hpp>
#include <effattn/core/parallel.hpp>
#include <effattn/core/random.hpp>
#include <effattn/core/softmax.hpp>
#include <effattn/core/types.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using effattn::Index;
using effattn::Matrix;
using effattn::Rng;
using effattn::Vector;
namespace et = effattn::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// Runs `f`, which must throw effattn::invalid_argument, and returns what().
template <typename F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const effattn::invalid_argument& e) {
    return e.what();
  } catch (...) {
    FAIL("threw something other than effattn::invalid_argument");
  }
  FAIL("did not throw effattn::invalid_argument");
  return {};
}

/// A matrix with entries that are not all equal (so transposition / offset bugs show).
template <typename Scalar>
Matrix<Scalar> ramp(Index rows, Index cols, double start = 0.25) {
  Matrix<Scalar> m(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i)
      m(i, j) = static_cast<Scalar>(start + 0.5 * static_cast<double>(i) -
                                    0.125 * static_cast<double>(j));
  return m;
}

/// Long-double softmax oracle of one row: probabilities and log-sum-exp (entries -inf = masked).
struct RowOracle {
  std::vector<long double> p;
  long double lse;
};

template <typename Derived>
RowOracle softmax_oracle_row(const Eigen::MatrixBase<Derived>& S, Index i) {
  const Index m = S.cols();
  RowOracle r;
  r.p.assign(static_cast<std::size_t>(m), 0.0L);
  long double mx = -std::numeric_limits<long double>::infinity();
  for (Index j = 0; j < m; ++j) mx = std::max(mx, static_cast<long double>(S(i, j)));
  if (mx == -std::numeric_limits<long double>::infinity()) {
    r.lse = mx;
    return r;
  }
  long double total = 0;
  for (Index j = 0; j < m; ++j) total += std::exp(static_cast<long double>(S(i, j)) - mx);
  for (Index j = 0; j < m; ++j)
    r.p[static_cast<std::size_t>(j)] = std::exp(static_cast<long double>(S(i, j)) - mx) / total;
  r.lse = mx + std::log(total);
  return r;
}

/// Inverse of mt19937_64's tempering (u = 29, d = 0x5555..., s = 17, b = 0x71D67FFFEDA60000,
/// t = 37, c = 0xFFF7EEE000000000, l = 43 per [rand.predef]).
std::uint64_t untemper(std::uint64_t y) {
  y ^= y >> 43;
  y ^= (y << 37) & 0xFFF7EEE000000000ULL;
  std::uint64_t x = y;
  for (int k = 0; k < 4; ++k) x = y ^ ((x << 17) & 0x71D67FFFEDA60000ULL);
  y = x;
  for (int k = 0; k < 3; ++k) x = y ^ ((x >> 29) & 0x5555555555555555ULL);
  return x;
}

/// An mt19937_64 whose next outputs are exactly `outputs` (at most 100), built through the
/// engine's standard textual state ([rand.eng.mers]: the state is X_{i-n} .. X_{i-1}, and
/// X_{i+k} = X_{i+k-(n-m)} ^ twist(X_{i+k-n}, X_{i+k-n+1})). With words 0 .. 100 zero the twist
/// term vanishes for k < 100, so X_{i+k} = word[m + k] and we store untemper(output_k) there.
Rng engine_emitting(std::initializer_list<std::uint64_t> outputs) {
  constexpr std::size_t n = 312, m = 156;
  std::vector<std::uint64_t> words(n, 0);
  std::size_t k = 0;
  for (std::uint64_t out : outputs) words[m + k++] = untemper(out);
  std::ostringstream text;
  for (std::size_t w = 0; w < n; ++w) text << words[w] << ' ';
  // libstdc++ also stores the read position after the words (n = "the words are X_{i-n} .. X_{i-1},
  // twist before the next output"); other libraries stop after the n words and ignore it.
  text << n;
  Rng rng;
  std::istringstream in(text.str());
  in >> rng;
  REQUIRE(!in.fail());
  // Self-check of the construction (so a failure here is not blamed on effattn).
  Rng probe = rng;
  for (std::uint64_t out : outputs) REQUIRE(probe() == out);
  return rng;
}

}  // namespace

// =================================================================================================
// errors
// =================================================================================================

TEST_CASE("EFFATTN_CHECK(false, msg) throws effattn::invalid_argument prefixed with 'effattn: '",
          "[core][errors]") {
  const std::string what =
      invalid_argument_message([] { EFFATTN_CHECK(false, "the answer is " + std::to_string(42)); });
  CHECK(what.rfind("effattn: ", 0) == 0);
  CHECK(contains(what, "the answer is 42"));

  // The exception is a std::invalid_argument (and so a std::logic_error / std::exception).
  CHECK_THROWS_AS([] { EFFATTN_CHECK(1 + 1 == 3, "arithmetic"); }(), std::invalid_argument);
  CHECK_THROWS_AS([] { EFFATTN_CHECK(false, "x"); }(), std::logic_error);
  static_assert(std::is_base_of<std::invalid_argument, effattn::invalid_argument>::value,
                "effattn::invalid_argument must derive from std::invalid_argument");
}

TEST_CASE("EFFATTN_CHECK evaluates its message only when the condition fails", "[core][errors]") {
  int evaluated = 0;
  auto message = [&evaluated] {
    ++evaluated;
    return std::string("expensive message");
  };
  CHECK_NOTHROW([&] { EFFATTN_CHECK(true, message()); }());
  CHECK_NOTHROW([&] { EFFATTN_CHECK(2 > 1, message()); }());
  CHECK(evaluated == 0);

  CHECK_THROWS_AS([&] { EFFATTN_CHECK(false, message()); }(), effattn::invalid_argument);
  CHECK(evaluated == 1);

  // The condition itself is evaluated exactly once.
  int cond_evaluated = 0;
  CHECK_NOTHROW([&] { EFFATTN_CHECK(++cond_evaluated > 0, "never"); }());
  CHECK(cond_evaluated == 1);
}

TEST_CASE("numerical_error carries its Info and is a std::runtime_error", "[core][errors]") {
  const effattn::numerical_error direct("direct", effattn::Info::NoConvergence);
  CHECK(direct.info == effattn::Info::NoConvergence);
  CHECK(std::string(direct.what()) == "direct");

  bool caught = false;
  try {
    effattn::detail::throw_numerical_error("SomeMethod", effattn::Info::NumericalIssue);
  } catch (const effattn::numerical_error& e) {
    caught = true;
    CHECK(e.info == effattn::Info::NumericalIssue);
    const std::string what = e.what();
    CHECK(what.rfind("effattn: ", 0) == 0);
    CHECK(contains(what, "SomeMethod"));
    CHECK(contains(what, "NumericalIssue"));
  }
  CHECK(caught);
  CHECK_THROWS_AS(effattn::detail::throw_numerical_error("M", effattn::Info::NoConvergence),
                  std::runtime_error);
  static_assert(std::is_base_of<std::runtime_error, effattn::numerical_error>::value,
                "effattn::numerical_error must derive from std::runtime_error");
}

TEST_CASE("to_string and operator<< name all four Info values", "[core][errors]") {
  using effattn::Info;
  CHECK(std::string(effattn::to_string(Info::Success)) == "Success");
  CHECK(std::string(effattn::to_string(Info::NumericalIssue)) == "NumericalIssue");
  CHECK(std::string(effattn::to_string(Info::NoConvergence)) == "NoConvergence");
  CHECK(std::string(effattn::to_string(Info::NotComputed)) == "NotComputed");
  std::ostringstream s;
  s << Info::NoConvergence << '|' << Info::Success;
  CHECK(s.str() == "NoConvergence|Success");
  // A default-constructed result says nothing was computed.
  CHECK(effattn::AttentionResult<float>{}.info == Info::NotComputed);
}

TEMPLATE_TEST_CASE("check_attention_inputs rejects empty and mismatched shapes, naming them",
                   "[core][errors]", float, double) {
  using S = TestType;
  using effattn::detail::check_attention_inputs;
  const Matrix<S> Q = ramp<S>(3, 4), K = ramp<S>(5, 4), V = ramp<S>(5, 2);
  REQUIRE_NOTHROW(check_attention_inputs(Q, K, V, "Meth"));

  SECTION("empty Q") {
    for (const auto& bad : {Matrix<S>(0, 4), Matrix<S>(3, 0)}) {
      const std::string w =
          invalid_argument_message([&] { check_attention_inputs(bad, K, V, "Meth"); });
      CHECK(w.rfind("effattn: Meth", 0) == 0);
      CHECK(contains(w, "got Q " + effattn::detail::shape(bad)));
    }
    CHECK(contains(
        invalid_argument_message([&] { check_attention_inputs(Matrix<S>(0, 4), K, V, "M"); }),
        "0 x 4"));
  }
  SECTION("empty K") {
    for (const auto& bad : {Matrix<S>(0, 4), Matrix<S>(5, 0)}) {
      const std::string w =
          invalid_argument_message([&] { check_attention_inputs(Q, bad, V, "Meth"); });
      CHECK(contains(w, "Meth"));
      CHECK(contains(w, "got K " + effattn::detail::shape(bad)));
    }
    CHECK(contains(
        invalid_argument_message([&] { check_attention_inputs(Q, Matrix<S>(5, 0), V, "M"); }),
        "K 5 x 0"));
  }
  SECTION("empty V") {
    for (const auto& bad : {Matrix<S>(0, 2), Matrix<S>(5, 0)}) {
      const std::string w =
          invalid_argument_message([&] { check_attention_inputs(Q, K, bad, "Meth"); });
      CHECK(contains(w, "Meth"));
      CHECK(contains(w, "got V " + effattn::detail::shape(bad)));
    }
    CHECK(contains(
        invalid_argument_message([&] { check_attention_inputs(Q, K, Matrix<S>(5, 0), "M"); }),
        "V 5 x 0"));
  }
  SECTION("K.cols() != Q.cols()") {
    const Matrix<S> K3 = ramp<S>(5, 3);
    const std::string w =
        invalid_argument_message([&] { check_attention_inputs(Q, K3, V, "Meth"); });
    CHECK(contains(w, "Meth"));
    CHECK(contains(w, "Q 3 x 4"));
    CHECK(contains(w, "K 5 x 3"));
  }
  SECTION("V.rows() != K.rows()") {
    const Matrix<S> V6 = ramp<S>(6, 2);
    const std::string w =
        invalid_argument_message([&] { check_attention_inputs(Q, K, V6, "Meth"); });
    CHECK(contains(w, "Meth"));
    CHECK(contains(w, "K 5 x 4"));
    CHECK(contains(w, "V 6 x 2"));
  }
}

TEMPLATE_TEST_CASE("check_attention_inputs rejects NaN, +Inf and -Inf in each of Q, K, V",
                   "[core][errors]", float, double) {
  using S = TestType;
  using effattn::detail::check_attention_inputs;
  const double bad_values[] = {kNaN, kInf, -kInf};
  const char* names[] = {"Q", "K", "V"};
  for (int which = 0; which < 3; ++which) {
    for (double bad : bad_values) {
      Matrix<S> Q = ramp<S>(3, 4), K = ramp<S>(5, 4), V = ramp<S>(5, 2);
      Matrix<S>& target = which == 0 ? Q : (which == 1 ? K : V);
      const Index r = target.rows() - 2, c = target.cols() - 1;
      target(r, c) = static_cast<S>(bad);
      // A second bad entry later in column-major order: the first one must be reported.
      target(target.rows() - 1, target.cols() - 1) = static_cast<S>(kNaN);
      INFO("argument " << names[which] << ", value " << bad);
      const std::string w =
          invalid_argument_message([&] { check_attention_inputs(Q, K, V, "Meth"); });
      CHECK(w.rfind("effattn: ", 0) == 0);
      CHECK(contains(w, std::string(names[which]) + " (" + effattn::detail::shape(target) + ")"));
      CHECK(contains(w, "non-finite"));
      CHECK(contains(w, "row " + std::to_string(r) + ", column " + std::to_string(c)));
    }
  }
}

TEMPLATE_TEST_CASE("all_finite finds every non-finite entry in either storage order",
                   "[core][errors]", float, double) {
  using S = TestType;
  using effattn::detail::all_finite;
  using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // Blocks at an offset (strided in both orders), their transposes, and row / column vectors;
  // the scan order depends on the storage order, so each entry is tried in each.
  const Index rows = 7, cols = 19;
  const double bad_values[] = {kNaN, kInf, -kInf};
  Matrix<S> C = ramp<S>(rows + 3, cols + 2);
  RowMat R = C;
  auto cb = C.block(2, 1, rows, cols);
  auto rb = R.block(2, 1, rows, cols);
  REQUIRE(all_finite(cb));
  REQUIRE(all_finite(rb));
  REQUIRE(all_finite(rb.transpose()));
  for (double bad : bad_values)
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) {
        const S keep = cb(i, j);
        cb(i, j) = static_cast<S>(bad);
        rb(i, j) = static_cast<S>(bad);
        INFO("value " << bad << " at (" << i << ", " << j << ")");
        CHECK_FALSE(all_finite(cb));
        CHECK_FALSE(all_finite(rb));
        CHECK_FALSE(all_finite(cb.transpose()));
        CHECK_FALSE(all_finite(rb.transpose()));
        CHECK_FALSE(all_finite(rb.row(i)));
        CHECK_FALSE(all_finite(cb.col(j)));
        CHECK(all_finite(rb.row((i + 1) % rows)));
        cb(i, j) = keep;
        rb(i, j) = keep;
      }
}

TEMPLATE_TEST_CASE("check_attention_inputs accepts valid Maps and column blocks", "[core][errors]",
                   float, double) {
  using S = TestType;
  using effattn::detail::check_attention_inputs;
  // Packed multi-head layout: 2 heads of d = 4 side by side; the checks see only the block.
  Matrix<S> packedQ = ramp<S>(3, 8), packedK = ramp<S>(5, 8), packedV = ramp<S>(5, 6);
  CHECK_NOTHROW(check_attention_inputs(packedQ.middleCols(4, 4), packedK.middleCols(4, 4),
                                       packedV.middleCols(3, 3), "Meth"));
  // A NaN outside the viewed block is not the callee's business ...
  packedQ(1, 0) = static_cast<S>(kNaN);
  CHECK_NOTHROW(check_attention_inputs(packedQ.middleCols(4, 4), packedK.middleCols(4, 4),
                                       packedV.middleCols(3, 3), "Meth"));
  // ... but one inside it is, and its position is reported relative to the block.
  packedQ(2, 5) = static_cast<S>(kInf);
  const std::string w = invalid_argument_message([&] {
    check_attention_inputs(packedQ.middleCols(4, 4), packedK.middleCols(4, 4),
                           packedV.middleCols(3, 3), "Meth");
  });
  CHECK(contains(w, "Q (3 x 4)"));
  CHECK(contains(w, "row 2, column 1"));

  // Maps over raw buffers, including an outer stride, and the library's ConstRef type.
  std::vector<S> buf(64);
  for (std::size_t k = 0; k < buf.size(); ++k)
    buf[k] = static_cast<S>(0.5 * static_cast<double>(k));
  const Eigen::Map<const Matrix<S>> Qm(buf.data(), 3, 4);
  const Eigen::Map<const Matrix<S>, 0, Eigen::OuterStride<>> Km(buf.data(), 5, 4,
                                                                Eigen::OuterStride<>(7));
  const Eigen::Map<const Matrix<S>> Vm(buf.data() + 30, 5, 2);
  CHECK_NOTHROW(check_attention_inputs(Qm, Km, Vm, "Meth"));
  const effattn::ConstRef<S> Qr(Qm), Kr(Km), Vr(Vm);
  CHECK_NOTHROW(check_attention_inputs(Qr, Kr, Vr, "Meth"));
  // Single-entry inputs are the smallest valid problem.
  CHECK_NOTHROW(check_attention_inputs(Matrix<S>::Ones(1, 1), Matrix<S>::Ones(1, 1),
                                       Matrix<S>::Ones(1, 1), "Meth"));
}

TEST_CASE("check_scale_option and resolve_scale", "[core][errors]") {
  using effattn::detail::check_scale_option;
  using effattn::detail::resolve_scale;
  for (double bad :
       {-1.0, -1e-300, -std::numeric_limits<double>::denorm_min(), kNaN, kInf, -kInf}) {
    INFO("scale = " << bad);
    const std::string w = invalid_argument_message([&] { check_scale_option(bad, "Meth"); });
    CHECK(contains(w, "Meth"));
    CHECK(contains(w, "scale"));
  }
  for (double good : {0.0, std::numeric_limits<double>::denorm_min(), 1e-300, 0.125, 1.0, 1e300}) {
    INFO("scale = " << good);
    CHECK_NOTHROW(check_scale_option(good, "Meth"));
  }
  // 0 means 1/sqrt(d); exact for perfect squares that are powers of 4.
  CHECK(resolve_scale(0, 64) == 0.125);
  CHECK(resolve_scale(0, 1) == 1.0);
  CHECK(resolve_scale(0, 4) == 0.5);
  for (Index d : {2, 3, 7, 48, 96, 128, 1000}) {
    INFO("d = " << d);
    CHECK(resolve_scale(0, d) == Approx(1.0 / std::sqrt(static_cast<double>(d))).epsilon(1e-15));
  }
  // A positive scale is used as given, whatever d.
  CHECK(resolve_scale(0.3, 64) == 0.3);
  CHECK(resolve_scale(2.0, 1) == 2.0);
}

// =================================================================================================
// random
// =================================================================================================

TEST_CASE("The engine is std::mt19937_64 and conforms to the C++ standard", "[core][random]") {
  static_assert(std::is_same<Rng, std::mt19937_64>::value, "effattn::Rng must be std::mt19937_64");
  // [rand.predef]: "the 10000th consecutive invocation of a default-constructed object of type
  // mt19937_64 shall produce the value 9981545732273789042". This pins the engine's sequence, on
  // which the "identical across toolchains" claim of random.hpp rests.
  Rng rng;
  rng.discard(9999);
  CHECK(rng() == 9981545732273789042ULL);
}

TEST_CASE("splitmix64 matches Vigna's reference SplitMix64 outputs", "[core][random]") {
  // splitmix64(x) is one step of the reference generator (state += golden gamma, then mix), so
  // splitmix64(k * gamma) is output k+1 of SplitMix64 seeded with 0: 0xE220A8397B1DCDAF,
  // 0x6E789E6AA1B965F4, 0x06C45D188009454F (xorshift.di.unimi.it/splitmix64.c).
  constexpr std::uint64_t gamma = 0x9E3779B97F4A7C15ULL;
  static_assert(effattn::splitmix64(0) == 0xE220A8397B1DCDAFULL, "splitmix64 must be constexpr");
  CHECK(effattn::splitmix64(gamma) == 0x6E789E6AA1B965F4ULL);
  CHECK(effattn::splitmix64(2 * gamma) == 0x06C45D188009454FULL);
}

TEST_CASE("Same seed and stream give identical sequences, other streams and seeds differ",
          "[core][random]") {
  Rng a = effattn::make_rng(7, 3), b = effattn::make_rng(7, 3);
  CHECK(a == b);
  CHECK(effattn::make_rng(7) == effattn::make_rng(7, 0));
  CHECK(effattn::make_rng(7, 3) == Rng(effattn::derive_seed(7, 3)));
  for (int k = 0; k < 1000; ++k) REQUIRE(a() == b());

  // Different streams of one seed, and one stream of different seeds: no output in common
  // position (each coincidence has probability 2^-64).
  Rng s1 = effattn::make_rng(7, 1), s2 = effattn::make_rng(7, 2), t1 = effattn::make_rng(8, 1);
  int same_stream = 0, same_seed = 0;
  for (int k = 0; k < 1000; ++k) {
    const std::uint64_t x = s1(), y = s2(), z = t1();
    same_stream += x == y;
    same_seed += x == z;
  }
  CHECK(same_stream == 0);
  CHECK(same_seed == 0);
}

TEST_CASE("Streams of one seed are nearly uncorrelated", "[core][random]") {
  // For independent streams the sample correlation r of N pairs has standard error ~ 1/sqrt(N)
  // = 0.01 at N = 10^4; 5 standard errors give the bound 0.05. Also checked for adjacent seeds
  // (seed s vs s + 1, same stream), which a weak seed derivation would correlate.
  constexpr int N = 10000;
  auto correlation = [](Rng x, Rng y) {
    double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
    for (int k = 0; k < N; ++k) {
      const double u = effattn::standard_normal(x), v = effattn::standard_normal(y);
      sx += u, sy += v, sxx += u * u, syy += v * v, sxy += u * v;
    }
    const double n = static_cast<double>(N);
    const double cov = sxy / n - (sx / n) * (sy / n);
    return cov / std::sqrt((sxx / n - (sx / n) * (sx / n)) * (syy / n - (sy / n) * (sy / n)));
  };
  CHECK(std::abs(correlation(effattn::make_rng(123, 1), effattn::make_rng(123, 2))) < 0.05);
  CHECK(std::abs(correlation(effattn::make_rng(123, 0), effattn::make_rng(124, 0))) < 0.05);
  // Control: a stream correlates perfectly with itself, so the statistic is meaningful.
  CHECK(correlation(effattn::make_rng(123, 1), effattn::make_rng(123, 1)) > 0.999999);
}

TEST_CASE("derive_seed has no collisions over a 64 x 64 grid of (seed, stream)", "[core][random]") {
  // Small consecutive seeds and streams are the common case; a derivation like seed ^ stream or
  // seed + stream would collide massively here (e.g. (1, 2) vs (2, 1)).
  std::vector<std::uint64_t> seeds;
  for (std::uint64_t s = 0; s < 64; ++s)
    for (std::uint64_t t = 0; t < 64; ++t) seeds.push_back(effattn::derive_seed(s, t));
  std::sort(seeds.begin(), seeds.end());
  CHECK(std::adjacent_find(seeds.begin(), seeds.end()) == seeds.end());
  CHECK(effattn::derive_seed(1, 2) != effattn::derive_seed(2, 1));
}

TEST_CASE("uniform01 and uniform_open01: ranges over many draws, one engine output each",
          "[core][random]") {
  Rng rng = effattn::make_rng(2024, 0);
  const int N = 1000000;
  double lo01 = 1, hi01 = 0, loo = 1, hio = 0;
  bool on_grid = true;
  for (int k = 0; k < N; ++k) {
    const double u = effattn::uniform01(rng), v = effattn::uniform_open01(rng);
    lo01 = std::min(lo01, u), hi01 = std::max(hi01, u);
    loo = std::min(loo, v), hio = std::max(hio, v);
    // uniform01 = k 2^-53 for an integer k < 2^53.
    const double ku = std::ldexp(u, 53);
    on_grid = on_grid && ku == std::floor(ku);
  }
  CHECK(lo01 >= 0.0);
  CHECK(hi01 < 1.0);
  CHECK(loo > 0.0);
  CHECK(hio < 1.0);
  CHECK(on_grid);
  // Over 10^6 draws the extremes come within 1e-5 of the ends (P(miss) = (1 - 1e-5)^1e6 ~ e^-10).
  CHECK(lo01 < 1e-5);
  CHECK(hi01 > 1 - 1e-5);
  CHECK(loo < 1e-5);
  CHECK(hio > 1 - 1e-5);

  // Each consumes exactly one engine output; uniform01 uses its top 53 bits.
  Rng a = effattn::make_rng(5), b = a;
  const double u = effattn::uniform01(a);
  const std::uint64_t r = b();
  CHECK(a == b);
  CHECK(u == static_cast<double>(r >> 11) / 9007199254740992.0);
  (void)effattn::uniform_open01(a);
  b.discard(1);
  CHECK(a == b);
}

TEST_CASE("uniform01 and uniform_open01 at the extreme engine outputs", "[core][random]") {
  // Engines forced to emit 0 and 2^64 - 1 (see engine_emitting).
  Rng zero = engine_emitting({0}), ones = engine_emitting({~std::uint64_t(0)});
  CHECK(effattn::uniform01(zero) == 0.0);
  CHECK(effattn::uniform01(ones) == 1.0 - std::ldexp(1.0, -53));
  // uniform_open01 = (k + 1/2) 2^-52 for the top 52 bits k: both ends stay strictly inside.
  Rng zero2 = engine_emitting({0});
  const double v = effattn::uniform_open01(zero2);
  CHECK(v > 0.0);
  CHECK(v == std::ldexp(1.0, -53));
  Rng mid = engine_emitting({(std::uint64_t(12345) << 12) | 4095U});
  CHECK(effattn::uniform_open01(mid) == (12345.0 + 0.5) * std::ldexp(1.0, -52));
}

// Regression: an earlier transform, (top 53 bits + 1/2) 2^-53, returned exactly 1.0 for the
// all-ones engine output because 2^53 - 1/2 is not representable and rounds up to 2^53.
TEST_CASE("uniform_open01 never returns 1, even for the all-ones engine output", "[core][random]") {
  Rng ones = engine_emitting({~std::uint64_t(0)});
  const double v = effattn::uniform_open01(ones);
  CHECK(v < 1.0);
  CHECK(v == 1.0 - std::ldexp(1.0, -53));
}

TEST_CASE("uniform01 has the mean and variance of U(0, 1)", "[core][random]") {
  // U(0,1): mean 1/2, variance 1/12. With N = 10^6, the sample mean has standard error
  // sqrt(1/12 / N) = 2.9e-4 -> bound 1.5e-3 (~5 SE). The sample variance about 1/2 has standard
  // error sqrt(Var((U - 1/2)^2) / N) = sqrt((1/80 - 1/144) / N) = 7.5e-5 -> bound 4e-4 (~5 SE).
  Rng rng = effattn::make_rng(99, 4);
  const int N = 1000000;
  double s1 = 0, s2 = 0;
  for (int k = 0; k < N; ++k) {
    const double u = effattn::uniform01(rng);
    s1 += u;
    s2 += (u - 0.5) * (u - 0.5);
  }
  CHECK(std::abs(s1 / N - 0.5) < 1.5e-3);
  CHECK(std::abs(s2 / N - 1.0 / 12.0) < 4e-4);
}

TEST_CASE("uniform_index stays in 0 .. n-1 and rejects n <= 0", "[core][random][errors]") {
  Rng rng = effattn::make_rng(11, 0);
  const Index big = std::numeric_limits<Index>::max();
  for (Index n : {Index(1), Index(2), Index(3), Index(7), Index(1000), Index(1) << 40,
                  (Index(3) << 61), big}) {
    bool in_range = true;
    for (int k = 0; k < 20000; ++k) {
      const Index x = effattn::uniform_index(rng, n);
      in_range = in_range && x >= 0 && x < n;
    }
    INFO("n = " << n);
    CHECK(in_range);
  }
  for (int k = 0; k < 100; ++k) REQUIRE(effattn::uniform_index(rng, 1) == 0);
  for (Index n : {Index(0), Index(-1), std::numeric_limits<Index>::min()}) {
    INFO("n = " << n);
    const std::string w = invalid_argument_message([&] { (void)effattn::uniform_index(rng, n); });
    CHECK(contains(w, "uniform_index"));
  }
}

TEST_CASE("uniform_index is unbiased (chi-square) for n = 7 and n = 1000", "[core][random]") {
  // Pearson's statistic X^2 = sum (O - E)^2 / E is ~ chi^2 with n - 1 degrees of freedom for an
  // unbiased generator. Thresholds have upper-tail probability ~ 1e-7 (computed from the exact
  // chi^2 survival function): P(chi^2_6 > 40) = 4.6e-7 and P(chi^2_999 > 1250) ~ 1e-7, so a
  // correct implementation essentially never fails (the seed is fixed anyway), while a 1 % bias
  // in one of 7 buckets with E = 10^5 adds ~10 and a 5 % bias spread over 1000 buckets adds ~2500.
  struct Case {
    Index n;
    int draws;
    double threshold;
  };
  for (const Case c : {Case{7, 700000, 40.0}, Case{1000, 1000000, 1250.0}}) {
    Rng rng = effattn::make_rng(31337, static_cast<std::uint64_t>(c.n));
    std::vector<long> counts(static_cast<std::size_t>(c.n), 0);
    for (int k = 0; k < c.draws; ++k)
      ++counts[static_cast<std::size_t>(effattn::uniform_index(rng, c.n))];
    const double expected = static_cast<double>(c.draws) / static_cast<double>(c.n);
    double chi2 = 0;
    for (long o : counts)
      chi2 += (static_cast<double>(o) - expected) * (static_cast<double>(o) - expected) / expected;
    INFO("n = " << c.n << ", chi2 = " << chi2);
    CHECK(chi2 < c.threshold);
    // Not suspiciously good either: P(chi^2_6 < 0.1) ~ 1e-5, P(chi^2_999 < 800) ~ 5e-8.
    CHECK(chi2 > (c.n == 7 ? 0.1 : 800.0));
  }
}

TEST_CASE("uniform_index removes modulo bias for n close to 2^63", "[core][random]") {
  // n = 3 * 2^61: 2^64 = 2n + 2^62, so plain `rng() % n` would return values below 2^62 = (2/3) n
  // with probability 3/4 instead of 2/3. Over N = 10^5 draws the observed fraction has standard
  // error sqrt((2/3)(1/3) / N) = 1.5e-3; the bound 7.5e-3 is 5 SE, and the biased 3/4 is ~56 SE
  // away.
  const Index n = Index(3) << 61;
  const Index cut = Index(1) << 62;
  Rng rng = effattn::make_rng(77, 0);
  const int N = 100000;
  int below = 0;
  for (int k = 0; k < N; ++k) below += effattn::uniform_index(rng, n) < cut;
  CHECK(std::abs(static_cast<double>(below) / N - 2.0 / 3.0) < 7.5e-3);
}

TEST_CASE("uniform_index rejects exactly the low 2^64 mod n engine outputs", "[core][random]") {
  // n = 3 * 2^61: threshold 2^64 mod n = 2^62. Outputs below it are redrawn; others map by % n.
  const Index n = Index(3) << 61;
  const std::uint64_t t = std::uint64_t(1) << 62, un = static_cast<std::uint64_t>(n);
  {
    Rng rng = engine_emitting({0, t - 1, 5, t + 7});
    CHECK(effattn::uniform_index(rng, n) == static_cast<Index>(t + 7));
    Rng after = engine_emitting({0, t - 1, 5, t + 7});
    after.discard(4);
    CHECK(rng == after);  // exactly four outputs consumed
  }
  {
    const std::uint64_t top = ~std::uint64_t(0);  // 2^64 - 1 = 2n + 2^62 - 1 -> 2^62 - 1
    Rng rng = engine_emitting({top, t});
    CHECK(effattn::uniform_index(rng, n) == static_cast<Index>(top % un));
    CHECK(effattn::uniform_index(rng, n) == static_cast<Index>(t));
  }
  {
    // n = 7: 2^64 mod 7 = 2, so outputs 0 and 1 are rejected and 2 maps to 2.
    Rng rng = engine_emitting({1, 0, 2, 13});
    CHECK(effattn::uniform_index(rng, 7) == 2);
    CHECK(effattn::uniform_index(rng, 7) == 6);
  }
  {
    // Powers of two have threshold 0: nothing is rejected, not even output 0.
    Rng rng = engine_emitting({0, 1023});
    CHECK(effattn::uniform_index(rng, 1024) == 0);
    CHECK(effattn::uniform_index(rng, 1024) == 1023);
  }
}

// Regression: lo + (hi - lo) u is computed in double and rounded to the matrix scalar; for
// float every u > 1 - 2^-25 used to round to exactly hi = 1.0f, outside [lo, hi).
TEST_CASE("fill_uniform<float> never returns hi, even for u close to 1", "[core][random]") {
  Rng ones = engine_emitting({~std::uint64_t(0)});
  Matrix<float> x(1, 1);
  effattn::fill_uniform(x, ones);
  CHECK(x(0, 0) < 1.0f);
  CHECK(x(0, 0) == std::nextafter(1.0f, 0.0f));
}

TEST_CASE("standard_normal has the moments and CDF of N(0, 1)", "[core][random]") {
  // N = 10^6 draws. Standard errors: mean sqrt(1/N) = 1e-3; E[Z^2] sqrt(Var Z^2 / N) =
  // sqrt(2 / N) = 1.4e-3; E[Z^4] sqrt((E Z^8 - (E Z^4)^2) / N) = sqrt((105 - 9) / N) = 9.8e-3.
  // Bounds are 5 SE: 5e-3, 7e-3, 0.05. The CDF at x has standard error sqrt(p (1 - p) / N) <= 5e-4
  // -> bound 5 SE, compared with Phi(x) = erfc(-x / sqrt 2) / 2.
  Rng rng = effattn::make_rng(2718, 1);
  const int N = 1000000;
  const double xs[] = {-2.5, -1.0, 0.0, 0.5, 1.0, 1.96, 3.0};
  std::vector<int> below(std::size(xs), 0);
  double m1 = 0, m2 = 0, m4 = 0;
  for (int k = 0; k < N; ++k) {
    const double z = effattn::standard_normal(rng);
    m1 += z, m2 += z * z, m4 += z * z * z * z;
    for (std::size_t q = 0; q < std::size(xs); ++q) below[q] += z <= xs[q];
  }
  CHECK(std::abs(m1 / N) < 5e-3);
  CHECK(std::abs(m2 / N - 1.0) < 7e-3);
  CHECK(std::abs(m4 / N - 3.0) < 0.05);
  for (std::size_t q = 0; q < std::size(xs); ++q) {
    const double p = 0.5 * std::erfc(-xs[q] / std::sqrt(2.0));
    INFO("x = " << xs[q]);
    CHECK(std::abs(static_cast<double>(below[q]) / N - p) < 5 * std::sqrt(p * (1 - p) / N));
  }
}

TEST_CASE("standard_normal_pair gives two uncorrelated normals from two engine outputs",
          "[core][random]") {
  // Sample correlation of N = 10^5 independent pairs: SE 1/sqrt(N) = 3.2e-3 -> bound 0.016.
  Rng a = effattn::make_rng(3), b = a;
  double z0 = 0, z1 = 0;
  effattn::standard_normal_pair(a, z0, z1);
  b.discard(2);
  CHECK(a == b);
  (void)effattn::standard_normal(a);
  b.discard(2);
  CHECK(a == b);

  const int N = 100000;
  double s01 = 0, s00 = 0, s11 = 0;
  for (int k = 0; k < N; ++k) {
    effattn::standard_normal_pair(a, z0, z1);
    s01 += z0 * z1, s00 += z0 * z0, s11 += z1 * z1;
  }
  CHECK(std::abs(s01 / std::sqrt(s00 * s11)) < 0.016);
}

TEMPLATE_TEST_CASE("fill_normal: moments with mean / stddev, column-major pairs, blocks",
                   "[core][random]", float, double) {
  using S = TestType;
  SECTION("N(3, 0.5^2) moments") {
    // N = 4 * 10^5 entries. Mean SE = sigma / sqrt(N) = 7.9e-4 -> bound 4e-3 (5 SE). The sample
    // variance has SE sigma^2 sqrt(2 / N) = 5.6e-4 -> bound 2.8e-3. The standardised 4th moment has
    // SE ~ sqrt(96 / N) = 0.015 -> bound 0.08. Float rounding of the entries (relative 6e-8) is far
    // below these.
    Matrix<S> M(500, 800);
    Rng rng = effattn::make_rng(42, 9);
    effattn::fill_normal(M, rng, 3.0, 0.5);
    const Eigen::ArrayXXd x = M.template cast<double>().array();
    const double N = static_cast<double>(x.size());
    const double mean = x.mean();
    const double var = (x - mean).square().sum() / N;
    const double kurt = ((x - 3.0) / 0.5).square().square().sum() / N;
    CHECK(std::abs(mean - 3.0) < 4e-3);
    CHECK(std::abs(var - 0.25) < 2.8e-3);
    CHECK(std::abs(kurt - 3.0) < 0.08);
  }
  SECTION("entries are the Box-Muller pairs in column-major order") {
    // Odd sizes, so the last pair is split; a column vector with the same number of entries,
    // reshaped, must match bitwise.
    Rng a = effattn::make_rng(8), b = a, c = a;
    Matrix<S> M(37, 11);
    effattn::fill_normal(M, a, -1.0, 2.0);
    Vector<S> v(37 * 11);
    effattn::fill_normal(v, b, -1.0, 2.0);
    CHECK(et::bitwise_equal(M, Eigen::Map<const Matrix<S>>(v.data(), 37, 11)));
    // 407 entries = 204 pairs = 408 engine outputs.
    c.discard(408);
    CHECK(a == c);
    // First pair: (z0, z1) of standard_normal_pair, mapped by mean + stddev z.
    Rng d = effattn::make_rng(8);
    double z0 = 0, z1 = 0;
    effattn::standard_normal_pair(d, z0, z1);
    CHECK(M(0, 0) == static_cast<S>(-1.0 + 2.0 * z0));
    CHECK(M(1, 0) == static_cast<S>(-1.0 + 2.0 * z1));
  }
  SECTION("a block is filled in place, the rest untouched; random_normal matches fill_normal") {
    Matrix<S> M = Matrix<S>::Constant(6, 5, S(7));
    auto blk = M.block(1, 2, 4, 2);
    Rng a = effattn::make_rng(19);
    effattn::fill_normal(blk, a);
    CHECK((M.leftCols(2).array() == S(7)).all());
    CHECK((M.rightCols(1).array() == S(7)).all());
    CHECK((M.row(0).array() == S(7)).all());
    CHECK((M.row(5).array() == S(7)).all());
    CHECK((M.block(1, 2, 4, 2).array() != S(7)).all());

    Rng b = effattn::make_rng(19), c = effattn::make_rng(19);
    const Matrix<S> R = effattn::random_normal<S>(4, 2, b);
    Matrix<S> F(4, 2);
    effattn::fill_normal(F, c);
    CHECK(et::bitwise_equal(R, F));
    CHECK(et::bitwise_equal(R, M.block(1, 2, 4, 2)));
  }
}

TEMPLATE_TEST_CASE("fill_rademacher gives only +-1, balanced, 64 signs per engine output",
                   "[core][random]", float, double) {
  using S = TestType;
  // 1000 x 1001 entries (not a multiple of 64). The count of +1 is Binomial(N, 1/2): SE
  // sqrt(N) / 2 = 500 -> bound 2500 (5 SE). Each column is also roughly balanced: SE sqrt(1000)/2
  // = 16 per column, the bound 6 SE = 95 over 1001 columns (P(any exceeds) ~ 1001 * 2e-9).
  Matrix<S> M(1000, 1001);
  Rng rng = effattn::make_rng(5, 5);
  effattn::fill_rademacher(M, rng);
  CHECK((M.array().abs() == S(1)).all());
  const double N = static_cast<double>(M.size());
  const double plus = static_cast<double>((M.array() > S(0)).count());
  CHECK(std::abs(plus - N / 2) < 2500);
  double worst_col = 0;
  for (Index j = 0; j < M.cols(); ++j)
    worst_col = std::max(worst_col,
                         std::abs(static_cast<double>((M.col(j).array() > S(0)).count()) - 500.0));
  CHECK(worst_col < 95);

  // Entry k is +1 exactly when bit (k mod 64) of engine output k / 64 is set.
  Rng a = effattn::make_rng(6), b = a;
  Vector<S> v(65);
  effattn::fill_rademacher(v, a);
  const std::uint64_t r0 = b(), r1 = b();
  CHECK(a == b);
  bool bits_match = true;
  for (Index k = 0; k < 65; ++k) {
    const std::uint64_t r = k < 64 ? r0 : r1;
    const bool set = ((r >> (k & 63)) & 1U) != 0;
    bits_match = bits_match && (v(k) == (set ? S(1) : S(-1)));
  }
  CHECK(bits_match);
}

TEMPLATE_TEST_CASE("fill_uniform covers lo <= x < hi with the right mean", "[core][random]", float,
                   double) {
  using S = TestType;
  // U(-2, 3): mean 0.5, sd 5 / sqrt(12) = 1.44; N = 5 * 10^5 -> mean SE 2.0e-3, bound 0.01 (5 SE).
  Matrix<S> M(1000, 500);
  Rng rng = effattn::make_rng(1234, 2);
  effattn::fill_uniform(M, rng, -2.0, 3.0);
  CHECK(M.minCoeff() >= S(-2));
  CHECK(M.maxCoeff() < S(3));
  CHECK(M.minCoeff() < S(-1.99));
  CHECK(M.maxCoeff() > S(2.99));
  CHECK(std::abs(M.template cast<double>().mean() - 0.5) < 0.01);
  // Default range is [0, 1); entries are the engine's uniform01 values mapped affinely.
  Vector<S> v(1000);
  Rng a = effattn::make_rng(4), b = a;
  effattn::fill_uniform(v, a);
  CHECK(v.minCoeff() >= S(0));
  CHECK(v.maxCoeff() < S(1));
  bool match = true;
  for (Index k = 0; k < v.size(); ++k)
    match = match && v(k) == static_cast<S>(effattn::uniform01(b));
  CHECK(match);
  CHECK(a == b);
}

// =================================================================================================
// softmax
// =================================================================================================

TEST_CASE("logsumexp matches a long-double oracle for moderate values", "[core][softmax]") {
  Rng rng = effattn::make_rng(10);
  for (int trial = 0; trial < 20; ++trial) {
    const Index len = 1 + effattn::uniform_index(rng, 100);
    Eigen::VectorXd x(len);
    effattn::fill_uniform(x, rng, -30.0, 30.0);
    long double mx = x(0);
    for (Index k = 0; k < len; ++k) mx = std::max(mx, static_cast<long double>(x(k)));
    long double s = 0;
    for (Index k = 0; k < len; ++k) s += std::exp(static_cast<long double>(x(k)) - mx);
    const double oracle = static_cast<double>(mx + std::log(s));
    // Result = mx + log(sum): each term has relative error ~ len * eps; absolute 1e-13 * (1 +
    // |lse|) is generous for len <= 100.
    INFO("trial " << trial << ", len " << len);
    CHECK(std::abs(effattn::logsumexp(x) - oracle) < 1e-13 * (1 + std::abs(oracle)));
    // Float input: summed in double from the float values.
    const Eigen::VectorXf xf = x.cast<float>();
    long double sf = 0, mf = xf(0);
    for (Index k = 0; k < len; ++k) mf = std::max(mf, static_cast<long double>(xf(k)));
    for (Index k = 0; k < len; ++k) sf += std::exp(static_cast<long double>(xf(k)) - mf);
    const double oracle_f = static_cast<double>(mf + std::log(sf));
    CHECK(std::abs(effattn::logsumexp(xf) - oracle_f) < 1e-13 * (1 + std::abs(oracle_f)));
  }
  // Arrays, row vectors and a single element.
  Eigen::ArrayXd a(3);
  a << 0.0, std::log(2.0), std::log(5.0);
  CHECK(effattn::logsumexp(a) == Approx(std::log(8.0)).epsilon(1e-15));
  CHECK(effattn::logsumexp(a.matrix().transpose()) == Approx(std::log(8.0)).epsilon(1e-15));
  Eigen::VectorXd one(1);
  one << -3.25;
  CHECK(effattn::logsumexp(one) == -3.25);
}

TEST_CASE("logsumexp does not overflow or underflow and handles inf, NaN and empty input",
          "[core][softmax]") {
  auto vec = [](std::initializer_list<double> l) {
    Eigen::VectorXd v(static_cast<Index>(l.size()));
    Index k = 0;
    for (double x : l) v(k++) = x;
    return v;
  };
  // exp(1000) overflows and exp(-1000) underflows in double; the stable form does neither.
  CHECK(std::abs(effattn::logsumexp(vec({1000, 1000})) - (1000 + std::log(2.0))) < 1e-12);
  CHECK(std::abs(effattn::logsumexp(vec({-1000, -1000})) - (-1000 + std::log(2.0))) < 1e-12);
  CHECK(std::abs(effattn::logsumexp(vec({1e5, 1e5, 1e5})) - (1e5 + std::log(3.0))) < 1e-10);
  CHECK(effattn::logsumexp(vec({1000, 0})) == 1000.0);  // 1000 + log1p(e^-1000) rounds to 1000
  Eigen::VectorXf f(2);
  f << 100.0f, 100.0f;  // exp(100) overflows float
  CHECK(std::abs(effattn::logsumexp(f) - (100 + std::log(2.0))) < 1e-12);

  CHECK(effattn::logsumexp(vec({-kInf, -kInf})) == -kInf);
  CHECK(effattn::logsumexp(vec({1.0, kInf, 2.0})) == kInf);
  CHECK(effattn::logsumexp(vec({-kInf, kInf})) == kInf);
  CHECK(std::isnan(effattn::logsumexp(vec({1.0, kNaN, 2.0}))));
  CHECK(std::isnan(effattn::logsumexp(vec({kNaN}))));
  CHECK(std::isnan(effattn::logsumexp(vec({kInf, kNaN}))));
  CHECK(effattn::logsumexp(Eigen::VectorXd(0)) == -kInf);
  // -inf entries are masked: they contribute nothing.
  CHECK(effattn::logsumexp(vec({-kInf, 0.0, -kInf, 0.0})) == Approx(std::log(2.0)).epsilon(1e-15));
}

TEMPLATE_TEST_CASE("row_softmax matches a long-double oracle, rows sum to 1, lse matches",
                   "[core][softmax]", float, double) {
  using S = TestType;
  const double eps = et::eps<S>();
  Rng rng = effattn::make_rng(21);
  Matrix<S> L(13, 37);
  effattn::fill_normal(L, rng, 0.0, 3.0);
  const Matrix<S> P = effattn::row_softmax(L);
  Matrix<S> Pin = L;
  const Vector<S> lse = effattn::row_softmax_inplace(Pin);
  // row_softmax is row_softmax_inplace on a copy: identical bits.
  CHECK(et::bitwise_equal(P, Pin));
  // Error budget: the shift x - max and exp each cost a few ulps relative to p, plus |x - max| eps
  // from the shift's rounding (|x - max| < 25 here, and p |x - max| <= max_y y e^-y-ish terms stay
  // O(1)); 16 eps absolute is ample. The lse is max + log(sum), relative error a few eps.
  double worst_p = 0, worst_lse = 0, worst_sum = 0;
  for (Index i = 0; i < L.rows(); ++i) {
    const RowOracle o = softmax_oracle_row(L, i);
    double rowsum = 0;
    for (Index j = 0; j < L.cols(); ++j) {
      worst_p = std::max(worst_p, std::abs(static_cast<double>(P(i, j)) -
                                           static_cast<double>(o.p[static_cast<std::size_t>(j)])));
      rowsum += static_cast<double>(P(i, j));
    }
    worst_sum = std::max(worst_sum, std::abs(rowsum - 1.0));
    worst_lse =
        std::max(worst_lse, std::abs(static_cast<double>(lse(i)) - static_cast<double>(o.lse)) /
                                (1 + std::abs(static_cast<double>(o.lse))));
  }
  INFO("worst |p - oracle| = " << worst_p << ", worst rel lse = " << worst_lse
                               << ", worst |sum - 1| = " << worst_sum);
  CHECK(worst_p < 16 * eps);
  CHECK(worst_lse < 4 * eps);
  CHECK(worst_sum < 37 * 2 * eps);
  CHECK((P.array() >= S(0)).all());
}

TEMPLATE_TEST_CASE("row_softmax is invariant to a per-row shift", "[core][softmax]", float,
                   double) {
  using S = TestType;
  // Logits on the 2^-10 grid with |x| < 16 and integer shifts < 2^12: x + c and (x + c) -
  // max(x + c) are exact in float and double, so the shifted softmax must be bitwise identical;
  // the returned lse shifts by exactly c up to the rounding of lse itself.
  Rng rng = effattn::make_rng(22);
  Matrix<S> L(9, 41), Ls(9, 41);
  Vector<S> c(9);
  for (Index i = 0; i < 9; ++i) c(i) = static_cast<S>(static_cast<double>(i * 457) - 1800.0);
  for (Index j = 0; j < 41; ++j)
    for (Index i = 0; i < 9; ++i) {
      const double x = std::round(std::ldexp(effattn::uniform01(rng) * 30.0 - 15.0, 10)) / 1024.0;
      L(i, j) = static_cast<S>(x);
      Ls(i, j) = static_cast<S>(x + static_cast<double>(c(i)));
    }
  Matrix<S> P = L, Ps = Ls;
  const Vector<S> lse = effattn::row_softmax_inplace(P);
  const Vector<S> lses = effattn::row_softmax_inplace(Ps);
  CHECK(et::bitwise_equal(P, Ps));
  for (Index i = 0; i < 9; ++i) {
    INFO("row " << i);
    CHECK(std::abs(static_cast<double>(lses(i)) - static_cast<double>(lse(i)) -
                   static_cast<double>(c(i))) <=
          2 * et::eps<S>() * (std::abs(static_cast<double>(lses(i))) + 16));
  }
}

TEMPLATE_TEST_CASE("row_softmax does not overflow for huge logits", "[core][softmax]", float,
                   double) {
  using S = TestType;
  // Magnitudes 80 / 700 (close to the float / double exp limits 88.7 / 709.8) and far beyond
  // (1000 / 1e5), where a naive exp overflows to inf (or underflows to 0 -> 0/0 = NaN).
  const bool is_float = std::is_same<S, float>::value;
  for (double mag : {is_float ? 80.0 : 700.0, is_float ? 1000.0 : 1e5}) {
    Matrix<S> L(3, 6);
    L << S(1.0 * mag), S(1.0 * mag - 1), S(1.0 * mag - 2), S(-mag), S(0), S(1.0 * mag - 0.5),  //
        S(-mag), S(-mag + 1), S(-mag + 3), S(-mag), S(-mag + 0.25), S(-mag + 2),               //
        S(mag), S(-mag), S(mag), S(-mag), S(mag), S(-mag);
    Matrix<S> P = L;
    const Vector<S> lse = effattn::row_softmax_inplace(P);
    INFO("magnitude " << mag);
    REQUIRE(P.allFinite());
    REQUIRE(lse.allFinite());
    for (Index i = 0; i < L.rows(); ++i) {
      const RowOracle o = softmax_oracle_row(L, i);
      for (Index j = 0; j < L.cols(); ++j)
        CHECK(std::abs(static_cast<double>(P(i, j)) -
                       static_cast<double>(o.p[static_cast<std::size_t>(j)])) < 8 * et::eps<S>());
      CHECK(std::abs(static_cast<double>(lse(i)) - static_cast<double>(o.lse)) <
            4 * et::eps<S>() * std::abs(static_cast<double>(o.lse)));
    }
    // Row 2 is exactly three equal winners: 1/3 each.
    CHECK(std::abs(static_cast<double>(P(2, 0)) - 1.0 / 3.0) < 2 * et::eps<S>());
    // exp(-2 mag) underflows: zero up to the smallest normal (Eigen's vectorised exp clamps).
    CHECK(std::abs(static_cast<double>(P(2, 1))) <=
          static_cast<double>(std::numeric_limits<S>::min()));
  }
}

namespace {
/// 40 rows (enough for every SIMD width to take Eigen's vectorised path over a column) cycling
/// through four masking patterns: some -inf entries, all -inf, some -inf, a single finite entry.
template <typename S>
Matrix<S> masked_logits() {
  const S ninf = -std::numeric_limits<S>::infinity();
  Matrix<S> pattern(4, 5);
  pattern << S(1), ninf, S(2), ninf, S(0.5),  //
      ninf, ninf, ninf, ninf, ninf,           //
      S(-3), S(4), ninf, S(0), S(1),          //
      ninf, ninf, S(7), ninf, ninf;
  Matrix<S> L(40, 5);
  for (Index i = 0; i < 40; ++i) L.row(i) = pattern.row(i % 4);
  return L;
}

/// The softmax helpers applied to masked_logits(), computed once for both tests below.
template <typename S>
struct MaskedResults {
  Matrix<S> L, P;
  Vector<S> lse, lse2, mx;
};

template <typename S>
MaskedResults<S> masked_results() {
  MaskedResults<S> r;
  r.L = masked_logits<S>();
  r.P = r.L;
  r.lse = effattn::row_softmax_inplace(r.P);
  r.lse2 = effattn::row_logsumexp(r.L);
  r.mx = effattn::row_max(r.L);
  return r;
}
}  // namespace

TEMPLATE_TEST_CASE("row_softmax: masked (-inf) entries get no mass, visible entries match oracle",
                   "[core][softmax]", float, double) {
  using S = TestType;
  const MaskedResults<S> r = masked_results<S>();
  const Matrix<S>& L = r.L;
  const Matrix<S>& P = r.P;
  const Vector<S>&lse = r.lse, &lse2 = r.lse2, &mx = r.mx;
  // Masked entries: no mass (exact zeros are checked in the next test case).
  const double tiny = static_cast<double>(std::numeric_limits<S>::min());
  for (Index i = 0; i < L.rows(); ++i) {
    INFO("row " << i);
    if (i % 4 == 1) {
      CHECK(mx(i) == -std::numeric_limits<S>::infinity());
      continue;  // all masked: see the next test case
    }
    for (Index j = 0; j < L.cols(); ++j)
      if (std::isinf(L(i, j))) CHECK(std::abs(static_cast<double>(P(i, j))) <= tiny);
    const RowOracle o = softmax_oracle_row(L, i);
    double sum = 0;
    for (Index j = 0; j < L.cols(); ++j) {
      sum += static_cast<double>(P(i, j));
      CHECK(std::abs(static_cast<double>(P(i, j)) -
                     static_cast<double>(o.p[static_cast<std::size_t>(j)])) < 8 * et::eps<S>());
    }
    CHECK(std::abs(sum - 1.0) < 8 * et::eps<S>());
    const double lse_tol = 4 * et::eps<S>() * (1 + std::abs(static_cast<double>(o.lse)));
    CHECK(std::abs(static_cast<double>(lse(i)) - static_cast<double>(o.lse)) < lse_tol);
    CHECK(std::abs(static_cast<double>(lse2(i)) - static_cast<double>(o.lse)) < lse_tol);
    S m = -std::numeric_limits<S>::infinity();
    for (Index j = 0; j < L.cols(); ++j) m = std::max(m, L(i, j));
    CHECK(mx(i) == m);
  }
  // A single visible key gets all the mass.
  CHECK(std::abs(static_cast<double>(P(3, 2)) - 1.0) <= et::eps<S>());
  CHECK(std::abs(static_cast<double>(lse(3)) - 7.0) <= 8 * et::eps<S>());
}

// Regression: Eigen 3.4's vectorised exp (pexp_float / pexp_double) clamps its argument to
// >= -88.72 / -709.78, so exp(-inf) is ~1.2e-38 / ~2.2e-308 in SIMD packets. Before softmax.hpp
// masked explicitly, masked entries came out tiny but non-zero and an all -inf row of m entries
// came out uniform (1 / m) with lse ~ -708.7 instead of zeros and -inf.
TEMPLATE_TEST_CASE("row_softmax: -inf entries get exactly 0, all -inf rows give 0 and lse -inf",
                   "[core][softmax]", float, double) {
  using S = TestType;
  const S ninf = -std::numeric_limits<S>::infinity();
  const MaskedResults<S> r = masked_results<S>();
  const Matrix<S>& L = r.L;
  const Matrix<S>& P = r.P;
  const Vector<S>&lse = r.lse, &lse2 = r.lse2;
  Index nonzero_masked = 0, bad_rows = 0;
  for (Index i = 0; i < L.rows(); ++i) {
    for (Index j = 0; j < L.cols(); ++j) nonzero_masked += std::isinf(L(i, j)) && P(i, j) != S(0);
    if (i % 4 == 1)
      bad_rows += !((P.row(i).array() == S(0)).all() && lse(i) == ninf && lse2(i) == ninf);
  }
  CHECK(nonzero_masked == 0);
  CHECK(bad_rows == 0);
  INFO("all -inf row: P(1, 0) = " << P(1, 0) << ", lse = " << lse(1)
                                  << ", row_logsumexp = " << lse2(1));
  CHECK((P.row(1).array() == S(0)).all());
  CHECK(lse(1) == ninf);
  CHECK(lse2(1) == ninf);
}

TEMPLATE_TEST_CASE("row_softmax_inplace on a block touches only the block", "[core][softmax]",
                   float, double) {
  using S = TestType;
  Rng rng = effattn::make_rng(23);
  Matrix<S> M(6, 10);
  effattn::fill_normal(M, rng);
  const Matrix<S> before = M;
  auto blk = M.middleCols(3, 4);
  const Vector<S> lse = effattn::row_softmax_inplace(blk);
  CHECK(et::bitwise_equal(M.leftCols(3), before.leftCols(3)));
  CHECK(et::bitwise_equal(M.rightCols(3), before.rightCols(3)));
  const Matrix<S> sub = before.middleCols(3, 4);
  for (Index i = 0; i < 6; ++i) {
    const RowOracle o = softmax_oracle_row(sub, i);
    for (Index j = 0; j < 4; ++j)
      CHECK(std::abs(static_cast<double>(M(i, 3 + j)) -
                     static_cast<double>(o.p[static_cast<std::size_t>(j)])) < 8 * et::eps<S>());
    CHECK(std::abs(static_cast<double>(lse(i)) - static_cast<double>(o.lse)) <
          8 * et::eps<S>() * (1 + std::abs(static_cast<double>(o.lse))));
  }
}

TEMPLATE_TEST_CASE("row_max and row_logsumexp match loop oracles", "[core][softmax]", float,
                   double) {
  using S = TestType;
  Rng rng = effattn::make_rng(24);
  Matrix<S> L(17, 29);
  effattn::fill_normal(L, rng, 0.0, 10.0);
  L(4, 0) = S(600);  // beyond float's exp range: must still be exact / stable
  L(5, 28) = S(-600);
  const Vector<S> mx = effattn::row_max(L);
  const Vector<S> lse = effattn::row_logsumexp(L);
  Matrix<S> P = L;
  const Vector<S> lse_sm = effattn::row_softmax_inplace(P);
  REQUIRE(mx.size() == 17);
  REQUIRE(lse.size() == 17);
  for (Index i = 0; i < L.rows(); ++i) {
    S m = L(i, 0);
    for (Index j = 1; j < L.cols(); ++j) m = std::max(m, L(i, j));
    CHECK(mx(i) == m);
    const RowOracle o = softmax_oracle_row(L, i);
    CHECK(std::abs(static_cast<double>(lse(i)) - static_cast<double>(o.lse)) <
          4 * et::eps<S>() * (1 + std::abs(static_cast<double>(o.lse))));
    // The two lse routines use the same formula; they agree to round-off.
    CHECK(std::abs(static_cast<double>(lse(i)) - static_cast<double>(lse_sm(i))) <
          4 * et::eps<S>() * (1 + std::abs(static_cast<double>(o.lse))));
  }
  // lse >= max and lse <= max + log(cols) always.
  CHECK(((lse - mx).array() >= S(0)).all());
  CHECK(((lse - mx).array() <= static_cast<S>(std::log(29.0) * (1 + 1e-6))).all());
}

// =================================================================================================
// parallel
// =================================================================================================

TEST_CASE("max_threads is at least 1 and follows OpenMP's setting", "[core]") {
  CHECK(effattn::max_threads() >= 1);
  if (et::has_openmp() && EFFATTN_HAS_OPENMP) {
    CHECK(et::with_threads(3, [] { return effattn::max_threads(); }) == 3);
    CHECK(et::with_threads(1, [] { return effattn::max_threads(); }) == 1);
  } else {
    CHECK(effattn::max_threads() == 1);
  }
}

TEST_CASE("parallel_for runs every task exactly once, one workspace per thread at most", "[core]") {
  for (int threads : {1, 2, 4}) {
    for (Index count : {Index(1), Index(3), Index(1000)}) {
      std::vector<int> visits(static_cast<std::size_t>(count), 0);
      std::atomic<int> workspaces{0};
      std::atomic<long> tasks_seen_by_workspaces{0};
      struct Workspace {
        std::atomic<long>* total;
        long tasks = 0;
        Workspace(std::atomic<long>* t) : total(t) {}
        Workspace(Workspace&& o) noexcept : total(o.total), tasks(o.tasks) { o.total = nullptr; }
        Workspace(const Workspace&) = delete;
        ~Workspace() {
          if (total) *total += tasks;
        }
      };
      int limit = 0;
      et::with_threads(threads, [&] {
        limit = effattn::max_threads();
        effattn::detail::parallel_for(
            count,
            [&] {
              ++workspaces;
              return Workspace(&tasks_seen_by_workspaces);
            },
            [&](Index t, Workspace& ws) {
              ++visits[static_cast<std::size_t>(t)];  // distinct tasks write distinct elements
              ++ws.tasks;
            });
        return 0;
      });
      INFO("threads " << threads << ", count " << count);
      CHECK(std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; }));
      CHECK(workspaces.load() >= 1);
      CHECK(workspaces.load() <= limit);
      // Every task ran with one of the workspaces (and the workspaces were destroyed afterwards).
      CHECK(tasks_seen_by_workspaces.load() == count);
      if (threads == 1) CHECK(workspaces.load() == 1);
    }
  }
}

TEST_CASE("parallel_for propagates exceptions from tasks and from make_workspace", "[core]") {
  for (int threads : {1, 4}) {
    INFO("threads " << threads);
    std::atomic<int> ran{0};
    auto make_ws = [] { return 0; };
    CHECK_THROWS_AS(et::with_threads(threads,
                                     [&] {
                                       effattn::detail::parallel_for(
                                           100, make_ws, [&](Index t, int&) {
                                             ++ran;
                                             if (t == 17)
                                               throw effattn::invalid_argument("task 17");
                                           });
                                       return 0;
                                     }),
                    effattn::invalid_argument);
    CHECK(ran.load() >= 1);
    // Several throwing tasks: exactly one exception comes out (no std::terminate), of the type
    // thrown.
    CHECK_THROWS_AS(et::with_threads(threads,
                                     [&] {
                                       effattn::detail::parallel_for(
                                           64, make_ws, [](Index t, int&) {
                                             if (t % 3 == 0) throw std::out_of_range("many");
                                           });
                                       return 0;
                                     }),
                    std::out_of_range);
    CHECK_THROWS_WITH(
        et::with_threads(threads,
                         [&] {
                           effattn::detail::parallel_for(
                               8, []() -> int { throw std::runtime_error("no workspace"); },
                               [](Index, int&) {});
                           return 0;
                         }),
        "no workspace");
  }
}

TEST_CASE("parallel_for with count <= 0 does nothing", "[core]") {
  for (Index count : {Index(0), Index(-5)}) {
    int calls = 0, workspaces = 0;
    CHECK_NOTHROW(effattn::detail::parallel_for(
        count, [&] { return ++workspaces; }, [&](Index, int&) { ++calls; }));
    CHECK(calls == 0);
    CHECK(workspaces == 0);
  }
}

namespace {
// gemm's C (=, +=, -=) alpha op(A) op(B) for one (OA, OB, update) combination, with C starting as
// C0.
template <effattn::detail::Op OA, effattn::detail::Op OB, int U, typename Scalar>
Matrix<Scalar> run_gemm(const Matrix<Scalar>& C0, const Matrix<Scalar>& A, const Matrix<Scalar>& B,
                        Scalar alpha) {
  Matrix<Scalar> C = C0;
  effattn::detail::gemm<OA, OB>(effattn::detail::UpdateKind<U>{}, C, A, B, alpha);
  return C;
}
}  // namespace

TEMPLATE_TEST_CASE("gemm matches a long-double oracle and is bit-identical for 1, 2 and 3 threads",
                   "[core][gemm]", float, double) {
  using effattn::detail::Op;
  using S = TestType;
  using LD = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
  // (rows, cols, depth): column panels, row panels, one panel inside a region, Eigen's serial
  // sizes. Depths of 700 and 1000 exceed Eigen's depth blocking on every cache size, where its own
  // multithreaded GEMM splits the sum differently for one and two threads.
  const Index shapes[][3] = {{300, 300, 1000}, {520, 40, 1000}, {90, 90, 700}, {20, 30, 10}};
  std::uint64_t seed = 5;
  for (const auto& sh : shapes) {
    const Index r = sh[0], c = sh[1], k = sh[2];
    auto check = [&](auto oa, auto ob, auto u) {
      constexpr Op OA = decltype(oa)::value, OB = decltype(ob)::value;
      constexpr int U = decltype(u)::value;
      const Matrix<S> A = et::randn<S>(OA == Op::N ? r : k, OA == Op::N ? k : r, ++seed);
      const Matrix<S> B = et::randn<S>(OB == Op::N ? k : c, OB == Op::N ? c : k, ++seed);
      const Matrix<S> C0 = et::randn<S>(r, c, ++seed);
      const S alpha = S(0.75);
      INFO("rows " << r << " cols " << c << " depth " << k << " OA " << int(OA) << " OB " << int(OB)
                   << " update " << U);
      const Matrix<S> C1 =
          et::with_threads(1, [&] { return run_gemm<OA, OB, U>(C0, A, B, alpha); });
      const Matrix<S> C2 =
          et::with_threads(2, [&] { return run_gemm<OA, OB, U>(C0, A, B, alpha); });
      const Matrix<S> C3 =
          et::with_threads(3, [&] { return run_gemm<OA, OB, U>(C0, A, B, alpha); });
      CHECK(et::bitwise_equal(C1, C2));
      CHECK(et::bitwise_equal(C1, C3));
      // Oracle in long double, and the worst-case bound of any summation order:
      // |error| <= (k + 2) eps (|alpha| (|op(A)| |op(B)|) + |C0|) entrywise.
      const LD a = OA == Op::N ? LD(A.template cast<long double>())
                               : LD(A.transpose().template cast<long double>());
      const LD b = OB == Op::N ? LD(B.template cast<long double>())
                               : LD(B.transpose().template cast<long double>());
      const LD p = static_cast<long double>(alpha) * (a * b);
      const LD c0 = C0.template cast<long double>();
      const LD ref = U == 0 ? p : U == 1 ? LD(c0 + p) : LD(c0 - p);
      const LD bound = static_cast<long double>(static_cast<double>(k + 2) * et::eps<S>()) *
                       (std::abs(static_cast<long double>(alpha)) * (a.cwiseAbs() * b.cwiseAbs()) +
                        (U == 0 ? LD(LD::Zero(r, c)) : LD(c0.cwiseAbs())));
      const LD err = (C1.template cast<long double>() - ref).cwiseAbs();
      CHECK((err.array() <= bound.array()).all());
      // Inside a parallel region gemm is Eigen's product written inline, bit for bit.
      Matrix<S> inline_eigen = C0, in_region = C0;
      effattn::detail::parallel_for(
          1, [] { return 0; },
          [&](Index, int) {
            const auto opa = [&]() -> decltype(auto) {
              if constexpr (OA == Op::N)
                return (A);
              else
                return A.transpose();
            };
            const auto opb = [&]() -> decltype(auto) {
              if constexpr (OB == Op::N)
                return (B);
              else
                return B.transpose();
            };
            if constexpr (U == 0) inline_eigen.noalias() = alpha * opa() * opb();
            if constexpr (U == 1) inline_eigen.noalias() += alpha * opa() * opb();
            if constexpr (U == 2) inline_eigen.noalias() -= alpha * opa() * opb();
            effattn::detail::gemm<OA, OB>(effattn::detail::UpdateKind<U>{}, in_region, A, B, alpha);
          });
      CHECK(et::bitwise_equal(inline_eigen, in_region));
    };
    using N = std::integral_constant<Op, Op::N>;
    using T = std::integral_constant<Op, Op::T>;
    check(N{}, N{}, std::integral_constant<int, 0>{});
    check(N{}, T{}, std::integral_constant<int, 1>{});
    check(T{}, N{}, std::integral_constant<int, 2>{});
    check(T{}, T{}, std::integral_constant<int, 0>{});
  }
  if (!et::has_openmp() || !EFFATTN_HAS_OPENMP)
    WARN("SKIP thread invariance: built without OpenMP, one thread only (the oracle checks ran)");
}
