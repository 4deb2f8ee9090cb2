/// \file vcc_tree_impl.hpp
/// \brief Internal: the partition helpers of `effattn::vcc` (`check_partition`, `decompress`,
/// `nonvip_rows`) and the members of `VccTree` (build, node and segment lookups, level means,
/// compress / decompress, update and select), on top of the selection of `vcc_select.hpp`.
/// Include <effattn/vcc_tree.hpp> (or <effattn/vcc.hpp>) instead.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../vcc_tree.hpp"
#include "vcc_select.hpp"

namespace effattn {

namespace vcc {

inline void check_partition(const std::vector<VccSegment>& J, Index n_c, const char* who) {
  Index next = 0;
  for (std::size_t j = 0; j < J.size(); ++j) {
    EFFATTN_CHECK(
        J[j].begin == next && J[j].count >= 1,
        detail::cat(who,
                    ": segments must be non-empty, sorted and contiguous, covering "
                    "[0, n_c) with n_c = ",
                    n_c, "; segment ", j, " is [", J[j].begin, ", ", J[j].begin + J[j].count,
                    ") but ", next, " was expected to start it"));
    next += J[j].count;
  }
  EFFATTN_CHECK(next == n_c, detail::cat(who, ": segments cover [0, ", next,
                                         ") but must cover [0, n_c) with n_c = ", n_c));
}

template <typename Scalar>
Matrix<Scalar> decompress(const std::vector<VccSegment>& J, const ConstRef<Scalar>& Y) {
  EFFATTN_CHECK(static_cast<Index>(J.size()) == Y.rows(),
                detail::cat("vcc::decompress: Y must be |J| x cols with |J| = ", J.size(),
                            "; got Y ", detail::shape(Y)));
  const Index n_c = J.empty() ? 0 : J.back().begin + J.back().count;
  check_partition(J, n_c, "vcc::decompress");
  Matrix<Scalar> out(n_c, Y.cols());
  for (Index c = 0; c < Y.cols(); ++c)
    for (std::size_t j = 0; j < J.size(); ++j)
      out.col(c).segment(J[j].begin, J[j].count).setConstant(Y(static_cast<Index>(j), c));
  return out;
}

inline std::vector<Index> nonvip_rows(Index n, const std::vector<Index>& vip) {
  std::vector<Index> rows;
  rows.reserve(static_cast<std::size_t>(std::max<Index>(0, n - static_cast<Index>(vip.size()))));
  std::size_t p = 0;
  for (Index t = 0; t < n; ++t) {
    if (p < vip.size() && vip[p] == t) {
      ++p;
      continue;
    }
    rows.push_back(t);
  }
  return rows;
}

}  // namespace vcc

template <typename Scalar_>
void VccTree<Scalar_>::build(const Ref& C) {
  EFFATTN_CHECK(
      C.rows() > 0 && C.cols() > 0,
      detail::cat("VccTree::build: C must be n_c x d with n_c, d >= 1; got C ", detail::shape(C)));
  detail::check_finite(C, "C");
  RowMatrix leaves = C;
  build_from_rows(std::move(leaves));
}

template <typename Scalar_>
void VccTree<Scalar_>::build_from_rows(RowMatrix&& leaves) {
  m_n = leaves.rows();
  m_d = leaves.cols();
  m_depth = detail::ceil_log2(m_n);
  m_delta.assign(static_cast<std::size_t>(m_depth), RowMatrix());
  RowMatrix cur = std::move(leaves);
  for (Index l = 0; l < m_depth; ++l) {
    const Index np = num_nodes(l + 1), nc = num_nodes(l);
    RowMatrix par(np, m_d);
    // Parents from children, then children -> deltas in place. Row chunks are independent.
    detail::vcc_for_rows(np, [&](Index p0, Index p1) {
      for (Index p = p0; p < p1; ++p) {
        const Index c1 = 2 * p + 1;
        detail::vcc_combine(par.row(p), cur.row(2 * p), node_count(l, 2 * p),
                            cur.row(std::min(c1, nc - 1)), c1 < nc ? node_count(l, c1) : 0);
      }
    });
    detail::vcc_for_rows(nc, [&](Index x0, Index x1) {
      for (Index x = x0; x < x1; ++x) cur.row(x) = par.row(x / 2) - cur.row(x);
    });
    m_delta[static_cast<std::size_t>(l)] = std::move(cur);
    cur = std::move(par);
  }
  m_root = cur.row(0);
}

template <typename Scalar_>
VccNode VccTree<Scalar_>::node_of(const VccSegment& s) const {
  const Index l = detail::ceil_log2(s.count);
  const bool ok = s.count >= 1 && s.begin >= 0 && l <= m_depth && (s.begin >> l << l) == s.begin &&
                  s.begin < m_n && node_count(l, s.begin >> l) == s.count;
  EFFATTN_CHECK(ok, detail::cat("VccTree: segment [", s.begin, ", ", s.begin + s.count,
                                ") is not a node of the dyadic tree over n_c = ", m_n,
                                " rows (a node (l, x) covers [x 2^l, min((x+1) 2^l, n_c)))"));
  return VccNode{l, s.begin >> l};
}

template <typename Scalar_>
VccSegment VccTree<Scalar_>::segment_of(Index l, Index x) const {
  const Index c = node_count(l, x);
  return VccSegment{x << l, c, detail::ceil_log2(c)};
}

template <typename Scalar_>
RowVector<Scalar_> VccTree<Scalar_>::mean(Index l, Index x) const {
  EFFATTN_CHECK(m_n > 0 && l >= 0 && l <= m_depth && x >= 0 && x < num_nodes(l),
                detail::cat("VccTree::mean: node (", l, ", ", x, ") does not exist (depth ",
                            m_depth, ", n_c = ", m_n, ")"));
  RowVector<Scalar> c = m_root;
  for (Index k = m_depth - 1; k >= l; --k) c -= deltas(k).row(x >> (k - l));
  return c;
}

template <typename Scalar_>
typename VccTree<Scalar_>::RowMatrix VccTree<Scalar_>::level_means_rows(Index l) const {
  EFFATTN_CHECK(m_n > 0 && l >= 0 && l <= m_depth,
                detail::cat("VccTree::level_means: level ", l, " not in [0, ", m_depth, "]"));
  RowMatrix cur = m_root;
  for (Index k = m_depth - 1; k >= l; --k) {
    const RowMatrix& D = deltas(k);
    RowMatrix nxt(D.rows(), m_d);
    detail::vcc_for_rows(D.rows(), [&](Index x0, Index x1) {
      for (Index x = x0; x < x1; ++x) nxt.row(x) = cur.row(x / 2) - D.row(x);
    });
    cur = std::move(nxt);
  }
  return cur;
}

template <typename Scalar_>
typename VccTree<Scalar_>::MatrixType VccTree<Scalar_>::means(
    const std::vector<VccSegment>& J) const {
  vcc::check_partition(J, m_n, "VccTree::means");
  MatrixType out(static_cast<Index>(J.size()), m_d);
  detail::VccPathWalker<Scalar> w(*this);
  for (std::size_t j = 0; j < J.size(); ++j) {
    const VccNode v = node_of(J[j]);
    out.row(static_cast<Index>(j)) = w.walk(v.level, v.index);
  }
  return out;
}

template <typename Scalar_>
VccCompressed<Scalar_> VccTree<Scalar_>::compress(const std::vector<VccSegment>& J) const {
  VccCompressed<Scalar> c;
  c.means = means(J);
  c.counts.reserve(J.size());
  for (const auto& s : J) c.counts.push_back(s.count);
  return c;
}

template <typename Scalar_>
typename VccTree<Scalar_>::MatrixType VccTree<Scalar_>::decompress(const std::vector<VccSegment>& J,
                                                                   const Ref& Y) const {
  vcc::check_partition(J, m_n, "VccTree::decompress");
  return vcc::decompress<Scalar>(J, Y);
}

template <typename Scalar_>
typename VccTree<Scalar_>::MatrixType VccTree<Scalar_>::materialize() const {
  EFFATTN_CHECK(m_n > 0, "VccTree::materialize: the tree is empty");
  return level_means_rows(0);
}

template <typename Scalar_>
VccUpdateStats VccTree<Scalar_>::update(const std::vector<VccSegment>& J, const Ref& Y) {
  vcc::check_partition(J, m_n, "VccTree::update");
  EFFATTN_CHECK(Y.rows() == static_cast<Index>(J.size()) && Y.cols() == m_d,
                detail::cat("VccTree::update: Y must be |J| x d = ", J.size(), " x ", m_d,
                            "; got Y ", detail::shape(Y)));
  detail::check_finite(Y, "Y");
  VccUpdateStats st;
  // Nodes of J grouped by level, each list in increasing x (J is sorted by begin).
  std::vector<std::vector<std::pair<Index, Index>>> at(static_cast<std::size_t>(m_depth + 1));
  for (std::size_t j = 0; j < J.size(); ++j) {
    const VccNode v = node_of(J[j]);
    at[static_cast<std::size_t>(v.level)].emplace_back(v.index, static_cast<Index>(j));
  }
  // Dirty nodes of the current level: (x, row in `vals`), sorted by x.
  std::vector<Index> dx, carried_x;
  RowMatrix vals, carried;
  for (Index l = 0; l <= m_depth; ++l) {
    const auto& here = at[static_cast<std::size_t>(l)];
    // Merge J nodes of this level with the parents carried up from the level below.
    dx.clear();
    vals.resize(static_cast<Index>(here.size() + carried_x.size()), m_d);
    std::size_t a = 0, b = 0;
    while (a < here.size() || b < carried_x.size()) {
      const Index row = static_cast<Index>(dx.size());
      if (b >= carried_x.size() || (a < here.size() && here[a].first < carried_x[b])) {
        dx.push_back(here[a].first);
        vals.row(row) = Y.row(here[a].second);
        ++a;
      } else {
        EFFATTN_ASSERT(a >= here.size() || here[a].first != carried_x[b]);
        dx.push_back(carried_x[b]);
        vals.row(row) = carried.row(static_cast<Index>(b));
        ++b;
      }
    }
    if (l == m_depth) {
      EFFATTN_ASSERT(dx.size() == 1 && dx[0] == 0);
      m_root = vals.row(0);
      st.touched.push_back(VccNode{l, 0});
      break;
    }
    // New parents: both children of every parent are dirty (J is a partition).
    carried_x.clear();
    carried.resize(static_cast<Index>(dx.size()), m_d);
    RowMatrix& D = m_delta[static_cast<std::size_t>(l)];
    for (std::size_t i = 0; i < dx.size();) {
      const Index p = dx[i] / 2;
      const bool pair = i + 1 < dx.size() && dx[i + 1] / 2 == p;
      EFFATTN_ASSERT(dx[i] == 2 * p && (pair || !has_two_children(l + 1, p)));
      const Index row = static_cast<Index>(carried_x.size());
      const Index vi = static_cast<Index>(i);
      detail::vcc_combine(carried.row(row), vals.row(vi), node_count(l, 2 * p),
                          vals.row(pair ? vi + 1 : vi), pair ? node_count(l, 2 * p + 1) : 0);
      for (std::size_t c = i; c < i + (pair ? 2 : 1); ++c) {
        D.row(dx[c]) = carried.row(row) - vals.row(static_cast<Index>(c));
        st.touched.push_back(VccNode{l, dx[c]});
      }
      carried_x.push_back(p);
      i += pair ? 2 : 1;
    }
    carried.conservativeResize(static_cast<Index>(carried_x.size()), m_d);
  }
  return st;
}

template <typename Scalar_>
std::vector<VccSegment> VccTree<Scalar_>::select(const Ref& P, const VccSelectOptions& o) const {
  EFFATTN_CHECK(m_n > 0, "VccTree::select: the tree is empty");
  EFFATTN_CHECK(
      detail::is_one_of(o.select, {vcc::SelectKind::TwoLevel, vcc::SelectKind::BestFirstDyadic,
                                   vcc::SelectKind::Uniform}),
      "VccTree::select: select must be a vcc::SelectKind");
  EFFATTN_CHECK(detail::is_one_of(o.score, {vcc::ScoreKind::MeanProb, vcc::ScoreKind::SumExp}),
                "VccTree::select: score must be a vcc::ScoreKind");
  detail::vcc_check_select_options(o.block_size, o.fine_blocks, "VccTree::select");
  detail::check_scale_option(o.scale, "VccTree::select");
  EFFATTN_CHECK(o.segments >= 0,
                detail::cat("VccTree::select: segments must be >= 0; got ", o.segments));
  EFFATTN_CHECK(P.rows() == 0 || P.cols() == m_d,
                detail::cat("VccTree::select: P must be n_p x d with d = ", m_d, "; got P ",
                            detail::shape(P)));
  detail::check_finite(P, "P");
  detail::VccSelectRule rule;
  rule.who = "VccTree::select";
  rule.fixed = o.segments > 0;
  rule.segments = std::min(o.segments, m_n);
  rule.block_size = o.block_size;
  rule.fine_blocks = o.fine_blocks;
  rule.lookahead = o.lookahead;
  const Matrix<Scalar> QPs = P * static_cast<Scalar>(detail::resolve_scale(o.scale, m_d));
  const detail::VccTreeKeys<Scalar> keys{*this};
  detail::VccSelectReport rep;
  const bool mean_prob = o.score == vcc::ScoreKind::MeanProb;
  switch (o.select) {
    case vcc::SelectKind::TwoLevel:
      return mean_prob
                 ? detail::vcc_select<policy::TwoLevel, policy::MeanProb>(keys, QPs, rule, rep)
                 : detail::vcc_select<policy::TwoLevel, policy::SumExp>(keys, QPs, rule, rep);
    case vcc::SelectKind::BestFirstDyadic:
      return mean_prob ? detail::vcc_select<policy::BestFirstDyadic, policy::MeanProb>(keys, QPs,
                                                                                       rule, rep)
                       : detail::vcc_select<policy::BestFirstDyadic, policy::SumExp>(keys, QPs,
                                                                                     rule, rep);
    case vcc::SelectKind::Uniform:
      return detail::vcc_select<policy::Uniform, policy::MeanProb>(keys, QPs, rule, rep);
  }
  return {};  // unreachable: the kinds are validated above
}

}  // namespace effattn
