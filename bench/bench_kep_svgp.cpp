// Benchmarks of kep_svgp (placeholder until the method lands).
#include "common.hpp"

static void bm_placeholder(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(state.iterations());
}
BENCHMARK(bm_placeholder)->Name("kep_svgp/smoke/placeholder");

BENCHMARK_MAIN();
