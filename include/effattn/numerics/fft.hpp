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
/// - `fft::Default` is `Fftw` when `EFFATTN_USE_FFTW` is defined, else `EigenFft`. Building
///   without `EFFATTN_USE_FFTW` (CMake option EFFATTN_WITH_FFTW=OFF) drops the GPL dependency:
///   everything except `fft::Fftw` itself keeps working on `EigenFft`.
///
/// **Alignment**: FFTW's new-array execute needs arrays aligned like the planning arrays. Every
/// scratch array here is 64-byte aligned (>= FFTW's SIMD alignment on all ISAs); an engine given
/// other pointers checks `fftw_alignment_of` and then uses a separate FFTW_UNALIGNED plan (slower,
/// still correct).
///
/// **Precision**: `Real` (the FFT precision) is double by default even for float data, because
/// FFT round-off is absolute, about eps_Real * ||b||_2 ||x||_2 per output: a small output next to
/// large ones keeps only the absolute accuracy. Measured: relative errors ~1e-16 (double) and
/// ~1e-7 (float FFTs).
///
/// The definitions of the heavy members live in `detail/linalg/fft_impl.hpp`, included at the end.
#pragma once

#include <complex>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unsupported/Eigen/FFT>

#include "../core/checks.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"

#ifdef EFFATTN_USE_FFTW
#include "../detail/linalg/fftw_traits.hpp"
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

template <typename T>
class AlignedBuffer;  // 64-byte aligned scratch array (detail/linalg/fft_impl.hpp)
}  // namespace detail

/// Smallest 2^a 3^b 5^c 7^d >= n (n >= 1). FFTW is fastest on these sizes; a prime size near
/// 8192 is ~17x slower than 8192 (measured with FFTW 3.3, double). O(log^4 n).
/// \throws effattn::invalid_argument if n < 1 or n > 2^60.
inline Index good_size(Index n);

/// Planner rigor (FFTW only; `EigenFft` ignores it). Estimate never touches data and is the
/// default; Measure/Patient time candidate plans (seconds for large batches) and pay off only
/// with wisdom; WisdomOnly = measure-level plan from imported wisdom, else
/// effattn::invalid_argument (the wisdom is a precondition of that option).
enum class Rigor { Estimate, Measure, Patient, WisdomOnly };

/// Statistics of one precision's FFTW plan cache.
struct PlanCacheStats {
  Index cached = 0;   ///< plans currently in the cache
  Index created = 0;  ///< plans created since process start
  Index hits = 0;     ///< lookups answered from the cache since process start
  Index alive = 0;    ///< plans not yet destroyed (cached or held by engines)
};

/// FFTW backend: fftw (double) / fftwf (float) with the process-wide plan cache. Requires
/// `EFFATTN_USE_FFTW` (and linking fftw3 + fftw3f); otherwise using it is a compile error.
struct Fftw {
#ifdef EFFATTN_USE_FFTW
  /// Batched real FFT engine in precision Real (float or double).
  template <typename Real>
  class Engine : public ::effattn::detail::FftwEngine<Real> {
   public:
    /// The cached r2c/c2r plans of size `size` batched `batch` times, planned with `rigor`.
    /// \throws effattn::invalid_argument if FFTW returns no plan (Rigor::WisdomOnly without
    ///         wisdom for this transform).
    Engine(Index size, Index batch, Rigor rigor);
  };
#else
  template <typename Real>
  struct Engine {
    static_assert(detail::dependent_false_v<Real>,
                  "effattn: fft::Fftw needs FFTW. Define EFFATTN_USE_FFTW and link fftw3 and "
                  "fftw3f (CMake option EFFATTN_WITH_FFTW=ON), or use fft::EigenFft.");
    // Members so that the static_assert is the only diagnostic.
    using Complex = std::complex<Real>;  ///< the complex type of the transforms
    struct Scratch {};
    Engine(Index, Index, Rigor) {}
    Scratch make_scratch() const { return {}; }
    void forward(Index, const Real*, Complex*, Scratch&) const {}
    void inverse(Index, Complex*, Real*, Scratch&) const {}
  };
#endif
  /// Transform size for a linear convolution needing `m` samples: `good_size(m)`.
  static Index fft_size(Index m);
  /// Cost of one size-N real transform relative to one n^2 step of the direct product (fitted):
  /// 5 N log2 N.
  static double transform_cost(Index N);
  /// Short name for labels.
  static const char* name() {
    return "fftw";
  }

  /// Statistics of the plan cache of precision Real.
  template <typename Real>
  static PlanCacheStats cache_stats();
  /// Drops every cached plan of precision Real (engines keep theirs until destroyed). Returns
  /// the number dropped. Later engines re-plan (cheaply with Estimate or with wisdom).
  template <typename Real>
  static Index clear_cache();
  /// All accumulated wisdom of precision Real as FFTW's text format ("" on failure).
  template <typename Real>
  static std::string export_wisdom();
  /// Adds wisdom from a string made by `export_wisdom`. Returns false if FFTW rejects it.
  template <typename Real>
  static bool import_wisdom(const std::string& wisdom);
  /// Writes the wisdom of precision Real to `path`. Returns false on failure.
  template <typename Real>
  static bool export_wisdom_to_file(const std::string& path);
  /// Reads wisdom of precision Real from `path`. Returns false on failure.
  template <typename Real>
  static bool import_wisdom_from_file(const std::string& path);
  /// Forgets all wisdom of precision Real (existing plans stay valid).
  template <typename Real>
  static void forget_wisdom();

 private:
  template <typename Real>
  static void check_available();
};

/// Eigen backend: `Eigen::FFT<Real>` (kissfft; header-only, MPL-2), always available.
struct EigenFft {
  /// Batched real FFTs of size N (a multiple of 4 is fast; N >= 2). Immutable and shareable; the
  /// twiddles are computed once, each Scratch holds its own copy of the (stateful) Eigen::FFT.
  template <typename Real>
  class Engine {
    using Fft = Eigen::FFT<Real>;

   public:
    using Complex = std::complex<Real>;  ///< the complex type of the transforms
    /// Per-thread state: a copy of the prepared Eigen::FFT object.
    struct Scratch {
      Fft fft;  ///< the prepared transform
    };
    /// Prepares the twiddles of size `size` (in [2, 2^31)); `batch` >= 1 is only recorded.
    /// \throws effattn::invalid_argument on a size or batch out of range.
    Engine(Index size, Index batch, Rigor /*ignored*/);
    Index size() const { return m_size; }                       ///< transform size N
    Index batch() const { return m_batch; }                     ///< recorded batch size
    Scratch make_scratch() const { return Scratch{*m_proto}; }  ///< per-thread state
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
  static Index fft_size(Index m);
  /// Cost of one size-N real transform relative to one n^2 step of the direct product (fitted):
  /// 28 N log2 N.
  static double transform_cost(Index N);
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
/// (and columns < e). Conv-Basis (Gu et al., arXiv 2405.05219v1): the paper's sub-convolution
/// conv(b, m), T(b_{1:m}) in the bottom-right m x m block, is {b, n - m} (end = n); the segment
/// form "keys [s_r, s_{r+1}) use the representative column c_r" is {c_r, s_r, s_{r+1}}.
template <typename Scalar>
struct ConvTerm {
  Vector<Scalar> kernel;  ///< b: lags 0..K-1, 1 <= K <= n - offset, finite
  Index offset = 0;       ///< s: first row/column of the Toeplitz block, 0 <= s < n
  Index end = -1;         ///< e: one past the last input row used, s < e <= n; -1 = n
};

/// How `CausalConv` evaluates the sum (a runtime choice: Auto depends on n).
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

/// The dense n x n lower-triangular matrix sum_j T(b_j) P_j of `terms` (see ConvTerm), in
/// precision Real: column k is the sum of the kernels of the terms with s_j <= k < e_j, placed
/// from row k down. A left-to-right sweep keeps that sum, adding kernels as terms start and
/// re-summing (never subtracting, so weights of very different magnitudes stay exact) when a term
/// ends. O(n^2) memory; O(n^2 + n * sum over term ends of the active terms) time, i.e. O(n^2 + kn)
/// for the per-basis (all e_j = n) and segment (disjoint ranges) forms.
/// \throws effattn::invalid_argument on invalid terms (see ConvTerm).
template <typename Real = double, typename Scalar>
Matrix<Real> conv_matrix(Index n, const std::vector<ConvTerm<Scalar>>& terms);

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
/// product and ONE inverse transform per column: G + 1 transforms per column for G distinct
/// input ranges, whatever the number of terms.
///
/// Method (Fft): transform size N = Backend::fft_size(max(n, max_j (e_j + K_j - 1))) -- for full
/// kernels K_j = n - s_j that is n + (longest input segment) - 1, 2n - 1 for one full term --
/// which keeps the circular wrap-around out of rows 0..n-1. Kernel spectra (with 1/N folded in)
/// are computed once in the constructor. `apply` splits the columns into batches of `batch()`,
/// processed in parallel (OpenMP, detail::parallel_for; no parallel region when there is only one
/// batch); per batch and input range: copy the rows [s, e) into a zero-padded buffer, one batched
/// r2c, multiply-accumulate with the group's spectrum; then one batched c2r. Cost
/// O(c (G + 1) N log N); memory per thread O(batch N) plus O(G N) for the spectra. The
/// decomposition depends only on the shapes, so results are bitwise identical for any thread
/// count. Method (Direct): the dense `conv_matrix` times X, O(n^2) memory, O(n^2 c) time. The
/// method is a runtime option (`ConvOptions::method`; Auto depends on n), so both paths are
/// compiled; the Real-vs-Scalar casts are chosen at compile time.
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
  using Complex = std::complex<Real>;                      ///< the complex type of the transforms
  using Engine = typename Backend::template Engine<Real>;  ///< the FFT engine of the backend
  using Term = ConvTerm<Scalar>;                           ///< one convolution term

  /// Prepares the sum of `terms` for signals of length n (plans, kernel spectra, or the dense
  /// matrix for the Direct method). O(k N log N) for k terms.
  /// \throws effattn::invalid_argument on invalid n, terms (see ConvTerm) or options.
  CausalConv(Index n, const std::vector<Term>& terms, const ConvOptions& opts = {});

  /// Single full term: y = T(b) x with n = b.size().
  explicit CausalConv(const ConstVectorRef<Scalar>& b, const ConvOptions& opts = {})
      : CausalConv(b.size(), std::vector<Term>{Term{b, 0, -1}}, opts) {}

  /// Y = sum_j T(b_j) P_j X for an n x c matrix X (c >= 1, finite). Y must be n x c and must not
  /// overlap X. Thread-safe.
  /// \throws effattn::invalid_argument on shape mismatch or non-finite X.
  void apply(const ConstRef<Scalar>& X, Eigen::Ref<Matrix<Scalar>> Y) const;

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
  struct Workspace;  // per-thread buffers of apply_fft (detail/linalg/fft_impl.hpp)

  void apply_direct(const ConstRef<Scalar>& X, Eigen::Ref<Matrix<Scalar>> Y) const;
  void apply_fft(const ConstRef<Scalar>& X, Eigen::Ref<Matrix<Scalar>> Y) const;

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
  using Scalar = typename DX::Scalar;  ///< the scalar type (float or double)
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
/// The backend is never used on this path (no plan, no transform).
template <typename Real = double, typename DB, typename DX>
Matrix<typename DX::Scalar> causal_conv_direct(const Eigen::MatrixBase<DB>& b,
                                               const Eigen::MatrixBase<DX>& X) {
  ConvOptions o;
  o.method = ConvMethod::Direct;
  return causal_conv<Default, Real>(b, X, o);
}

/// Direct O(n^2 c) evaluation of sum_j T(b_j) P_j X (dense matrix, precision Real).
template <typename Real = double, typename Scalar>
Matrix<Scalar> causal_conv_direct(const std::vector<ConvTerm<Scalar>>& terms,
                                  const detail::identity_t<ConstRef<Scalar>>& X) {
  ConvOptions o;
  o.method = ConvMethod::Direct;
  return causal_conv<Default, Real>(terms, X, o);
}

}  // namespace fft
}  // namespace effattn

#include "../detail/linalg/fft_impl.hpp"

#ifdef EFFATTN_COMPILED
namespace effattn {
namespace fft {
extern template class CausalConv<float>;  // default backend and precision only
extern template class CausalConv<double>;
}  // namespace fft
}  // namespace effattn
#endif
