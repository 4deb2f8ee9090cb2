// Benchmarks of AutoAttention (effattn/auto.hpp) against Tiled exact attention, in one binary run
// so that only within-run ratios are quoted, plus the calibration rows of its cost model.
//
// Names:  exact/<workload>/<full|causal>/<n>            ExactAttention<float> (Tiled)
//         auto/<workload>/<full|causal>/t<target>/<n>   AutoAttention<float>, default options
//         calib/exact/<n>, calib/probe/<n>, calib/select/r<r>/<n>, calib/attend/r<r>/<n>,
//         calib/eva/<n>                                  the cost model's terms, timed alone
//         auto/smoke/...                                 (tiny, for ctest)
// n = m, d = dv = 64, float, every thread (OMP_NUM_THREADS). Workloads: the five synthetic kinds;
// with EFFATTN_BENCH_WORKLOAD=lm:MODEL:LAYER:HEAD every shape uses that trained head instead
// (bench/common.hpp). Counters of the auto rows:
//   vs_exact: time / time of exact at the same (workload, mask, n) measured earlier in this run;
//   err: relative Frobenius error of the whole output against exact Tiled (float; computed
//       outside the timed loop); meets: err <= target; est_error: AutoAttention's estimate;
//   method (0 exact, 1 wildcat, 2 eva), budget, predicted_cost (cost model's total / exact).
// The calib rows report model_units: the measured time over the time of one cost-model unit
// (exact's time / (n m (d + dv)) at the same n), i.e. the coefficient the model should use.
// After the run a summary prints the auto table and the fitted coefficients.
// Example (target error 1e-2):
//   bench_auto --benchmark_filter='^(exact|auto)/' --benchmark_min_time=0.05
#include "common.hpp"

#include <effattn/auto.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

using namespace effattn;
using effattn::bench::attention_gflops;
using effattn::bench::cached_workload;
using effattn::bench::timed_loop;

namespace {

constexpr Index kD = 64;

struct Row {
  double seconds = 0, vs_exact = -1, err = -1, est = -1, predicted = -1;
  std::string method;
  Index budget = 0;
};
using Key = std::tuple<std::string, bool, Index>;  // workload, causal, n
std::map<Key, std::pair<double, Matrix<float>>>& exact_runs() {
  static std::map<Key, std::pair<double, Matrix<float>>> r;
  return r;
}
std::map<std::tuple<std::string, bool, double, Index>, Row>& auto_runs() {
  static std::map<std::tuple<std::string, bool, double, Index>, Row> r;
  return r;
}
std::map<std::string, std::vector<double>>& calib() {  // term -> model_units samples
  static std::map<std::string, std::vector<double>> r;
  return r;
}
std::map<Index, double>& calib_exact() {  // n -> seconds per model unit
  static std::map<Index, double> r;
  return r;
}

const workloads::Workload<float>& workload(const std::string& kind, Index n) {
  return cached_workload<float>(workloads::parse_kind(kind), n, n, kD, kD);
}

Matrix<float> exact_output(const std::string& kind, bool causal, Index n) {
  const auto& w = workload(kind, n);
  ExactOptions o;
  o.causal = causal;
  return ExactAttention<float>(o).compute(w.Q, w.K, w.V).output;
}

void bm_exact(benchmark::State& state, std::string kind, bool causal) {
  const Index n = state.range(0);
  const auto& w = workload(kind, n);
  ExactOptions o;
  o.causal = causal;
  const ExactAttention<float> f(o);
  ExactResult<float> r;
  const double sec = timed_loop(state, [&] {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  exact_runs()[Key(kind, causal, n)] = {sec, r.output};
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, kD, kD);
}

void bm_auto(benchmark::State& state, std::string kind, bool causal, double target) {
  const Index n = state.range(0);
  const auto& w = workload(kind, n);
  AutoOptions o;
  o.causal = causal;
  o.target_error = target;
  const AutoAttention<float> f(o);
  AutoResult<float> r;
  const double sec = timed_loop(state, [&] {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  if (r.info != Info::Success) {
    state.SkipWithError("compute did not succeed");
    return;
  }
  Row row;
  row.seconds = sec;
  auto it = exact_runs().find(Key(kind, causal, n));
  const Matrix<float> ref =
      it != exact_runs().end() ? it->second.second : exact_output(kind, causal, n);
  row.err = (r.output - ref).template cast<double>().norm() / ref.template cast<double>().norm();
  if (it != exact_runs().end()) row.vs_exact = sec / it->second.first;
  row.est = r.estimated_error;
  row.predicted = r.predicted_cost;
  row.method = to_string(r.method);
  row.budget = r.budget;
  auto_runs()[std::make_tuple(kind, causal, target, n)] = row;
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, kD, kD);
  state.counters["vs_exact"] = row.vs_exact;
  state.counters["err"] = row.err;
  state.counters["meets"] = row.err <= target ? 1 : 0;
  state.counters["est_error"] = row.est;
  state.counters["method"] = static_cast<double>(r.method);
  state.counters["budget"] = static_cast<double>(r.budget);
  state.counters["predicted_cost"] = row.predicted;
}

// ---- calibration of detail::AutoCostModel ----
// Every calib row reports model_ratio = measured time / the model's predicted time, with the
// model's unit taken from calib/exact at the same n (run it first; the filter keeps the order).

void bm_calib_exact(benchmark::State& state) {
  const Index n = state.range(0);
  const auto& w = workload("sphere", n);
  const ExactAttention<float> f;
  const double sec = timed_loop(state, [&] {
    auto r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  calib_exact()[n] = sec / detail::AutoCostModel::exact(n, n, kD, kD, false);
  state.SetComplexityN(n);
}

void record(benchmark::State& state, const std::string& term, Index n, double sec,
            double predicted_units) {
  auto it = calib_exact().find(n);
  if (it == calib_exact().end()) {
    state.SkipWithError("run calib/exact at this n first");
    return;
  }
  const double ratio = sec / it->second / predicted_units;
  calib()[term].push_back(ratio);
  state.counters["model_ratio"] = ratio;
  state.counters["vs_exact"] =
      sec / (it->second * detail::AutoCostModel::exact(n, n, kD, kD, false));
}

void bm_calib_probe(benchmark::State& state) {
  const Index n = state.range(0), s = std::clamp<Index>(n / 64, 32, 256);
  const auto& w = workload("sphere", n);
  const std::vector<Index> rows = detail::sample_rows(n, s, 1, 2);
  const Matrix<float> Qs = detail::gather_rows<float>(w.Q, rows);
  const double sec = timed_loop(state, [&] {
    auto r = detail::exact_rows<float>(Qs, rows, n, w.K, w.V, 0.125, false);
    benchmark::DoNotOptimize(r.data());
  });
  record(state, "probe", n, sec, detail::AutoCostModel::probe(s, n, n, kD, kD, false));
}

void bm_calib_select(benchmark::State& state) {
  const Index r = state.range(0), n = state.range(1);
  const auto& w = workload("sphere", n);
  WildcatOptions o;
  o.rank = r;
  const WildcatAttention<float> f(o);
  const double rq = std::sqrt(w.Q.template cast<double>().rowwise().squaredNorm().maxCoeff());
  const double sec = timed_loop(state, [&] {
    auto c = f.compress_kv(w.K, w.V, rq);
    benchmark::DoNotOptimize(c.keys.data());
  });
  record(state, "wildcat_select", n, sec, detail::AutoCostModel::wildcat_select(r, n, kD, kD));
}

void bm_calib_attend(benchmark::State& state) {
  const Index r = state.range(0), n = state.range(1);
  const auto& w = workload("sphere", n);
  WildcatOptions o;
  o.rank = r;
  const WildcatAttention<float> f(o);
  const double rq = std::sqrt(w.Q.template cast<double>().rowwise().squaredNorm().maxCoeff());
  const CompressedKV<float> c = f.compress_kv(w.K, w.V, rq);
  const double sec = timed_loop(state, [&] {
    auto a = f.weighted_attention(w.Q, c);
    benchmark::DoNotOptimize(a.output.data());
  });
  record(state, "wildcat_attend", n, sec, detail::AutoCostModel::wildcat_attend(n, r, kD, kD));
}

void bm_calib_eva(benchmark::State& state, bool causal) {
  const Index n = state.range(0);
  const auto& w = workload("sphere", n);
  EvaOptions o;
  o.causal = causal;
  const EvaAttention<float> f(o);
  const double sec = timed_loop(state, [&] {
    auto a = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(a.output.data());
  });
  record(state, causal ? "eva_causal" : "eva", n, sec,
         detail::AutoCostModel::eva(n, n, kD, kD, o.window, std::min<Index>(64, n)));
}

const std::vector<std::string> kKinds = {"gaussian", "sphere", "clustered", "positional",
                                         "needles"};
const std::vector<double> kTargets = {1e-2, 1e-1};

void register_all() {
  for (const bool causal : {false, true}) {
    const std::string mask = causal ? "causal" : "full";
    for (const std::string& kind : kKinds) {
      benchmark::RegisterBenchmark(("exact/" + kind + "/" + mask).c_str(), bm_exact, kind, causal)
          ->RangeMultiplier(4)
          ->Range(4096, 65536)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      for (const double t : kTargets) {
        char name[96];
        std::snprintf(name, sizeof(name), "auto/%s/%s/t%g", kind.c_str(), mask.c_str(), t);
        benchmark::RegisterBenchmark(name, bm_auto, kind, causal, t)
            ->RangeMultiplier(4)
            ->Range(4096, 65536)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  for (const Index n : {4096, 16384, 65536}) {
    const std::string sn = std::to_string(n);
    benchmark::RegisterBenchmark(("calib/exact/" + sn).c_str(), bm_calib_exact)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("calib/probe/" + sn).c_str(), bm_calib_probe)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const Index r : {64, 256, 1024}) {
      if (2 * r >= n) continue;
      benchmark::RegisterBenchmark(("calib/select/r" + std::to_string(r) + "/" + sn).c_str(),
                                   bm_calib_select)
          ->Args({r, n})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(("calib/attend/r" + std::to_string(r) + "/" + sn).c_str(),
                                   bm_calib_attend)
          ->Args({r, n})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    benchmark::RegisterBenchmark(("calib/eva/" + sn).c_str(), bm_calib_eva, false)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("calib/eva_causal/" + sn).c_str(), bm_calib_eva, true)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // ctest smoke at a tiny size (exact attention is chosen there without a probe; test_auto covers
  // the probing paths).
  benchmark::RegisterBenchmark("exact/sphere/full/smoke", bm_exact, std::string("sphere"), false)
      ->Arg(512);
  benchmark::RegisterBenchmark("auto/sphere/full/t0.01/smoke", bm_auto, std::string("sphere"),
                               false, 1e-2)
      ->Arg(512);
}

void summary() {
  if (!auto_runs().empty()) {
    std::printf(
        "\nAutoAttention (float, d = 64, %d thread(s)); vs_exact = time / exact in this run\n",
        effattn::max_threads());
    std::printf("%-11s %-6s %6s %7s  %-8s %6s %10s %10s %6s %9s %9s\n", "workload", "mask", "n",
                "target", "method", "budget", "est", "err", "meets", "vs_exact", "predicted");
    for (const auto& [k, r] : auto_runs()) {
      const auto& [kind, causal, target, n] = k;
      std::printf("%-11s %-6s %6ld %7.3g  %-8s %6ld %10.3g %10.3g %6s %9.3f %9.3f\n", kind.c_str(),
                  causal ? "causal" : "full", static_cast<long>(n), target, r.method.c_str(),
                  static_cast<long>(r.budget), r.est, r.err, r.err <= target ? "yes" : "NO",
                  r.vs_exact, r.predicted);
    }
  }
  if (!calib().empty()) {
    std::printf(
        "\nCost model check: measured / predicted time per term (1 = exact model; > 1: "
        "the model is optimistic)\n");
    for (const auto& [term, v] : calib()) {
      double lo = v.front(), hi = v.front();
      for (const double x : v) lo = std::min(lo, x), hi = std::max(hi, x);
      std::printf("  %-16s %.2f .. %.2f over %zu shapes\n", term.c_str(), lo, hi, v.size());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, summary);
}
