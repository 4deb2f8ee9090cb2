/// \file common.hpp
/// \brief Shared helpers of the effattn benchmarks.
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include <effattn/exact.hpp>
#include <effattn/workloads.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "../examples/lm/lm_workload.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace effattn {
namespace bench {

/// A workload cached by (kind, n, m, d, dv): large inputs are generated once per process.
///
/// Real heads: with the environment variable EFFATTN_BENCH_WORKLOAD=lm:MODEL:LAYER:HEAD (see
/// examples/lm/lm_workload.hpp) every benchmark gets the Q, K, V of that head of a trained model
/// on held-out text instead of the synthetic generator: the model runs on max(n, m) bytes of
/// held-out window `seed - 1`; Q is the last n positions' queries, K and V the first m positions'
/// keys and values. Shapes with d or dv other than the models' head dimension (64) keep the
/// synthetic generator, with a message on stderr.
template <typename Scalar>
const workloads::Workload<Scalar>& cached_workload(workloads::Kind kind, Index n, Index m, Index d,
                                                   Index dv, std::uint64_t seed = 1) {
  using Key = std::tuple<int, Index, Index, Index, Index, std::uint64_t>;
  static std::map<Key, std::unique_ptr<workloads::Workload<Scalar>>> cache;
  auto& slot = cache[Key(static_cast<int>(kind), n, m, d, dv, seed)];
  if (slot) return *slot;
  lm::WorkloadSpec spec;
  const char* env = std::getenv("EFFATTN_BENCH_WORKLOAD");
  if (env && *env && lm::parse_workload(env, spec) && d == 64 && dv == 64) {
    // max(n, m) tokens of held-out window seed - 1; the queries are the last n positions (so a
    // causal n < m problem is the end of the sequence, as in decoding), the keys the first m.
    const Index L = std::max(n, m);
    const auto h = lm::real_head<Scalar>(spec, L, static_cast<Index>(seed) - 1);
    if (h.Q.cols() != d)
      throw std::invalid_argument(std::string("EFFATTN_BENCH_WORKLOAD=") + env +
                                  ": the model's head dimension is not 64");
    slot = std::make_unique<workloads::Workload<Scalar>>();
    slot->Q = h.Q.bottomRows(n);
    slot->K = h.K.topRows(m);
    slot->V = h.V.topRows(m);
    slot->kind = kind;
  } else {
    if (env && *env)
      std::fprintf(stderr,
                   "EFFATTN_BENCH_WORKLOAD=%s: d = %ld, dv = %ld is not a real head's 64: "
                   "synthetic workload for this shape\n",
                   env, static_cast<long>(d), static_cast<long>(dv));
    slot = std::make_unique<workloads::Workload<Scalar>>(
        workloads::make<Scalar>(kind, workloads::Params::shape(n, m, d, dv, seed)));
  }
  return *slot;
}

/// OpenMP's thread count when the process started (call once early in main).
inline int default_threads() {
#if defined(_OPENMP)
  static const int t = omp_get_max_threads();
  return t;
#else
  return 1;
#endif
}

/// Sets the OpenMP thread count used by effattn and Eigen (0 = the process default).
/// Returns the count now in effect.
inline int set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads > 0 ? threads : default_threads());
  Eigen::setNbThreads(omp_get_max_threads());
  return omp_get_max_threads();
#else
  (void)threads;
  return 1;
#endif
}

/// Relative Frobenius error of `approx` rows [row0, row0 + rows) against exact attention in
/// double (Naive) on those rows only, so the check stays cheap at large n.
template <typename Scalar>
double sampled_rel_error(const Matrix<Scalar>& Q, const Matrix<Scalar>& K, const Matrix<Scalar>& V,
                         const Matrix<Scalar>& approx, Index row0, Index rows, bool causal) {
  // Causal alignment is bottom-right, so a bottom block of queries keeps its offsets; any other
  // block is shifted by passing only the keys it may see.
  const Index n = Q.rows(), m = K.rows();
  const Index m_vis = causal ? row0 + rows + (m - n) : m;
  ExactOptions o;
  o.causal = causal;
  const Matrix<double> Qd = Q.middleRows(row0, rows).template cast<double>();
  const Matrix<double> Kd = K.topRows(m_vis).template cast<double>();
  const Matrix<double> Vd = V.topRows(m_vis).template cast<double>();
  const Matrix<double> ref = ExactAttention<double, policy::Naive>(o)(Qd, Kd, Vd);
  const Matrix<double> got = approx.middleRows(row0, rows).template cast<double>();
  return (got - ref).norm() / ref.norm();
}

/// Effective GFLOP/s counter for attention: 4 n m d per iteration (dense-equivalent, also for
/// causal and approximate methods, so rates compare as speed-ups).
inline benchmark::Counter attention_gflops(Index n, Index m, Index d, Index dv) {
  const double flops =
      2.0 * static_cast<double>(n) * static_cast<double>(m) * static_cast<double>(d + dv);
  return benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

/// Runs the benchmark loop over `f` and returns the wall time per iteration (the benchmarks'
/// own clock, recorded for the ratio summaries printed after the run).
template <typename F>
double timed_loop(benchmark::State& state, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t iters = 0;
  for (auto _ : state) {
    f();
    ++iters;
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return iters > 0 ? sec / static_cast<double>(iters) : 0;
}

/// Times `f.compute(Q, K, V)` with timed_loop, keeping the last result in `r`. Returns the
/// seconds per call, or -1 after marking the benchmark skipped when `r.info != Success`.
template <typename Functor, typename Result, typename Mat>
double timed_compute(benchmark::State& state, const Functor& f, const Mat& Q, const Mat& K,
                     const Mat& V, Result& r) {
  const double sec = timed_loop(state, [&] {
    r = f.compute(Q, K, V);
    benchmark::DoNotOptimize(r.output.data());
  });
  if (r.info != Info::Success) {
    state.SkipWithError("compute did not succeed");
    return -1;
  }
  return sec;
}

/// The main() of a benchmark binary with registered families and a summary printed afterwards.
inline int run_benchmarks(int argc, char** argv, void (*register_all)(), void (*summary)()) {
  default_threads();  // record OMP_NUM_THREADS before any benchmark changes it
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  summary();
  return 0;
}

/// Least-squares slope of log(seconds) against log(n) over the points of `pts` (a map from n to
/// a sample with a `seconds` member) with n >= n_min; NaN with fewer than two points.
template <typename Map>
double loglog_slope(const Map& pts, Index n_min = 0) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0, k = 0;
  for (const auto& [n, s] : pts) {
    if (s.seconds <= 0 || n < n_min) continue;
    const double x = std::log(static_cast<double>(n)), y = std::log(s.seconds);
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
    k += 1;
  }
  return k >= 2 ? (k * sxy - sx * sy) / (k * sxx - sx * sx) : std::nan("");
}

}  // namespace bench
}  // namespace effattn
