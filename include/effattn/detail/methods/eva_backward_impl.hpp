/// \file eva_backward_impl.hpp
/// \brief Internal: `EvaAttention::backward`, the reverse pass of the kernel in `eva_impl.hpp`.
/// Include `<effattn/eva.hpp>` instead; this header is not for users.
///
/// The chunk statistics are recomputed by the forward's own code (`eva_chunk_stats`, same plan
/// and random streams) and converted to double; everything after runs in double, in two stages
/// that mirror the forward:
/// - the query stage (one task of at most `EvaPlan::tile` rows at a time) gives dQ of its rows,
///   dK and dV of the keys of its local block, and the chunk-side gradients of the quantities it
///   read: dL/dk^_c, dL/d(var_c / 2), dL/db_{c,s} and, for S >= 2, the sums over its queries of
///   dT_{n,c,s} q~_n and dT_{n,c,s} (T = the pi logits);
/// - the chunk stage (one chunk of either level at a time) turns those into dK, dV of the chunk's
///   keys, dQ of the queries its mean covers, and the summary-map parameter gradients.
/// Chunk-side sums over queries are accumulated per *group* of query units (the blocks, or the
/// query tiles without a window), assigned round-robin; the group count depends only on shapes
/// and options, and the groups are summed in a fixed order, so the result is bit-identical for
/// any thread count.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "../../eva.hpp"
#include "../../gradients.hpp"
#include "eva_impl.hpp"

namespace effattn {
namespace detail {

/// Gradients the query stage sends to the chunk statistics of one level (layout of `EvaLevel`).
struct EvaLevelGrad {
  Matrix<double> rep;      ///< d x count: dL/dk^_c
  Matrix<double> halfvar;  ///< d x count: dL/d(var_c / 2) (GaussianDiag only)
  Matrix<double> values;   ///< (count S) x dv: dL/db_{c,s}
  Matrix<double> wq;       ///< d x (count S): sum_n dT_{n,c,s} q~_n (S >= 2 only)
  Vector<double> lse;      ///< count S: sum_n dT_{n,c,s} = dL/da_{c,s} (S >= 2 only)

  void reset(Index count, Index d, Index dv, Index S, bool gauss) {
    rep.setZero(d, count);
    halfvar.setZero(gauss ? d : 0, gauss ? count : 0);
    values.setZero(count * S, dv);
    wq.setZero(S > 1 ? d : 0, S > 1 ? count * S : 0);
    lse.setZero(S > 1 ? count * S : 0);
  }
  /// Bytes of one level's accumulators.
  static Index bytes(Index count, Index d, Index dv, Index S, bool gauss) {
    return 8 * count * (d * (gauss ? 2 : 1) + S * dv + (S > 1 ? S * (d + 1) : 0));
  }
};

/// Everything both backward stages read. The inputs stay in their own precision; the stages
/// convert the rows they use to double.
template <typename Scalar>
struct EvaBackContext {
  const EvaPlan* plan;
  const EvaOptions* opts;
  const ConstRef<Scalar>* Q;   ///< n x d, input coordinates
  const ConstRef<Scalar>* K;   ///< m x d, input coordinates
  const ConstRef<Scalar>* V;   ///< m x dv
  const ConstRef<Scalar>* dO;  ///< n x dv
  const Matrix<Scalar>* Kt;    ///< d x m scaled keys (the forward's)
  const EvaLevel<double>* lv;  ///< the forward's chunk statistics of both levels, in double
  double scale, rs;            ///< s and sqrt(s)
};

/// Per-thread buffers of the query stage.
struct EvaBackWorkspace {
  Matrix<double> q, q2, go, a, y, dq, tmp, pi, u, kt, v, dk, dv;
  EvaBackWorkspace(Index rows, Index d, Index dv_, Index cols, Index tcols, bool gauss)
      : q(rows, d),
        q2(gauss ? rows : 0, gauss ? d : 0),
        go(rows, dv_),
        a(rows, cols),
        y(rows, cols),
        dq(rows, d),
        tmp(gauss ? rows : 0, gauss ? d : 0),
        pi(rows, tcols),
        u(rows, tcols),
        kt(d, cols),
        v(cols, dv_),
        dk(cols, d),
        dv(cols, dv_) {}
};

/// Reverse of `eva_block` for one task: writes dQ of its rows (without the query-mean terms)
/// into `dQ`, adds dK and dV of its local keys into `dK`, `dV`, and its chunk-side gradients into
/// `acc` (one `EvaLevelGrad` per level).
template <typename Scalar>
void eva_backward_task(const EvaBackContext<Scalar>& cx, const EvaTask& t, EvaLevelGrad* acc,
                       EvaBackWorkspace& ws, Matrix<Scalar>& dQ, Matrix<Scalar>& dK,
                       Matrix<Scalar>& dV) {
  const EvaPlan& p = *cx.plan;
  const Index R = t.rows, S = p.samples;
  auto q = ws.q.topRows(R);
  q = cx.Q->middleRows(t.row0, R).template cast<double>() * cx.rs;
  auto go = ws.go.topRows(R);
  go = cx.dO->middleRows(t.row0, R).template cast<double>();
  if (p.gauss) ws.q2.topRows(R) = q.array().square().matrix();
  EvaSegment segs[6];
  const int ns = eva_task_segments(p, t, segs);
  const Index cols = ns > 0 ? segs[ns - 1].col + segs[ns - 1].len : 0;
  EFFATTN_ASSERT(cols > 0 && cols <= p.max_cols);
  auto A = ws.a.topLeftCorner(R, cols);
  auto Y = ws.y.topLeftCorner(R, cols);

  // Logits (into A) and Y_nj = dO_n . (value row of column j): v_j, b_c, or for S >= 2
  // beta_{n,c} = sum_s pi_{n,c,s} b_{c,s}, with pi (into ws.pi) and U_{n,cs} = dO_n . b_{c,s}.
  // The local keys and values (one segment, first) are converted once into ws.kt, ws.v.
  Index pc = 0;
  for (int g = 0; g < ns; ++g) {
    const EvaSegment& sg = segs[g];
    auto Ab = A.middleCols(sg.col, sg.len);
    auto Yb = Y.middleCols(sg.col, sg.len);
    if (sg.level < 0) {
      auto kt = ws.kt.leftCols(sg.len);
      auto v = ws.v.topRows(sg.len);
      kt = cx.Kt->middleCols(sg.start, sg.len).template cast<double>();
      v = cx.V->middleRows(sg.start, sg.len).template cast<double>();
      gemm(Update::Assign, Ab, q, kt);
      gemm<Op::N, Op::T>(Update::Assign, Yb, go, v);
    } else {
      const EvaLevel<double>& L = cx.lv[sg.level];
      gemm(Update::Assign, Ab, q, L.repT.middleCols(sg.start, sg.len));
      if (p.gauss) gemm(Update::Add, Ab, ws.q2.topRows(R), L.halfvarT.middleCols(sg.start, sg.len));
      Ab.rowwise() += L.bias.segment(sg.start, sg.len);
      if (S == 1) {
        gemm<Op::N, Op::T>(Update::Assign, Yb, go, L.values.middleRows(sg.start, sg.len));
      } else {
        const Index w = sg.len * S;
        auto T = ws.pi.block(0, pc, R, w);
        auto U = ws.u.block(0, pc, R, w);
        gemm(Update::Assign, T, q, L.omegaT.middleCols(sg.start * S, w));
        T.rowwise() += L.pconst.segment(sg.start * S, w);
        gemm<Op::N, Op::T>(Update::Assign, U, go, L.values.middleRows(sg.start * S, w));
        for (Index j = 0; j < sg.len; ++j) {
          auto Tj = T.middleCols(j * S, S);
          const Vector<double> mx = Tj.rowwise().maxCoeff();
          Tj = (Tj.colwise() - mx).array().exp().matrix();
          const Vector<double> inv = Tj.rowwise().sum().cwiseInverse();
          Tj = inv.asDiagonal() * Tj;
          Yb.col(j) = Tj.cwiseProduct(U.middleCols(j * S, S)).rowwise().sum();
        }
        pc += w;
      }
    }
    if (sg.masked) {
      for (Index j = 0; j < sg.len; ++j)
        Ab.col(j)
            .head(eva_hidden_rows(sg, j, t.row0, p.off, R))
            .setConstant(-std::numeric_limits<double>::infinity());
    }
  }
  row_softmax_inplace(A);  // masked entries exactly 0

  // Softmax backward: D_n = dO_n . O_n = sum_j A_nj Y_nj, dlogit = A o (Y - D). For S >= 2 first
  // U := dT = A_c pi o (U - Y_c) (the pi softmax backward) and pi := P = A_c pi.
  const Vector<double> D = A.cwiseProduct(Y).rowwise().sum();
  pc = 0;
  for (int g = 0; g < ns; ++g) {
    const EvaSegment& sg = segs[g];
    if (sg.level < 0 || S == 1) continue;
    for (Index j = 0; j < sg.len; ++j) {
      auto Pj = ws.pi.block(0, pc + j * S, R, S);
      auto Uj = ws.u.block(0, pc + j * S, R, S);
      const auto a = A.col(sg.col + j);
      Uj = (Uj.colwise() - Y.col(sg.col + j)).cwiseProduct(Pj);
      Uj = a.asDiagonal() * Uj;
      Pj = a.asDiagonal() * Pj;
    }
    pc += sg.len * S;
  }
  Y = A.cwiseProduct(Y.colwise() - D);  // Y := dlogit

  auto dq = ws.dq.topRows(R);
  dq.setZero();
  pc = 0;
  for (int g = 0; g < ns; ++g) {
    const EvaSegment& sg = segs[g];
    const auto Ab = A.middleCols(sg.col, sg.len);
    const auto dL = Y.middleCols(sg.col, sg.len);
    if (sg.level < 0) {
      auto dk = ws.dk.topRows(sg.len);
      auto dv = ws.dv.topRows(sg.len);
      gemm<Op::N, Op::T>(Update::Add, dq, dL, ws.kt.leftCols(sg.len));
      gemm<Op::T, Op::N>(Update::Assign, dk, dL, q, cx.rs);  // dk~ = dL^T q~, dk = sqrt(s) dk~
      gemm<Op::T, Op::N>(Update::Assign, dv, Ab, go);
      dK.middleRows(sg.start, sg.len) += dk.template cast<Scalar>();
      dV.middleRows(sg.start, sg.len) += dv.template cast<Scalar>();
      continue;
    }
    const EvaLevel<double>& L = cx.lv[sg.level];
    EvaLevelGrad& G = acc[sg.level];
    gemm<Op::N, Op::T>(Update::Add, dq, dL, L.repT.middleCols(sg.start, sg.len));
    gemm<Op::T, Op::N>(Update::Add, G.rep.middleCols(sg.start, sg.len), q, dL);
    if (p.gauss) {
      // d(q~ o q~ . halfvar)/dq~ = 2 q~ o halfvar.
      auto tmp = ws.tmp.topRows(R);
      gemm<Op::N, Op::T>(Update::Assign, tmp, dL, L.halfvarT.middleCols(sg.start, sg.len));
      dq += 2.0 * q.cwiseProduct(tmp);
      gemm<Op::T, Op::N>(Update::Add, G.halfvar.middleCols(sg.start, sg.len), ws.q2.topRows(R), dL);
    }
    if (S == 1) {
      gemm<Op::T, Op::N>(Update::Add, G.values.middleRows(sg.start, sg.len), Ab, go);
      continue;
    }
    // T_{n,c,s} = w_{c,s} . q~_n + a_{c,s} - w_{c,s} . mu_c.
    const Index w = sg.len * S;
    const auto P = ws.pi.block(0, pc, R, w);
    const auto dT = ws.u.block(0, pc, R, w);
    gemm<Op::T, Op::N>(Update::Add, G.values.middleRows(sg.start * S, w), P, go);
    gemm<Op::T, Op::N>(Update::Add, G.wq.middleCols(sg.start * S, w), q, dT);
    G.lse.segment(sg.start * S, w) += dT.colwise().sum().transpose();
    gemm<Op::N, Op::T>(Update::Add, dq, dT, L.omegaT.middleCols(sg.start * S, w));
    pc += w;
  }
  dQ.middleRows(t.row0, R) = (dq * cx.rs).template cast<Scalar>();
}

/// Backward of y = sigma(x) = LN(W x + b) (`apply_summary_map`) given dy: dx, and the pieces of
/// the parameter gradients, dpre = dL/d(W x + b) (so dW = dpre x^T, db = dpre), dgamma, dbeta.
template <typename = void>
void summary_map_backward(const eva::SummaryMap& map, const Vector<double>& x,
                          const Vector<double>& dy, Vector<double>& dx, Vector<double>& dpre,
                          Vector<double>& dgamma, Vector<double>& dbeta) {
  dpre = dy;
  if (map.layer_norm) {
    Vector<double> y = map.weight.size() > 0 ? Vector<double>(map.weight * x) : x;
    if (map.bias.size() > 0) y += map.bias;
    const double mean = y.mean();
    const double var = (y.array() - mean).square().mean();
    const double rstd = 1.0 / std::sqrt(var + map.ln_eps);
    const Vector<double> z = ((y.array() - mean) * rstd).matrix();
    dgamma = dy.cwiseProduct(z);
    dbeta = dy;
    Vector<double> dz = dy;
    if (map.ln_gamma.size() > 0) dz.array() *= map.ln_gamma.array();
    const double mdz = dz.mean(), mdzz = dz.cwiseProduct(z).mean();
    dpre = ((dz.array() - mdz - z.array() * mdzz) * rstd).matrix();
  }
  if (map.weight.size() > 0) {
    dx.noalias() = map.weight.transpose() * dpre;
  } else {
    dx = dpre;
  }
}

/// Per-unit pieces of the summary-map parameter gradients (columns = chunk units).
struct EvaMapPieces {
  Matrix<double> x, dpre, dgamma, dbeta;  ///< d x units
  void resize(Index d, Index units) {
    x.setZero(d, units);
    dpre.setZero(d, units);
    dgamma.setZero(d, units);
    dbeta.setZero(d, units);
  }
  /// Sums the pieces into the gradients of `map` (empty fields for absent parameters).
  void reduce(const eva::SummaryMap& map, eva::SummaryMapGradients& g) const {
    if (map.weight.size() > 0) g.weight = matmul<Op::N, Op::T>(dpre, x);
    if (map.bias.size() > 0) g.bias = dpre.rowwise().sum();
    if (map.layer_norm && map.ln_gamma.size() > 0) g.ln_gamma = dgamma.rowwise().sum();
    if (map.layer_norm && map.ln_beta.size() > 0) g.ln_beta = dbeta.rowwise().sum();
  }
};

/// Outputs of the chunk stage besides dK, dV: per unit dL/dqbar and the map pieces.
struct EvaChunkGrads {
  Matrix<double> dqbar;  ///< d x units
  EvaMapPieces key, query;
};

/// Reverse of `eva_chunk_stats` for chunk `c` of `level` (keys [k0, k1), unit index `u`): sums
/// the groups' accumulators in group order, then goes back through b, a (the chunk softmax),
/// w = mu + eps (eps fixed), the proposal, the summary maps and the means. Adds dK, dV of the
/// chunk's keys into `dK`, `dV`.
template <typename Scalar>
void eva_backward_chunk(const EvaBackContext<Scalar>& cx, int level, Index c, Index k0, Index k1,
                        Index u, const std::vector<std::array<EvaLevelGrad, 2>>& acc,
                        EvaChunkGrads& out, Matrix<Scalar>& dK, Matrix<Scalar>& dV) {
  using MatD = Matrix<double>;
  using VecD = Vector<double>;
  const EvaPlan& p = *cx.plan;
  const EvaOptions& o = *cx.opts;
  const Index S = p.samples, d = p.d, dv = p.dv, len = k1 - k0;
  const EvaLevel<double>& L = cx.lv[level];
  MatD dvals = MatD::Zero(S, dv), Gq, dW;
  VecD dkh = VecD::Zero(d), dhv, da;
  if (p.gauss) dhv.setZero(d);
  if (S > 1) {
    Gq.setZero(d, S);
    da.setZero(S);
  }
  for (const auto& grp : acc) {
    const EvaLevelGrad& G = grp[static_cast<std::size_t>(level)];
    dvals += G.values.middleRows(c * S, S);
    dkh += G.rep.col(c);
    if (p.gauss) dhv += G.halfvar.col(c);
    if (S > 1) {
      Gq += G.wq.middleCols(c * S, S);
      da += G.lse.segment(c * S, S);
    }
  }
  const auto W = L.omegaT.middleCols(c * S, S);  // d x S
  const VecD mu = L.mu.col(c);
  VecD dmu;
  if (S > 1) {
    dW = Gq - mu * da.transpose();  // dT/dw = q~ - mu
    dmu = -(W * da);                // dT/dmu = -w
  } else {
    dW.setZero(d, S);
    dmu.setZero(d);
  }
  // r = W^T k~ - |k~|^2 / 2 (S x len), P = row softmax, a = row lse, b = P V.
  const MatD Kc = cx.Kt->middleCols(k0, len).template cast<double>();  // d x len
  const MatD Vc = cx.V->middleRows(k0, len).template cast<double>();   // len x dv
  const MatD Kin = cx.K->middleRows(k0, len).template cast<double>();  // len x d
  MatD P = matmul<Op::T, Op::N>(W, Kc);
  P.rowwise() -= 0.5 * Kc.colwise().squaredNorm();
  row_softmax_inplace(P);
  const auto B = L.values.middleRows(c * S, S);
  MatD dr = matmul<Op::N, Op::T>(dvals, Vc);
  VecD shift = dvals.cwiseProduct(B).rowwise().sum();
  if (S > 1) shift -= da;
  dr.colwise() -= shift;
  dr = P.cwiseProduct(dr);
  dV.middleRows(k0, len) += matmul<Op::T, Op::N>(P, dvals).template cast<Scalar>();
  gemm<Op::N, Op::T>(Update::Add, dW, Kc, dr);
  // dk~_m = sum_s dr_{s,m} (w_s - k~_m), as rows: dr^T W^T - diag(colsum dr) K~.
  MatD dk = matmul<Op::T, Op::T>(dr, W);
  dk -= dr.colwise().sum().transpose().asDiagonal() * Kc.transpose();
  dk *= cx.rs;
  dmu += dW.rowwise().sum();  // w_{c,s} = mu_c + eps_{c,s}
  VecD dqh = VecD::Zero(d);
  switch (o.proposal) {
    case eva::Proposal::SumMeans:
      dkh += dmu;
      dqh = dmu;
      break;
    case eva::Proposal::HalfSum:
      dkh += 0.5 * dmu;
      dqh = 0.5 * dmu;
      break;
    case eva::Proposal::QueryMean:
      dqh = dmu;
      break;
    case eva::Proposal::Zero:
      break;
  }
  // k^ = sqrt(s) sigma_k(kbar), kbar the mean of the chunk's keys (input coordinates).
  const double inv_len = 1.0 / static_cast<double>(len);
  const VecD kbar = Kin.colwise().sum().transpose() * inv_len;
  VecD dx, dpre, dg, db;
  summary_map_backward(o.key_map, kbar, VecD(cx.rs * dkh), dx, dpre, dg, db);
  out.key.x.col(u) = kbar;
  out.key.dpre.col(u) = dpre;
  if (dg.size() > 0) {
    out.key.dgamma.col(u) = dg;
    out.key.dbeta.col(u) = db;
  }
  dk.rowwise() += dx.transpose() * inv_len;
  if (p.gauss) {
    // var_c / 2 = s / (2 len) sum_j (k_j - kbar)^2: d/dk_j = (s / len) (k_j - kbar).
    const VecD f = dhv * (cx.scale * inv_len);
    dk += (Kin.rowwise() - kbar.transpose()) * f.asDiagonal();
  }
  dK.middleRows(k0, len) += dk.template cast<Scalar>();
  // q^ = sqrt(s) sigma_q(qbar), qbar the mean of the queries at the chunk's positions (or 0).
  Index r0 = 0, r1 = 0;
  p.query_rows(k0, k1, r0, r1);
  VecD qbar = VecD::Zero(d);
  if (r1 > r0)
    qbar = cx.Q->middleRows(r0, r1 - r0).template cast<double>().colwise().sum().transpose() /
           static_cast<double>(r1 - r0);
  dg.resize(0);
  summary_map_backward(o.query_map, qbar, VecD(cx.rs * dqh), dx, dpre, dg, db);
  out.query.x.col(u) = qbar;
  out.query.dpre.col(u) = dpre;
  if (dg.size() > 0) {
    out.query.dgamma.col(u) = dg;
    out.query.dbeta.col(u) = db;
  }
  if (r1 > r0) out.dqbar.col(u) = dx;
}

/// The chunk statistics of one level in double (a copy for float, moved for double).
template <typename Scalar>
EvaLevel<double> eva_level_to_double(EvaLevel<Scalar>& lv) {
  if constexpr (std::is_same_v<Scalar, double>) {
    return std::move(lv);
  } else {
    EvaLevel<double> r;
    r.count = lv.count;
    r.size = lv.size;
    r.repT = lv.repT.template cast<double>();
    r.halfvarT = lv.halfvarT.template cast<double>();
    r.bias = lv.bias.template cast<double>();
    r.mu = lv.mu.template cast<double>();
    r.omegaT = lv.omegaT.template cast<double>();
    r.lse = lv.lse.template cast<double>();
    r.pconst = lv.pconst.template cast<double>();
    r.values = lv.values.template cast<double>();
    return r;
  }
}

/// Units of the query stage: [first, last) ranges of `plan.tasks` sharing one block (or single
/// tasks without a window), so that one unit owns the dK~, dV rows of its local keys.
inline std::vector<std::pair<Index, Index>> eva_backward_units(const EvaPlan& p) {
  std::vector<std::pair<Index, Index>> units;
  const Index count = static_cast<Index>(p.tasks.size());
  for (Index i = 0; i < count;) {
    Index j = i + 1;
    while (p.window > 0 && j < count &&
           p.tasks[static_cast<std::size_t>(j)].block == p.tasks[static_cast<std::size_t>(i)].block)
      ++j;
    units.emplace_back(i, j);
    i = j;
  }
  return units;
}

}  // namespace detail

template <typename Scalar_, typename Policy>
typename EvaAttention<Scalar_, Policy>::Gradients EvaAttention<Scalar_, Policy>::backward(
    const Ref& Q, const Ref& K, const Ref& V, const Result& result, const Ref& dO) const {
  using detail::cat;
  detail::eva_check_call(m_opts, Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  detail::check_backward_args<Scalar>(name, n, dv, result.output, result.info, dO);
  const double scale = detail::resolve_scale(m_opts.scale, d), rs = std::sqrt(scale);
  const detail::EvaPlan plan =
      detail::eva_make_plan(m_opts, false, n, m, d, dv, static_cast<Index>(sizeof(Scalar)));
  const Index S = plan.samples, C = plan.chunks;
  EFFATTN_CHECK(result.window == plan.window && result.chunk_size == plan.chunk &&
                    result.num_chunks == C && result.samples == S && result.omega.rows() == C * S &&
                    result.omega.cols() == d && result.chunk_keys.rows() == C &&
                    result.chunk_keys.cols() == d,
                cat(name,
                    ": result must be the forward result of these Q, K, V and options "
                    "(window ",
                    plan.window, ", chunk_size ", plan.chunk, ", ", C, " chunks, ", S,
                    " samples, omega ", C * S, " x ", d, "); got window ", result.window,
                    ", chunk_size ", result.chunk_size, ", ", result.num_chunks, " chunks, ",
                    result.samples, " samples, omega ", detail::shape(result.omega)));

  // The forward's chunk statistics, recomputed by the forward's own code (same random streams).
  const auto rsS = static_cast<Scalar>(rs);
  const Matrix<Scalar> Kt = (K * rsS).transpose();
  const Vector<Scalar> negnk = Kt.colwise().squaredNorm().transpose() * Scalar(-0.5);
  detail::EvaLevel<Scalar> lvs[2];
  lvs[0].resize(C, plan.chunk, d, dv, S, plan.gauss);
  if (plan.fine) lvs[1].resize(plan.blocks, plan.window, d, dv, S, plan.gauss);
  const Index longest = std::min(m, std::max(plan.chunk, plan.fine ? plan.window : Index(0)));
  const detail::TilePlan tiles =
      detail::plan_tiles(S, longest, d, dv, static_cast<Index>(sizeof(Scalar)), 0, 0);
  const detail::EvaChunkContext<Scalar> ctx{&plan, &m_opts, &Q,    &K,       &V,
                                            &Kt,   &negnk,  scale, tiles.bq, tiles.bk};
  const Index units = C + (plan.fine ? plan.blocks : 0);
  auto unit_range = [&](Index u, int& level, Index& c, Index& k0, Index& k1) {
    level = u < C ? 0 : 1;
    c = level == 0 ? u : u - C;
    const Index size = level == 0 ? plan.chunk : plan.window;
    k0 = c * size;
    k1 = std::min(m, k0 + size);
  };
  detail::parallel_for(
      units, [&] { return detail::EvaChunkWorkspace<Scalar>(tiles.bq, tiles.bk, d, dv, S); },
      [&](Index u, detail::EvaChunkWorkspace<Scalar>& ws) {
        int level = 0;
        Index c = 0, k0 = 0, k1 = 0;
        unit_range(u, level, c, k0, k1);
        detail::eva_chunk_stats(ctx, level, c, k0, k1, lvs[level], ws);
      });
  // The forward's draws and representatives must be these (a result of other inputs or another
  // seed would give the gradient of a different function). Equal up to the round-off of the
  // means when the forward saw the inputs through other strides (MultiHead's slices).
  const double tol = (std::is_same_v<Scalar, float> ? 1e-5 : 1e-10) *
                     (1.0 + static_cast<double>(lvs[0].omegaT.cwiseAbs().maxCoeff()) +
                      static_cast<double>(lvs[0].repT.cwiseAbs().maxCoeff()));
  EFFATTN_CHECK(
      (result.omega - lvs[0].omegaT.transpose()).template cast<double>().cwiseAbs().maxCoeff() <=
              tol &&
          (result.chunk_keys - lvs[0].repT.transpose())
                  .template cast<double>()
                  .cwiseAbs()
                  .maxCoeff() <= tol,
      cat(name,
          ": result.omega / result.chunk_keys differ from those of these Q, K and options "
          "(a result of other inputs or another seed?)"));
  const detail::EvaLevel<double> lv[2] = {detail::eva_level_to_double(lvs[0]),
                                          detail::eva_level_to_double(lvs[1])};
  const detail::EvaBackContext<Scalar> cx{&plan, &m_opts, &Q, &K, &V, &dO, &Kt, lv, scale, rs};

  // Query stage: units (blocks) assigned round-robin to a fixed number of groups, each with its
  // own chunk-side accumulators (at most 16, and about 64 MiB in total).
  const std::vector<std::pair<Index, Index>> qunits = detail::eva_backward_units(plan);
  const Index nq = static_cast<Index>(qunits.size());
  const Index group_bytes = std::max<Index>(
      1, detail::EvaLevelGrad::bytes(C, d, dv, S, plan.gauss) +
             (plan.fine ? detail::EvaLevelGrad::bytes(plan.blocks, d, dv, S, plan.gauss) : 0));
  const Index groups =
      std::max<Index>(1, std::min({nq, Index(16), (Index(64) << 20) / group_bytes}));
  std::vector<std::array<detail::EvaLevelGrad, 2>> acc(static_cast<std::size_t>(groups));
  Gradients g;
  g.dQ.resize(n, d);
  g.dK.setZero(m, d);
  g.dV.setZero(m, dv);
  const Index tcols = S > 1 ? plan.max_cols * S : 0;
  detail::parallel_for(
      groups,
      [&] { return detail::EvaBackWorkspace(plan.tile, d, dv, plan.max_cols, tcols, plan.gauss); },
      [&](Index grp, detail::EvaBackWorkspace& ws) {
        auto& a = acc[static_cast<std::size_t>(grp)];
        a[0].reset(C, d, dv, S, plan.gauss);
        if (plan.fine) a[1].reset(plan.blocks, d, dv, S, plan.gauss);
        for (Index u = grp; u < nq; u += groups)
          for (Index t = qunits[static_cast<std::size_t>(u)].first;
               t < qunits[static_cast<std::size_t>(u)].second; ++t)
            detail::eva_backward_task(cx, plan.tasks[static_cast<std::size_t>(t)], a.data(), ws,
                                      g.dQ, g.dK, g.dV);
      });

  // Chunk stage: level 0, then level 1 (their keys overlap), each chunk in parallel.
  detail::EvaChunkGrads cg;
  cg.dqbar.setZero(d, units);
  cg.key.resize(d, units);
  cg.query.resize(d, units);
  for (int level = 0; level < (plan.fine ? 2 : 1); ++level) {
    const Index u0 = level == 0 ? 0 : C, count = level == 0 ? C : plan.blocks;
    detail::parallel_for(
        count, [] { return 0; },
        [&](Index i, int&) {
          int lvl = 0;
          Index c = 0, k0 = 0, k1 = 0;
          unit_range(u0 + i, lvl, c, k0, k1);
          detail::eva_backward_chunk(cx, lvl, c, k0, k1, u0 + i, acc, cg, g.dK, g.dV);
        });
  }

  // The query means: dQ of the rows each covers, in unit order.
  if (plan.cross_all) {
    g.dQ.rowwise() +=
        (cg.dqbar.rowwise().sum() / static_cast<double>(n)).transpose().template cast<Scalar>();
  } else {
    for (Index u = 0; u < units; ++u) {
      int level = 0;
      Index c = 0, k0 = 0, k1 = 0, r0 = 0, r1 = 0;
      unit_range(u, level, c, k0, k1);
      plan.query_rows(k0, k1, r0, r1);
      if (r1 > r0)
        g.dQ.middleRows(r0, r1 - r0).rowwise() +=
            (cg.dqbar.col(u) / static_cast<double>(r1 - r0)).transpose().template cast<Scalar>();
    }
  }
  cg.key.reduce(m_opts.key_map, g.key_map);
  cg.query.reduce(m_opts.query_map, g.query_map);
  return g;
}

}  // namespace effattn
