/// \file eva_impl.hpp
/// \brief Internal: the per-block kernel of `EvaAttention` (shared with `PerformerAttention`) and
/// the out-of-class definitions of both functors' members; the plan and the chunk statistics are
/// in `eva_chunks.hpp`. Include `<effattn/eva.hpp>` instead; this header is not for users.
///
/// Notation (see eva.hpp): s is the logit scale and every key and query is pre-scaled,
/// k~ = sqrt(s) k, q~ = sqrt(s) q, so q~ . k~ = s q . k. K is the block ("window") size, L the
/// chunk size, C = ceil(m / L) the number of chunks, S the samples per chunk. Query i sits at key
/// position p_i = clamp(i + m - n, 0, m - 1) (bottom-right aligned as in ExactAttention).
///
/// Two chunk levels exist. Level 0 ("coarse") is the global chunking [cL, (c+1)L). Level 1
/// ("fine") is used only when L > K (then L % K == 0): it holds one chunk per block, and stands in
/// for the part of the query's own coarse chunk that lies outside its block, which keeps the
/// partition disjoint (the paper only treats K % L == 0; the fine level is our extension so that
/// a fixed chunk *count* -- the linear-cost regime -- still has the exactness limits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../eva.hpp"
#include "../../gradients.hpp"
#include "eva_chunks.hpp"

namespace effattn {
namespace detail {

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
        gemm(Update::Assign, Sb, q, Kt.middleCols(sg.start + j0, w));
      } else {
        const EvaLevel<Scalar>& L = lv[sg.level];
        gemm(Update::Assign, Sb, q, L.repT.middleCols(sg.start + j0, w));
        if (p.gauss)
          gemm(Update::Add, Sb, ws.q2.topRows(R), L.halfvarT.middleCols(sg.start + j0, w));
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
        gemm(Update::Add, acc, ws.s.block(0, sg.col + j0, R, w), V.middleRows(sg.start + j0, w));
      }
      continue;
    }
    const EvaLevel<Scalar>& L = lv[sg.level];
    if (S == 1) {
      for (Index j0 = 0; j0 < sg.len; j0 += G) {
        const Index w = std::min(G, sg.len - j0);
        gemm(Update::Add, acc, ws.s.block(0, sg.col + j0, R, w),
             L.values.middleRows(sg.start + j0, w));
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
        gemm(Update::Assign, T.middleCols(x, w), q, L.omegaT.middleCols(c0 * S + x, w));
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
        gemm(Update::Add, acc, T.middleCols(x, w), L.values.middleRows(c0 * S + x, w));
      }
    }
  }
  ws.colw.head(R) = ws.sum.head(R).inverse().template cast<Scalar>();
  out.middleRows(t.row0, R).array() = acc.array().colwise() * ws.colw.head(R);
}

/// The plan of one problem: n queries over m keys (d, dv columns) with the options `o`.
/// `one_chunk`: a single level-0 chunk holding every key (the Performer preset), whatever
/// `o.chunk_size` says. `scalar_bytes` is sizeof(Scalar) (it sets the GEMM column split).
inline EvaPlan eva_make_plan(const EvaOptions& o, bool one_chunk, Index n, Index m, Index d,
                             Index dv, Index scalar_bytes) {
  EvaPlan p;
  p.n = n;
  p.m = m;
  p.d = d;
  p.dv = dv;
  p.off = m - n;
  p.causal = o.causal;
  p.overlap = o.partition == eva::Partition::Overlapping;
  p.gauss = o.mass == eva::Mass::GaussianDiag;
  p.random = o.samples > 0;
  p.samples = std::max<Index>(1, o.samples);
  p.cross_all = !p.causal && n != m;
  const Index K = o.window;
  p.window = K;
  if (one_chunk) {
    p.chunk = m;
  } else if (o.chunk_size > 0) {
    p.chunk = o.chunk_size;
  } else {
    // About 64 chunks (the paper's C = 64 for language; C = 49 for images), compatible with K.
    const Index target = std::max<Index>(1, (m + 63) / 64);
    if (K == 0)
      p.chunk = target;
    else if (target <= K)
      p.chunk = smallest_divisor_at_least(K, target);
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
  p.gemm_cols = std::max<Index>(16, EIGEN_STACK_ALLOCATION_LIMIT / (width * scalar_bytes));
  if (K == 0) {
    for (Index i0 = 0; i0 < n; i0 += p.tile) p.tasks.push_back({-1, i0, std::min(p.tile, n - i0)});
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
  EvaSegment segs[6];
  for (const EvaTask& t : p.tasks) {
    const int ns = eva_task_segments(p, t, segs);
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

/// The whole computation for a plan: chunk statistics of both levels into `lv[0]`, `lv[1]`, then
/// the query stage into `out` (resized to n x dv). `scale` is the resolved logit scale s.
template <typename Scalar>
void eva_run(const EvaPlan& plan, const EvaOptions& o, const ConstRef<Scalar>& Q,
             const ConstRef<Scalar>& K, const ConstRef<Scalar>& V, double scale,
             EvaLevel<Scalar>* lv, Matrix<Scalar>& out) {
  const Index m = plan.m, d = plan.d, dv = plan.dv;
  // Scaled keys, transposed (every key range is then a contiguous column block).
  const auto rs = static_cast<Scalar>(std::sqrt(scale));
  const Matrix<Scalar> Kt = (K * rs).transpose();
  const Vector<Scalar> negnk = Kt.colwise().squaredNorm().transpose() * Scalar(-0.5);

  // Chunk statistics: level 0 (C chunks) and, if used, level 1 (one chunk per block).
  lv[0].resize(plan.chunks, plan.chunk, d, dv, plan.samples, plan.gauss);
  if (plan.fine) lv[1].resize(plan.blocks, plan.window, d, dv, plan.samples, plan.gauss);
  const Index longest = std::min(m, std::max(plan.chunk, plan.fine ? plan.window : Index(0)));
  const TilePlan tiles =
      plan_tiles(plan.samples, longest, d, dv, static_cast<Index>(sizeof(Scalar)), 0, 0);
  const EvaChunkContext<Scalar> ctx{&plan, &o, &Q, &K, &V, &Kt, &negnk, scale, tiles.bq, tiles.bk};
  const Index units = plan.chunks + (plan.fine ? plan.blocks : 0);
  parallel_for(
      units, [&] { return EvaChunkWorkspace<Scalar>(tiles.bq, tiles.bk, d, dv, plan.samples); },
      [&](Index u, EvaChunkWorkspace<Scalar>& ws) {
        const int level = u < plan.chunks ? 0 : 1;
        const Index c = level == 0 ? u : u - plan.chunks;
        const Index size = level == 0 ? plan.chunk : plan.window;
        const Index k0 = c * size, k1 = std::min(m, k0 + size);
        eva_chunk_stats(ctx, level, c, k0, k1, lv[level], ws);
      });

  // Query stage: independent tasks of at most plan.tile rows inside one block.
  out.resize(plan.n, dv);
  const Index tcols = plan.samples > 1 ? std::max(plan.samples, plan.gemm_cols) : 0;
  parallel_for(
      static_cast<Index>(plan.tasks.size()),
      [&] { return EvaBlockWorkspace<Scalar>(plan.tile, d, dv, plan.max_cols, tcols, plan.gauss); },
      [&](Index t, EvaBlockWorkspace<Scalar>& ws) {
        eva_block<Scalar>(plan, plan.tasks[static_cast<std::size_t>(t)], Q, Kt, V, lv, rs, ws, out);
      });
}

/// Validates the shape and values of a summary map (its size against d comes at compute time).
inline void eva_check_map(const eva::SummaryMap& mp, const char* which, const char* method) {
  const Index w = mp.weight.size() > 0 ? mp.weight.rows() : -1;
  EFFATTN_CHECK(mp.weight.size() == 0 || mp.weight.rows() == mp.weight.cols(),
                cat(method, ": Options::", which, ".weight must be d x d; got ", shape(mp.weight)));
  for (const Eigen::VectorXd* v : {&mp.bias, &mp.ln_gamma, &mp.ln_beta})
    EFFATTN_CHECK(v->size() == 0 || w < 0 || v->size() == w,
                  cat(method, ": Options::", which, " vectors must have d = weight.rows() = ", w,
                      " entries; got ", v->size()));
  EFFATTN_CHECK(mp.weight.allFinite() && mp.bias.allFinite() && mp.ln_gamma.allFinite() &&
                    mp.ln_beta.allFinite() && std::isfinite(mp.ln_eps) && mp.ln_eps > 0,
                cat(method, ": Options::", which, " must be finite with ln_eps > 0"));
}

/// Validates the size of a summary map against the head dimension d = Q.cols().
inline void eva_check_map_dim(const eva::SummaryMap& mp, const char* which, Index d,
                              const char* method) {
  EFFATTN_CHECK(mp.weight.size() == 0 || mp.weight.rows() == d,
                cat(method, ": Options::", which, ".weight must be d x d with d = Q.cols() = ", d,
                    "; got ", shape(mp.weight)));
  for (const Eigen::VectorXd* v : {&mp.bias, &mp.ln_gamma, &mp.ln_beta})
    EFFATTN_CHECK(v->size() == 0 || v->size() == d,
                  cat(method, ": Options::", which, " vectors must have d = Q.cols() = ", d,
                      " entries; got ", v->size()));
}

/// The checks `compute` and `backward` share: Q, K, V (as every method), causal shapes and the
/// summary maps' size against d = Q.cols().
template <typename QT, typename KT, typename VT>
void eva_check_call(const EvaOptions& o, const QT& Q, const KT& K, const VT& V, const char* name) {
  check_attention_inputs(Q, K, V, name);
  EFFATTN_CHECK(!o.causal || K.rows() >= Q.rows(),
                cat(name,
                    ": causal attention needs m >= n (query i sits at key position i + m - n); "
                    "got Q ",
                    shape(Q), ", K ", shape(K)));
  eva_check_map_dim(o.key_map, "key_map", Q.cols(), name);
  eva_check_map_dim(o.query_map, "query_map", Q.cols(), name);
}

/// The EVA options that make the kernel compute RFA / Performer: no local block, mu = 0, chunk
/// logit q~ . k^_c with no mass term, `features` features (0 = 64) drawn from `seed`. (The single
/// chunk holding every key comes from `eva_make_plan(..., one_chunk = true, ...)`.)
inline EvaOptions performer_kernel_options(const PerformerOptions& p) {
  EvaOptions e;
  e.scale = p.scale;
  e.causal = false;
  e.window = 0;
  e.chunk_size = 0;
  e.samples = p.features > 0 ? p.features : 64;
  e.seed = p.seed;
  e.mass = eva::Mass::Literal;
  e.proposal = eva::Proposal::Zero;
  e.partition = eva::Partition::Disjoint;
  return e;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// EvaAttention

template <typename Scalar_, typename Policy>
EvaAttention<Scalar_, Policy>::EvaAttention(Options opts) : m_opts(std::move(opts)) {
  using detail::cat;
  detail::check_scale_option(m_opts.scale, name);
  EFFATTN_CHECK(
      m_opts.window >= 0,
      cat(name, ": Options::window must be >= 0 (0 = no exact keys); got ", m_opts.window));
  EFFATTN_CHECK(
      m_opts.chunk_size >= 0,
      cat(name, ": Options::chunk_size must be >= 0 (0 = automatic); got ", m_opts.chunk_size));
  EFFATTN_CHECK(
      m_opts.samples >= 0,
      cat(name, ": Options::samples must be >= 0 (0 = deterministic); got ", m_opts.samples));
  using eva::Mass;
  using eva::Partition;
  using eva::Proposal;
  EFFATTN_CHECK(
      detail::is_one_of(m_opts.mass, {Mass::Literal, Mass::LogCount, Mass::GaussianDiag}) &&
          detail::is_one_of(m_opts.proposal, {Proposal::SumMeans, Proposal::HalfSum,
                                              Proposal::QueryMean, Proposal::Zero}) &&
          detail::is_one_of(m_opts.partition, {Partition::Disjoint, Partition::Overlapping}),
      cat(name, ": Options::mass, proposal or partition is not a valid enumerator"));
  EFFATTN_CHECK(!m_opts.causal || m_opts.window >= 1,
                cat(name,
                    ": causal EVA needs window >= 1 (E_n must contain the query itself); got "
                    "window = ",
                    m_opts.window));
  if (m_opts.partition == Partition::Disjoint && m_opts.window > 0 && m_opts.chunk_size > 0)
    EFFATTN_CHECK(
        m_opts.window % m_opts.chunk_size == 0 || m_opts.chunk_size % m_opts.window == 0,
        cat(name, ": Options::chunk_size (", m_opts.chunk_size, ") must divide Options::window (",
            m_opts.window, ") or be a multiple of it, so that the chunks and E_n stay disjoint"));
  detail::eva_check_map(m_opts.key_map, "key_map", name);
  detail::eva_check_map(m_opts.query_map, "query_map", name);
}

template <typename Scalar_, typename Policy>
typename EvaAttention<Scalar_, Policy>::Result EvaAttention<Scalar_, Policy>::compute(
    const Ref& Q, const Ref& K, const Ref& V) const {
  using detail::cat;
  detail::eva_check_call(m_opts, Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  const double scale = detail::resolve_scale(m_opts.scale, d);
  const detail::EvaPlan plan =
      detail::eva_make_plan(m_opts, false, n, m, d, dv, static_cast<Index>(sizeof(Scalar)));
  detail::EvaLevel<Scalar> lv[2];
  Result r;
  detail::eva_run<Scalar>(plan, m_opts, Q, K, V, scale, lv, r.output);
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

template <typename Scalar_, typename Policy>
Index EvaAttention<Scalar_, Policy>::max_logits(Index n, Index m) const {
  EFFATTN_CHECK(n >= 1 && m >= 1 && (!m_opts.causal || m >= n),
                detail::cat(name, ": max_logits needs n, m >= 1 (and m >= n if causal); got n = ",
                            n, ", m = ", m));
  return detail::eva_make_plan(m_opts, false, n, m, 1, 1, static_cast<Index>(sizeof(Scalar)))
      .max_logits;
}

// ---------------------------------------------------------------------------------------------
// PerformerAttention

template <typename Scalar_>
PerformerAttention<Scalar_>::PerformerAttention(Options opts)
    : m_opts(detail::resolve_renamed(opts, name)) {
  detail::check_scale_option(m_opts.scale, name);
  EFFATTN_CHECK(
      m_opts.features >= 0,
      detail::cat(name, ": Options::features must be >= 0 (0 = 64); got ", m_opts.features));
}

template <typename Scalar_>
typename PerformerAttention<Scalar_>::Result PerformerAttention<Scalar_>::compute(
    const Ref& Q, const Ref& K, const Ref& V) const {
  detail::check_attention_inputs(Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  const EvaOptions o = detail::performer_kernel_options(m_opts);
  const double scale = detail::resolve_scale(o.scale, d);
  const detail::EvaPlan plan =
      detail::eva_make_plan(o, true, n, m, d, dv, static_cast<Index>(sizeof(Scalar)));
  detail::EvaLevel<Scalar> lv[2];
  Result r;
  detail::eva_run<Scalar>(plan, o, Q, K, V, scale, lv, r.output);
  r.features = plan.samples;
  r.omega = lv[0].omegaT.transpose();
  r.info = detail::all_finite(r.output) ? Info::Success : Info::NumericalIssue;
  return r;
}

template <typename Scalar_>
typename PerformerAttention<Scalar_>::Gradients PerformerAttention<Scalar_>::backward(
    const Ref& Q, const Ref& K, const Ref& V, const Result& result, const Ref& dO) const {
  using MatD = Matrix<double>;
  detail::check_attention_inputs(Q, K, V, name);
  const Index n = Q.rows(), d = Q.cols();
  detail::check_backward_args<Scalar>(name, n, V.cols(), result.output, result.info, dO);
  EFFATTN_CHECK(
      result.omega.rows() == result.features && result.omega.cols() == d,
      detail::cat(name, ": result.omega must be S x d = ", result.features, " x ", d,
                  " (the forward result of these Q, K, V); got ", detail::shape(result.omega)));
  const double rs = std::sqrt(detail::resolve_scale(m_opts.scale, d));
  const MatD W = result.omega.template cast<double>();  // S x d
  const MatD Qt = Q.template cast<double>() * rs, Kt = K.template cast<double>() * rs;
  const MatD Vd = V.template cast<double>(), dOd = dO.template cast<double>();
  // Key side: l (S x m) -> beta = row softmax, a = row log-sum-exp, B = beta V.
  MatD beta = detail::matmul<detail::Op::N, detail::Op::T>(W, Kt);
  beta.rowwise() -= 0.5 * Kt.rowwise().squaredNorm().transpose();
  const Vector<double> a = row_softmax_inplace(beta);
  const MatD B = detail::matmul(beta, Vd);  // S x dv
  // Query side: g = Qt W^T + 1 a^T, pi = row softmax, O = pi B.
  MatD pi = detail::matmul<detail::Op::N, detail::Op::T>(Qt, W);
  pi.rowwise() += a.transpose();
  row_softmax_inplace(pi);
  const MatD O = detail::matmul(pi, B);
  // Softmax backward over the features, then over the keys.
  const MatD dB = detail::matmul<detail::Op::T>(pi, dOd);
  MatD dg = detail::matmul<detail::Op::N, detail::Op::T>(dOd, B);
  dg.colwise() -= dOd.cwiseProduct(O).rowwise().sum();
  dg = pi.cwiseProduct(dg);
  MatD dl = detail::matmul<detail::Op::N, detail::Op::T>(dB, Vd);  // S x m
  Vector<double> shift = dB.cwiseProduct(B).rowwise().sum() - dg.colwise().sum().transpose();
  dl.colwise() -= shift;
  dl = beta.cwiseProduct(dl);
  Gradients g;
  g.dQ = detail::matmul(dg, W, rs).template cast<Scalar>();  // Eigen: rs (dg W) = (rs dg) W
  g.dV = detail::matmul<detail::Op::T>(beta, dB).template cast<Scalar>();
  MatD dKt = detail::matmul<detail::Op::T>(dl, W);  // m x d
  dKt -= Kt.cwiseProduct(dl.colwise().sum().transpose().replicate(1, d));
  g.dK = (rs * dKt).template cast<Scalar>();
  return g;
}

}  // namespace effattn
