// Benchmarks of WildCat (effattn/wildcat.hpp) against Tiled exact attention, in one binary run so
// that only within-run ratios are quoted.
//
// Names:  exact/tiled/float/d64/<n>
//         wildcat/float/d64/r<rank>/B<bins>/<n>      n = m in {1024 ... 65536}
//         wildcat-headline/float/d64/r256/B<bins>/16384     the headline configuration, B in
//                                                       {1,2,4,16}
//         shape/<biggan|t2t1|t2t2>/<exact|wildcat>     synthetic analogues of the paper's
//                                                       BigGAN and T2T-ViT attention shapes
//         wildcat-target/float/d64/r1024/t<target>/<n>  Options::target_error (rank cap 1024)
//         wildcat-bf16/float/d64/r<rank>/B1/<n>         Options::bf16_attention (n >= 4096)
//         wildcat/smoke/...                             (tiny, for ctest)
// d = dv = 64, float, every thread (OMP_NUM_THREADS); timing on the sphere workload. Counters:
//   err_sphere, err_clustered: relative Frobenius error of 256 sampled rows (the first 256)
//       against the double Naive reference, on the sphere (scale R^2 = 1) and clustered
//       (16 centres, noise 0.1) workloads of the same n; computed once per
//       configuration outside the timed loop;
//   est_error (target families): the sampled-row estimate the method reported;
//   vs_exact: time / time of exact/tiled at the same n measured earlier in this run (< 0.1 means
//       >= 10x faster); rank: coreset rows used; GFLOP/s: dense-equivalent 2 n m (d + dv).
// After the run a summary prints the ratios and the log-log slope of time against n per family.
// Example (the sweep and the headline configuration):
//   bench_wildcat --benchmark_filter='^(exact|wildcat)' --benchmark_min_time=0.2
#include "common.hpp"

#include <effattn/wildcat.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

using namespace effattn;
using effattn::bench::attention_gflops;
using effattn::bench::cached_workload;
using effattn::bench::loglog_slope;
using effattn::bench::sampled_rel_error;
using effattn::bench::set_threads;
using effattn::bench::timed_compute;
using effattn::bench::timed_loop;

namespace {

constexpr Index kD = 64;

struct Sample {
  double seconds = 0;  // per iteration
  double err_s = -1, err_c = -1;
  Index rank = 0;
};
// family -> n -> measurement (filled as benchmarks run; read by the summary).
std::map<std::string, std::map<Index, Sample>>& results() {
  static std::map<std::string, std::map<Index, Sample>> r;
  return r;
}

// Shapes: n queries, m keys, value width dv.
struct Shape {
  Index n, m, dv;
};

void bm_exact(benchmark::State& state, Shape sh, double scale, const std::string& family) {
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Sphere, sh.n, sh.m, kD, sh.dv);
  ExactOptions o;
  o.scale = scale;
  const ExactAttention<float> f(o);
  ExactResult<float> r;
  const double sec = timed_loop(state, [&] {
    r = f.compute(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.SetComplexityN(sh.m);
  state.counters["GFLOP/s"] = attention_gflops(sh.n, sh.m, kD, sh.dv);
  state.counters["threads"] = threads;
  results()[family][sh.m].seconds = sec;
}

// Relative error of 256 rows against the double reference on the given workload (untimed).
double rows_err(workloads::Kind kind, Shape sh, const WildcatAttention<float>& f, double scale) {
  const auto& w = cached_workload<float>(kind, sh.n, sh.m, kD, sh.dv);
  const Matrix<float> out = f.compute(w.Q, w.K, w.V).output;
  const Index rows = std::min<Index>(256, sh.n);
  if (scale == 0) return sampled_rel_error(w.Q, w.K, w.V, out, 0, rows, false);
  // Non-default scale (BigGAN: beta = 1): fold it into the queries of the reference.
  const Matrix<float> Qs = w.Q * static_cast<float>(scale * std::sqrt(static_cast<double>(kD)));
  return sampled_rel_error(Qs, w.K, w.V, out, 0, rows, false);
}

void bm_wildcat(benchmark::State& state, Shape sh, WildcatOptions o, const std::string& family,
                const std::string& exact_family) {
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Sphere, sh.n, sh.m, kD, sh.dv);
  const WildcatAttention<float> f(o);
  WildcatResult<float> r;
  const double sec = timed_compute(state, f, w.Q, w.K, w.V, r);
  if (sec < 0) return;
  Sample smp;
  smp.seconds = sec;
  smp.rank = r.rank;
  smp.err_s = rows_err(workloads::Kind::Sphere, sh, f, o.scale);
  smp.err_c = rows_err(workloads::Kind::Clustered, sh, f, o.scale);
  results()[family][sh.m] = smp;
  state.SetComplexityN(sh.m);
  state.counters["GFLOP/s"] = attention_gflops(sh.n, sh.m, kD, sh.dv);
  state.counters["threads"] = threads;
  state.counters["err_sphere"] = smp.err_s;
  state.counters["err_clustered"] = smp.err_c;
  state.counters["rank"] = static_cast<double>(r.rank);
  if (o.target_error > 0) state.counters["est_error"] = r.estimated_error;
  const auto ex = results().find(exact_family);
  if (ex != results().end() && ex->second.count(sh.m) && ex->second.at(sh.m).seconds > 0)
    state.counters["vs_exact"] = sec / ex->second.at(sh.m).seconds;
}

std::vector<Index> sizes() {
  return {1024, 2048, 4096, 8192, 16384, 32768, 65536};
}

WildcatOptions opts(Index rank, Index bins, double scale = 0) {
  WildcatOptions o;
  o.rank = rank;
  o.bins = bins;
  o.scale = scale;
  return o;
}

void register_all() {
  const std::string ex = "exact/tiled/float/d64";
  {
    auto* b = benchmark::RegisterBenchmark(ex.c_str(), [=](benchmark::State& s) {
      bm_exact(s, {s.range(0), s.range(0), kD}, 0, ex);
    });
    for (const Index n : sizes()) b->Arg(n);
    b->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
  }
  for (const Index rank : {Index(64), Index(256), Index(1024)}) {
    for (const Index bins : {Index(1), Index(16)}) {
      const std::string fam =
          "wildcat/float/d64/r" + std::to_string(rank) + "/B" + std::to_string(bins);
      const WildcatOptions o = opts(rank, bins);
      auto* b = benchmark::RegisterBenchmark(fam.c_str(), [=](benchmark::State& s) {
        bm_wildcat(s, {s.range(0), s.range(0), kD}, o, fam, ex);
      });
      // B = 1 at rank 1024 needs an r x m double factor (0.5 GB at m = 65536): stop at 16384.
      for (const Index n : sizes())
        if (n > rank && !(bins == 1 && rank == 1024 && n > 16384)) b->Arg(n);
      b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
    }
  }
  // Options::bf16_attention: the coreset attention's two products in bf16 (B = 1).
  for (const Index rank : {Index(256), Index(1024)}) {
    const std::string fam = "wildcat-bf16/float/d64/r" + std::to_string(rank) + "/B1";
    WildcatOptions o = opts(rank, 1);
    o.bf16_attention = true;
    auto* b = benchmark::RegisterBenchmark(fam.c_str(), [=](benchmark::State& s) {
      bm_wildcat(s, {s.range(0), s.range(0), kD}, o, fam, ex);
    });
    for (const Index n : sizes())
      if (n >= 4096 && !(rank == 1024 && n > 16384)) b->Arg(n);
    b->Unit(benchmark::kMillisecond)->UseRealTime()->Complexity(benchmark::oN);
  }
  for (const Index bins : {Index(1), Index(2), Index(4), Index(16)}) {
    const std::string fam = "wildcat-headline/float/d64/r256/B" + std::to_string(bins);
    const WildcatOptions o = opts(256, bins);
    benchmark::RegisterBenchmark(fam.c_str(),
                                 [=](benchmark::State& s) {
                                   bm_wildcat(s, {16384, 16384, kD}, o, fam, ex);
                                 })
        ->Arg(16384)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // Error targets (Options::target_error): rank cap 1024, B = 1; the rank chosen, the sampled
  // estimate (est_error) and the measured errors show what the target buys.
  for (const double target : {3e-2, 1e-2}) {
    char tag[16];
    std::snprintf(tag, sizeof tag, "t%.0e", target);
    const std::string fam = std::string("wildcat-target/float/d64/r1024/") + tag;
    WildcatOptions o = opts(1024, 1);
    o.target_error = target;
    auto* b = benchmark::RegisterBenchmark(fam.c_str(), [=](benchmark::State& s) {
      bm_wildcat(s, {s.range(0), s.range(0), kD}, o, fam, ex);
    });
    for (const Index n : {Index(4096), Index(16384)}) b->Arg(n);
    b->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  // Analogues of the paper's BigGAN and T2T-ViT shapes (synthetic tensors; the ratio is what
  // transfers).
  struct Analogue {
    const char* name;
    Shape sh;
    Index rank, bins;
    double scale;
  };
  const Analogue analogues[] = {{"biggan", {4096, 1024, 256}, 96, 8, 1.0},
                                {"t2t1", {3136, 3136, 64}, 224, 224, 0.0},
                                {"t2t2", {784, 784, 64}, 196, 196, 0.0}};
  for (const Analogue& a : analogues) {
    const std::string exf = std::string("shape/") + a.name + "/exact";
    const std::string fam = std::string("shape/") + a.name + "/wildcat";
    const Shape sh = a.sh;
    const double scale = a.scale;
    benchmark::RegisterBenchmark(exf.c_str(),
                                 [=](benchmark::State& s) { bm_exact(s, sh, scale, exf); })
        ->Arg(sh.m)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    const WildcatOptions o = opts(a.rank, a.bins, a.scale);
    benchmark::RegisterBenchmark(fam.c_str(),
                                 [=](benchmark::State& s) { bm_wildcat(s, sh, o, fam, exf); })
        ->Arg(sh.m)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // Tiny configurations for the ctest smoke run.
  for (const Index bins : {Index(1), Index(4)}) {
    const std::string fam = "wildcat/smoke/B" + std::to_string(bins);
    const WildcatOptions o = opts(32, bins);
    benchmark::RegisterBenchmark(fam.c_str(), [=](benchmark::State& s) {
      bm_wildcat(s, {256, 256, kD}, o, fam, "");
    })->Arg(256);
  }
}

void print_summary() {
  const auto& res = results();
  if (res.empty()) return;
  std::printf("\nSummary (times from this run; vs_exact = time / exact tiled time, same shape)\n");
  std::printf("%-34s %7s %10s %9s %6s %11s %11s\n", "family", "m", "ms", "vs_exact", "rank",
              "err_sphere", "err_clust");
  for (const auto& [fam, pts] : res) {
    std::string ex = "exact/tiled/float/d64";
    if (fam.rfind("shape/", 0) == 0) ex = fam.substr(0, fam.rfind('/')) + "/exact";
    for (const auto& [n, s] : pts) {
      double ratio = std::nan("");
      const auto e = res.find(ex);
      if (e != res.end() && e->second.count(n) && fam != ex)
        ratio = s.seconds / e->second.at(n).seconds;
      std::printf("%-34s %7ld %10.2f %9.4f %6ld %11.3g %11.3g\n", fam.c_str(), static_cast<long>(n),
                  s.seconds * 1e3, ratio, static_cast<long>(s.rank), s.err_s, s.err_c);
    }
    if (pts.size() >= 2)
      std::printf("%-34s log-log slope of time vs n: %.3f\n", fam.c_str(), loglog_slope(pts));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, print_summary);
}
