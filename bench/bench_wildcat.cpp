// Benchmarks of wildcat (placeholder until the method lands).
#include "common.hpp"

static void bm_placeholder(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(state.iterations());
}
BENCHMARK(bm_placeholder)->Name("wildcat/smoke/placeholder");

BENCHMARK_MAIN();
