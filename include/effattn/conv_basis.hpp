/// \file conv_basis.hpp
/// \brief Conv-Basis attention (Gu, Liang, Liu, Shi, Song and Yin, "Conv-Basis: A New Paradigm
/// for Efficient Attention Inference and Gradient Computation in Transformers", arXiv
/// 2405.05219v1): causal softmax attention whose masked logits are approximated by a sum of k
/// sub-convolution (lower-triangular Toeplitz) matrices and evaluated with FFTs in
/// O(k d n log n), never forming an n x n matrix. The building blocks (basis, oracles, recovery
/// policies, evaluator) are in `conv_basis_recovery.hpp`; the definitions in
/// `detail/methods/conv_basis_impl.hpp`, included at the end.
#pragma once

#include <utility>
#include <vector>

#include "conv_basis_recovery.hpp"
#include "core/checks.hpp"
#include "core/deprecated.hpp"
#include "core/errors.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"
#include "gradients.hpp"
#include "numerics/fft.hpp"

namespace effattn {

EFFATTN_DEPRECATED_FIELDS_BEGIN  // the renamed fields' old spellings (core/deprecated.hpp)

/// Options of `ConvBasisAttention`. Thresholds are in scaled-logit units (after `scale`). There
/// is no `causal` field: the method is causal by construction (`causal_only`).
struct ConvBasisOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d); the paper's
  /// sections 3-5 use 1.
  double scale = 0;
  /// k, the most bases to recover (clamped to n). Grid: exactly min(k, n) uniform starts.
  /// k = n with probe = 1 and threshold = 0 reproduces exact causal attention (Cor. 4.5).
  Index num_bases = 16;
  /// T, the logits nearest the diagonal each probed column is tested on (clamped to n and to
  /// the sliding window).
  Index probe = 8;
  /// delta (BinarySearch: thr = delta - 2 T epsilon) or tau (Scan): a column opens a new basis
  /// when the l1 distance of its first T logits to the current basis column is >= this.
  double threshold = 0;
  /// eps, the assumed max-norm logit noise of BinarySearch (paper Thm 4.4; needs eps <= delta/5T).
  double epsilon = 0;
  /// Grid only: explicit basis starts (first 0, strictly increasing, < n); empty = uniform.
  std::vector<Index> grid_starts;
  /// Sliding-window causal mask: query i sees keys i - sliding_window < j <= i. 0 = no window.
  /// Exact for the conv form: the window mask times conv(b) is conv(b truncated to
  /// `sliding_window` lags), so the columns are simply read to lag sliding_window - 1. (Not
  /// EVA's `window`, which is an exact local block.)
  Index sliding_window = 0;
  /// Block-diagonal causal mask: blocks of `mask_block` tokens (the last may be shorter), each
  /// an independent causal sequence (LongLoRA-style groups). 0 = one block.
  Index mask_block = 0;
  /// Dynamic-range guard: recompute directly the rows whose FFT result may have lost accuracy
  /// (tiny denominators; see conv_basis::evaluate).
  bool guard = true;
  /// Guard tolerance on the estimated error of a row, per column c relative to max |V_c|; 0 = 1e-9
  /// when the FFTs run in double, 1e-4 in float.
  double guard_tolerance = 0;
  /// How the conv sum is evaluated: Fft (default), Direct (dense n x n, for tests and tiny n)
  /// or Auto (fft::prefer_direct; may form an n x n matrix for small n).
  fft::ConvMethod conv_method = fft::ConvMethod::Fft;
  /// FFTW planner rigor (Estimate by default; Measure pays off with wisdom).
  fft::Rigor rigor = fft::Rigor::Estimate;

  /// Deprecated spelling of `sliding_window` (honoured when not 0; removed in the next release).
  [[deprecated("use sliding_window")]] Index window = 0;
  /// Deprecated spelling of `mask_block` (honoured when not 0; removed in the next release).
  [[deprecated("use mask_block")]] Index block_size = 0;
};

namespace detail {
/// `o` with the deprecated spellings folded into the new fields (core/deprecated.hpp).
/// \throws effattn::invalid_argument when an old and a new spelling disagree.
inline ConvBasisOptions resolve_renamed(ConvBasisOptions o, const char* who) {
  merge_renamed(o.sliding_window, o.window, Index(0), who, "sliding_window", "window");
  merge_renamed(o.mask_block, o.block_size, Index(0), who, "mask_block", "block_size");
  return o;
}
}  // namespace detail

EFFATTN_DEPRECATED_FIELDS_END

/// Result of `ConvBasisAttention::compute`.
template <typename Scalar>
struct ConvBasisResult : AttentionResult<Scalar> {
  /// Recovered basis starts s_r (0-based key columns, increasing; with mask_block, the starts of
  /// every block in global positions).
  std::vector<Index> offsets;
  /// k_eff, the number of bases used (summed over blocks).
  Index bases_used = 0;
  /// Rows recomputed directly by the dynamic-range guard.
  Index rows_recomputed = 0;
  /// Logits the recovery evaluated (k n + n T order; never n^2 unless k ~ n).
  Index entries_evaluated = 0;
  /// Columns probed (BinarySearch: about k log2 n; Scan: n - T + 1).
  Index probes = 0;
  /// Largest FFT size used (0 with the Direct method).
  Index fft_size = 0;
  /// The threshold the recovery ended with (Scan raises tau to respect num_bases; last block).
  double threshold_used = 0;

  /// bases_used, rows_recomputed (the guard's result), entries_evaluated, probes, fft_size,
  /// threshold_used, in this order.
  Diagnostics diagnostics() const {
    return {{"bases_used", static_cast<double>(bases_used)},
            {"rows_recomputed", static_cast<double>(rows_recomputed)},
            {"entries_evaluated", static_cast<double>(entries_evaluated)},
            {"probes", static_cast<double>(probes)},
            {"fft_size", static_cast<double>(fft_size)},
            {"threshold_used", threshold_used}};
  }
};

/// \ingroup Methods
/// \brief Conv-Basis attention: Y = D^-1 (M o exp(H')) V, where H' = sum_r conv(b'_r, m_r)
/// approximates the causal logits H = M o (scale Q K^T) (Gu et al., arXiv 2405.05219v1).
///
/// **Model.** A lower-triangular H has a k-conv basis when its columns fall into k groups
/// [s_r, s_{r+1}) inside which every column, read from the diagonal down, is the same vector
/// U_r (Claim A.11). Then exp(H) keeps the structure (Lemma A.13) and
/// \f[ Y = D^{-1} \sum_r \mathrm{conv}(c_r)\, S_r V, \quad c_r = \exp(U_r - \mu),\;
///     D_i = \sum_r \sum_{j \in [s_r, s_{r+1}), j \le i} c_r[i - j], \f]
/// with S_r selecting the rows [s_r, s_{r+1}) and mu = max U (cancels). Only relative-position
/// (Toeplitz) structure is captured: per-query content variation is not.
///
/// **Recovery** (`Recovery` policy, all producing a conv_basis::Basis of starts + cumulative
/// logit columns through conv_basis::recover, reading O(k n + n T) logits through a logit
/// oracle, never the n x n matrix): `policy::Scan` (default; linear scan with threshold tau, k
/// from the data capped by num_bases), `policy::BinarySearch` (the paper's Algorithms 2-3, with
/// a forced first basis at column 0 and a tested last probe), `policy::Grid` (fixed starts).
///
/// **Evaluation** (conv_basis::evaluate): segment form, one inverse FFT per value column after
/// summing the k spectra, N = smooth size >= n + longest segment - 1; FFTs in `Real` (double
/// by default, also for float data); denominators by exact O(k n) prefix sums; the guard
/// recomputes rows whose denominator is too small for the FFT's absolute error (reported in
/// `Result::rows_recomputed`).
///
/// **Cost**: recovery O((k n + n T) d) (Scan) or O((k n + k T log n) d) (BinarySearch);
/// evaluation O(k dv N log N) time, O((k + dv) N) memory, plus O(i dv) per guarded row.
///
/// **Accuracy caveat** (measured, bench_conv_basis): on `workloads` positional (RoPE + smooth
/// drift + i.i.d. token noise 0.1, d = 64) the relative error at k = 16 is 0.2-0.6 and falls only
/// slowly with k (0.15 at k = 64, 0.09 at k = 1024, n = 2048); without the token noise it is
/// 0.11 at k = 16 and 9e-3 at k = 256. Use it where logits are close to relative-position
/// structure; it is not a general-purpose approximation.
///
/// **Masks**: causal (always: `causal_only`), sliding window (`sliding_window`), block-diagonal
/// causal (`mask_block`); `compute(Q, K, V, mask)` accepts an explicit mask only if it is one of
/// these. Self-attention only (`self_attention_only`): K must have as many rows as Q.
///
/// \tparam Scalar_ float or double.
/// \tparam FftBackend fft::Fftw or fft::EigenFft (default fft::Default).
/// \tparam Recovery policy::Scan (default), policy::BinarySearch or policy::Grid.
/// \tparam Real FFT precision: double (default) or float (faster; guard tolerance 1e-4).
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/conv_basis.hpp>
/// Eigen::MatrixXf Q = ..., K = ..., V = ...;          // n x d, n x d, n x dv
/// effattn::ConvBasisAttentionf::Options o;
/// o.num_bases = 16;                                   // at most 16 sub-convolutions
/// auto r = effattn::ConvBasisAttentionf(o).compute(Q, K, V);
/// // r.output (n x dv), r.offsets (basis starts), r.bases_used, r.rows_recomputed
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state. FFT columns, column reads and guarded rows run in
/// parallel with shape-fixed decompositions: results are bit-identical for any thread count.
template <typename Scalar_, typename FftBackend = fft::Default, typename Recovery = policy::Scan,
          typename Real = double>
class ConvBasisAttention
    : public AttentionFunctor<ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(ConvBasisAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(detail::is_supported_scalar_v<Real>, "effattn: Real must be float or double");
  static_assert(conv_basis::is_recovery_policy_v<Recovery>,
                "effattn: ConvBasisAttention Recovery must be policy::Scan, "
                "policy::BinarySearch or policy::Grid");

 public:
  using Scalar = Scalar_;                        ///< the scalar type (float or double)
  using Options = ConvBasisOptions;              ///< the options struct
  using Result = ConvBasisResult<Scalar>;        ///< the result of `compute`
  using Gradients = AttentionGradients<Scalar>;  ///< the result of `backward`
  using MatrixType = Matrix<Scalar>;             ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;                  ///< the input type, `ConstRef<Scalar>`
  /// An explicit n x n mask (true = the key is visible).
  using MaskRef = Eigen::Ref<const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>>;

  static constexpr const char* name = "ConvBasisAttention";  ///< for messages
  static constexpr bool supports_causal = false;     ///< no `Options::causal`: always causal
  static constexpr bool causal_only = true;          ///< causal by construction
  static constexpr bool randomized = false;          ///< deterministic
  static constexpr bool self_attention_only = true;  ///< K must have n = Q.rows() rows
  static constexpr bool exact = false;  ///< approximate at default options (k = n, T = 1: exact)

  /// \throws effattn::invalid_argument on a bad scale, num_bases < 1, probe < 1, a negative or
  ///         non-finite threshold / epsilon / guard_tolerance, sliding_window < 0 or
  ///         mask_block < 0; when a deprecated spelling and its new name disagree.
  explicit ConvBasisAttention(Options opts = {});

  /// Conv-basis attention of Q (n x d) over K (n x d), V (n x dv) with the options' mask.
  /// \throws effattn::invalid_argument on empty, mismatched (n != m) or non-finite inputs, or
  ///         invalid Grid starts.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// As `compute(Q, K, V)` with an explicit n x n mask, which must be causal, sliding-window
  /// causal or block-diagonal causal (or block-diagonal with a window inside each block); the
  /// options' sliding_window and mask_block must then be 0. O(n^2) to check the mask.
  /// \throws effattn::invalid_argument for any other mask (e.g. non-causal, random, padding).
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V, const MaskRef& mask) const;

  /// The basis the recovery finds for the causal logits of Q (n x d) and K (n x d) as ONE
  /// sequence (the sliding window is honoured; mask_block is not: blocks are separate sequences).
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs.
  conv_basis::Basis recover(const Ref& Q, const Ref& K) const;

  /// Evaluates attention with the logits of `basis` on V (basis.n x dv), with the guard.
  /// \throws effattn::invalid_argument on a malformed basis or a V of the wrong shape.
  [[nodiscard]] Result apply(const conv_basis::Basis& basis, const Ref& V) const;

  /// Gradients of a loss L through `compute(Q, K, V)`: given `result` = compute(Q, K, V) and
  /// dO = dL/dO (n x dv), returns dQ, dK (n x d) and dV (n x dv) (`dbias` stays empty).
  ///
  /// **Which function is differentiated.** The Conv-Basis output as a function of Q, K and V
  /// with the basis starts s_r frozen at `result.offsets` (the caveat P11 of the spec: the starts
  /// are discrete, chosen by the recovery, and their dependence on Q, K is ignored; recompute
  /// them every step or freeze them for a few). Everything else is differentiated: with
  /// U_r[t] = s <q_{s_r + t}, k_{s_r}> (the basis column read from the logits), the logits are
  /// H'[i, j] = U_r[i - j] for keys j in segment [s_r, s_{r+1}), and
  /// Y = D^{-1} (M o exp(H')) V. For the Grid recovery (fixed starts) this is the exact
  /// gradient of `compute`, and central finite differences of `compute` match it; for Scan and
  /// BinarySearch it is the gradient wherever the recovered starts do not change. With k = n
  /// (every column its own basis) H' is the causal logit matrix itself, and the result is the
  /// exact causal attention gradient.
  ///
  /// **How** (in double, per block of `mask_block`; O(k dv N log N) time, O((k + dv) N + n d)
  /// memory, no n x n matrix). With P = D^{-1} A, A = sum_r T(c_r) S_r (segment form of
  /// `conv_basis::evaluate`), X = D^{-1} dO and z_i = <dO_i, Y_i> / D_i:
  /// - dV = A^T X: per basis r, rows [s_r, s_{r+1}) of the correlation of X with c_r (one
  ///   inverse FFT per value column);
  /// - dL/dU_r[t] = sum over the logits equal to U_r[t] of dS = P o (dO V^T - <dO_i, Y_i>), i.e.
  ///   c_r[t] (a_r[t] - b_r[t]) with a_r[t] = sum_{j in segment r} <X_{j+t}, V_j> (dv
  ///   correlations summed in the frequency domain, one inverse FFT per basis) and
  ///   b_r[t] = sum_{j in segment r} z_{j+t} (prefix sums);
  /// - dQ_{s_r + t} += s dU_r[t] k_{s_r}, dK_{s_r} += s sum_t dU_r[t] q_{s_r + t}: O(k n d).
  ///
  /// FFTs: dv + k (2 dv + 2) transforms of size N (the forward's size), about twice the
  /// forward's dv (k + 1) + k. This is cheaper than the paper's gradient (Gu et al., Lemma B.9 and
  /// Theorem 5.6: the exact softmax gradient with the attention matrix replaced by the
  /// Conv-Basis one, O(d^2 k n log n) with d dv batched convolutions), which is not the
  /// derivative of the forward: it agrees with this one at k = n, where both are exact. The
  /// backward has no dynamic-range guard: its FFT round-off is absolute (~eps_Real log2 N times
  /// the norms of the transformed columns), so rows the forward's guard had to recompute
  /// (`result.rows_recomputed` > 0) may carry larger relative errors in their gradients. The
  /// FFT path is always used (`conv_method` applies to the forward only). The mask is the
  /// options' (sliding_window, mask_block); a result of `compute(Q, K, V, mask)` with another mask
  /// is not supported.
  /// \throws effattn::invalid_argument on invalid Q, K, V (as `compute`), if `result` is not a
  ///         successful result of these shapes with valid offsets (each block's starts beginning
  ///         at the block start, strictly increasing), or if dO is not n x dv or not finite.
  [[nodiscard]] Gradients backward(const Ref& Q, const Ref& K, const Ref& V, const Result& result,
                                   const Ref& dO) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  void check_inputs(const Ref& Q, const Ref& K, const Ref& V) const;
  conv_basis::RecoveryParams params(Index window) const;
  void check_basis(const conv_basis::Basis& b) const;
  // Evaluates one block's basis into rows [row0, row0 + n) of r.output; false on trouble.
  bool add_block(const conv_basis::Basis& b, const Ref& V, Index row0, Result& r) const;
  Result run(const Ref& Q, const Ref& K, const Ref& V, Index window, Index block) const;
  // (sliding_window, mask_block) of a supported explicit mask; throws otherwise.
  static std::pair<Index, Index> classify_mask(const MaskRef& M, Index n);

  Options m_opts;
};

/// Conv-Basis attention, float (default backend and Scan recovery).
using ConvBasisAttentionf = ConvBasisAttention<float>;
/// Conv-Basis attention, double (default backend and Scan recovery).
using ConvBasisAttentiond = ConvBasisAttention<double>;

}  // namespace effattn

#if EFFATTN_DETAIL_WITH_IMPL
#include "detail/methods/conv_basis_backward_impl.hpp"
#include "detail/methods/conv_basis_impl.hpp"
#endif

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(ConvBasisAttention<float>)  // default backend and recovery only
EFFATTN_EXTERN_INSTANCE(ConvBasisAttention<double>)
}  // namespace effattn
#endif
