/// \file exact_backward_impl.hpp
/// \brief Implementation of `ExactAttention::backward` (exact.hpp): the Naive reference backward
/// in double, the tiled flash-style backward with its key-group schedule, and the member
/// definitions.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/gemm.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/parallel.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "../../exact.hpp"
#include "../../gradients.hpp"
#include "exact_impl.hpp"

namespace effattn {
namespace detail {

/// The Naive backward, in double: P = `naive_probabilities` (n x m), dV = P^T dO, dP = dO V^T,
/// D = rowsum(P o dP) (= rowsum(dO o O)), dS = P o (dP - D 1^T), dQ = s dS K, dK = s dS^T Q and,
/// when `bias` is given, dbias = dS^T 1. 2 n m (2 d + 3 dv) flops, three n x m double matrices.
template <typename Scalar>
void exact_naive_backward(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                          const ConstRef<Scalar>& V, const Scalar* bias, double scale, bool causal,
                          const ConstRef<Scalar>& dO, AttentionGradients<Scalar>& g) {
  using MatD = Matrix<double>;
  MatD P;
  (void)naive_probabilities<Scalar>(Q, K, bias, scale, causal, P);
  decltype(auto) dOd = as_double(dO);                 // dO itself for double
  MatD dS = matmul<Op::N, Op::T>(dOd, as_double(V));  // dP
  const Vector<double> D = P.cwiseProduct(dS).rowwise().sum();
  dS.colwise() -= D;
  dS = P.cwiseProduct(dS);
  g.dV = matmul<Op::T>(P, dOd).template cast<Scalar>();
  g.dQ = matmul(dS, as_double(K), scale).template cast<Scalar>();
  g.dK = matmul<Op::T>(dS, as_double(Q), scale).template cast<Scalar>();
  if (bias != nullptr) g.dbias = dS.colwise().sum().transpose().template cast<Scalar>();
}

/// Key groups of the tiled backward (see `tiled_backward`): the parallelism of the backward, and
/// the number of n x d partial dQ sums (G - 1 besides dQ itself). A fixed constant, never the
/// thread count, so that results are bit-identical for any number of threads; 4 keeps both cores
/// of the target machine busy (with dynamic scheduling) for (G - 1) n d extra scalars.
constexpr Index kBackwardKeyGroups = 4;

/// Per-thread buffers of the tiled backward: O(bq bk) scalars plus bk doubles.
template <typename Scalar>
struct BackwardWorkspace {
  Matrix<Scalar> p;                               ///< bq x bk: scores, then probabilities P
  Matrix<Scalar> ds;                              ///< bq x bk: dP, then dS
  Eigen::Array<Scalar, Eigen::Dynamic, 1> d_row;  ///< bq: D of the query block (a copy)
  BackwardWorkspace(Index bq, Index bk) : p(bq, bk), ds(bq, bk), d_row(bq) {}
};

/// The inputs of one tiled backward, prepared once per call: s Q (n x d), K^T (d x m) and V^T
/// (dv x m) for contiguous tile operands, D (n), and the outputs.
template <typename Scalar>
struct BackwardProblem {
  const ConstRef<Scalar>& K;
  const ConstRef<Scalar>& dO;
  const Scalar* bias;
  const Vector<Scalar>& lse;
  bool causal;
  Index bq, bk;
  Matrix<Scalar> Qs, Kt, Vt;
  Vector<Scalar> D;
  Matrix<Scalar>& dQ;
  Matrix<Scalar>& dK;
  Matrix<Scalar>& dV;
  Eigen::Array<double, Eigen::Dynamic, 1>* dbias;  ///< null without a bias
};

/// One (query block b, key tile t) pair of the tiled backward (see `ExactAttention::backward`):
/// five GEMMs on bq x bk tiles, nothing when the tile is entirely hidden by the causal mask. The
/// dQ rows go to `dQ` (the key group's partial sum).
template <typename Scalar>
void backward_tile(BackwardProblem<Scalar>& pr, Index b, Index t, BackwardWorkspace<Scalar>& ws,
                   Matrix<Scalar>& dQ) {
  constexpr Scalar ninf = -std::numeric_limits<Scalar>::infinity();
  const Index n = pr.Qs.rows(), m = pr.Kt.cols();
  const Index off = m - n;  // causal: row i sees keys j <= i + off
  const Index i0 = b * pr.bq, rows = std::min(pr.bq, n - i0);
  const Index j0 = t * pr.bk, cols = std::min(pr.bk, m - j0);
  if (pr.causal && j0 >= i0 + rows + off) return;  // every key of the tile is hidden
  const bool diagonal = pr.causal && j0 + cols - 1 > i0 + off;
  auto hidden_rows = [&](Index c) { return std::max<Index>(0, std::min(rows, j0 + c - off - i0)); };

  auto P = ws.p.topLeftCorner(rows, cols);
  auto dS = ws.ds.topLeftCorner(rows, cols);
  const auto Qs_b = pr.Qs.middleRows(i0, rows);
  const auto dO_b = pr.dO.middleRows(i0, rows);
  const auto lse_b = pr.lse.segment(i0, rows).array();
  auto D_b = ws.d_row.head(rows);
  D_b = pr.D.segment(i0, rows).array();

  gemm(Update::Assign, P, Qs_b, pr.Kt.middleCols(j0, cols));
  for (Index c = 0; c < cols; ++c) {
    if (pr.bias != nullptr) P.col(c).array() += pr.bias[j0 + c];
    P.col(c).array() = (P.col(c).array() - lse_b).exp();
    // Masked entries exactly 0 (Eigen's vectorised exp clamps exp(-inf) to ~1e-38; a hidden
    // logit above lse could even give inf): overwritten, never multiplied.
    if (diagonal) P.col(c).head(hidden_rows(c)).setZero();
    if (pr.bias != nullptr && pr.bias[j0 + c] == ninf) P.col(c).setZero();
  }
  gemm(Update::Assign, dS, dO_b, pr.Vt.middleCols(j0, cols));  // dP
  gemm<Op::T>(Update::Add, pr.dV.middleRows(j0, cols), P, dO_b);
  for (Index c = 0; c < cols; ++c) dS.col(c).array() = P.col(c).array() * (dS.col(c).array() - D_b);
  gemm<Op::T>(Update::Add, pr.dK.middleRows(j0, cols), dS, Qs_b);
  gemm(Update::Add, dQ.middleRows(i0, rows), dS, pr.K.middleRows(j0, cols));
  if (pr.dbias != nullptr)
    for (Index c = 0; c < cols; ++c) (*pr.dbias)(j0 + c) += dS.col(c).template cast<double>().sum();
}

/// The tiled backward over the whole problem (see `ExactAttention::backward` for the schedule
/// and the cost). `O` and `lse` are the forward result; every row must see a visible key.
template <typename Scalar>
void tiled_backward(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K, const ConstRef<Scalar>& V,
                    const Scalar* bias, Scalar scale, bool causal, const TilePlan& plan,
                    const Matrix<Scalar>& O, const Vector<Scalar>& lse, const ConstRef<Scalar>& dO,
                    AttentionGradients<Scalar>& g) {
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  g.dQ.setZero(n, d);
  g.dK.setZero(m, d);
  g.dV.setZero(m, dv);
  Eigen::Array<double, Eigen::Dynamic, 1> dbias;
  if (bias != nullptr) dbias.setZero(m);
  // K, dO, bias, lse, causal, bq, bk, then Qs, Kt, Vt, D (filled below), dQ, dK, dV, dbias.
  BackwardProblem<Scalar> pr{K,       dO,      bias, lse,  causal,
                             plan.bq, plan.bk, {},   {},   {},
                             {},      g.dQ,    g.dK, g.dV, bias ? &dbias : nullptr};
  pr.Qs.noalias() = Q * scale;
  pr.Kt = K.transpose();
  pr.Vt = V.transpose();
  // D_i = <dO_i, O_i>, summed in double: dS = P o (dP - D) cancels when dP ~ D.
  {
    Eigen::Array<double, Eigen::Dynamic, 1> Dd = Eigen::Array<double, Eigen::Dynamic, 1>::Zero(n);
    for (Index c = 0; c < dv; ++c)
      Dd += dO.col(c).template cast<double>().array() * O.col(c).template cast<double>().array();
    pr.D = Dd.template cast<Scalar>().matrix();
  }

  // Key groups: group grp owns the key tiles t = grp, grp + G, ... (interleaved, which balances
  // the causal triangle) and runs their query blocks in order, accumulating its own dK_t, dV_t
  // rows and its own partial dQ (group 0 writes g.dQ directly); the partials are added in group
  // order afterwards. G depends only on the shape, so the sums are bit-identical for any thread
  // count.
  const Index qb = (n + plan.bq - 1) / plan.bq, kb = (m + plan.bk - 1) / plan.bk;
  const Index groups = std::min(kb, kBackwardKeyGroups);
  std::vector<Matrix<Scalar>> dq_part(static_cast<std::size_t>(groups - 1));
  parallel_for(
      groups, [&] { return BackwardWorkspace<Scalar>(plan.bq, plan.bk); },
      [&](Index grp, BackwardWorkspace<Scalar>& ws) {
        Matrix<Scalar>& dq = grp == 0 ? g.dQ : dq_part[static_cast<std::size_t>(grp - 1)];
        if (grp > 0) dq.setZero(n, d);
        for (Index t = grp; t < kb; t += groups)
          for (Index b = 0; b < qb; ++b) backward_tile<Scalar>(pr, b, t, ws, dq);
      });
  for (const auto& part : dq_part) g.dQ += part;
  g.dQ *= scale;
  if (bias != nullptr) g.dbias = dbias.template cast<Scalar>().matrix();
}

}  // namespace detail

template <typename Scalar_, typename Policy>
auto ExactAttention<Scalar_, Policy>::backward(const Ref& Q, const Ref& K, const Ref& V,
                                               const Result& result, const Ref& dO) const
    -> Gradients {
  return run_backward(Q, K, V, nullptr, result, dO);
}

template <typename Scalar_, typename Policy>
auto ExactAttention<Scalar_, Policy>::backward(const Ref& Q, const Ref& K, const Ref& V,
                                               const ConstVectorRef<Scalar>& key_bias,
                                               const Result& result, const Ref& dO) const
    -> Gradients {
  check_key_bias(key_bias, Q.rows(), K.rows());
  return run_backward(Q, K, V, key_bias.data(), result, dO);
}

template <typename Scalar_, typename Policy>
auto ExactAttention<Scalar_, Policy>::run_backward(const Ref& Q, const Ref& K, const Ref& V,
                                                   const Scalar* bias, const Result& result,
                                                   const Ref& dO) const -> Gradients {
  const double scale = check_inputs(Q, K, V);
  const Index n = Q.rows();
  detail::check_backward_args<Scalar>(name, n, V.cols(), result.output, result.info, dO);
  EFFATTN_CHECK(
      result.lse.size() == n,
      detail::cat(name, ": result.lse must have n = Q.rows() = ", n,
                  " values (the forward result of these Q, K, V); got ", result.lse.size()));
  Gradients g;
  if constexpr (std::is_same_v<Policy, policy::Naive>) {
    detail::exact_naive_backward<Scalar>(Q, K, V, bias, scale, m_opts.causal, dO, g);
  } else {
    const detail::TilePlan plan =
        detail::plan_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(),
                           static_cast<Index>(sizeof(Scalar)), m_opts.block_q, m_opts.block_k);
    detail::tiled_backward<Scalar>(Q, K, V, bias, static_cast<Scalar>(scale), m_opts.causal, plan,
                                   result.output, result.lse, dO, g);
  }
  return g;
}

}  // namespace effattn
