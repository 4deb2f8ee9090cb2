// Benchmarks of the gradients, ratios measured in one run.
//
// Names: grad/exact/float/d<d>/<full|causal>/<n>   Tiled forward + backward of exact attention;
//        grad/conv_basis/float/d64/k<k>/<n>        Conv-Basis (Grid, k bases) forward + backward;
//        grad/eva/float/d64/<full|causal>/<n>      EVA (window 64, about 64 chunks, deterministic)
//                                                  forward + backward;
//        grad/.../smoke/<n>                         the smallest size of each family (ctest).
// Every iteration runs the forward and then the backward of the same inputs, each timed with its
// own clock: the reported (manual) time is the backward's, and the counters are
//   fwd_ms, bwd_ms      mean forward / backward time per call,
//   bwd_over_fwd        backward time / forward time of the same iterations,
//   GFLOP/s             exact backward: 10 n m d dense-equivalent flops per call (5 GEMMs);
// the summary printed after the run gives, per size, the backward / forward ratios (exact, EVA),
// Conv-Basis backward against the exact causal backward at the same n, and the fitted exponent of
// the Conv-Basis backward time in n (least squares in log-log over n >= 4096).
#include "common.hpp"

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include <effattn/conv_basis.hpp>
#include <effattn/eva.hpp>

using namespace effattn;
using effattn::bench::cached_workload;
using effattn::bench::set_threads;

namespace {

struct Sample {
  double seconds = 0;      // backward seconds per call (what loglog_slope reads)
  double fwd_seconds = 0;  // forward seconds per call
};
// (family, n) -> times, for the summary.
std::map<std::string, std::map<Index, Sample>> g_samples;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs fwd() then bwd() per iteration, timing both; records the means under `family`.
template <typename Fwd, typename Bwd>
void forward_backward_loop(benchmark::State& state, const std::string& family, Index n, Fwd&& fwd,
                           Bwd&& bwd) {
  double tf = 0, tb = 0;
  std::int64_t iters = 0;
  for (auto _ : state) {
    const double t0 = now();
    fwd();
    const double t1 = now();
    bwd();
    const double t2 = now();
    state.SetIterationTime(t2 - t1);
    tf += t1 - t0;
    tb += t2 - t1;
    ++iters;
  }
  if (iters == 0) return;
  tf /= static_cast<double>(iters);
  tb /= static_cast<double>(iters);
  state.counters["fwd_ms"] = tf * 1e3;
  state.counters["bwd_ms"] = tb * 1e3;
  state.counters["bwd_over_fwd"] = tb / tf;
  state.SetComplexityN(n);
  g_samples[family][n] = Sample{tb, tf};
}

void bm_exact(benchmark::State& state, Index d, bool causal, const std::string& family) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d);
  const auto& g = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d, 2);  // dO = g.V
  ExactOptions o;
  o.causal = causal;
  const ExactAttentionf f(o);
  ExactResult<float> r;
  AttentionGradients<float> grads;
  forward_backward_loop(
      state, family, n, [&] { r = f.compute(w.Q, w.K, w.V); },
      [&] {
        grads = f.backward(w.Q, w.K, w.V, r, g.V);
        benchmark::DoNotOptimize(grads.dQ.data());
      });
  const double nn = static_cast<double>(n);
  state.counters["GFLOP/s"] = benchmark::Counter(10.0 * nn * nn * static_cast<double>(d) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

void register_exact(Index d, bool causal, Index max_n, bool smoke) {
  const std::string family =
      std::string("grad/exact/float/d") + std::to_string(d) + (causal ? "/causal" : "/full");
  const std::string name = family + (smoke ? "/smoke" : "");
  auto* b = benchmark::RegisterBenchmark(
      name.c_str(), [=](benchmark::State& s) { bm_exact(s, d, causal, family); });
  if (smoke) {
    b->Arg(256);
  } else {
    for (Index n = 1024; n <= max_n; n *= 2) b->Arg(n);
  }
  b->Unit(benchmark::kMillisecond)->UseManualTime()->Complexity(benchmark::oNSquared);
}

void bm_conv_basis(benchmark::State& state, Index k, const std::string& family) {
  const Index n = state.range(0), d = 64;
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Positional, n, n, d, d);
  const auto& g = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d, 2);  // dO = g.V
  ConvBasisOptions o;
  o.num_bases = k;
  const ConvBasisAttention<float, fft::Default, policy::Grid> f(o);
  ConvBasisResult<float> r;
  AttentionGradients<float> grads;
  forward_backward_loop(
      state, family, n, [&] { r = f.compute(w.Q, w.K, w.V); },
      [&] {
        grads = f.backward(w.Q, w.K, w.V, r, g.V);
        benchmark::DoNotOptimize(grads.dQ.data());
      });
  state.counters["threads"] = threads;
  state.counters["bases_used"] = static_cast<double>(r.bases_used);
}

void register_conv_basis(Index k, bool smoke) {
  const std::string family = "grad/conv_basis/float/d64/k" + std::to_string(k);
  const std::string name = family + (smoke ? "/smoke" : "");
  auto* b = benchmark::RegisterBenchmark(name.c_str(),
                                         [=](benchmark::State& s) { bm_conv_basis(s, k, family); });
  if (smoke) {
    b->Arg(256);
  } else {
    for (Index n = 4096; n <= 65536; n *= 2) b->Arg(n);
  }
  b->Unit(benchmark::kMillisecond)->UseManualTime()->Complexity(benchmark::oNLogN);
}

void bm_eva(benchmark::State& state, bool causal, const std::string& family) {
  const Index n = state.range(0), d = 64;
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d);
  const auto& g = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d, 2);  // dO = g.V
  EvaOptions o;
  o.causal = causal;
  o.window = 64;
  const EvaAttentionf f(o);
  EvaResult<float> r;
  EvaGradients<float> grads;
  forward_backward_loop(
      state, family, n, [&] { r = f.compute(w.Q, w.K, w.V); },
      [&] {
        grads = f.backward(w.Q, w.K, w.V, r, g.V);
        benchmark::DoNotOptimize(grads.dQ.data());
      });
  state.counters["threads"] = threads;
  state.counters["chunks"] = static_cast<double>(r.num_chunks);
}

void register_eva(bool causal, bool smoke) {
  const std::string family = std::string("grad/eva/float/d64") + (causal ? "/causal" : "/full");
  const std::string name = family + (smoke ? "/smoke" : "");
  auto* b = benchmark::RegisterBenchmark(name.c_str(),
                                         [=](benchmark::State& s) { bm_eva(s, causal, family); });
  if (smoke) {
    b->Arg(256);
  } else {
    for (Index n = 1024; n <= 16384; n *= 4) b->Arg(n);
  }
  b->Unit(benchmark::kMillisecond)->UseManualTime()->Complexity(benchmark::oN);
}

void register_all() {
  for (const bool smoke : {true, false})
    for (const bool causal : {false, true}) register_eva(causal, smoke);
  for (const bool smoke : {true, false}) register_conv_basis(16, smoke);
  for (const bool smoke : {true, false}) {
    for (const Index d : {64, 128}) {
      register_exact(d, false, smoke ? 256 : 16384, smoke);
      register_exact(d, true, d == 64 ? 65536 : 16384, smoke);
    }
  }
}

void summary() {
  if (g_samples.empty()) return;
  std::printf("\nBackward / forward time (exact Tiled, EVA; float, same iterations):\n");
  std::printf("%-36s %8s %10s %10s %8s\n", "family", "n", "fwd ms", "bwd ms", "bwd/fwd");
  for (const auto& [family, pts] : g_samples) {
    if (family.rfind("grad/exact", 0) != 0 && family.rfind("grad/eva", 0) != 0) continue;
    for (const auto& [n, s] : pts)
      std::printf("%-36s %8ld %10.2f %10.2f %8.2f\n", family.c_str(), static_cast<long>(n),
                  s.fwd_seconds * 1e3, s.seconds * 1e3, s.seconds / s.fwd_seconds);
  }
  const auto cb = g_samples.find("grad/conv_basis/float/d64/k16");
  const auto ex = g_samples.find("grad/exact/float/d64/causal");
  if (cb == g_samples.end()) return;
  std::printf("\nConv-Basis (Grid, k = 16) backward vs exact Tiled causal backward, d = 64:\n");
  std::printf("%8s %12s %12s %12s %10s\n", "n", "cb fwd ms", "cb bwd ms", "exact bwd ms",
              "speed-up");
  for (const auto& [n, s] : cb->second) {
    double exact_ms = -1;
    if (ex != g_samples.end() && ex->second.count(n)) exact_ms = ex->second.at(n).seconds * 1e3;
    std::printf("%8ld %12.2f %12.2f %12.2f %10.2f\n", static_cast<long>(n), s.fwd_seconds * 1e3,
                s.seconds * 1e3, exact_ms, exact_ms > 0 ? exact_ms / (s.seconds * 1e3) : -1.0);
  }
  std::printf("fitted exponent of the Conv-Basis backward time, n >= 4096: %.3f\n",
              effattn::bench::loglog_slope(cb->second, 4096));
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, summary);
}
