/// \file mpi.hpp
/// \brief Context-parallel attention over MPI: ring exact attention (`RingAttention`) and
/// distributed WildCat coresets (`compress_kv`, `wildcat_attention` over a communicator).
///
/// Header-only; compiled only by translation units that include it, which must link MPI (the
/// CMake target `effattn::mpi` = `effattn::effattn` + `MPI::MPI_CXX`). Namespace `effattn::mpi`.
///
/// **The idea (Ring Attention; Liu, Zaharia and Abbeel 2023).** A sequence of N tokens is split
/// over P ranks; rank p holds the queries, keys and values of its tokens (its shard). Softmax
/// attention of a query over all keys is a log-sum-exp combination of its attention over any
/// partition of the keys: with o_s, lse_s the output and log-sum-exp over key block s,
/// \f[ \mathrm{lse} = \log \sum_s e^{\mathrm{lse}_s}, \qquad
///     o = \sum_s e^{\mathrm{lse}_s - \mathrm{lse}}\, o_s . \f]
/// So the key/value blocks travel around a ring (rank p sends to p + 1 and receives from p - 1,
/// P - 1 steps) while each rank computes the attention of its queries against the block it
/// holds, and merges the partial (output, lse) pairs. The transfer of the next block is posted
/// (`MPI_Isend` / `MPI_Irecv`, double-buffered) before the computation on the current one, so
/// communication hides behind computation when a block takes longer to compute than to send:
/// with T = N / P tokens per rank, H query heads and G key/value heads of width d, a step
/// computes 4 T^2 H d flops (at the kernel rate F) and sends 2 T G d scalars (at link bandwidth
/// B bytes/s, latency alpha; b bytes per scalar): the ring is compute-bound when
/// \f[ \frac{4 T^2 H d}{F} \ \ge\ \alpha + \frac{2 T G d b}{B}, \f]
/// i.e. \f$ T \ge G b F / (2 H B) \f$ tokens per rank when alpha is small.
/// (Half the flops per step with `causal` and striped shards: T twice as large.)
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "../exact.hpp"
#include "../multi_head.hpp"
#include "../wildcat.hpp"

namespace effattn {
/// Context-parallel attention over MPI (see mpi.hpp).
namespace mpi {

/// How the N tokens of a sequence are spread over the P ranks of the communicator.
enum class Sharding {
  /// Rank p holds a contiguous range of tokens, ranks in order (rank 0 the first tokens); the
  /// ranges may have any lengths (uneven, even empty). Causal attention is unbalanced: rank p
  /// computes p + 1/2 blocks while rank 0 computes 1/2.
  Contiguous,
  /// Token t lives on rank t mod P (rank p holds t = p, p + P, p + 2P, ... in order, so it has
  /// ceil((N - p) / P) tokens). Every block pair is half visible under a causal mask, so every
  /// rank does the same causal work (Striped Attention; Brandon et al. 2023).
  Striped
};

/// How the ring drives MPI progress while a block is being computed.
enum class Progress {
  /// `Thread` when MPI was initialised with at least MPI_THREAD_SERIALIZED, else `Poll`.
  Auto,
  /// A helper thread calls MPI_Testall (sleeping `poll_interval_us` in between) while the calling
  /// thread computes; MPI is never called by two threads at once (MPI_THREAD_SERIALIZED).
  Thread,
  /// The calling thread calls MPI_Testall between chunks of query rows (MPI_THREAD_SINGLE).
  Poll
};

/// Options of `RingAttention`. Every rank must pass the same options (checked).
struct RingOptions {
  /// Logit scale: the logit of (i, j) is scale * <q_i, k_j>. 0 means 1/sqrt(d).
  double scale = 0;
  /// Causal mask over GLOBAL positions: token t attends to tokens t' <= t of the whole sequence.
  bool causal = false;
  /// How the tokens are spread over the ranks.
  Sharding sharding = Sharding::Contiguous;
  /// Query heads and key/value heads (GQA) of the packed layout, as for `MultiHead`:
  /// Q_local is T x (heads d), K_local T x (kv_heads d), V_local T x (kv_heads dv).
  HeadLayout layout{};
  /// Query rows / keys per tile of the exact Tiled kernel (0 = automatic).
  Index block_q = 0;
  /// Keys per tile of the exact Tiled kernel (0 = automatic).
  Index block_k = 0;
  /// Float only: run each block with bf16 products and fp32 accumulation
  /// (`ExactAttention<float, policy::TiledBf16>`, on AMX, AVX512-BF16 or the portable path, see
  /// `effattn::active_isa()`), with its error model (about 3e-3 relative on the shared
  /// workloads). The blocks still travel in float. `RingAttention<double>` rejects it.
  bool bf16 = false;
  /// How MPI progress is made during a block's computation.
  Progress progress = Progress::Auto;
  /// Sleep between two MPI_Testall calls of the progress thread, in microseconds (>= 1).
  int poll_interval_us = 50;
};

/// Time and traffic of one `RingAttention::compute` call on this rank.
struct RingStats {
  double total_seconds = 0;         ///< the whole call (validation included)
  double compute_seconds = 0;       ///< the exact kernel and the lse merges
  double exposed_seconds = 0;       ///< MPI time on the critical path: posts, polls, final waits
  double validate_seconds = 0;      ///< the collective input checks (two small collectives)
  std::int64_t bytes_sent = 0;      ///< key/value bytes this rank sent around the ring
  std::int64_t bytes_received = 0;  ///< key/value bytes this rank received
  int steps = 0;                    ///< ring steps (P)
  bool progress_thread = false;     ///< whether the helper progress thread was used
};

/// Result of `RingAttention::compute`: the rows of this rank's shard.
template <typename Scalar>
struct RingResult : AttentionResult<Scalar> {
  /// T_local x heads log-sum-exp values over every visible key of the whole sequence (column h
  /// is query head h). `output` is T_local x (heads dv), head h in columns [h dv, (h + 1) dv).
  Matrix<Scalar> lse;
  Index global_tokens = 0;  ///< N, the tokens of all ranks
  RingStats stats;          ///< time and traffic of this rank

  /// {"global_tokens", "compute_seconds", "exposed_seconds", "bytes_sent"}.
  Diagnostics diagnostics() const {
    return {{"global_tokens", static_cast<double>(global_tokens)},
            {"compute_seconds", stats.compute_seconds},
            {"exposed_seconds", stats.exposed_seconds},
            {"bytes_sent", static_cast<double>(stats.bytes_sent)}};
  }
};

/// The global positions of the tokens rank `rank` of `ranks` holds when `total` tokens are
/// sharded with `sharding` (contiguous: the balanced split, the first total % ranks ranks one
/// token longer). Any contiguous split is accepted by `RingAttention`; this is a convenience.
inline std::vector<Index> shard_positions(Index total, int ranks, int rank, Sharding sharding);

/// \brief Exact softmax attention of a sequence sharded over the ranks of an MPI communicator
/// (Ring Attention), in the packed multi-head / GQA layout.
///
/// Rank p passes the rows of its tokens: Q_p (T_p x heads d), K_p (T_p x kv_heads d), V_p
/// (T_p x kv_heads dv), where the tokens are those `Options::sharding` assigns it. It gets back
/// the same rows of O = softmax(scale Q K^T [+ causal mask]) V over the whole sequence, and
/// their log-sum-exp values; query head h reads key/value head h / (heads / kv_heads).
///
/// Algorithm: K_p and V_p are packed into one buffer; in step s = 0 .. P - 1 rank p holds the
/// block of rank (p - s) mod P, posts MPI_Isend of it to p + 1 and MPI_Irecv of the next one
/// from p - 1 into the other buffer, computes the block's contribution with the exact Tiled
/// kernel (`core/online_softmax.hpp`: `tiled_attention`, which also returns lse) per head and
/// chunk of 2048 query rows, merges it into the running (output, lse) by log-sum-exp
/// (`merge_split_states`), and waits. MPI progress during the computation comes from a helper
/// thread or from polls between chunks (`Options::progress`). With `causal`, global positions
/// decide visibility: contiguous shards see earlier ranks' blocks whole, their own block with
/// the diagonal mask, later blocks not at all (skipped, still forwarded); striped shards see
/// block q of rank q <= p with local mask j <= i and of rank q > p with j < i.
///
/// Cost per rank: 4 T^2 heads d flops per step (for d = dv; about half with `causal`, same on
/// every rank when striped), P steps; traffic (P - 1) T kv_heads (d + dv) scalars sent and
/// received; memory O(T (heads + kv_heads) d): two key/value buffers and the running output.
/// Results are deterministic (fixed merge order, thread-count independent kernel) and agree with
/// single-process `ExactAttention` to round-off (tested within 1e-5 relative in float).
///
/// **Error model.** `compute` is collective. Shapes and options of all ranks are exchanged first
/// (MPI_Allgather), then every rank runs the same checks on the exchanged data plus its local
/// checks (finite entries); the verdict is combined with MPI_Allreduce and the message of the
/// lowest failing rank is broadcast, so either every rank returns or every rank throws the same
/// `effattn::invalid_argument` ("... (rank r) ..."): a bad rank never leaves the others waiting
/// in the ring. Checked: widths equal on every rank and divisible by the head counts, equal
/// options, T_p equal for Q, K and V, striped shard sizes ceil((N - p) / P), N >= 1, finite
/// entries, messages below 2^31 scalars.
///
/// \par Example
/// \code{.cpp}
/// MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
/// effattn::mpi::RingOptions o;
/// o.causal = true;
/// o.sharding = effattn::mpi::Sharding::Striped;     // rank p holds tokens p, p + P, ...
/// effattn::mpi::RingAttention<float> ring(MPI_COMM_WORLD, o);
/// auto r = ring.compute(Q_local, K_local, V_local); // r.output, r.lse: this rank's rows
/// \endcode
///
/// The communicator is used for point-to-point messages with a fixed tag and for collectives;
/// do not run two `compute` calls on the same communicator concurrently. bf16 is not supported
/// (float and double).
template <typename Scalar_>
class RingAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");

 public:
  using Scalar = Scalar_;                                    ///< float or double
  using Options = RingOptions;                               ///< the options struct
  using Result = RingResult<Scalar>;                         ///< the result of `compute`
  using Ref = ConstRef<Scalar>;                              ///< the input type
  static constexpr const char* name = "mpi::RingAttention";  ///< name in messages

  /// Collective over `comm`: validates the options on every rank (all throw if one rank's
  /// options are invalid). \throws effattn::invalid_argument on a negative scale, block sizes
  /// < 0, heads < 1, kv_heads < 0 or not dividing heads, poll_interval_us < 1, or `Thread`
  /// progress without MPI_THREAD_SERIALIZED.
  RingAttention(MPI_Comm comm, Options opts = {});

  /// Collective: the attention of this rank's rows over the whole sequence (class
  /// documentation). \throws effattn::invalid_argument on every rank if any rank's input is
  /// invalid (error model above).
  [[nodiscard]] Result compute(const Ref& Q_local, const Ref& K_local, const Ref& V_local) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }
  /// The communicator.
  MPI_Comm comm() const noexcept { return m_comm; }

 private:
  MPI_Comm m_comm;
  Options m_opts;
};

/// Ring attention, float.
using RingAttentionf = RingAttention<float>;
/// Ring attention, double.
using RingAttentiond = RingAttention<double>;

/// Traffic of the all-gather of a distributed `compress_kv`.
struct GatherStats {
  std::int64_t bytes_local = 0;     ///< this rank's serialised coreset
  std::int64_t bytes_gathered = 0;  ///< the serialised coresets of all ranks (the union)
  std::int64_t bytes_received = 0;  ///< bytes_gathered - bytes_local + the size exchange
  double seconds = 0;               ///< the whole call
};

/// The serialised size in bytes of a coreset of r rows, `blocks` bins, key width d and value
/// width dv, as `compress_kv` over a communicator sends it: r (d + dv + 2) scalars (keys,
/// compressed values, weights, log-scales), r pivot positions (8 bytes), per bin d + 8 doubles
/// (centre; radius, tau^2, residual trace, row and token ranges, exactness), the value range
/// (2 dv scalars) and an 8-value header. O(r d): what makes the all-gather O(P r d).
inline std::int64_t coreset_bytes(Index r, Index blocks, Index d, Index dv, Index scalar_bytes);

/// \brief Distributed CompressKV (WildCat): every rank compresses its own contiguous shard of
/// keys and values with `effattn::compress_kv`, the coresets are all-gathered (O(P r (d + dv))
/// bytes, not O(N d)), and every rank returns the same union (rank order; pivots and block token
/// ranges in global positions), ready for `weighted_attention`.
///
/// Rank p uses the seed `derive_seed(opts.seed, p)` (independent pivot draws per shard), its own
/// key mean as the recentring point (stored per block, keys in original units) and `q_radius`
/// (the same on every rank). The union is exactly what a single process gets by calling
/// `compress_kv` on each shard with those seeds and stacking the results: a block-diagonal
/// Nystrom approximation whose bins are all ranks' bins. **Error bound**: `weighted_attention`
/// over the union computes the Lemma 1 + 2 bound of the global problem: for row i the squared
/// errors of disjoint key blocks add, ||a_i - ahat_i||^2 <= sum over the bins b of ALL ranks of
/// e^{2 beta <q_i, c_b>} e^{beta tau_b^2 |q_i|^2} tr_b; min_l a_il is the minimum over all bins;
/// m = N (global tokens); the clip range is the global [vmin, vmax] (min / max over ranks). A
/// rank's `error_bound` bounds its own rows; the max over ranks bounds the whole output
/// (`wildcat_attention` returns it as `global_error_bound`).
///
/// Collective; errors as `RingAttention` (every rank throws the same `invalid_argument`).
/// A rank may hold no tokens (it contributes nothing); N >= 1. Numerical breakdown on any rank
/// gives an empty union (size() == 0) on every rank.
/// \throws effattn::invalid_argument on bad options, mismatched widths or options across ranks,
///         non-finite entries, q_radius < 0 or N = 0.
template <typename PivotRule = policy::AcceleratedRandomlyPivoted, typename DK, typename DV>
[[nodiscard]] CompressedKV<typename DK::Scalar> compress_kv(
    MPI_Comm comm, const Eigen::MatrixBase<DK>& K_local, const Eigen::MatrixBase<DV>& V_local,
    double q_radius, const WildcatOptions& opts = {}, GatherStats* stats = nullptr);

/// Result of the distributed WildCat forward: this rank's rows plus the global bound.
template <typename Scalar>
struct WildcatShardResult : WildcatResult<Scalar> {
  double global_error_bound = 0;  ///< max over ranks of `error_bound`: bounds the whole output
  GatherStats gather;             ///< traffic of the coreset all-gather
};

/// \brief Distributed WildCat attention (paper Alg. 4 over a communicator): R_Q = the global
/// max ||q_i|| (MPI_Allreduce; or opts.q_radius when > 0), the distributed `compress_kv` above,
/// then `weighted_attention` of this rank's queries against the union. Cost per rank:
/// O(T r^2 / B + T r d / B) to compress its shard, O(P r (d + dv)) bytes to gather, O(T r P (d +
/// dv)) to attend (the union has P r rows). Single head (for heads, call it per head column
/// block). Collective; errors as `compress_kv`.
template <typename PivotRule = policy::AcceleratedRandomlyPivoted, typename DQ, typename DK,
          typename DV>
[[nodiscard]] WildcatShardResult<typename DQ::Scalar> wildcat_attention(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q_local, const Eigen::MatrixBase<DK>& K_local,
    const Eigen::MatrixBase<DV>& V_local, const WildcatOptions& opts = {});

}  // namespace mpi
}  // namespace effattn

#include "detail/mpi_impl.hpp"
