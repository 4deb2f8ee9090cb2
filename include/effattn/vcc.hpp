/// \file vcc.hpp
/// \brief VCC: VIP-token centric compression (Zeng, Hawkins, Hong, Zhang, Pappas, Singh, Zheng,
/// "VCC: Scaling Transformers to 128K Tokens or More by Prioritizing Important Tokens",
/// NeurIPS 2023) as a single attention call. The compression tree `VccTree`, the segments and the
/// selection policies are in `<effattn/vcc_tree.hpp>` (included); the definitions are in
/// `detail/methods/vcc_impl.hpp`, included at the end.
#pragma once

#include <type_traits>
#include <utility>
#include <vector>

#include "core/errors.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"
#include "vcc_tree.hpp"

namespace effattn {

namespace policy {
/// \ingroup Policies
/// VCC non-VIP rows: decompression (the paper): Ybar = softmax(tau Qbar_J K'^T + b) V', token t
/// of segment j gets Ybar_j. Cost O(|J| r d).
struct Decompress {};
/// \ingroup Policies
/// VCC non-VIP rows: every query attends to the compressed keys, O(n_c r d). Not the paper's
/// method.
struct ExactQuery {};
/// \ingroup Policies
/// VCC non-VIP rows are not computed (left at 0). Cost linear in n.
struct VipOnly {};
}  // namespace policy

/// Options of `VccAttention`.
struct VccOptions {
  /// Logit scale tau: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// r, the compressed length including the n_p VIP rows: the VIP rows attend to r keys
  /// [K_P; Kbar_J] with |J| = r - n_p. Values >= n give exact attention. 0 = the paper's
  /// two-level length n_p + ceil(n_c / k) + h (k - 1) with k = block_size, h = fine_blocks
  /// (for every policy, so that policies compare at equal length).
  Index budget = 0;
  /// k: TwoLevel block size (paper: 16; 32 and 64 at 32K/64K). BestFirstDyadic with MeanProb
  /// normalises each VIP row over the tree level whose nodes have ~k rows.
  Index block_size = 16;
  /// h: TwoLevel fine blocks when budget == 0 (paper: 44-90). With budget > 0, h is the largest
  /// number of blocks that fits in the budget.
  Index fine_blocks = 90;
  /// An infeasible budget (r < n_p + 1, or TwoLevel r < n_p + ceil(n_c / k)) throws by default;
  /// with clamp_budget it is raised to the smallest feasible value, reported in
  /// `Result::budget_effective`.
  bool clamp_budget = false;
  /// BestFirstDyadic only (library extension, off by default = the priority
  /// log s + log score): rank a segment by the estimated gain of splitting it,
  /// log sum_i (mass_i(child a) + mass_i(child b) - mass_i(segment)), which is >= 0 by Jensen.
  /// Measured on `workloads::make_smooth_vip` (n = 4096, seeds 1-3): VIP error 1.1e-2..1.3e-2
  /// instead of 2.5e-2..2.7e-2 at |J| = 256, 2.1e-3..2.5e-3 instead of 2.9e-3..3.3e-3 at 1024.
  /// Three GEMVs per refinement instead of one.
  bool lookahead = false;
  /// The VIP rows P of `compute(Q, K, V)` (any order, unique, in [0, n); the 4- and 5-argument
  /// `compute` take theirs as an argument instead). Empty (the default) means no VIP row: nothing
  /// guides the selection, which falls back to Uniform pooling of all n rows into |J| = r
  /// near-equal segments (`Result::uniform_fallback`), and with `policy::Decompress` every row
  /// gets its segment's output (the segment-mean query attending to the pooled keys),
  /// with `policy::ExactQuery` every row attends to the pooled keys, with `policy::VipOnly` the
  /// output is all zero.
  std::vector<Index> vip;
};

/// Result of `VccAttention::compute`.
template <typename Scalar>
struct VccResult : AttentionResult<Scalar> {
  /// The partition J of the n_c non-VIP rows (numbered 0..n_c-1 in their original order).
  std::vector<VccSegment> segments;
  /// The VIP rows, sorted.
  std::vector<Index> vip;
  /// r_eff = n_p + |J|, the number of keys every query attended to.
  Index budget_effective = 0;
  /// TwoLevel: the number h of blocks expanded to single rows (0 for the other policies).
  Index fine_blocks = 0;
  /// True when the selection had no VIP scores (n_p = 0) and fell back to Uniform.
  bool uniform_fallback = false;

  /// {budget_effective, fine_blocks, vip (n_p), segments (|J|), uniform_fallback (0 or 1)}.
  Diagnostics diagnostics() const {
    return {{"budget_effective", static_cast<double>(budget_effective)},
            {"fine_blocks", static_cast<double>(fine_blocks)},
            {"vip", static_cast<double>(vip.size())},
            {"segments", static_cast<double>(segments.size())},
            {"uniform_fallback", uniform_fallback ? 1.0 : 0.0}};
  }
};

/// \ingroup Methods
/// \brief VCC attention: the VIP rows attend exactly to the VIP keys and to a VIP-guided
/// multi-resolution compression of all other keys and values (Zeng et al., NeurIPS 2023).
///
/// The n rows are split into the n_p VIP rows P (`Options::vip`, or the `vip` argument) and the
/// n_c = n - n_p others, C, kept in their original order. A partition J of C into contiguous
/// segments (sizes s_j) gives S_c (row j = the mean over segment j), the compressed keys and
/// values K' = [K_P; S_c K_C], V' = [V_P; S_c V_C] (r = n_p + |J| rows) and the log-count bias
/// b = [0; log s_j] (the paper's D, in numerator and denominator):
/// \f[ O_P = \mathrm{softmax}(\tau Q_P K'^T + 1 b^T) V'. \f]
/// This is exactly softmax attention against keys and values averaged within segments:
/// O_P = Attn(Q_P, [K_P; S_c^^+ S_c K_C], [V_P; S_c^^+ S_c V_C]), with
/// S_c^^+ = S_c^T D. The error is 0 when every segment is one row (r >= n) or keys and values
/// are constant on segments; VIP row q satisfies
/// ||O_hat(q) - O(q)|| <= eps_v + (exp(2 tau ||q|| delta) - 1) max_j ||vbar_j||, with delta and
/// eps_v the largest in-segment deviations of keys and values.
/// The non-VIP rows follow `NonVip`: `policy::Decompress` (the paper: the segment-mean queries
/// attend and every token gets its segment's output, O_C = S_c^^+ softmax(tau S_c Q_C K'^T +
/// b) V'), `policy::ExactQuery` (every query attends to K', V'), or `policy::VipOnly` (left at 0).
///
/// J comes from `Select` guided by the VIP queries scored with `Score`: `policy::TwoLevel` (the
/// paper's experiments and code, default), `policy::BestFirstDyadic` (budgeted refinement of the
/// dyadic tree `VccTree`, library extension), `policy::Uniform` (no guidance: the pooling
/// baseline); `policy::MeanProb` (default) or `policy::SumExp`. The selection is the one of
/// `VccTree::select`. With no VIP rows it falls back to Uniform (see `VccOptions::vip`).
///
/// Cost (d_v ~ d): TwoLevel + VipOnly O(n d + (n_c / k) n_p d + n_p r d); BestFirstDyadic adds
/// the tree O(n_c d) and O(r n_p d) for the refinement; Decompress adds O(|J| r d + n d);
/// ExactQuery O(n_c r d). Extra memory O(n_c d / k + r d) (TwoLevel) or O(n_c d) (tree), plus
/// attention tiles: nothing n x n or n_p x n is formed.
///
/// Kernel-level caveat: compressing K and V equals the paper's compress-the-hidden-states only
/// when X -> K, V is affine (it is for biased linear projections, since S_c rows sum to 1; not for
/// pre-LayerNorm or RoPE applied after averaging): this primitive defines VCC on the given K, V.
/// VCC has no causal form (segment means mix past and future tokens) and needs Q and K to be the
/// same sequence.
///
/// \tparam Scalar_ float or double.
/// \tparam Select `policy::TwoLevel` (default), `policy::BestFirstDyadic` or `policy::Uniform`.
/// \tparam Score `policy::MeanProb` (default) or `policy::SumExp`.
/// \tparam NonVip `policy::Decompress` (default), `policy::ExactQuery` or `policy::VipOnly`.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/vcc.hpp>
/// Eigen::MatrixXf Q = ..., K = ..., V = ...;        // n x d, n x d, n x dv
/// effattn::VccAttentionf::Options o;
/// o.vip = {0, 1, 2, 3};                             // e.g. the question tokens
/// o.block_size = 16;
/// o.fine_blocks = 90;                               // r = n_p + n_c/16 + 90 * 15
/// auto r = effattn::VccAttentionf(o).compute(Q, K, V);
/// // r.output (n x dv), r.segments (J), r.budget_effective (r)
/// using BestFirst = effattn::VccAttention<float, effattn::policy::BestFirstDyadic>;
/// BestFirst::Options b;
/// b.budget = 2048;
/// Eigen::MatrixXf O = BestFirst(b)(Q, K, V, {0, 1, 2, 3});  // VIP rows as an argument
/// \endcode
///
/// \par Gradients
/// No `backward`: which tokens stay exact and which are merged into compressed ones is a
/// discrete, data-dependent selection (the VIP-scored tree), so the output is piecewise smooth
/// with jumps where the selection changes; the gradient with the selection frozen would be that
/// of a different model at every step. Use `ExactAttention::backward`.
///
/// \par Threading
/// `compute` is const and keeps no state. Every parallel loop has a decomposition fixed by the
/// shapes, so results (and the selected J, including its ties) are bit-identical for any number
/// of threads.
template <typename Scalar_, typename Select = policy::TwoLevel, typename Score = policy::MeanProb,
          typename NonVip = policy::Decompress>
class VccAttention
    : public AttentionFunctor<VccAttention<Scalar_, Select, Score, NonVip>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(VccAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same_v<Select, policy::TwoLevel> ||
                    std::is_same_v<Select, policy::BestFirstDyadic> ||
                    std::is_same_v<Select, policy::Uniform>,
                "effattn: VccAttention Select must be policy::TwoLevel, policy::BestFirstDyadic "
                "or policy::Uniform");
  static_assert(std::is_same_v<Score, policy::MeanProb> || std::is_same_v<Score, policy::SumExp>,
                "effattn: VccAttention Score must be policy::MeanProb or policy::SumExp");
  static_assert(std::is_same_v<NonVip, policy::Decompress> ||
                    std::is_same_v<NonVip, policy::ExactQuery> ||
                    std::is_same_v<NonVip, policy::VipOnly>,
                "effattn: VccAttention NonVip must be policy::Decompress, policy::ExactQuery or "
                "policy::VipOnly");

 public:
  using Scalar = Scalar_;             ///< float or double
  using Options = VccOptions;         ///< the options
  using Result = VccResult<Scalar>;   ///< what `compute` returns
  using MatrixType = Matrix<Scalar>;  ///< dense column-major matrix
  using Ref = ConstRef<Scalar>;       ///< input view
  using SelectPolicy = Select;        ///< the selection tag
  using ScorePolicy = Score;          ///< the score tag
  using NonVipPolicy = NonVip;        ///< the non-VIP rows tag

  /// "VccAttention".
  static constexpr const char* name = "VccAttention";
  /// No causal mask: segment means mix past and future tokens.
  static constexpr bool supports_causal = false;
  /// Deterministic (no seed).
  static constexpr bool randomized = false;
  /// Q and K must be the same sequence (the VIP rows index both).
  static constexpr bool self_attention_only = true;
  /// Compressed: exact only when r >= n or every row is VIP.
  static constexpr bool exact = false;

  /// \throws effattn::invalid_argument on a bad scale, budget < 0, block_size < 1,
  ///         fine_blocks < 0, or a negative or repeated index in `vip`.
  explicit VccAttention(Options opts = {});

  /// VCC attention of the n rows of Q (n x d) over K (n x d), V (n x dv), with the VIP rows
  /// `options().vip` (empty: see `VccOptions::vip`).
  /// \throws effattn::invalid_argument on empty, mismatched (Q and K must have the same rows)
  ///         or non-finite inputs, a vip index >= n, or an infeasible budget (unless
  ///         clamp_budget).
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const {
    return run(Q, K, V, m_opts.vip, nullptr);
  }

  /// As `compute(Q, K, V)` with the VIP rows `vip` (any order, unique, in [0, n); may be empty
  /// or all rows) instead of `options().vip`.
  /// \throws effattn::invalid_argument as above, or on bad vip indices.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const std::vector<Index>& vip) const {
    return run(Q, K, V, vip, nullptr);
  }

  /// As `compute(Q, K, V, vip)` with a caller-supplied partition J of the n_c non-VIP rows (for
  /// example from `VccTree::select` in a multi-layer driver); the selection options are unused.
  /// \throws effattn::invalid_argument as above, or if J does not partition [0, n_c).
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const std::vector<Index>& vip,
                               const std::vector<VccSegment>& segments) const {
    return run(Q, K, V, vip, &segments);
  }

  /// `operator()(Q, K, V)`: `compute(Q, K, V).output` (AttentionFunctor).
  using AttentionFunctor<VccAttention<Scalar_, Select, Score, NonVip>, Scalar_>::operator();

  /// Convenience: `compute(Q, K, V, vip).output`.
  /// \throws effattn::numerical_error if the result is not finite.
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V,
                        const std::vector<Index>& vip) const {
    return this->checked_output(compute(Q, K, V, vip));
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  // The selection: J for n_c >= 1 non-VIP rows (detail::vcc_select with the rows of K).
  std::vector<VccSegment> select(const Ref& Q, const Ref& K, const std::vector<Index>& vip,
                                 const std::vector<detail::VccRun>& runs, Index n_c, double tau,
                                 Result& r) const;
  // Everything compute does; `given` is the caller's J or null.
  Result run(const Ref& Q, const Ref& K, const Ref& V, const std::vector<Index>& vip_in,
             const std::vector<VccSegment>* given) const;

  Options m_opts;
};

/// VCC attention (TwoLevel, MeanProb, Decompress), float.
using VccAttentionf = VccAttention<float>;
/// VCC attention (TwoLevel, MeanProb, Decompress), double.
using VccAttentiond = VccAttention<double>;

}  // namespace effattn

#if EFFATTN_DETAIL_WITH_IMPL
#include "detail/methods/vcc_impl.hpp"
#endif

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(VccAttention<float>)
EFFATTN_EXTERN_INSTANCE(VccAttention<double>)
}  // namespace effattn
#endif
