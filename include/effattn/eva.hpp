/// \file eva.hpp
/// \brief EVA: efficient attention via control variates (Zheng, Yuan, Wang and Kong, "Efficient
/// attention via control variates", ICLR 2023), and the RFA / Performer baseline it generalises
/// (`PerformerAttention`, computed by the same kernel).
///
/// The member functions that do the work are defined in `detail/methods/eva_impl.hpp`, included at
/// the end of this header; with `EFFATTN_COMPILED` the float and double instantiations come from
/// the `effattn::compiled` library instead of being compiled in every translation unit.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "core/deprecated.hpp"
#include "core/errors.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"
#include "gradients.hpp"

namespace effattn {

/// Runtime options of `EvaAttention` that are not compile-time policies.
namespace eva {

/// How the mass sum_{m in P_c} exp(q~ . k~_m) of a chunk is approximated in the joint softmax:
/// the chunk logit is q~ . k^_c + u_c(q).
enum class Mass {
  /// u = 0: the paper's exp(q^T k^_c). With mean pooling it underestimates every chunk by a
  /// factor of at least |P_c| (Jensen); meant for learned summary maps, which absorb the count.
  Literal,
  /// u = log |P_c| (default): the Jensen lower bound |P_c| exp(q~ . kbar_c) of the mass, exact
  /// when the keys of a chunk are identical.
  LogCount,
  /// u = log |P_c| + sum_i q~_i^2 var_{c,i} / 2 (var: per-coordinate variance of the chunk's
  /// scaled keys): exact for Gaussian chunk keys. Experimental; one extra GEMM per block.
  GaussianDiag
};

/// Mean mu_c of the chunk proposal N(mu_c, I) (paper App. C and Table 8).
enum class Proposal {
  SumMeans,   ///< mu = q^_c + k^_c (paper, causal official code; default)
  HalfSum,    ///< mu = (q^_c + k^_c) / 2 (non-causal official code)
  QueryMean,  ///< mu = q^_c
  Zero        ///< mu = 0 (the RFA proposal)
};

/// How the keys outside the exact local block are chunked.
enum class Partition {
  /// Default: [m] \ E_n is split into disjoint chunks (the paper's maths). The exactness limits
  /// (window >= m, or chunk_size = 1) hold only in this mode.
  Disjoint,
  /// The official code's simplification: chunks cover all of [m] and may overlap E_n, whose keys
  /// are then counted twice. Causal: a query sees the chunks before its own chunk.
  Overlapping
};

/// A learned chunk-summary map sigma(x) = LN(W x + b) (paper App. C: a d x d Linear, optionally
/// followed by LayerNorm), applied to the mean of a chunk's keys (or queries) in the *input*
/// coordinates, before the logit scale: k^_c = sqrt(s) sigma(mean_{P_c} k). Empty = identity.
struct SummaryMap {
  Eigen::MatrixXd weight;    ///< d x d, or empty for the identity
  Eigen::VectorXd bias;      ///< d, or empty for 0
  bool layer_norm = false;   ///< apply LayerNorm after the affine map
  Eigen::VectorXd ln_gamma;  ///< d LayerNorm gains, or empty for 1
  Eigen::VectorXd ln_beta;   ///< d LayerNorm offsets, or empty for 0
  double ln_eps = 1e-5;      ///< LayerNorm epsilon (> 0)
};

/// Gradients of a loss with respect to the parameters of one `SummaryMap` (see
/// `EvaAttention::backward`), in double like the map. A field is empty when the map does not
/// have that parameter: `weight` and `bias` when they are empty (identity, zero), `ln_gamma` and
/// `ln_beta` when they are empty or `layer_norm` is off.
struct SummaryMapGradients {
  Eigen::MatrixXd weight;    ///< d x d, dL/dW
  Eigen::VectorXd bias;      ///< d, dL/db
  Eigen::VectorXd ln_gamma;  ///< d, dL/dgamma
  Eigen::VectorXd ln_beta;   ///< d, dL/dbeta
};

}  // namespace eva

/// Gradients returned by `EvaAttention::backward`: dQ, dK, dV (`AttentionGradients`; dbias is
/// empty) and the gradients of the learned summary maps.
template <typename Scalar>
struct EvaGradients : AttentionGradients<Scalar> {
  eva::SummaryMapGradients key_map;    ///< of `EvaOptions::key_map`
  eva::SummaryMapGradients query_map;  ///< of `EvaOptions::query_map`
};

namespace policy {
/// \ingroup Policies
/// EVA proper: exact local block, chunk control variates, joint softmax (eq. 16). The only
/// policy of `EvaAttention` (the RFA / Performer baseline is `PerformerAttention`).
struct ControlVariates {};
}  // namespace policy

/// Options of `EvaAttention`.
struct EvaOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal self-attention, bottom-right aligned as in ExactAttention: query i (at key position
  /// i + m - n) uses only keys j <= i + m - n and only queries i' <= i (queries enter the chunk
  /// means). Needs m >= n and window >= 1.
  bool causal = false;
  /// Exact local block size K: keys are cut into blocks [bK, (b+1)K) and a query attends exactly
  /// to its own block (causal: to the part up to itself). 0 = no exact keys (non-causal only).
  Index window = 64;
  /// Chunk size L for the remaining keys; 0 = automatic: about 64 chunks (ceil(m / 64), rounded
  /// up to a divisor or multiple of `window`), so the cost stays linear in n. With
  /// Partition::Disjoint, L must divide `window` or be a multiple of it.
  Index chunk_size = 0;
  /// Samples per chunk S. 0 (default) = deterministic proposal mean w_c = mu_c (the official
  /// inference mode). S >= 1 draws w_{c,s} ~ N(mu_c, I); S >= 2 uses query-dependent weights.
  Index samples = 0;
  /// Seed of the samples (ignored when samples = 0).
  std::uint64_t seed = 0x5eedULL;
  /// Chunk mass approximation.
  eva::Mass mass = eva::Mass::LogCount;
  /// Proposal mean.
  eva::Proposal proposal = eva::Proposal::SumMeans;
  /// Chunking of the keys outside the local block.
  eva::Partition partition = eva::Partition::Disjoint;
  /// Optional learned map giving the chunk key representatives k^_c.
  eva::SummaryMap key_map;
  /// Optional learned map giving the chunk query summaries q^_c used by the proposal.
  eva::SummaryMap query_map;
};

/// Result of `EvaAttention::compute`. The chunk statistics are those of the global chunking
/// (level 0: chunk c holds keys [c L, min((c+1) L, m))), in scaled coordinates
/// q~ = sqrt(s) q, k~ = sqrt(s) k. Rows c S + s refer to sample s of chunk c.
template <typename Scalar>
struct EvaResult : AttentionResult<Scalar> {
  Index window = 0;               ///< exact local block size used (0 = none)
  Index chunk_size = 0;           ///< chunk size L used
  Index num_chunks = 0;           ///< C = ceil(m / L)
  Index samples = 0;              ///< samples per chunk S (1 in deterministic mode)
  Index max_logits = 0;           ///< most logits of any query: |E_n| + S x (visible chunks)
  Matrix<Scalar> chunk_keys;      ///< C x d representatives k^_c
  Vector<Scalar> chunk_bias;      ///< C constant chunk-logit terms u_c (log |P_c| or 0)
  Matrix<Scalar> proposal_means;  ///< C x d proposal means mu_c
  Matrix<Scalar> omega;           ///< C S x d samples w_{c,s} (= mu_c in deterministic mode)
  /// C S values a_{c,s} = log sum_{m in P_c} xi(k~_m, w_{c,s}), xi(x, w) = exp(w.x - |x|^2/2).
  Vector<Scalar> chunk_lse;
  /// C S x dv values b_{c,s} = sum_{m in P_c} softmax_m(w_{c,s}.k~_m - |k~_m|^2/2) v_m; with S = 1
  /// these are the control-variate coefficients beta_c.
  Matrix<Scalar> chunk_values;

  /// window, chunk_size, num_chunks, samples, max_logits (in this order).
  Diagnostics diagnostics() const {
    return {{"window", static_cast<double>(window)},
            {"chunk_size", static_cast<double>(chunk_size)},
            {"num_chunks", static_cast<double>(num_chunks)},
            {"samples", static_cast<double>(samples)},
            {"max_logits", static_cast<double>(max_logits)}};
  }
};

/// \ingroup Methods
/// \brief EVA attention: exact softmax over a local block plus control-variate estimates of
/// the remaining keys, chunk by chunk, in one joint softmax (Zheng et al., ICLR 2023, eq. 16).
///
/// With pre-scaled q~ = sqrt(s) q, k~ = sqrt(s) k, the output row of query n is
/// \f[ O_n = \frac{\sum_{m \in E_n} e^{\tilde q_n^\top \tilde k_m} v_m
///        + \sum_{c} e^{\tilde q_n^\top \hat k_c + u_c}\, \beta_{n,c}}
///       {\sum_{m \in E_n} e^{\tilde q_n^\top \tilde k_m} + \sum_c e^{\tilde q_n^\top \hat k_c +
///       u_c}}, \qquad
///    \beta_{n,c} = \sum_s \pi_{n,c,s}\, b_{c,s},\quad
///    b_{c,s} = \sum_{m\in P_c} \mathrm{softmax}_m\!\big(w_{c,s}^\top \tilde k_m -
///       \tfrac12\|\tilde k_m\|^2\big) v_m, \f]
/// \f[ \pi_{n,c,s} = \mathrm{softmax}_s\big(w_{c,s}^\top(\tilde q_n - \mu_c) + a_{c,s}\big),\quad
///     a_{c,s} = \log \sum_{m \in P_c} e^{w_{c,s}^\top \tilde k_m - \|\tilde k_m\|^2/2}, \f]
/// the self-normalised importance-sampling estimate of the softmax-within-chunk mean beta_c*
/// (Prop. 2) with proposal N(mu_c, I): pi weighs the samples by the ratio of the target
/// softmax-within-chunk density to the proposal; with S = 1, pi = 1 and beta is query-free.
/// - E_n: the query's block [bK, (b+1)K) of `window` keys (causal: up to the query itself).
/// - P_c: disjoint chunks of `chunk_size` keys covering the rest. When chunk_size divides
///   window, the chunks inside E_n are skipped. When it is a multiple of window, the chunk holding
///   E_n is replaced, for that block's queries, by its other blocks as block-sized chunks, so
///   the partition stays disjoint (the paper only treats the first case; the second keeps the
///   exactness limits in the fixed-chunk-count regime). Causal: only the chunks (and, in the
///   second case, the blocks of the query's own chunk) that end at or before the start of the
///   query's block; together with E_n they cover the keys [0, p_n] exactly once, and every
///   statistic they use comes from keys and queries at positions before the block start (two
///   static masks: one on the local block, one on the chunks).
///   Partition::Overlapping instead uses every chunk (causal: those before the query's chunk).
/// - k^_c = sqrt(s) sigma_k(mean_{P_c} k), u_c from `mass`, mu_c from `proposal` with
///   q^_c = sqrt(s) sigma_q(mean of the queries at the positions of P_c; for non-causal n != m, of
///   all queries; 0 if none), sigma = identity unless `key_map` / `query_map` are given.
/// - w_{c,s} = mu_c + eps_{c,s}: eps_{c,1..S} are the columns of a d x S matrix filled by
///   `fill_normal` from `make_rng(seed, 2c)` (chunk c) or `make_rng(seed, 2b + 1)` (the
///   block-sized chunk of block b). Deterministic mode (samples = 0, the default): w_c = mu_c and
///   the seed is not used; samples >= 1 draw from the seed (`randomized` is true).
///
/// Exactness limits (tested): window >= m, or chunk_size = 1 (any proposal, mass and samples),
/// give softmax attention up to round-off, causal and not. With window = 0, one chunk of all m
/// keys, proposal Zero and mass Literal it is RFA / Performer (`PerformerAttention`).
///
/// Query i sits at key position p_i = clamp(i + m - n, 0, m - 1) (bottom-right aligned, the
/// convention of ExactAttention's causal mask); its block is floor(p_i / K). For unrelated
/// cross-attention use window = 0 (no exact keys).
///
/// Cost: O(m S (d + dv)) for the chunk statistics plus O(n (K + C + L/K)(d + dv)) for the
/// queries, and O(n C S (d + dv)) more when S >= 2: linear in n at fixed window and chunk
/// count. Memory: O(m d) for the scaled keys, O((C + m / K) S (d + dv)) chunk statistics,
/// O(min(K, 128) (K + C + S)) per thread; nothing n x m. Every exponential goes through a
/// max-subtracted softmax or log-sum-exp, with the sums in double. Query blocks and chunks run in
/// parallel (OpenMP); the decomposition and the random streams depend only on shapes and options,
/// so results are bit-identical for any thread count.
///
/// \tparam Scalar_ float or double.
/// \tparam Policy `policy::ControlVariates` (the only policy; kept as a parameter so that the
///         policy spelling of the library stays uniform).
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/eva.hpp>
/// Eigen::MatrixXf Q = Eigen::MatrixXf::Random(4096, 64), K = Eigen::MatrixXf::Random(4096, 64),
///                 V = Eigen::MatrixXf::Random(4096, 64);
/// effattn::EvaAttentionf::Options o;
/// o.window = 64;      // exact local blocks of 64 keys
/// o.chunk_size = 64;  // 64-key chunks elsewhere (0 = about 64 chunks in total)
/// o.causal = true;
/// auto r = effattn::EvaAttentionf(o).compute(Q, K, V);   // r.output: 4096 x 64
/// \endcode
///
/// \par Gradients
/// `backward` gives the exact derivative of `compute`'s output with respect to Q, K, V and the
/// summary-map parameters, for every option (the random draws eps held fixed), computed in
/// double at a few times the forward's cost (see `backward`).
///
/// \par Threading
/// `compute` is const and keeps no state: one functor may be shared by any number of threads.
template <typename Scalar_, typename Policy = policy::ControlVariates>
class EvaAttention : public AttentionFunctor<EvaAttention<Scalar_, Policy>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(EvaAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same_v<Policy, policy::ControlVariates>,
                "effattn: EvaAttention's policy must be policy::ControlVariates (the RFA / "
                "Performer baseline is PerformerAttention)");

 public:
  using Scalar = Scalar_;             ///< the scalar type (float or double)
  using Options = EvaOptions;         ///< the options struct
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;       ///< the input type, `ConstRef<Scalar>`
  /// Result of `compute`.
  using Result = EvaResult<Scalar>;  ///< the result of `compute`

  /// Method name used in messages.
  static constexpr const char* name = "EvaAttention";
  /// `Options::causal` is honoured.
  static constexpr bool supports_causal = true;
  /// samples >= 1 draw from `Options::seed` (samples = 0, the default, is deterministic).
  static constexpr bool randomized = true;
  /// Cross-attention (n != m) is supported.
  static constexpr bool self_attention_only = false;
  /// An approximation at default options.
  static constexpr bool exact = false;

  /// \throws effattn::invalid_argument on a negative or non-finite scale, negative window,
  ///         chunk_size or samples, a chunk size that neither divides nor is a multiple of the
  ///         window (Disjoint), causal without a window, an invalid enumerator, or a malformed
  ///         summary map.
  explicit EvaAttention(Options opts = {});

  /// EVA attention of Q (n x d) over K (m x d), V (m x dv); see the class documentation.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, causal with
  ///         m < n, or a summary map whose size is not d.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// Result of `backward`.
  using Gradients = EvaGradients<Scalar>;

  /// Gradients of a loss L through `compute(Q, K, V)`: given `result` (that call's result) and
  /// dO = dL/dO (n x dv), returns dQ (n x d), dK (m x d), dV (m x dv) and the gradients of the
  /// `key_map` and `query_map` parameters (`EvaGradients`), the exact derivative of the forward
  /// for every option. With samples >= 1 the draws eps_{c,s} (regenerated from the seed, checked
  /// against `result.omega`) are held fixed and w_{c,s} = mu_c + eps_{c,s} moves with mu_c (the
  /// reparameterisation gradient of one draw); with samples = 0, w_c = mu_c.
  ///
  /// The chain rule follows the forward backwards. Per query n, with the joint softmax A_n over
  /// the logits l_nj (local keys: q~_n . k~_j; chunks: q~_n . k^_c + u_c(q~_n)), value rows x_j
  /// (v_j, or beta_{n,c}), Y_nj = dO_n . x_j and D_n = dO_n . O_n = sum_j A_nj Y_nj:
  /// \f[ \partial l_{nj} = A_{nj}(Y_{nj} - D_n),\quad dv_j \mathrel{+}= A_{nj}\,dO_n,\quad
  ///     d\tilde q_n \mathrel{+}= \partial l_{nj}\,\partial_{\tilde q} l_{nj},\quad
  ///     d\tilde k_j \mathrel{+}= \partial l_{nj}\,\tilde q_n,\quad
  ///     d\hat k_c \mathrel{+}= \partial l_{nc}\,\tilde q_n, \f]
  /// (GaussianDiag: d(var_c/2) += dl q~ o q~, dq~ += 2 dl q~ o var_c/2). For S >= 2,
  /// db_{c,s} += A_nc pi_{n,c,s} dO_n and dT_{n,c,s} = A_nc pi_{n,c,s}(dO_n . b_{c,s} - Y_nc)
  /// with T = w.(q~ - mu) + a: dq~ += dT w, dw += dT (q~ - mu), da += dT, dmu -= dT w (S = 1:
  /// db_c += A_nc dO_n). Per chunk, with r_{s,m} = w_s . k~_m - |k~_m|^2/2 and P = softmax_m(r):
  /// \f[ \partial r_{s,m} = P_{s,m}\big(db_s\cdot(v_m - b_s) + da_s\big),\quad
  ///     dv_m \mathrel{+}= \textstyle\sum_s P_{s,m}\,db_s,\quad
  ///     dw_s \mathrel{+}= \sum_m \partial r_{s,m}\,\tilde k_m,\quad
  ///     d\tilde k_m \mathrel{+}= \sum_s \partial r_{s,m}(w_s - \tilde k_m), \f]
  /// then dmu += sum_s dw_s, the proposal's share of dmu goes to k^_c and q^_c, each through its
  /// map (Linear, LayerNorm) to the chunk mean and the map parameters, and the means spread
  /// their gradient evenly over the chunk's keys and queries (GaussianDiag:
  /// dk_j += (s / |P_c|) d(var_c/2) o (k_j - kbar_c)). dQ = sqrt(s) dq~ + (query means),
  /// dK = sqrt(s) dk~ + (key means).
  ///
  /// Cost: recomputes the forward's chunk statistics (by its own code), then
  /// O(n (K + C S)(d + dv)) for the queries and O(m S (d + dv) + C d^2) for the chunks, like
  /// `compute`; memory O(m d) for the scaled keys, O(G C S (d + dv)) for the chunk-side
  /// accumulators of G <= 16 fixed groups of query blocks and per-thread tiles, nothing n x m.
  /// Past the chunk statistics (the forward's, in Scalar), every product, softmax and sum runs in
  /// double (each gradient entry then adds at most three such contributions in Scalar); the work
  /// split depends only on shapes and options, and the groups are summed in a fixed order, so
  /// the gradients are bit-identical for any thread count.
  /// `MultiHead<F>::backward` uses it for dQ, dK, dV (it does not collect the summary-map
  /// gradients).
  /// \throws effattn::invalid_argument on invalid Q, K, V or options (as `compute`), if `result`
  ///         is not a successful result of these inputs and options (output n x dv, window,
  ///         chunk_size, chunk and sample counts, omega C S x d, and omega and chunk_keys equal to
  ///         those these inputs give), or if dO is not n x dv or not finite.
  [[nodiscard]] Gradients backward(const Ref& Q, const Ref& K, const Ref& V, const Result& result,
                                   const Ref& dO) const;

  /// The most logits any query evaluates, |E_n| + S x (visible chunks), for n queries over m
  /// keys, without computing anything: the feature budget of the configuration
  /// (`Result::max_logits` of a compute on such shapes). O(n / min(K, 128)) time.
  /// \throws effattn::invalid_argument unless n, m >= 1 (and m >= n if causal).
  [[nodiscard]] Index max_logits(Index n, Index m) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

EFFATTN_DEPRECATED_FIELDS_BEGIN  // the renamed field's old spelling (core/deprecated.hpp)

/// Options of `PerformerAttention`. There is no `causal`: the Performer has no causal form here
/// (it would need a prefix recurrence), which `functor_traits::supports_causal` states.
struct PerformerOptions {
  /// Logit scale: the kernel approximates exp(scale * <q_i, k_j>). 0 means 1/sqrt(d).
  double scale = 0;
  /// Number of random features S; 0 (default) = 64. (`Result::features` reports the count used;
  /// EVA's `samples` are per-chunk samples, another quantity.)
  Index features = 0;
  /// Seed of the random features.
  std::uint64_t seed = 0x5eedULL;

  /// Deprecated spelling of `features` (honoured when not 0; removed in the next release).
  [[deprecated("use features")]] Index samples = 0;
};

namespace detail {
/// `o` with the deprecated spelling folded into the new field (core/deprecated.hpp).
/// \throws effattn::invalid_argument when the old and the new spelling disagree.
inline PerformerOptions resolve_renamed(PerformerOptions o, const char* who) {
  merge_renamed(o.features, o.samples, Index(0), who, "features", "samples");
  return o;
}
}  // namespace detail

EFFATTN_DEPRECATED_FIELDS_END

/// Result of `PerformerAttention::compute`.
template <typename Scalar>
struct PerformerResult : AttentionResult<Scalar> {
  Index features = 0;    ///< number of random features S used
  Matrix<Scalar> omega;  ///< S x d random projection w_1..w_S (applied to x~ = sqrt(s) x)

  /// features.
  Diagnostics diagnostics() const { return {{"features", static_cast<double>(features)}}; }
};

/// \ingroup Methods
/// \brief RFA / Performer attention with positive random features (Choromanski et al.,
/// "Rethinking attention with Performers", ICLR 2021; Peng et al., "Random feature attention",
/// ICLR 2021), the baseline EVA generalises.
///
/// With x~ = sqrt(s) x and S features w_1..w_S ~ N(0, I_d),
/// \f[ \phi(x) = S^{-1/2}\big[e^{w_s^\top \tilde x - \|\tilde x\|^2/2}\big]_{s=1..S},\qquad
///     O_n = \frac{\sum_m \phi(q_n)^\top \phi(k_m)\, v_m}{\sum_m \phi(q_n)^\top \phi(k_m)}, \f]
/// an unbiased estimate of exp(s q.k) in each kernel entry. It is computed in the log domain
/// through the EVA kernel (no local block, one chunk holding every key, proposal mean 0, mass
/// Literal): O_n = sum_s pi_{n,s} b_s with pi_n = softmax_s(w_s.q~_n + a_s),
/// a_s = log sum_m exp(w_s.k~_m - |k~_m|^2/2) and b_s = the matching softmax mean of V, so no
/// feature map overflows. The features are the columns of a d x S matrix filled by `fill_normal`
/// from `make_rng(seed, 0)` (`Result::omega` holds them as rows).
///
/// Cost: O((n + m) S (d + dv)) time; memory O(m d) for the scaled keys and O(S (d + dv)) for the
/// feature statistics, plus per-thread tiles of at most 128 query rows; nothing n x m. Queries and
/// features run in parallel (OpenMP), bit-identical for any thread count.
///
/// \tparam Scalar_ float or double.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/eva.hpp>
/// effattn::PerformerAttentionf::Options p;
/// p.features = 256;  // 256 positive random features
/// Eigen::MatrixXf rfa = effattn::PerformerAttentionf(p)(Q, K, V);
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state: one functor may be shared by any number of threads.
template <typename Scalar_>
class PerformerAttention : public AttentionFunctor<PerformerAttention<Scalar_>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(PerformerAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");

 public:
  using Scalar = Scalar_;             ///< the scalar type (float or double)
  using Options = PerformerOptions;   ///< the options struct
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;       ///< the input type, `ConstRef<Scalar>`
  /// Result of `compute`.
  using Result = PerformerResult<Scalar>;  ///< the result of `compute`

  /// Method name used in messages.
  static constexpr const char* name = "PerformerAttention";
  /// No causal form (no `Options::causal`).
  static constexpr bool supports_causal = false;
  /// The features are drawn from `Options::seed`.
  static constexpr bool randomized = true;
  /// Cross-attention (n != m) is supported.
  static constexpr bool self_attention_only = false;
  /// A Monte-Carlo approximation.
  static constexpr bool exact = false;

  /// \throws effattn::invalid_argument on a negative or non-finite scale, negative features, or
  ///         a deprecated `samples` that disagrees with `features`.
  explicit PerformerAttention(Options opts = {});

  /// Performer attention of Q (n x d) over K (m x d), V (m x dv); see the class documentation.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// Result of `backward`.
  using Gradients = AttentionGradients<Scalar>;

  /// Gradients of a loss L through `compute(Q, K, V)` with the random features held fixed (those
  /// of `result.omega`, i.e. the same seed): given dO = dL/dO (n x dv), returns dQ (n x d),
  /// dK (m x d) and dV (m x dv), the exact derivative of the Performer output. In the log domain
  /// of `compute`, with l_{s,m} = w_s.k~_m - |k~_m|^2/2, beta_s = softmax_m(l_s),
  /// a_s = logsumexp_m(l_s), B = beta V (S x dv), g_{n,s} = w_s.q~_n + a_s, pi = softmax_s(g)
  /// and O = pi B, the chain rule is two softmax backwards:
  /// dB = pi^T dO, dg = pi o (dO B^T - rowsum(dO o O)), dQ = sqrt(s) dg W,
  /// dV = beta^T dB, dl = beta o (dB V^T - rowsum(dB o B) + 1^T dg), and
  /// dk~_m = sum_s dl_{s,m} (w_s - k~_m), dK = sqrt(s) dk~. Products of n x S and S x m feature
  /// matrices in double: O((n + m) S (d + dv)) time and O((n + m) S) memory, nothing n x m. The
  /// features are random, so this is the gradient of one draw (of the estimator), not of exact
  /// softmax attention.
  /// \throws effattn::invalid_argument on invalid Q, K, V (as `compute`), if `result` is not a
  ///         successful result of these shapes (output n x dv, omega S x d), or if dO is not
  ///         n x dv or not finite.
  [[nodiscard]] Gradients backward(const Ref& Q, const Ref& K, const Ref& V, const Result& result,
                                   const Ref& dO) const;

  /// The number of random features used (`Options::features`, or 64 when it is 0).
  [[nodiscard]] Index features() const noexcept {
    return m_opts.features > 0 ? m_opts.features : Index(64);
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

/// EVA, float.
using EvaAttentionf = EvaAttention<float>;
/// EVA, double.
using EvaAttentiond = EvaAttention<double>;
/// Performer, float.
using PerformerAttentionf = PerformerAttention<float>;
/// Performer, double.
using PerformerAttentiond = PerformerAttention<double>;

}  // namespace effattn

#if EFFATTN_DETAIL_WITH_IMPL
#include "detail/methods/eva_backward_impl.hpp"
#include "detail/methods/eva_impl.hpp"
#endif

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(EvaAttention<float>)
EFFATTN_EXTERN_INSTANCE(EvaAttention<double>)
EFFATTN_EXTERN_INSTANCE(PerformerAttention<float>)
EFFATTN_EXTERN_INSTANCE(PerformerAttention<double>)
}  // namespace effattn
#endif
