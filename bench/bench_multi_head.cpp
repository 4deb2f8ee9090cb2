// MultiHead benchmarks: prefill (B = 8, heads = 32, kv_heads = 8, d = 128) and decoding (one
// query per head against long GQA caches), each variant timed in the same benchmark iteration so
// that every ratio comes from one run:
//   prefill/<order>/<causal>/L: MultiHead exact Tiled vs the same work as a per-head loop of
//     ExactAttention calls, and vs one large single-head problem of the same flop count
//     (n = m = L sqrt(B H)); counters `GFLOP/s` (MultiHead), `x_vs_loop` (loop time / MultiHead
//     time), `of_single` (MultiHead GFLOP/s / single-head GFLOP/s), `into_of_single` (the same for
//     `compute_into` a reused output buffer: no allocation and no fresh pages per call);
//   decode/<order>/m: MultiHead vs the per-head loop and a streaming-read loop over the same K
//     and V buffers (OpenMP, vectorised sum); counters `GB/s`, `of_stream` (MultiHead bandwidth /
//     streaming bandwidth), `x_vs_loop`; decode_stream/<order>/m: the same without the per-head
//     loop (its reference takes most of decode/'s time), to iterate on the decoding kernel;
//   decode_order/tile: the same cache only summed, in the decoding kernel's order (head slice by
//     head slice over tiles of `tile` keys) vs whole rows in order: `of_rows`.
// Usage: bench_multi_head [--benchmark_filter=prefill/row] ...; smoke: --benchmark_filter=/smoke/
#include "common.hpp"

#include <effattn/multi_head.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

namespace {

using namespace effattn;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Clock = std::chrono::steady_clock;

template <typename F>
double seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Random packed activations (uniform in [-1, 1], scaled like projections).
template <typename M>
M packed(Index rows, Index cols, unsigned seed) {
  std::srand(seed);
  M x = M::Random(rows, cols);
  return x;
}

/// The per-head loop a user writes by hand: one ExactAttention call per (sequence, head) on
/// column blocks of the packed inputs, the result copied into the packed output.
template <typename MQ, typename MK>
void per_head_loop(const ExactAttentionf& f, const MQ& Q, const MK& K, const MK& V, Index B,
                   Index L_q, Index L_k, Index H, Index G, Index d, MQ& out) {
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / G);
      out.block(b * L_q, h * d, L_q, d) =
          f.compute(Q.block(b * L_q, h * d, L_q, d), K.block(b * L_k, g * d, L_k, d),
                    V.block(b * L_k, g * d, L_k, d))
              .output;
    }
}

template <typename MQ>
void bm_prefill(benchmark::State& state, bool causal, bool single) {
  const Index L = state.range(0), B = 8, H = 32, G = 8, d = 128, T = B * L;
  const bool with_single = single && L <= 512;  // n = 16 L: 550 GFLOP per call at L = 2048
  const MQ Q = packed<MQ>(T, H * d, 1), K = packed<MQ>(T, G * d, 2), V = packed<MQ>(T, G * d, 3);
  SeqOffsets cu{0};
  for (Index b = 0; b < B; ++b) cu.push_back(cu.back() + L);
  ExactOptions o;
  o.causal = causal;
  const ExactAttentionf f(o);
  const MultiHead<ExactAttentionf> mh(o, {H, G});
  // One single-head problem with the same flop count: n^2 = B H L^2.
  const Index n = static_cast<Index>(std::lround(static_cast<double>(L) * std::sqrt(B * H)));
  Matrix<float> Qs, Ks, Vs;
  if (with_single) {
    Qs = Matrix<float>::Random(n, d);
    Ks = Matrix<float>::Random(n, d);
    Vs = Matrix<float>::Random(n, d);
  }
  MQ out(T, H * d), into = MQ::Zero(T, H * d);
  double t_mh = 0, t_loop = 0, t_single = 0, t_into = 0;
  for (auto _ : state) {
    const double t = seconds([&] {
      auto r = mh.compute(Q, K, V, cu, cu);
      benchmark::DoNotOptimize(r.output.data());
    });
    state.SetIterationTime(t);
    t_mh += t;
    t_loop += seconds([&] { per_head_loop(f, Q, K, V, B, L, L, H, G, d, out); });
    if (with_single)
      t_into += seconds([&] {
        auto r = mh.compute_into(Q, K, V, into, cu, cu);
        benchmark::DoNotOptimize(into.data());
        benchmark::DoNotOptimize(r.info);
      });
    if (with_single)
      t_single += seconds([&] {
        auto r = f.compute(Qs, Ks, Vs);
        benchmark::DoNotOptimize(r.output.data());
      });
  }
  const double iters = static_cast<double>(state.iterations());
  // 4 L^2 d flops per head (2 for QK^T, 2 for PV), half of it with the causal mask.
  const double flops = (causal ? 2.0 : 4.0) * static_cast<double>(B * H * L * L * d);
  state.counters["GFLOP/s"] = flops / (t_mh / iters) * 1e-9;
  state.counters["x_vs_loop"] = t_loop / t_mh;
  if (with_single) {
    const double single_flops = (causal ? 2.0 : 4.0) * static_cast<double>(n * n * d);
    state.counters["of_single"] = (flops / t_mh) / (single_flops / t_single);
    state.counters["into_of_single"] = (flops / t_into) / (single_flops / t_single);
  }
  state.SetComplexityN(L);
}

/// Sum of every entry of K and V with the threads: the machine's streaming-read rate on the
/// same buffers.
template <typename M>
float stream_read(const M& K, const M& V) {
  float total = 0;
  const Index n = K.size();
  const float* k = K.data();
  const float* v = V.data();
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (Index c = 0; c < 64; ++c) {
    const Index b = n * c / 64, e = n * (c + 1) / 64;
    total += Eigen::Map<const Eigen::ArrayXf>(k + b, e - b).sum() +
             Eigen::Map<const Eigen::ArrayXf>(v + b, e - b).sum();
  }
  return total;
}

template <typename M>
void bm_decode(benchmark::State& state, bool with_loop) {
  const Index m = state.range(0), B = 1, H = 32, G = 8, d = 128;
  const M Q = packed<M>(B, H * d, 4), K = packed<M>(B * m, G * d, 5),
          V = packed<M>(B * m, G * d, 6);
  ExactOptions o;
  o.causal = true;
  const ExactAttentionf f(o);
  const MultiHead<ExactAttentionf> mh(o, {H, G});
  M out(B, H * d);
  double t_mh = 0, t_loop = 0, t_stream = 0;
  for (auto _ : state) {
    const double t = seconds([&] {
      auto r = mh.compute(Q, K, V, {0, B}, {0, B * m});
      benchmark::DoNotOptimize(r.output.data());
    });
    state.SetIterationTime(t);
    t_mh += t;
    if (with_loop) t_loop += seconds([&] { per_head_loop(f, Q, K, V, B, 1, m, H, G, d, out); });
    t_stream += seconds([&] { benchmark::DoNotOptimize(stream_read(K, V)); });
  }
  const double iters = static_cast<double>(state.iterations());
  const double bytes = 2.0 * static_cast<double>(K.size()) * sizeof(float);
  state.counters["GB/s"] = bytes / (t_mh / iters) * 1e-9;
  state.counters["stream_GB/s"] = bytes / (t_stream / iters) * 1e-9;
  state.counters["of_stream"] = t_stream / t_mh;
  if (with_loop) state.counters["x_vs_loop"] = t_loop / t_mh;
  state.SetComplexityN(m);
}

/// decode_order/<tile>: the cache of decode/row/32768 (G = 8, d = 128, row-major) only summed,
/// no attention, in the decoding kernel's order, split like it into 32 key ranges over the
/// threads: per tile of `tile` keys, head slice by head slice (the 512 B of kv head g of every
/// key of the tile, K then V), against whole rows in order in the same iteration. Counters
/// `GB/s` (slice order), `row_GB/s`, `of_rows` (slice / row bandwidth): what the access order
/// alone costs, whatever the arithmetic.
void bm_decode_order(benchmark::State& state) {
  const Index m = 32768, G = 8, d = 128, W = G * d, tile = state.range(0);
  const RowMat K = packed<RowMat>(m, W, 5), V = packed<RowMat>(m, W, 6);
  using Slice = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
  double t_slices = 0, t_rows = 0;
  for (auto _ : state) {
    const double t = seconds([&] {
      float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
      for (Index s = 0; s < 32; ++s) {
        const Index end = (s + 1) * m / 32;
        for (Index j0 = s * m / 32; j0 < end; j0 += tile) {
          const Index rows = std::min(tile, end - j0);  // any tile, not only divisors of m / 32
          for (Index g = 0; g < G; ++g)
            total += Slice(K.data() + j0 * W + g * d, rows, d, Eigen::OuterStride<>(W)).sum() +
                     Slice(V.data() + j0 * W + g * d, rows, d, Eigen::OuterStride<>(W)).sum();
        }
      }
      benchmark::DoNotOptimize(total);
    });
    state.SetIterationTime(t);
    t_slices += t;
    t_rows += seconds([&] { benchmark::DoNotOptimize(stream_read(K, V)); });
  }
  const double bytes = 2.0 * static_cast<double>(K.size()) * sizeof(float);
  const double iters = static_cast<double>(state.iterations());
  state.counters["GB/s"] = bytes / (t_slices / iters) * 1e-9;
  state.counters["row_GB/s"] = bytes / (t_rows / iters) * 1e-9;
  state.counters["of_rows"] = t_rows / t_slices;
}

void prefill_args(benchmark::internal::Benchmark* b) {
  b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
  for (const int L : {128, 512, 2048}) b->Arg(L);
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
  for (const int m : {4096, 16384, 32768, 65536, 131072}) b->Arg(m);
}

}  // namespace

int main(int argc, char** argv) {
  using ColMat = Matrix<float>;
  for (const bool causal : {false, true}) {
    const std::string mask = causal ? "causal" : "full";
    benchmark::RegisterBenchmark(("prefill/row/" + mask).c_str(), [causal](benchmark::State& s) {
      bm_prefill<RowMat>(s, causal, true);
    })->Apply(prefill_args);
    benchmark::RegisterBenchmark(("prefill/col/" + mask).c_str(), [causal](benchmark::State& s) {
      bm_prefill<ColMat>(s, causal, false);
    })->Apply(prefill_args);
  }
  for (const bool loop : {true, false}) {
    const std::string name = loop ? "decode/" : "decode_stream/";
    const auto row = [loop](benchmark::State& s) { bm_decode<RowMat>(s, loop); };
    const auto col = [loop](benchmark::State& s) { bm_decode<ColMat>(s, loop); };
    benchmark::RegisterBenchmark((name + "row").c_str(), row)->Apply(decode_args);
    benchmark::RegisterBenchmark((name + "col").c_str(), col)->Apply(decode_args);
  }
  benchmark::RegisterBenchmark("decode_order", bm_decode_order)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->MinTime(0.5)
      ->Arg(256)
      ->Arg(32)
      ->Arg(8)
      ->Arg(4);
  // Smoke run for ctest: the smallest sizes, one iteration each.
  benchmark::RegisterBenchmark("multi_head/smoke/prefill",
                               [](benchmark::State& s) { bm_prefill<RowMat>(s, true, false); })
      ->UseManualTime()
      ->Arg(16)
      ->Iterations(1);
  benchmark::RegisterBenchmark("multi_head/smoke/decode",
                               [](benchmark::State& s) { bm_decode<RowMat>(s, true); })
      ->UseManualTime()
      ->Arg(64)
      ->Iterations(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
