/// \file vcc_select.hpp
/// \brief Internal part of `<effattn/vcc.hpp>`: row runs around the VIP tokens, segment means,
/// the VIP scores and the three selection policies (TwoLevel, BestFirstDyadic, Uniform), and
/// `VccTree::select`. Include `<effattn/vcc.hpp>` instead.
///
/// Determinism: every loop that runs in parallel has a decomposition fixed by the shapes (score
/// tiles of kVccScoreTile candidates, one task per column for the segment sums); partial results
/// are merged in a fixed order, and the logits are GEMVs (one per candidate), which Eigen never
/// threads and which give equal candidates equal bits. Selection is therefore bit-identical for any
/// thread count, and so are its ties (higher priority first, then the smaller begin).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <vector>

#include "../vcc_tree.hpp"

namespace effattn {
namespace detail {

/// A maximal run of non-VIP rows: C rows [c0, c0 + len) are the original rows [o0, o0 + len).
struct VccRun {
  Index c0 = 0, o0 = 0, len = 0;
};

/// The runs of non-VIP rows between the (sorted, unique) VIP rows. At most n_p + 1 runs.
inline std::vector<VccRun> vcc_runs(Index n, const std::vector<Index>& vip) {
  std::vector<VccRun> runs;
  Index next = 0, c = 0;
  for (const Index v : vip) {
    if (v > next) {
      runs.push_back(VccRun{c, next, v - next});
      c += v - next;
    }
    next = v + 1;
  }
  if (n > next) runs.push_back(VccRun{c, next, n - next});
  return runs;
}

/// Calls f(original_row, length) for each piece of the C rows [b, b + cnt) (a segment may
/// straddle VIP rows: spec pitfall 8). `ri` is a cursor into `runs` that only moves forward, so a
/// pass over a sorted partition costs O(|J| + runs).
template <typename F>
void vcc_for_pieces(const std::vector<VccRun>& runs, std::size_t& ri, Index b, Index cnt, F&& f) {
  while (runs[ri].c0 + runs[ri].len <= b) ++ri;
  const Index e = b + cnt;
  std::size_t k = ri;
  for (Index t = b; t < e;) {
    const VccRun& R = runs[k];
    const Index off = t - R.c0, take = std::min(R.len - off, e - t);
    f(R.o0 + off, take);
    t += take;
    if (t >= R.c0 + R.len) ++k;
  }
}

/// out.row(row0 + j) = mean over segment j of the rows of X (original numbering, VIP rows
/// skipped). Sums in double (also for float). The pieces of every segment are listed once, then
/// one task per column walks them (contiguous reads of the column-major X): O(n_c cols).
template <typename Scalar, typename Out>
void vcc_segment_means(const ConstRef<Scalar>& X, const std::vector<VccRun>& runs,
                       const std::vector<VccSegment>& J, Out& out, Index row0) {
  // Flattened pieces (original row, length); piece_end[j] = one past segment j's last piece.
  std::vector<Index> piece_row, piece_len, piece_end;
  piece_row.reserve(J.size() + runs.size());
  piece_len.reserve(J.size() + runs.size());
  piece_end.reserve(J.size());
  std::size_t ri = 0;
  for (const VccSegment& s : J) {
    vcc_for_pieces(runs, ri, s.begin, s.count, [&](Index o, Index len) {
      piece_row.push_back(o);
      piece_len.push_back(len);
    });
    piece_end.push_back(static_cast<Index>(piece_row.size()));
  }
  parallel_for(
      X.cols(), [] { return 0; },
      [&](Index c, int&) {
        const auto col = X.col(c);
        std::size_t p = 0;
        for (std::size_t j = 0; j < J.size(); ++j) {
          const std::size_t pe = static_cast<std::size_t>(piece_end[j]);
          if (J[j].count == 1) {  // a single row: copy, no rounding
            out(row0 + static_cast<Index>(j), c) = col(piece_row[p]);
            p = pe;
            continue;
          }
          double acc = 0;
          for (; p < pe; ++p) {
            const Index o = piece_row[p], len = piece_len[p];
            if (len <= 32) {
              for (Index t = o; t < o + len; ++t) acc += static_cast<double>(col(t));
            } else {
              acc += col.segment(o, len).template cast<double>().sum();
            }
          }
          out(row0 + static_cast<Index>(j), c) =
              static_cast<Scalar>(acc / static_cast<double>(J[j].count));
        }
      });
}

/// out rows of segment j (original numbering) = Y.row(row0 + j): the decompression S_c^dagger.
template <typename Scalar>
void vcc_scatter_segments(const Matrix<Scalar>& Y, Index row0, const std::vector<VccRun>& runs,
                          const std::vector<VccSegment>& J, Matrix<Scalar>& out) {
  parallel_for(
      Y.cols(), [] { return 0; },
      [&](Index c, int&) {
        std::size_t ri = 0;
        for (std::size_t j = 0; j < J.size(); ++j) {
          const Scalar y = Y(row0 + static_cast<Index>(j), c);
          vcc_for_pieces(runs, ri, J[j].begin, J[j].count,
                         [&](Index o, Index len) { out.col(c).segment(o, len).setConstant(y); });
        }
      });
}

/// The non-VIP rows of X as a row-major n_c x cols matrix (the tree's input).
template <typename Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> vcc_gather_rows(
    const ConstRef<Scalar>& X, const std::vector<VccRun>& runs, Index n_c) {
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> R(n_c, X.cols());
  for (const VccRun& run : runs) R.middleRows(run.c0, run.len) = X.middleRows(run.o0, run.len);
  return R;
}

/// Candidates scored per task.
constexpr Index kVccScoreTile = 256;

template <typename Scalar>
struct VccScoreWorkspace {
  Matrix<Scalar> s;                                 ///< n_p x tile logits
  Eigen::Array<double, Eigen::Dynamic, 1> z, a, b;  ///< n_p
  VccScoreWorkspace(Index np, Index tile) : s(np, tile), z(np), a(np), b(np) {}
};

/// Per query row i: lse_i = log sum_b exp(z_ib + logc_b) with z = QPs M^T (QPs already scaled).
/// Max-subtracted, summed in double; tiles of candidates in parallel, merged in tile order.
template <typename Scalar, typename MD>
Eigen::Array<double, Eigen::Dynamic, 1> vcc_row_lse(const Matrix<Scalar>& QPs,
                                                    const Eigen::MatrixBase<MD>& M,
                                                    const std::vector<double>& logc) {
  const Index np = QPs.rows(), nb = M.rows();
  const Index tiles = (nb + kVccScoreTile - 1) / kVccScoreTile;
  Matrix<double> tmax(np, tiles), tsum(np, tiles);
  parallel_for(
      tiles, [&] { return VccScoreWorkspace<Scalar>(np, std::min(nb, kVccScoreTile)); },
      [&](Index t, VccScoreWorkspace<Scalar>& ws) {
        const Index b0 = t * kVccScoreTile, w = std::min(kVccScoreTile, nb - b0);
        auto S = ws.s.leftCols(w);
        // One GEMV per candidate rather than one GEMM per tile: GEMM kernels take different
        // code paths for edge columns, so equal candidates could get different last bits and
        // break exact ties; a GEMV treats every candidate identically.
        for (Index c = 0; c < w; ++c) S.col(c).noalias() = QPs * M.row(b0 + c).transpose();
        ws.a.setConstant(-std::numeric_limits<double>::infinity());
        for (Index c = 0; c < w; ++c)
          ws.a = ws.a.max(S.col(c).template cast<double>().array() +
                          logc[static_cast<std::size_t>(b0 + c)]);
        ws.b.setZero();
        for (Index c = 0; c < w; ++c)
          ws.b += (S.col(c).template cast<double>().array() +
                   logc[static_cast<std::size_t>(b0 + c)] - ws.a)
                      .exp();
        tmax.col(t) = ws.a.matrix();
        tsum.col(t) = ws.b.matrix();
      });
  Eigen::Array<double, Eigen::Dynamic, 1> lse(np);
  for (Index i = 0; i < np; ++i) {
    const double mx = tmax.row(i).maxCoeff();
    double total = 0;
    for (Index t = 0; t < tiles; ++t) total += tsum(i, t) * std::exp(tmax(i, t) - mx);
    lse(i) = mx + std::log(total);
  }
  return lse;
}

/// log of the (weighted) score of one candidate from its n_p logits z (double, already including
/// the log-count and, for MeanProb, minus the row normalisers): log sum_i exp(z_i).
/// NaN (overflowed logits) becomes -inf so that orderings stay strict; the attention itself then
/// reports the non-finite result.
inline double vcc_log_sum_exp(const Eigen::Array<double, Eigen::Dynamic, 1>& z) {
  const double mx = z.maxCoeff();
  if (!std::isfinite(mx))
    return mx == std::numeric_limits<double>::infinity() ? mx
                                                         : -std::numeric_limits<double>::infinity();
  const double v = mx + std::log((z - mx).exp().sum());
  return std::isnan(v) ? -std::numeric_limits<double>::infinity() : v;
}

/// Priorities of every candidate row of M: log sum_i exp(z_ib + logc_b - off_i), where off is
/// the MeanProb row normaliser (empty for SumExp).
template <typename Scalar, typename MD>
std::vector<double> vcc_priorities(const Matrix<Scalar>& QPs, const Eigen::MatrixBase<MD>& M,
                                   const std::vector<double>& logc,
                                   const Eigen::Array<double, Eigen::Dynamic, 1>& off) {
  const Index np = QPs.rows(), nb = M.rows();
  const Index tiles = (nb + kVccScoreTile - 1) / kVccScoreTile;
  std::vector<double> prio(static_cast<std::size_t>(nb));
  parallel_for(
      tiles, [&] { return VccScoreWorkspace<Scalar>(np, std::min(nb, kVccScoreTile)); },
      [&](Index t, VccScoreWorkspace<Scalar>& ws) {
        const Index b0 = t * kVccScoreTile, w = std::min(kVccScoreTile, nb - b0);
        auto S = ws.s.leftCols(w);
        // One GEMV per candidate rather than one GEMM per tile: GEMM kernels take different
        // code paths for edge columns, so equal candidates could get different last bits and
        // break exact ties; a GEMV treats every candidate identically.
        for (Index c = 0; c < w; ++c) S.col(c).noalias() = QPs * M.row(b0 + c).transpose();
        for (Index c = 0; c < w; ++c) {
          ws.z = S.col(c).template cast<double>().array() + logc[static_cast<std::size_t>(b0 + c)];
          if (off.size() > 0) ws.z -= off;
          prio[static_cast<std::size_t>(b0 + c)] = vcc_log_sum_exp(ws.z);
        }
      });
  return prio;
}

inline bool vcc_is_pow2(Index k) {
  return k > 0 && (k & (k - 1)) == 0;
}

/// TwoLevel: rank the nb blocks of size k by priority (desc, then begin asc) and expand the best
/// h to single rows. h = min(h_req, nb) when m == 0, else the largest h with
/// nb + sum over the h best blocks of (size - 1) <= m (a prefix of the ranking, so partitions
/// nest as m grows). Returns J in row order.
inline std::vector<VccSegment> vcc_two_level(Index n_c, Index k, const std::vector<double>& prio,
                                             Index m, Index h_req, Index& h_out) {
  const Index nb = static_cast<Index>(prio.size());
  auto cnt = [&](Index b) { return std::min(k, n_c - b * k); };
  std::vector<Index> order(static_cast<std::size_t>(nb));
  std::iota(order.begin(), order.end(), Index(0));
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) {
    return prio[static_cast<std::size_t>(a)] > prio[static_cast<std::size_t>(b)];
  });
  Index h = 0;
  if (m == 0) {
    h = std::min(h_req, nb);
  } else {
    Index total = nb;
    while (h < nb && total + cnt(order[static_cast<std::size_t>(h)]) - 1 <= m) {
      total += cnt(order[static_cast<std::size_t>(h)]) - 1;
      ++h;
    }
  }
  std::vector<char> fine(static_cast<std::size_t>(nb), 0);
  for (Index i = 0; i < h; ++i)
    fine[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = 1;
  std::vector<VccSegment> J;
  const bool dyadic = vcc_is_pow2(k);
  for (Index b = 0; b < nb; ++b) {
    if (fine[static_cast<std::size_t>(b)]) {
      for (Index t = 0; t < cnt(b); ++t) J.push_back(VccSegment{b * k + t, 1, 0});
    } else {
      J.push_back(VccSegment{b * k, cnt(b), dyadic ? ceil_log2(cnt(b)) : Index(-1)});
    }
  }
  h_out = h;
  return J;
}

/// All-singleton partition of [0, n_c).
inline std::vector<VccSegment> vcc_singletons(Index n_c) {
  std::vector<VccSegment> J(static_cast<std::size_t>(n_c));
  for (Index t = 0; t < n_c; ++t) J[static_cast<std::size_t>(t)] = VccSegment{t, 1, 0};
  return J;
}

/// Heap entry of the best-first and uniform refinements (max-heap on priority, ties: smaller
/// begin first).
struct VccHeapEntry {
  double prio;
  Index begin, level, x, slot;
};
struct VccHeapLess {
  bool operator()(const VccHeapEntry& a, const VccHeapEntry& b) const {
    return a.prio != b.prio ? a.prio < b.prio : a.begin > b.begin;
  }
};

/// Uniform: m near-equal dyadic segments of [0, n_c): split the largest splittable node first
/// (ties: leftmost). Shape only, O(m log m).
inline std::vector<VccSegment> vcc_uniform(Index n_c, Index m) {
  m = std::min(m, n_c);
  std::priority_queue<VccHeapEntry, std::vector<VccHeapEntry>, VccHeapLess> heap;
  std::vector<VccSegment> J;
  auto push = [&](Index l, Index x) {
    while (l > 0 && !vcc_has_two_children(n_c, l, x)) {
      --l;
      x *= 2;
    }
    const Index c = vcc_node_count(n_c, l, x);
    if (c == 1)
      J.push_back(VccSegment{x << l, 1, 0});
    else
      heap.push(VccHeapEntry{static_cast<double>(c), x << l, l, x, 0});
  };
  push(ceil_log2(n_c), 0);
  while (static_cast<Index>(heap.size() + J.size()) < m && !heap.empty()) {
    const VccHeapEntry e = heap.top();
    heap.pop();
    push(e.level - 1, 2 * e.x);
    push(e.level - 1, 2 * e.x + 1);
  }
  for (; !heap.empty(); heap.pop()) {
    const VccHeapEntry& e = heap.top();
    J.push_back(VccSegment{e.begin, vcc_node_count(n_c, e.level, e.x), e.level});
  }
  std::sort(J.begin(), J.end(),
            [](const VccSegment& a, const VccSegment& b) { return a.begin < b.begin; });
  return J;
}

/// BestFirstDyadic over a built tree of the keys: start from the root, repeatedly split the
/// segment of highest mass-weighted priority log s + log score (MeanProb: normalised per query
/// row over the tree level of ~block_size rows; SumExp: eq. 53) until |J| = m. Children means
/// come from the parent's mean minus the stored delta, O(d); each priority is a GEMV
/// O(n_p d). Total O(m n_p d + n_c d / block_size * n_p) plus the tree.
/// With `lookahead` (library option, off by default) the priority is instead the estimated gain of
/// the split, log sum_i (mass_i(a) + mass_i(b) - mass_i(node)) for the children a, b: it stops
/// refining smooth stretches whose mean already carries their mass and so spreads the budget
/// over every attended region (measured on make_smooth_vip, n = 4096: about 2x lower VIP error
/// than the spec's priority at |J| = 128..2048; see tests/test_vcc.cpp). Costs 3 GEMVs per push.
template <typename Scalar>
std::vector<VccSegment> vcc_best_first(const VccTree<Scalar>& T, const Matrix<Scalar>& QPs, Index m,
                                       vcc::ScoreKind score, Index block_size, bool lookahead) {
  using RowMatrix = typename VccTree<Scalar>::RowMatrix;
  const Index n_c = T.size(), d = T.dim(), np = QPs.rows();
  m = std::min(m, n_c);
  if (m >= n_c) return vcc_singletons(n_c);
  Eigen::Array<double, Eigen::Dynamic, 1> off;
  if (score == vcc::ScoreKind::MeanProb) {
    Index lref = 0;
    while (lref < T.depth() && (Index(2) << lref) <= block_size) ++lref;
    const RowMatrix Mref = T.level_means_rows(lref);
    std::vector<double> logc(static_cast<std::size_t>(Mref.rows()));
    for (Index x = 0; x < Mref.rows(); ++x)
      logc[static_cast<std::size_t>(x)] = std::log(static_cast<double>(T.node_count(lref, x)));
    off = vcc_row_lse(QPs, Mref, logc);
  }
  RowMatrix slots(2 * m + 2, d);
  Index next_slot = 0;
  Vector<Scalar> zs(np);
  Eigen::Array<double, Eigen::Dynamic, 1> z(np), za(np), zb(np);
  RowVector<Scalar> tmp(d);
  std::priority_queue<VccHeapEntry, std::vector<VccHeapEntry>, VccHeapLess> heap;
  std::vector<VccSegment> J;
  auto push = [&](Index l, Index x, Index slot) {
    while (l > 0 && !T.has_two_children(l, x)) {  // lone child: same rows, delta exactly 0
      slots.row(slot) -= T.deltas(l - 1).row(2 * x);
      --l;
      x *= 2;
    }
    const Index c = T.node_count(l, x);
    if (c == 1) {
      J.push_back(VccSegment{x << l, 1, 0});
      return;
    }
    // Per VIP row: z_i = tau q_i.mean + log s (- lse_i for MeanProb), the log of the row's
    // estimated attention mass on the segment.
    auto logits = [&](const auto& mean_row, Index cnt,
                      Eigen::Array<double, Eigen::Dynamic, 1>& out) {
      zs.noalias() = QPs * mean_row.transpose();  // GEMV: never threaded by Eigen
      out = zs.template cast<double>().array() + std::log(static_cast<double>(cnt));
      if (off.size() > 0) out -= off;
    };
    logits(slots.row(slot), c, z);
    double prio = vcc_log_sum_exp(z);
    if (lookahead) {
      // Gain of splitting: sum_i (mass(a) + mass(b) - mass(node)) >= 0 (Jensen: the logit is
      // linear in the mean, and the node mean is the count-weighted mean of a and b).
      tmp = slots.row(slot) - T.deltas(l - 1).row(2 * x);
      logits(tmp, T.node_count(l - 1, 2 * x), za);
      tmp = slots.row(slot) - T.deltas(l - 1).row(2 * x + 1);
      logits(tmp, T.node_count(l - 1, 2 * x + 1), zb);
      const double M = std::max({za.maxCoeff(), zb.maxCoeff(), z.maxCoeff()});
      const double g = ((za - M).exp() + (zb - M).exp() - (z - M).exp()).sum();
      prio = std::isfinite(M) && g > 0 ? M + std::log(g) : -std::numeric_limits<double>::infinity();
    }
    heap.push(VccHeapEntry{prio, x << l, l, x, slot});
  };
  slots.row(next_slot) = T.root();
  push(T.depth(), 0, next_slot++);
  while (static_cast<Index>(heap.size() + J.size()) < m && !heap.empty()) {
    const VccHeapEntry e = heap.top();
    heap.pop();
    for (Index c = 2 * e.x; c <= 2 * e.x + 1; ++c) {
      const Index s = next_slot++;
      slots.row(s) = slots.row(e.slot) - T.deltas(e.level - 1).row(c);
      push(e.level - 1, c, s);
    }
  }
  for (; !heap.empty(); heap.pop()) {
    const VccHeapEntry& e = heap.top();
    J.push_back(VccSegment{e.begin, T.node_count(e.level, e.x), e.level});
  }
  std::sort(J.begin(), J.end(),
            [](const VccSegment& a, const VccSegment& b) { return a.begin < b.begin; });
  return J;
}

/// Validates `VccSelectOptions` (shared by the tree and the attention functor).
inline void vcc_check_select_options(Index block_size, Index fine_blocks, const char* who) {
  EFFATTN_CHECK(block_size >= 1, cat(who, ": block_size (k) must be >= 1; got ", block_size));
  EFFATTN_CHECK(fine_blocks >= 0, cat(who, ": fine_blocks (h) must be >= 0; got ", fine_blocks));
}

/// The two-level length ceil(n_c / k) + h (k - 1), saturated at n_c.
inline Index vcc_auto_segments(Index n_c, Index k, Index h) {
  const Index nb = (n_c + k - 1) / k;
  if (h > 0 && k - 1 > (n_c - nb) / h) return n_c;
  return std::min(n_c, nb + h * (k - 1));
}

}  // namespace detail

template <typename Scalar_>
std::vector<VccSegment> VccTree<Scalar_>::select(const Ref& P, const VccSelectOptions& o) const {
  EFFATTN_CHECK(m_n > 0, "VccTree::select: the tree is empty");
  detail::vcc_check_select_options(o.block_size, o.fine_blocks, "VccTree::select");
  detail::check_scale_option(o.scale, "VccTree::select");
  EFFATTN_CHECK(o.segments >= 0,
                detail::cat("VccTree::select: segments must be >= 0; got ", o.segments));
  EFFATTN_CHECK(P.rows() == 0 || P.cols() == m_d,
                detail::cat("VccTree::select: P must be n_p x d with d = ", m_d, "; got P ",
                            detail::shape(P)));
  detail::check_finite(P, "P");
  const Index k = o.block_size, nb = (m_n + k - 1) / k;
  const Index m =
      o.segments > 0 ? std::min(o.segments, m_n) : detail::vcc_auto_segments(m_n, k, o.fine_blocks);
  if (P.rows() == 0 || o.select == vcc::SelectKind::Uniform) return detail::vcc_uniform(m_n, m);
  if (m >= m_n) return detail::vcc_singletons(m_n);
  const Matrix<Scalar> QPs = P * static_cast<Scalar>(detail::resolve_scale(o.scale, m_d));
  if (o.select == vcc::SelectKind::BestFirstDyadic)
    return detail::vcc_best_first(*this, QPs, m, o.score, k, o.lookahead);
  EFFATTN_CHECK(detail::vcc_is_pow2(k),
                detail::cat("VccTree::select: TwoLevel on the tree needs a power-of-two "
                            "block_size (blocks are tree nodes); got ",
                            k));
  EFFATTN_CHECK(
      o.segments == 0 || m >= nb,
      detail::cat("VccTree::select: TwoLevel needs segments >= ceil(n_c / k) = ", nb, "; got ", m));
  Index lk = 0;
  while ((Index(1) << lk) < k && lk < m_depth) ++lk;
  const RowMatrix Mb = level_means_rows(lk);
  std::vector<double> logc(static_cast<std::size_t>(Mb.rows()));
  for (Index x = 0; x < Mb.rows(); ++x)
    logc[static_cast<std::size_t>(x)] = std::log(static_cast<double>(node_count(lk, x)));
  const Eigen::Array<double, Eigen::Dynamic, 1> off =
      o.score == vcc::ScoreKind::MeanProb ? detail::vcc_row_lse(QPs, Mb, logc)
                                          : Eigen::Array<double, Eigen::Dynamic, 1>();
  const std::vector<double> prio = detail::vcc_priorities(QPs, Mb, logc, off);
  Index h = 0;
  return detail::vcc_two_level(m_n, Index(1) << lk, prio, o.segments > 0 ? m : 0, o.fine_blocks, h);
}

}  // namespace effattn
