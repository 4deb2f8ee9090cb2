// Benchmarks of effattn/kv_press.hpp: the time to press a prompt of m rows (one key/value head,
// d = dv = 64, the queries of two query heads guiding the query-guided presses), and one decoding
// step (the new queries of the two heads) against the pressed cache through
// `weighted_attention`, beside the same step against the full cache with exact attention.
//
//   compress/<press>/keep<pct>/<m>   counters: rows (cache rows), rel_error (the decoding step's
//                                    output against exact attention over the full cache)
//   decode/<press>/keep<pct>/<m>     one step over the pressed cache (weighted_attention)
//   decode-rows/<press>/keep<pct>/<m> one step of exact attention over the rows a selection press
//                                    kept (how effattn-lm decodes with those presses)
//   decode/exact/<m>                 one step over the full cache (ExactAttention, decoding form)
//   .../smoke/...                    the same at m = 512 (ctest)
//
// After the run a summary prints, per m, each press's decoding speed-up over exact attention in
// the same run.
#include "common.hpp"

#include <effattn/kv_press.hpp>

#include <map>
#include <string>
#include <vector>

namespace {

using namespace effattn;
using bench::cached_workload;

constexpr Index kD = 64, kGroup = 2;

struct Sample {
  double seconds = 0;
};
std::map<std::string, std::map<Index, Sample>> g_decode;  // press -> m -> step time

/// The prompt (m rows of one kv head), the group's prompt queries (2 heads x m rows) and the
/// decoding step's queries (2 rows), from the clustered workload.
struct Prompt {
  Matrix<float> K, V, Qp, Qnew;
};
const Prompt& prompt(Index m) {
  static std::map<Index, Prompt> cache;
  Prompt& p = cache[m];
  if (p.K.size() > 0) return p;
  const auto& w =
      cached_workload<float>(workloads::Kind::Clustered, kGroup * m + kGroup, m, kD, kD);
  p.K = w.K;
  p.V = w.V;
  p.Qp = w.Q.topRows(kGroup * m);
  p.Qnew = w.Q.bottomRows(kGroup);
  return p;
}

KvPressOptions press_options(kv_press::Kind k, double keep) {
  KvPressOptions o;
  o.press = k;
  o.keep = keep;
  o.query_heads = kGroup;
  return o;
}

/// The queries a press reads (KvPress::queries_read), the two heads stacked, as effattn-lm
/// passes them.
Matrix<float> press_queries(const Prompt& p, const KvPress<float>& press, Index m) {
  const Index w = press.queries_read(m);
  Matrix<float> Q(kGroup * w, kD);
  for (Index h = 0; h < kGroup; ++h) Q.middleRows(h * w, w) = p.Qp.middleRows(h * m + m - w, w);
  return Q;
}

void bm_compress(benchmark::State& state, kv_press::Kind k, double keep, Index m) {
  const Prompt& p = prompt(m);
  const KvPress<float> press(press_options(k, keep));
  const Matrix<float> Q = press_queries(p, press, m);
  CompressedKV<float> c;
  bench::timed_loop(state, [&] {
    c = press.compress(p.K, p.V, Q);
    benchmark::DoNotOptimize(c.keys.data());
  });
  state.counters["rows"] = static_cast<double>(c.size());
  if (c.size() > 0) {
    const Matrix<float> got = weighted_attention(p.Qnew, c).output;
    const Matrix<float> ref = ExactAttentionf()(p.Qnew, p.K, p.V);
    state.counters["rel_error"] = (got - ref).norm() / ref.norm();
  }
}

void bm_decode(benchmark::State& state, kv_press::Kind k, double keep, Index m) {
  const Prompt& p = prompt(m);
  const KvPress<float> press(press_options(k, keep));
  CompressedKV<float> c = press.compress(p.K, p.V, press_queries(p, press, m));
  c.append(p.K.bottomRows(1), p.V.bottomRows(1));  // the step's own key: never an empty cache
  const WildcatAttentionf wild;
  const double sec = bench::timed_loop(state, [&] {
    auto r = wild.weighted_attention(p.Qnew, c);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.counters["rows"] = static_cast<double>(c.size());
  state.counters["GFLOP/s"] = bench::attention_gflops(kGroup, c.size(), kD, kD);
  g_decode[std::string(kv_press::name(k)) + "/keep" + std::to_string(std::lround(keep * 100))][m]
      .seconds = sec;
}

/// One decoding step with exact attention over the rows a selection press kept (weight 1,
/// log-scale 0: plain keys and values), as effattn-lm decodes with those presses.
void bm_decode_rows(benchmark::State& state, kv_press::Kind k, double keep, Index m) {
  const Prompt& p = prompt(m);
  const KvPress<float> press(press_options(k, keep));
  const CompressedKV<float> c = press.compress(p.K, p.V, press_queries(p, press, m));
  Matrix<float> K(c.size() + 1, kD), V(c.size() + 1, kD);
  K << c.keys, p.K.bottomRows(1);
  V << c.values, p.V.bottomRows(1);
  const ExactAttentionf exact;
  const double sec = bench::timed_loop(state, [&] {
    auto r = exact.compute(p.Qnew, K, V);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.counters["rows"] = static_cast<double>(K.rows());
  g_decode[std::string(kv_press::name(k)) + "/keep" + std::to_string(std::lround(keep * 100)) +
           " (exact kernel)"][m]
      .seconds = sec;
}

void bm_decode_exact(benchmark::State& state, Index m) {
  const Prompt& p = prompt(m);
  const ExactAttentionf exact;
  const double sec = bench::timed_loop(state, [&] {
    auto r = exact.compute(p.Qnew, p.K, p.V);
    benchmark::DoNotOptimize(r.output.data());
  });
  state.counters["GFLOP/s"] = bench::attention_gflops(kGroup, m, kD, kD);
  g_decode["exact"][m].seconds = sec;
}

void register_all() {
  const auto add = [](const std::string& tag, Index m) {
    const std::string size = tag + std::to_string(m);
    benchmark::RegisterBenchmark(("decode/exact/" + size).c_str(), bm_decode_exact, m)
        ->Unit(benchmark::kMicrosecond);
    for (const auto k : kv_press::all())
      for (const double keep : {0.1, 0.25}) {
        const std::string name = std::string(kv_press::name(k)) + "/keep" +
                                 std::to_string(std::lround(keep * 100)) + "/" + size;
        benchmark::RegisterBenchmark(("compress/" + name).c_str(), bm_compress, k, keep, m)
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("decode/" + name).c_str(), bm_decode, k, keep, m)
            ->Unit(benchmark::kMicrosecond);
        if (k != kv_press::Kind::Wildcat && k != kv_press::Kind::Vcc && k != kv_press::Kind::Drop)
          benchmark::RegisterBenchmark(("decode-rows/" + name).c_str(), bm_decode_rows, k, keep, m)
              ->Unit(benchmark::kMicrosecond);
      }
  };
  add("smoke/", 512);
  for (const Index m : {2048, 8192}) add("", m);
}

void print_summary() {
  const auto ex = g_decode.find("exact");
  if (ex == g_decode.end()) return;
  std::printf(
      "\ndecoding step over the pressed cache: speed-up over exact attention over the "
      "full cache (same run)\n");
  for (const auto& [name, per_m] : g_decode) {
    if (name == "exact") continue;
    std::printf("  %-18s", name.c_str());
    for (const auto& [m, s] : per_m) {
      const auto e = ex->second.find(m);
      if (e != ex->second.end() && s.seconds > 0)
        std::printf("  m = %ld: %.2fx", static_cast<long>(m), e->second.seconds / s.seconds);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, print_summary);
}
