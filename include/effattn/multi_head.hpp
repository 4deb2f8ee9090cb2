/// \file multi_head.hpp
/// \brief Heads, batches and KV caches for every attention functor: multi-head, grouped-query
/// (GQA / MQA), variable-length (packed) batches and decoding, in the packed layout a model's
/// projections produce.
///
/// Public declarations; the implementation is in `detail/methods/multi_head_impl.hpp` (included at
/// the end), with the packed views in `detail/methods/multi_head_views.hpp` and the multi-head
/// exact kernel in `detail/methods/multi_head_exact.hpp`.
#pragma once

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/concept.hpp"
#include "core/errors.hpp"
#include "core/types.hpp"
#include "exact.hpp"

namespace effattn {

/// How a packed tensor is split into heads: `heads` query heads and `kv_heads` key/value heads
/// (`kv_heads = 0` means `heads`, i.e. plain multi-head attention). `heads` must be a multiple of
/// `kv_heads`: query head h reads key/value head h / (heads / kv_heads). `kv_heads == heads` is
/// multi-head attention, 1 < kv_heads < heads grouped-query attention (GQA: Llama, Mistral, Qwen)
/// and `kv_heads == 1` multi-query attention (MQA).
struct HeadLayout {
  Index heads = 1;     ///< query heads H (>= 1)
  Index kv_heads = 0;  ///< key/value heads G (0 = heads); H must be a multiple of G
};

/// Cumulative sequence offsets of a packed variable-length batch: B + 1 non-decreasing values
/// from 0 to the number of rows (flash-attention's `cu_seqlens`); sequence b is rows
/// [offsets[b], offsets[b + 1]). An empty vector means one sequence spanning every row.
using SeqOffsets = std::vector<Index>;

/// Result of `MultiHead<F>::compute`: the packed output, one status for the call, and the
/// per-(sequence, head) Results of the functor (their `output` left empty: it is in `output`).
/// \tparam StorageOrder the storage order of `output`, that of the Q passed to `compute`.
template <typename F, int StorageOrder = Eigen::ColMajor>
struct MultiHeadResult {
  using Scalar = typename F::Scalar;      ///< the functor's scalar
  using HeadResult = typename F::Result;  ///< the functor's Result
  /// T_q x (heads * dv) output, head h in columns [h dv, (h + 1) dv), in Q's storage order.
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, StorageOrder> output;
  /// Success when every (sequence, head) succeeded, else the first failure in (b, h) order.
  Info info = Info::NotComputed;
  Index batch = 0;     ///< sequences B
  Index heads = 0;     ///< query heads H
  Index kv_heads = 0;  ///< key/value heads G
  Index tasks = 0;     ///< parallel tasks the call was split into
  /// Per-(sequence, head) Results, index b * heads + h, with an empty `output`: WildCat's error
  /// bounds, Conv-Basis's bases, KEP-SVGP's variances, exact attention's `lse` (the rows of
  /// sequence b). A sequence without queries has a default Result with `info = Success`.
  std::vector<HeadResult> head_results;

  /// The Result of query head h of sequence b.
  const HeadResult& head(Index b, Index h) const {
    return head_results[static_cast<std::size_t>(b * heads + h)];
  }
  /// {"batch", "heads", "kv_heads", "tasks"}; per-head diagnostics: `head(b, h).diagnostics()`.
  Diagnostics diagnostics() const {
    return {{"batch", static_cast<double>(batch)},
            {"heads", static_cast<double>(heads)},
            {"kv_heads", static_cast<double>(kv_heads)},
            {"tasks", static_cast<double>(tasks)}};
  }
};

/// Gradients returned by `MultiHead<F>::backward`, in the packed layout of the inputs and in Q's
/// storage order: dQ (T_q x heads d), dK (T_k x kv_heads d), dV (T_k x kv_heads dv). The key
/// and value gradients of a key/value head are summed over the query heads that read it (GQA);
/// rows of keys no query saw (`seqused_k`, sequences without queries) are zero.
template <typename Scalar, int StorageOrder = Eigen::ColMajor>
struct MultiHeadGradients {
  /// A packed gradient, in Q's storage order.
  using Packed = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, StorageOrder>;
  Packed dQ;  ///< T_q x (heads d), dL/dQ
  Packed dK;  ///< T_k x (kv_heads d), dL/dK
  Packed dV;  ///< T_k x (kv_heads dv), dL/dV
};

/// Per-(sequence, key/value head) caches of a method with a compressed KV cache (WildCat's
/// `CompressedKV`), built by `MultiHead<WildcatAttention<S>>::compress_kv`.
template <typename Cache>
struct MultiHeadCache {
  Index batch = 0;            ///< sequences B
  Index kv_heads = 0;         ///< key/value heads G
  std::vector<Cache> caches;  ///< index b * kv_heads + g
  /// The cache of key/value head g of sequence b.
  Cache& at(Index b, Index g) { return caches[static_cast<std::size_t>(b * kv_heads + g)]; }
  /// The cache of key/value head g of sequence b.
  const Cache& at(Index b, Index g) const {
    return caches[static_cast<std::size_t>(b * kv_heads + g)];
  }
};

/// \ingroup Methods
/// \brief Any attention functor over heads, grouped key/value heads and packed variable-length
/// batches: `MultiHead<F>` runs F on every (sequence, query head) of a packed batch.
///
/// Inputs are in the packed layout of a model's projections, tokens in rows:
/// - Q: T_q x (H d), query head h in columns [h d, (h + 1) d);
/// - K: T_k x (G d) and V: T_k x (G dv), key/value head g in the g-th column block;
/// - sequence b: query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows
///   [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
///
/// Query head h of sequence b attends to key/value head h / (H / G) of the same sequence:
/// \f[ O^{(b)}_{:, h} = F\big(Q^{(b)}_{:, h},\; K^{(b)}_{:, g(h)},\; V^{(b)}_{:, g(h)}\big),
///     \qquad g(h) = \lfloor h G / H \rfloor. \f]
/// With `causal`, the mask is bottom-right aligned per sequence: query i of sequence b sees keys
/// j <= i + (n_k^{(b)} - n_q^{(b)}), which is what decoding against a KV cache needs (the new
/// queries are the last positions).
///
/// Row-major inputs (a `Map` over a PyTorch / NumPy buffer, `Eigen::Matrix<..., RowMajor>`) and
/// column-major ones (`MatrixX`, `Map`, column blocks) are read in place; an input whose inner
/// stride is not 1, or an expression, is evaluated once. The output has Q's storage order.
///
/// **Exact Tiled (`ExactAttention<S, policy::Tiled>`)** runs a multi-head kernel: tasks are
/// (sequence, key/value head, query block, query-head chunk, key split), scheduled dynamically
/// over the threads, each an online-softmax pass (the kernel of `core/online_softmax.hpp`) that
/// reads the head's rows and columns of Q, K, V through strided maps, with no copy of any input,
/// and writes its rows of the output. When a sequence has few queries (decoding: n_q <= bq / 2)
/// the query heads of a GQA group are stacked into one block, so every key/value tile is read
/// once per group; when there are fewer than 32 blocks the key range is split too and the
/// partial states are merged by log-sum-exp (split-KV). Extra memory: one tile workspace per
/// thread (bq (d + bk + dv) scalars) plus the partial states of split blocks.
///
/// **Every other functor** (Naive, Conv-Basis, VCC, EVA, Performer, WildCat, KEP-SVGP, ...) is
/// called once per (sequence, query head), the (sequence, head) calls running in parallel, each
/// serially inside its task (effattn never nests parallel regions). Column-major inputs are
/// passed as views; a row-major input is copied one (sequence, head) slice at a time, never
/// whole. Methods with one sequence per call (`self_attention_only`) need equal query and key
/// lengths per sequence; VCC's VIP indices apply to every sequence and must lie inside each.
///
/// Results are bit-identical for any thread count: the task decomposition depends only on the
/// shapes and the options. For exact Tiled they agree with per-head `ExactAttention` calls to
/// round-off (bit-identical when the blocks are the same: no head stacking, no split); for every
/// other functor they are the per-head calls' results.
///
/// \par Example (prefill, GQA 32 / 8, causal, two sequences)
/// \code{.cpp}
/// using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// RowMat Q(700, 32 * 128), K(700, 8 * 128), V(700, 8 * 128);  // from the projections
/// effattn::ExactAttentionf::Options o;
/// o.causal = true;
/// effattn::MultiHead<effattn::ExactAttentionf> mha(o, {32, 8});
/// auto r = mha.compute(Q, K, V, {0, 200, 700}, {0, 200, 700});
/// // r.output: 700 x 4096, row-major; r.head(1, 5).lse: log-sum-exp of head 5, sequence 1
/// \endcode
///
/// \par Threading
/// `compute` is const and keeps no state.
template <typename F>
class MultiHead {
  static_assert(is_attention_functor_v<F>, "effattn: MultiHead<F> needs an attention functor");

 public:
  using Functor = F;                                ///< the per-head functor
  using Scalar = typename F::Scalar;                ///< its scalar type
  using Options = typename F::Options;              ///< its options
  using HeadResult = typename F::Result;            ///< its per-head Result
  static constexpr const char* name = "MultiHead";  ///< name in messages

  /// \throws effattn::invalid_argument if the options are invalid for F, `heads` < 1,
  ///         `kv_heads` < 0 or `heads` is not a multiple of `kv_heads`.
  explicit MultiHead(Options opts = {}, HeadLayout layout = {});

  /// Attention of every (sequence, query head) of the packed batch (see the class
  /// documentation). Q: T_q x (heads d), K: T_k x (kv_heads d), V: T_k x (kv_heads dv).
  /// `cu_seqlens_q` / `cu_seqlens_k`: B + 1 offsets each (empty: one sequence; an empty
  /// `cu_seqlens_k` with a multi-sequence `cu_seqlens_q` means the same offsets).
  /// `seqused_k` (B values, optional; flash-attention's name): sequence b uses only the first
  /// seqused_k[b] rows of its key region [cu_seqlens_k[b], cu_seqlens_k[b + 1]), so a KV cache
  /// preallocated per sequence is passed as it is and a decoding step appends by writing rows.
  /// \returns the output in Q's storage order, `info`, and the per-(sequence, head) Results.
  /// \throws effattn::invalid_argument naming the argument: widths not divisible by the head
  ///         counts, offsets that do not start at 0, decrease or do not end at the row count,
  ///         different batch sizes, `seqused_k` of the wrong size or beyond a region, a sequence
  ///         with queries but no keys, non-finite entries, and whatever F rejects for one
  ///         (sequence, head) (the message names them).
  template <typename DQ, typename DK, typename DV>
  [[nodiscard]] MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)> compute(
      const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
      const Eigen::MatrixBase<DV>& V, const SeqOffsets& cu_seqlens_q = {},
      const SeqOffsets& cu_seqlens_k = {}, const std::vector<Index>& seqused_k = {}) const;

  /// `compute` writing the output into `out` (T_q x heads dv, either storage order, inner stride
  /// 1: a Matrix, a Map of a model's buffer or a block of one) instead of a new matrix; the
  /// Result's `output` stays empty. A model that reuses one output buffer per layer saves the
  /// allocation and the kernel's zeroing of fresh pages on every call (a prefill output is
  /// 64 MiB at B = 8, L = 512, 32 heads of 128: see docs/multi_head.md).
  /// The values are bit-identical to `compute`'s; `backward` needs `compute`'s Result (it reads
  /// the output). When the call throws, `out` may have been partly written.
  /// \throws effattn::invalid_argument as `compute`, and if `out` has the wrong shape, an inner
  ///         stride other than 1, or overlaps Q, K or V.
  template <typename DQ, typename DK, typename DV, typename DOut>
  [[nodiscard]] MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
  compute_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
               const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& out,
               const SeqOffsets& cu_seqlens_q = {}, const SeqOffsets& cu_seqlens_k = {},
               const std::vector<Index>& seqused_k = {}) const;

  /// Gradients of a loss through `compute` (methods with a `backward`: exact attention, both
  /// policies and TiledBf16, Conv-Basis, Performer, EVA): given the packed Q, K, V and offsets of
  /// the forward call, its `result` and dO = dL/dO (T_q x heads dv, the output's shape), returns
  /// dQ, dK, dV in the packed layout (see `MultiHeadGradients`). Each (sequence, query head)
  /// runs F's own `backward` from its part of `result` (output slice and per-head Result: `lse`,
  /// Conv-Basis offsets, ...); the dK, dV of a key/value head are the sums over its query heads,
  /// added in head order. Tasks are (sequence, key/value head) pairs in parallel, each serial
  /// inside, so results do not depend on the thread count. Cost: the per-head backwards (about
  /// 2.5x the forward for exact Tiled), extra memory one (sequence, head)'s gradients per task.
  /// \throws effattn::invalid_argument for inputs `compute` would reject, a `result` that is not
  ///         a successful result of this layout and these shapes, or a dO of the wrong shape or
  ///         with non-finite entries (the messages name the argument, sequence and head).
  template <typename DQ, typename DK, typename DV, int ResultOrder, typename DO>
  [[nodiscard]] MultiHeadGradients<Scalar, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
  backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
           const Eigen::MatrixBase<DV>& V, const MultiHeadResult<F, ResultOrder>& result,
           const Eigen::MatrixBase<DO>& dO, const SeqOffsets& cu_seqlens_q = {},
           const SeqOffsets& cu_seqlens_k = {}, const std::vector<Index>& seqused_k = {}) const;

  /// WildCat only: compresses every (sequence, key/value head) of a packed K, V
  /// (`WildcatAttention::compress_kv` per head, in parallel). \returns the caches, index
  /// b * kv_heads + g. Later tokens are added with `append`.
  template <typename DK, typename DV>
  [[nodiscard]] auto compress_kv(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                 const SeqOffsets& cu_seqlens_k = {}, double q_radius = 0) const;

  /// WildCat only: appends newly decoded tokens (packed K_new, V_new with offsets
  /// `cu_seqlens_new`, B + 1 values) exactly to each sequence's caches.
  template <typename Cache, typename DK, typename DV>
  void append(MultiHeadCache<Cache>& cache, const Eigen::MatrixBase<DK>& K_new,
              const Eigen::MatrixBase<DV>& V_new, const SeqOffsets& cu_seqlens_new = {}) const;

  /// WildCat only: attention of the packed queries Q (T_q x heads d, offsets `cu_seqlens_q`)
  /// over the compressed caches (`WildcatAttention::weighted_attention` per head); a query head
  /// reads its group's cache.
  template <typename Cache, typename DQ>
  [[nodiscard]] MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
  weighted_attention(const Eigen::MatrixBase<DQ>& Q, const MultiHeadCache<Cache>& cache,
                     const SeqOffsets& cu_seqlens_q = {}) const;

  /// The per-head functor.
  const F& functor() const noexcept { return m_functor; }
  /// The functor's options.
  const Options& options() const noexcept { return m_functor.options(); }
  /// The head layout (kv_heads resolved: never 0).
  const HeadLayout& layout() const noexcept { return m_layout; }

 private:
  F m_functor;
  HeadLayout m_layout;
};

}  // namespace effattn

#include "detail/methods/multi_head_impl.hpp"
