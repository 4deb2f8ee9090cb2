// The conformance suite (tests/conformance.hpp) applied to every method of the method list
// (effattn/methods.hpp) at its default options, float and double, plus the exact kernels at
// tight tolerances with non-default tiles.
#include <effattn/methods.hpp>

#include <array>
#include <iterator>

#include "conformance.hpp"

using namespace effattn;
using effattn::testing::all_entries_name;
using effattn::testing::check_conformance;
using effattn::testing::conformance_report;
using effattn::testing::ConformanceCheck;
using effattn::testing::ConformanceConfig;
using effattn::testing::expected_skip;
using effattn::testing::ExpectedSkip;
using effattn::testing::SkipLedger;
using effattn::testing::type_key;

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

// Fractions of the uniform-attention baseline's error for the approximations at their defaults,
// per workload: min(1.5 f, (1 + f) / 2) of the measured max fraction f over both shapes and both
// scalars (EFFATTN_TEST_VERBOSE=1 prints f). kNoTolerance: the method at its defaults is measured
// no better than uniform attention on that workload (f >= 0.95), so no tolerance can tell it from
// the baseline; the skip is listed, with the measured f, in default_skips below. Measured f:
//   Conv-Basis (k = 16): positional 0.49 (the others: see default_skips);
//   EVA: positional 0.39, sphere 0.90;
//   Performer (64 features): clustered 0.70;
//   KEP-SVGP (s = 10): clustered 0.46, gaussian 0.82, needles 0.63, positional 0.41, sphere 0.75;
//   VCC and WildCat: exact on the square shape at these sizes (default budget >= n, rank 256 >=
//     m); WildCat on m = 300: clustered 0.0072, gaussian 0.078, needles 0.082, positional 0.014,
//     sphere 0.010. VCC is held to round-off (2e-5 of the baseline, about 1e-6 absolute).
// The order of a Fractions table is the workload order: gaussian, sphere, clustered, positional,
// needles.
using Fractions = std::array<double, 5>;
constexpr double kNoTolerance = -1;
static_assert(static_cast<int>(workloads::Kind::Gaussian) == 0 &&
                  static_cast<int>(workloads::Kind::Sphere) == 1 &&
                  static_cast<int>(workloads::Kind::Clustered) == 2 &&
                  static_cast<int>(workloads::Kind::Positional) == 3 &&
                  static_cast<int>(workloads::Kind::Needles) == 4,
              "workload order of the Fractions tables");

template <typename S>
struct DefaultTolerance<ConvBasisAttention<S>> {
  static constexpr Fractions fraction = {kNoTolerance, kNoTolerance, kNoTolerance, 0.74,
                                         kNoTolerance};
};
template <typename S>
struct DefaultTolerance<EvaAttention<S>> {
  static constexpr Fractions fraction = {kNoTolerance, 0.951, kNoTolerance, 0.59, kNoTolerance};
};
template <typename S>
struct DefaultTolerance<PerformerAttention<S>> {
  static constexpr Fractions fraction = {kNoTolerance, kNoTolerance, 0.851, kNoTolerance,
                                         kNoTolerance};
};
template <typename S>
struct DefaultTolerance<KepSvgpAttention<S>> {
  static constexpr Fractions fraction = {0.91, 0.877, 0.69, 0.61, 0.815};
};
template <typename S>
struct DefaultTolerance<VccAttention<S>> {
  static constexpr Fractions fraction = {2e-5, 2e-5, 2e-5, 2e-5, 2e-5};
};
template <typename S>
struct DefaultTolerance<WildcatAttention<S>> {
  static constexpr Fractions fraction = {0.117, 0.015, 0.011, 0.021, 0.123};
};

// The checks the default-options suite skips, with the measured fraction f of the uniform
// baseline's error (max over both shapes and both scalars): every kNoTolerance above, and the
// cross-attention shape of the self-attention-only methods (run as m x m instead).
template <typename S>
constexpr ExpectedSkip<ConformanceCheck> default_skips[] = {
    expected_skip<ConvBasisAttention<S>>(ConformanceCheck::cross_attention(),
                                         "self-attention only (K must have n rows)"),
    expected_skip<ConvBasisAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Gaussian),
                                         "f = 1.25 at k = 16: no Toeplitz structure in the logits"),
    expected_skip<ConvBasisAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Sphere),
                                         "f = 1.30 at k = 16: no Toeplitz structure in the logits"),
    expected_skip<ConvBasisAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Clustered),
                                         "f = 1.64 at k = 16: no Toeplitz structure in the logits"),
    expected_skip<ConvBasisAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Needles),
                                         "f = 1.19 at k = 16: no Toeplitz structure in the logits"),
    expected_skip<VccAttention<S>>(ConformanceCheck::cross_attention(),
                                   "self-attention only (VIP rows index both Q and K)"),
    expected_skip<EvaAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Gaussian),
                                   "f = 0.995: its chunks mix unrelated keys"),
    expected_skip<EvaAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Clustered),
                                   "f = 1.40: its chunks mix unrelated keys"),
    expected_skip<EvaAttention<S>>(ConformanceCheck::accuracy(workloads::Kind::Needles),
                                   "f = 1.04: its chunks mix unrelated keys"),
    expected_skip<PerformerAttention<S>>(
        ConformanceCheck::accuracy(workloads::Kind::Gaussian),
        "f = 2.78: 64 random features are too few for d = 16..32 at these scales"),
    expected_skip<PerformerAttention<S>>(
        ConformanceCheck::accuracy(workloads::Kind::Sphere),
        "f = 1.61: 64 random features are too few for d = 16..32 at these scales"),
    expected_skip<PerformerAttention<S>>(
        ConformanceCheck::accuracy(workloads::Kind::Positional),
        "f = 1.55: 64 random features are too few for d = 16..32 at these scales"),
    expected_skip<PerformerAttention<S>>(
        ConformanceCheck::accuracy(workloads::Kind::Needles),
        "f = 1.69: 64 random features are too few for d = 16..32 at these scales"),
};

template <typename F>
ConformanceConfig default_config() {
  using T = functor_traits<F>;
  using S = typename F::Scalar;
  ConformanceConfig cfg;
  cfg.name = std::string(T::name) + " (defaults)";
  cfg.causal = T::causal_only;
  cfg.self_attention_only = T::self_attention_only;
  if constexpr (T::exact) {
    cfg.tolerance = [](workloads::Kind k) { return DefaultTolerance<F>::round_off(k); };
  } else {
    cfg.baseline_fraction = [](workloads::Kind k) {
      return DefaultTolerance<F>::fraction[static_cast<std::size_t>(k)];
    };
  }
  cfg.method = type_key<F>();
  cfg.expected_skips.assign(std::begin(default_skips<S>), std::end(default_skips<S>));
  return cfg;
}

}  // namespace

TEMPLATE_TEST_CASE("Every method conforms at its default options", "[conformance][defaults][skips]",
                   float, double) {
  int index = 0;
  for_each_method<TestType>([&](auto tag) {
    using F = typename decltype(tag)::type;
    STATIC_REQUIRE(is_attention_functor_v<F>);
    DYNAMIC_SECTION(index << ": " << functor_traits<F>::name) {
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

TEMPLATE_TEST_CASE("The expected skips name functors of the method list, once per check",
                   "[conformance][skips]", float, double) {
  // An entry for a functor outside the list would escape the per-functor check that every entry
  // is used.
  CHECK(all_entries_name(MethodList<TestType>{}, default_skips<TestType>));
  const auto& table = default_skips<TestType>;
  for (std::size_t i = 0; i < std::size(table); ++i)
    for (std::size_t j = 0; j < i; ++j) {
      INFO(table[i].method_name << ": " << table[i].where);
      CHECK_FALSE((table[i].method == table[j].method && table[i].where == table[j].where));
    }
}

TEST_CASE("The skip ledger finds unlisted skips and unused entries", "[conformance][skips]") {
  using F = ExactAttention<double>;
  using G = WildcatAttention<double>;
  const auto gaussian = ConformanceCheck::accuracy(workloads::Kind::Gaussian);
  const auto sphere = ConformanceCheck::accuracy(workloads::Kind::Sphere);
  const ExpectedSkip<ConformanceCheck> table[] = {
      expected_skip<F>(gaussian, "first"), expected_skip<F>(sphere, "second"),
      expected_skip<G>(ConformanceCheck::cross_attention(), "third")};
  SkipLedger<ConformanceCheck> all(table);
  CHECK(all.unused().size() == 3);
  CHECK(all.record(type_key<F>(), gaussian) == table[0].reason);
  CHECK(all.record(type_key<F>(), gaussian) == table[0].reason);  // both shapes
  CHECK(all.record(type_key<G>(), gaussian) == nullptr);          // listed for F only
  CHECK(all.record(type_key<F>(), ConformanceCheck::accuracy(workloads::Kind::Needles)) == nullptr);
  CHECK(all.record(type_key<F>(), ConformanceCheck::cross_attention()) == nullptr);
  CHECK(all.record(type_key<G>(), ConformanceCheck::cross_attention()) == table[2].reason);
  REQUIRE(all.unused().size() == 1);
  CHECK(all.unused()[0].where == sphere);
  CHECK(all.unused()[0].method == type_key<F>());
  // One functor's entries only.
  SkipLedger<ConformanceCheck> only_g(table, type_key<G>());
  CHECK(only_g.unused().size() == 1);
  CHECK(only_g.record(type_key<F>(), gaussian) == nullptr);
  CHECK(type_key<F>() != type_key<ExactAttention<float>>());
}
