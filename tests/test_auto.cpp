// Tests of AutoAttention (effattn/auto.hpp) and of the sampled-row probe (core/probe.hpp).
// Oracles: ExactAttention<double, Naive> and the long-double loop of test_utils.hpp. The choice
// itself is checked through what it must guarantee: the output meets the target against exact
// attention whenever an approximation is chosen, exact attention's bits otherwise, the probe
// budget, determinism and the functor concept.
#include <catch2/catch.hpp>

#include <effattn/auto.hpp>
#include <effattn/eva.hpp>
#include <effattn/multi_head.hpp>
#include <effattn/workloads.hpp>

#include <set>
#include <string>

#include "conformance.hpp"
#include "test_utils.hpp"

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::rel_fro_error;
using effattn::testing::require_invalid_argument;

static_assert(is_attention_functor_v<AutoAttention<float>>);
static_assert(is_attention_functor_v<AutoAttention<double>>);

namespace {

template <typename Scalar>
Matrix<double> exact_ref(const workloads::Workload<Scalar>& w, bool causal) {
  ExactOptions o;
  o.causal = causal;
  return ExactAttention<double, policy::Naive>(o)
      .compute(w.Q.template cast<double>(), w.K.template cast<double>(),
               w.V.template cast<double>())
      .output;
}

}  // namespace

TEST_CASE("sample_rows draws distinct sorted rows, all of them when s >= n", "[auto][probe]") {
  const std::vector<Index> r = detail::sample_rows(1000, 64, 7, 1);
  REQUIRE(r.size() == 64);
  CHECK(std::is_sorted(r.begin(), r.end()));
  CHECK(std::set<Index>(r.begin(), r.end()).size() == 64);
  CHECK(r.front() >= 0);
  CHECK(r.back() < 1000);
  CHECK(detail::sample_rows(1000, 64, 7, 1) == r);  // seeded
  CHECK(detail::sample_rows(1000, 64, 8, 1) != r);
  const std::vector<Index> all = detail::sample_rows(10, 50, 7, 1);
  REQUIRE(all.size() == 10);
  for (Index i = 0; i < 10; ++i) CHECK(all[static_cast<std::size_t>(i)] == i);
}

TEMPLATE_TEST_CASE("exact_rows equals the loop oracle on its rows, causal or not", "[auto][probe]",
                   float, double) {
  for (const bool causal : {false, true}) {
    for (const auto& shape :
         {std::pair<Index, Index>{200, 200}, std::pair<Index, Index>{70, 333}}) {
      const Index n = shape.first, m = shape.second;
      workloads::Params p;
      p.n = n;
      p.m = m;
      p.d = 16;
      p.dv = 24;
      p.seed = 3;
      const auto w = workloads::make<TestType>(workloads::Kind::Clustered, p);
      const std::vector<Index> rows = detail::sample_rows(n, 37, 11, 2);
      const Matrix<TestType> Qs = detail::gather_rows<TestType>(w.Q, rows);
      const double beta = 0.25;
      const Matrix<double> got = detail::exact_rows<TestType>(Qs, rows, n, w.K, w.V, beta, causal);
      const Matrix<double> ref = effattn::testing::loop_attention(w.Q, w.K, w.V, beta, causal);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        INFO("causal " << causal << " n " << n << " row " << rows[i]);
        CHECK(rel_fro_error(got.row(static_cast<Index>(i)), ref.row(rows[i])) <
              100 * effattn::testing::eps<TestType>());
      }
    }
  }
}

TEMPLATE_TEST_CASE("estimate_relative_error tracks the true error of any method's output",
                   "[auto][probe]", float, double) {
  const Index n = 1024;
  const auto w = workloads::make<TestType>(workloads::Kind::Clustered, n, 32, 6);
  for (const bool causal : {false, true}) {
    ExactOptions eo;
    eo.causal = causal;
    const Matrix<double> ref = exact_ref(w, causal);
    EvaOptions o;
    o.causal = causal;
    const Matrix<TestType> approx = EvaAttention<TestType>(o)(w.Q, w.K, w.V);
    const double truth = rel_fro_error(approx, ref);
    // All rows: the estimate is the true error up to round-off.
    CHECK(std::abs(estimate_relative_error<TestType>(w.Q, w.K, w.V, approx, causal, n) - truth) <
          1e-3 * truth);
    // 128 rows: within a factor 1.5 here (EVA's error is spread over the rows).
    const double est = estimate_relative_error<TestType>(w.Q, w.K, w.V, approx, causal, 128);
    INFO("causal " << causal << " truth " << truth << " est " << est);
    CHECK(est > truth / 1.5);
    CHECK(est < truth * 1.5);
    // Exact attention's own output: round-off.
    const Matrix<TestType> ex = ExactAttention<TestType>(eo)(w.Q, w.K, w.V);
    CHECK(estimate_relative_error<TestType>(w.Q, w.K, w.V, ex, causal) <
          100 * effattn::testing::eps<TestType>());
  }
  require_invalid_argument(
      [&] { (void)estimate_relative_error<TestType>(w.Q, w.K, w.V, w.Q.topRows(3)); }, "output");
  require_invalid_argument(
      [&] { (void)estimate_relative_error<TestType>(w.Q, w.K, w.V, w.V, false, 0); }, "rows");
}

TEMPLATE_TEST_CASE("AutoAttention conforms at its defaults", "[auto][conformance]", float, double) {
  for (const bool causal : {false, true}) {
    effattn::testing::ConformanceConfig cfg;
    cfg.name = "AutoAttention";
    cfg.causal = causal;
    if (causal) cfg.shapes = {{256, 256, 32, 32}, {97, 300, 16, 24}};
    // The default target is 1e-2; at these sizes nothing is faster than exact attention, so the
    // error is round-off (measured <= 4e-7 in float), but the test holds the method only to its
    // contract: the target.
    cfg.tolerance = [](workloads::Kind) { return 1e-2; };
    effattn::testing::check_conformance<TestType>(
        cfg, [&](const auto& Q, const auto& K, const auto& V) {
          AutoOptions o;
          o.causal = causal;
          return AutoAttention<TestType>(o).compute(Q, K, V);
        });
  }
}

TEMPLATE_TEST_CASE("AutoAttention chooses exact attention when nothing is cheaper, with its bits",
                   "[auto]", float, double) {
  const auto w = workloads::make<TestType>(workloads::Kind::Sphere, 512, 32, 5);
  for (const bool causal : {false, true}) {
    AutoOptions o;
    o.causal = causal;
    const auto r = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
    ExactOptions eo;
    eo.causal = causal;
    const auto e = ExactAttention<TestType>(eo).compute(w.Q, w.K, w.V);
    CHECK(r.info == Info::Success);
    CHECK(r.method == AutoMethod::Exact);
    CHECK(r.error_sample_rows == 0);  // no candidate fitted: no probe was paid for
    CHECK(r.candidates.empty());
    CHECK(r.predicted_cost == 1.0);
    CHECK(!r.reason.empty());
    CHECK(bitwise_equal(r.output, e.output));
    CHECK(bitwise_equal(r.lse, e.lse));
  }
  // target 0: exact, whatever the budget.
  AutoOptions o;
  o.target_error = 0;
  o.max_overhead = 100;
  const auto r = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
  CHECK(r.method == AutoMethod::Exact);
  CHECK(bitwise_equal(r.output, ExactAttention<TestType>().compute(w.Q, w.K, w.V).output));
}

TEMPLATE_TEST_CASE("AutoAttention's choice meets the target against exact attention", "[auto]",
                   float, double) {
  // A probe budget large enough that WildCat is affordable at n = 2048 (the default budget
  // affords it only from n ~ 16384 on): the test exercises the choice, not the cost model.
  const Index n = 2048;
  const auto w = workloads::make<TestType>(workloads::Kind::Sphere, n, 64, 9);
  const Matrix<double> ref = exact_ref(w, false);
  AutoOptions o;
  o.max_overhead = 50;
  o.target_error = 0.05;
  const auto r = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
  INFO(r.reason);
  REQUIRE(r.info == Info::Success);
  REQUIRE(r.method == AutoMethod::Wildcat);
  const double err = rel_fro_error(r.output, ref);
  CHECK(err <= o.target_error);
  CHECK(r.estimated_error <= o.safety * o.target_error);
  // The estimate tracks the true error (sphere has no outlier rows): measured 0.8-1.2x.
  CHECK(r.estimated_error > 0.5 * err);
  CHECK(r.estimated_error < 2.0 * err);
  CHECK(r.budget > 0);
  CHECK(r.budget < n);
  CHECK(r.error_sample_rows == 32);  // automatic: max(32, n / 64) rows up to 256
  REQUIRE(!r.candidates.empty());
  CHECK(r.candidates.back().accepted);
  CHECK(r.predicted_cost < 1 + o.max_overhead);

  // A looser target never picks a larger rank (EVA, cheaper, is a candidate from 0.05 on).
  AutoOptions loose = o;
  loose.target_error = 0.2;
  loose.allow_eva = false;
  const auto rl = AutoAttention<TestType>(loose).compute(w.Q, w.K, w.V);
  REQUIRE(rl.method == AutoMethod::Wildcat);
  CHECK(rl.budget <= r.budget);
  CHECK(rel_fro_error(rl.output, ref) <= loose.target_error);
  // With EVA allowed the loose target takes the cheapest candidate that meets it.
  loose.allow_eva = true;
  const auto re = AutoAttention<TestType>(loose).compute(w.Q, w.K, w.V);
  INFO(re.reason);
  CHECK(re.method != AutoMethod::Exact);
  CHECK(rel_fro_error(re.output, ref) <= loose.target_error);
}

TEMPLATE_TEST_CASE("AutoAttention picks EVA for a loose causal target and meets it", "[auto]",
                   float, double) {
  const auto w = workloads::make<TestType>(workloads::Kind::Sphere, 2048, 64, 4);
  const Matrix<double> ref = exact_ref(w, true);
  AutoOptions o;
  o.causal = true;
  o.max_overhead = 50;
  o.target_error = 0.3;  // EVA's error on sphere is ~0.08 (causal)
  const auto r = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
  INFO(r.reason);
  REQUIRE(r.info == Info::Success);
  REQUIRE(r.method == AutoMethod::Eva);
  CHECK(rel_fro_error(r.output, ref) <= o.target_error);
  // Disallowing EVA leaves only exact attention (WildCat has no causal form).
  o.allow_eva = false;
  const auto e = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
  CHECK(e.method == AutoMethod::Exact);
  CHECK(e.error_sample_rows == 0);
}

TEMPLATE_TEST_CASE("AutoAttention falls back to exact attention when no candidate meets the target",
                   "[auto]", float, double) {
  // needles: WildCat's error stays ~0.9 at every affordable rank (some queries copy one key).
  const auto w = workloads::make<TestType>(workloads::Kind::Needles, 2048, 64, 2);
  AutoOptions o;
  o.max_overhead = 50;
  o.target_error = 1e-2;
  const auto r = AutoAttention<TestType>(o).compute(w.Q, w.K, w.V);
  INFO(r.reason);
  REQUIRE(r.info == Info::Success);
  CHECK(r.method == AutoMethod::Exact);
  REQUIRE(!r.candidates.empty());
  for (const AutoCandidate& c : r.candidates) {
    CHECK(!c.accepted);
    CHECK(c.estimated_error > o.safety * o.target_error);
  }
  CHECK(bitwise_equal(r.output, ExactAttention<TestType>().compute(w.Q, w.K, w.V).output));
  CHECK(r.predicted_cost > 1);  // the probe was paid for
  CHECK(r.predicted_cost <= 1 + o.max_overhead);
  CHECK(r.reason.find("no candidate met") != std::string::npos);
}

TEST_CASE("AutoAttention skips a WildCat probe whose affordable rank cannot meet the target",
          "[auto]") {
  // n = 4096, 1e-2 target, default budget: the affordable rank is 64 and 64 x 1e-2 < 2, so no
  // probe is paid for (the default); with the rule off, WildCat r = 64 is probed and misses
  // (sphere: ~0.05 at r = 64), and the call pays for the probe.
  const auto w = workloads::make<float>(workloads::Kind::Sphere, 4096, 64, 3);
  AutoOptions o;
  o.allow_eva = false;
  const auto r = AutoAttention<float>(o).compute(w.Q, w.K, w.V);
  INFO(r.reason);
  CHECK(r.method == AutoMethod::Exact);
  CHECK(r.error_sample_rows == 0);
  CHECK(r.candidates.empty());
  CHECK(r.predicted_cost == 1.0);
  CHECK(r.reason.find("wildcat_min_rank_error") != std::string::npos);
  o.wildcat_min_rank_error = 0;
  const auto p = AutoAttention<float>(o).compute(w.Q, w.K, w.V);
  INFO(p.reason);
  CHECK(p.method == AutoMethod::Exact);
  REQUIRE(!p.candidates.empty());
  CHECK(p.candidates.front().method == AutoMethod::Wildcat);
  CHECK(static_cast<double>(p.candidates.front().budget) * o.target_error < 2.0);
  CHECK(!p.candidates.front().accepted);
  CHECK(p.predicted_cost > 1.0);
  CHECK(bitwise_equal(r.output, p.output));
}

TEST_CASE("AutoAttention's probe stays within max_overhead", "[auto]") {
  const auto w = workloads::make<float>(workloads::Kind::Gaussian, 4096, 64, 2);
  for (const double overhead : {0.05, 0.2, 1.0, 5.0}) {
    AutoOptions o;
    o.max_overhead = overhead;
    const auto r = AutoAttention<float>(o).compute(w.Q, w.K, w.V);
    INFO("max_overhead " << overhead << ": " << r.reason);
    REQUIRE(r.info == Info::Success);
    double probe = 0;
    for (const AutoCandidate& c : r.candidates) probe += c.predicted_cost;
    CHECK(probe <= overhead);
    if (r.method == AutoMethod::Exact) CHECK(r.predicted_cost <= 1 + overhead + 1e-12);
  }
}

TEMPLATE_TEST_CASE("AutoAttention is deterministic across calls and thread counts", "[auto]", float,
                   double) {
  const auto w = workloads::make<TestType>(workloads::Kind::Sphere, 1536, 32, 8);
  AutoOptions o;
  o.max_overhead = 50;
  o.target_error = 0.05;
  const AutoAttention<TestType> f(o);
  const auto a = effattn::testing::with_threads(1, [&] { return f.compute(w.Q, w.K, w.V); });
  const auto b = effattn::testing::with_threads(2, [&] { return f.compute(w.Q, w.K, w.V); });
  const auto c = f.compute(w.Q, w.K, w.V);
  CHECK(a.method == b.method);
  CHECK(a.budget == b.budget);
  CHECK(bitwise_equal(a.output, b.output));
  CHECK(bitwise_equal(a.output, c.output));
}

TEST_CASE("AutoAttention runs per head under MultiHead", "[auto][multi_head]") {
  const Index L = 300, H = 4, G = 2, d = 16;
  const Matrix<float> Q = effattn::testing::gaussian<float>(L, H * d, 1, 0.5);
  const Matrix<float> K = effattn::testing::gaussian<float>(L, G * d, 2, 0.5);
  const Matrix<float> V = effattn::testing::gaussian<float>(L, G * d, 3);
  AutoOptions o;
  o.causal = true;
  const MultiHead<AutoAttention<float>> mh(o, HeadLayout{H, G});
  const auto r = mh.compute(Q, K, V);
  REQUIRE(r.info == Info::Success);
  for (Index h = 0; h < H; ++h) {
    const Index g = h / (H / G);
    const auto ref = AutoAttention<float>(o).compute(Q.middleCols(h * d, d), K.middleCols(g * d, d),
                                                     V.middleCols(g * d, d));
    CHECK(bitwise_equal(r.output.middleCols(h * d, d), ref.output));
  }
}

TEST_CASE("AutoAttention rejects bad options and inputs", "[auto][errors]") {
  auto bad = [](auto edit, const char* needle) {
    AutoOptions o;
    edit(o);
    require_invalid_argument([&] { AutoAttentionf f(o); }, needle);
  };
  bad([](AutoOptions& o) { o.target_error = -1; }, "target_error");
  bad([](AutoOptions& o) { o.target_error = std::numeric_limits<double>::quiet_NaN(); },
      "target_error");
  bad([](AutoOptions& o) { o.error_sample_rows = -1; }, "error_sample_rows");
  bad([](AutoOptions& o) { o.max_overhead = -0.1; }, "max_overhead");
  bad([](AutoOptions& o) { o.max_overhead = std::numeric_limits<double>::infinity(); },
      "max_overhead");
  bad([](AutoOptions& o) { o.safety = 0; }, "safety");
  bad([](AutoOptions& o) { o.safety = 1.5; }, "safety");
  bad([](AutoOptions& o) { o.scale = -1; }, "scale");
  bad([](AutoOptions& o) { o.eva_min_target = -1; }, "eva_min_target");
  bad([](AutoOptions& o) { o.wildcat_min_rank_error = -1; }, "wildcat_min_rank_error");
  bad([](AutoOptions& o) { o.wildcat_min_rank_error = std::numeric_limits<double>::infinity(); },
      "wildcat_min_rank_error");

  const Matrix<float> Q = effattn::testing::gaussian<float>(8, 4, 1);
  const Matrix<float> K = effattn::testing::gaussian<float>(6, 4, 2);
  const Matrix<float> V = effattn::testing::gaussian<float>(6, 3, 3);
  const AutoAttentionf f;
  require_invalid_argument([&] { (void)f.compute(Q, K, V.topRows(5)); }, "V");
  require_invalid_argument([&] { (void)f.compute(Q.leftCols(3), K, V); }, "K");
  require_invalid_argument([&] { (void)f.compute(Matrix<float>(0, 4), K, V); }, "Q");
  Matrix<float> Kn = K;
  Kn(2, 1) = std::numeric_limits<float>::quiet_NaN();
  require_invalid_argument([&] { (void)f.compute(Q, Kn, V); }, "K");
  AutoOptions co;
  co.causal = true;
  require_invalid_argument([&] { (void)AutoAttentionf(co).compute(Q, K, V); }, "m >= n");
}

// ---- Deprecated spelling of a renamed option (one release): the same output as the new name.

namespace {
EFFATTN_DEPRECATED_FIELDS_BEGIN
AutoOptions with_old_probe_rows(Index rows) {
  AutoOptions o;
  o.probe_rows = rows;
  return o;
}
Index old_probe_rows(const AutoResult<float>& r) {
  return r.probe_rows;
}
EFFATTN_DEPRECATED_FIELDS_END
}  // namespace

TEST_CASE("AutoOptions::probe_rows (deprecated) gives the output of error_sample_rows",
          "[auto][deprecated]") {
  const auto w = workloads::make<float>(workloads::Kind::Sphere, 2048, 64, 9);
  AutoOptions now;
  now.max_overhead = 50;
  now.target_error = 0.05;
  now.error_sample_rows = 48;
  const auto a = AutoAttention<float>(now).compute(w.Q, w.K, w.V);
  REQUIRE(a.info == Info::Success);
  REQUIRE(a.method == AutoMethod::Wildcat);  // the sampled rows were used
  CHECK(a.error_sample_rows == 48);
  CHECK(old_probe_rows(a) == 48);  // the Result's deprecated spelling holds the same value
  AutoOptions old = with_old_probe_rows(48);
  old.max_overhead = 50;
  old.target_error = 0.05;
  const AutoAttention<float> f(old);
  const auto b = f.compute(w.Q, w.K, w.V);
  CHECK(bitwise_equal(b.output, a.output));
  CHECK(b.estimated_error == a.estimated_error);
  CHECK(b.error_sample_rows == 48);
  CHECK(f.options().error_sample_rows == 48);
  std::set<std::string> names;
  for (const Diagnostic& d : b.diagnostics()) names.insert(d.name);
  CHECK(names.count("error_sample_rows") == 1);
  CHECK(names.count("probe_rows") == 1);  // the deprecated key, for one release
  AutoOptions clash = old;
  clash.error_sample_rows = 64;
  CHECK_THROWS_WITH(AutoAttention<float>(clash), Catch::Contains("error_sample_rows = 64") &&
                                                     Catch::Contains("probe_rows = 48"));
}
