// Benchmarks of vcc (placeholder until the method lands).
#include "common.hpp"

static void bm_placeholder(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(state.iterations());
}
BENCHMARK(bm_placeholder)->Name("vcc/smoke/placeholder");

BENCHMARK_MAIN();
