// Benchmarks of the shared utility layer: RP-Cholesky (sequential vs accelerated vs greedy) and
// batched causal FFT convolution (vs the dense Toeplitz product). Each family registers itself
// from its own header; names containing "/smoke/" form the ctest smoke run.
#include "bench_core_fft.hpp"
#include "bench_core_rpc.hpp"
#include "common.hpp"

namespace {
void bm_smoke_noop(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(state.iterations());
}
}  // namespace

int main(int argc, char** argv) {
  effattn::bench::default_threads();
  benchmark::RegisterBenchmark("core/smoke/noop", bm_smoke_noop);
  register_rpc_benchmarks();
  register_fft_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
