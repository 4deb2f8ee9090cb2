/// \file exact.hpp
/// \brief Exact softmax attention: a materialised reference and a tiled streaming kernel.
///
/// Public declarations only; the kernels and the member definitions are in
/// `detail/methods/exact_impl.hpp`, included at the end of this file.
#pragma once

#include <type_traits>
#include <utility>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/functor.hpp"
#include "core/types.hpp"
#include "gradients.hpp"

namespace effattn {

/// \defgroup Policies Policies
/// Tag types selecting an algorithm at compile time.
namespace policy {
/// \ingroup Policies
/// Materialise the n x m score matrix in double precision, softmax it row by row, multiply by V.
/// O(n m) memory. The reference every other method is tested against.
struct Naive {};
/// \ingroup Policies
/// Streaming online softmax over key blocks for each query block (flash-attention style).
/// O((n + m) d) memory; both products are GEMMs on cache-sized tiles.
struct Tiled {};
/// \ingroup Policies
/// The Tiled kernel with bf16 products and fp32 accumulation on the matrix engine (AMX), with
/// AVX512-BF16 and portable fallbacks chosen at run time (`effattn::active_isa()`). Float only:
/// `ExactAttention<float, policy::TiledBf16>`. See `ExactAttention` for the error model.
struct TiledBf16 {};
}  // namespace policy

/// How `policy::TiledBf16` forms the scores S = s Q K^T of float inputs
/// (`ExactOptions::bf16_scores`).
enum class Bf16Scores {
  /// `Split` when d <= `kBf16SplitScoresMaxDim` (32), `Single` otherwise.
  Auto,
  /// One bf16 product: S = bf16(s Q) bf16(K)^T, fp32 sums (the logit error ~2^-8 s |q| |k|).
  Single,
  /// Split bf16 ("bf16x3"): with q = s Q = q_h + q_l and K = k_h + k_l split into a bf16 value
  /// and a bf16 remainder, S = q_h k_h^T + q_h k_l^T + q_l k_h^T, three bf16 products with fp32
  /// sums: the logit error drops to ~2^-16 s |q| |k| (plus fp32 summation) at 3x the flops of
  /// the score product. The decoding kernel (1-16 queries on the AVX-512 and AMX paths) reads
  /// the fp32 inputs anyway and runs its fp32 form instead (scores and P V in fp32), at the same
  /// memory rate.
  Split
};

/// `Bf16Scores::Auto` splits the score product up to this head dimension. Small heads have the
/// cheapest score product (d flops per score against the fixed cost of the online softmax), and
/// there a needle query (a scaled copy of one key) has a moderate logit (~2 gain sqrt(d)) whose
/// weight competes with thousands of others, where a bf16 logit error moves the output most:
/// measured on the needles workload (3 or 40 queries, 9001 keys), relative error 1.3-1.4e-2 at
/// d = 16 and 24 with one product, 1.5-1.9e-3 split; 3.6e-3 at d = 32 and <= 2.3e-3 from d = 48.
constexpr Index kBf16SplitScoresMaxDim = 32;

/// Options of `ExactAttention`.
struct ExactOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal mask, bottom-right aligned as in FlashAttention: query i sees keys
  /// j <= i + (m - n). Requires m >= n (otherwise the first n - m queries would see no key).
  bool causal = false;
  /// Query rows per tile (Tiled only). 0 = automatic.
  Index block_q = 0;
  /// Keys per tile (Tiled only). 0 = automatic.
  Index block_k = 0;
  /// TiledBf16 with float inputs: one bf16 score product or three (see `Bf16Scores`). The
  /// other policies form their scores in fp32 / double (`ExactAttention::uses_bf16_scores` is
  /// false): they reject any value but `Auto`. With bf16 inputs (whose K is exactly bf16 already)
  /// TiledBf16 forms one product whatever the value.
  Bf16Scores bf16_scores = Bf16Scores::Auto;
};

/// Result of `ExactAttention::compute`, shared by both policies.
template <typename Scalar>
struct ExactResult : AttentionResult<Scalar> {
  Vector<Scalar> lse;   ///< n values log sum_j exp(logit_ij) over the visible keys.
  Index block_q = 0;    ///< query rows per block used (Tiled; 0 for Naive)
  Index block_k = 0;    ///< keys per tile used (Tiled; 0 for Naive)
  Index kv_splits = 1;  ///< key-range splits per query block (Tiled; 1 for Naive)

  /// {"block_q", "block_k", "kv_splits"}, in this order.
  Diagnostics diagnostics() const {
    return {{"block_q", static_cast<double>(block_q)},
            {"block_k", static_cast<double>(block_k)},
            {"kv_splits", static_cast<double>(kv_splits)}};
  }
};

/// \ingroup Methods
/// \brief Exact softmax attention O = softmax(scale Q K^T + 1 b^T [+ causal mask]) V.
///
/// \f[ O_{i,:} = \sum_j \frac{\exp(s\,\langle q_i, k_j\rangle + b_j)}{\sum_{j'}
///     \exp(s\,\langle q_i, k_{j'}\rangle + b_{j'})} v_j, \qquad
///     \mathrm{lse}_i = \log \sum_j \exp(s\,\langle q_i, k_j\rangle + b_j) \f]
///
/// \tparam Scalar_ float or double.
/// \tparam Policy `policy::Tiled` (default) or `policy::Naive`, chosen at compile time: only
///         the selected kernel is instantiated.
///
/// - **Tiled** (default): for each block of `block_q` queries, loop over tiles of `block_k` keys,
///   S = (s Q_b) K_t^T (GEMM), running row max m and sum l with rescaling of the accumulator by
///   exp(m_old - m_new), then acc += exp(S - m) V_t (GEMM); finally O = acc / l. This is the
///   online softmax of Milakov & Gimelshein (2018) as used by FlashAttention (Dao et al., 2022).
///   Cost 4 n m d flops (about half with `causal`), memory O((n + m) d + threads * block_q *
///   (block_k + d + dv)): nothing n x m is ever allocated. Query blocks run in parallel under
///   OpenMP; when there are fewer than 8 query blocks the key range is split too and the partial
///   states are merged by log-sum-exp. The decomposition depends only on shapes and options, so
///   results are bit-identical for any thread count.
/// - **Naive**: materialises the n x m scores in double, stable row softmax, O = P V. 2 n m (d +
///   dv) flops in double and O(n m) memory; the reference. Computed in double even for float
///   inputs. Its two GEMMs run on Eigen's own threads, whose k-blocking depends on the thread
///   count: results agree across thread counts to round-off, not bit for bit (Tiled: bit for bit).
///
/// - **TiledBf16** (float only): the Tiled algorithm with both products in bf16 and fp32
///   accumulation, on Intel AMX (`tdpbf16ps`), AVX512-BF16 (`vdpbf16ps`) or a portable path
///   (bf16 values widened to float, Eigen GEMM), chosen once per process at run time
///   (`effattn::active_isa()`, `EFFATTN_ISA`; see core/isa.hpp). Q (times the scale), K and V are
///   rounded to bf16 once per call into packed panels; the online softmax (max, exp, row sums in
///   double) stays fp32 (on the x86 paths, tiles without mask or bias fuse it with the rounding
///   of P, exp a ~3 ulp polynomial); P = exp(S - m) is rounded to bf16 for the P V product, as
///   FlashAttention does. Block sizes are multiples of 32 (`block_q` / `block_k` rounded up;
///   default 256 x 256). Native bf16 inputs: the `compute(Bf16Ref, ...)` overloads.
///   **Error model**: bf16 keeps 8 significand bits, so each rounding is a relative error
///   <= u = 2^-9. A logit moves by at most about 2u s |q_i| |k_j| (plus fp32 summation error),
///   which changes the weights by a relative e^{2u s |q_i| |k_j|} - 1; rounding P and V adds
///   about 2u relative per term. Outputs are therefore within a few times 2^-9 of exact in
///   relative terms unless the logits are large (|s q_i k_j| >> 1 amplifies the logit error):
///   measured relative Frobenius errors are ~3e-3 on the shared workloads (docs/bf16.md).
///   lse carries the logit error directly (absolute ~u s |q| |k|). With
///   `ExactOptions::bf16_scores` = `Bf16Scores::Split` (the default `Auto` for d <= 32) the
///   scores of float inputs are three bf16 products (Q and K split into bf16 value and bf16
///   remainder), which takes the logit error to ~u^2 s |q| |k|: at small d a needle query
///   (moderate logit, weight competing with thousands of keys) reached 1.4e-2 with one product,
///   1.5e-3 split. The
///   three paths multiply the same bf16 values and differ only in fp32 summation order and in
///   the last bits of exp (measured: they agree to 1.5e-4); each
///   path is bit-identical across thread counts. `backward` runs the fp32 Tiled backward from
///   the bf16 forward's output and lse (gradients carry the forward's bf16 error); `MultiHead`
///   runs it per (sequence, head).
///
/// With `causal`, query i sees keys j <= i + (m - n) (bottom-right aligned); key tiles beyond
/// the diagonal are skipped and the diagonal tile is masked.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/exact.hpp>
/// Eigen::MatrixXf Q = Eigen::MatrixXf::Random(512, 64), K = Eigen::MatrixXf::Random(1024, 64),
///                 V = Eigen::MatrixXf::Random(1024, 64);
/// effattn::ExactAttentionf::Options o;
/// o.causal = true;                                  // query i sees keys j <= i + 512
/// auto r = effattn::ExactAttentionf(o).compute(Q, K, V);
/// // r.output: 512 x 64, r.lse: 512 log-sum-exp values
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state: one functor may be shared by any number of threads.
template <typename Scalar_, typename Policy = policy::Tiled>
class ExactAttention : public AttentionFunctor<ExactAttention<Scalar_, Policy>, Scalar_> {
  EFFATTN_REQUIRE_DEFINITIONS(ExactAttention);
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same_v<Policy, policy::Tiled> || std::is_same_v<Policy, policy::Naive> ||
                    std::is_same_v<Policy, policy::TiledBf16>,
                "effattn: ExactAttention policy must be policy::Tiled, policy::Naive or "
                "policy::TiledBf16");
  static_assert(!std::is_same_v<Policy, policy::TiledBf16> || std::is_same_v<Scalar_, float>,
                "effattn: policy::TiledBf16 needs Scalar = float (float in, float out)");

 public:
  using Scalar = Scalar_;             ///< the scalar type (float or double)
  using Options = ExactOptions;       ///< the options struct
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;       ///< the input type, `ConstRef<Scalar>`
  /// bf16 input type (activations stored in bf16), `Eigen::Ref<const Matrix<Eigen::bfloat16>>`.
  using Bf16Ref = Eigen::Ref<const Matrix<Eigen::bfloat16>>;

  /// Result of `compute` (the same type for both policies).
  using Result = ExactResult<Scalar>;  ///< the result of `compute`
  /// Result of `backward`: dQ, dK, dV (and dbias for the key-bias overload).
  using Gradients = AttentionGradients<Scalar>;

  /// The method's name, as in messages.
  static constexpr const char* name = "ExactAttention";
  /// `Options::causal` is honoured (bottom-right aligned mask).
  static constexpr bool supports_causal = true;
  /// Deterministic: no seed.
  static constexpr bool randomized = false;
  /// Q and K may have different numbers of rows (cross-attention, decoding against a cache).
  static constexpr bool self_attention_only = false;
  /// The output is softmax attention up to round-off.
  static constexpr bool exact = true;
  /// Whether `Options::bf16_scores` applies (TiledBf16 only; Tiled and Naive throw on any value
  /// but `Bf16Scores::Auto` rather than ignore it).
  static constexpr bool uses_bf16_scores = std::is_same_v<Policy, policy::TiledBf16>;

  /// \throws effattn::invalid_argument if `scale` is negative or non-finite, a block size < 0,
  ///         `bf16_scores` is not a Bf16Scores value, or it is not `Auto` for a policy other
  ///         than TiledBf16.
  explicit ExactAttention(Options opts = {}) : m_opts(opts) {
    detail::check_scale_option(m_opts.scale, name);
    EFFATTN_CHECK(
        m_opts.block_q >= 0,
        detail::cat(name, ": Options::block_q must be >= 0 (0 = automatic); got ", m_opts.block_q));
    EFFATTN_CHECK(
        m_opts.block_k >= 0,
        detail::cat(name, ": Options::block_k must be >= 0 (0 = automatic); got ", m_opts.block_k));
    EFFATTN_CHECK(detail::is_one_of(m_opts.bf16_scores,
                                    {Bf16Scores::Auto, Bf16Scores::Single, Bf16Scores::Split}),
                  detail::cat(name, ": Options::bf16_scores is not a Bf16Scores value"));
    EFFATTN_CHECK(uses_bf16_scores || m_opts.bf16_scores == Bf16Scores::Auto,
                  detail::cat(name,
                              ": Options::bf16_scores applies to policy::TiledBf16 only, not to "
                              "policy::",
                              std::is_same_v<Policy, policy::Naive> ? "Naive" : "Tiled",
                              ", whose scores are not bf16 products: leave it at "
                              "Bf16Scores::Auto"));
  }

  /// Attention of Q (n x d) over K (m x d), V (m x dv); `output` is n x dv, `lse` has n values.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, and for
  ///         `causal` with m < n.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const {
    return run(Q, K, V, nullptr);
  }

  /// Attention with an additive per-key logit bias b (m values): logit_ij = s <q_i, k_j> + b_j.
  /// b_j = log c_j is the log-count correction of a key standing for c_j identical keys, and
  /// b_j = -inf masks key j (padding). Every query must keep at least one visible key.
  /// Validation costs O(m) on top of `compute(Q, K, V)`.
  /// \throws effattn::invalid_argument as `compute(Q, K, V)`, and if `key_bias` has the wrong
  ///         length, contains NaN or +inf, or masks every key of some query.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const ConstVectorRef<Scalar>& key_bias) const;

  /// Attention of bf16 inputs (as a model stores activations); output and `lse` are Scalar.
  /// `TiledBf16` multiplies the stored bf16 values directly (no conversion; with a logit scale
  /// that is not a power of two the scaled queries are rounded to bf16 once more); the other
  /// policies widen the inputs to Scalar once and run as `compute(Q, K, V)`.
  /// \throws effattn::invalid_argument as `compute(Q, K, V)`.
  [[nodiscard]] Result compute(const Bf16Ref& Q, const Bf16Ref& K, const Bf16Ref& V) const {
    return run_bf16(Q, K, V, nullptr);
  }

  /// bf16 inputs with a per-key logit bias (see the float overload).
  /// \throws effattn::invalid_argument as `compute(Q, K, V, key_bias)`.
  [[nodiscard]] Result compute(const Bf16Ref& Q, const Bf16Ref& K, const Bf16Ref& V,
                               const ConstVectorRef<Scalar>& key_bias) const;

  /// Gradients of a loss L through `compute(Q, K, V)`: given `result` = compute(Q, K, V) and
  /// dO = dL/dO (n x dv), returns dQ = dL/dQ (n x d), dK (m x d) and dV (m x dv), with the
  /// functor's options (scale, causal mask):
  /// \f[ dV = P^T dO,\quad dS = P \circ (dO\,V^T - D\,1^T),\quad dQ = s\,dS\,K,\quad
  ///     dK = s\,dS^T Q,\qquad D_i = \sum_c dO_{ic} O_{ic}. \f]
  ///
  /// - **Tiled** (flash-attention 2 style backward; Dao 2023, "FlashAttention-2: Faster
  ///   Attention with Better Parallelism and Work Partitioning"): D from `result.output` and dO
  ///   (sums in double), then for every (query block b, key tile t) pair the probabilities are
  ///   recomputed from `result.lse`, P = exp(s Q_b K_t^T + b_t - lse_b) (masked), and five GEMMs
  ///   per tile: S = (s Q_b) K_t^T, dP = dO_b V_t^T, dV_t += P^T dO_b, then with
  ///   dS = P o (dP - D_b): dK_t += dS^T (s Q_b) and dQ_b += dS K_t. 10 n m d flops for d = dv
  ///   (2.5x the forward's 4 n m d; about half of both with `causal`, whose hidden tiles are
  ///   skipped). Extra memory O((n + m) d): s Q, K^T, V^T, D and 3 partial dQ sums (see below),
  ///   plus O(threads bq bk) workspace; nothing n x m. Parallel without atomics over 4 key
  ///   groups (a constant, never the thread count): group g owns the key tiles t = g, g + 4, ...
  ///   (interleaved, which balances the causal triangle), loops over the query blocks in order
  ///   accumulating its dK_t, dV_t and its own partial dQ, and the partials are added in group
  ///   order at the end. One parallel region per call; the result is bit-identical for any
  ///   thread count. The parallelism is min(4, key tiles) tasks.
  /// - **Naive**: the reference, in double: P materialised (n x m doubles), the same formulas as
  ///   dense products, D = rowsum(P o dP); `result` is only checked, not used. 2 n m (2 d + 3 dv)
  ///   flops.
  ///
  /// \throws effattn::invalid_argument on invalid Q, K, V (as `compute`), if `result` is not a
  ///         successful result of these shapes (output n x dv, n lse values), or if dO is not
  ///         n x dv or not finite.
  [[nodiscard]] Gradients backward(const Ref& Q, const Ref& K, const Ref& V, const Result& result,
                                   const Ref& dO) const;

  /// As `backward(Q, K, V, result, dO)` for `result` = compute(Q, K, V, key_bias); also returns
  /// dbias = dL/db = dS^T 1 (m values, the column sums of dS; accumulated in double; 0 for a
  /// masked key b_j = -inf).
  /// \throws effattn::invalid_argument as `backward(Q, K, V, result, dO)` and for an invalid
  ///         `key_bias` (as `compute`).
  [[nodiscard]] Gradients backward(const Ref& Q, const Ref& K, const Ref& V,
                                   const ConstVectorRef<Scalar>& key_bias, const Result& result,
                                   const Ref& dO) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  /// Validates the inputs and runs the policy's kernel; `bias` is null or points to m values.
  Result run(const Ref& Q, const Ref& K, const Ref& V, const Scalar* bias) const;
  /// `run` for bf16 inputs.
  Result run_bf16(const Bf16Ref& Q, const Bf16Ref& K, const Bf16Ref& V, const Scalar* bias) const;
  /// Validates Q, K, V and the causal shape condition; returns the effective scale.
  double check_inputs(const Ref& Q, const Ref& K, const Ref& V) const;
  /// Validates a key bias for Q (n rows) and K (m rows); see `compute(Q, K, V, key_bias)`.
  void check_key_bias(const ConstVectorRef<Scalar>& key_bias, Index n, Index m) const;
  /// Validates the backward arguments and runs the policy's backward kernel.
  Gradients run_backward(const Ref& Q, const Ref& K, const Ref& V, const Scalar* bias,
                         const Result& result, const Ref& dO) const;

  Options m_opts;
};

/// Exact attention with the Tiled kernel, float.
using ExactAttentionf = ExactAttention<float>;
/// Exact attention with the Tiled kernel, double.
using ExactAttentiond = ExactAttention<double>;
/// Exact attention with bf16 products (AMX / AVX512-BF16 / generic), float in and out.
using ExactAttentionBf16 = ExactAttention<float, policy::TiledBf16>;
/// Materialised reference, float inputs (computed in double).
using NaiveAttentionf = ExactAttention<float, policy::Naive>;
/// Materialised reference, double.
using NaiveAttentiond = ExactAttention<double, policy::Naive>;

}  // namespace effattn

#if EFFATTN_DETAIL_WITH_IMPL
#include "detail/methods/exact_backward_impl.hpp"
#include "detail/methods/exact_impl.hpp"
#endif

#ifdef EFFATTN_COMPILED
namespace effattn {
// Both policies are reference policies of the library: the default Tiled kernel, and Naive, the
// materialised reference the tests and the comparison program measure every method against.
EFFATTN_EXTERN_INSTANCE(ExactAttention<float, policy::Tiled>)
EFFATTN_EXTERN_INSTANCE(ExactAttention<double, policy::Tiled>)
EFFATTN_EXTERN_INSTANCE(ExactAttention<float, policy::Naive>)
EFFATTN_EXTERN_INSTANCE(ExactAttention<double, policy::Naive>)
EFFATTN_EXTERN_INSTANCE(ExactAttention<float, policy::TiledBf16>)
}  // namespace effattn
#endif
