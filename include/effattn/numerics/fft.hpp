/// \file fft.hpp
/// \brief FFT backends (FFTW with a plan cache, Eigen's kissfft) and batched causal convolution
/// y = sum_j T(b_j) P_j X, the operation Conv-Basis attention is built on.
///
/// **Backends** are policy types with a nested `Engine<Real>` (batched real FFTs of one size) and
/// `fft_size(m)` (the transform size used for a linear convolution needing m samples):
/// - `fft::Fftw` (needs `EFFATTN_USE_FFTW`; fftw for double, fftwf for float). Plans come from a
///   process-wide cache keyed by precision, size, batch, layout, direction, alignment class and
///   planner flags; planning, destruction and wisdom calls hold one mutex, execution uses the
///   new-array functions without it. Sizes are padded to `good_size` (2^a 3^b 5^c 7^d). Licence:
///   FFTW is GPL-2+ (or commercial); binaries using this backend inherit its terms.
/// - `fft::EigenFft` (always available; Eigen's unsupported kissfft, MPL-2). Sizes are
///   4 x (2^a 3^b 5^c) because kissfft has fast radix-2/3/4/5 butterflies and a fast real
///   transform only for multiples of 4. 5-8x slower than FFTW (double, bench_core).
/// - `fft::Default` is `Fftw` when `EFFATTN_USE_FFTW` is defined, else `EigenFft`.
///
/// **Alignment**: FFTW's new-array execute needs arrays aligned like the planning arrays. Every
/// scratch array here is 64-byte aligned (>= FFTW's SIMD alignment on all ISAs); an engine given
/// other pointers checks `fftw_alignment_of` and then uses a separate FFTW_UNALIGNED plan (slower,
/// still correct).
///
/// **Precision**: `Real` (the FFT precision) is double by default even for float data, because
/// FFT round-off is absolute, about eps_Real * ||b||_2 ||x||_2 per output (see convbasis spec P5);
/// measured: relative errors ~1e-16 (double) and ~1e-7 (float FFTs).
#pragma once

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unsupported/Eigen/FFT>

#include "../core/checks.hpp"
#include "../core/errors.hpp"
#include "../core/parallel.hpp"
#include "../core/types.hpp"

#ifdef EFFATTN_USE_FFTW
#include "../detail/fftw_traits.hpp"
#endif

namespace effattn {
namespace fft {

namespace detail {
using namespace ::effattn::detail;

template <typename T>
struct identity {
  using type = T;
};
template <typename T>
using identity_t = typename identity<T>::type;  ///< blocks template argument deduction

template <typename T>
constexpr bool dependent_false_v = false;

/// Smallest m >= n whose prime factors are all in {2, 3, 5} (max_prime = 5) or {2, 3, 5, 7}.
inline Index smooth_size(Index n, Index max_prime) {
  EFFATTN_CHECK(n >= 1 && n <= (Index(1) << 60),
                cat("fft::good_size: n must be in [1, 2^60]; got ", n));
  Index best = 1;
  while (best < n) best *= 2;  // the power of two is a candidate
  for (Index p7 = 1; p7 < best; p7 *= (max_prime >= 7 ? 7 : best))
    for (Index p5 = p7; p5 < best; p5 *= 5)
      for (Index p3 = p5; p3 < best; p3 *= 3) {
        Index m = p3;
        while (m < n) m *= 2;
        best = std::min(best, m);
      }
  return best;
}

/// N log2 N (for cost models), with log2 clamped at 1.
inline double n_log2_n(Index N) {
  const double x = static_cast<double>(N);
  return x * std::max(1.0, std::log2(x));
}

/// 64-byte aligned, uninitialised array of trivially copyable T (64 >= FFTW's SIMD alignment).
template <typename T>
class AlignedBuffer {
 public:
  static constexpr std::size_t kAlign = 64;
  explicit AlignedBuffer(Index count = 0)
      : m_data(count > 0
                   ? static_cast<T*>(::operator new(static_cast<std::size_t>(count) * sizeof(T),
                                                    std::align_val_t(kAlign)))
                   : nullptr) {}
  T* data() const { return m_data.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(kAlign)); }
  };
  std::unique_ptr<T, Free> m_data;
};
}  // namespace detail

/// Smallest 2^a 3^b 5^c 7^d >= n (n >= 1). FFTW is fastest on these sizes; a prime size near
/// 8192 is ~17x slower than 8192 (PERF_ANCHORS C). O(log^4 n).
/// \throws effattn::invalid_argument if n < 1 or n > 2^60.
inline Index good_size(Index n) {
  return detail::smooth_size(n, 7);
}

/// Planner rigor (FFTW only; `EigenFft` ignores it). Estimate never touches data and is the
/// default; Measure/Patient time candidate plans (seconds for large batches) and pay off only
/// with wisdom; WisdomOnly = measure-level plan from imported wisdom, else std::runtime_error.
enum class Rigor { Estimate, Measure, Patient, WisdomOnly };

/// Statistics of one precision's FFTW plan cache.
struct PlanCacheStats {
  Index cached = 0;   ///< plans currently in the cache
  Index created = 0;  ///< plans created since process start
  Index hits = 0;     ///< lookups answered from the cache since process start
  Index alive = 0;    ///< plans not yet destroyed (cached or held by engines)
};

#ifdef EFFATTN_USE_FFTW
namespace detail {
inline unsigned fftw_flags(Rigor r) {
  switch (r) {
    case Rigor::Measure:
      return FFTW_MEASURE;
    case Rigor::Patient:
      return FFTW_PATIENT;
    case Rigor::WisdomOnly:
      return FFTW_MEASURE | FFTW_WISDOM_ONLY;
    case Rigor::Estimate:
      break;
  }
  return FFTW_ESTIMATE;
}

}  // namespace detail
#endif

/// FFTW backend: fftw (double) / fftwf (float) with the process-wide plan cache. Requires
/// `EFFATTN_USE_FFTW` (and linking fftw3 + fftw3f); otherwise using it is a compile error.
struct Fftw {
#ifdef EFFATTN_USE_FFTW
  /// Batched real FFT engine in precision Real (float or double).
  template <typename Real>
  class Engine : public ::effattn::detail::FftwEngine<Real> {
   public:
    /// The cached r2c/c2r plans of size `size` batched `batch` times, planned with `rigor`.
    /// \throws std::runtime_error if FFTW returns no plan (Rigor::WisdomOnly without wisdom).
    Engine(Index size, Index batch, Rigor rigor)
        : ::effattn::detail::FftwEngine<Real>(size, batch, detail::fftw_flags(rigor)) {}
  };
#else
  template <typename Real>
  struct Engine {
    static_assert(detail::dependent_false_v<Real>,
                  "effattn: fft::Fftw needs FFTW. Define EFFATTN_USE_FFTW and link fftw3 and "
                  "fftw3f (CMake option EFFATTN_WITH_FFTW=ON), or use fft::EigenFft.");
    // Members so that the static_assert is the only diagnostic.
    using Complex = std::complex<Real>;
    struct Scratch {};
    Engine(Index, Index, Rigor) {}
    Scratch make_scratch() const { return {}; }
    void forward(Index, const Real*, Complex*, Scratch&) const {}
    void inverse(Index, Complex*, Real*, Scratch&) const {}
  };
#endif
  /// Transform size for a linear convolution needing `m` samples: `good_size(m)`.
  static Index fft_size(Index m) {
    return good_size(m);
  }
  /// Cost of one size-N real transform relative to one n^2 step of the direct product (fitted).
  static double transform_cost(Index N) {
    return 5.0 * detail::n_log2_n(N);
  }
  /// Short name for labels.
  static const char* name() {
    return "fftw";
  }

  /// Statistics of the plan cache of precision Real.
  template <typename Real>
  static PlanCacheStats cache_stats() {
    check_available<Real>();
    PlanCacheStats s;
#ifdef EFFATTN_USE_FFTW
    const auto& c = detail::fftw_counters<Real>();
    s.cached = detail::FftwPlanCache<Real>::instance().size();
    s.created = c.created;
    s.hits = c.hits;
    s.alive = c.alive;
#endif
    return s;
  }
  /// Drops every cached plan of precision Real (engines keep theirs until destroyed). Returns
  /// the number dropped. Later engines re-plan (cheaply with Estimate or with wisdom).
  template <typename Real>
  static Index clear_cache() {
    check_available<Real>();
#ifdef EFFATTN_USE_FFTW
    return detail::FftwPlanCache<Real>::instance().clear();
#else
    return 0;
#endif
  }
  /// All accumulated wisdom of precision Real as FFTW's text format ("" on failure).
  template <typename Real>
  static std::string export_wisdom() {
    check_available<Real>();
    std::string out;
#ifdef EFFATTN_USE_FFTW
    detail::with_fftw_planner_lock([&] {
      char* s = detail::fftw_traits<Real>::export_wisdom_to_string();
      if (s != nullptr) out = s;
      std::free(s);  // FFTW 3.3: the caller frees it with free()
    });
#endif
    return out;
  }
  /// Adds wisdom from a string made by `export_wisdom`. Returns false if FFTW rejects it.
  template <typename Real>
  static bool import_wisdom(const std::string& wisdom) {
    check_available<Real>();
#ifdef EFFATTN_USE_FFTW
    return detail::with_fftw_planner_lock(
        [&] { return detail::fftw_traits<Real>::import_wisdom_from_string(wisdom.c_str()) != 0; });
#else
    (void)wisdom;
    return false;
#endif
  }
  /// Writes the wisdom of precision Real to `path`. Returns false on failure.
  template <typename Real>
  static bool export_wisdom_to_file(const std::string& path) {
    check_available<Real>();
#ifdef EFFATTN_USE_FFTW
    return detail::with_fftw_planner_lock(
        [&] { return detail::fftw_traits<Real>::export_wisdom_to_filename(path.c_str()) != 0; });
#else
    (void)path;
    return false;
#endif
  }
  /// Reads wisdom of precision Real from `path`. Returns false on failure.
  template <typename Real>
  static bool import_wisdom_from_file(const std::string& path) {
    check_available<Real>();
#ifdef EFFATTN_USE_FFTW
    return detail::with_fftw_planner_lock(
        [&] { return detail::fftw_traits<Real>::import_wisdom_from_filename(path.c_str()) != 0; });
#else
    (void)path;
    return false;
#endif
  }
  /// Forgets all wisdom of precision Real (existing plans stay valid).
  template <typename Real>
  static void forget_wisdom() {
    check_available<Real>();
#ifdef EFFATTN_USE_FFTW
    detail::with_fftw_planner_lock([] { detail::fftw_traits<Real>::forget_wisdom(); });
#endif
  }

 private:
  template <typename Real>
  static void check_available() {
    static_assert(std::is_same<Real, float>::value || std::is_same<Real, double>::value,
                  "effattn: fft::Fftw supports Real = float or double");
    (void)sizeof(Engine<Real>);  // fires the readable static_assert without EFFATTN_USE_FFTW
  }
};

/// Eigen backend: `Eigen::FFT<Real>` (kissfft; header-only, MPL-2), always available.
struct EigenFft {
  /// Batched real FFTs of size N (a multiple of 4 is fast; N >= 2). Immutable and shareable; the
  /// twiddles are computed once, each Scratch holds its own copy of the (stateful) Eigen::FFT.
  template <typename Real>
  class Engine {
    using Fft = Eigen::FFT<Real>;

   public:
    using Complex = std::complex<Real>;
    /// Per-thread state: a copy of the prepared Eigen::FFT object.
    struct Scratch {
      Fft fft;
    };
    Engine(Index size, Index batch, Rigor /*ignored*/) : m_size(size), m_batch(batch) {
      EFFATTN_CHECK(size >= 2 && size <= 0x7fffffff && batch >= 1,
                    detail::cat("fft::EigenFft: size must be in [2, 2^31) and batch >= 1; got ",
                                size, ", ", batch));
      auto fft = std::make_shared<Fft>();
      fft->SetFlag(Fft::HalfSpectrum);
      fft->SetFlag(Fft::Unscaled);
      std::vector<Real> x(static_cast<std::size_t>(size), Real(0));
      std::vector<Complex> X(static_cast<std::size_t>(size / 2 + 1));
      fft->fwd(X.data(), x.data(), size);  // builds the twiddles of both directions once
      fft->inv(x.data(), X.data(), size);
      m_proto = std::move(fft);
    }
    Index size() const { return m_size; }
    Index batch() const { return m_batch; }
    Scratch make_scratch() const { return Scratch{*m_proto}; }
    /// r2c of `howmany` columns: in[t N + i] -> out[t (N/2+1) + f].
    void forward(Index howmany, const Real* in, Complex* out, Scratch& s) const {
      for (Index t = 0; t < howmany; ++t)
        s.fft.fwd(out + t * (m_size / 2 + 1), in + t * m_size, m_size);
    }
    /// Unnormalised c2r of `howmany` columns: in[t (N/2+1) + f] -> out[t N + i].
    void inverse(Index howmany, Complex* in, Real* out, Scratch& s) const {
      for (Index t = 0; t < howmany; ++t)
        s.fft.inv(out + t * m_size, in + t * (m_size / 2 + 1), m_size);
    }

   private:
    Index m_size, m_batch;
    std::shared_ptr<const Fft> m_proto;
  };
  /// Transform size for a linear convolution needing `m` samples: 4 x (2^a 3^b 5^c) >= m.
  static Index fft_size(Index m) { return 4 * detail::smooth_size((m + 3) / 4, 5); }
  /// Cost of one size-N real transform relative to one n^2 step of the direct product (fitted).
  static double transform_cost(Index N) { return 28.0 * detail::n_log2_n(N); }
  /// Short name for labels.
  static const char* name() { return "eigen"; }
};

/// The default backend: `Fftw` when `EFFATTN_USE_FFTW` is defined, else `EigenFft`.
#ifdef EFFATTN_USE_FFTW
using Default = Fftw;
#else
using Default = EigenFft;
#endif

// ---------------------------------------------------------------------------------------------
// Batched causal convolution.

/// One term of a sum of causal (sub-)convolutions of length-n signals. With s = `offset`,
/// e = `end` (exclusive; -1 means n) and b = `kernel` of length K (1 <= K <= n - s), the term
/// adds, for every column x of X,
///
///   y_i += sum_{k = s}^{min(i, e-1)} b_{i-k} x_k      (i = 0..n-1; b_l = 0 for l >= K),
///
/// i.e. y += T(b) P x, where T(b) is the n x n lower-triangular Toeplitz matrix with first column
/// b (zero-padded) and P zeroes the rows of x outside [s, e). Since T(b) is lower triangular,
/// T(b) P = P' T(b) P with P' zeroing rows < s: the term is T(b) restricted to rows/columns >= s
/// (and columns < e). Conv-Basis (convbasis spec 2.2-2.3): the sub-convolution conv(b, m) of the
/// paper, T(b_{1:m}) in the bottom-right m x m block, is {b, n - m} (end = n); the segment form
/// "keys [s_r, s_{r+1}) use representative column c_r" is {c_r, s_r, s_{r+1}}.
template <typename Scalar>
struct ConvTerm {
  Vector<Scalar> kernel;  ///< b: lags 0..K-1, 1 <= K <= n - offset, finite
  Index offset = 0;       ///< s: first row/column of the Toeplitz block, 0 <= s < n
  Index end = -1;         ///< e: one past the last input row used, s < e <= n; -1 = n
};

/// How `CausalConv` evaluates the sum.
enum class ConvMethod {
  Auto,   ///< Direct when `prefer_direct` says it is faster, else Fft
  Fft,    ///< frequency-domain accumulation, O(G c N log N)
  Direct  ///< dense lower-triangular matrix (O(n^2) memory) times X, O(n^2 c)
};

/// Options of `CausalConv`.
struct ConvOptions {
  ConvMethod method = ConvMethod::Auto;  ///< see ConvMethod
  Rigor rigor = Rigor::Estimate;         ///< FFTW planner rigor (Fftw backend only)
  Index batch = 0;                       ///< columns per transform batch; 0 = auto (<= 16)
};

namespace detail {
/// Validates n and the terms (shared by CausalConv and conv_matrix).
template <typename Scalar>
void check_conv_terms(Index n, const std::vector<ConvTerm<Scalar>>& terms, const char* who) {
  EFFATTN_CHECK(n >= 1, cat(who, ": n must be >= 1; got ", n));
  EFFATTN_CHECK(!terms.empty(), cat(who, ": terms must not be empty"));
  for (std::size_t j = 0; j < terms.size(); ++j) {
    const ConvTerm<Scalar>& t = terms[j];
    EFFATTN_CHECK(t.offset >= 0 && t.offset < n,
                  cat(who, ": terms[", j, "].offset must be in [0, n = ", n, "); got ", t.offset));
    EFFATTN_CHECK(t.end == -1 || (t.end > t.offset && t.end <= n),
                  cat(who, ": terms[", j, "].end must be -1 (= n) or in (offset = ", t.offset,
                      ", n = ", n, "]; got ", t.end));
    EFFATTN_CHECK(t.kernel.size() >= 1 && t.kernel.size() <= n - t.offset,
                  cat(who, ": terms[", j, "].kernel must have 1 to n - offset = ", n - t.offset,
                      " entries; got ", t.kernel.size()));
    check_finite(t.kernel, cat("terms[", j, "].kernel").c_str());
  }
}
inline Index term_end(Index end, Index n) {
  return end == -1 ? n : end;
}
}  // namespace detail

/// The dense n x n lower-triangular matrix sum_j T(b_j) P_j of `terms` (see ConvTerm), in
/// precision Real: column k is the sum of the kernels of the terms with s_j <= k < e_j, placed
/// from row k down. A left-to-right sweep keeps that sum, adding kernels as terms start and
/// re-summing (never subtracting, so weights of very different magnitudes stay exact) when a term
/// ends. O(n^2) memory; O(n^2 + n * sum over term ends of the active terms) time, i.e. O(n^2 + kn)
/// for the per-basis (all e_j = n) and segment (disjoint ranges) forms.
/// \throws effattn::invalid_argument on invalid terms (see ConvTerm).
template <typename Real = double, typename Scalar>
Matrix<Real> conv_matrix(Index n, const std::vector<ConvTerm<Scalar>>& terms) {
  detail::check_conv_terms(n, terms, "conv_matrix");
  const std::size_t k = terms.size();
  std::vector<std::vector<std::size_t>> starts(static_cast<std::size_t>(n)),
      stops(static_cast<std::size_t>(n));
  for (std::size_t j = 0; j < k; ++j) {
    starts[static_cast<std::size_t>(terms[j].offset)].push_back(j);
    const Index e = detail::term_end(terms[j].end, n);
    if (e < n) stops[static_cast<std::size_t>(e)].push_back(j);
  }
  auto add = [&](Vector<Real>& acc, std::size_t j) {
    acc.head(terms[j].kernel.size()) += terms[j].kernel.template cast<Real>();
  };
  Matrix<Real> H = Matrix<Real>::Zero(n, n);
  Vector<Real> acc = Vector<Real>::Zero(n);
  std::vector<char> active(k, 0);
  for (Index col = 0; col < n; ++col) {
    const auto c = static_cast<std::size_t>(col);
    if (!stops[c].empty()) {
      for (std::size_t j : stops[c]) active[j] = 0;
      acc.setZero();
      for (std::size_t j = 0; j < k; ++j)
        if (active[j]) add(acc, j);
    }
    for (std::size_t j : starts[c]) {
      active[j] = 1;
      add(acc, j);
    }
    H.col(col).tail(n - col) = acc.head(n - col);
  }
  return H;
}

/// Whether the direct product (dense lower-triangular matrix times X at GEMM speed, n^2 flops per
/// column) is expected to beat the FFT path of `Backend` (G + 1 transforms of size N per column,
/// each costing `Backend::transform_cost(N)` in the same units) for G = `groups` distinct input
/// ranges. The constants were fitted to bench_core (c = 64, one thread, CPU time): for one
/// group the measured crossover against the double dense product is n ~ 160 with FFTW and
/// n ~ 1400 with EigenFft; the direct path wins more often as G grows (k = n bases: always).
template <typename Backend>
bool prefer_direct(Index n, Index fft_size, Index groups) {
  const double nn = static_cast<double>(n);
  return nn * nn <= static_cast<double>(groups + 1) * Backend::transform_cost(fft_size);
}

/// Batched causal convolution y = sum_j T(b_j) P_j x (see ConvTerm) for every column x of an
/// n x c matrix X, with the spectra of terms sharing an input range [s, e) summed before the
/// product and ONE inverse transform per column (convbasis spec 2.3).
///
/// Method (Fft): transform size N = Backend::fft_size(max(n, max_j (e_j + K_j - 1))) -- for full
/// kernels K_j = n - s_j that is n + (longest input segment) - 1, 2n - 1 for one full term --
/// which keeps the circular wrap-around out of rows 0..n-1. Kernel spectra (with 1/N folded in)
/// are computed once in the constructor. `apply` splits the columns into batches of `batch()`,
/// processed in parallel (OpenMP, detail::parallel_for; no parallel region when there is only one
/// batch); per batch and input range: copy the rows
/// [s, e) into a zero-padded buffer, one batched r2c, multiply-accumulate with the group's
/// spectrum; then one batched c2r. Cost O(c (G + 1) N log N); memory per thread
/// O(batch N) plus O(G N) for the spectra. The decomposition depends only on the shapes, so
/// results are bitwise identical for any thread count.
///
/// Precision: all arithmetic in Real (double by default, also for float data). Error of the Fft
/// path, per column: ~ eps_Real * log2(N) * sum_j ||b_j||_2 ||x||_2 (absolute); of the Direct
/// path: the usual GEMM bound. Thread safety: a const object may be used by any number of threads
/// at once (each call has its own scratch; FFTW plans are only executed).
///
/// \tparam Scalar data type (float or double); \tparam Backend fft::Fftw or fft::EigenFft;
/// \tparam Real computation precision (float or double).
template <typename Scalar, typename Backend = Default, typename Real = double>
class CausalConv {
  static_assert(::effattn::detail::is_supported_scalar_v<Scalar>,
                "effattn: CausalConv Scalar must be float or double");
  static_assert(::effattn::detail::is_supported_scalar_v<Real>,
                "effattn: CausalConv Real must be float or double");

 public:
  using Complex = std::complex<Real>;
  using Engine = typename Backend::template Engine<Real>;
  using Term = ConvTerm<Scalar>;

  /// Prepares the sum of `terms` for signals of length n (plans, kernel spectra, or the dense
  /// matrix for the Direct method). O(k N log N) for k terms.
  /// \throws effattn::invalid_argument on invalid n, terms (see ConvTerm) or options.
  CausalConv(Index n, const std::vector<Term>& terms, const ConvOptions& opts = {}) : m_n(n) {
    detail::check_conv_terms(n, terms, "CausalConv");
    EFFATTN_CHECK(opts.batch >= 0,
                  detail::cat("CausalConv: ConvOptions::batch must be >= 0; got ", opts.batch));
    std::vector<Index> group_of(terms.size());
    std::map<std::pair<Index, Index>, Index> group_index;  // input range [s, e) -> group
    Index need = n;
    for (std::size_t j = 0; j < terms.size(); ++j) {
      const Index s = terms[j].offset, e = detail::term_end(terms[j].end, n);
      need = std::max(need, e + terms[j].kernel.size() - 1);
      const auto ins = group_index.emplace(std::make_pair(s, e), groups());
      if (ins.second) m_groups.emplace_back(s, e);
      group_of[j] = ins.first->second;
    }
    const Index G = groups(), N = Backend::fft_size(need);
    m_use_fft = opts.method == ConvMethod::Fft ||
                (opts.method == ConvMethod::Auto && !prefer_direct<Backend>(n, N, G));
    if (!m_use_fft) {
      m_dense = conv_matrix<Real>(n, terms);
      return;
    }
    m_fft_size = N;
    const Index H = N / 2 + 1;
    const Index auto_batch = (Index(1) << 16) / (N * Index(sizeof(Real)));
    m_batch = opts.batch > 0 ? opts.batch : std::max<Index>(1, std::min<Index>(16, auto_batch));
    m_engine = std::make_shared<const Engine>(N, m_batch, opts.rigor);
    m_spectra.setZero(H, G);
    auto scratch = m_engine->make_scratch();
    detail::AlignedBuffer<Real> in(m_batch * N);
    detail::AlignedBuffer<Complex> out(m_batch * H);
    const Index k = static_cast<Index>(terms.size());
    for (Index j0 = 0; j0 < k; j0 += m_batch) {
      const Index h = std::min(m_batch, k - j0);
      for (Index t = 0; t < h; ++t) {
        const auto& b = terms[static_cast<std::size_t>(j0 + t)].kernel;
        Real* col = in.data() + t * N;
        std::fill(col, col + N, Real(0));
        Eigen::Map<Vector<Real>>(col, b.size()) = b.template cast<Real>();
      }
      m_engine->forward(h, in.data(), out.data(), scratch);
      for (Index t = 0; t < h; ++t)
        m_spectra.col(group_of[static_cast<std::size_t>(j0 + t)]) +=
            Eigen::Map<const CVector>(out.data() + t * H, H) * (Real(1) / static_cast<Real>(N));
    }
  }

  /// Single full term: y = T(b) x with n = b.size().
  explicit CausalConv(const ConstVectorRef<Scalar>& b, const ConvOptions& opts = {})
      : CausalConv(b.size(), std::vector<Term>{Term{b, 0, -1}}, opts) {}

  /// Y = sum_j T(b_j) P_j X for an n x c matrix X (c >= 1, finite). Y must be n x c and must not
  /// overlap X. Thread-safe.
  /// \throws effattn::invalid_argument on shape mismatch or non-finite X.
  void apply(const ConstRef<Scalar>& X, Eigen::Ref<Matrix<Scalar>> Y) const {
    EFFATTN_CHECK(X.rows() == m_n && X.cols() >= 1,
                  detail::cat("CausalConv: X must be n x c with n = ", m_n, ", c >= 1; got X ",
                              detail::shape(X)));
    EFFATTN_CHECK(
        Y.rows() == m_n && Y.cols() == X.cols(),
        detail::cat("CausalConv: Y must be ", m_n, " x ", X.cols(), "; got Y ", detail::shape(Y)));
    detail::check_finite(X, "X");
    if (!m_use_fft) {
      if constexpr (std::is_same<Real, Scalar>::value) {
        Y.noalias() = m_dense.template triangularView<Eigen::Lower>() * X;
      } else {
        const Matrix<Real> Xr = X.template cast<Real>();
        Y = (m_dense.template triangularView<Eigen::Lower>() * Xr).template cast<Scalar>();
      }
      return;
    }
    const Index c = X.cols(), B = m_batch, N = m_fft_size, H = N / 2 + 1, G = groups();
    auto make_workspace = [&] { return Workspace(*m_engine, B, N, G > 1); };
    auto body = [&](Index chunk, Workspace& ws) {
      const Index c0 = chunk * B, h = std::min(B, c - c0);
      Complex* const prod = G == 1 ? ws.spec.data() : ws.acc.data();
      for (Index g = 0; g < G; ++g) {
        const Index s = m_groups[static_cast<std::size_t>(g)].first;
        const Index e = m_groups[static_cast<std::size_t>(g)].second;
        for (Index t = 0; t < h; ++t) {
          Real* col = ws.in.data() + t * N;
          std::fill(col, col + s, Real(0));
          Eigen::Map<Vector<Real>>(col + s, e - s) =
              X.col(c0 + t).segment(s, e - s).template cast<Real>();
          std::fill(col + e, col + N, Real(0));
        }
        m_engine->forward(h, ws.in.data(), ws.spec.data(), ws.scratch);
        const auto K = m_spectra.col(g).array();
        for (Index t = 0; t < h; ++t) {
          Eigen::Map<CArray> S(ws.spec.data() + t * H, H), P(prod + t * H, H);
          if (G == 1 || g == 0)
            P = K * S;
          else
            P += K * S;
        }
      }
      m_engine->inverse(h, prod, ws.in.data(), ws.scratch);  // c2r destroys prod
      for (Index t = 0; t < h; ++t)
        Y.col(c0 + t) =
            Eigen::Map<const Vector<Real>>(ws.in.data() + t * N, m_n).template cast<Scalar>();
    };
    const Index chunks = (c + B - 1) / B;
    if (chunks == 1) {  // no parallel region for one batch (the body has no Eigen GEMM inside)
      Workspace ws = make_workspace();
      body(0, ws);
    } else {
      ::effattn::detail::parallel_for(chunks, make_workspace, body);
    }
  }

  /// Returns sum_j T(b_j) P_j X (see apply).
  Matrix<Scalar> operator()(const ConstRef<Scalar>& X) const {
    Matrix<Scalar> Y(m_n, X.cols());
    apply(X, Y);
    return Y;
  }

  Index size() const { return m_n; }                                    ///< n
  Index groups() const { return static_cast<Index>(m_groups.size()); }  ///< distinct [s, e)
  bool uses_fft() const { return m_use_fft; }                           ///< false: Direct method
  Index fft_size() const { return m_fft_size; }                         ///< N (0 for Direct)
  Index batch() const { return m_batch; }  ///< columns per transform batch

 private:
  using CVector = Eigen::Matrix<Complex, Eigen::Dynamic, 1>;
  using CArray = Eigen::Array<Complex, Eigen::Dynamic, 1>;
  struct Workspace {
    Workspace(const Engine& engine, Index B, Index N, bool accumulate)
        : in(B * N),
          spec(B * (N / 2 + 1)),
          acc(accumulate ? B * (N / 2 + 1) : 0),
          scratch(engine.make_scratch()) {}
    detail::AlignedBuffer<Real> in;       // B x N zero-padded inputs, then the c2r outputs
    detail::AlignedBuffer<Complex> spec;  // B x (N/2+1) input spectra
    detail::AlignedBuffer<Complex> acc;   // B x (N/2+1) accumulated products (G > 1)
    typename Engine::Scratch scratch;
  };

  Index m_n;
  std::vector<std::pair<Index, Index>> m_groups;  // distinct input ranges [s, e)
  bool m_use_fft = false;
  Index m_fft_size = 0, m_batch = 0;
  std::shared_ptr<const Engine> m_engine;
  Eigen::Matrix<Complex, Eigen::Dynamic, Eigen::Dynamic> m_spectra;  // (N/2+1) x G, times 1/N
  Matrix<Real> m_dense;                                              // Direct: n x n
};

/// y = T(b) X for a kernel b (column vector, 1 <= size <= n) and X (n x c): one full term.
/// Builds a temporary CausalConv (FFTW plans come from the cache). Float or double data.
template <typename Backend = Default, typename Real = double, typename DB, typename DX>
Matrix<typename DX::Scalar> causal_conv(const Eigen::MatrixBase<DB>& b,
                                        const Eigen::MatrixBase<DX>& X,
                                        const ConvOptions& opts = {}) {
  using Scalar = typename DX::Scalar;
  static_assert(std::is_same<typename DB::Scalar, Scalar>::value,
                "effattn: causal_conv: b and X must have the same scalar type");
  EFFATTN_CHECK(b.cols() == 1,
                detail::cat("causal_conv: b must be a column vector; got b ", detail::shape(b)));
  std::vector<ConvTerm<Scalar>> terms(1);
  terms[0].kernel = b;
  return CausalConv<Scalar, Backend, Real>(X.rows(), terms, opts)(X);
}

/// Y = sum_j T(b_j) P_j X for `terms` (see ConvTerm) with n = X.rows().
template <typename Backend = Default, typename Real = double, typename Scalar>
Matrix<Scalar> causal_conv(const std::vector<ConvTerm<Scalar>>& terms,
                           const detail::identity_t<ConstRef<Scalar>>& X,
                           const ConvOptions& opts = {}) {
  return CausalConv<Scalar, Backend, Real>(X.rows(), terms, opts)(X);
}

/// Direct O(n^2 c) evaluation of y = T(b) X (dense matrix, precision Real): reference and tiny n.
template <typename Real = double, typename DB, typename DX>
Matrix<typename DX::Scalar> causal_conv_direct(const Eigen::MatrixBase<DB>& b,
                                               const Eigen::MatrixBase<DX>& X) {
  ConvOptions o;
  o.method = ConvMethod::Direct;
  return causal_conv<EigenFft, Real>(b, X, o);
}

/// Direct O(n^2 c) evaluation of sum_j T(b_j) P_j X (dense matrix, precision Real).
template <typename Real = double, typename Scalar>
Matrix<Scalar> causal_conv_direct(const std::vector<ConvTerm<Scalar>>& terms,
                                  const detail::identity_t<ConstRef<Scalar>>& X) {
  ConvOptions o;
  o.method = ConvMethod::Direct;
  return causal_conv<EigenFft, Real>(terms, X, o);
}

}  // namespace fft
}  // namespace effattn
