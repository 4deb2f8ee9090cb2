/// \file eva_impl.hpp
/// \brief Internal: the plan, the chunk statistics and the per-block kernel of `EvaAttention`.
/// Include `<effattn/eva.hpp>` instead; this header is not for users.
///
/// Notation (see eva.hpp): s is the logit scale and every key and query is pre-scaled,
/// k~ = sqrt(s) k, q~ = sqrt(s) q, so q~ . k~ = s q . k. K is the block ("window") size, L the
/// chunk size, C = ceil(m / L) the number of chunks, S the samples per chunk. Query i sits at key
/// position p_i = clamp(i + m - n, 0, m - 1) (bottom-right aligned as in ExactAttention).
///
/// Two chunk levels exist. Level 0 ("coarse") is the global chunking [cL, (c+1)L). Level 1
/// ("fine") is used only when L > K (then L % K == 0): it holds one chunk per block, and stands in
/// for the part of the query's own coarse chunk that lies outside its block, which keeps the
/// partition disjoint (the spec fixes K % L == 0; the fine level is our extension so that a
/// fixed chunk *count* -- the linear-cost regime -- still has the exactness limits).
#pragma once

#ifndef EFFATTN_EVA_INTERNAL
#error "effattn/detail/eva_impl.hpp is internal: include <effattn/eva.hpp>"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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
template <typename Map>
void apply_summary_map(const Map& map, const Eigen::VectorXd& x, Eigen::VectorXd& y) {
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
template <typename Scalar, typename Opts>
struct EvaChunkContext {
  const EvaPlan* plan;
  const Opts* opts;
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
template <typename Scalar, typename Opts>
void eva_chunk_stats(const EvaChunkContext<Scalar, Opts>& ctx, int level, Index c, Index k0,
                     Index k1, EvaLevel<Scalar>& lv, EvaChunkWorkspace<Scalar>& ws) {
  const EvaPlan& p = *ctx.plan;
  const Opts& o = *ctx.opts;
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
    online_softmax_block<Scalar>(W, *ctx.Kt, *ctx.V, ctx.negnk->data(), Scalar(1), false, s0, rows, k0,
                              k1, ctx.bk, ws.ex);
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

/// A contiguous range of softmax columns: the local keys (level -1) or chunks of a level.
struct EvaSegment {
  int level = -1;
  Index start = 0;  ///< first key (local) or first chunk
  Index len = 0;
  Index col = 0;  ///< first column in the score workspace
  /// Per-row causal mask: column j hides the query rows whose position is below
  /// mask_base + j * mask_step (see eva_hidden_rows).
  bool masked = false;
  Index mask_base = 0;
  Index mask_step = 0;
};

/// Per-thread buffers of the query stage.
template <typename Scalar>
struct EvaBlockWorkspace {
  using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  Matrix<Scalar> q, q2, s, t, acc;
  Array mx, colw;
  Eigen::Array<double, Eigen::Dynamic, 1> sum, zsum;
  EvaBlockWorkspace(Index rows, Index d, Index dv, Index cols, Index tcols, bool gauss)
      : q(rows, d),
        q2(gauss ? rows : 0, gauss ? d : 0),
        s(rows, cols),
        t(rows, tcols),
        acc(rows, dv),
        mx(rows),
        colw(rows),
        sum(rows),
        zsum(rows) {}
};

/// Rows of a masked column that are hidden: column j of segment g hides rows r with
/// i0 + r + off < g.mask_base + j * g.mask_step, i.e. the first clamp(...) rows.
inline Index eva_hidden_rows(const EvaSegment& g, Index j, Index i0, Index off, Index rows) {
  return std::min(rows, std::max<Index>(0, g.mask_base + j * g.mask_step - off - i0));
}

/// The softmax columns a task sees (local keys and chunk ranges); returns the segment count.
inline int eva_task_segments(const EvaPlan& p, const EvaTask& t, EvaSegment* segs) {
  int ns = 0;
  Index col = 0;
  auto add = [&](int level, Index start, Index end) {
    if (end <= start) return;
    EvaSegment g;
    g.level = level;
    g.start = start;
    g.len = end - start;
    g.col = col;
    col += g.len;
    segs[ns++] = g;
  };
  const Index plast = p.pos(t.row0 + t.rows - 1);
  if (p.window == 0) {
    add(0, 0, p.chunks);
    return ns;
  }
  const Index K = p.window, L = p.chunk;
  const Index bs = t.block * K, be = std::min(bs + K, p.m);
  // Local keys: the whole block, or up to the last row's position when causal (then row r sees
  // keys <= p_r: column j = key bs + j hides rows with p_r < bs + j).
  add(-1, bs, p.causal ? plast + 1 : be);
  if (p.causal) {
    segs[ns - 1].masked = true;
    segs[ns - 1].mask_base = bs;
    segs[ns - 1].mask_step = 1;
  }
  if (p.overlap) {
    if (!p.causal) {
      add(0, 0, p.chunks);
    } else {
      // Official causal rule: row r sees the chunks before its own chunk floor(p_r / L), so
      // chunk c hides rows with p_r < (c + 1) L.
      add(0, 0, plast / L);
      if (ns > 0 && segs[ns - 1].level == 0) {
        segs[ns - 1].masked = true;
        segs[ns - 1].mask_base = L;
        segs[ns - 1].mask_step = L;
      }
    }
    return ns;
  }
  if (!p.fine) {
    // K % L == 0 (or one block): the chunks inside the block are E itself; skip them.
    const Index cin0 = bs / L, cin1 = (be + L - 1) / L;
    add(0, 0, cin0);
    if (!p.causal) add(0, cin1, p.chunks);
  } else {
    // L % K == 0: the block lies inside coarse chunk h; the rest of h enters as its blocks.
    const Index h = bs / L, per = L / K;
    const Index fb0 = h * per, fb1 = std::min(fb0 + per, p.blocks);
    add(0, 0, h);
    if (!p.causal) add(0, h + 1, p.chunks);
    add(1, fb0, t.block);
    if (!p.causal) add(1, t.block + 1, fb1);
  }
  return ns;
}

/// Row max / exp / double row sums over the first `cols` columns of ws.s; masked entries are
/// set to exactly 0 (Eigen's vectorised exp clamps -inf to ~1e-38, see core/softmax.hpp).
template <typename Scalar>
void eva_joint_softmax(const EvaPlan& p, const EvaTask& t, const EvaSegment* segs, int ns,
                       Index cols, EvaBlockWorkspace<Scalar>& ws) {
  const Index R = t.rows;
  auto Sm = ws.s.topLeftCorner(R, cols);
  auto mx = ws.mx.head(R);
  auto sum = ws.sum.head(R);
  mx = Sm.col(0).array();
  for (Index c = 1; c < cols; ++c) mx = mx.max(Sm.col(c).array());
  // Every row has a visible entry (its own key, or a chunk), so mx is finite unless the logits
  // overflowed, which then shows up as a non-finite output (Info::NumericalIssue).
  sum.setZero();
  for (Index c = 0; c < cols; ++c) Sm.col(c).array() = (Sm.col(c).array() - mx).exp();
  for (int g = 0; g < ns; ++g) {
    if (!segs[g].masked) continue;
    for (Index j = 0; j < segs[g].len; ++j)
      Sm.col(segs[g].col + j).head(eva_hidden_rows(segs[g], j, t.row0, p.off, R)).setZero();
  }
  for (Index c = 0; c < cols; ++c) sum += Sm.col(c).array().template cast<double>();
}

/// The query stage for one task: joint softmax over [local logits | chunk logits], output rows.
template <typename Scalar>
void eva_block(const EvaPlan& p, const EvaTask& t, const ConstRef<Scalar>& Q,
               const Matrix<Scalar>& Kt, const ConstRef<Scalar>& V, const EvaLevel<Scalar>* lv,
               Scalar rs, EvaBlockWorkspace<Scalar>& ws, Matrix<Scalar>& out) {
  const Index R = t.rows, S = p.samples, G = p.gemm_cols;
  auto q = ws.q.topRows(R);
  q.noalias() = Q.middleRows(t.row0, R) * rs;
  if (p.gauss) ws.q2.topRows(R) = q.array().square().matrix();
  EvaSegment segs[6];
  const int ns = eva_task_segments(p, t, segs);
  const Index cols = ns > 0 ? segs[ns - 1].col + segs[ns - 1].len : 0;
  EFFATTN_ASSERT(cols > 0 && cols <= p.max_cols);

  // Logits. Every GEMM is split into column slices of at most G (see EvaPlan::gemm_cols).
  for (int g = 0; g < ns; ++g) {
    const EvaSegment& sg = segs[g];
    for (Index j0 = 0; j0 < sg.len; j0 += G) {
      const Index w = std::min(G, sg.len - j0);
      auto Sb = ws.s.block(0, sg.col + j0, R, w);
      if (sg.level < 0) {
        Sb.noalias() = q * Kt.middleCols(sg.start + j0, w);
      } else {
        const EvaLevel<Scalar>& L = lv[sg.level];
        Sb.noalias() = q * L.repT.middleCols(sg.start + j0, w);
        if (p.gauss) Sb.noalias() += ws.q2.topRows(R) * L.halfvarT.middleCols(sg.start + j0, w);
        Sb.rowwise() += L.bias.segment(sg.start + j0, w);
      }
    }
    if (sg.masked) {
      for (Index j = 0; j < sg.len; ++j)
        ws.s.col(sg.col + j)
            .head(eva_hidden_rows(sg, j, t.row0, p.off, R))
            .setConstant(-std::numeric_limits<Scalar>::infinity());
    }
  }
  eva_joint_softmax(p, t, segs, ns, cols, ws);

  // Output: acc = A_loc V_E + sum_c A_c beta_c (unnormalised), then divide by the row sums.
  auto acc = ws.acc.topRows(R);
  acc.setZero();
  for (int g = 0; g < ns; ++g) {
    const EvaSegment& sg = segs[g];
    if (sg.level < 0) {
      for (Index j0 = 0; j0 < sg.len; j0 += G) {
        const Index w = std::min(G, sg.len - j0);
        acc.noalias() += ws.s.block(0, sg.col + j0, R, w) * V.middleRows(sg.start + j0, w);
      }
      continue;
    }
    const EvaLevel<Scalar>& L = lv[sg.level];
    if (S == 1) {
      for (Index j0 = 0; j0 < sg.len; j0 += G) {
        const Index w = std::min(G, sg.len - j0);
        acc.noalias() += ws.s.block(0, sg.col + j0, R, w) * L.values.middleRows(sg.start + j0, w);
      }
      continue;
    }
    // S > 1: beta_{n,c} = sum_s pi_{n,c,s} b_{c,s} with pi = softmax_s(w_{c,s} . (q~_n - mu_c)
    // + a_{c,s}). Chunks are processed in groups of about G / S; P = [A_c pi_c]_c then multiplies
    // the stacked b_{c,s}. Both GEMMs are split into slices of at most G columns / depth.
    const Index group = std::max<Index>(1, G / S);
    for (Index j0 = 0; j0 < sg.len; j0 += group) {
      const Index cnt = std::min(group, sg.len - j0), c0 = sg.start + j0, width = cnt * S;
      auto T = ws.t.topLeftCorner(R, width);
      for (Index x = 0; x < width; x += G) {
        const Index w = std::min(G, width - x);
        T.middleCols(x, w).noalias() = q * L.omegaT.middleCols(c0 * S + x, w);
      }
      T.rowwise() += L.pconst.segment(c0 * S, width);
      for (Index j = 0; j < cnt; ++j) {
        auto Tj = T.middleCols(j * S, S);
        auto mx = ws.mx.head(R);
        auto z = ws.zsum.head(R);
        mx = Tj.col(0).array();
        for (Index s = 1; s < S; ++s) mx = mx.max(Tj.col(s).array());
        z.setZero();
        for (Index s = 0; s < S; ++s) {
          Tj.col(s).array() = (Tj.col(s).array() - mx).exp();
          z += Tj.col(s).array().template cast<double>();
        }
        ws.colw.head(R) =
            ws.s.col(sg.col + j0 + j).head(R).array() * z.inverse().template cast<Scalar>();
        for (Index s = 0; s < S; ++s) Tj.col(s).array() *= ws.colw.head(R);
      }
      for (Index x = 0; x < width; x += G) {
        const Index w = std::min(G, width - x);
        acc.noalias() += T.middleCols(x, w) * L.values.middleRows(c0 * S + x, w);
      }
    }
  }
  ws.colw.head(R) = ws.sum.head(R).inverse().template cast<Scalar>();
  out.middleRows(t.row0, R).array() = acc.array().colwise() * ws.colw.head(R);
}

}  // namespace detail
}  // namespace effattn
