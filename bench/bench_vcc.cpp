// Benchmarks of VCC (effattn/vcc.hpp) on workloads::make_smooth_vip (d = 64, n_p = 48 VIP rows,
// tau = 1/3), float, against Tiled exact attention in the same binary.
//
// Names: vcc/<twolevel|bestfirst>/<viponly|decompress|exactquery>/<n>
//          twolevel: k = 16, h = 90 (r = 48 + ceil(n_c / 16) + 1350, grows with n)
//          bestfirst: BestFirstDyadic, MeanProb, r = 2048
//        exact/tiled/<n>        full exact attention (n <= 32768)
//        exactvip/<n>           exact attention of the 48 VIP rows only (O(n_p n d))
//        vcc/smoke/...          one tiny configuration for ctest
// Counters: r_eff (keys each query attends to), vip_err (relative Frobenius error of the VIP rows
// against exact attention in double), peak_MB / largest_MB (heap bytes live at the peak and the
// largest single allocation during one compute call, glibc malloc interposition; -1 when not
// available), n_x_n_MB (what one n x n float score matrix would take, for comparison).
// Ratios: time(vcc/...) / time(exact/tiled/...) of the same run and n; the VipOnly exponent is the
// log-log slope of time against n.
#include "common.hpp"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <effattn/vcc.hpp>

#include "malloc_count.hpp"  // heap accounting (glibc malloc interposition), shared with tests

using namespace effattn;

namespace {

constexpr Index kD = 64, kVip = 48;

const workloads::SmoothVipWorkload<float>& workload(Index n) {
  static std::map<Index, std::unique_ptr<workloads::SmoothVipWorkload<float>>> cache;
  auto& slot = cache[n];
  if (!slot) {
    workloads::SmoothVipParams p;
    p.n = n;
    p.d = kD;
    p.vip = kVip;
    slot =
        std::make_unique<workloads::SmoothVipWorkload<float>>(workloads::make_smooth_vip<float>(p));
  }
  return *slot;
}

Matrix<float> vip_rows(const Matrix<float>& X, const std::vector<Index>& vip) {
  Matrix<float> R(static_cast<Index>(vip.size()), X.cols());
  for (std::size_t i = 0; i < vip.size(); ++i) R.row(static_cast<Index>(i)) = X.row(vip[i]);
  return R;
}

// Exact attention of the VIP rows in double (the error reference), cached per n.
const Matrix<double>& vip_reference(Index n) {
  static std::map<Index, Matrix<double>> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  const auto& w = workload(n);
  ExactOptions o;
  o.scale = w.scale;
  Matrix<double> ref = ExactAttention<double>(o)(vip_rows(w.Q, w.vip).cast<double>(),
                                                 w.K.cast<double>(), w.V.cast<double>());
  return cache.emplace(n, std::move(ref)).first->second;
}

template <typename F>
void track_memory(benchmark::State& state, F&& f) {
  const testing::HeapStats h = testing::track_heap(std::forward<F>(f));  // -1 when unavailable
  state.counters["peak_MB"] = h.peak < 0 ? -1.0 : static_cast<double>(h.peak) / (1 << 20);
  state.counters["largest_MB"] = h.largest < 0 ? -1.0 : static_cast<double>(h.largest) / (1 << 20);
}

template <typename Select, typename NonVip>
void bm_vcc(benchmark::State& state, Index budget) {
  const Index n = state.range(0);
  const auto& w = workload(n);
  VccOptions o;
  o.scale = w.scale;
  o.budget = budget;
  o.block_size = 16;
  o.fine_blocks = 90;
  const VccAttention<float, Select, policy::MeanProb, NonVip> f(o);
  VccResult<float> r;
  track_memory(state, [&] { r = f.compute(w.Q, w.K, w.V, w.vip); });
  for (auto _ : state) {
    r = f.compute(w.Q, w.K, w.V, w.vip);
    benchmark::DoNotOptimize(r.output.data());
  }
  if (r.info != Info::Success) state.SkipWithError("compute did not succeed");
  state.SetComplexityN(n);
  state.counters["r_eff"] = static_cast<double>(r.budget_effective);
  state.counters["n_x_n_MB"] = static_cast<double>(n) * static_cast<double>(n) * 4.0 / (1 << 20);
  const Matrix<double> got = vip_rows(r.output, w.vip).cast<double>();
  const Matrix<double>& ref = vip_reference(n);
  state.counters["vip_err"] = (got - ref).norm() / ref.norm();
}

void bm_exact(benchmark::State& state) {
  const Index n = state.range(0);
  const auto& w = workload(n);
  ExactOptions o;
  o.scale = w.scale;
  const ExactAttention<float> f(o);
  ExactResult<float> r;
  track_memory(state, [&] { r = f.compute(w.Q, w.K, w.V); });
  for (auto _ : state) {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  }
  state.SetComplexityN(n);
  state.counters["r_eff"] = static_cast<double>(n);
}

void bm_exact_vip(benchmark::State& state) {
  const Index n = state.range(0);
  const auto& w = workload(n);
  ExactOptions o;
  o.scale = w.scale;
  const ExactAttention<float> f(o);
  const Matrix<float> QP = vip_rows(w.Q, w.vip);
  ExactResult<float> r;
  for (auto _ : state) {
    r = f.compute(QP, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  }
  state.SetComplexityN(n);
  const Matrix<double>& ref = vip_reference(n);
  state.counters["vip_err"] = (r.output.cast<double>() - ref).norm() / ref.norm();
}

template <typename Select, typename NonVip>
void register_vcc(const std::string& name, Index budget, std::int64_t max_n) {
  auto* b = benchmark::RegisterBenchmark(
      name.c_str(), [budget](benchmark::State& s) { bm_vcc<Select, NonVip>(s, budget); });
  for (std::int64_t n = 1024; n <= max_n; n *= 2) b->Arg(n);
  b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t max_n = 131072;
  register_vcc<policy::TwoLevel, policy::VipOnly>("vcc/twolevel/viponly", 0, max_n);
  register_vcc<policy::TwoLevel, policy::Decompress>("vcc/twolevel/decompress", 0, max_n);
  register_vcc<policy::TwoLevel, policy::ExactQuery>("vcc/twolevel/exactquery", 0, 32768);
  register_vcc<policy::BestFirstDyadic, policy::VipOnly>("vcc/bestfirst/viponly", 2048, max_n);
  register_vcc<policy::BestFirstDyadic, policy::Decompress>("vcc/bestfirst/decompress", 2048,
                                                            max_n);
  register_vcc<policy::BestFirstDyadic, policy::ExactQuery>("vcc/bestfirst/exactquery", 2048,
                                                            65536);
  auto* e = benchmark::RegisterBenchmark("exact/tiled", bm_exact);
  for (std::int64_t n = 1024; n <= 32768; n *= 2) e->Arg(n);
  e->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oNSquared);
  auto* ev = benchmark::RegisterBenchmark("exactvip", bm_exact_vip);
  for (std::int64_t n = 1024; n <= max_n; n *= 2) ev->Arg(n);
  ev->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
  // ctest smoke: one tiny configuration.
  benchmark::RegisterBenchmark(
      "vcc/smoke/twolevel/decompress",
      [](benchmark::State& s) { bm_vcc<policy::TwoLevel, policy::Decompress>(s, 0); })
      ->Arg(1024)
      ->Unit(benchmark::kMillisecond);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
