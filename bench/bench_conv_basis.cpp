// Benchmarks of Conv-Basis attention (effattn/conv_basis.hpp) against causal Tiled exact attention
// in the same binary run, so that only within-run ratios are quoted.
//
// Names:  exact/tiled/float/d64/causal/<n>                 (Iterations(1): ~n^2)
//         conv_basis/<scan|binary|grid>/float/d64/k<k>/<n>  full compute (recovery + FFT apply)
//         conv_basis/recover/scan/float/d64/k16/<n>        recovery only (logit reads + scan)
//         conv_basis/errsweep/scan/d64/n2048/k<k>          accuracy vs k (no timing claim)
//         conv_basis/smoke/...                             tiny, for ctest
// n = m in {1024 ... 65536}, d = dv = 64, float inputs (FFTs in double, the default), timing on
// the `positional` workload (the recovery is data dependent). Counters:
//   rel_err: relative Frobenius error of the last 256 rows (they see every key) against the
//       double Naive causal reference, on `positional` (default knobs, token noise 0.1);
//   err_clean: the same on `positional` with noise = 0 (only the smooth drift + RoPE);
//   bases_used, recomputed (guard rows), fft_size; vs_exact: time / exact tiled causal time at
//   the same n, measured earlier in this run.
// After the run a summary prints the ratios, the log-log slope of time against n per family,
// the crossover n (vs_exact < 1 from that n on) and the error-vs-k sweep. Example:
//   bench_conv_basis --benchmark_filter='^(exact|conv_basis/(scan|recover|errsweep))'
#include "common.hpp"

#include <effattn/conv_basis.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

using namespace effattn;
using effattn::bench::cached_workload;
using effattn::bench::loglog_slope;
using effattn::bench::sampled_rel_error;
using effattn::bench::set_threads;
using effattn::bench::timed_compute;
using effattn::bench::timed_loop;

namespace {

constexpr Index kD = 64;
const std::string kExact = "exact/tiled/float/d64/causal";

struct Sample {
  double seconds = 0;
  double err = -1, err_clean = -1;
  Index bases = 0, recomputed = 0;
};
std::map<std::string, std::map<Index, Sample>>& results() {
  static std::map<std::string, std::map<Index, Sample>> r;
  return r;
}

// `positional` with noise 0 (only the smooth drift under RoPE), cached per n.
const workloads::Workload<float>& clean_positional(Index n) {
  static std::map<Index, workloads::Workload<float>> cache;
  auto it = cache.find(n);
  if (it == cache.end()) {
    auto p = workloads::Params::shape(n, n, kD, kD, 1);
    p.noise = 0;
    it = cache.emplace(n, workloads::make<float>(workloads::Kind::Positional, p)).first;
  }
  return it->second;
}

double tail_err(const workloads::Workload<float>& w, const Matrix<float>& out) {
  const Index n = w.Q.rows(), rows = std::min<Index>(256, n);
  return sampled_rel_error(w.Q, w.K, w.V, out, n - rows, rows, true);
}

void bm_exact(benchmark::State& state) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Positional, n, n, kD, kD);
  ExactOptions o;
  o.causal = true;
  const ExactAttention<float> f(o);
  ExactResult<float> r;
  const double sec = timed_loop(state, [&] {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.SetComplexityN(n);
  state.counters["threads"] = threads;
  results()[kExact][n].seconds = sec;
}

template <typename Functor>
void bm_conv(benchmark::State& state, const Functor& f, const std::string& family, bool errors) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Positional, n, n, kD, kD);
  typename Functor::Result r;
  const double sec = timed_compute(state, f, w.Q, w.K, w.V, r);
  if (sec < 0) return;
  Sample s;
  s.seconds = sec;
  s.bases = r.bases_used;
  s.recomputed = r.rows_recomputed;
  if (errors) {
    s.err = tail_err(w, r.output);
    const auto& wc = clean_positional(n);
    s.err_clean = tail_err(wc, f.compute(wc.Q, wc.K, wc.V).output);
    state.counters["rel_err"] = s.err;
    state.counters["err_clean"] = s.err_clean;
  }
  results()[family][n] = s;
  state.SetComplexityN(n);
  state.counters["threads"] = threads;
  state.counters["bases_used"] = static_cast<double>(r.bases_used);
  state.counters["recomputed"] = static_cast<double>(r.rows_recomputed);
  state.counters["fft_size"] = static_cast<double>(r.fft_size);
  const auto ex = results().find(kExact);
  if (ex != results().end() && ex->second.count(n) && ex->second.at(n).seconds > 0)
    state.counters["vs_exact"] = sec / ex->second.at(n).seconds;
}

void bm_recover(benchmark::State& state, Index k) {
  const Index n = state.range(0);
  set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Positional, n, n, kD, kD);
  ConvBasisOptions o;
  o.num_bases = k;
  const ConvBasisAttention<float> f(o);
  conv_basis::Basis b;
  const double sec = timed_loop(state, [&] {
    b = f.recover(w.Q, w.K);
    benchmark::DoNotOptimize(b.starts.data());
  });
  state.SetComplexityN(n);
  state.counters["bases_used"] = static_cast<double>(b.size());
  state.counters["entries_per_n"] = static_cast<double>(b.entries) / static_cast<double>(n);
  results()["conv_basis/recover/scan/float/d64/k" + std::to_string(k)][n].seconds = sec;
}

// Accuracy of Scan against k at n = 2048 on `positional` (all rows, double reference).
std::map<Index, std::pair<double, double>>& sweep() {
  static std::map<Index, std::pair<double, double>> s;
  return s;
}
void bm_errsweep(benchmark::State& state) {
  const Index n = 2048, k = state.range(0);
  const auto& w = cached_workload<float>(workloads::Kind::Positional, n, n, kD, kD);
  const auto& wc = clean_positional(n);
  ConvBasisOptions o;
  o.num_bases = k;
  const ConvBasisAttention<float> f(o);
  ConvBasisResult<float> r;
  for (auto _ : state) r = f.compute(w.Q, w.K, w.V);
  const double e = sampled_rel_error(w.Q, w.K, w.V, r.output, 0, n, true);
  const double ec =
      sampled_rel_error(wc.Q, wc.K, wc.V, f.compute(wc.Q, wc.K, wc.V).output, 0, n, true);
  state.counters["rel_err"] = e;
  state.counters["err_clean"] = ec;
  state.counters["bases_used"] = static_cast<double>(r.bases_used);
  sweep()[k] = {e, ec};
}

std::vector<Index> sizes() {
  return {1024, 2048, 4096, 8192, 16384, 32768, 65536};
}

template <typename Recovery>
void register_family(const std::string& name, Index k, bool errors) {
  ConvBasisOptions o;
  o.num_bases = k;
  const ConvBasisAttention<float, fft::Default, Recovery> f(o);
  const std::string fam = "conv_basis/" + name + "/float/d64/k" + std::to_string(k);
  auto* b = benchmark::RegisterBenchmark(fam.c_str(),
                                         [=](benchmark::State& s) { bm_conv(s, f, fam, errors); });
  for (const Index n : sizes()) b->Arg(n);
  b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oNLogN);
}

void register_all() {
  auto* e = benchmark::RegisterBenchmark(kExact.c_str(), bm_exact);
  for (const Index n : sizes()) e->Arg(n);
  e->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
  for (const Index k : {Index(4), Index(16), Index(64)})
    register_family<policy::Scan>("scan", k, true);
  register_family<policy::BinarySearch>("binary", 16, true);
  register_family<policy::Grid>("grid", 16, true);
  auto* rc = benchmark::RegisterBenchmark("conv_basis/recover/scan/float/d64/k16",
                                          [](benchmark::State& s) { bm_recover(s, 16); });
  for (const Index n : sizes()) rc->Arg(n);
  rc->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
  auto* sw = benchmark::RegisterBenchmark("conv_basis/errsweep/scan/d64/n2048", bm_errsweep);
  for (const Index k : {4, 16, 64, 256, 1024, 2048}) sw->Arg(k);
  sw->Unit(benchmark::kMillisecond)->Iterations(1);
  // ctest smoke: one tiny configuration.
  ConvBasisOptions so;
  so.num_bases = 16;
  const ConvBasisAttention<float> sf(so);
  benchmark::RegisterBenchmark("conv_basis/smoke/scan/k16", [=](benchmark::State& s) {
    bm_conv(s, sf, "conv_basis/smoke/scan/k16", true);
  })->Arg(512);
}

void print_summary() {
  const auto& res = results();
  if (res.empty() && sweep().empty()) return;
  std::printf("\nSummary (vs_exact = time / exact tiled causal time, same run and n)\n");
  std::printf("%-40s %7s %10s %9s %6s %8s %10s %10s\n", "family", "n", "ms", "vs_exact", "k_eff",
              "recomp", "err_pos", "err_clean");
  const auto ex = res.find(kExact);
  for (const auto& [fam, pts] : res) {
    Index crossover = -1;
    for (const auto& [n, s] : pts) {
      double ratio = std::nan("");
      if (ex != res.end() && ex->second.count(n) && fam != kExact)
        ratio = s.seconds / ex->second.at(n).seconds;
      if (ratio < 1) {
        if (crossover < 0) crossover = n;
      } else {
        crossover = -1;  // the crossover is where it beats exact from then on
      }
      std::printf("%-40s %7ld %10.2f %9.4f %6ld %8ld %10.3g %10.3g\n", fam.c_str(),
                  static_cast<long>(n), s.seconds * 1e3, ratio, static_cast<long>(s.bases),
                  static_cast<long>(s.recomputed), s.err, s.err_clean);
    }
    if (pts.size() >= 2) {
      std::printf("%-40s log-log slope of time vs n: %.3f (all n), %.3f (n >= 8192)\n", fam.c_str(),
                  loglog_slope(pts, 0), loglog_slope(pts, 8192));
      if (fam != kExact && fam.find("recover") == std::string::npos)
        std::printf("%-40s crossover (vs_exact < 1 from this n on): %ld\n", fam.c_str(),
                    static_cast<long>(crossover));
    }
  }
  if (!sweep().empty()) {
    std::printf("\nScan error vs k at n = 2048 (all rows): k, err_positional, err_clean\n");
    for (const auto& [k, e] : sweep())
      std::printf("  k = %5ld  %10.3g  %10.3g\n", static_cast<long>(k), e.first, e.second);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, print_summary);
}
