// Thread safety: one const functor shared by 8 std::threads, each computing its own inputs
// several times, gives bit-identical results to sequential calls. Covers every functor of
// effattn::MethodList (options from tests/method_configs.hpp) and the
// FFTW plan cache (CausalConv objects built and executed concurrently, several sizes, so plans are
// created, shared and looked up at the same time). Run it under ThreadSanitizer with the `tsan`
// preset (OpenMP off there: libgomp is not TSan-instrumented).
#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "method_configs.hpp"
#include "test_utils.hpp"

using namespace effattn;
using effattn::testing::bitwise_equal;

namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 3;

template <typename Scalar>
struct Input {
  Matrix<Scalar> Q, K, V;
};

template <typename Scalar>
std::vector<Input<Scalar>> inputs(Index n, Index d) {
  std::vector<Input<Scalar>> in;
  for (int t = 0; t < kThreads; ++t) {
    const auto w = workloads::make<Scalar>(
        workloads::Kind::Clustered,
        workloads::Params::shape(n + 7 * t, n + 7 * t, d, d, static_cast<std::uint64_t>(t)));
    in.push_back({w.Q, w.K, w.V});
  }
  return in;
}

/// Runs f(i) for every input sequentially, then from kThreads threads at once (kRounds times
/// each, in different orders), and checks every concurrent result against the sequential one.
template <typename F>
void check_concurrent(const std::string& what, int count, F&& f) {
  using Out = decltype(f(0));
  std::vector<Out> seq;
  for (int i = 0; i < count; ++i) seq.push_back(f(i));
  std::vector<std::vector<Out>> par(kThreads);
  std::atomic<int> go{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t)
    pool.emplace_back([&, t] {
      while (go.load() == 0) std::this_thread::yield();  // start together
      for (int r = 0; r < kRounds; ++r)
        par[static_cast<std::size_t>(t)].push_back(f((t + r) % count));
    });
  go = 1;
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t)
    for (int r = 0; r < kRounds; ++r) {
      INFO(what << ": thread " << t << ", round " << r);
      CHECK(bitwise_equal(par[static_cast<std::size_t>(t)][static_cast<std::size_t>(r)],
                          seq[static_cast<std::size_t>((t + r) % count)]));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("One const functor shared by 8 threads equals sequential calls", "[threads]",
                   float, double) {
  using Scalar = TestType;
  const auto in = inputs<Scalar>(96, 16);
  const int count = static_cast<int>(in.size());
  auto at = [&](int i) -> const Input<Scalar>& { return in[static_cast<std::size_t>(i)]; };

  // Every functor of effattn::MethodList, with the moderate options of tests/method_configs.hpp.
  for_each_method<Scalar>([&](auto tag) {
    using F = typename decltype(tag)::type;
    using C = testing::MethodTestConfig<F>;
    using A = typename C::Approx;
    const A method(C::stress());
    check_concurrent(functor_traits<F>::name, count,
                     [&](int i) { return C::observed(method.compute(at(i).Q, at(i).K, at(i).V)); });
  });
}

TEMPLATE_TEST_CASE("FFT convolution: plans created and executed from 8 threads at once",
                   "[threads][fft]", float, double) {
  using Scalar = TestType;
  // Each call builds its own CausalConv (plan lookups and creation race in the cache) for one of
  // four sizes, two of them new to the cache, and convolves 5 columns.
  const std::vector<Index> sizes = {61, 128, 250, 389};
  std::vector<Matrix<Scalar>> X;
  std::vector<Vector<Scalar>> b;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    Rng rng = make_rng(77, i);
    Matrix<double> x(sizes[i], 5);
    Vector<double> k(sizes[i] / 2);
    fill_normal(x, rng);
    fill_normal(k, rng);
    X.push_back(x.cast<Scalar>());
    b.push_back(k.cast<Scalar>());
  }
  const int count = static_cast<int>(sizes.size());
  check_concurrent("fft::causal_conv", count, [&](int i) {
    fft::ConvOptions o;
    o.method = fft::ConvMethod::Fft;
    return fft::causal_conv(b[static_cast<std::size_t>(i)], X[static_cast<std::size_t>(i)], o);
  });
  // One shared const CausalConv executed concurrently on different inputs.
  std::vector<fft::ConvTerm<Scalar>> terms(2);
  terms[0].kernel = b[2];
  terms[1].kernel = b[2].head(20);
  terms[1].offset = 30;
  fft::ConvOptions o;
  o.method = fft::ConvMethod::Fft;
  const fft::CausalConv<Scalar> conv(sizes[2], terms, o);
  std::vector<Matrix<Scalar>> Y;
  for (int t = 0; t < kThreads; ++t) {
    Rng rng = make_rng(99, static_cast<std::uint64_t>(t));
    Matrix<double> y(sizes[2], 3);
    fill_normal(y, rng);
    Y.push_back(y.cast<Scalar>());
  }
  check_concurrent("shared CausalConv", kThreads,
                   [&](int i) { return conv(Y[static_cast<std::size_t>(i)]); });
}
