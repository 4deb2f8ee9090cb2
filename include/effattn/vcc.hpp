/// \file vcc.hpp
/// \brief VCC: VIP-token centric compression (Zeng, Hawkins, Hong, Zhang, Pappas, Singh, Zheng,
/// "VCC: Scaling Transformers to 128K Tokens or More by Prioritizing Important Tokens",
/// NeurIPS 2023) as a single attention call, plus the compression tree `VccTree`.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/parallel.hpp"
#include "core/types.hpp"
#include "exact.hpp"

#include "vcc_tree.hpp"

namespace effattn {

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
  /// BestFirstDyadic only (library extension, off by default = the spec's priority
  /// log s + log score): rank a segment by the estimated gain of splitting it,
  /// log sum_i (mass_i(child a) + mass_i(child b) - mass_i(segment)), which is >= 0 by Jensen.
  /// Measured on `workloads::make_smooth_vip` (n = 4096, seeds 1-3): VIP error 1.1e-2..1.3e-2
  /// instead of 2.5e-2..2.7e-2 at |J| = 256, 2.1e-3..2.5e-3 instead of 2.9e-3..3.3e-3 at 1024.
  /// Three GEMVs per refinement instead of one.
  bool lookahead = false;
  /// VCC has no causal mask (the compressed keys mix positions): must stay false, true throws.
  bool causal = false;
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
};

namespace detail {

/// Sorted copy of `vip`. \throws invalid_argument on an out-of-range or duplicate index.
inline std::vector<Index> vcc_check_vip(const std::vector<Index>& vip, Index n) {
  std::vector<Index> s = vip;
  std::sort(s.begin(), s.end());
  for (std::size_t i = 0; i < s.size(); ++i) {
    EFFATTN_CHECK(s[i] >= 0 && s[i] < n,
                  cat("VccAttention: vip indices must be rows of Q, K and V in [0, n) with n = ", n,
                      "; got ", s[i]));
    EFFATTN_CHECK(i == 0 || s[i] != s[i - 1],
                  cat("VccAttention: vip indices must be unique; ", s[i], " appears twice"));
  }
  return s;
}

template <typename T, typename = void>
struct vcc_has_select : std::false_type {};
template <typename T>
struct vcc_has_select<T, std::void_t<decltype(T::kind)>>
    : std::is_same<std::decay_t<decltype(T::kind)>, vcc::SelectKind> {};
template <typename T, typename = void>
struct vcc_has_score : std::false_type {};
template <typename T>
struct vcc_has_score<T, std::void_t<decltype(T::kind)>>
    : std::is_same<std::decay_t<decltype(T::kind)>, vcc::ScoreKind> {};
template <typename T, typename = void>
struct vcc_has_nonvip : std::false_type {};
template <typename T>
struct vcc_has_nonvip<T, std::void_t<decltype(T::kind)>>
    : std::is_same<std::decay_t<decltype(T::kind)>, vcc::NonVipKind> {};

}  // namespace detail

/// \ingroup Methods
/// \brief VCC attention: the VIP rows attend exactly to the VIP keys and to a VIP-guided
/// multi-resolution compression of all other keys and values (Zeng et al., NeurIPS 2023).
///
/// The n rows are split into the n_p VIP rows P (`vip`) and the n_c = n - n_p others, C, kept
/// in their original order. A partition J of C into contiguous segments (sizes s_j) gives
/// S_c (row j = the mean over segment j), the compressed keys and values
/// K' = [K_P; S_c K_C], V' = [V_P; S_c V_C] (r = n_p + |J| rows) and the log-count bias
/// b = [0; log s_j] (the paper's D, in numerator and denominator):
/// \f[ O_P = \mathrm{softmax}(\tau Q_P K'^T + 1 b^T) V'. \f]
/// This is exactly softmax attention against keys and values averaged within segments:
/// O_P = Attn(Q_P, [K_P; S_c^\dagger S_c K_C], [V_P; S_c^\dagger S_c V_C]), with
/// S_c^\dagger = S_c^T D. The error is 0 when every segment is one row (r >= n) or keys and values
/// are constant on segments; VIP row q satisfies
/// ||O_hat(q) - O(q)|| <= eps_v + (exp(2 tau ||q|| delta) - 1) max_j ||vbar_j||, with delta and
/// eps_v the largest in-segment deviations of keys and values.
/// The non-VIP rows follow `NonVip`: `vcc::Decompress` (the paper: the segment-mean queries
/// attend and every token gets its segment's output, O_C = S_c^\dagger softmax(tau S_c Q_C K'^T +
/// b) V'), `vcc::ExactQuery` (every query attends to K', V'), or `vcc::VipOnly` (left at 0).
///
/// J comes from `Select` guided by the VIP queries scored with `Score` (see the policy tags in
/// `effattn::vcc`): `vcc::TwoLevel` (the paper's experiments and code, default),
/// `vcc::BestFirstDyadic` (budgeted refinement of the dyadic tree `VccTree`, library extension),
/// `vcc::Uniform` (no guidance: the pooling baseline); `vcc::MeanProb` (default) or
/// `vcc::SumExp`. With no VIP rows the selection falls back to Uniform.
///
/// Cost (d_v ~ d): TwoLevel + VipOnly O(n d + (n_c / k) n_p d + n_p r d); BestFirstDyadic adds
/// the tree O(n_c d) and O(r n_p d) for the refinement; Decompress adds O(|J| r d + n d);
/// ExactQuery O(n_c r d). Extra memory O(n_c d / k + r d) (TwoLevel) or O(n_c d) (tree), plus
/// attention tiles: nothing n x n or n_p x n is formed.
///
/// Kernel-level caveat: compressing K and V equals the paper's compress-the-hidden-states only
/// when X -> K, V is affine (it is for biased linear projections, since S_c rows sum to 1; not for
/// pre-LayerNorm or RoPE applied after averaging): this primitive defines VCC on the given K, V.
///
/// \tparam Scalar_ float or double.
/// \tparam Select `vcc::TwoLevel` (default), `vcc::BestFirstDyadic` or `vcc::Uniform`.
/// \tparam Score `vcc::MeanProb` (default) or `vcc::SumExp`.
/// \tparam NonVip `vcc::Decompress` (default), `vcc::ExactQuery` or `vcc::VipOnly`.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/vcc.hpp>
/// Eigen::MatrixXf Q = ..., K = ..., V = ...;        // n x d, n x d, n x dv
/// std::vector<Eigen::Index> vip = {0, 1, 2, 3};     // e.g. the question tokens
/// effattn::VccAttentionf::Options o;
/// o.block_size = 16;
/// o.fine_blocks = 90;                               // r = n_p + n_c/16 + 90 * 15
/// auto r = effattn::VccAttentionf(o).compute(Q, K, V, vip);
/// // r.output (n x dv), r.segments (J), r.budget_effective (r)
/// using BestFirst = effattn::VccAttention<float, effattn::vcc::BestFirstDyadic>;
/// BestFirst::Options b;
/// b.budget = 2048;
/// Eigen::MatrixXf O = BestFirst(b)(Q, K, V, vip);
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state. Every parallel loop has a decomposition fixed by the
/// shapes, so results (and the selected J, including its ties) are bit-identical for any number
/// of threads.
template <typename Scalar_, typename Select = vcc::TwoLevel, typename Score = vcc::MeanProb,
          typename NonVip = vcc::Decompress>
class VccAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(detail::vcc_has_select<Select>::value,
                "effattn: VccAttention Select must be vcc::TwoLevel, vcc::BestFirstDyadic or "
                "vcc::Uniform");
  static_assert(detail::vcc_has_score<Score>::value,
                "effattn: VccAttention Score must be vcc::MeanProb or vcc::SumExp");
  static_assert(detail::vcc_has_nonvip<NonVip>::value,
                "effattn: VccAttention NonVip must be vcc::Decompress, vcc::ExactQuery or "
                "vcc::VipOnly");

 public:
  using Scalar = Scalar_;
  using Options = VccOptions;
  using Result = VccResult<Scalar>;
  using MatrixType = Matrix<Scalar>;
  using Ref = ConstRef<Scalar>;
  static constexpr vcc::SelectKind select_kind = Select::kind;
  static constexpr vcc::ScoreKind score_kind = Score::kind;
  static constexpr vcc::NonVipKind nonvip_kind = NonVip::kind;

  /// \throws effattn::invalid_argument on a bad scale, budget < 0, block_size < 1,
  ///         fine_blocks < 0, or causal = true.
  explicit VccAttention(Options opts = {}) : m_opts(opts) {
    detail::check_scale_option(m_opts.scale, "VccAttention");
    EFFATTN_CHECK(m_opts.budget >= 0,
                  detail::cat("VccAttention: Options::budget (r) must be >= 0 (0 = automatic); "
                              "got ",
                              m_opts.budget));
    detail::vcc_check_select_options(m_opts.block_size, m_opts.fine_blocks,
                                     "VccAttention: Options");
    EFFATTN_CHECK(!m_opts.causal,
                  "VccAttention: Options::causal is not supported (segment means mix past and "
                  "future tokens); VCC has no causal mask");
  }

  /// VCC attention of the n rows of Q (n x d) over K (n x d), V (n x dv), with the VIP rows
  /// `vip` (any order, unique, in [0, n); may be empty or all rows).
  /// \throws effattn::invalid_argument on empty, mismatched (Q and K must have the same rows)
  ///         or non-finite inputs, bad vip indices, or an infeasible budget (unless
  ///         clamp_budget).
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

  /// Convenience: `compute(Q, K, V, vip).output`.
  /// \throws effattn::numerical_error if the result is not finite.
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V,
                        const std::vector<Index>& vip) const {
    Result r = compute(Q, K, V, vip);
    if (r.info != Info::Success) detail::throw_numerical_error("VccAttention", r.info);
    return std::move(r.output);
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  // The selection: J for n_c >= 1 non-VIP rows.
  std::vector<VccSegment> select(const Ref& Q, const Ref& K, const std::vector<Index>& vip,
                                 const std::vector<detail::VccRun>& runs, Index n_c, double tau,
                                 Result& r) const {
    const Index n_p = static_cast<Index>(vip.size()), n = n_p + n_c;
    const Index k = m_opts.block_size, nb = (n_c + k - 1) / k;
    const bool two_level = select_kind == vcc::SelectKind::TwoLevel;
    // m = r - n_p, the number of segments.
    Index m = m_opts.budget > 0 ? std::min(m_opts.budget, n) - n_p
                                : detail::vcc_auto_segments(n_c, k, m_opts.fine_blocks);
    const Index m_min = two_level && n_p > 0 ? nb : 1;
    if (m < m_min) {
      EFFATTN_CHECK(m_opts.clamp_budget,
                    detail::cat("VccAttention: Options::budget r = ", m_opts.budget,
                                " is infeasible: it must be >= n_p + ",
                                two_level ? "ceil(n_c / k) = " : "1 = ", n_p + m_min,
                                " (n_p = ", n_p, " VIP rows, n_c = ", n_c,
                                two_level ? detail::cat(", k = ", k) : std::string(),
                                "); set clamp_budget to raise it automatically"));
      m = m_min;
    }
    m = std::min(m, n_c);
    if (n_p == 0 || select_kind == vcc::SelectKind::Uniform) {
      r.uniform_fallback = n_p == 0 && select_kind != vcc::SelectKind::Uniform;
      return detail::vcc_uniform(n_c, m);
    }
    if (m >= n_c) {
      if (two_level) r.fine_blocks = nb;
      return detail::vcc_singletons(n_c);
    }
    Matrix<Scalar> QPs(n_p, Q.cols());
    for (Index i = 0; i < n_p; ++i) QPs.row(i) = Q.row(vip[static_cast<std::size_t>(i)]);
    QPs *= static_cast<Scalar>(tau);
    if (two_level) {
      std::vector<VccSegment> blocks(static_cast<std::size_t>(nb));
      std::vector<double> logc(static_cast<std::size_t>(nb));
      for (Index b = 0; b < nb; ++b) {
        const Index c = std::min(k, n_c - b * k);
        blocks[static_cast<std::size_t>(b)] = VccSegment{b * k, c, -1};
        logc[static_cast<std::size_t>(b)] = std::log(static_cast<double>(c));
      }
      Matrix<Scalar> Kb(nb, K.cols());
      detail::vcc_segment_means<Scalar>(K, runs, blocks, Kb, 0);
      // MeanProb: each VIP row's softmax over the blocks, averaged over the rows (official
      // code). Deviation: the log-count bias is included in the logits, which changes nothing
      // for equal blocks and weighs a ragged last block by its true size.
      const Eigen::Array<double, Eigen::Dynamic, 1> off =
          score_kind == vcc::ScoreKind::MeanProb ? detail::vcc_row_lse(QPs, Kb, logc)
                                                 : Eigen::Array<double, Eigen::Dynamic, 1>();
      const std::vector<double> prio = detail::vcc_priorities(QPs, Kb, logc, off);
      return detail::vcc_two_level(n_c, k, prio, m_opts.budget > 0 ? m : 0, m_opts.fine_blocks,
                                   r.fine_blocks);
    }
    VccTree<Scalar> tree;
    tree.build_from_rows(detail::vcc_gather_rows<Scalar>(K, runs, n_c));
    return detail::vcc_best_first(tree, QPs, m, score_kind, k, m_opts.lookahead);
  }

  Result run(const Ref& Q, const Ref& K, const Ref& V, const std::vector<Index>& vip_in,
             const std::vector<VccSegment>* given) const {
    detail::check_attention_inputs(Q, K, V, "VccAttention");
    EFFATTN_CHECK(Q.rows() == K.rows(),
                  detail::cat("VccAttention: VCC is self-attention over one token sequence: Q "
                              "must be n x d and K n x d with the same n; got Q ",
                              detail::shape(Q), ", K ", detail::shape(K)));
    const Index n = Q.rows(), dv = V.cols();
    Result r;
    r.vip = detail::vcc_check_vip(vip_in, n);
    const std::vector<Index>& vip = r.vip;
    const Index n_p = static_cast<Index>(vip.size()), n_c = n - n_p;
    const double tau = detail::resolve_scale(m_opts.scale, Q.cols());
    ExactOptions eo;
    eo.scale = tau;
    const ExactAttention<Scalar> exact(eo);

    if (n_c == 0) {  // every row is VIP: exact attention
      if (given != nullptr) vcc::check_partition(*given, 0, "VccAttention");
      auto e = exact.compute(Q, K, V);
      r.output = std::move(e.output);
      r.info = e.info;
      r.budget_effective = n;
      return r;
    }
    const std::vector<detail::VccRun> runs = detail::vcc_runs(n, vip);
    if (given != nullptr) {
      vcc::check_partition(*given, n_c, "VccAttention");
      r.segments = *given;
    } else {
      r.segments = select(Q, K, vip, runs, n_c, tau, r);
    }
    const std::vector<VccSegment>& J = r.segments;
    const Index m = static_cast<Index>(J.size()), rr = n_p + m;
    r.budget_effective = rr;

    // K' = [K_P; S_c K_C], V' = [V_P; S_c V_C], b = [0; log s_j].
    MatrixType Kc(rr, Q.cols()), Vc(rr, dv);
    Vector<Scalar> bias(rr);
    for (Index i = 0; i < n_p; ++i) {
      Kc.row(i) = K.row(vip[static_cast<std::size_t>(i)]);
      Vc.row(i) = V.row(vip[static_cast<std::size_t>(i)]);
      bias(i) = Scalar(0);
    }
    detail::vcc_segment_means<Scalar>(K, runs, J, Kc, n_p);
    detail::vcc_segment_means<Scalar>(V, runs, J, Vc, n_p);
    for (Index j = 0; j < m; ++j)
      bias(n_p + j) =
          static_cast<Scalar>(std::log(static_cast<double>(J[static_cast<std::size_t>(j)].count)));

    Info info = Info::Success;
    if (nonvip_kind == vcc::NonVipKind::ExactQuery) {
      auto e = exact.compute(Q, Kc, Vc, bias);
      r.output = std::move(e.output);
      info = e.info;
    } else {
      const bool decompress = nonvip_kind == vcc::NonVipKind::Decompress;
      const Index nq = n_p + (decompress ? m : 0);
      r.output = MatrixType::Zero(n, dv);
      if (nq > 0) {
        MatrixType Qs(nq, Q.cols());
        for (Index i = 0; i < n_p; ++i) Qs.row(i) = Q.row(vip[static_cast<std::size_t>(i)]);
        if (decompress) detail::vcc_segment_means<Scalar>(Q, runs, J, Qs, n_p);
        auto e = exact.compute(Qs, Kc, Vc, bias);
        info = e.info;
        for (Index i = 0; i < n_p; ++i)
          r.output.row(vip[static_cast<std::size_t>(i)]) = e.output.row(i);
        if (decompress) detail::vcc_scatter_segments<Scalar>(e.output, n_p, runs, J, r.output);
      }
    }
    r.info = info == Info::Success && detail::all_finite(r.output) ? Info::Success
                                                                   : Info::NumericalIssue;
    return r;
  }

  Options m_opts;
};

/// VCC attention (TwoLevel, MeanProb, Decompress), float.
using VccAttentionf = VccAttention<float>;
/// VCC attention (TwoLevel, MeanProb, Decompress), double.
using VccAttentiond = VccAttention<double>;

}  // namespace effattn
