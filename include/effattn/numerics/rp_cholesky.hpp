/// \file rp_cholesky.hpp
/// \brief Randomly pivoted partial Cholesky (RPCholesky) of a PSD kernel matrix, with pivot rules
/// as policies, and two kernels: exp(s <x, y>) in Gaussian coordinates and the Gaussian RBF.
///
/// Given a PSD m x m matrix K that is only accessed through its diagonal and through rows, the
/// partial Cholesky with pivots s_1, ..., s_k builds the row-major factor F (k x m),
/// \f[ F_{i,:} = \frac{K_{s_i,:} - F_{1:i-1,s_i}^T F_{1:i-1,:}}{\sqrt{\mathrm{res}(s_i)}}, \qquad
///     \mathrm{res} = \mathrm{diag}(K - F^T F), \f]
/// so that K ~ F^T F (the column Nystrom approximation on the pivots) and res is the residual
/// diagonal. Pivot rules (tag types in `effattn::policy`):
/// - `RandomlyPivoted` (sequential): s_i ~ w_l res(l) / sum_l w_l res(l) (Chen, Epperly, Tropp &
///   Webber, "Randomly pivoted Cholesky", CPAM 78(5), 2025, arXiv 2207.06503). Cost
///   O(m k^2 + k * (one kernel row)) = O(m k^2 + m k d) for the kernels below; GEMV-bound.
/// - `AcceleratedRandomlyPivoted`: the rejection-sampling block variant of Epperly, Tropp &
///   Webber, "Embrace rejection: kernel matrix approximation by accelerated randomly pivoted
///   Cholesky" (arXiv 2410.03969). Same distribution of pivot sequences, same O() cost, but the
///   O(m k^2) part is GEMM-shaped (see detail::rp_run_accelerated).
/// - `GreedyPivoted`: s_i = argmax_l w_l res(l) (deterministic; smallest index on ties).
/// The weights w are per-point sampling weights supplied by the kernel (all ones by default); they
/// let the algorithm factorise a well-scaled K while sampling as for D K D (see `ExpDotKernel`).
///
/// Stopping: after min(rank, m) pivots; or once the weighted residual trace sum_l w_l res(l)
/// is <= rel_tol times its initial value; or when every residual is zero. Residual entries <=
/// tol = roundoff_factor * eps(SelectionScalar) * max_l K_ll (default factor 100) are set to zero:
/// once all are, the kernel is exhausted to round-off and fewer pivots are returned. Without this
/// rule an exhausted rank yields garbage rows (pivots on residuals that are pure round-off); with
/// it, e.g. 8 distinct keys repeated 8 times give exactly 8 pivots and an exact factorisation.
///
/// Precision: the kernel rows and the factor F (its GEMM-shaped block updates and triangular
/// solves) are in the kernel's `Scalar` (the *selection scalar*); the residual diagonal, the
/// sampling weights and probabilities, the traces (and so `rel_tol`) and the accelerated rule's
/// rejection Cholesky of its candidates are in double whatever the selection scalar. The provided
/// kernels select in double by default even for float inputs (`ExpDotKernel<float>` converts
/// once); a float selection scalar runs the O(m k^2 + m k d) part at float GEMM speed (about 2x).
/// Determinism: the pivots and F are a function of (kernel, options, seed); the randomness is
/// effattn's `Rng` (uniform01 and an inverse-CDF scan, never std distributions).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/checks.hpp"
#include "../core/deprecated.hpp"
#include "../core/errors.hpp"
#include "../core/parallel.hpp"
#include "../core/random.hpp"
#include "../core/types.hpp"

namespace effattn {

/// Row-major dynamic matrix (the layout of Cholesky factors and Nystrom weights: r x m with each
/// pivot's row contiguous, so block updates and back-substitutions stream over m).
template <typename Scalar>
using RowMajorMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Writable block of rows of a row-major matrix (what `Kernel::rows` fills).
template <typename Scalar>
using RowsRef = Eigen::Ref<RowMajorMatrix<Scalar>>;

namespace policy {
/// \ingroup Policies
/// Sequential RPCholesky: each pivot sampled proportionally to the current weighted residual.
struct RandomlyPivoted {};
/// \ingroup Policies
/// Accelerated (block, rejection-sampling) RPCholesky; same pivot distribution as RandomlyPivoted.
struct AcceleratedRandomlyPivoted {};
/// \ingroup Policies
/// Greedy pivoting: largest weighted residual (deterministic pivoted Cholesky).
struct GreedyPivoted {};
}  // namespace policy

EFFATTN_DEPRECATED_FIELDS_BEGIN  // the renamed field's old spelling (core/deprecated.hpp)

/// Options of `RpCholesky`.
struct RpCholeskyOptions {
  Index rank = 64;                 ///< pivot budget r >= 1 (at most m pivots are taken)
  double rel_tol = 0;              ///< stop once trace(res) <= rel_tol * trace(K); in [0, 1)
  std::uint64_t seed = 0x5eedULL;  ///< seed of the pivot draws (ignored by GreedyPivoted)
  Index proposal_block = 0;        ///< accelerated rule: proposals per block (0 = automatic)
  double roundoff_factor = 100;    ///< residuals <= factor * eps * max diag count as zero

  /// Deprecated spelling of `proposal_block` (honoured when not 0; removed in the next release).
  [[deprecated("use proposal_block")]] Index block_size = 0;
};

namespace detail {
/// `o` with the deprecated spelling folded into the new field (core/deprecated.hpp).
/// \throws effattn::invalid_argument when the old and the new spelling disagree.
inline RpCholeskyOptions resolve_renamed(RpCholeskyOptions o, const char* who) {
  merge_renamed(o.proposal_block, o.block_size, Index(0), who, "proposal_block", "block_size");
  return o;
}
}  // namespace detail

EFFATTN_DEPRECATED_FIELDS_END

/// Why an RPCholesky run stopped.
enum class RpStopReason {
  RankReached,    ///< min(rank, m) pivots were taken
  RelTolReached,  ///< the residual trace fell to <= rel_tol * initial trace
  Exhausted,      ///< every residual is zero (at round-off): the kernel's numerical rank is k
  Breakdown       ///< a non-finite factor row (kernel returned NaN/Inf); info = NumericalIssue
};

/// Result of `RpCholesky::compute`. k = pivots.size() <= min(rank, m).
template <typename Scalar>
struct RpCholeskyResult {
  std::vector<Index> pivots;           ///< s_1, ..., s_k in the order taken
  RowMajorMatrix<Scalar> factor;       ///< F, k x m: K ~ F^T F; F(:, pivots) is upper triangular
  Vector<Scalar> residual_diagonal;    ///< diag(K - F^T F), entries <= tol set to 0
  std::vector<double> residual_trace;  ///< k + 1 weighted traces sum_l w_l res(l): [0] initial,
                                       ///< [i] after i pivots (non-increasing)
  double initial_trace = 0;            ///< sum_l w_l K_ll (= residual_trace[0])
  Info info = Info::NotComputed;       ///< Success, or NumericalIssue after a Breakdown
  RpStopReason stop = RpStopReason::RankReached;  ///< why the run stopped
  Index proposals = 0;  ///< candidates drawn (= k for the sequential and greedy rules)
  Index blocks = 0;     ///< block updates (accelerated rule only)

  /// Number of pivots k.
  Index rank() const noexcept { return static_cast<Index>(pivots.size()); }
  /// Final residual trace over the initial one (0 if the initial trace is 0).
  double relative_residual_trace() const noexcept {
    return initial_trace > 0 ? residual_trace.back() / initial_trace : 0.0;
  }
};

namespace detail {
// ---- The Kernel concept (documented at RpCholesky) ----
/// The selection scalar `K::Scalar` of a kernel type (`valid` when it is float or double).
template <typename K, typename = void>
struct kernel_scalar {
  using type = double;
  static constexpr bool valid = false;
};
template <typename K>
struct kernel_scalar<K, std::void_t<typename K::Scalar>> {
  using type = typename K::Scalar;
  static constexpr bool valid = is_supported_scalar_v<type>;
};
template <typename K>
using kernel_scalar_t = typename kernel_scalar<K>::type;

template <typename K, typename = void>
struct has_kernel_size : std::false_type {};
template <typename K>
struct has_kernel_size<K, std::void_t<decltype(std::declval<const K&>().size())>>
    : std::is_convertible<decltype(std::declval<const K&>().size()), Index> {};

template <typename K, typename = void>
struct has_kernel_diagonal : std::false_type {};
template <typename K>
struct has_kernel_diagonal<K, std::void_t<decltype(std::declval<const K&>().diagonal(
                                  std::declval<Eigen::Ref<Vector<kernel_scalar_t<K>>>>()))>>
    : std::true_type {};

template <typename K, typename = void>
struct has_kernel_rows : std::false_type {};
template <typename K>
struct has_kernel_rows<K, std::void_t<decltype(std::declval<const K&>().rows(
                              std::declval<const std::vector<Index>&>(),
                              std::declval<RowsRef<kernel_scalar_t<K>>>()))>> : std::true_type {};

template <typename K, typename = void>
struct has_sampling_weights : std::false_type {};
template <typename K>
struct has_sampling_weights<K, std::void_t<decltype(std::declval<const K&>().sampling_weights(
                                   std::declval<Eigen::Ref<Vector<kernel_scalar_t<K>>>>()))>>
    : std::true_type {};

template <typename K, typename = void>
struct has_principal_submatrix : std::false_type {};
template <typename K>
struct has_principal_submatrix<K, std::void_t<decltype(std::declval<const K&>().principal_submatrix(
                                      std::declval<const std::vector<Index>&>(),
                                      std::declval<Eigen::Ref<Matrix<kernel_scalar_t<K>>>>()))>>
    : std::true_type {};

/// Points of the Gaussian-coordinate kernels (defined in detail/linalg/rp_cholesky_impl.hpp).
template <typename S>
class GaussianCore;
}  // namespace detail

/// True when `K` models the RPCholesky Kernel concept (see `RpCholesky`).
template <typename K>
constexpr bool is_rp_kernel_v = (detail::kernel_scalar<K>::valid) &&
                                (detail::has_kernel_size<K>::value) &&
                                (detail::has_kernel_diagonal<K>::value) &&
                                (detail::has_kernel_rows<K>::value);

/// \brief Randomly pivoted partial Cholesky of a PSD kernel matrix given only its diagonal and
/// rows; the pivot rule is a policy.
///
/// \tparam PivotRule `policy::RandomlyPivoted` (default, sequential),
///         `policy::AcceleratedRandomlyPivoted` or `policy::GreedyPivoted`.
///
/// \par The Kernel concept
/// A kernel is any type `K` with (S = `K::Scalar`, float or double, the selection scalar):
/// - `using Scalar = S;`
/// - `Index size() const;` the order m of the kernel matrix;
/// - `void diagonal(Eigen::Ref<Vector<S>> out) const;` out(l) = K(l, l) >= 0, l < m;
/// - `void rows(const std::vector<Index>& idx, RowsRef<S> out) const;` out(j, :) = K(idx[j], :)
///   for an |idx| x m block of rows (the caller's rows of F; write every entry);
/// - optionally `void sampling_weights(Eigen::Ref<Vector<S>> out) const;` w_l >= 0: pivots are
///   sampled proportionally to w_l res(l) and all traces are weighted by w;
/// - optionally `void principal_submatrix(const std::vector<Index>& idx,
///   Eigen::Ref<Matrix<S>> out) const;` out = K(idx, idx). The accelerated rule needs the b x b
///   block of its b candidates; without this member it is cut out of b full rows (b x m work).
/// The full matrix is never formed. `is_rp_kernel_v<K>` tests the concept; `compute` enforces it
/// with a static_assert per missing member.
///
/// \par Complexity (k pivots, m points, kernel rows of cost O(m d))
/// Time O(m k^2 + m k d) for every rule, memory O(r m) for F (r = min(rank, m)). The sequential
/// and greedy rules do one GEMV with the k x m factor per pivot (memory-bound); the accelerated
/// rule does per block of a accepted pivots one (a x k)(k x m) GEMM, one (a x d)(d x m) GEMM for
/// the kernel rows and an a x a triangular solve (all by cache-sized column tiles), plus
/// O(b^2 (k + d) + b a^2) for its b candidates. Measured (bench_core, m = 16384, r = 256, d = 64,
/// one thread): accelerated 87-96 ms against 340-410 ms sequential, same mean residual trace.
///
/// \par Example
/// \code{.cpp}
/// // keys K: m x 64 floats; selection runs in double
/// effattn::ExpDotKernel<float> kern(K, 1.0 / 8.0);
/// effattn::RpCholeskyOptions o;
/// o.rank = 256;
/// using Rule = effattn::policy::AcceleratedRandomlyPivoted;
/// auto r = effattn::RpCholesky<Rule>(o).compute(kern);
/// // r.pivots (<= 256 indices), r.factor (k x m, a factor of the Gaussian-coordinate G)
/// auto w = effattn::nystrom_weights(r);  // numerics/nystrom.hpp: W_G = F(:, S)^{-1} F
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state. The accelerated rule's block updates and the provided
/// kernels' row blocks run their column tiles through `parallel_for` (OpenMP), and the two GEMMs
/// per block outside those loops may use Eigen's threads; results are bit-identical for any
/// thread count (tested for 1 and 2).
template <typename PivotRule = policy::RandomlyPivoted>
class RpCholesky {
  static_assert(std::is_same_v<PivotRule, policy::RandomlyPivoted> ||
                    std::is_same_v<PivotRule, policy::AcceleratedRandomlyPivoted> ||
                    std::is_same_v<PivotRule, policy::GreedyPivoted>,
                "effattn: RpCholesky PivotRule must be policy::RandomlyPivoted, "
                "policy::AcceleratedRandomlyPivoted or policy::GreedyPivoted");

 public:
  using Options = RpCholeskyOptions;  ///< the options struct

  /// \throws effattn::invalid_argument if rank < 1, rel_tol is not in [0, 1), proposal_block < 0,
  ///         roundoff_factor is negative or non-finite, or the deprecated block_size disagrees
  ///         with proposal_block.
  explicit RpCholesky(Options opts = {});

  /// Factorises the kernel matrix of `kernel` (see the Kernel concept). Only the arm of the
  /// chosen pivot rule is instantiated.
  /// \throws effattn::invalid_argument if the kernel is empty or its diagonal (or a sampling
  ///         weight) is negative or non-finite.
  template <typename Kernel>
  [[nodiscard]] RpCholeskyResult<detail::kernel_scalar_t<Kernel>> compute(
      const Kernel& kernel) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

// ------------------------------------------------------------------------------------------
// Kernels.

/// \brief The exponential dot-product kernel H(x, y) = exp(s <x, y>) (s > 0), evaluated in
/// Gaussian coordinates so that nothing overflows.
///
/// With x' = sqrt(s) x, sq_l = ||x'_l||^2 and D = diag(exp(sq / 2)),
/// \f[ H = D\,G\,D, \qquad G(x, y) = \exp(-\|x' - y'\|^2 / 2) \in [0, 1],\ G_{ll} = 1. \f]
/// H's entries overflow once s <x, y> exceeds ~709, G's never do. This kernel presents G to
/// RPCholesky (`Scalar` = SelectionScalar) together with the sampling weights
/// w_l = exp(sq_l - max sq) in (0, 1]. Because res_H(l) = exp(sq_l) res_G(l), sampling
/// proportionally to w_l res_G(l) is exactly RPCholesky on H, and the pivot sequences (and greedy
/// pivots) coincide; exp(sq) itself is never formed. Recovering H's quantities:
/// - factor: F_H = F_G D, i.e. F_H(i, l) = F_G(i, l) exp(sq_l / 2) (`original_factor`);
/// - residual diagonal: res_H(l) = exp(sq_l) res_G(l); residual trace:
///   tr(H - F_H^T F_H) = exp(max sq) * (the weighted trace reported by RPCholesky), so relative
///   traces (and `rel_tol`) are those of H;
/// - Nystrom weights: W_H(i, l) = W_G(i, l) exp((sq_l - sq_{s_i}) / 2) (`original_weights`).
/// The rescaled quantities overflow when sq / 2 exceeds the exponent range; callers that need
/// robustness keep W_G and the log-scales sq / 2 (`half_sq_norms`) separately, as the log-scaled
/// forms of numerics/nystrom.hpp do (`exp_dot_log_scaled_weights`, `exp_dot_log_scaled_product`).
///
/// The points are copied once into SelectionScalar (scaled, centred, d x m): O(m d) memory; X
/// need not outlive the kernel. A kernel row costs O(m d) (one GEMV), a block of a rows one GEMM.
/// \tparam InScalar float or double (the input type). \tparam SelectionScalar the scalar of the
///         kernel rows and of F (see the file documentation; the bookkeeping is double anyway):
///         double by default, also for float inputs, because residuals below roundoff_factor *
///         eps(SelectionScalar) count as zero, which in float (1.2e-5 of the unit diagonal) ends
///         the factorisation at a relative residual trace of about 1e-5 instead of 1e-14. Float
///         is what WildCat uses for float attention: at its ranks the residuals stay far above
///         that floor (measured, sphere and clustered keys, m = 4096 / 16384, r = 256 / 1024:
///         relative residual traces 1e-3 to 1e-2, equal to double selection's within 1.5%, no
///         early stop).
template <typename InScalar, typename SelectionScalar = double>
class ExpDotKernel {
  static_assert(detail::is_supported_scalar_v<InScalar> &&
                    detail::is_supported_scalar_v<SelectionScalar>,
                "effattn: ExpDotKernel scalars must be float or double");

 public:
  using InputScalar = InScalar;    ///< the scalar of the points X
  using Scalar = SelectionScalar;  ///< the Kernel concept's selection scalar

  /// \param X the m x d points (rows). \param scale s > 0 (e.g. 1 / sqrt(d)).
  /// \throws effattn::invalid_argument if X is empty or non-finite, or scale is not finite > 0.
  ExpDotKernel(const ConstRef<InputScalar>& X, double scale);

  /// m, the number of points.
  Index size() const noexcept { return m_core.size(); }
  /// G has unit diagonal.
  void diagonal(Eigen::Ref<Vector<Scalar>> out) const { out.setOnes(); }
  /// out(j, :) = G(x_idx[j], X), one GEMM (a x d)(d x m) and a x m exponentials.
  void rows(const std::vector<Index>& idx, RowsRef<Scalar> out) const { m_core.rows(idx, out); }
  /// out = G(X_idx, X_idx).
  void principal_submatrix(const std::vector<Index>& idx, Eigen::Ref<Matrix<Scalar>> out) const {
    m_core.principal_submatrix(idx, out);
  }
  /// w_l = exp(sq_l - max sq).
  void sampling_weights(Eigen::Ref<Vector<Scalar>> out) const { out = m_weights; }

  /// sq_l / 2 = s ||x_l||^2 / 2 = log D_ll (uncentred).
  const Vector<Scalar>& half_sq_norms() const noexcept { return m_half_sq; }
  /// max_l sq_l: H's traces are exp(this) times the weighted traces RPCholesky reports.
  double log_trace_scale() const noexcept { return m_log_scale; }

  /// F_H = F_G D (k x m): a factor of H from a factor of G. Overflows to inf if sq / 2 does.
  RowMajorMatrix<Scalar> original_factor(const RowMajorMatrix<Scalar>& F) const;
  /// W_H(i, l) = W_G(i, l) exp((sq_l - sq_{s_i}) / 2): Nystrom weights of H from those of G for
  /// landmarks s_i (W_G: r x m, e.g. from `nystrom_weights`).
  /// \throws effattn::invalid_argument on a shape mismatch or a landmark out of range.
  RowMajorMatrix<Scalar> original_weights(const RowMajorMatrix<Scalar>& W,
                                          const std::vector<Index>& landmarks) const;

 private:
  detail::GaussianCore<Scalar> m_core;
  Vector<Scalar> m_half_sq, m_weights;
  double m_log_scale = 0;
};

/// \brief The Gaussian RBF kernel K(x, y) = exp(-||x - y||^2 / (2 sigma^2)) (unit diagonal).
///
/// Evaluated as exp(<y, z> - |y|^2 / 2 - |z|^2 / 2) on centred points y = (x - mean) / sigma
/// with the exponent clamped at <= 0 (entries in [0, 1]). Points are copied once into
/// SelectionScalar (O(m d) memory); a row costs O(m d), a block of rows one GEMM.
/// \tparam InScalar float or double (input). \tparam SelectionScalar arithmetic type (double).
template <typename InScalar, typename SelectionScalar = double>
class GaussianKernel {
  static_assert(detail::is_supported_scalar_v<InScalar> &&
                    detail::is_supported_scalar_v<SelectionScalar>,
                "effattn: GaussianKernel scalars must be float or double");

 public:
  using InputScalar = InScalar;    ///< the scalar of the points X
  using Scalar = SelectionScalar;  ///< the Kernel concept's selection scalar

  /// \param X the m x d points (rows). \param sigma the bandwidth, > 0.
  /// \throws effattn::invalid_argument if X is empty or non-finite, or sigma is not finite > 0.
  GaussianKernel(const ConstRef<InputScalar>& X, double sigma);

  /// m, the number of points.
  Index size() const noexcept { return m_core.size(); }
  /// K has unit diagonal.
  void diagonal(Eigen::Ref<Vector<Scalar>> out) const { out.setOnes(); }
  /// out(j, :) = K(x_idx[j], X), one GEMM (a x d)(d x m) and a x m exponentials.
  void rows(const std::vector<Index>& idx, RowsRef<Scalar> out) const { m_core.rows(idx, out); }
  /// out = K(X_idx, X_idx).
  void principal_submatrix(const std::vector<Index>& idx, Eigen::Ref<Matrix<Scalar>> out) const {
    m_core.principal_submatrix(idx, out);
  }

 private:
  detail::GaussianCore<Scalar> m_core;
};

/// Exp-dot kernel over float points (selection in double).
using ExpDotKernelf = ExpDotKernel<float>;
/// Exp-dot kernel over double points.
using ExpDotKerneld = ExpDotKernel<double>;
/// Gaussian RBF kernel over float points (selection in double).
using GaussianKernelf = GaussianKernel<float>;
/// Gaussian RBF kernel over double points.
using GaussianKerneld = GaussianKernel<double>;

/// Convenience: `RpCholesky<PivotRule>(opts).compute(kernel)`.
template <typename PivotRule = policy::RandomlyPivoted, typename Kernel>
[[nodiscard]] RpCholeskyResult<detail::kernel_scalar_t<Kernel>> rp_cholesky(
    const Kernel& kernel, const RpCholeskyOptions& opts = {}) {
  return RpCholesky<PivotRule>(opts).compute(kernel);
}

}  // namespace effattn

#include "../detail/linalg/rp_cholesky_impl.hpp"
