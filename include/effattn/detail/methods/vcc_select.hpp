/// \file vcc_select.hpp
/// \brief Internal part of `<effattn/vcc_tree.hpp>` (and so of `<effattn/vcc.hpp>`): row runs
/// around the VIP tokens, segment means, the VIP scores, the three selection policies (TwoLevel,
/// BestFirstDyadic, Uniform), `detail::vcc_select` (the one selection that `VccAttention` and
/// `VccTree::select` both call). The members of `VccTree` and the partition helpers of
/// `effattn::vcc` are in `vcc_tree_impl.hpp`, included at the end.
///
/// Determinism: every loop that runs in parallel has a decomposition fixed by the shapes (score
/// tiles of kVccScoreTile candidates, one task per column for the segment sums, row chunks of
/// kVccRowChunk for the tree levels); partial results are merged in a fixed order, and the logits
/// are GEMVs (one per candidate), which Eigen never threads and which give equal candidates equal
/// bits. Selection is therefore bit-identical for any thread count, and so are its ties (higher
/// priority first, then the smaller begin).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../vcc_tree.hpp"

namespace effattn {
namespace detail {

/// Smallest L with 2^L >= n (0 for n <= 1).
inline Index ceil_log2(Index n) {
  Index L = 0;
  while ((Index(1) << L) < n) ++L;
  return L;
}

/// Rows covered by node (l, x) of the dyadic tree over n rows (`VccTree::node_count` without a
/// tree).
inline Index vcc_node_count(Index n, Index l, Index x) {
  return std::min((x + 1) << l, n) - (x << l);
}
/// Whether node (l, x) of the tree over n rows has two children (`VccTree::has_two_children`).
inline bool vcc_has_two_children(Index n, Index l, Index x) {
  return l > 0 && ((2 * x + 1) << (l - 1)) < n;
}

/// parent = count-weighted mean of its children (a lone child copies up). Shared by build and
/// update so both produce the same bits for the same inputs.
template <typename Dst, typename A, typename B>
void vcc_combine(Dst&& dst, const A& a, Index na, const B& b, Index nb) {
  using Scalar = typename std::decay_t<Dst>::Scalar;
  if (nb == 0) {
    dst = a;
  } else if (na == nb) {
    dst = (a + b) * Scalar(0.5);
  } else {
    const Scalar wa = static_cast<Scalar>(static_cast<double>(na) / static_cast<double>(na + nb));
    const Scalar wb = static_cast<Scalar>(static_cast<double>(nb) / static_cast<double>(na + nb));
    dst = a * wa + b * wb;
  }
}

/// Rows per task of the tree's parallel loops (a fixed decomposition: thread-count invariant).
constexpr Index kVccRowChunk = 1024;

/// body(r0, r1) over [0, rows) in chunks of kVccRowChunk rows: in parallel when there are several
/// chunks, inline otherwise (small levels open no OpenMP region). Row-wise work only, so the
/// result does not depend on the split.
template <typename Body>
void vcc_for_rows(Index rows, Body&& body) {
  const Index chunks = (rows + kVccRowChunk - 1) / kVccRowChunk;
  parallel_for_if(chunks > 1, chunks,
                  [&](Index t) { body(t * kVccRowChunk, std::min(rows, (t + 1) * kVccRowChunk)); });
}

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
/// straddle VIP rows). `ri` is a cursor into `runs` that only moves forward, so a
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
template <typename = void>  // instantiated where used (compile cost)
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
/// than the plain mass priority at |J| = 128..2048; see tests/test_vcc.cpp). Costs 3 GEMVs per
/// push.
template <typename Scalar>
std::vector<VccSegment> vcc_best_first(const VccTree<Scalar>& T, const Matrix<Scalar>& QPs, Index m,
                                       bool mean_prob, Index block_size, bool lookahead) {
  using RowMatrix = typename VccTree<Scalar>::RowMatrix;
  const Index n_c = T.size(), d = T.dim(), np = QPs.rows();
  m = std::min(m, n_c);
  if (m >= n_c) return vcc_singletons(n_c);
  Eigen::Array<double, Eigen::Dynamic, 1> off;
  if (mean_prob) {
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
/// The keys of a selection given as the rows of K (`VccAttention`): the n_c non-VIP rows, read
/// through the runs around the VIP rows.
template <typename Scalar>
struct VccRowKeys {
  const ConstRef<Scalar>& K;          ///< n x d, every row
  const std::vector<VccRun>& runs;    ///< the runs of non-VIP rows
  Index n_c;                          ///< number of non-VIP rows
  Index rows() const { return n_c; }  ///< n_c
  /// TwoLevel: the ceil(n_c / k) block means (direct sums in double) and their log counts.
  Matrix<Scalar> block_means(Index k, std::vector<double>& logc) const {
    const Index nb = (n_c + k - 1) / k;
    std::vector<VccSegment> blocks(static_cast<std::size_t>(nb));
    logc.assign(static_cast<std::size_t>(nb), 0.0);
    for (Index b = 0; b < nb; ++b) {
      const Index c = std::min(k, n_c - b * k);
      blocks[static_cast<std::size_t>(b)] = VccSegment{b * k, c, -1};
      logc[static_cast<std::size_t>(b)] = std::log(static_cast<double>(c));
    }
    Matrix<Scalar> Kb(nb, K.cols());
    vcc_segment_means<Scalar>(K, runs, blocks, Kb, 0);
    return Kb;
  }
  /// BestFirstDyadic: the tree of the non-VIP rows, built here (O(n_c d)).
  VccTree<Scalar> tree() const {
    VccTree<Scalar> t;
    t.build_from_rows(vcc_gather_rows<Scalar>(K, runs, n_c));
    return t;
  }
};

/// The keys of a selection given as a built tree (`VccTree::select`).
template <typename Scalar>
struct VccTreeKeys {
  const VccTree<Scalar>& T;                ///< the tree of the n_c rows
  Index rows() const { return T.size(); }  ///< n_c
  /// TwoLevel: the blocks are the nodes of level log2(k) (k must be a power of two), their means
  /// the tree's node means.
  typename VccTree<Scalar>::RowMatrix block_means(Index k, std::vector<double>& logc) const {
    EFFATTN_CHECK(vcc_is_pow2(k), cat("VccTree::select: TwoLevel on the tree needs a power-of-two "
                                      "block_size (blocks are tree nodes); got ",
                                      k));
    Index lk = 0;
    while ((Index(1) << lk) < k && lk < T.depth()) ++lk;
    typename VccTree<Scalar>::RowMatrix Mb = T.level_means_rows(lk);
    logc.assign(static_cast<std::size_t>(Mb.rows()), 0.0);
    for (Index x = 0; x < Mb.rows(); ++x)
      logc[static_cast<std::size_t>(x)] = std::log(static_cast<double>(T.node_count(lk, x)));
    return Mb;
  }
  /// BestFirstDyadic: the tree itself.
  const VccTree<Scalar>& tree() const { return T; }
};

/// The numbers of one selection: `VccAttention` fills them from `VccOptions`, `VccTree::select`
/// from `VccSelectOptions`.
struct VccSelectRule {
  const char* who = "";  ///< the caller, for messages
  /// The requested number is VccAttention's r = n_p + |J| (`budget`), not |J| (messages only).
  bool budget_form = false;
  Index budget = 0;        ///< VccAttention's Options::budget (messages only)
  bool fixed = false;      ///< |J| was requested; otherwise the two-level length
  Index segments = 0;      ///< the requested |J| when `fixed` (may be < 1: infeasible), <= n_c
  Index block_size = 16;   ///< k
  Index fine_blocks = 90;  ///< h
  bool lookahead = false;  ///< BestFirstDyadic gain priority
  bool clamp = false;      ///< raise an infeasible |J| to the smallest feasible one
};

/// What the selection reports besides J.
struct VccSelectReport {
  Index fine_blocks = 0;          ///< TwoLevel: blocks expanded to single rows
  bool uniform_fallback = false;  ///< no VIP queries: Uniform was used
};

/// The message of an infeasible |J| (m_min: the smallest feasible |J|).
inline std::string vcc_infeasible_message(const VccSelectRule& rule, bool two_level, Index n_p,
                                          Index n_c, Index m_min) {
  if (rule.budget_form)
    return cat(rule.who, ": Options::budget r = ", rule.budget,
               " is infeasible: it must be >= n_p + ",
               two_level ? "ceil(n_c / k) = " : "1 = ", n_p + m_min, " (n_p = ", n_p,
               " VIP rows, n_c = ", n_c, two_level ? cat(", k = ", rule.block_size) : std::string(),
               "); set clamp_budget to raise it automatically");
  return cat(rule.who, ": segments = ", rule.segments, " is infeasible: ",
             two_level ? "TwoLevel with queries needs segments >= ceil(n_c / k) = " : ">= ", m_min,
             " (n_c = ", n_c, ", k = ", rule.block_size, ")");
}

/// The VCC selection, shared by `VccAttention` (keys `VccRowKeys`) and `VccTree::select` (keys
/// `VccTreeKeys`): the partition J of the n_c key rows guided by the n_p scaled VIP queries QPs
/// (rows tau q_i).
///
/// Rules, in order: |J| = m is the requested number or, when none is, the two-level length
/// ceil(n_c / k) + h (k - 1) (saturated at n_c); m below the smallest feasible value
/// (TwoLevel with queries: ceil(n_c / k); otherwise 1) throws, or is raised to it with `clamp`;
/// m is capped at n_c. Uniform, or no query (n_p = 0, reported as `uniform_fallback`), gives
/// the Uniform partition; m = n_c gives the singletons (TwoLevel reports every block fine);
/// otherwise TwoLevel scores the k-blocks (log-count bias included, MeanProb normalised over the
/// blocks) and expands the best, and BestFirstDyadic refines the tree of the keys.
/// Only the arms of `Select` and `Score` are instantiated.
template <typename Select, typename Score, typename Scalar, typename Keys>
std::vector<VccSegment> vcc_select(const Keys& keys, const Matrix<Scalar>& QPs,
                                   const VccSelectRule& rule, VccSelectReport& rep) {
  constexpr bool two_level = std::is_same_v<Select, policy::TwoLevel>;
  constexpr bool uniform = std::is_same_v<Select, policy::Uniform>;
  constexpr bool mean_prob = std::is_same_v<Score, policy::MeanProb>;
  static_assert(two_level || uniform || std::is_same_v<Select, policy::BestFirstDyadic>,
                "effattn: the VCC selection is policy::TwoLevel, policy::BestFirstDyadic or "
                "policy::Uniform");
  static_assert(mean_prob || std::is_same_v<Score, policy::SumExp>,
                "effattn: the VCC score is policy::MeanProb or policy::SumExp");
  const Index n_p = QPs.rows(), n_c = keys.rows(), k = rule.block_size, nb = (n_c + k - 1) / k;
  Index m = rule.fixed ? rule.segments : vcc_auto_segments(n_c, k, rule.fine_blocks);
  const Index m_min = two_level && n_p > 0 ? nb : 1;
  if (m < m_min) {
    EFFATTN_CHECK(rule.clamp, vcc_infeasible_message(rule, two_level, n_p, n_c, m_min));
    m = m_min;
  }
  m = std::min(m, n_c);
  if constexpr (uniform) {
    return vcc_uniform(n_c, m);
  } else {
    if (n_p == 0) {
      rep.uniform_fallback = true;
      return vcc_uniform(n_c, m);
    }
    if (m >= n_c) {
      if constexpr (two_level) rep.fine_blocks = nb;
      return vcc_singletons(n_c);
    }
    if constexpr (two_level) {
      std::vector<double> logc;
      const auto Kb = keys.block_means(k, logc);
      // MeanProb: each VIP row's softmax over the blocks, averaged over the rows (official
      // code). Deviation: the log-count bias is included in the logits, which changes nothing
      // for equal blocks and weighs a ragged last block by its true size.
      Eigen::Array<double, Eigen::Dynamic, 1> off;
      if constexpr (mean_prob) off = vcc_row_lse(QPs, Kb, logc);
      const std::vector<double> prio = vcc_priorities(QPs, Kb, logc, off);
      return vcc_two_level(n_c, k, prio, rule.fixed ? m : 0, rule.fine_blocks, rep.fine_blocks);
    } else {
      const auto& T = keys.tree();
      return vcc_best_first(T, QPs, m, mean_prob, k, rule.lookahead);
    }
  }
}

/// Walk from the root with a cached path: consecutive nodes reuse the common prefix.
template <typename Scalar>
struct VccPathWalker {
  const VccTree<Scalar>& t;
  typename VccTree<Scalar>::RowMatrix path;  ///< row k: mean of the node on level k of the path
  std::vector<Index> px;                     ///< x of that node, -1 when invalid
  explicit VccPathWalker(const VccTree<Scalar>& tree)
      : t(tree),
        path(tree.depth() + 1, tree.dim()),
        px(static_cast<std::size_t>(tree.depth() + 1), -1) {
    path.row(t.depth()) = t.root();
    px[static_cast<std::size_t>(t.depth())] = 0;
  }
  /// Mean of node (l, x). path.row(k) is always the mean of node (k, px[k]), so the walk
  /// restarts below the lowest level whose cached node is an ancestor of (l, x).
  auto walk(Index l, Index x) {
    Index k = l;
    while (px[static_cast<std::size_t>(k)] != (x >> (k - l))) ++k;  // the root always matches
    for (Index j = k - 1; j >= l; --j) {
      const Index xj = x >> (j - l);
      path.row(j) = path.row(j + 1) - t.deltas(j).row(xj);
      px[static_cast<std::size_t>(j)] = xj;
    }
    return path.row(l);
  }
};

}  // namespace detail

}  // namespace effattn

// The members of `VccTree` and the partition helpers of `effattn::vcc`, which use the selection
// above.
#include "vcc_tree_impl.hpp"
