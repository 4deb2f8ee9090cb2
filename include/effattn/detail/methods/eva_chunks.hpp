/// \file eva_chunks.hpp
/// \brief Internal: the plan of `EvaAttention` (its query-stage tasks and chunk levels) and the
/// chunk statistics stage: per-level summaries (`EvaLevel`), the summary maps, and
/// `eva_chunk_stats`, which samples each chunk and forms its summary key, value and bias. The
/// notation is that of `eva_impl.hpp`. Include `<effattn/eva.hpp>` instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/gemm.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../eva.hpp"

namespace effattn {
namespace detail {

/// One unit of work of the query stage: `rows` query rows from `row0`, all in block `block`
/// (-1 when there is no local window).
struct EvaTask {
  Index block = -1;
  Index row0 = 0;
  Index rows = 0;
};

/// How one problem is split. Depends only on shapes and options (never on the thread count).
struct EvaPlan {
  Index n = 0, m = 0, d = 0, dv = 0;
  Index window = 0;      ///< K (0 = no exact local keys)
  Index chunk = 1;       ///< L
  Index chunks = 0;      ///< C = ceil(m / L)
  Index blocks = 0;      ///< ceil(m / K), 0 when K = 0
  bool fine = false;     ///< level 1 in use (disjoint, K > 0, L > K)
  bool overlap = false;  ///< Partition::Overlapping
  bool causal = false;
  bool cross_all = false;  ///< query means over all queries (non-causal, n != m)
  bool random = false;     ///< samples drawn (false: w = mu)
  bool gauss = false;      ///< Mass::GaussianDiag
  Index samples = 1;       ///< S (1 in deterministic mode)
  Index off = 0;           ///< m - n
  Index tile = 0;          ///< most query rows per task
  Index max_cols = 0;      ///< widest joint softmax of any task
  Index max_logits = 0;    ///< most logits of any query: |E_n| + S x (visible chunks)
  Index gemm_cols = 0;     ///< column split of every GEMM (keeps Eigen's packing on the stack)
  std::vector<EvaTask> tasks;

  Index pos(Index i) const { return std::min(m - 1, std::max<Index>(0, i + off)); }
  /// First query row whose position is >= key position t (rows are sorted by position).
  Index first_row_at(Index t) const {
    return t <= 0 ? 0 : std::min(n, std::max<Index>(0, t - off));
  }
  /// Query rows whose positions lie in the key range [k0, k1), or all of them (cross_all).
  void query_rows(Index k0, Index k1, Index& r0, Index& r1) const {
    if (cross_all) {
      r0 = 0;
      r1 = n;
      return;
    }
    r0 = first_row_at(k0);
    r1 = k1 >= m ? n : first_row_at(k1);
  }
};

/// Smallest divisor of k that is >= target (k itself if none is smaller).
inline Index smallest_divisor_at_least(Index k, Index target) {
  for (Index l = std::max<Index>(1, target); l < k; ++l)
    if (k % l == 0) return l;
  return k;
}

/// Chunk statistics of one level, laid out for the query-stage GEMMs.
template <typename Scalar>
struct EvaLevel {
  Index count = 0;           ///< chunks in this level
  Index size = 0;            ///< nominal chunk length (the last one may be shorter)
  Matrix<Scalar> repT;       ///< d x count: representatives k^_c (scaled coordinates)
  Matrix<Scalar> halfvarT;   ///< d x count: var_c / 2 (GaussianDiag only)
  RowVector<Scalar> bias;    ///< count: u_c, the constant part of the chunk logit
  Matrix<Scalar> mu;         ///< d x count: proposal means
  Matrix<Scalar> omegaT;     ///< d x (count S): samples w_{c,s}, column c S + s
  Vector<Scalar> lse;        ///< count S: a_{c,s} = log sum_{P_c} xi(k~, w_{c,s})
  RowVector<Scalar> pconst;  ///< count S: a_{c,s} - w_{c,s} . mu_c (the pi logit offset)
  Matrix<Scalar> values;     ///< (count S) x dv: b_{c,s}

  void resize(Index cnt, Index sz, Index d, Index dv, Index S, bool gauss) {
    count = cnt;
    size = sz;
    repT.resize(d, cnt);
    if (gauss) halfvarT.resize(d, cnt);
    bias.resize(cnt);
    mu.resize(d, cnt);
    omegaT.resize(d, cnt * S);
    lse.resize(cnt * S);
    pconst.resize(cnt * S);
    values.resize(cnt * S, dv);
  }
};

/// A learned chunk-summary map y = LN(W x + b), evaluated in double (W empty: identity).
template <typename = void>  // instantiated where used (compile cost)
inline void apply_summary_map(const eva::SummaryMap& map, const Eigen::VectorXd& x,
                              Eigen::VectorXd& y) {
  if (map.weight.size() > 0) {
    y.noalias() = map.weight * x;
  } else {
    y = x;
  }
  if (map.bias.size() > 0) y += map.bias;
  if (map.layer_norm) {
    const double mean = y.mean();
    const double var = (y.array() - mean).square().mean();
    y = ((y.array() - mean) / std::sqrt(var + map.ln_eps)).matrix();
    if (map.ln_gamma.size() > 0) y.array() *= map.ln_gamma.array();
    if (map.ln_beta.size() > 0) y += map.ln_beta;
  }
}

/// Per-thread buffers of the chunk stage.
template <typename Scalar>
struct EvaChunkWorkspace {
  TileWorkspace<Scalar> ex;
  Matrix<Scalar> w;  ///< S x d samples of one chunk
  Eigen::VectorXd kbar, qbar, khat, qhat, mu, var;
  Eigen::MatrixXd eps;  ///< d x S standard normals
  EvaChunkWorkspace(Index bq, Index bk, Index d, Index dv, Index S)
      : ex(bq, bk, d, dv), w(S, d), kbar(d), qbar(d), khat(d), qhat(d), mu(d), var(d), eps(d, S) {}
};

/// Everything the chunk stage needs besides the inputs.
template <typename Scalar>
struct EvaChunkContext {
  const EvaPlan* plan;
  const EvaOptions* opts;
  const ConstRef<Scalar>* Q;
  const ConstRef<Scalar>* K;
  const ConstRef<Scalar>* V;
  const Matrix<Scalar>* Kt;     ///< d x m scaled keys
  const Vector<Scalar>* negnk;  ///< m values -||k~||^2 / 2
  double scale;                 ///< s
  Index bq, bk;                 ///< tiles of online_softmax_block
};

/// Statistics of chunk `c` of `level` (keys [k0, k1)), written into column/rows c of `lv`.
/// Random stream: 2c for level 0, 2c + 1 for level 1 (documented at EvaAttention).
template <typename Scalar>
void eva_chunk_stats(const EvaChunkContext<Scalar>& ctx, int level, Index c, Index k0, Index k1,
                     EvaLevel<Scalar>& lv, EvaChunkWorkspace<Scalar>& ws) {
  const EvaPlan& p = *ctx.plan;
  const EvaOptions& o = *ctx.opts;
  const Index S = p.samples, len = k1 - k0;
  const double rs = std::sqrt(ctx.scale);
  // Means in the input coordinates, accumulated in double.
  ws.kbar = ctx.K->middleRows(k0, len).template cast<double>().colwise().sum().transpose() /
            static_cast<double>(len);
  Index r0 = 0, r1 = 0;
  p.query_rows(k0, k1, r0, r1);
  if (r1 > r0) {
    ws.qbar = ctx.Q->middleRows(r0, r1 - r0).template cast<double>().colwise().sum().transpose() /
              static_cast<double>(r1 - r0);
  } else {
    ws.qbar.setZero();  // no query sits in this chunk (decoding against a cache): qbar := 0
  }
  apply_summary_map(o.key_map, ws.kbar, ws.khat);
  apply_summary_map(o.query_map, ws.qbar, ws.qhat);
  ws.khat *= rs;
  ws.qhat *= rs;
  lv.repT.col(c) = ws.khat.template cast<Scalar>();
  if (p.gauss) {
    ws.var.setZero();
    for (Index j = k0; j < k1; ++j)
      ws.var.array() +=
          (ctx.K->row(j).transpose().template cast<double>() - ws.kbar).array().square();
    lv.halfvarT.col(c) =
        (ws.var * (0.5 * ctx.scale / static_cast<double>(len))).template cast<Scalar>();
  }
  lv.bias(c) = o.mass == eva::Mass::Literal
                   ? Scalar(0)
                   : static_cast<Scalar>(std::log(static_cast<double>(len)));
  switch (o.proposal) {
    case eva::Proposal::SumMeans:
      ws.mu = ws.qhat + ws.khat;
      break;
    case eva::Proposal::HalfSum:
      ws.mu = 0.5 * (ws.qhat + ws.khat);
      break;
    case eva::Proposal::QueryMean:
      ws.mu = ws.qhat;
      break;
    case eva::Proposal::Zero:
      ws.mu.setZero();
      break;
  }
  lv.mu.col(c) = ws.mu.template cast<Scalar>();
  if (p.random) {
    Rng rng = make_rng(o.seed, 2 * static_cast<std::uint64_t>(c) + (level == 0 ? 0U : 1U));
    fill_normal(ws.eps, rng);
    for (Index s = 0; s < S; ++s)
      ws.w.row(s) = (ws.mu + ws.eps.col(s)).transpose().template cast<Scalar>();
  } else {
    ws.w.row(0) = ws.mu.transpose().template cast<Scalar>();
  }
  // a_s = log sum_m exp(w_s . k~_m - ||k~_m||^2 / 2) and b_s = the matching softmax mean of V:
  // exact attention of the "queries" w_s over the chunk's keys with key bias -||k~||^2 / 2.
  const ConstRef<Scalar> W(ws.w);
  for (Index s0 = 0; s0 < S; s0 += ctx.bq) {
    const Index rows = std::min(ctx.bq, S - s0);
    online_softmax_block<Scalar>(W, *ctx.Kt, *ctx.V, ctx.negnk->data(), Scalar(1), false, s0, rows,
                                 k0, k1, ctx.bk, ws.ex);
    for (Index r = 0; r < rows; ++r) {
      const Index s = s0 + r, col = c * S + s;
      const double l = ws.ex.l(r);
      const double a = static_cast<double>(ws.ex.m(r)) + std::log(l);
      lv.lse(col) = static_cast<Scalar>(a);
      lv.values.row(col) = ws.ex.acc.row(r) * static_cast<Scalar>(1.0 / l);
      lv.omegaT.col(col) = ws.w.row(s).transpose();
      lv.pconst(col) =
          static_cast<Scalar>(a - ws.w.row(s).template cast<double>().dot(ws.mu.transpose()));
    }
  }
}

}  // namespace detail
}  // namespace effattn
