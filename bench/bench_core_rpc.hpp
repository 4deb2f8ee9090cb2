// RP-Cholesky benchmarks of bench_core: sequential vs accelerated (block, rejection sampling)
// RPCholesky, with greedy pivoting for reference, on the exp-dot kernel exp(<k, k'> / sqrt(d))
// over the keys of a workload (float input, selection in double).
//
// Names: rpc/<seq|acc|greedy>/<kind>/m<m>/r<r>/t<1|all>     (time per call in ms)
//        rpc/smoke/<seq|acc|greedy>/m256/r16                 (ctest smoke run)
// Grid: m in {4096, 16384, 65536} x r in {64, 256, 1024}, d = 64, clustered keys, all threads;
// plus the acceptance configuration m = 16384, r = 256 with gaussian keys and 1 / all threads.
// Every iteration uses a different seed (1000 + iteration), so the counters are means over
// seeds: rel_resid_trace (final residual trace / initial trace, the quality both random rules
// must share in expectation), pivots (pivots taken), blocks (accelerated block updates),
// accept_rate (pivots / candidates proposed), seeds (iterations), threads.
// Speed-ups are ratios of the seq and acc rows of one run (same process, same load).
#pragma once
#include <effattn/numerics/rp_cholesky.hpp>

#include <string>
#include <type_traits>

#include "common.hpp"

namespace effattn {
namespace bench {

template <typename Rule>
const char* rpc_rule_name() {
  if constexpr (std::is_same_v<Rule, policy::RandomlyPivoted>)
    return "seq";
  else if constexpr (std::is_same_v<Rule, policy::AcceleratedRandomlyPivoted>)
    return "acc";
  else
    return "greedy";
}

template <typename Rule>
void bm_rpc(benchmark::State& state, workloads::Kind kind, Index m, Index r, Index d,
            int threads_req) {
  const int threads = set_threads(threads_req);
  const auto& w = cached_workload<float>(kind, m, m, d, d);
  const ExpDotKernel<float> kernel(w.K, 1.0 / std::sqrt(static_cast<double>(d)));
  RpCholeskyOptions o;
  o.rank = r;
  double rel = 0, pivots = 0, blocks = 0, proposals = 0;
  std::uint64_t seeds = 0;
  for (auto _ : state) {
    o.seed = 1000 + seeds;
    const auto res = rp_cholesky<Rule>(kernel, o);
    benchmark::DoNotOptimize(res.factor.data());
    if (res.info != Info::Success) state.SkipWithError("RPCholesky did not succeed");
    rel += res.relative_residual_trace();
    pivots += static_cast<double>(res.rank());
    blocks += static_cast<double>(res.blocks);
    proposals += static_cast<double>(res.proposals);
    ++seeds;
  }
  const double n = static_cast<double>(seeds);
  state.counters["rel_resid_trace"] = rel / n;
  state.counters["pivots"] = pivots / n;
  state.counters["blocks"] = blocks / n;
  state.counters["accept_rate"] = proposals > 0 ? pivots / proposals : 0.0;
  state.counters["seeds"] = n;
  state.counters["threads"] = threads;
}

template <typename Rule>
void register_rpc(workloads::Kind kind, Index m, Index r, int threads) {
  const std::string name = std::string("rpc/") + rpc_rule_name<Rule>() + "/" +
                           workloads::name(kind) + "/m" + std::to_string(m) + "/r" +
                           std::to_string(r) + "/t" +
                           (threads > 0 ? std::to_string(threads) : "all");
  benchmark::RegisterBenchmark(name.c_str(), bm_rpc<Rule>, kind, m, r, Index(64), threads)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace bench
}  // namespace effattn

inline void register_rpc_benchmarks() {
  using namespace effattn;
  using bench::register_rpc;
  using Seq = policy::RandomlyPivoted;
  using Acc = policy::AcceleratedRandomlyPivoted;
  using Greedy = policy::GreedyPivoted;
  // Smoke: the smallest configuration of each rule.
  const auto smoke = [](auto rule, const char* tag) {
    using Rule = decltype(rule);
    benchmark::RegisterBenchmark((std::string("rpc/smoke/") + tag + "/m256/r16").c_str(),
                                 bench::bm_rpc<Rule>, workloads::Kind::Clustered, Index(256),
                                 Index(16), Index(64), 0)
        ->Unit(benchmark::kMillisecond);
  };
  smoke(Seq{}, "seq");
  smoke(Acc{}, "acc");
  smoke(Greedy{}, "greedy");
  // The headline configuration first, then the grid.
  for (const auto kind : {workloads::Kind::Gaussian, workloads::Kind::Clustered})
    for (const int t : {1, 0}) {
      if (kind == workloads::Kind::Clustered && t == 0) continue;  // in the grid below
      register_rpc<Seq>(kind, 16384, 256, t);
      register_rpc<Acc>(kind, 16384, 256, t);
    }
  for (const Index m : {Index(4096), Index(16384), Index(65536)})
    for (const Index r : {Index(64), Index(256), Index(1024)}) {
      register_rpc<Seq>(workloads::Kind::Clustered, m, r, 0);
      register_rpc<Acc>(workloads::Kind::Clustered, m, r, 0);
      register_rpc<Greedy>(workloads::Kind::Clustered, m, r, 0);
    }
}
