#include "test_utils.hpp"
// Tests of numerics/fft.hpp: smooth sizes, batched causal convolution (one term and sums of
// sub-convolutions with offsets) against an independent long-double Toeplitz oracle written here,
// the FFTW plan cache (statistics, concurrent planning and execution, wisdom round trip, unaligned
// arrays) and argument validation. Tolerances: see the measured values quoted next to each one.
#include <effattn/core/errors.hpp>
#include <effattn/core/random.hpp>
#include <effattn/numerics/fft.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using effattn::Index;
using effattn::Matrix;
using effattn::Vector;
namespace fft = effattn::fft;
namespace et = effattn::testing;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

template <typename Scalar>
Matrix<Scalar> gaussian(Index rows, Index cols, std::uint64_t seed) {
  effattn::Rng rng = effattn::make_rng(seed);
  Matrix<Scalar> m(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) m(i, j) = static_cast<Scalar>(effattn::standard_normal(rng));
  return m;
}

template <typename Scalar>
Vector<Scalar> gaussian_vector(Index n, std::uint64_t seed) {
  return gaussian<Scalar>(n, 1, seed).col(0);
}

/// The definition of ConvTerm, evaluated literally in long double:
/// y_i = sum_j sum_{k = s_j}^{min(i, e_j - 1)} b_j[i - k] x_k, with b_j[l] = 0 for l >= K_j.
template <typename Scalar>
Matrix<double> oracle(const std::vector<fft::ConvTerm<Scalar>>& terms, const Matrix<Scalar>& X) {
  const Index n = X.rows();
  Matrix<double> Y(n, X.cols());
  for (Index c = 0; c < X.cols(); ++c)
    for (Index i = 0; i < n; ++i) {
      long double acc = 0;
      for (const auto& t : terms) {
        const Index e = t.end == -1 ? n : t.end;
        for (Index k = t.offset; k <= std::min(i, e - 1); ++k)
          if (i - k < t.kernel.size())
            acc += static_cast<long double>(t.kernel(i - k)) * static_cast<long double>(X(k, c));
      }
      Y(i, c) = static_cast<double>(acc);
    }
  return Y;
}

/// Runs `f`, which must throw effattn::invalid_argument mentioning `needle`.
template <typename F>
void require_invalid(F&& f, const std::string& needle) {
  effattn::testing::require_invalid_argument(f, needle);
}

bool is_smooth(Index m, Index max_prime) {
  for (Index p : {2, 3, 5, 7})
    if (p <= max_prime)
      while (m % p == 0) m /= p;
  return m == 1;
}

template <typename Scalar>
std::vector<fft::ConvTerm<Scalar>> full_term(const Vector<Scalar>& b) {
  return {fft::ConvTerm<Scalar>{b, 0, -1}};
}

fft::ConvOptions with_method(fft::ConvMethod m) {
  fft::ConvOptions o;
  o.method = m;
  return o;
}

// Tolerances (relative Frobenius error vs the long-double oracle), with the largest value measured
// over every case of the single-term test in brackets: float data with double FFTs 1e-5 [3.0e-8;
// the float rounding of the output dominates]; double 1e-12 [4.9e-16 FFTW, 5.5e-16 kissfft];
// float FFTs (float or double data) 2e-6 [2.7e-7 FFTW and kissfft, ~2 eps_f]. The
// direct path meets the same bounds [3.0e-8 float, 4.3e-16 double].
template <typename Scalar, typename Real>
double tolerance() {
  if (std::is_same<Real, float>::value) return 2e-6;
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

template <typename Scalar, typename Backend, typename Real>
void check_single_term(Index n, Index cols, const Matrix<double>& ref, const Vector<Scalar>& b,
                       const Matrix<Scalar>& X) {
  const fft::CausalConv<Scalar, Backend, Real> conv(n, full_term(b),
                                                    with_method(fft::ConvMethod::Fft));
  REQUIRE(conv.uses_fft());
  CHECK(conv.fft_size() == Backend::fft_size(2 * n - 1));
  const Matrix<Scalar> Y = conv(X);
  const double err = et::rel_fro_error(Y, ref);
  INFO("backend " << Backend::name() << ", n = " << n << ", c = " << cols << ", Scalar "
                  << sizeof(Scalar) << " B, Real " << sizeof(Real) << " B: rel. error " << err);
  CHECK(err <= tolerance<Scalar, Real>());
  // The free function computes the same thing (same plans, same arithmetic).
  CHECK(et::bitwise_equal(fft::causal_conv<Backend, Real>(b, X, with_method(fft::ConvMethod::Fft)),
                          Y));
}

template <typename Scalar>
void check_single_term_all(Index n, Index cols) {
  const Vector<Scalar> b = gaussian_vector<Scalar>(n, 100 + static_cast<std::uint64_t>(n));
  const Matrix<Scalar> X = gaussian<Scalar>(n, cols, 200 + static_cast<std::uint64_t>(n + cols));
  const Matrix<double> ref = oracle(full_term(b), X);
#ifdef EFFATTN_USE_FFTW
  check_single_term<Scalar, fft::Fftw, double>(n, cols, ref, b, X);
  check_single_term<Scalar, fft::Fftw, float>(n, cols, ref, b, X);
#endif
  check_single_term<Scalar, fft::EigenFft, double>(n, cols, ref, b, X);
  check_single_term<Scalar, fft::EigenFft, float>(n, cols, ref, b, X);
  // Direct path (dense lower-triangular product).
  const double err_direct = et::rel_fro_error(fft::causal_conv_direct(b, X), ref);
  INFO("direct, n = " << n << ": rel. error " << err_direct);
  CHECK(err_direct <= tolerance<Scalar, double>());
}

}  // namespace

TEST_CASE("good_size: 7-smooth, >= n and minimal (brute force up to 5000)", "[core][fft]") {
  Index next = 1;   // smallest 7-smooth number >= n, maintained by brute force
  Index next4 = 4;  // smallest 4 x 5-smooth number >= n (EigenFft sizes)
  for (Index n = 1; n <= 5000; ++n) {
    while (!is_smooth(next, 7) || next < n) ++next;
    while (next4 % 4 != 0 || !is_smooth(next4, 5) || next4 < n) ++next4;
    const Index g = fft::good_size(n);
    if (g != next) FAIL("good_size(" << n << ") = " << g << ", brute force " << next);
    const Index g4 = fft::EigenFft::fft_size(n);
    if (g4 != next4) FAIL("EigenFft::fft_size(" << n << ") = " << g4 << ", brute force " << next4);
  }
  CHECK(fft::good_size(4099) == 4116);  // 2^2 3 7^3
  CHECK(fft::good_size(Index(1) << 40) == Index(1) << 40);
  CHECK(fft::good_size((Index(1) << 40) + 1) == 1100753141760);  // 2^25 3^8 5
  require_invalid([] { (void)fft::good_size(0); }, "good_size");
  require_invalid([] { (void)fft::good_size(-3); }, "good_size");
}

TEST_CASE("causal convolution matches the long-double Toeplitz product", "[core][fft]") {
  for (Index n : {1, 2, 3, 17, 256, 1000, 4099})
    for (Index cols : {1, 5}) {
      check_single_term_all<float>(n, cols);
      check_single_term_all<double>(n, cols);
    }
}

TEST_CASE("sums of sub-convolutions with offsets and ends match the oracle", "[core][fft]") {
  using T = fft::ConvTerm<double>;
  const Index n = 300, cols = 7;
  const Matrix<double> X = gaussian<double>(n, cols, 11);
  auto b = [](Index len, std::uint64_t seed) { return gaussian_vector<double>(len, seed); };
  // A mix of every form: per-basis sub-convolutions (end = n, kernel n - s), segments (end = next
  // start), a short kernel (window), two terms on the same input range (one spectrum group), and
  // the extreme offset n - 1; terms 2 and 4 share the offset but not the end.
  const std::vector<T> terms = {T{b(n, 1), 0, -1},        T{b(n - 40, 2), 40, -1},
                                T{b(n - 90, 3), 90, 170}, T{b(25, 4), 90, 170},
                                T{b(n - 90, 7), 90, -1},  T{b(12, 5), 170, n},
                                T{b(1, 6), n - 1, -1}};
  const Matrix<double> ref = oracle(terms, X);

  auto check = [&](const Matrix<double>& Y, double tol, const char* what) {
    const double err = et::rel_fro_error(Y, ref);
    INFO(what << ": rel. error " << err);
    CHECK(err <= tol);  // measured 4.2e-16 (FFTW), 4.9e-16 (kissfft), 3.2e-16 (direct)
  };
#ifdef EFFATTN_USE_FFTW
  const fft::CausalConv<double, fft::Fftw> c_fftw(n, terms, with_method(fft::ConvMethod::Fft));
  CHECK(c_fftw.groups() == 6);  // terms 2 and 3 share the input range [90, 170)
  // N = good_size(max_j (e_j + K_j - 1)) = good_size(300 + 300 - 1).
  CHECK(c_fftw.fft_size() == fft::good_size(2 * n - 1));
  check(c_fftw(X), 1e-12, "fftw");
#endif
  check(fft::causal_conv<fft::EigenFft>(terms, X, with_method(fft::ConvMethod::Fft)), 1e-12,
        "eigen");
  check(fft::causal_conv_direct(terms, X), 1e-12, "direct");
  check(fft::conv_matrix(n, terms).triangularView<Eigen::Lower>() * X, 1e-12, "conv_matrix");
  CHECK(
      fft::conv_matrix(n, terms).triangularView<Eigen::StrictlyUpper>().toDenseMatrix().isZero(0));
  // Weights of very different magnitudes on consecutive segments stay exact in the dense matrix
  // (no cancellation when a segment ends).
  const std::vector<T> wide = {T{Vector<double>::Constant(n, 1e10), 0, 5},
                               T{Vector<double>::Constant(n, 1e-5), 0, -1}};
  const Matrix<double> Hw = fft::conv_matrix(n, wide);
  CHECK(Hw(n - 1, 5) == 1e-5);
  CHECK(Hw(n - 1, 4) == 1e10 + 1e-5);

  // Float data, float FFTs.
  std::vector<fft::ConvTerm<float>> tf;
  for (const auto& t : terms) tf.push_back({t.kernel.cast<float>(), t.offset, t.end});
  const Matrix<float> Xf = X.cast<float>();
  const Matrix<double> ref_f = oracle(tf, Xf);
  const double err_f = et::rel_fro_error(
      fft::causal_conv<fft::Default, float>(tf, Xf, with_method(fft::ConvMethod::Fft)), ref_f);
  INFO("float FFT: rel. error " << err_f);
  CHECK(err_f <= 2e-6);  // measured 2.3e-7
}

TEST_CASE("segment form: FFT size n + L_max - 1 and equality with the per-basis form",
          "[core][fft]") {
  // Conv-Basis (Gu et al., Lemma A.13): with starts s_r and weight columns c_r (length n - s_r),
  // the segment form sum_r T(c_r) S_r V equals the per-basis form sum_r conv(bt_r, n - s_r) V with
  // bt_r = c_r - c_{r-1} (restricted to n - s_r entries) -- two different term sets, same matrix.
  using T = fft::ConvTerm<double>;
  const Index n = 512, cols = 3;
  const std::vector<Index> starts = {0, 100, 200, 300, 400, 512};
  std::vector<Vector<double>> c;
  for (std::size_t r = 0; r + 1 < starts.size(); ++r)
    c.push_back(gaussian_vector<double>(n - starts[r], 50 + r));
  std::vector<T> segment, per_basis;
  for (std::size_t r = 0; r + 1 < starts.size(); ++r) {
    segment.push_back(T{c[r], starts[r], starts[r + 1]});
    Vector<double> bt = c[r];
    if (r > 0) bt -= c[r - 1].head(n - starts[r]);
    per_basis.push_back(T{bt, starts[r], -1});
  }
  const Matrix<double> X = gaussian<double>(n, cols, 77);
  const auto opt = with_method(fft::ConvMethod::Fft);
  const fft::CausalConv<double> seg(n, segment, opt), basis(n, per_basis, opt);
  CHECK(seg.fft_size() == fft::Default::fft_size(n + 100 - 1));  // L_max = 112 -> 611
  CHECK(basis.fft_size() == fft::Default::fft_size(2 * n - 1));
  const Matrix<double> ref = oracle(segment, X);
  CHECK(et::rel_fro_error(seg(X), ref) <= 1e-12);    // measured 4.5e-16
  CHECK(et::rel_fro_error(basis(X), ref) <= 1e-12);  // measured 5.4e-16
}

TEST_CASE("Auto dispatch: direct for tiny n and many groups, FFT for large n", "[core][fft]") {
  const Vector<double> b_small = gaussian_vector<double>(64, 1);
  const Vector<double> b_large = gaussian_vector<double>(2048, 2);
  CHECK_FALSE(fft::CausalConv<double>(b_small).uses_fft());
  CHECK(fft::CausalConv<double>(b_large).uses_fft());
  CHECK(fft::CausalConv<double>(b_small).fft_size() == 0);
  // k = n bases (every column its own group, Cor. 4.5 of the paper): always direct.
  const Index n = 2048;
  std::vector<fft::ConvTerm<double>> many;
  for (Index s = 0; s < n; s += 8) many.push_back({gaussian_vector<double>(n - s, 3), s, -1});
  CHECK_FALSE(fft::CausalConv<double>(n, many).uses_fft());
  // Auto and forced paths agree.
  const Matrix<double> X = gaussian<double>(64, 2, 4);
  CHECK(et::rel_fro_error(fft::causal_conv(b_small, X),
                          fft::causal_conv(b_small, X, with_method(fft::ConvMethod::Fft))) <=
        1e-13);
}

TEST_CASE("concurrent calls on one const object give bitwise the sequential results",
          "[core][fft]") {
  const Index n = 1000, cols = 6, calls = 64;
  const Vector<float> b = gaussian_vector<float>(n, 5);
  std::vector<Matrix<float>> inputs;
  for (Index t = 0; t < calls; ++t)
    inputs.push_back(gaussian<float>(n, cols, 1000 + static_cast<std::uint64_t>(t)));
  fft::ConvOptions o = with_method(fft::ConvMethod::Fft);
  o.batch = 4;  // batches of 4 + a partial batch of 2 (exercises the per-thread plan lookup)

  auto run = [&](const auto& conv, const char* name) {
    INFO("backend " << name);
    std::vector<Matrix<float>> seq(static_cast<std::size_t>(calls));
    for (Index t = 0; t < calls; ++t)
      seq[static_cast<std::size_t>(t)] = conv(inputs[std::size_t(t)]);
    // 8 std::threads, released together, each handling every 8th input.
    std::vector<Matrix<float>> par(static_cast<std::size_t>(calls));
    std::vector<std::thread> pool;
    std::atomic<int> waiting{8};
    for (int w = 0; w < 8; ++w)
      pool.emplace_back([&, w] {
        --waiting;
        while (waiting.load() > 0) std::this_thread::yield();
        for (Index t = w; t < calls; t += 8)
          par[static_cast<std::size_t>(t)] = conv(inputs[static_cast<std::size_t>(t)]);
      });
    for (auto& th : pool) th.join();
    for (Index t = 0; t < calls; ++t)
      CHECK(et::bitwise_equal(par[std::size_t(t)], seq[std::size_t(t)]));
    // OpenMP threads calling the object, and 1 vs 2 threads inside one call.
    std::vector<Matrix<float>> omp(static_cast<std::size_t>(calls));
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1)
#endif
    for (Index t = 0; t < calls; ++t) omp[std::size_t(t)] = conv(inputs[std::size_t(t)]);
    for (Index t = 0; t < calls; ++t)
      CHECK(et::bitwise_equal(omp[std::size_t(t)], seq[std::size_t(t)]));
    const Matrix<float> one = et::with_threads(1, [&] { return conv(inputs[0]); });
    const Matrix<float> two = et::with_threads(2, [&] { return conv(inputs[0]); });
    CHECK(et::bitwise_equal(one, seq[0]));
    CHECK(et::bitwise_equal(two, seq[0]));
  };
#ifdef EFFATTN_USE_FFTW
  run(fft::CausalConv<float, fft::Fftw>(b, o), "fftw");
  run(fft::CausalConv<float, fft::Fftw, float>(b, o), "fftw/float");
#endif
  run(fft::CausalConv<float, fft::EigenFft>(b, o), "eigen");
}

#ifdef EFFATTN_USE_FFTW
TEST_CASE("FFTW plan cache: reuse, statistics and clearing", "[core][fft]") {
  const Index n = 333;  // N = good_size(665) = 672, a size no other test uses
  const Vector<double> b = gaussian_vector<double>(n, 9);
  const Matrix<double> X = gaussian<double>(n, 3, 10);
  const auto opt = with_method(fft::ConvMethod::Fft);
  fft::Fftw::clear_cache<double>();
  const fft::PlanCacheStats s0 = fft::Fftw::cache_stats<double>();
  CHECK(s0.cached == 0);
  const fft::CausalConv<double, fft::Fftw> first(b, opt);
  const Matrix<double> y1 = first(X);
  const fft::PlanCacheStats s1 = fft::Fftw::cache_stats<double>();
  CHECK(s1.created - s0.created >= 2);  // r2c + c2r for the batch (and partial-batch plans)
  CHECK(s1.cached >= 2);
  // Same size again: no new plan, only cache hits.
  const fft::CausalConv<double, fft::Fftw> second(b, opt);
  const Matrix<double> y2 = second(X);
  const fft::PlanCacheStats s2 = fft::Fftw::cache_stats<double>();
  CHECK(s2.created == s1.created);
  CHECK(s2.hits > s1.hits);
  CHECK(s2.cached == s1.cached);
  CHECK(et::bitwise_equal(y1, y2));
  // Clearing drops the cache; live objects keep their plans and still work.
  CHECK(fft::Fftw::clear_cache<double>() == s2.cached);
  CHECK(fft::Fftw::cache_stats<double>().cached == 0);
  CHECK(fft::Fftw::cache_stats<double>().alive >= 2);
  CHECK(et::bitwise_equal(second(X), y1));
}

TEST_CASE("FFTW concurrent first-use planning of equal and different sizes", "[core][fft]") {
  fft::Fftw::clear_cache<double>();
  fft::Fftw::clear_cache<float>();
  const fft::PlanCacheStats s0 = fft::Fftw::cache_stats<double>();
  const std::vector<Index> sizes = {100, 100, 257, 257, 300, 513, 100, 700};
  const Index cols = 3;
  const auto opt = with_method(fft::ConvMethod::Fft);
  std::vector<Matrix<double>> got_d(sizes.size());
  std::vector<Matrix<float>> got_f(sizes.size());
  std::vector<std::thread> pool;
  for (std::size_t w = 0; w < sizes.size(); ++w)
    pool.emplace_back([&, w] {
      const Index n = sizes[w];
      const Vector<double> b = gaussian_vector<double>(n, 20 + static_cast<std::uint64_t>(n));
      const Matrix<double> X = gaussian<double>(n, cols, 30 + static_cast<std::uint64_t>(w));
      got_d[w] = fft::causal_conv<fft::Fftw>(b, X, opt);
      got_f[w] = fft::causal_conv<fft::Fftw, float>(Vector<float>(b.cast<float>()),
                                                    Matrix<float>(X.cast<float>()), opt);
    });
  for (auto& th : pool) th.join();
  // Every plan was created exactly once (a duplicate would be created but not cached).
  const fft::PlanCacheStats s1 = fft::Fftw::cache_stats<double>();
  CHECK(s1.created - s0.created == s1.cached);
  for (std::size_t w = 0; w < sizes.size(); ++w) {
    const Index n = sizes[w];
    const Vector<double> b = gaussian_vector<double>(n, 20 + static_cast<std::uint64_t>(n));
    const Matrix<double> X = gaussian<double>(n, cols, 30 + static_cast<std::uint64_t>(w));
    CHECK(et::bitwise_equal(got_d[w], fft::causal_conv<fft::Fftw>(b, X, opt)));
    CHECK(et::rel_fro_error(got_d[w], oracle(full_term(b), X)) <= 1e-12);
    CHECK(et::rel_fro_error(got_f[w], got_d[w]) <= 2e-6);  // measured <= 2.4e-7
  }
  // The sequential re-run found every plan in the cache.
  CHECK(fft::Fftw::cache_stats<double>().created == s1.created);
  CHECK(fft::Fftw::cache_stats<double>().cached == s1.cached);
}

TEST_CASE("FFTW wisdom export/import round trip", "[core][fft]") {
  const Index n = 96;  // N = 192
  const Vector<double> b = gaussian_vector<double>(n, 40);
  const Matrix<double> X = gaussian<double>(n, 2, 41);
  fft::ConvOptions measure = with_method(fft::ConvMethod::Fft), wisdom_only = measure;
  measure.rigor = fft::Rigor::Measure;
  wisdom_only.rigor = fft::Rigor::WisdomOnly;

  (void)fft::causal_conv<fft::Fftw>(b, X, measure);  // accumulates measured wisdom
  const std::string wisdom = fft::Fftw::export_wisdom<double>();
  CHECK(wisdom.rfind("(fftw-3", 0) == 0);
  fft::Fftw::forget_wisdom<double>();
  fft::Fftw::clear_cache<double>();
  // Rigor::WisdomOnly without wisdom is an unsatisfiable option: effattn::invalid_argument (the
  // library's exception for bad input), never a bare std::runtime_error.
  require_invalid([&] { (void)fft::causal_conv<fft::Fftw>(b, X, wisdom_only); },
                  "Rigor::WisdomOnly and no wisdom");
  REQUIRE(fft::Fftw::import_wisdom<double>(wisdom));
  const Matrix<double> y = fft::causal_conv<fft::Fftw>(b, X, wisdom_only);
  CHECK(et::rel_fro_error(y, oracle(full_term(b), X)) <= 1e-12);
  CHECK_FALSE(fft::Fftw::import_wisdom<double>("not wisdom"));

  // File form, single precision.
  const std::string path = "effattn_test_fft_wisdom.txt";
  auto run_float = [&](const fft::ConvOptions& o) {
    return fft::causal_conv<fft::Fftw, float>(Vector<float>(b.cast<float>()),
                                              Matrix<float>(X.cast<float>()), o);
  };
  (void)run_float(measure);
  REQUIRE(fft::Fftw::export_wisdom_to_file<float>(path));
  fft::Fftw::forget_wisdom<float>();
  fft::Fftw::clear_cache<float>();
  CHECK_THROWS_AS(run_float(wisdom_only), effattn::invalid_argument);
  CHECK(fft::Fftw::import_wisdom_from_file<float>(path));
  CHECK_NOTHROW(run_float(wisdom_only));
  std::remove(path.c_str());
  CHECK_FALSE(fft::Fftw::import_wisdom_from_file<float>(path));
}

TEST_CASE("FFTW engine falls back to unaligned plans for misaligned arrays", "[core][fft]") {
  using Engine = fft::Fftw::Engine<double>;
  using C = std::complex<double>;
  const Index N = 64, howmany = 3, H = N / 2 + 1;
  fft::Fftw::clear_cache<double>();
  const Engine engine(N, howmany, fft::Rigor::Estimate);
  Engine::Scratch scratch = engine.make_scratch();
  const Matrix<double> x = gaussian<double>(N, howmany, 50);
  // 64-byte aligned arrays, and the same arrays shifted by one double (8 bytes: misaligned for
  // every SIMD width FFTW uses).
  std::vector<double> in_mem(std::size_t(N * howmany + 16)),
      out_mem(std::size_t(2 * H * howmany + 16)), out2_mem(out_mem.size());
  auto align64 = [](double* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<double*>((a + 63) & ~std::uintptr_t(63));
  };
  double* in_al = align64(in_mem.data());
  C* out_al = reinterpret_cast<C*>(align64(out_mem.data()));
  C* out_mis = reinterpret_cast<C*>(align64(out2_mem.data()) + 1);
  REQUIRE(effattn::detail::fftw_traits<double>::alignment_of(reinterpret_cast<double*>(out_mis)) !=
          0);
  std::copy(x.data(), x.data() + N * howmany, in_al);
  engine.forward(howmany, in_al, out_al, scratch);
  // The misaligned call needs (and creates once) its own FFTW_UNALIGNED plan.
  const Index created = fft::Fftw::cache_stats<double>().created;
  engine.forward(howmany, in_al, out_mis, scratch);
  CHECK(fft::Fftw::cache_stats<double>().created == created + 1);
  engine.forward(howmany, in_al, out_mis, scratch);
  CHECK(fft::Fftw::cache_stats<double>().created == created + 1);
  double diff = 0, scale = 0;
  for (Index i = 0; i < H * howmany; ++i) {
    diff = std::max(diff, std::abs(out_al[i] - out_mis[i]));
    scale = std::max(scale, std::abs(out_al[i]));
  }
  CHECK(diff <= 1e-14 * scale);
  // Round trip through the inverse (unnormalised: N x).
  std::vector<double> back_mem(std::size_t(N * howmany + 16));
  double* back = align64(back_mem.data()) + 1;
  engine.inverse(howmany, out_mis, back, scratch);
  for (Index i = 0; i < N * howmany; ++i)
    CHECK(back[i] / double(N) == Approx(x.data()[i]).margin(1e-13));
}
#endif

TEST_CASE("invalid arguments throw effattn::invalid_argument", "[core][fft]") {
  using T = fft::ConvTerm<double>;
  const Index n = 10;
  const Vector<double> b = gaussian_vector<double>(n, 60);
  const Matrix<double> X = gaussian<double>(n, 2, 61);
  auto make = [&](const std::vector<T>& terms) { fft::CausalConv<double> c(n, terms); };
  require_invalid([&] { make({}); }, "terms must not be empty");
  require_invalid([&] { fft::CausalConv<double> c(0, {T{b, 0, -1}}); }, "n must be >= 1");
  require_invalid([&] { make({T{b, -1, -1}}); }, "offset must be in [0, n");
  require_invalid([&] { make({T{b.head(1), n, -1}}); }, "offset must be in [0, n");
  require_invalid([&] { make({T{b.head(5), 3, 3}}); }, "end must be");
  require_invalid([&] { make({T{b.head(5), 3, n + 1}}); }, "end must be");
  require_invalid([&] { make({T{b.head(5), 3, -2}}); }, "end must be");
  require_invalid([&] { make({T{b, 3, -1}}); }, "kernel must have 1 to n - offset = 7");
  require_invalid([&] { make({T{Vector<double>(), 0, -1}}); }, "kernel must have 1 to");
  Vector<double> bad = b;
  bad(4) = kNaN;
  require_invalid([&] { make({T{b, 0, -1}, T{bad, 0, -1}}); }, "terms[1].kernel");
  const fft::CausalConv<double> conv(b, with_method(fft::ConvMethod::Fft));
  require_invalid([&] { (void)conv(Matrix<double>(n + 1, 2)); }, "X must be n x c");
  require_invalid([&] { (void)conv(Matrix<double>(n, 0)); }, "X must be n x c");
  require_invalid([&] { (void)conv(Matrix<double>(0, 0)); }, "X must be n x c");
  Matrix<double> Xnan = X;
  Xnan(3, 1) = kNaN;
  require_invalid([&] { (void)conv(Xnan); }, "X (10 x 2) contains a non-finite value");
  Matrix<double> Y(n, 3);
  require_invalid([&] { conv.apply(X, Y); }, "Y must be 10 x 2");
  require_invalid([&] { (void)fft::causal_conv(Vector<double>(n + 1), X); }, "kernel must have");
  require_invalid([&] { (void)fft::causal_conv(Matrix<double>(n, 2), X); }, "column vector");
  require_invalid([&] { (void)fft::causal_conv(b, Matrix<double>(0, 3)); }, "n must be >= 1");
  require_invalid([&] { (void)fft::conv_matrix(n, std::vector<T>{T{b, 2, -1}}); }, "conv_matrix");
  fft::ConvOptions o;
  o.batch = -1;
  require_invalid([&] { fft::CausalConv<double> c(b, o); }, "batch must be >= 0");
}
