// Benchmarks of exact attention: Tiled vs Naive, float and double, d in {64, 128},
// n = m in {512 ... 16384} (Naive up to 8192), causal and not, plus, in the same binary, an Eigen
// GEMM (the machine's GEMM rate) and the "afternoon" baseline (materialised float scores,
// Eigen products, vectorised row softmax) so ratios can be read from one run.
//
// Names: exact/<tiled|naive>/<float|double>/d<d>/<full|causal>/t<threads|all>/<n>
//        gemm/<float|double>/t<1|all>/<n>          afternoon/float/d64/full/tall/<n>
// Counters: GFLOP/s (4 n m d per iteration, dense-equivalent), rel_err (relative Frobenius
// error of 64 sampled rows against the double Naive reference), threads.
// Ratios: python3 bench/ratios.py out.json (see docs/performance.md).
#include "common.hpp"

#include <string>
#include <vector>

using namespace effattn;
using effattn::bench::attention_gflops;
using effattn::bench::cached_workload;
using effattn::bench::sampled_rel_error;
using effattn::bench::set_threads;

namespace {

template <typename Scalar>
const char* scalar_name() {
  return std::is_same<Scalar, float>::value ? "float" : "double";
}

template <typename Scalar>
void bm_gemm(benchmark::State& state, int threads_req) {
  const Index n = state.range(0);
  const int threads = set_threads(threads_req);
  Rng rng = make_rng(7);
  const Matrix<Scalar> A = random_normal<Scalar>(n, n, rng), B = random_normal<Scalar>(n, n, rng);
  Matrix<Scalar> C(n, n);
  for (auto _ : state) {
    C.noalias() = A * B;
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  const double nd = static_cast<double>(n);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * nd * nd * nd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

template <typename Scalar, typename Policy>
void bm_exact(benchmark::State& state, Index d, bool causal, int threads_req) {
  const Index n = state.range(0);
  const int threads = set_threads(threads_req);
  const auto& w = cached_workload<Scalar>(workloads::Kind::Gaussian, n, n, d, d);
  ExactOptions o;
  o.causal = causal;
  const ExactAttention<Scalar, Policy> f(o);
  ExactResult<Scalar> r;
  for (auto _ : state) {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  }
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, d, d);
  state.counters["threads"] = threads;
  state.counters["rel_err"] = sampled_rel_error(w.Q, w.K, w.V, r.output, n - std::min<Index>(64, n),
                                                std::min<Index>(64, n), causal);
  if (r.info != Info::Success) state.SkipWithError("compute did not succeed");
}

// What one writes in an afternoon with Eigen: S = scale Q K^T in float, vectorised stable row
// softmax, O = P V. Materialises n x m floats.
void bm_afternoon(benchmark::State& state) {
  const Index n = state.range(0), d = 64;
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d);
  const float scale = 1.0f / 8.0f;
  Matrix<float> S(n, n), O(n, d);
  for (auto _ : state) {
    S.noalias() = (w.Q * scale) * w.K.transpose();
    const Eigen::VectorXf mx = S.rowwise().maxCoeff();
    S.array().colwise() -= mx.array();
    S.array() = S.array().exp();
    const Eigen::ArrayXf inv = S.rowwise().sum().array().inverse();
    O.noalias() = S * w.V;
    O.array().colwise() *= inv;
    benchmark::DoNotOptimize(O.data());
  }
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, d, d);
  state.counters["threads"] = threads;
  state.counters["rel_err"] = sampled_rel_error(w.Q, w.K, w.V, O, n - 64, 64, false);
}

std::vector<std::int64_t> sizes(std::int64_t max_n) {
  std::vector<std::int64_t> v;
  for (std::int64_t n = 512; n <= max_n; n *= 2) v.push_back(n);
  return v;
}

template <typename Scalar, typename Policy>
void register_exact(const char* policy, std::int64_t max_n, Index d, bool causal, int threads) {
  const std::string name = std::string("exact/") + policy + "/" + scalar_name<Scalar>() + "/d" +
                           std::to_string(d) + (causal ? "/causal" : "/full") + "/t" +
                           (threads == 0 ? std::string("all") : std::to_string(threads));
  auto* b = benchmark::RegisterBenchmark(
      name.c_str(), [=](benchmark::State& s) { bm_exact<Scalar, Policy>(s, d, causal, threads); });
  for (const auto n : sizes(max_n)) b->Arg(n);
  b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oNSquared);
}

}  // namespace

int main(int argc, char** argv) {
  effattn::bench::default_threads();  // record OMP_NUM_THREADS before any benchmark changes it
  for (const int t : {0, 1}) {
    const std::string tn = t == 0 ? "tall" : "t1";
    benchmark::RegisterBenchmark(("gemm/float/" + tn).c_str(),
                                 [t](benchmark::State& s) { bm_gemm<float>(s, t); })
        ->Arg(512)
        ->Arg(2048)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("gemm/double/" + tn).c_str(),
                                 [t](benchmark::State& s) { bm_gemm<double>(s, t); })
        ->Arg(512)
        ->Arg(2048)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("afternoon/float/d64/full/tall", bm_afternoon)
      ->Arg(512)
      ->Arg(1024)
      ->Arg(2048)
      ->Arg(4096)
      ->Arg(8192)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->Complexity(benchmark::oNSquared);
  for (const Index d : {64, 128}) {
    for (const bool causal : {false, true}) {
      register_exact<float, policy::Tiled>("tiled", 16384, d, causal, 0);
      register_exact<double, policy::Tiled>("tiled", 16384, d, causal, 0);
      register_exact<float, policy::Naive>("naive", 8192, d, causal, 0);
      register_exact<double, policy::Naive>("naive", 8192, d, causal, 0);
    }
  }
  // Single-thread column (A.5: always report one).
  register_exact<float, policy::Tiled>("tiled", 16384, 64, false, 1);
  register_exact<float, policy::Naive>("naive", 8192, 64, false, 1);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
