/// \file online_softmax.hpp
/// \brief The tiled online-softmax kernel shared by exact attention (`policy::Tiled`) and EVA's
/// chunk statistics: tile planning, per-thread workspaces, one query block streamed over a key
/// range, the merge of split-KV partial states, and the whole-problem driver.
///
/// The online softmax (Milakov and Gimelshein 2018; Dao et al. 2022, FlashAttention) computes
/// softmax(S) V one key tile at a time without storing S. Per query row it keeps a running
/// maximum m, a running sum l = sum_j exp(s_j - m) (in double) and an unnormalised accumulator
/// a = sum_j exp(s_j - m) v_j. A new tile with scores s_t and values V_t updates them as
/// \f[ m' = \max(m, \max_t s_t),\quad \alpha = e^{m - m'},\quad
///     l' = \alpha l + \sum_t e^{s_t - m'},\quad a' = \alpha a + e^{s_t - m'} V_t, \f]
/// and at the end O = a / l, lse = m + log l. Each key tile of `bk` keys costs two GEMMs
/// (S = (s Q_b) K_t^T and a += exp(S - m) V_t) and one vectorised exp over the bq x bk tile.
///
/// The row-wise (materialised) counterparts, and the small helpers both files share (the
/// masked-exp convention, the shifts, the row maximum), are in `softmax.hpp`.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "gemm.hpp"
#include "parallel.hpp"
#include "softmax.hpp"
#include "types.hpp"

namespace effattn {
namespace detail {

/// How the Tiled kernel splits one problem. It depends only on the shapes and options, never on
/// the number of threads, which keeps results bit-identical across thread counts.
struct TilePlan {
  Index bq = 0;         ///< query rows per block
  Index bk = 0;         ///< keys per tile
  Index q_blocks = 0;   ///< ceil(n / bq)
  Index kv_splits = 1;  ///< key-range splits per query block (split-KV for few query blocks)
};

/// The tile plan of an n x m problem with key width d, value width dv and `scalar_bytes`-byte
/// scalars; `block_q` / `block_k` > 0 override the automatic tile sizes. O(1).
inline TilePlan plan_tiles(Index n, Index m, Index d, Index dv, Index scalar_bytes, Index block_q,
                           Index block_k) {
  TilePlan p;
  // Automatic tiles: 128 query rows, and as many keys (<= 256) as keep the score tile within
  // Eigen's stack-allocation limit (128 KiB by default), because Eigen packs a GEMM operand of
  // that size on the stack but heap-allocates larger ones on every call (measured: one malloc
  // per tile for double 128 x 256 tiles). Float: 128 x 256, double: 128 x 128; the query block
  // halves for very wide heads so the packed Q tile obeys the same limit. A tile that size sits
  // well inside the L2 cache. The choice was timed with bench_exact (docs/methods/exact.md).
  const Index limit = EIGEN_STACK_ALLOCATION_LIMIT;
  const Index width = std::min<Index>(std::max(d, dv), 256);
  Index bq = 128;
  while (bq > 16 && bq * width * scalar_bytes > limit) bq /= 2;
  const Index bk = std::max<Index>(16, std::min<Index>(256, limit / (bq * scalar_bytes)));
  p.bq = std::min(n, block_q > 0 ? block_q : bq);
  p.bk = std::min(m, block_k > 0 ? block_k : bk);
  p.q_blocks = (n + p.bq - 1) / p.bq;
  // Too few query blocks to keep several cores busy (decode, short prompts against a long
  // cache): also split the key range, then merge the partial softmax states by log-sum-exp.
  constexpr Index kMinTasks = 8;
  if (p.q_blocks < kMinTasks) {
    const Index want = (kMinTasks + p.q_blocks - 1) / p.q_blocks;
    const Index can = std::max<Index>(1, m / (4 * p.bk));  // keep >= 4 tiles per split
    p.kv_splits = std::min(want, can);
  }
  return p;
}

/// Per-thread buffers of the Tiled kernel, allocated once per thread per call:
/// O(bq (d + bk + dv)) scalars.
template <typename Scalar>
struct TileWorkspace {
  using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  Matrix<Scalar> q;    ///< bq x d, scaled query block
  Matrix<Scalar> s;    ///< bq x bk, scores then probabilities
  Matrix<Scalar> acc;  ///< bq x dv, unnormalised output
  Array m, shift, alpha, tile_max, tile_sum;
  Eigen::Array<double, Eigen::Dynamic, 1> l;  ///< running row sums, in double

  TileWorkspace(Index bq, Index bk, Index d, Index dv)
      : q(bq, d),
        s(bq, bk),
        acc(bq, dv),
        m(bq),
        shift(bq),
        alpha(bq),
        tile_max(bq),
        tile_sum(bq),
        l(bq) {}
};

/// Starts an online-softmax pass over rows [0, rows) of ws: running max -inf, row sums 0 (the
/// accumulator, wherever the caller keeps it, is the caller's to zero).
template <typename Scalar>
void begin_rows(TileWorkspace<Scalar>& ws, Index rows) {
  ws.m.head(rows).setConstant(-std::numeric_limits<Scalar>::infinity());
  ws.l.head(rows).setZero();
}

/// Ends an online-softmax pass over rows [0, rows): out = acc / l (rows x dv; `out` may be `acc`
/// itself) and lse = m + log l. The inverse goes through ws.alpha: a broadcast cast expression
/// would be evaluated into a heap temporary once per block. O(rows dv).
template <typename Scalar, typename Acc, typename Out, typename Lse>
void finish_rows(TileWorkspace<Scalar>& ws, Index rows, const Acc& acc, Out&& out, Lse&& lse) {
  ws.alpha.head(rows) = ws.l.head(rows).inverse().template cast<Scalar>();
  if constexpr (std::decay_t<Out>::IsRowMajor && std::decay_t<Acc>::IsRowMajor) {
    for (Index r = 0; r < rows; ++r) out.row(r) = acc.row(r) * ws.alpha(r);  // vectorised rows
  } else {
    for (Index c = 0; c < acc.cols(); ++c)  // column by column: vectorised (see the update)
      out.col(c).array() = acc.col(c).array() * ws.alpha.head(rows);
  }
  lse.array() = ws.m.head(rows) + ws.l.head(rows).log().template cast<Scalar>();
}

/// The online-softmax update of one score tile: ws.s's top-left bq x cols block holds the logits
/// S of bq query rows against `cols` keys. Updates the running max ws.m, the row sums ws.l (in
/// double) and rescales the accumulator ws.acc by alpha = exp(m_old - m_new) (see the file
/// documentation), and leaves P = exp(S - m_new) in the tile, ready for acc += P V_t, which the
/// caller does (its V access varies). `hide(c, column, value)` sets the masked entries of tile
/// column c to `value`; it is called (with -inf before the row max, with 0 after the exp) only
/// when `masked`. Masked entries must end exactly 0: Eigen's vectorised exp clamps its argument,
/// so exp(-inf) would give ~1e-38 (float), which a huge value could still turn into a bias.
/// Rows that have seen no visible key keep m = -inf, l = 0, acc = 0. O(bq (cols + dv)), no
/// allocation.
///
/// `acc` is the accumulator to rescale (bq x dv, any storage order); the overload without it
/// rescales ws.acc.
template <typename Scalar, typename Hide, typename Acc>
void online_softmax_update(Index bq, Index cols, bool masked, Hide&& hide,
                           TileWorkspace<Scalar>& ws, Acc&& acc) {
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
  auto S = ws.s.topLeftCorner(bq, cols);
  auto m = ws.m.head(bq);
  auto shift = ws.shift.head(bq);
  auto alpha = ws.alpha.head(bq);
  auto tmax = ws.tile_max.head(bq);
  auto tsum = ws.tile_sum.head(bq);
  auto l = ws.l.head(bq);
  if (masked)
    for (Index c = 0; c < cols; ++c) hide(c, S.col(c), ninf);
  row_max_into(S, tmax);
  tmax = tmax.max(m);  // new running max
  // Rows that have seen no visible key yet keep max -inf; shift them by 0 to avoid inf - inf.
  shift = neg_inf_to_zero(tmax);
  // Rescale factor of the old state. Where m was -inf it is exp(-inf), ~1e-38 under Eigen's
  // vectorised exp, but the old state is l = 0, acc = 0 there, so it stays exactly 0.
  alpha = (m - shift).exp();
  tsum.setZero();
  for (Index c = 0; c < cols; ++c) {
    S.col(c).array() = (S.col(c).array() - shift).exp();
    // The masked positions are known here, so they are zeroed after the vectorised exp
    // (masked_exp would test every entry and fall back to the scalar exp).
    if (masked) hide(c, S.col(c), Scalar(0));
    tsum += S.col(c).array();
  }
  l = l * alpha.template cast<double>() + tsum.template cast<double>();
  if (!(alpha == Scalar(1)).all()) {
    if constexpr (std::decay_t<Acc>::IsRowMajor) {
      // Row by row: a broadcast column over a row-major block would not vectorise.
      for (Index r = 0; r < bq; ++r) acc.row(r) *= alpha(r);
    } else {
      // Column by column: Eigen 3.4 evaluates the broadcast `acc.array().colwise() *= alpha`
      // with scalar code (measured: ~10% of a bf16 pass at d = 128); same products, same bits.
      for (Index c = 0; c < acc.cols(); ++c) acc.col(c).array() *= alpha;
    }
  }
  m = tmax;
}

/// `online_softmax_update` rescaling the workspace's own accumulator ws.acc.
template <typename Scalar, typename Hide>
void online_softmax_update(Index bq, Index cols, bool masked, Hide&& hide,
                           TileWorkspace<Scalar>& ws) {
  online_softmax_update<Scalar>(bq, cols, masked, std::forward<Hide>(hide), ws, ws.acc.topRows(bq));
}

/// Online-softmax pass of query rows [i0, i0 + bq) over keys [k_begin, k_end) (see the file
/// documentation), with logits scale <q_i, k_j> + bias[j] (`bias` null or m values, -inf masks a
/// key) and, with `causal`, key j hidden from row i when j > i + (m - n). `Kt` is K^T (d x m;
/// a `Matrix` binds without a copy).
/// Leaves the running max in ws.m, the row sums (relative to ws.m) in ws.l and the unnormalised
/// output in ws.acc. Rows that saw no visible key keep m = -inf, l = 0, acc = 0.
/// Cost 2 bq (k_end - k_begin) (d + dv) flops (key tiles past the causal diagonal are skipped);
/// no allocation.
template <typename Scalar>
void online_softmax_block(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& Kt,
                          const ConstRef<Scalar>& V, const Scalar* bias, Scalar scale, bool causal,
                          Index i0, Index bq, Index k_begin, Index k_end, Index bk,
                          TileWorkspace<Scalar>& ws) {
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
  const Index off = Kt.cols() - Q.rows();  // causal: row i sees keys j <= i + off
  // Keys beyond the last row's diagonal are never visible to this block: stop early.
  if (causal) k_end = std::min(k_end, i0 + bq + off);

  auto q = ws.q.topRows(bq);
  auto acc = ws.acc.topRows(bq);
  q.noalias() = Q.middleRows(i0, bq) * scale;
  begin_rows(ws, bq);
  acc.setZero();

  for (Index j0 = k_begin; j0 < k_end; j0 += bk) {
    const Index cols = std::min(bk, k_end - j0);
    auto S = ws.s.topLeftCorner(bq, cols);
    gemm(Update::Assign, S, q, Kt.middleCols(j0, cols));
    if (bias != nullptr)
      for (Index c = 0; c < cols; ++c) S.col(c).array() += bias[j0 + c];
    // Diagonal tile: key j is hidden from local rows r < j - off - i0 (a prefix of the column).
    const bool diagonal = causal && j0 + cols - 1 > i0 + off;
    auto hide = [&](Index c, auto column, Scalar value) {
      if (diagonal)
        column.head(std::max<Index>(0, std::min(bq, j0 + c - off - i0))).setConstant(value);
      if (bias != nullptr && bias[j0 + c] == ninf) column.setConstant(value);
    };
    online_softmax_update<Scalar>(bq, cols, diagonal || bias != nullptr, hide, ws);
    gemm(Update::Add, acc, S, V.middleRows(j0, cols));
  }
}

/// Merges S partial online-softmax states of the same n rows over disjoint key ranges (column s
/// of `part_m` / `part_l` and `part_acc[s]` hold split s's m, l and accumulator) into the final
/// output and log-sum-exp: with M = max_s m_s and w_s = exp(m_s - M),
/// \f[ O = \frac{\sum_s w_s a_s}{\sum_s w_s l_s}, \qquad
///     \mathrm{lse} = M + \log \sum_s w_s l_s. \f]
/// Every row must have seen a key in some split (M finite); a split in which a row saw none has
/// l = 0 and a = 0 and adds nothing. The splits are summed in the fixed order s = 0, 1, ..., so
/// the result does not depend on how the splits were scheduled. O(S n dv).
template <typename Scalar>
void merge_split_states(const Matrix<Scalar>& part_m,
                        const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic>& part_l,
                        const std::vector<Matrix<Scalar>>& part_acc, Matrix<Scalar>& out,
                        Vector<Scalar>& lse) {
  const Index n = part_m.rows(), splits = part_m.cols();
  const Vector<Scalar> mx = part_m.rowwise().maxCoeff();  // finite: every row sees a key
  Eigen::Array<double, Eigen::Dynamic, 1> total = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
  out.setZero();
  for (Index s = 0; s < splits; ++s) {
    // A row that saw no key in split s has m = -inf: its weight is exp(-inf), which Eigen's
    // vectorised exp returns as ~1e-38 rather than 0, but it multiplies l = 0 and acc = 0.
    const Eigen::Array<Scalar, Eigen::Dynamic, 1> w = (part_m.col(s) - mx).array().exp();
    total += part_l.col(s).array() * w.template cast<double>();
    out.array() += part_acc[static_cast<std::size_t>(s)].array().colwise() * w;
  }
  out.array().colwise() /= total.template cast<Scalar>();
  lse.array() = mx.array() + total.log().template cast<Scalar>();
}

/// The Tiled kernel: out (n x dv) = softmax(scale Q K^T + 1 bias^T [+ causal mask]) V and lse (n)
/// for the whole problem, split as `plan` says. Query blocks (times key splits) run in parallel;
/// every row must see at least one visible key. 4 n m d flops for d = dv (about half with
/// `causal`), O(m d) for K^T, O(threads bq (d + bk + dv)) workspace, plus O(kv_splits n dv) for
/// the partial accumulators when the key range is split.
template <typename Scalar>
void tiled_attention(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                     const ConstRef<Scalar>& V, const Scalar* bias, Scalar scale, bool causal,
                     const TilePlan& plan, Matrix<Scalar>& out, Vector<Scalar>& lse) {
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  const Index off = m - n;
  out.resize(n, dv);
  lse.resize(n);
  const Index bq = plan.bq, bk = plan.bk, splits = plan.kv_splits;
  auto make_ws = [&] { return TileWorkspace<Scalar>(bq, bk, d, dv); };
  // K^T (d x m) once per call, O(m d): every key tile K_t^T is then a contiguous column block,
  // which Eigen packs with unit-stride reads (packing K_t^T from the column-major K strided by m
  // cost ~8% of the run time at n = m = 4096, d = 64).
  const Matrix<Scalar> Kt_data = K.transpose();
  const ConstRef<Scalar> Kt(Kt_data);

  if (splits == 1) {
    parallel_for(plan.q_blocks, make_ws, [&](Index b, TileWorkspace<Scalar>& ws) {
      const Index i0 = b * bq, rows = std::min(bq, n - i0);
      online_softmax_block<Scalar>(Q, Kt, V, bias, scale, causal, i0, rows, 0, m, bk, ws);
      finish_rows(ws, rows, ws.acc.topRows(rows), out.middleRows(i0, rows), lse.segment(i0, rows));
    });
    return;
  }

  // Split-KV: task (b, s) handles query block b against key range s; partial states are merged
  // afterwards in a fixed order (s = 0, 1, ...), so the result does not depend on scheduling.
  Matrix<Scalar> part_m(n, splits);
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> part_l(n, splits);
  std::vector<Matrix<Scalar>> part_acc(static_cast<std::size_t>(splits), Matrix<Scalar>(n, dv));
  parallel_for(plan.q_blocks * splits, make_ws, [&](Index t, TileWorkspace<Scalar>& ws) {
    const Index b = t / splits, s = t % splits;
    const Index i0 = b * bq, rows = std::min(bq, n - i0);
    const Index visible = causal ? std::min(m, i0 + rows + off) : m;
    const Index k0 = visible * s / splits, k1 = visible * (s + 1) / splits;
    online_softmax_block<Scalar>(Q, Kt, V, bias, scale, causal, i0, rows, k0, k1, bk, ws);
    part_m.col(s).segment(i0, rows) = ws.m.head(rows).matrix();
    part_l.col(s).segment(i0, rows) = ws.l.head(rows).matrix();
    part_acc[static_cast<std::size_t>(s)].middleRows(i0, rows) = ws.acc.topRows(rows);
  });
  merge_split_states(part_m, part_l, part_acc, out, lse);
}

}  // namespace detail
}  // namespace effattn
