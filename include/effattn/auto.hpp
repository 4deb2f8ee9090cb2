/// \file auto.hpp
/// \brief AutoAttention: ask for an accuracy, not a budget. For a shape, a mask and a relative
/// error target it picks the fastest method and budget that meets the target on a short probe of
/// sampled exact rows, exact attention included, and says why.
///
/// The choice, for Q (n x d), K (m x d), V (m x dv):
/// 1. A cost model (in units of exact Tiled attention at the same shape, calibrated on the
///    benchmarks; see `detail::AutoCostModel`) predicts each candidate's cost: WildCat (non-causal)
///    up to the largest rank whose selection fits the probe budget, EVA (causal or not, only for
///    targets >= `eva_min_target`: its measured error floor on the shared workloads and the
///    trained models is ~0.08), and exact attention. Nothing else is a candidate: VCC approximates
///    only its VIP rows, Performer's errors are >= 0.1, Conv-Basis fails on content-dependent
///    heads (+2.4 bits per byte on the trained decoder) and KEP-SVGP costs more than exact.
/// 2. The probe budget is `max_overhead` x exact: the sampled exact rows plus every candidate
///    tried must fit in it, so when nothing meets the target the call costs at most
///    (1 + max_overhead) x exact attention (to the accuracy of the cost model). When no candidate
///    fits (small n, causal masks at tight targets, ...) exact attention runs at once, with no
///    probe at all.
/// 3. The probe: `error_sample_rows` query rows drawn uniformly (seeded), their exact attention
///    computed in double (O(s m (d + dv))). A candidate is accepted when its estimated relative
///    Frobenius error on those rows is <= safety x target_error. WildCat is probed by compressing
///    the keys once with the residual-trace tolerance rel_tol = safety x target (rank capped by the
///    budget) and attending with the sampled rows only; if it misses and budget is left, the
///    tolerance is tightened and the keys are compressed again; when accepted, the same compressed
///    cache serves every query (O(n r (d + dv))). EVA is run whole and its sampled rows compared.
/// 4. If nothing is accepted, exact attention (`ExactAttention<Scalar>`, Tiled) gives the output,
///    and the Result says which candidates were tried, their estimates and why they lost.
///
/// The estimate is not a bound: it can miss rare rows whose error is far above the rest (the
/// `needles` workload); `safety` < 1 covers the sampling noise of the ordinary case. Every choice
/// depends only on the shape, the options and the data (never on timings), so the output is the
/// same for every thread count and call.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/checks.hpp"
#include "core/concept.hpp"
#include "core/deprecated.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"

namespace effattn {

/// The methods `AutoAttention` chooses between.
enum class AutoMethod {
  Exact,    ///< ExactAttention (Tiled): the fallback, and the choice when nothing is faster
  Wildcat,  ///< WildcatAttention's compressed cache (one bin), budget = coreset rank
  Eva       ///< EvaAttention, budget = exact local window
};

/// "exact", "wildcat" or "eva".
inline const char* to_string(AutoMethod m) noexcept {
  switch (m) {
    case AutoMethod::Wildcat:
      return "wildcat";
    case AutoMethod::Eva:
      return "eva";
    default:
      return "exact";
  }
}

EFFATTN_DEPRECATED_FIELDS_BEGIN  // the renamed fields' old spellings (core/deprecated.hpp)

/// Options of `AutoAttention`.
struct AutoOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal mask, bottom-right aligned (as ExactAttention; requires m >= n). Rules WildCat out.
  bool causal = false;
  /// Relative Frobenius error target ||O - Ohat||_F / ||O||_F, estimated on `error_sample_rows`
  /// sampled rows. 0 = always exact attention.
  double target_error = 1e-2;
  /// Query rows whose exact attention is computed for the estimate (at most n). 0 = automatic:
  /// n / 64 clamped to [32, 256], so the rows cost ~5% of exact attention or less (the probe
  /// computes them at about a third of the Tiled kernel's rate). The same field as
  /// `WildcatOptions::error_sample_rows` (whose default is 64 rows).
  Index error_sample_rows = 0;
  /// Probe budget, as a fraction of exact attention's predicted cost: the sampled rows plus every
  /// candidate tried stay within it, so a call costs at most (1 + max_overhead) x exact.
  double max_overhead = 0.2;
  /// A candidate is accepted when its estimate is <= safety x target_error (0 < safety <= 1):
  /// the margin for the estimate's sampling noise (measured on sphere: estimate / true error
  /// 0.9-1.1 with 64-256 rows).
  double safety = 0.9;
  /// EVA is a candidate only for targets >= this (its error floor, see the file documentation).
  double eva_min_target = 0.05;
  /// Seed of the sampled rows and of WildCat's pivots.
  std::uint64_t seed = 0x5eedULL;
  /// WildCat is probed only when the largest rank r the budget affords satisfies
  /// r x target_error >= this (0 = whenever some rank fits). The smallest rank x error product
  /// measured on the shared workloads is 3.2 (`sphere`, r = 256, n = 4096, d = 64; 7-17 on the
  /// others), so below 2 a probe would only spend time: at n = 4096 and a 1e-2 target the
  /// affordable r = 64 missed on every workload and the wasted probe made the call 1.10-1.20x
  /// exact's time.
  double wildcat_min_rank_error = 2.0;
  /// Allow WildCat as a candidate (non-causal only).
  bool allow_wildcat = true;
  /// Allow EVA as a candidate.
  bool allow_eva = true;

  /// Deprecated spelling of `error_sample_rows` (honoured when not 0; removed in the next
  /// release).
  [[deprecated("use error_sample_rows")]] Index probe_rows = 0;
};

/// One candidate `AutoAttention` considered.
struct AutoCandidate {
  AutoMethod method = AutoMethod::Exact;  ///< the method
  Index budget = 0;                       ///< WildCat: rank used (cap when not probed); EVA: window
  double predicted_cost = 0;    ///< cost-model cost of the probe, in units of exact attention
  double estimated_error = -1;  ///< estimate on the sampled rows (-1: not probed)
  bool accepted = false;        ///< met safety x target
};

/// Result of `AutoAttention::compute`.
template <typename Scalar>
struct AutoResult : AttentionResult<Scalar> {
  AutoMethod method = AutoMethod::Exact;  ///< the method that produced `output`
  Index budget = 0;                       ///< its budget (WildCat rank, EVA window; 0 for exact)
  double estimated_error = 0;             ///< its estimated relative error (0 for exact attention)
  /// Predicted cost of the whole call (probe + chosen method) over exact attention's, from the
  /// cost model (< 1: faster than exact).
  double predicted_cost = 1;
  Index error_sample_rows = 0;  ///< rows sampled for the estimate (0: no probe was needed)
  std::string reason;           ///< why this method, in words
  std::vector<AutoCandidate> candidates;  ///< every candidate considered, in the order tried
  Vector<Scalar> lse;  ///< n log-sum-exp values when exact attention was chosen (else empty)
  /// Deprecated spelling of `error_sample_rows` (the same value; removed in the next release).
  [[deprecated("use error_sample_rows")]] Index probe_rows = 0;

  /// chosen_method (0 exact, 1 wildcat, 2 eva), budget, estimated_error, predicted_cost,
  /// error_sample_rows, candidates_tried; then probe_rows, the deprecated name of
  /// error_sample_rows (the same value; removed in the next release).
  Diagnostics diagnostics() const {
    Index tried = 0;
    for (const AutoCandidate& c : candidates) tried += c.estimated_error >= 0 ? 1 : 0;
    return {{"chosen_method", static_cast<double>(method)},
            {"budget", static_cast<double>(budget)},
            {"estimated_error", estimated_error},
            {"predicted_cost", predicted_cost},
            {"error_sample_rows", static_cast<double>(error_sample_rows)},
            {"candidates_tried", static_cast<double>(tried)},
            {"probe_rows", static_cast<double>(error_sample_rows)}};
  }
};

namespace detail {
/// `o` with the deprecated spelling folded into the new field (core/deprecated.hpp).
/// \throws effattn::invalid_argument when the old and the new spelling disagree.
inline AutoOptions resolve_renamed(AutoOptions o, const char* who) {
  merge_renamed(o.error_sample_rows, o.probe_rows, Index(0), who, "error_sample_rows",
                "probe_rows");
  return o;
}
/// Sets `r.error_sample_rows` and its deprecated spelling `r.probe_rows` to `rows`.
template <typename Scalar>
void set_error_sample_rows(AutoResult<Scalar>& r, Index rows) {
  r.error_sample_rows = rows;
  r.probe_rows = rows;
}
}  // namespace detail

EFFATTN_DEPRECATED_FIELDS_END

/// \ingroup Methods
/// \brief Attention at a requested accuracy: the fastest of exact attention, WildCat and EVA that
/// meets `Options::target_error` on sampled exact rows (see the file documentation).
///
/// Cost: exact attention's when nothing is faster; otherwise the probe (s rows of exact
/// attention, O(s m (d + dv)), plus the candidates tried, together <= max_overhead x exact) plus
/// the chosen method. No n x m matrix. Memory as the chosen method's.
///
/// \par Example
/// \code{.cpp}
/// effattn::AutoAttentionf::Options o;
/// o.target_error = 1e-2;
/// auto r = effattn::AutoAttentionf(o).compute(Q, K, V);
/// std::printf("%s, budget %ld, est. error %.2e: %s\n", effattn::to_string(r.method),
///             static_cast<long>(r.budget), r.estimated_error, r.reason.c_str());
/// \endcode
template <typename Scalar_>
class AutoAttention : public AttentionFunctor<AutoAttention<Scalar_>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(AutoAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");

 public:
  using Scalar = Scalar_;             ///< the scalar type (float or double)
  using Options = AutoOptions;        ///< the options struct
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;       ///< the input type, `ConstRef<Scalar>`
  using Result = AutoResult<Scalar>;  ///< the result of `compute`

  static constexpr const char* name = "AutoAttention";  ///< the method's name
  static constexpr bool supports_causal = true;         ///< `Options::causal` is honoured
  static constexpr bool randomized = true;              ///< sampled rows and pivots use the seed
  static constexpr bool self_attention_only = false;    ///< any n and m
  static constexpr bool exact = false;  ///< within the target, exact only when it chooses so

  /// \throws effattn::invalid_argument on a negative or non-finite scale or target_error,
  ///         error_sample_rows < 0 (or a deprecated probe_rows that disagrees with it),
  ///         max_overhead < 0 or non-finite, safety outside (0, 1], or a negative or non-finite
  ///         eva_min_target.
  explicit AutoAttention(Options opts = {});

  /// Attention of Q (n x d) over K (m x d), V (m x dv) at the target accuracy.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, and for
  ///         `causal` with m < n.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

/// AutoAttention, float.
using AutoAttentionf = AutoAttention<float>;
/// AutoAttention, double.
using AutoAttentiond = AutoAttention<double>;

}  // namespace effattn

#if EFFATTN_DETAIL_WITH_IMPL
#include "detail/methods/auto_impl.hpp"
#endif

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(AutoAttention<float>)
EFFATTN_EXTERN_INSTANCE(AutoAttention<double>)
}  // namespace effattn
#endif
