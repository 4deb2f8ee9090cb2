// The conformance suite (tests/conformance.hpp) applied to every method, float and double.
// Method issues add their functors here.
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
