/// \file wildcat.hpp
/// \brief WildCat: weighted-coreset attention through randomly pivoted Nystrom (RPNys), a KV-cache
/// compressor, and a certified a-posteriori error bound (Schroeder & Mackey, "WildCat: Near-Linear
/// Attention in Theory and Practice").
///
/// Exact attention O = D^{-1} A V with A_il = exp(beta <q_i, k_l>) is replaced by a rank-r Nystrom
/// approximation of A built from the keys alone: with a coreset S of keys (chosen by randomly
/// pivoted Cholesky on the key kernel) and the Nystrom weights W = h(K_S, K_S)^{-1} h(K_S, K),
/// \f[ \hat O_i = \mathrm{clip}\Big(\frac{\sum_{s \in S} e^{\beta \langle q_i, k_s\rangle} (W V)_s}
///                {\sum_{s \in S} e^{\beta \langle q_i, k_s\rangle} (W 1)_s},\ v_{\min},
///                v_{\max}\Big),
/// \f]
/// where v_min / v_max are the column extrema of all m values. Keys are first recentred by their
/// mean and the kernel is tempered, h_tau(x, y) = exp(beta <x, y> / tau^2), with the closed-form
/// tau of the paper's eq. (12) (Lambert W); both leave exact attention unchanged. Keys are split
/// into contiguous bins, each compressed independently (in parallel). The Nystrom weights come
/// from numerics/nystrom.hpp (`exp_dot_log_scaled_product`), the pivots from
/// numerics/rp_cholesky.hpp.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/concept.hpp"
#include "core/deprecated.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"
#include "numerics/rp_cholesky.hpp"

namespace effattn {

namespace wildcat {

/// What a row gets when its approximate denominator sum_s e^{beta<q, k_s>} w_s is not safely
/// positive (weights can be negative): `Zero` (the paper's choice, then clipped) or `Midpoint`
/// ((vmin + vmax) / 2, the minimiser of the worst-case error). Either way Lemma 1 caps the error
/// of the row at max_j (vmax_j - vmin_j) when clipping is on.
enum class Fallback { Zero, Midpoint };

/// rho0 = sqrt(1 + exp(W0(2 / e^2) + 2)) = 3.191601025323704 (paper eq. 12).
inline double rho0();

/// The squared temperature tau^2 of the paper's eq. (12):
/// b0 = log(m_bin) / (beta R_Q R_K) + 2, rho = b0 / (2 W0(b0 / (2 rho0))), tau^2 = (R_K / R_Q) rho
/// (rho = tau^2 R_Q / R_K >= 4.0784). Degenerate inputs (R_Q = 0, R_K = 0, or beta R_Q R_K so
/// small that b0 overflows) give tau = 1: the tempered kernel is then (numerically) rank one.
/// \throws effattn::invalid_argument on negative or non-finite arguments or m_bin < 1.
inline double temperature_squared(double beta, double q_radius, double k_radius, Index m_bin);

}  // namespace wildcat

EFFATTN_DEPRECATED_FIELDS_BEGIN  // the renamed field's old spelling (core/deprecated.hpp)

/// Options of `WildcatAttention`, `compress_kv`, `recompress_tail` and `weighted_attention`.
/// WildCat has no causal form (the paper lists it as a limitation):
/// `WildcatAttention::supports_causal` is false.
struct WildcatOptions {
  /// Logit scale beta: the logit of (i, l) is scale * <q_i, k_l>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Coreset budget r >= 1 (total over bins): each bin gets ceil(rank / bins) pivots. A bin with
  /// no more keys than that is kept exactly (weights 1), so rank >= m gives exact attention.
  Index rank = 256;
  /// Number B >= 1 of contiguous key bins: B bins of floor(m / B) keys plus, if m % B != 0, a
  /// remainder bin with its own ceil(rank / B) pivots. B > m acts as B = m.
  Index bins = 1;
  /// Seed of the pivot draws (bin b uses the stream derive_seed(seed, b)).
  std::uint64_t seed = 0x5eedULL;
  /// Clip every output entry to [vmin_j, vmax_j] (part of the method; Lemma 1 needs it).
  bool clip = true;
  /// Adaptive rank: stop adding pivots to a bin once its residual trace tr(H - Hhat) is
  /// <= rel_tol * tr(H) (tempered kernel of the bin). 0 = always use the full budget.
  double rel_tol = 0;
  /// R_Q, the query-norm bound in eq. (12). 0 = max_i ||q_i|| in the forward pass; for
  /// `compress_kv` the q_radius argument is used instead (0 there = each bin's R_K).
  double q_radius = 0;
  /// Use the eq. (12) temperature (default); false uses tau = 1 (ablation only).
  bool temperature = true;
  /// Data-driven temperature (off by default): per bin, also factorise at tau^2 / 2, / 4, / 8
  /// and tau^2 = 1 and keep the tau^2 whose Lemma 2 bound e^{beta tau^2 R_Q^2} tr(H_tau -
  /// Hhat_tau) (the certified bound's per-bin term) is smallest at the bin's rank. Up to 5x the
  /// selection cost. Measured (n = 4096, r = 256, B = 1, float, mean of 3 seeds, relative
  /// Frobenius error of 256 rows): it picks tau^2 ~ 1 on `clustered` (error 0.025 against 0.068
  /// with eq. 12) but also on `gaussian` (2.6 against 0.57) and tau^2 ~ 1.7 on `sphere` (0.018
  /// against 0.0125), so eq. (12) stays the default.
  bool fit_temperature = false;
  /// Row fallback when the approximate denominator is not safely positive.
  wildcat::Fallback fallback = wildcat::Fallback::Zero;
  /// A denominator counts as failed when it is <= denominator_tol * sum_s e^{..} |w_s|: with
  /// negative weights the sum can cancel to a tiny or negative value whose quotient is noise.
  /// Such rows get the fallback and are counted in `fallback_rows`.
  double denominator_tol = 1e-12;
  /// Accelerated RPCholesky: pivot proposals per block (0 = automatic;
  /// `RpCholeskyOptions::proposal_block`).
  Index proposal_block = 0;
  /// Error target (0 = off): the relative Frobenius error ||O - Ohat||_F / ||O||_F that
  /// `compute` aims for, *estimated* (not certified) on `error_sample_rows` query rows drawn
  /// uniformly without replacement, whose exact attention is computed (O(s m (d + dv)) extra).
  /// The rank is then chosen per bin through the residual-trace criterion of `rel_tol`: round 1
  /// compresses with rel_tol = (rel_tol > 0 ? rel_tol : target_error) (measured on sphere,
  /// n = 4096: a relative residual trace t gives an error of about t at t ~ 1e-2; on clustered
  /// about 3 t .. 0.75 sqrt(t)); while the estimate is above the target, the trace tolerance is
  /// multiplied by clamp(0.5 (target / estimate)^2, 1e-4, 0.5) and the keys are compressed again
  /// (at most 4 rounds; the pivots of a tighter tolerance extend those of a looser one, same
  /// seed). `rank` stays the budget cap: once every bin uses its whole budget (or its rank stops
  /// growing) the target may be missed, which the result reports (`estimated_error` > target).
  /// Ignored by `compress_kv` / `recompress_tail` (no queries).
  double target_error = 0;
  /// Query rows sampled for the `target_error` estimate (min(n, this); >= 1). The same field
  /// as `AutoOptions::error_sample_rows`, whose default 0 picks the count from n.
  Index error_sample_rows = 64;
  /// Coreset attention (the two products of WtdAttn, S = beta Q K_S^T and P V_S) with bf16
  /// operands and fp32 accumulation, on the kernels of `policy::TiledBf16` (`active_isa()`:
  /// AVX512-BF16 `vdpbf16ps`, or the portable path that widens the bf16 values to float); the
  /// softmax weights, the denominators P w and P |w| and the error bound stay fp32 / double.
  /// float only (ignored for double; `WildcatResult::bf16` says whether it ran). Off by default:
  /// it adds the bf16 error of exact attention (~3e-3 relative Frobenius) to WildCat's own
  /// (~1e-2 at r = 256 on sphere), and `error_bound` does not cover the rounding. Measured speed:
  /// docs/methods/wildcat.md.
  bool bf16_attention = false;

  /// Deprecated spelling of `proposal_block` (honoured when not 0; removed in the next release).
  [[deprecated("use proposal_block")]] Index block_size = 0;
};

namespace detail {
/// `o` with the deprecated spelling folded into the new field (core/deprecated.hpp).
/// \throws effattn::invalid_argument when the old and the new spelling disagree.
inline WildcatOptions resolve_renamed(WildcatOptions o, const char* who) {
  merge_renamed(o.proposal_block, o.block_size, Index(0), who, "proposal_block", "block_size");
  return o;
}
}  // namespace detail

EFFATTN_DEPRECATED_FIELDS_END

/// One compressed bin (or exactly kept bin) of a `CompressedKV`; the data of the error bound.
struct WildcatBlock {
  Index row_begin = 0;     ///< first coreset row of the block in the CompressedKV
  Index rows = 0;          ///< coreset rows of the block (pivots used, or all keys if exact)
  Index first_token = 0;   ///< position of the block's first key in the sequence
  Index tokens = 0;        ///< keys m_b the block represents
  bool exact = false;      ///< all keys kept with weight 1 (m_b <= pivots per bin)
  Eigen::VectorXd centre;  ///< recentring point kbar, in the frame of the stored keys
  double key_radius = 0;   ///< R_K = max_l ||k_l - kbar|| over the block
  double tau2 = 1;         ///< tau^2 used (eq. 12; 1 on the exact path)
  /// log tr(H_tau - Hhat_tau) of the block's tempered kernel (an upper bound: residuals zeroed
  /// as round-off are added back); -inf on the exact path.
  double log_residual_trace = -std::numeric_limits<double>::infinity();
};

/// \brief A compressed KV cache (paper Alg. 2, CompressKV): r coreset keys with compressed values
/// V_S = W V and weights w = W 1, stored in log-scaled form, plus an exact (uncompressed) tail.
///
/// Row s stands for the kernel column exp(beta <q, keys_s> + log_scale_s); the true Nystrom
/// weights are W(s, :) = exp(log_scale_s) * (row s of the stored weights), so that
/// sum_s e^{beta<q,k_s> + log_scale_s} values_s approximates sum_l e^{beta<q,k_l>} v_l. The
/// per-row log-scale keeps everything finite whatever the logit range (the plain weights carry
/// factors e^{beta |k|^2 / (2 tau^2)} that overflow for large keys) and lets blocks compressed
/// separately (bins, later re-compressions) and exact rows (weight 1, log-scale 0) share one
/// softmax. Keys are in original units (recentring is added back).
template <typename Scalar>
struct CompressedKV {
  Matrix<Scalar> keys;               ///< r x d coreset keys (original units)
  Matrix<Scalar> values;             ///< r x dv compressed values (log-scaled)
  Vector<Scalar> weights;            ///< r compressed softmax weights (log-scaled; may be < 0)
  Vector<Scalar> log_scale;          ///< r log-scales (0 for exact rows)
  RowVector<Scalar> vmin;            ///< running column minima of every value seen (the clip)
  RowVector<Scalar> vmax;            ///< running column maxima of every value seen (the clip)
  std::vector<Index> pivots;         ///< sequence position of the token behind each row
  std::vector<WildcatBlock> blocks;  ///< compressed (and exactly kept) bins, in row order
  Index tokens = 0;                  ///< tokens represented (compressed + tail)
  Index tail_begin = 0;              ///< rows [tail_begin, size()) are the exact appended tail

  /// Coreset rows r (compressed rows plus tail).
  Index size() const noexcept { return keys.rows(); }
  /// Rows of the exact tail.
  Index tail_size() const noexcept { return size() - tail_begin; }

  /// Appends newly decoded tokens exactly (weight 1, log-scale 0) and updates the running
  /// vmin / vmax. O(t (d + dv)).
  /// \throws effattn::invalid_argument on mismatched shapes or non-finite entries.
  void append(const ConstRef<Scalar>& K, const ConstRef<Scalar>& V);
};

/// Result of `WildcatAttention::compute` and `weighted_attention`.
template <typename Scalar>
struct WildcatResult : AttentionResult<Scalar> {
  /// Key rows (sequence positions) of the coreset, bin by bin (all keys of exact bins).
  std::vector<Index> pivots;
  /// \brief Certified a-posteriori bound on max_{i,j} |O_ij - Ohat_ij| (exact arithmetic).
  ///
  /// Row i: Lemma 2 with temperature gives, per compressed bin b (centre c_b, radius R_b,
  /// temperature tau_b, residual trace tr_b of the tempered key kernel, read off RPCholesky),
  /// ||a_ib - ahat_ib||_2^2 <= e^{2 beta <q_i, c_b>} e^{beta tau_b^2 ||q_i||^2} tr_b
  /// (||.||_op <= trace), summed over bins; min_l a_il >= min_b e^{beta(<q_i,c_b> - ||q_i|| R_b)}.
  /// Then x_i = ||a_i - ahat_i||_2 / (sqrt(m) min_l a_il) >= ||a_i - ahat_i||_1 / (a_i 1), and
  /// Lemma 1 (row-wise) gives |O_ij - Ohat_ij| <= min( range x/(1-x) [x < 1], range,
  /// 3 ||V||_max x ), range = max_j (vmax_j - vmin_j). The first term is our sharpening of the
  /// paper's 3 x (same proof: o - ohat = e(V - 1 o^T) / ahat 1); the last two need clipping.
  /// It bounds the max-entry error of the whole output, not the Frobenius error, and is often
  /// loose (it can equal the trivial clip bound `range` at small rank).
  double error_bound = 0;
  Vector<double> row_error_bound;  ///< the bound per query row (its max is error_bound)
  Index rank = 0;                  ///< coreset rows used (pivots.size(); < rank after early stops)
  Index bins = 0;                  ///< bins used (including the remainder bin)
  Index fallback_rows = 0;         ///< rows whose denominator failed (see Options::fallback)
  std::vector<WildcatBlock> blocks;  ///< per-bin diagnostics (tau^2, residual trace, ...)
  /// With Options::target_error > 0: the estimated relative Frobenius error of the output, from
  /// the exact attention of the sampled query rows (-1 when no target was set).
  double estimated_error = -1;
  /// With Options::target_error > 0: the residual-trace tolerance (rel_tol) of the last round
  /// (0 when no target was set).
  double target_rel_tol = 0;
  /// With Options::target_error > 0: the number of compression rounds used (0 when no target
  /// was set).
  Index target_rounds = 0;
  /// The coreset attention ran with bf16 products (Options::bf16_attention with float).
  bool bf16 = false;

  /// rank, bins, exact_bins (bins kept exactly), fallback_rows, error_bound; with a target also
  /// estimated_error, target_rel_tol and target_rounds; bf16 (= 1) when the coreset attention
  /// used bf16 products.
  Diagnostics diagnostics() const {
    Index exact_bins = 0;
    for (const WildcatBlock& b : blocks) exact_bins += b.exact ? 1 : 0;
    Diagnostics d = {{"rank", static_cast<double>(rank)},
                     {"bins", static_cast<double>(bins)},
                     {"exact_bins", static_cast<double>(exact_bins)},
                     {"fallback_rows", static_cast<double>(fallback_rows)},
                     {"error_bound", error_bound}};
    if (target_rounds > 0) {
      d.push_back({"estimated_error", estimated_error});
      d.push_back({"target_rel_tol", target_rel_tol});
      d.push_back({"target_rounds", static_cast<double>(target_rounds)});
    }
    if (bf16) d.push_back({"bf16", 1.0});
    return d;
  }
};

/// \ingroup Methods
/// \brief WildCat attention (paper Alg. 4): recentre the keys, compress them bin by bin with
/// RPNys at the eq. (12) temperature, and run the clipped weighted attention.
///
/// Steps: R_Q = max_i ||q_i|| (or Options::q_radius); kbar = mean of all keys (global, before
/// binning; not added back since one global shift cancels in every softmax row); per bin b:
/// R_K = max ||k - kbar||, tau_b from eq. (12) with the bin's key count, RPCholesky (sampled
/// in Gaussian coordinates; kernel rows, factor updates and the Nystrom product in Scalar,
/// residuals, sampling and traces in double; early stop at round-off exhaustion of Scalar and at
/// Options::rel_tol) of h_tau on the bin's keys, Nystrom weights by
/// back-substitution, V_S = W V and w = W 1 in log-scaled form. Then
/// Ohat = clip(diag(Ahat w)^{-1} Ahat V_S) with Ahat = exp(beta Q K_S^T + log-scales), one
/// max-shifted exp per row and one GEMM against [V_S | w | |w|] per tile of 128 queries.
///
/// Exactness: a bin with no more keys than its pivot budget is kept exactly, so rank >= m (per
/// bin: ceil(rank/B) >= bin size) reproduces exact attention to round-off; duplicated keys stop
/// the factorisation at their number of distinct keys, which is then also exact.
///
/// Cost: O(m r^2 / B^2 + m r d / B) to select (bins in parallel; RPCholesky's own tiles in
/// parallel when B = 1), O(m r dv / B) for V_S, O(n r (d + dv)) to attend (query tiles in
/// parallel). Memory O(m d + r m / B) transient, nothing n x m. With one bin the results are
/// bit-identical for any thread count (fixed decomposition, per-bin random streams). With several
/// bins, the bins run in one parallel loop and the GEMMs of each bin run in nested (inactive)
/// regions, where Eigen's own threading picks its blocking from OMP_NUM_THREADS, so the last bits
/// can differ between thread counts (a fixed thread count always gives the same bits).
///
/// The KV-cache members (`compress_kv`, `weighted_attention`, `recompress_tail`, also available as
/// free functions taking options) use the functor's options.
///
/// \tparam Scalar_ float or double (I/O, the GEMMs of the selection and the n x r GEMMs; the
///         selection's bookkeeping is always double). Float selection gives the errors of double
///         selection within the seed spread (measured at n = 4096 / 16384, r = 256 / 1024).
/// \tparam PivotRule policy::AcceleratedRandomlyPivoted (default), policy::RandomlyPivoted or
///         policy::GreedyPivoted (deterministic, for ablations).
///
/// \par Gradients
/// No `backward`: the output depends on Q, K through discrete choices (the randomly pivoted
/// Cholesky pivots and the query-radius bins) and, between those, through a pseudo-inverse of a
/// pivot kernel block whose derivative is ill-conditioned exactly when the rank is large enough
/// to be accurate. Differentiate exact attention (`ExactAttention::backward`) instead, or hold
/// the coreset fixed and differentiate `weighted_attention` by hand.
///
/// \par Example
/// \code{.cpp}
/// effattn::WildcatAttentionf::Options o;
/// o.rank = 256;
/// o.bins = 16;                        // 16 pivots per bin of m / 16 keys
/// auto r = effattn::WildcatAttentionf(o).compute(Q, K, V);
/// // r.output (n x dv), r.pivots (coreset key rows), r.error_bound (certified max-entry bound)
/// \endcode
template <typename Scalar_, typename PivotRule = policy::AcceleratedRandomlyPivoted>
class WildcatAttention : public AttentionFunctor<WildcatAttention<Scalar_, PivotRule>, Scalar_> {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same_v<PivotRule, policy::AcceleratedRandomlyPivoted> ||
                    std::is_same_v<PivotRule, policy::RandomlyPivoted> ||
                    std::is_same_v<PivotRule, policy::GreedyPivoted>,
                "effattn: WildcatAttention PivotRule must be policy::AcceleratedRandomlyPivoted, "
                "policy::RandomlyPivoted or policy::GreedyPivoted");

 public:
  using Scalar = Scalar_;             ///< the scalar type (float or double)
  using Options = WildcatOptions;     ///< the options struct
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;       ///< the input type, `ConstRef<Scalar>`
  /// Result of `compute`.
  using Result = WildcatResult<Scalar>;  ///< the result of `compute`

  static constexpr const char* name = "WildcatAttention";  ///< the method's name
  static constexpr bool supports_causal = false;           ///< no causal form (a paper limitation)
  static constexpr bool randomized = true;                 ///< the pivots depend on Options::seed
  static constexpr bool self_attention_only = false;       ///< any n and m
  static constexpr bool exact = false;  ///< a rank-r approximation (exact only when rank >= m)

  /// \throws effattn::invalid_argument on rank < 1, bins < 1, rel_tol outside [0, 1), a negative
  ///         or non-finite scale / q_radius / denominator_tol / target_error, proposal_block < 0,
  ///         error_sample_rows < 1, an invalid fallback enumerator, or a deprecated spelling that
  ///         disagrees with its new name.
  explicit WildcatAttention(Options opts = {});

  /// WildCat attention of Q (n x d) over K (m x d), V (m x dv). Numerical breakdown of the
  /// compression gives info = NumericalIssue and an n x dv output of NaN.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// CompressKV with this functor's options (see the free `compress_kv`).
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs or q_radius < 0.
  [[nodiscard]] CompressedKV<Scalar> compress_kv(const Ref& K, const Ref& V, double q_radius) const;
  /// WtdAttn of Q over `ckv` with this functor's options (see the free `weighted_attention`).
  /// \throws effattn::invalid_argument on an empty cache, or Q empty, non-finite or with a column
  ///         count different from the cache's d.
  [[nodiscard]] Result weighted_attention(const Ref& Q, const CompressedKV<Scalar>& ckv) const;
  /// Re-compresses the exact tail of `ckv` with this functor's options (see the free
  /// `recompress_tail`). \returns false (cache unchanged) on numerical breakdown.
  /// \throws effattn::invalid_argument on q_radius < 0.
  bool recompress_tail(CompressedKV<Scalar>& ckv, double q_radius) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

/// WildCat, float.
using WildcatAttentionf = WildcatAttention<float>;
/// WildCat, double.
using WildcatAttentiond = WildcatAttention<double>;

/// \brief CompressKV (paper Alg. 2): compress a KV cache once, attend to it many times with
/// `weighted_attention`.
///
/// \param K keys m x d, \param V values m x dv (original units; K's mean is removed for the
///        selection and added back to the stored coreset keys).
/// \param q_radius R_Q, a bound on the norms of the queries that will attend (eq. 12). 0 uses
///        each bin's R_K (the official code's default for caches). Queries with larger norms
///        are still handled, but the temperature was tuned for R_Q.
/// \param opts scale (must match the later `weighted_attention`), rank, bins, seed, rel_tol,
///        temperature, proposal_block. Cost O(m r^2 / B + m r (d + dv) / B) time.
/// \tparam PivotRule the RPCholesky rule (accelerated by default; same pivot distribution as the
///         sequential rule, GEMM-shaped).
/// \throws effattn::invalid_argument on bad options (rank < 1, ...), empty, mismatched or
///         non-finite inputs, or q_radius < 0. Numerical breakdown yields an empty cache
///         (size() == 0), which weighted_attention rejects.
template <typename PivotRule = policy::AcceleratedRandomlyPivoted, typename DK, typename DV>
[[nodiscard]] CompressedKV<typename DK::Scalar> compress_kv(const Eigen::MatrixBase<DK>& K,
                                                            const Eigen::MatrixBase<DV>& V,
                                                            double q_radius,
                                                            const WildcatOptions& opts = {});

/// \brief Re-compresses the exact tail of a cache (tokens added by `append`) into a new block
/// of coreset rows (recentred at the tail's mean, binned with opts.bins, budget opts.rank), so
/// that the cache stays O(r (d + dv)) during long decodes. Earlier blocks are untouched.
/// \returns false (cache unchanged) if the compression broke down numerically.
/// \throws effattn::invalid_argument on bad options or q_radius < 0.
template <typename PivotRule = policy::AcceleratedRandomlyPivoted, typename Scalar>
bool recompress_tail(CompressedKV<Scalar>& ckv, double q_radius, const WildcatOptions& opts = {});

/// \brief WtdAttn (paper Alg. 3): attention of Q (n x d) over a compressed cache, clipped to the
/// cache's running value range. O(n r (d + dv)) time, O(128 r) extra memory per thread.
/// Uses opts.scale (same as at compression), clip, fallback, denominator_tol.
/// \throws effattn::invalid_argument on bad options, an empty cache, or Q empty, non-finite or
///         with a column count different from the cache's d.
template <typename DQ>
[[nodiscard]] WildcatResult<typename DQ::Scalar> weighted_attention(
    const Eigen::MatrixBase<DQ>& Q, const CompressedKV<typename DQ::Scalar>& ckv,
    const WildcatOptions& opts = {});

}  // namespace effattn

#include "detail/methods/wildcat_impl.hpp"

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(WildcatAttention<float>)
EFFATTN_EXTERN_INSTANCE(WildcatAttention<double>)
}  // namespace effattn
#endif
