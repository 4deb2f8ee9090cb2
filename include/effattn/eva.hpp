/// \file eva.hpp
/// \brief EVA: efficient attention via control variates (Zheng, Yuan, Wang and Kong, "Efficient
/// attention via control variates", ICLR 2023), and the RFA / Performer baseline it generalises.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/random.hpp"
#include "core/types.hpp"
#include "core/online_softmax.hpp"

namespace effattn {

/// Runtime policies of `EvaAttention` (spec section 3).
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

}  // namespace eva

namespace policy {
/// \ingroup Policies
/// EVA proper: exact local block, chunk control variates, joint softmax (eq. 16).
struct ControlVariates {};
/// \ingroup Policies
/// Plain RFA / Performer (positive random features, Choromanski et al. 2021) through the same
/// kernel: E = {}, one chunk holding every key, mu = 0, `samples` features (0 = 64).
struct RandomFeatures {};
}  // namespace policy

/// Options of `EvaAttention`.
struct EvaOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal self-attention, bottom-right aligned as in ExactAttention: query i (at key position
  /// i + m - n) uses only keys j <= i + m - n and only queries i' <= i (queries enter the chunk
  /// means). Needs m >= n and window >= 1. Not available with policy::RandomFeatures.
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
  /// With policy::RandomFeatures this is the feature count (0 = 64).
  Index samples = 0;
  /// Seed of the samples (ignored when samples = 0).
  std::uint64_t seed = 0x5eedULL;
  /// Chunk mass approximation (RandomFeatures: not used).
  eva::Mass mass = eva::Mass::LogCount;
  /// Proposal mean (RandomFeatures: always Zero).
  eva::Proposal proposal = eva::Proposal::SumMeans;
  /// Chunking of the keys outside the local block (RandomFeatures: not used).
  eva::Partition partition = eva::Partition::Disjoint;
  /// Optional learned map giving the chunk key representatives k^_c (RandomFeatures: not used).
  eva::SummaryMap key_map;
  /// Optional learned map giving the chunk query summaries q^_c used by the proposal.
  eva::SummaryMap query_map;
};

}  // namespace effattn

#define EFFATTN_EVA_INTERNAL
#include "detail/eva_impl.hpp"
#undef EFFATTN_EVA_INTERNAL

namespace effattn {

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
/// (Prop. 2) with proposal N(mu_c, I) (spec 2.2; with S = 1, pi = 1 and beta is query-free).
/// - E_n: the query's block [bK, (b+1)K) of `window` keys (causal: up to the query itself).
/// - P_c: disjoint chunks of `chunk_size` keys covering the rest. When chunk_size divides
///   window, the chunks inside E_n are skipped. When it is a multiple of window, the chunk holding
///   E_n is replaced, for that block's queries, by its other blocks as block-sized chunks, so
///   the partition stays disjoint (the spec only allows the first case; ours keeps the exactness
///   limits in the fixed-chunk-count regime). Causal: only the chunks (and, in the second case,
///   the blocks of the query's own chunk) that end at or before the start of the query's block;
///   together with E_n they cover the keys [0, p_n] exactly once, and every statistic they use
///   comes from keys and queries at positions < the block start (spec 2.5, two static masks).
///   Partition::Overlapping instead uses every chunk (causal: those before the query's chunk).
/// - k^_c = sqrt(s) sigma_k(mean_{P_c} k), u_c from `mass`, mu_c from `proposal` with
///   q^_c = sqrt(s) sigma_q(mean of the queries at the positions of P_c; for non-causal n != m, of
///   all queries; 0 if none), sigma = identity unless `key_map` / `query_map` are given.
/// - w_{c,s} = mu_c + eps_{c,s}: eps_{c,1..S} are the columns of a d x S matrix filled by
///   `fill_normal` from `make_rng(seed, 2c)` (chunk c) or `make_rng(seed, 2b + 1)` (the
///   block-sized chunk of block b). Deterministic mode (samples = 0): w_c = mu_c.
///
/// Exactness limits (tested): window >= m, or chunk_size = 1 (any proposal, mass and samples),
/// give softmax attention up to round-off, causal and not. policy::RandomFeatures gives
/// RFA / Performer with phi(x) = S^{-1/2}[exp(w_s.x - |x|^2/2)]_s, computed in the log domain.
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
/// \tparam Policy `policy::ControlVariates` (EVA, default) or `policy::RandomFeatures` (RFA).
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
/// effattn::PerformerAttentionf::Options p;
/// p.samples = 256;                                        // 256 positive random features
/// Eigen::MatrixXf rfa = effattn::PerformerAttentionf(p)(Q, K, V);
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state: one functor may be shared by any number of threads.
template <typename Scalar_, typename Policy = policy::ControlVariates>
class EvaAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same<Policy, policy::ControlVariates>::value ||
                    std::is_same<Policy, policy::RandomFeatures>::value,
                "effattn: EvaAttention policy must be policy::ControlVariates or "
                "policy::RandomFeatures");
  static constexpr bool kRfa = std::is_same<Policy, policy::RandomFeatures>::value;
  static constexpr const char* kName = kRfa ? "PerformerAttention" : "EvaAttention";

 public:
  using Scalar = Scalar_;
  using Options = EvaOptions;
  using MatrixType = Matrix<Scalar>;
  using Ref = ConstRef<Scalar>;
  /// Result of `compute`.
  using Result = EvaResult<Scalar>;

  /// \throws effattn::invalid_argument on a negative or non-finite scale, negative window,
  ///         chunk_size or samples, a chunk size that neither divides nor is a multiple of the
  ///         window (Disjoint), causal without a window (or with RandomFeatures), or a malformed
  ///         summary map.
  explicit EvaAttention(Options opts = {}) : m_opts(std::move(opts)) {
    using detail::cat;
    detail::check_scale_option(m_opts.scale, kName);
    EFFATTN_CHECK(
        m_opts.window >= 0,
        cat(kName, ": Options::window must be >= 0 (0 = no exact keys); got ", m_opts.window));
    EFFATTN_CHECK(
        m_opts.chunk_size >= 0,
        cat(kName, ": Options::chunk_size must be >= 0 (0 = automatic); got ", m_opts.chunk_size));
    EFFATTN_CHECK(
        m_opts.samples >= 0,
        cat(kName, ": Options::samples must be >= 0 (0 = deterministic); got ", m_opts.samples));
    EFFATTN_CHECK(static_cast<unsigned>(m_opts.mass) <= 2U &&
                      static_cast<unsigned>(m_opts.proposal) <= 3U &&
                      static_cast<unsigned>(m_opts.partition) <= 1U,
                  cat(kName, ": Options::mass, proposal or partition is not a valid enumerator"));
    if (kRfa) {
      EFFATTN_CHECK(!m_opts.causal, cat(kName,
                                        ": policy::RandomFeatures cannot honour causal "
                                        "(it would need a prefix recurrence); use "
                                        "policy::ControlVariates"));
      m_eff = m_opts;
      m_eff.window = 0;
      m_eff.chunk_size = 0;
      m_eff.samples = m_opts.samples > 0 ? m_opts.samples : 64;
      m_eff.mass = eva::Mass::Literal;
      m_eff.proposal = eva::Proposal::Zero;
      m_eff.partition = eva::Partition::Disjoint;
      m_eff.key_map = eva::SummaryMap{};
      m_eff.query_map = eva::SummaryMap{};
      return;
    }
    EFFATTN_CHECK(!m_opts.causal || m_opts.window >= 1,
                  cat(kName,
                      ": causal EVA needs window >= 1 (E_n must contain the query "
                      "itself); got window = ",
                      m_opts.window));
    if (m_opts.partition == eva::Partition::Disjoint && m_opts.window > 0 && m_opts.chunk_size > 0)
      EFFATTN_CHECK(
          m_opts.window % m_opts.chunk_size == 0 || m_opts.chunk_size % m_opts.window == 0,
          cat(kName, ": Options::chunk_size (", m_opts.chunk_size,
              ") must divide Options::window (", m_opts.window,
              ") or be a multiple of it, so that the chunks and E_n stay disjoint"));
    check_map(m_opts.key_map, "key_map");
    check_map(m_opts.query_map, "query_map");
    m_eff = m_opts;
  }

  /// EVA attention of Q (n x d) over K (m x d), V (m x dv); see the class documentation.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, causal with
  ///         m < n, or a summary map whose size is not d.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const {
    using detail::cat;
    detail::check_attention_inputs(Q, K, V, kName);
    const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
    EFFATTN_CHECK(!m_eff.causal || m >= n,
                  cat(kName,
                      ": causal attention needs m >= n (query i sits at key position i + "
                      "m - n); got Q ",
                      detail::shape(Q), ", K ", detail::shape(K)));
    check_map_dim(m_eff.key_map, "key_map", d);
    check_map_dim(m_eff.query_map, "query_map", d);
    const double scale = detail::resolve_scale(m_eff.scale, d);
    const detail::EvaPlan plan = make_plan(n, m, d, dv);

    // Scaled keys, transposed (every key range is then a contiguous column block).
    const auto rs = static_cast<Scalar>(std::sqrt(scale));
    const Matrix<Scalar> Kt = (K * rs).transpose();
    const Vector<Scalar> negnk = Kt.colwise().squaredNorm().transpose() * Scalar(-0.5);

    // Chunk statistics: level 0 (C chunks) and, if used, level 1 (one chunk per block).
    detail::EvaLevel<Scalar> lv[2];
    lv[0].resize(plan.chunks, plan.chunk, d, dv, plan.samples, plan.gauss);
    if (plan.fine) lv[1].resize(plan.blocks, plan.window, d, dv, plan.samples, plan.gauss);
    const Index longest = std::min(m, std::max(plan.chunk, plan.fine ? plan.window : Index(0)));
    const detail::TilePlan tiles = detail::plan_tiles(
        plan.samples, longest, d, dv, static_cast<Index>(sizeof(Scalar)), 0, 0);
    detail::EvaChunkContext<Scalar, Options> ctx{&plan, &m_eff, &Q,    &K,       &V,
                                                 &Kt,   &negnk, scale, tiles.bq, tiles.bk};
    const Index units = plan.chunks + (plan.fine ? plan.blocks : 0);
    detail::parallel_for(
        units,
        [&] { return detail::EvaChunkWorkspace<Scalar>(tiles.bq, tiles.bk, d, dv, plan.samples); },
        [&](Index u, detail::EvaChunkWorkspace<Scalar>& ws) {
          const int level = u < plan.chunks ? 0 : 1;
          const Index c = level == 0 ? u : u - plan.chunks;
          const Index size = level == 0 ? plan.chunk : plan.window;
          const Index k0 = c * size, k1 = std::min(m, k0 + size);
          detail::eva_chunk_stats(ctx, level, c, k0, k1, lv[level], ws);
        });

    // Query stage: independent tasks of at most plan.tile rows inside one block.
    Result r;
    r.output.resize(n, dv);
    const Index tcols = plan.samples > 1 ? std::max(plan.samples, plan.gemm_cols) : 0;
    detail::parallel_for(
        static_cast<Index>(plan.tasks.size()),
        [&] {
          return detail::EvaBlockWorkspace<Scalar>(plan.tile, d, dv, plan.max_cols, tcols,
                                                   plan.gauss);
        },
        [&](Index t, detail::EvaBlockWorkspace<Scalar>& ws) {
          detail::eva_block<Scalar>(plan, plan.tasks[static_cast<std::size_t>(t)], Q, Kt, V, lv, rs,
                                    ws, r.output);
        });

    r.window = plan.window;
    r.chunk_size = plan.chunk;
    r.num_chunks = plan.chunks;
    r.samples = plan.samples;
    r.max_logits = plan.max_logits;
    r.chunk_keys = lv[0].repT.transpose();
    r.chunk_bias = lv[0].bias.transpose();
    r.proposal_means = lv[0].mu.transpose();
    r.omega = lv[0].omegaT.transpose();
    r.chunk_lse = std::move(lv[0].lse);
    r.chunk_values = std::move(lv[0].values);
    r.info = detail::all_finite(r.output) ? Info::Success : Info::NumericalIssue;
    return r;
  }

  /// Convenience: `compute(Q, K, V).output`.
  /// \throws effattn::numerical_error if the result is not finite (logits overflowed), and
  ///         effattn::invalid_argument as `compute`.
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V) const {
    Result r = compute(Q, K, V);
    if (r.info != Info::Success) detail::throw_numerical_error(kName, r.info);
    return std::move(r.output);
  }

  /// The most logits any query evaluates, |E_n| + S x (visible chunks) (S for RandomFeatures),
  /// for n queries over m keys, without computing anything: the feature budget of the
  /// configuration (`Result::max_logits` of a compute on such shapes).
  [[nodiscard]] Index max_logits(Index n, Index m) const {
    EFFATTN_CHECK(
        n >= 1 && m >= 1 && (!m_eff.causal || m >= n),
        detail::cat(kName, ": max_logits needs n, m >= 1 (and m >= n if causal); got n = ", n,
                    ", m = ", m));
    return make_plan(n, m, 1, 1).max_logits;
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  static void check_map(const eva::SummaryMap& mp, const char* which) {
    using detail::cat;
    const Index w = mp.weight.size() > 0 ? mp.weight.rows() : -1;
    EFFATTN_CHECK(
        mp.weight.size() == 0 || mp.weight.rows() == mp.weight.cols(),
        cat(kName, ": Options::", which, ".weight must be d x d; got ", detail::shape(mp.weight)));
    for (const Eigen::VectorXd* v : {&mp.bias, &mp.ln_gamma, &mp.ln_beta})
      EFFATTN_CHECK(v->size() == 0 || w < 0 || v->size() == w,
                    cat(kName, ": Options::", which, " vectors must have d = weight.rows() = ", w,
                        " entries; got ", v->size()));
    EFFATTN_CHECK(mp.weight.allFinite() && mp.bias.allFinite() && mp.ln_gamma.allFinite() &&
                      mp.ln_beta.allFinite() && std::isfinite(mp.ln_eps) && mp.ln_eps > 0,
                  cat(kName, ": Options::", which, " must be finite with ln_eps > 0"));
  }

  static void check_map_dim(const eva::SummaryMap& mp, const char* which, Index d) {
    using detail::cat;
    EFFATTN_CHECK(mp.weight.size() == 0 || mp.weight.rows() == d,
                  cat(kName, ": Options::", which, ".weight must be d x d with d = Q.cols() = ", d,
                      "; got ", detail::shape(mp.weight)));
    for (const Eigen::VectorXd* v : {&mp.bias, &mp.ln_gamma, &mp.ln_beta})
      EFFATTN_CHECK(v->size() == 0 || v->size() == d,
                    cat(kName, ": Options::", which, " vectors must have d = Q.cols() = ", d,
                        " entries; got ", v->size()));
  }

  detail::EvaPlan make_plan(Index n, Index m, Index d, Index dv) const {
    detail::EvaPlan p;
    p.n = n;
    p.m = m;
    p.d = d;
    p.dv = dv;
    p.off = m - n;
    p.causal = m_eff.causal;
    p.overlap = m_eff.partition == eva::Partition::Overlapping;
    p.gauss = m_eff.mass == eva::Mass::GaussianDiag;
    p.random = m_eff.samples > 0;
    p.samples = std::max<Index>(1, m_eff.samples);
    p.cross_all = !p.causal && n != m;
    const Index K = m_eff.window;
    p.window = K;
    if (kRfa) {
      p.chunk = m;  // one chunk holding every key
    } else if (m_eff.chunk_size > 0) {
      p.chunk = m_eff.chunk_size;
    } else {
      // About 64 chunks (the paper's C = 64 for language; C = 49 for images), compatible with K.
      const Index target = std::max<Index>(1, (m + 63) / 64);
      if (K == 0)
        p.chunk = target;
      else if (target <= K)
        p.chunk = detail::smallest_divisor_at_least(K, target);
      else
        p.chunk = (target + K - 1) / K * K;
    }
    p.chunks = (m + p.chunk - 1) / p.chunk;
    p.blocks = K > 0 ? (m + K - 1) / K : 0;
    p.fine = !p.overlap && K > 0 && p.chunk > K;
    p.tile = K > 0 ? std::min<Index>(K, 128) : 128;
    // Eigen packs each GEMM operand on the stack up to EIGEN_STACK_ALLOCATION_LIMIT bytes and
    // heap-allocates larger ones on every call: slice GEMMs so that no packed operand exceeds it.
    const Index width = std::max({d, dv, p.tile});
    p.gemm_cols = std::max<Index>(
        16, EIGEN_STACK_ALLOCATION_LIMIT / (width * static_cast<Index>(sizeof(Scalar))));
    if (K == 0) {
      for (Index i0 = 0; i0 < n; i0 += p.tile)
        p.tasks.push_back({-1, i0, std::min(p.tile, n - i0)});
    } else {
      for (Index b = 0; b < p.blocks; ++b) {
        const Index r0 = b == 0 ? 0 : p.first_row_at(b * K);
        const Index r1 = b + 1 < p.blocks ? p.first_row_at((b + 1) * K) : n;
        for (Index i0 = r0; i0 < r1; i0 += p.tile)
          p.tasks.push_back({b, i0, std::min(p.tile, r1 - i0)});
      }
    }
    // Softmax widths: the workspace needs the widest task; the budget counts S per chunk. (The
    // last row of a task sees the most: causal masks only hide entries from earlier rows.)
    detail::EvaSegment segs[6];
    for (const detail::EvaTask& t : p.tasks) {
      const int ns = detail::eva_task_segments(p, t, segs);
      Index cols = 0, logits = 0;
      for (int g = 0; g < ns; ++g) {
        cols += segs[g].len;
        logits += segs[g].level < 0 ? segs[g].len : segs[g].len * p.samples;
      }
      p.max_cols = std::max(p.max_cols, cols);
      p.max_logits = std::max(p.max_logits, logits);
    }
    return p;
  }

  Options m_opts;  // as given
  Options m_eff;   // as used (RandomFeatures overrides)
};

/// EVA, float.
using EvaAttentionf = EvaAttention<float>;
/// EVA, double.
using EvaAttentiond = EvaAttention<double>;
/// RFA / Performer baseline (positive random features) through the EVA kernel.
template <typename Scalar>
using PerformerAttention = EvaAttention<Scalar, policy::RandomFeatures>;
/// Performer, float.
using PerformerAttentionf = PerformerAttention<float>;
/// Performer, double.
using PerformerAttentiond = PerformerAttention<double>;

}  // namespace effattn
