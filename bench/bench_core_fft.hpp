// FFT convolution benchmarks of bench_core: batched causal convolution Y = T(b) X (float data,
// c = 64 columns) by FFT (FFTW and Eigen's kissfft backends, FFTs in double -- the default -- and,
// for FFTW, in float) against the dense lower-triangular Toeplitz product (ConvMethod::Direct, in
// double and in float), and the Auto dispatch between them.
//
// Names: fft/conv/<fftw|eigen>/<fft precision>/c64/<n>   n = 64 ... 16384
//        fft/dense/<precision>/c64/<n>                   n = 64 ... 4096
//        fft/auto/c64/<n>                                n = 64 ... 4096
//        fft/smoke/{conv,dense}/n64                       (ctest smoke run)
// Counters: rel_err = ||Y - Y_dense||_F / ||Y_dense||_F against the dense product in double,
// not rounded to float (n <= 4096), N = transform size (0 = direct), threads.
// Run: bench_core --benchmark_filter='^fft/' (OMP_NUM_THREADS=1 for the single-core crossover).
// Measured (one thread, CPU time, c = 64, FFTW 3.3.10, loaded 2-core box): FFTW with double FFTs
// beats the double dense product from n ~ 160 (0.97x there, 0.36x at 512, 0.06x at 4096) and
// the float dense product from n ~ 256; EigenFft from n ~ 1400. fft::prefer_direct encodes this.
#pragma once
#include "common.hpp"

#include <effattn/core/random.hpp>
#include <effattn/numerics/fft.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace effattn {
namespace bench {
namespace fftbench {

constexpr Index kCols = 64;
constexpr Index kMaxDense = 4096;

/// Kernel b (n), input X (n x 64) and the dense double-precision product, cached per n.
struct ConvWorkload {
  Vector<float> b;
  Matrix<float> X;
  Matrix<double> ref;  // empty for n > kMaxDense
};

inline const ConvWorkload& workload(Index n) {
  static std::map<Index, std::unique_ptr<ConvWorkload>> cache;
  auto& slot = cache[n];
  if (!slot) {
    slot = std::make_unique<ConvWorkload>();
    Rng rng = make_rng(2024, static_cast<std::uint64_t>(n));
    slot->b.resize(n);
    slot->X.resize(n, kCols);
    for (Index i = 0; i < n; ++i) slot->b(i) = static_cast<float>(standard_normal(rng));
    for (Index j = 0; j < kCols; ++j)
      for (Index i = 0; i < n; ++i) slot->X(i, j) = static_cast<float>(standard_normal(rng));
    if (n <= kMaxDense) {  // unrounded double product (the float outputs round it)
      const std::vector<fft::ConvTerm<float>> terms = {{slot->b, 0, -1}};
      slot->ref = fft::conv_matrix<double>(n, terms).template triangularView<Eigen::Lower>() *
                  slot->X.template cast<double>();
    }
  }
  return *slot;
}

template <typename Backend, typename Real>
void bm_conv(benchmark::State& state, Index n, fft::ConvMethod method) {
  const int threads = set_threads(0);
  const ConvWorkload& w = workload(n);
  fft::ConvOptions o;
  o.method = method;
  const fft::CausalConv<float, Backend, Real> conv(w.b, o);
  Matrix<float> Y(n, kCols);
  for (auto _ : state) {
    conv.apply(w.X, Y);
    benchmark::DoNotOptimize(Y.data());
    benchmark::ClobberMemory();
  }
  state.SetComplexityN(n);
  state.counters["N"] = static_cast<double>(conv.fft_size());
  state.counters["threads"] = threads;
  if (w.ref.size() > 0) {
    const Matrix<double> d = Y.template cast<double>() - w.ref;
    state.counters["rel_err"] = d.norm() / w.ref.norm();
  }
}

template <typename Backend, typename Real>
void add(const std::string& name, Index n, fft::ConvMethod method) {
  benchmark::RegisterBenchmark(name.c_str(), [n, method](benchmark::State& st) {
    bm_conv<Backend, Real>(st, n, method);
  })->Unit(benchmark::kMicrosecond);
}

}  // namespace fftbench
}  // namespace bench
}  // namespace effattn

inline void register_fft_benchmarks() {
  using effattn::Index;
  namespace fb = effattn::bench::fftbench;
  namespace fft = effattn::fft;
  const auto Fft = fft::ConvMethod::Fft, Direct = fft::ConvMethod::Direct,
             Auto = fft::ConvMethod::Auto;
  fb::add<fft::Default, double>("fft/smoke/conv/n64", 64, Fft);
  fb::add<fft::Default, double>("fft/smoke/dense/n64", 64, Direct);
  const std::vector<Index> sizes = {64,  96,   128,  160,  192,  256,  384,
                                    512, 1024, 2048, 4096, 8192, 16384};
  for (Index n : sizes) {
    const std::string s = std::to_string(n);
#ifdef EFFATTN_USE_FFTW
    fb::add<fft::Fftw, double>("fft/conv/fftw/double/c64/" + s, n, Fft);
    fb::add<fft::Fftw, float>("fft/conv/fftw/float/c64/" + s, n, Fft);
#endif
    fb::add<fft::EigenFft, double>("fft/conv/eigen/double/c64/" + s, n, Fft);
    if (n <= fb::kMaxDense) {
      fb::add<fft::EigenFft, double>("fft/dense/double/c64/" + s, n, Direct);
      fb::add<fft::EigenFft, float>("fft/dense/float/c64/" + s, n, Direct);
      fb::add<fft::Default, double>("fft/auto/c64/" + s, n, Auto);
    }
  }
}
