// Benchmarks of bf16 exact attention (policy::TiledBf16), every ratio from one run:
//   peak/amx/t<1|all>                    the bare tdpbf16ps loop (4 accumulator tiles, no loads)
//   gemm/bf16-amx/t<all>/<n>             an n x n x n bf16 GEMM through the AMX score kernel
//   gemm/float/t<all>/<n>                Eigen's float GEMM, same n
//   exact/<path>/d<d>/<full|causal>/tall/<n>   path = fp32-tiled, bf16-amx, bf16-avx512bf16,
//                                        bf16-generic; n = m
//   decode/<path>/d128/q<queries>/<m>    1..16 queries against m keys (split-KV)
//   decode-bf16kv/<path>/d128/q<q>/<m>   the same with Q, K and V stored in bf16 (bf16 paths)
//   stream/read/<bytes>                  a streaming read (sum) of as many bytes as decode reads
//   .../smoke/...                        tiny configurations for the ctest smoke run
// Counters: GFLOP/s (4 n m d per iteration; 2 flops per multiply-add for peak and GEMM), rel_err
// (relative Frobenius error of 64 sampled rows against the double Naive reference), GB/s (decode:
// bytes of K and V per call; stream: bytes summed), threads. A path the machine lacks is skipped
// with a message. After the run a summary prints the headline ratios.
#include "common.hpp"

#include <effattn/core/isa.hpp>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

using namespace effattn;
using effattn::bench::attention_gflops;
using effattn::bench::cached_workload;
using effattn::bench::sampled_rel_error;
using effattn::bench::set_threads;
using effattn::bench::timed_loop;

namespace {

using detail::Isa;

// Seconds per call by benchmark name, for the summary.
std::map<std::string, double>& times() {
  static std::map<std::string, double> t;
  return t;
}

// "fp32-tiled" is the float Tiled kernel; the others the bf16 kernel on that path.
enum class Path { Fp32, Amx, Avx512Bf16, Generic };

const char* path_name(Path p) {
  switch (p) {
    case Path::Fp32:
      return "fp32-tiled";
    case Path::Amx:
      return "bf16-amx";
    case Path::Avx512Bf16:
      return "bf16-avx512bf16";
    case Path::Generic:
      return "bf16-generic";
  }
  return "?";
}

Isa path_isa(Path p) {
  return p == Path::Amx ? Isa::Amx : p == Path::Avx512Bf16 ? Isa::Avx512Bf16 : Isa::Generic;
}

// Whether `p` runs on this machine (fp32 always; a bf16 path when its ISA is available).
bool path_runs(Path p) {
  return p == Path::Fp32 || detail::isa_available(path_isa(p));
}

// False (and the benchmark skipped with the reason) when the path is missing here.
bool path_available(benchmark::State& state, Path p) {
  if (path_runs(p)) return true;
  state.SkipWithError((std::string("bf16 path '") + detail::isa_name(path_isa(p)) +
                       "' not available on this machine")
                          .c_str());
  return false;
}

// Asks for the O(n^2) fit of a family whose path runs here. Not for a skipped one: Google
// Benchmark 1.7.1 (Debian 12) dereferences a null pointer fitting the complexity of a family
// whose runs were all skipped (bench_bf16 crashed after its first exact row on a machine without
// AMX); the skipped rows still print their reason. The smoke rows ask for the fit too, so ctest
// runs this registration on every machine.
void fit_complexity(benchmark::internal::Benchmark* b, Path p) {
  if (path_runs(p)) b->Complexity(benchmark::oNSquared);
}

// One exact-attention call on `path` (the bf16 paths through the driver, with the functor's plan).
struct Runner {
  Path path;
  ExactOptions opts;
  Matrix<float> out;
  Vector<float> lse;
  void operator()(const Matrix<float>& Q, const Matrix<float>& K, const Matrix<float>& V) {
    if (path == Path::Fp32) {
      ExactOptions fp32 = opts;
      fp32.bf16_scores = Bf16Scores::Auto;  // the fp32 Tiled kernel takes no bf16 score mode
      auto r = ExactAttention<float>(fp32).compute(Q, K, V);
      out = std::move(r.output);
      return;
    }
    const detail::TilePlan plan =
        detail::plan_bf16_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(), opts.block_q, opts.block_k);
    const float scale = static_cast<float>(detail::resolve_scale(opts.scale, Q.cols()));
    detail::tiled_attention_bf16<float>(Q, K, V, nullptr, scale, opts.causal, plan, path_isa(path),
                                        out, lse, detail::bf16_split_scores<float>(opts, Q.cols()));
  }
};

void bm_exact(benchmark::State& state, const std::string& name, Path path, Index d, bool causal,
              Bf16Scores scores = Bf16Scores::Auto) {
  if (!path_available(state, path)) return;
  const Index n = state.range(0);
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, n, n, d, d);
  Runner run{path, {}, {}, {}};
  run.opts.causal = causal;
  run.opts.bf16_scores = scores;
  const double sec = timed_loop(state, [&] {
    run(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(run.out.data());
  });
  times()[name + "/" + std::to_string(n)] = sec;
  state.SetComplexityN(n);
  state.counters["GFLOP/s"] = attention_gflops(n, n, d, d);
  state.counters["threads"] = threads;
  const Index rows = std::min<Index>(64, n);
  state.counters["rel_err"] = sampled_rel_error(w.Q, w.K, w.V, run.out, n - rows, rows, causal);
}

void bm_decode(benchmark::State& state, const std::string& name, Path path, Index queries) {
  if (!path_available(state, path)) return;
  const Index m = state.range(0), d = 128;
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, queries, m, d, d);
  Runner run{path, {}, {}, {}};
  const double sec = timed_loop(state, [&] {
    run(w.Q, w.K, w.V);
    benchmark::DoNotOptimize(run.out.data());
  });
  times()[name + "/" + std::to_string(m)] = sec;
  const double bytes = 2.0 * static_cast<double>(m * d) * sizeof(float);
  state.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
  state.counters["rel_err"] = sampled_rel_error(w.Q, w.K, w.V, run.out, 0, queries, false);
}

// Decoding with K and V stored in bf16 (as a model keeps its KV cache): the same workload as
// `bm_decode`, rounded to bf16 once (Q too), on the bf16 paths; GB/s counts the bf16 bytes, and
// the summary compares them with a streaming read of as many bytes. rel_err is against the double
// reference of the float workload, so it includes the rounding of the inputs.
void bm_decode_bf16kv(benchmark::State& state, const std::string& name, Path path, Index queries) {
  if (!path_available(state, path)) return;
  using B = Eigen::bfloat16;
  const Index m = state.range(0), d = 128;
  const int threads = set_threads(0);
  const auto& w = cached_workload<float>(workloads::Kind::Gaussian, queries, m, d, d);
  const Matrix<B> Q = w.Q.cast<B>(), K = w.K.cast<B>(), V = w.V.cast<B>();
  const ExactOptions opts;  // defaults, as `Runner` takes them
  const detail::TilePlan plan =
      detail::plan_bf16_tiles(queries, m, d, d, opts.block_q, opts.block_k);
  const float scale = static_cast<float>(detail::resolve_scale(opts.scale, d));
  Matrix<float> out;
  Vector<float> lse;
  const double sec = timed_loop(state, [&] {
    detail::tiled_attention_bf16<B>(Q, K, V, nullptr, scale, false, plan, path_isa(path), out, lse);
    benchmark::DoNotOptimize(out.data());
  });
  times()[name + "/" + std::to_string(m)] = sec;
  const double bytes = 2.0 * static_cast<double>(m * d) * sizeof(B);
  state.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
  state.counters["rel_err"] = sampled_rel_error(w.Q, w.K, w.V, out, 0, queries, false);
}

// Streaming read: the sum of `floats` floats, in parallel, the machine's read bandwidth for an
// array of the size decoding reads.
void bm_stream(benchmark::State& state, const std::string& name) {
  const Index floats = state.range(0);
  const int threads = set_threads(0);
  const Eigen::VectorXf x = Eigen::VectorXf::Ones(floats);
  const Index chunks = 64, per = (floats + chunks - 1) / chunks;
  std::vector<float> part(static_cast<std::size_t>(chunks));
  const double sec = timed_loop(state, [&] {
    detail::parallel_for_if(true, chunks, [&](Index c) {
      const Index b = c * per, e = std::min(floats, b + per);
      part[static_cast<std::size_t>(c)] = e > b ? x.segment(b, e - b).sum() : 0.0f;
    });
    benchmark::DoNotOptimize(part.data());
  });
  times()[name + "/" + std::to_string(floats)] = sec;
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(floats) * sizeof(float) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

#if EFFATTN_BF16_X86
// The bare tdpbf16ps loop on every thread (one AmxTileScope per thread).
void bm_peak(benchmark::State& state, int threads_req) {
  if (!path_available(state, Path::Amx)) return;
  const int threads = set_threads(threads_req);
  constexpr long iters = 1 << 16;
  std::vector<float> sink(static_cast<std::size_t>(threads));
  for (auto _ : state) {
    detail::parallel_for(
        threads, [] { return 0; },
        [&](Index t, int&) {
          detail::AmxTileScope tiles;
          sink[static_cast<std::size_t>(t)] = detail::amx_peak_loop(iters);
        });
    benchmark::DoNotOptimize(sink.data());
  }
  const double flops = 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iters) * threads;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

// C = A B (n x n x n) in bf16 through the AMX score kernel: A as the queries, B^T as the keys,
// 256 x 256 blocks of C in parallel (each written to a per-thread block buffer).
void bm_gemm_amx(benchmark::State& state) {
  if (!path_available(state, Path::Amx)) return;
  const Index n = state.range(0);
  const int threads = set_threads(0);
  Rng rng = make_rng(7);
  const Matrix<float> A = random_normal<float>(n, n, rng), Bt = random_normal<float>(n, n, rng);
  const Matrix<float> one = Matrix<float>::Ones(n, 1);
  detail::Bf16Panels p;
  detail::pack_bf16_panels<float>(A, Bt, one, 1.0f, p);
  const Index blk = 256, nb = (n + blk - 1) / blk;
  for (auto _ : state) {
    detail::parallel_for(
        nb * nb, [&] { return Matrix<float>(blk, blk); },
        [&](Index t, Matrix<float>& C) {
          const Index i0 = (t / nb) * blk, j0 = (t % nb) * blk;
          detail::AmxTileScope tiles;
          detail::amx_scores(p, i0 / 16, j0, std::min(blk, p.npad - i0), std::min(blk, p.mpad - j0),
                             C.data(), blk);
        });
  }
  const double nd = static_cast<double>(n);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * nd * nd * nd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}
#endif

void bm_gemm_float(benchmark::State& state) {
  const Index n = state.range(0);
  const int threads = set_threads(0);
  Rng rng = make_rng(7);
  const Matrix<float> A = random_normal<float>(n, n, rng), B = random_normal<float>(n, n, rng);
  Matrix<float> C(n, n);
  for (auto _ : state) {
    C.noalias() = A * B;
    benchmark::DoNotOptimize(C.data());
  }
  const double nd = static_cast<double>(n);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * nd * nd * nd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}

const Path kPaths[] = {Path::Fp32, Path::Amx, Path::Avx512Bf16, Path::Generic};

void register_all() {
#if EFFATTN_BF16_X86
  for (const int t : {1, 0})
    benchmark::RegisterBenchmark(t == 1 ? "peak/amx/t1" : "peak/amx/tall",
                                 [t](benchmark::State& s) { bm_peak(s, t); })
        ->UseRealTime();
  benchmark::RegisterBenchmark("gemm/bf16-amx/tall", bm_gemm_amx)
      ->Arg(2048)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
#endif
  benchmark::RegisterBenchmark("gemm/float/tall", bm_gemm_float)
      ->Arg(2048)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  for (const Index d : {64, 128})
    for (const bool causal : {false, true})
      for (const Path p : kPaths) {
        const std::string name = std::string("exact/") + path_name(p) + "/d" + std::to_string(d) +
                                 (causal ? "/causal" : "/full") + "/tall";
        auto* b = benchmark::RegisterBenchmark(
            name.c_str(), [=](benchmark::State& s) { bm_exact(s, name, p, d, causal); });
        // The slow paths stop at 16384 (fp32 at 65536 takes ~5 s per call).
        const std::int64_t max_n = p == Path::Amx ? 65536 : 16384;
        for (std::int64_t n = 1024; n <= max_n; n *= 4) b->Arg(n);
        b->Unit(benchmark::kMillisecond)->UseRealTime();
        fit_complexity(b, p);
      }
  // Small heads, where `Bf16Scores::Auto` splits the score product (three bf16 products): its
  // cost against one product and against fp32.
  for (const Index d : {16, 32})
    for (const Path p : kPaths)
      for (const bool split : {false, true}) {
        if (p == Path::Fp32 && split) continue;
        const std::string name = std::string("exact/") + path_name(p) + (split ? "-split" : "") +
                                 "/d" + std::to_string(d) + "/full/tall";
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& s) {
                                       bm_exact(s, name, p, d, false,
                                                split ? Bf16Scores::Split : Bf16Scores::Single);
                                     })
            ->Arg(4096)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (const bool kv16 : {false, true})
    for (const Index q : {1, 4, 16})
      for (const Path p : kPaths) {
        if (kv16 && p == Path::Fp32) continue;  // fp32 Tiled takes float inputs
        const std::string name = std::string(kv16 ? "decode-bf16kv/" : "decode/") + path_name(p) +
                                 "/d128/q" + std::to_string(q);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) {
          if (kv16)
            bm_decode_bf16kv(s, name, p, q);
          else
            bm_decode(s, name, p, q);
        });
        for (const std::int64_t m : {32768, 262144}) b->Arg(m);
        b->Unit(benchmark::kMillisecond)->UseRealTime();
      }
  auto* st = benchmark::RegisterBenchmark("stream/read",
                                          [](benchmark::State& s) { bm_stream(s, "stream/read"); });
  // K and V of a decode: in float, and in bf16 (as many bytes as m x 128 floats).
  for (const std::int64_t m : {32768, 262144}) st->Arg(2 * m * 128)->Arg(m * 128);
  st->Unit(benchmark::kMillisecond)->UseRealTime();
  // Smoke (ctest): every family at a tiny size.
  for (const Path p : kPaths) {
    const std::string name = std::string("exact/") + path_name(p) + "/d64/full/smoke";
    fit_complexity(benchmark::RegisterBenchmark(
                       name.c_str(), [=](benchmark::State& s) { bm_exact(s, name, p, 64, false); })
                       ->Arg(256),
                   p);
    const std::string dname = std::string("decode/") + path_name(p) + "/d128/q1/smoke";
    benchmark::RegisterBenchmark(dname.c_str(), [=](benchmark::State& s) {
      bm_decode(s, dname, p, 1);
    })->Arg(4096);
    if (p != Path::Fp32) {
      const std::string kname = std::string("decode-bf16kv/") + path_name(p) + "/d128/q16/smoke";
      benchmark::RegisterBenchmark(kname.c_str(), [=](benchmark::State& s) {
        bm_decode_bf16kv(s, kname, p, 16);
      })->Arg(4096);
    }
  }
  benchmark::RegisterBenchmark("stream/read/smoke", [](benchmark::State& s) {
    bm_stream(s, "stream/read/smoke");
  })->Arg(1 << 16);
}

// The headline ratios, from the times of this run (printed when both sides ran).
void summary() {
  const auto& t = times();
  auto ratio = [&](const std::string& slow, const std::string& fast, const char* what) {
    const auto a = t.find(slow), b = t.find(fast);
    if (a == t.end() || b == t.end() || b->second <= 0) return;
    std::printf("%-58s %6.2fx\n", what, a->second / b->second);
  };
  std::printf("\nSummary (ratios from this run):\n");
  for (const char* d : {"d64", "d128"})
    for (const char* mask : {"full", "causal"})
      for (const char* p : {"bf16-amx", "bf16-avx512bf16", "bf16-generic"}) {
        const std::string sfx = std::string("/") + d + "/" + mask + "/tall/4096";
        const std::string what = std::string(p) + " vs fp32-tiled, n = m = 4096, " + d + " " + mask;
        ratio("exact/fp32-tiled" + sfx, std::string("exact/") + p + sfx, what.c_str());
      }
  for (const char* d : {"d16", "d32"})
    for (const char* p : {"bf16-amx", "bf16-avx512bf16", "bf16-generic"}) {
      const std::string sfx = std::string("/") + d + "/full/tall/4096";
      const std::string single = std::string("exact/") + p + sfx,
                        split = std::string("exact/") + p + "-split" + sfx;
      ratio("exact/fp32-tiled" + sfx, split,
            (std::string(p) + "-split vs fp32-tiled, n = m = 4096, " + d).c_str());
      ratio(split, single,
            (std::string(p) + "-split time / one product, n = m = 4096, " + d).c_str());
    }
  // Decoding against a streaming read of as many bytes: float K and V, then bf16 (half of them).
  for (const bool kv16 : {false, true})
    for (const std::int64_t m : {32768, 262144})
      for (const char* q : {"q1", "q4", "q16"})
        for (const Path p : kPaths) {
          const auto a = t.find("stream/read/" + std::to_string((kv16 ? 1 : 2) * m * 128));
          const auto b = t.find(std::string(kv16 ? "decode-bf16kv/" : "decode/") + path_name(p) +
                                "/d128/" + q + "/" + std::to_string(m));
          if (a == t.end() || b == t.end() || b->second <= 0) continue;
          std::printf("decode%s %-16s %s m = %-7lld bandwidth / streaming read %6.1f%%\n",
                      kv16 ? ", bf16 K and V" : "", path_name(p), q, static_cast<long long>(m),
                      100.0 * a->second / b->second);
        }
}

}  // namespace

int main(int argc, char** argv) {
  return effattn::bench::run_benchmarks(argc, argv, register_all, summary);
}
