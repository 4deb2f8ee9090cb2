/// \file online_softmax.hpp
/// \brief The tiled online-softmax kernel shared by exact attention (`policy::Tiled`) and EVA's
/// chunk statistics: tile planning, per-thread workspaces, one query block streamed over a key
/// range, and the whole-problem driver with split-KV log-sum-exp merging.
///
/// One query block of `bq` rows keeps a running row maximum m, running row sums l (in double)
/// and an unnormalised accumulator; each key tile of `bk` keys costs two GEMMs
/// (S = (s Q_b) K_t^T and acc += exp(S - m) V_t) and one vectorised exp, with the old state
/// rescaled by exp(m_old - m_new) (Milakov and Gimelshein 2018; Dao et al. 2022).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.hpp"
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

inline TilePlan plan_tiles(Index n, Index m, Index d, Index dv, Index scalar_bytes, Index block_q,
                           Index block_k) {
  TilePlan p;
  // Automatic tiles: 128 query rows, and as many keys (<= 256) as keep the score tile within
  // Eigen's stack-allocation limit (128 KiB by default), because Eigen packs a GEMM operand of
  // that size on the stack but heap-allocates larger ones on every call (measured: one malloc
  // per tile for double 128 x 256 tiles). Float: 128 x 256, double: 128 x 128; the query block
  // halves for very wide heads so the packed Q tile obeys the same limit. A tile that size sits
  // well inside the L2 cache. The choice was timed with bench_exact (the README, "Exact
  // attention").
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

/// Per-thread buffers of the Tiled kernel, allocated once per thread per call.
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

/// Online-softmax pass of query rows [i0, i0 + bq) over keys [k_begin, k_end). Leaves the
/// running max in ws.m, the row sums (relative to ws.m) in ws.l and the unnormalised output in
/// ws.acc. Rows that saw no visible key keep m = -inf, l = 0, acc = 0.
template <typename Scalar>
void online_softmax_block(const ConstRef<Scalar>& Q, const Matrix<Scalar>& Kt,
                          const ConstRef<Scalar>& V, const Scalar* bias, Scalar scale, bool causal,
                          Index i0, Index bq, Index k_begin, Index k_end, Index bk,
                          TileWorkspace<Scalar>& ws) {
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
  const Index off = Kt.cols() - Q.rows();  // causal: row i sees keys j <= i + off
  // Keys beyond the last row's diagonal are never visible to this block: stop early.
  if (causal) k_end = std::min(k_end, i0 + bq + off);

  auto q = ws.q.topRows(bq);
  auto acc = ws.acc.topRows(bq);
  auto m = ws.m.head(bq);
  auto shift = ws.shift.head(bq);
  auto alpha = ws.alpha.head(bq);
  auto tmax = ws.tile_max.head(bq);
  auto tsum = ws.tile_sum.head(bq);
  auto l = ws.l.head(bq);
  q.noalias() = Q.middleRows(i0, bq) * scale;
  m.setConstant(ninf);
  l.setZero();
  acc.setZero();

  for (Index j0 = k_begin; j0 < k_end; j0 += bk) {
    const Index cols = std::min(bk, k_end - j0);
    auto S = ws.s.topLeftCorner(bq, cols);
    S.noalias() = q * Kt.middleCols(j0, cols);
    if (bias != nullptr)
      for (Index c = 0; c < cols; ++c) S.col(c).array() += bias[j0 + c];
    // Diagonal tile: key j is hidden from local rows r < j - off - i0 (a prefix of the column).
    const bool diagonal = causal && j0 + cols - 1 > i0 + off;
    auto hidden_rows = [&](Index c) { return std::max<Index>(0, std::min(bq, j0 + c - off - i0)); };
    if (diagonal)
      for (Index c = 0; c < cols; ++c) S.col(c).head(hidden_rows(c)).setConstant(ninf);
    tmax = S.col(0).array();
    for (Index c = 1; c < cols; ++c) tmax = tmax.max(S.col(c).array());
    tmax = tmax.max(m);  // new running max
    // Rows that have seen no visible key yet keep max -inf; shift them by 0 to avoid inf - inf.
    shift = (tmax == ninf).select(Scalar(0), tmax);
    alpha = (m - shift).exp();  // rescale factor of the old state (0 when m was -inf)
    tsum.setZero();
    for (Index c = 0; c < cols; ++c) {
      S.col(c).array() = (S.col(c).array() - shift).exp();
      // Masked entries must be exactly 0: Eigen's vectorised exp clamps its argument, so
      // exp(-inf) would give ~1e-38 (float), which a huge value could still turn into a bias.
      if (diagonal) S.col(c).head(hidden_rows(c)).setZero();
      if (bias != nullptr && bias[j0 + c] == ninf) S.col(c).setZero();
      tsum += S.col(c).array();
    }
    l = l * alpha.template cast<double>() + tsum.template cast<double>();
    if (!(alpha == Scalar(1)).all()) acc.array().colwise() *= alpha;
    acc.noalias() += S * V.middleRows(j0, cols);
    m = tmax;
  }
}

/// The Tiled kernel: out (n x dv) and lse (n) for the whole problem.
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
  const Matrix<Scalar> Kt = K.transpose();

  if (splits == 1) {
    parallel_for(plan.q_blocks, make_ws, [&](Index b, TileWorkspace<Scalar>& ws) {
      const Index i0 = b * bq, rows = std::min(bq, n - i0);
      online_softmax_block<Scalar>(Q, Kt, V, bias, scale, causal, i0, rows, 0, m, bk, ws);
      // Normalise through a workspace vector: a broadcast cast expression would be evaluated
      // into a heap temporary once per block.
      ws.alpha.head(rows) = ws.l.head(rows).inverse().template cast<Scalar>();
      out.middleRows(i0, rows).array() =
          ws.acc.topRows(rows).array().colwise() * ws.alpha.head(rows);
      lse.segment(i0, rows).array() =
          ws.m.head(rows) + ws.l.head(rows).log().template cast<Scalar>();
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
  const Vector<Scalar> mx = part_m.rowwise().maxCoeff();  // finite: every row sees a key
  Eigen::Array<double, Eigen::Dynamic, 1> total = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
  out.setZero();
  for (Index s = 0; s < splits; ++s) {
    // Splits in which a row saw no key have m = -inf and contribute exp(-inf) = 0.
    const Eigen::Array<Scalar, Eigen::Dynamic, 1> w = (part_m.col(s) - mx).array().exp();
    total += part_l.col(s).array() * w.template cast<double>();
    out.array() += part_acc[static_cast<std::size_t>(s)].array().colwise() * w;
  }
  out.array().colwise() /= total.template cast<Scalar>();
  lse.array() = mx.array() + total.log().template cast<Scalar>();
}

}  // namespace detail
}  // namespace effattn
