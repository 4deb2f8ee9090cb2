// Benchmarks of EVA (effattn/eva.hpp) against Tiled exact attention and PerformerAttention (same
// header, same kernel) at equal feature budget, all in one binary run so that only within-run
// ratios are quoted.
//
// Names:  exact/tiled/float/d64/<full|causal>/<n>
//         eva/float/d64/<full|causal>/w64/<L16|L64|C64>/<n>   (C64: chunk_size 0 = about 64 chunks)
//         performer/float/d64/full/<L16|L64|C64>/<n>         (S = the matching EVA's softmax width)
//         eva/smoke/...                                       (tiny, for ctest)
// n = m in {1024 ... 65536}, d = dv = 64, float, every thread (OMP_NUM_THREADS); timing on the
// gaussian workload. Counters:
//   rel_err, err_positional, err_clustered: relative Frobenius error of 64 sampled rows (the last
//       64, so causal rows see every key) against the double Naive reference, on the gaussian,
//       positional and clustered workloads (same n);
//   vs_exact: time / time of exact/tiled at the same n and mask, measured earlier in this run;
//   logits: softmax width per query (|E| + chunks), S for Performer; GFLOP/s: dense-equivalent.
// After the run a summary prints the ratios and the log-log slope of time against n per family
// (the headline ratios). Example:
//   bench_eva --benchmark_filter='^(exact/tiled|eva|performer)/float' --benchmark_min_time=0.2
#include "common.hpp"

#include <effattn/eva.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

using namespace effattn;
using effattn::bench::attention_gflops;
using effattn::bench::cached_workload;
using effattn::bench::loglog_slope;
using effattn::bench::sampled_rel_error;
using effattn::bench::set_threads;
using effattn::bench::timed_compute;
using effattn::bench::timed_loop;

namespace {

constexpr Index kD = 64;
constexpr Index kWindow = 64;

struct Sample {
  double seconds = 0;  // per iteration
  double err_g = -1, err_p = -1, err_c = -1;
  Index logits = 0;
};
// family -> n -> measurement (filled as benchmarks run; read by the summary).
std::map<std::string, std::map<Index, Sample>>& results() {
  static std::map<std::string, std::map<Index, Sample>> r;
  return r;
}

double rows_err(workloads::Kind kind, Index n, bool causal, const Matrix<float>& out) {
  const auto& w = cached_workload<float>(kind, n, n, kD, kD);
  const Index rows = std::min<Index>(64, n);
  return sampled_rel_error(w.Q, w.K, w.V, out, n - rows, rows, causal);
}

void bm_exact(benchmark::State& state, bool causal, const std::string& family) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, kD, kD);
  ExactOptions o;
  o.causal = causal;
  const ExactAttention<float> f(o);
  ExactResult<float> r;
  const double sec = timed_loop(state, [&] {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, kD, kD);
  state.counters["threads"] = threads;
  results()[family][n].seconds = sec;
}

EvaOptions eva_options(bool causal, Index chunk) {
  EvaOptions o;
  o.causal = causal;
  o.window = kWindow;
  o.chunk_size = chunk;
  return o;
}

// Softmax width of the EVA configuration at this n (the Performer's equal feature budget).
Index eva_width(Index n, bool causal, Index chunk) {
  return EvaAttention<float>(eva_options(causal, chunk)).max_logits(n, n);
}

// Softmax width per query: |E| + S x chunks for EVA, the feature count for the Performer.
Index softmax_width(const EvaResult<float>& r) {
  return r.max_logits;
}
Index softmax_width(const PerformerResult<float>& r) {
  return r.features;
}

template <typename Functor>
void bm_method(benchmark::State& state, const Functor& f, bool causal, const std::string& family,
               const std::string& exact_family) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, kD, kD);
  typename Functor::Result r;
  const double sec = timed_compute(state, f, w.Q, w.K, w.V, r);
  if (sec < 0) return;
  Sample smp;
  smp.seconds = sec;
  smp.logits = softmax_width(r);
  smp.err_g = rows_err(workloads::Kind::Gaussian, n, causal, r.output);
  for (const auto kind : {workloads::Kind::Positional, workloads::Kind::Clustered}) {
    const auto& wk = cached_workload<float>(kind, n, n, kD, kD);
    const double e = rows_err(kind, n, causal, f.compute(wk.Q, wk.K, wk.V).output);
    (kind == workloads::Kind::Positional ? smp.err_p : smp.err_c) = e;
  }
  results()[family][n] = smp;
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, kD, kD);
  state.counters["threads"] = threads;
  state.counters["rel_err"] = smp.err_g;
  state.counters["err_positional"] = smp.err_p;
  state.counters["err_clustered"] = smp.err_c;
  state.counters["logits"] = static_cast<double>(smp.logits);
  const auto ex = results().find(exact_family);
  if (ex != results().end() && ex->second.count(n) && ex->second.at(n).seconds > 0)
    state.counters["vs_exact"] = sec / ex->second.at(n).seconds;
}

const char* mask_name(bool causal) {
  return causal ? "causal" : "full";
}

std::string chunk_name(Index chunk) {
  return chunk == 0 ? std::string("C64") : "L" + std::to_string(chunk);
}

std::vector<Index> sizes() {
  return {1024, 2048, 4096, 8192, 16384, 32768, 65536};
}

void register_all() {
  for (const bool causal : {false, true}) {
    const std::string ex = std::string("exact/tiled/float/d64/") + mask_name(causal);
    auto* b = benchmark::RegisterBenchmark(ex.c_str(),
                                           [=](benchmark::State& s) { bm_exact(s, causal, ex); });
    for (const Index n : sizes()) b->Arg(n);
    b->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
  }
  for (const Index chunk : {Index(16), Index(64), Index(0)}) {
    for (const bool causal : {false, true}) {
      const std::string ex = std::string("exact/tiled/float/d64/") + mask_name(causal);
      const std::string fam =
          std::string("eva/float/d64/") + mask_name(causal) + "/w64/" + chunk_name(chunk);
      const EvaAttention<float> f(eva_options(causal, chunk));
      auto* b = benchmark::RegisterBenchmark(
          fam.c_str(), [=](benchmark::State& s) { bm_method(s, f, causal, fam, ex); });
      for (const Index n : sizes()) b->Arg(n);
      b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
    }
    // Performer (non-causal only: RFA has no causal form here) at EVA's feature budget.
    for (const Index n : sizes()) {
      const std::string ex = "exact/tiled/float/d64/full";
      const std::string fam = "performer/float/d64/full/" + chunk_name(chunk);
      PerformerOptions o;
      o.features = eva_width(n, false, chunk);
      const PerformerAttention<float> f(o);
      benchmark::RegisterBenchmark(fam.c_str(),
                                   [=](benchmark::State& s) { bm_method(s, f, false, fam, ex); })
          ->Arg(n)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  // Tiny configurations for the ctest smoke run.
  for (const bool causal : {false, true}) {
    const std::string fam = std::string("eva/smoke/") + mask_name(causal);
    EvaOptions o = eva_options(causal, 16);
    o.samples = 2;
    const EvaAttention<float> f(o);
    benchmark::RegisterBenchmark(fam.c_str(), [=](benchmark::State& s) {
      bm_method(s, f, causal, fam, "");
    })->Arg(256);
  }
  PerformerOptions po;
  po.features = 32;
  const PerformerAttention<float> pf(po);
  benchmark::RegisterBenchmark("performer/smoke/full", [=](benchmark::State& s) {
    bm_method(s, pf, false, "performer/smoke/full", "");
  })->Arg(256);
}

void print_summary() {
  const auto& res = results();
  if (res.empty()) return;
  std::printf(
      "\nSummary (times from this run; vs_exact = time / exact tiled time, same n and mask)\n");
  std::printf("%-36s %7s %10s %9s %8s %10s %10s %10s\n", "family", "n", "ms", "vs_exact", "logits",
              "err_gauss", "err_pos", "err_clus");
  for (const auto& [fam, pts] : res) {
    const bool causal = fam.find("causal") != std::string::npos;
    const std::string ex = std::string("exact/tiled/float/d64/") + mask_name(causal);
    for (const auto& [n, s] : pts) {
      double ratio = std::nan("");
      const auto e = res.find(ex);
      if (e != res.end() && e->second.count(n) && fam != ex)
        ratio = s.seconds / e->second.at(n).seconds;
      std::printf("%-36s %7ld %10.2f %9.4f %8ld %10.3g %10.3g %10.3g\n", fam.c_str(),
                  static_cast<long>(n), s.seconds * 1e3, ratio, static_cast<long>(s.logits),
                  s.err_g, s.err_p, s.err_c);
    }
    if (pts.size() >= 2)
      std::printf("%-36s log-log slope of time vs n: %.3f\n", fam.c_str(), loglog_slope(pts));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, print_summary);
}
