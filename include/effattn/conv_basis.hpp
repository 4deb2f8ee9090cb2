/// \file conv_basis.hpp
/// \brief Conv-Basis attention (Gu, Liang, Liu, Shi, Song and Yin, "Conv-Basis: A New Paradigm
/// for Efficient Attention Inference and Gradient Computation in Transformers", arXiv
/// 2405.05219v1): causal softmax attention whose masked logits are approximated by a sum of k
/// sub-convolution (lower-triangular Toeplitz) matrices and evaluated with FFTs in
/// O(k d n log n), never forming an n x n matrix. Spec: shared/specs/convbasis.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "numerics/fft.hpp"
#include "core/types.hpp"
#include "conv_basis_recovery.hpp"

namespace effattn {

/// Options of `ConvBasisAttention`. Thresholds are in scaled-logit units (after `scale`).
struct ConvBasisOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d); the paper's
  /// sections 3-5 use 1 (spec 2.0).
  double scale = 0;
  /// k, the most bases to recover (clamped to n). Grid: exactly min(k, n) uniform starts.
  /// k = n with probe = 1 and threshold = 0 reproduces exact causal attention (Cor. 4.5).
  Index num_bases = 16;
  /// T, the logits nearest the diagonal each probed column is tested on (clamped to n and to
  /// the window).
  Index probe = 8;
  /// delta (BinarySearch: thr = delta - 2 T epsilon) or tau (Scan): a column opens a new basis
  /// when the l1 distance of its first T logits to the current basis column is >= this.
  double threshold = 0;
  /// eps, the assumed max-norm logit noise of BinarySearch (paper Thm 4.4; needs eps <= delta/5T).
  double epsilon = 0;
  /// Grid only: explicit basis starts (first 0, strictly increasing, < n); empty = uniform.
  std::vector<Index> grid_starts;
  /// Sliding-window causal mask: query i sees keys i - window < j <= i. 0 = no window.
  /// Exact for the conv form (W o conv(b) = conv(b truncated), spec 2.5).
  Index window = 0;
  /// Block-diagonal causal mask: blocks of `block_size` tokens (the last may be shorter), each
  /// an independent causal sequence (LongLoRA-style groups). 0 = one block.
  Index block_size = 0;
  /// Must stay true: conv-basis is causal by construction; false throws.
  bool causal = true;
  /// Dynamic-range guard (spec 7, P5): recompute rows whose FFT result may have lost accuracy.
  bool guard = true;
  /// Guard tolerance on the estimated error of a row, per column c relative to max |V_c|; 0 = 1e-9
  /// when the FFTs run in double, 1e-4 in float.
  double guard_tolerance = 0;
  /// How the conv sum is evaluated: Fft (default), Direct (dense n x n, for tests and tiny n)
  /// or Auto (fft::prefer_direct; may form an n x n matrix for small n).
  fft::ConvMethod conv_method = fft::ConvMethod::Fft;
  /// FFTW planner rigor (Estimate by default; Measure pays off with wisdom).
  fft::Rigor rigor = fft::Rigor::Estimate;
};

/// Result of `ConvBasisAttention::compute`.
template <typename Scalar>
struct ConvBasisResult : AttentionResult<Scalar> {
  /// Recovered basis starts s_r (0-based key columns, increasing; with block_size, the starts of
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
/// (Toeplitz) structure is captured: per-query content variation is not (spec P4).
///
/// **Recovery** (`Recovery` policy, all producing a conv_basis::Basis of starts + cumulative
/// logit columns, reading O(k n + n T) logits through a logit oracle, never the n x n matrix):
/// `conv_basis::Scan` (default; linear scan with threshold tau, k from the data capped by
/// num_bases), `conv_basis::BinarySearch` (the paper's Algorithms 2-3 with the spec's fixes),
/// `conv_basis::Grid` (fixed starts).
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
/// **Masks**: causal (always), sliding window (`window`), block-diagonal causal (`block_size`);
/// `compute(Q, K, V, mask)` accepts an explicit mask only if it is one of these. Self-attention
/// only: K must have as many rows as Q.
///
/// \tparam Scalar_ float or double.
/// \tparam FftBackend fft::Fftw or fft::EigenFft (default fft::Default).
/// \tparam Recovery conv_basis::Scan (default), conv_basis::BinarySearch or conv_basis::Grid.
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
template <typename Scalar_, typename FftBackend = fft::Default,
          typename Recovery = conv_basis::Scan, typename Real = double>
class ConvBasisAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(detail::is_supported_scalar_v<Real>, "effattn: Real must be float or double");
  static_assert(std::is_same<Recovery, conv_basis::Scan>::value ||
                    std::is_same<Recovery, conv_basis::BinarySearch>::value ||
                    std::is_same<Recovery, conv_basis::Grid>::value,
                "effattn: ConvBasisAttention Recovery must be conv_basis::Scan, "
                "conv_basis::BinarySearch or conv_basis::Grid");

 public:
  using Scalar = Scalar_;
  using Options = ConvBasisOptions;
  using Result = ConvBasisResult<Scalar>;
  using MatrixType = Matrix<Scalar>;
  using Ref = ConstRef<Scalar>;
  /// An explicit n x n mask (true = the key is visible).
  using MaskRef = Eigen::Ref<const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>>;

  /// \throws effattn::invalid_argument on a bad scale, num_bases < 1, probe < 1, a negative or
  ///         non-finite threshold / epsilon / guard_tolerance, window < 0, block_size < 0,
  ///         or causal = false.
  explicit ConvBasisAttention(Options opts = {}) : m_opts(std::move(opts)) {
    using detail::cat;
    detail::check_scale_option(m_opts.scale, kName);
    EFFATTN_CHECK(m_opts.num_bases >= 1,
                  cat(kName, ": Options::num_bases (k) must be >= 1; got ", m_opts.num_bases));
    EFFATTN_CHECK(m_opts.probe >= 1,
                  cat(kName, ": Options::probe (T) must be >= 1; got ", m_opts.probe));
    EFFATTN_CHECK(
        std::isfinite(m_opts.threshold) && m_opts.threshold >= 0,
        cat(kName, ": Options::threshold must be finite and >= 0; got ", m_opts.threshold));
    EFFATTN_CHECK(std::isfinite(m_opts.epsilon) && m_opts.epsilon >= 0,
                  cat(kName, ": Options::epsilon must be finite and >= 0; got ", m_opts.epsilon));
    EFFATTN_CHECK(std::isfinite(m_opts.guard_tolerance) && m_opts.guard_tolerance >= 0,
                  cat(kName,
                      ": Options::guard_tolerance must be finite and >= 0 (0 = default); "
                      "got ",
                      m_opts.guard_tolerance));
    EFFATTN_CHECK(m_opts.window >= 0,
                  cat(kName, ": Options::window must be >= 0 (0 = none); got ", m_opts.window));
    EFFATTN_CHECK(m_opts.block_size >= 0, cat(kName,
                                              ": Options::block_size must be >= 0 (0 = "
                                              "one block); got ",
                                              m_opts.block_size));
    EFFATTN_CHECK(m_opts.causal,
                  cat(kName,
                      ": Options::causal = false is not supported: conv-basis attention "
                      "is causal by construction (masks: causal, sliding window, "
                      "block-diagonal causal)"));
  }

  /// Conv-basis attention of Q (n x d) over K (n x d), V (n x dv) with the options' mask.
  /// \throws effattn::invalid_argument on empty, mismatched (n != m) or non-finite inputs, or
  ///         invalid Grid starts.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const {
    check_inputs(Q, K, V);
    return run(Q, K, V, m_opts.window, m_opts.block_size);
  }

  /// As `compute(Q, K, V)` with an explicit n x n mask, which must be causal, sliding-window
  /// causal or block-diagonal causal (or block-diagonal with a window inside each block); the
  /// options' window and block_size must then be 0. O(n^2) to check the mask.
  /// \throws effattn::invalid_argument for any other mask (e.g. non-causal, random, padding).
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const MaskRef& mask) const {
    check_inputs(Q, K, V);
    EFFATTN_CHECK(m_opts.window == 0 && m_opts.block_size == 0,
                  detail::cat(kName,
                              ": an explicit mask needs Options::window = 0 and "
                              "Options::block_size = 0"));
    const std::pair<Index, Index> wb = classify_mask(mask, Q.rows());
    return run(Q, K, V, wb.first, wb.second);
  }

  /// Convenience: `compute(Q, K, V).output`.
  /// \throws effattn::numerical_error if the result is not finite.
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V) const {
    Result r = compute(Q, K, V);
    if (r.info != Info::Success) detail::throw_numerical_error(kName, r.info);
    return std::move(r.output);
  }

  /// The basis the recovery finds for the causal logits of Q (n x d) and K (n x d) as ONE
  /// sequence (the window is honoured; block_size is not: blocks are separate sequences).
  conv_basis::Basis recover(const Ref& Q, const Ref& K) const {
    detail::check_attention_inputs(Q, K, K, kName);
    EFFATTN_CHECK(K.rows() == Q.rows(), detail::cat(kName,
                                                    ": self-attention only: K must be n x d "
                                                    "with n = Q.rows() = ",
                                                    Q.rows(), "; got K ", detail::shape(K)));
    const MatrixType Qs = Q * static_cast<Scalar>(detail::resolve_scale(m_opts.scale, Q.cols()));
    return Recovery::recover(conv_basis::QKOracle<Scalar>(Qs, K), params(m_opts.window));
  }

  /// Evaluates attention with the logits of `basis` on V (basis.n x dv), with the guard.
  /// \throws effattn::invalid_argument on a malformed basis or a V of the wrong shape.
  [[nodiscard]] Result apply(const conv_basis::Basis& basis, const Ref& V) const {
    check_basis(basis);
    EFFATTN_CHECK(
        V.rows() == basis.n && V.cols() >= 1,
        detail::cat(kName, ": V must be n x dv with n = ", basis.n, "; got V ", detail::shape(V)));
    detail::check_finite(V, "V");
    Result r;
    r.output.resize(basis.n, V.cols());
    if (!add_block(basis, V, 0, r)) return r;
    r.info = Info::Success;
    return r;
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  static constexpr const char* kName = "ConvBasisAttention";

  void check_inputs(const Ref& Q, const Ref& K, const Ref& V) const {
    detail::check_attention_inputs(Q, K, V, kName);
    EFFATTN_CHECK(K.rows() == Q.rows(),
                  detail::cat(kName,
                              ": self-attention only (n = m): K must be n x d with n = "
                              "Q.rows() = ",
                              Q.rows(), "; got Q ", detail::shape(Q), ", K ", detail::shape(K)));
  }

  conv_basis::RecoveryParams params(Index window) const {
    conv_basis::RecoveryParams p;
    p.num_bases = m_opts.num_bases;
    p.probe = m_opts.probe;
    p.threshold = m_opts.threshold;
    p.epsilon = m_opts.epsilon;
    p.max_lag = window;
    p.grid_starts = m_opts.grid_starts;
    return p;
  }

  void check_basis(const conv_basis::Basis& b) const {
    using detail::cat;
    EFFATTN_CHECK(
        b.n >= 1 && !b.starts.empty() && b.starts.size() == b.columns.size() && b.starts[0] == 0,
        cat(kName,
            ": malformed basis (need n >= 1, starts[0] = 0 and one column per "
            "start)"));
    for (std::size_t r = 0; r < b.starts.size(); ++r) {
      const Index s = b.starts[r], len = b.columns[r].size();
      EFFATTN_CHECK((r == 0 || s > b.starts[r - 1]) && s < b.n && len >= 1 && len <= b.n - s,
                    cat(kName, ": malformed basis at r = ", r, " (start ", s, ", column length ",
                        len, ", n = ", b.n, ")"));
    }
  }

  // Evaluates one block's basis into rows [row0, row0 + n) of r.output; false on trouble.
  bool add_block(const conv_basis::Basis& b, const Ref& V, Index row0, Result& r) const {
    conv_basis::EvalParams ep;
    ep.method = m_opts.conv_method;
    ep.rigor = m_opts.rigor;
    ep.guard = m_opts.guard;
    ep.row_tol = m_opts.guard_tolerance > 0 ? m_opts.guard_tolerance
                                            : (std::is_same<Real, double>::value ? 1e-9 : 1e-4);
    auto ev = conv_basis::evaluate<FftBackend, Real, Scalar>(b, V, ep);
    for (const Index s : b.starts) r.offsets.push_back(row0 + s);
    r.bases_used += b.size();
    r.probes += b.probes;
    r.entries_evaluated += b.entries;
    r.threshold_used = b.threshold_used;
    if (!ev.finite) {
      // Logits overflowed (e.g. |scale q.k| beyond the Scalar range): report it, and never leave
      // stale or partial rows behind that could be mistaken for a result.
      r.info = Info::NumericalIssue;
      r.output.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      return false;
    }
    r.output.middleRows(row0, b.n) = ev.output;
    r.rows_recomputed += ev.rows_recomputed;
    r.fft_size = std::max(r.fft_size, ev.fft_size);
    return true;
  }

  Result run(const Ref& Q, const Ref& K, const Ref& V, Index window, Index block) const {
    const Index n = Q.rows();
    const MatrixType Qs = Q * static_cast<Scalar>(detail::resolve_scale(m_opts.scale, Q.cols()));
    const conv_basis::RecoveryParams p = params(window);
    const Index bs = block > 0 ? std::min(block, n) : n;
    Result r;
    r.output.resize(n, V.cols());
    for (Index b0 = 0; b0 < n; b0 += bs) {
      const Index len = std::min(bs, n - b0);
      const MatrixType Qb = Qs.middleRows(b0, len);
      const auto Kb = K.middleRows(b0, len);
      const Ref Kr(Kb);
      const conv_basis::Basis basis = Recovery::recover(conv_basis::QKOracle<Scalar>(Qb, Kr), p);
      if (!add_block(basis, V.middleRows(b0, len), b0, r)) return r;
    }
    r.info = Info::Success;
    return r;
  }

  // (window, block_size) of a supported explicit mask; throws otherwise.
  static std::pair<Index, Index> classify_mask(const MaskRef& M, Index n) {
    using detail::cat;
    EFFATTN_CHECK(M.rows() == n && M.cols() == n,
                  cat(kName, ": mask must be n x n with n = ", n, "; got mask ", detail::shape(M)));
    const char* what =
        ": unsupported mask: only causal, sliding-window causal and block-diagonal causal masks "
        "have a conv-basis form (spec 2.5)";
    std::vector<Index> lo(static_cast<std::size_t>(n));
    Index w = 1;
    for (Index i = 0; i < n; ++i) {
      Index l = i;
      EFFATTN_CHECK(M(i, i), cat(kName, what, " (row ", i, " does not see its own key)"));
      while (l > 0 && M(i, l - 1)) --l;
      lo[static_cast<std::size_t>(i)] = l;
      w = std::max(w, i - l + 1);
    }
    // Block starts: rows that see only themselves although the window would allow more.
    Index block = 0;
    if (w > 1) {
      for (Index i = 1; i < n && block == 0; ++i)
        if (lo[static_cast<std::size_t>(i)] == i) block = i;
    }
    const Index window = w >= n ? 0 : w;
    for (Index i = 0; i < n; ++i) {
      const Index b0 = block > 0 ? (i / block) * block : 0;
      const Index l = window > 0 ? std::max(b0, i - window + 1) : b0;
      for (Index j = 0; j < n; ++j)
        EFFATTN_CHECK(M(i, j) == (j >= l && j <= i), cat(kName, what, " (entry ", i, ", ", j, ")"));
    }
    return {window, block};
  }

  Options m_opts;
};

/// float / double aliases with the default backend and Scan recovery.
using ConvBasisAttentionf = ConvBasisAttention<float>;
using ConvBasisAttentiond = ConvBasisAttention<double>;

}  // namespace effattn
