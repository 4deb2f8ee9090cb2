/// \file vcc_tree.hpp
/// \brief VCC's public building blocks: segments (`VccSegment`), the policy tags of `effattn::vcc`,
/// the partition helpers and the count-weighted dyadic tree `VccTree` (T(C) of Zeng et al.,
/// NeurIPS 2023, Sec. 3.4 / App. 6.3). `<effattn/vcc.hpp>` includes it.
#pragma once

#include <Eigen/SparseCore>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/parallel.hpp"
#include "core/types.hpp"

namespace effattn {

/// \ingroup Methods
/// One segment of a partition J of the n_c non-VIP rows (one row b_x^s of S_c): the rows
/// [begin, begin + count) of C, where C is the non-VIP rows in their original order.
struct VccSegment {
  Index begin = 0;  ///< first row (in C's numbering, 0-based)
  Index count = 0;  ///< number of rows s >= 1
  /// Level of the dyadic tree node with exactly this range, the lowest one when a ragged tail
  /// makes several levels cover the same rows (-1: not a dyadic node, e.g. a TwoLevel block of a
  /// block size that is not a power of two). Informational: the tree derives it itself.
  Index level = -1;
  friend bool operator==(const VccSegment& a, const VccSegment& b) {
    return a.begin == b.begin && a.count == b.count;
  }
  friend bool operator!=(const VccSegment& a, const VccSegment& b) { return !(a == b); }
};

/// A node (level, index) of `VccTree`: level 0 holds the single rows, the node (l, x) covers
/// the rows [x 2^l, min((x + 1) 2^l, n_c)).
struct VccNode {
  Index level = 0;
  Index index = 0;
  friend bool operator==(const VccNode& a, const VccNode& b) {
    return a.level == b.level && a.index == b.index;
  }
  friend bool operator<(const VccNode& a, const VccNode& b) {
    return a.level != b.level ? a.level < b.level : a.index < b.index;
  }
};

/// What `VccTree::update` changed.
struct VccUpdateStats {
  /// Nodes whose stored row was recomputed (their delta, or the root mean for the root), in
  /// level order. Everything else, in particular every node strictly below J, is untouched.
  std::vector<VccNode> touched;
};

/// S_c C with the segment sizes: `means` is |J| x d (row j = mean of segment j), `counts` the s_j.
template <typename Scalar>
struct VccCompressed {
  Matrix<Scalar> means;
  std::vector<Index> counts;
};

namespace vcc {

/// Selection policy (runtime form of the tags below).
enum class SelectKind {
  TwoLevel,         ///< the paper's experiments and code: k-blocks, the h best become fine
  BestFirstDyadic,  ///< budgeted best-first refinement of the dyadic tree (library extension)
  Uniform           ///< no VIP guidance: near-equal dyadic segments (the pooling baseline)
};
/// Score policy (runtime form of the tags below).
enum class ScoreKind {
  MeanProb,  ///< mean over VIP rows of the softmax probability (official code; default)
  SumExp     ///< log sum over VIP rows of exp(logit) (eq. 53)
};
/// What the non-VIP output rows are (runtime form of the tags below).
enum class NonVipKind {
  Decompress,  ///< paper: compressed rows attend, each token gets its segment's output
  ExactQuery,  ///< every non-VIP query attends to the compressed keys (not the paper's method)
  VipOnly      ///< non-VIP rows are left at 0; cost linear in n
};

/// \ingroup Policies
/// Selection: TwoLevel (paper Sec. 4 and official code, default). C is cut into blocks of
/// `block_size` k; the h blocks with the highest VIP score are expanded to single tokens.
/// |J| = ceil(n_c / k) + sum over fine blocks of (size - 1).
struct TwoLevel {
  static constexpr SelectKind kind = SelectKind::TwoLevel;
};
/// \ingroup Policies
/// Selection: best-first refinement of the dyadic tree (library extension, not in the paper):
/// a max-heap over the current segments, splitting the best until |J| = r - n_p. The priority is
/// mass-weighted, log(s) + log(score), so levels compare (an unweighted eq. 53 keeps refining
/// small segments). Refinements nest as the budget grows.
struct BestFirstDyadic {
  static constexpr SelectKind kind = SelectKind::BestFirstDyadic;
};
/// \ingroup Policies
/// Selection: no VIP guidance; split the largest segment first (ties: leftmost), giving
/// near-equal dyadic segments. The uniform-pooling baseline, and the fallback when n_p = 0.
struct Uniform {
  static constexpr SelectKind kind = SelectKind::Uniform;
};
/// \ingroup Policies
/// Score: mean over VIP rows i of p_i(seg) = exp(tau q_i.kbar + log s - lse_i), with lse_i the
/// row's log-sum-exp over a reference partition (TwoLevel: the k-blocks; best-first: the tree
/// level of size ~k), all with the log-count bias. Official code (Sec. 3.3 "averaged attention
/// scores"); default.
struct MeanProb {
  static constexpr ScoreKind kind = ScoreKind::MeanProb;
};
/// \ingroup Policies
/// Score: eq. 53 with the mass weight, log sum_i exp(tau q_i.kbar + log s), in log space.
struct SumExp {
  static constexpr ScoreKind kind = ScoreKind::SumExp;
};
/// \ingroup Policies
/// Non-VIP rows: decompression (paper): Ybar = softmax(tau Qbar_J K'^T + b) V', token t of
/// segment j gets Ybar_j. Cost O(|J| r d).
struct Decompress {
  static constexpr NonVipKind kind = NonVipKind::Decompress;
};
/// \ingroup Policies
/// Non-VIP rows: every query attends to the compressed keys, O(n_c r d). Not the paper's method.
struct ExactQuery {
  static constexpr NonVipKind kind = NonVipKind::ExactQuery;
};
/// \ingroup Policies
/// Non-VIP rows are not computed (left at 0). Cost linear in n.
struct VipOnly {
  static constexpr NonVipKind kind = NonVipKind::VipOnly;
};

}  // namespace vcc

/// Options of `VccTree::select` (and of the selection inside `VccAttention`).
struct VccSelectOptions {
  vcc::SelectKind select = vcc::SelectKind::TwoLevel;  ///< selection policy
  vcc::ScoreKind score = vcc::ScoreKind::MeanProb;     ///< score policy
  /// |J|, the number of segments to produce (the compressed length without the VIP rows).
  /// 0 = the two-level length ceil(n_c / k) + h (k - 1) with k = block_size, h = fine_blocks.
  /// Capped at n_c.
  Index segments = 0;
  /// k: TwoLevel block size (a power of two for the tree); best-first MeanProb normalises each
  /// query over the tree level whose nodes have ~k rows.
  Index block_size = 16;
  /// h: TwoLevel fine blocks when `segments` is 0 (otherwise h is the largest that fits).
  Index fine_blocks = 90;
  /// Logit scale; 0 = 1/sqrt(d).
  double scale = 0;
  /// BestFirstDyadic only: rank segments by the estimated gain of splitting them instead of by
  /// their mass (library extension; see `VccOptions::lookahead`).
  bool lookahead = false;
};

namespace vcc {

/// Throws `invalid_argument` unless `J` is sorted, contiguous, made of non-empty segments and
/// covers [0, n_c) exactly (eq. 25 of the paper: disjoint and covering). O(|J|).
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

/// S_c^dagger Y = S_c^T D Y (Claim 6.3): row t of the n_c x cols result is row j(t) of Y, the row
/// of the segment containing t. O(n_c cols).
/// \throws effattn::invalid_argument if Y.rows() != |J| or J is not a partition.
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

/// The sparse |J| x n_c matrix S_c: row j holds 1/s_j on segment j (eq. 22). For tests and
/// inspection; the library never forms it.
template <typename Scalar>
Eigen::SparseMatrix<Scalar, Eigen::RowMajor> explicit_Sc(const std::vector<VccSegment>& J,
                                                         Index n_c) {
  check_partition(J, n_c, "vcc::explicit_Sc");
  Eigen::SparseMatrix<Scalar, Eigen::RowMajor> S(static_cast<Index>(J.size()), n_c);
  std::vector<Index> per_row;
  per_row.reserve(J.size());
  for (const auto& s : J) per_row.push_back(s.count);
  S.reserve(per_row);
  for (std::size_t j = 0; j < J.size(); ++j)
    for (Index t = 0; t < J[j].count; ++t)
      S.insert(static_cast<Index>(j), J[j].begin + t) = Scalar(1) / static_cast<Scalar>(J[j].count);
  S.makeCompressed();
  return S;
}

/// The non-VIP rows 0 <= t < n, in order (the row order of C). `vip` must be sorted and unique.
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

namespace detail {

/// Smallest L with 2^L >= n (0 for n <= 1).
inline Index ceil_log2(Index n) {
  Index L = 0;
  while ((Index(1) << L) < n) ++L;
  return L;
}

/// Rows covered by node (l, x) of the dyadic tree over n rows.
inline Index vcc_node_count(Index n, Index l, Index x) {
  return std::min((x + 1) << l, n) - (x << l);
}
/// Whether node (l, x) of the tree over n rows has two children.
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
  if (chunks <= 1) {
    body(Index(0), rows);
    return;
  }
  parallel_for(
      chunks, [] { return 0; },
      [&](Index t, int&) { body(t * kVccRowChunk, std::min(rows, (t + 1) * kVccRowChunk)); });
}

}  // namespace detail

/// \ingroup Methods
/// \brief The count-weighted dyadic tree T(C) of VCC (Zeng et al., "VCC: Scaling Transformers to
/// 128K Tokens or More by Prioritizing Important Tokens", NeurIPS 2023, Sec. 3.4 and App. 6.3).
///
/// For C (n_c x d, any n_c >= 1) it stores the root mean c_root and, for every other node, the
/// difference to its parent \f$ \Delta c_x^{(l)} = c_{\lfloor x/2 \rfloor}^{(l+1)} - c_x^{(l)} \f$
/// (eq. 15), level by level as contiguous row-major blocks, about 2 n_c d numbers. Node (l, x)
/// covers rows [x 2^l, min((x+1) 2^l, n_c)); lengths need not be powers of two: the last node of
/// a level may be ragged, a parent is the count-weighted mean of its children and a lone child
/// copies up (its delta is exactly 0). Any node mean is the root minus the deltas on its path
/// (eq. 16/63).
///
/// | operation | cost |
/// |---|---|
/// | `build(C)` | O(n_c d) |
/// | `mean(l, x)` | O(log(n_c) d) |
/// | `compress(J)` = S_c C and the counts | O((|J| + log n_c) d) amortised (shared path prefixes) |
/// | `decompress(J, Y)` = S_c^dagger Y | O(n_c d) |
/// | `update(J, Y)` (Alg. 2) | O((|J| + log n_c) d); touches only J and its ancestors |
/// | `materialize()` | O(n_c d) |
/// | `select(P, options)` | see `VccSelectOptions` |
///
/// `update(J, Y)` makes the tree represent C + S_c^dagger (Y - S_c C): each segment moves by the
/// same vector (Claim 6.4), so the deltas strictly below J keep their bits. This is what lets a
/// multi-layer model keep its hidden states in the tree and pay O(r) per layer
/// (examples/vcc_stack.cpp).
///
/// \par Example
/// \code{.cpp}
/// Eigen::MatrixXd C = Eigen::MatrixXd::Random(1000, 16);
/// effattn::VccTreed T(C);
/// std::vector<effattn::VccSegment> J = {{0, 512}, {512, 256}, {768, 232}};
/// auto S = T.compress(J);                          // 3 x 16 means, counts {512, 256, 232}
/// Eigen::MatrixXd Y = S.means.array() + 1.0;       // new segment states
/// auto stats = T.update(J, Y);                     // every row of C moved by +1
/// Eigen::MatrixXd C2 = T.materialize();            // == C.array() + 1
/// \endcode
///
/// \par Threading
/// Const members may be called concurrently; `build` and `update` modify the tree.
template <typename Scalar_>
class VccTree {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");

 public:
  using Scalar = Scalar_;
  using MatrixType = Matrix<Scalar>;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Ref = ConstRef<Scalar>;

  /// An empty tree (size() == 0).
  VccTree() = default;
  /// `build(C)`.
  explicit VccTree(const Ref& C) { build(C); }

  /// Builds T(C) bottom-up: pairwise count-weighted means (eq. 14), then the deltas. O(n_c d).
  /// \throws effattn::invalid_argument if C is empty or not finite.
  void build(const Ref& C) {
    EFFATTN_CHECK(C.rows() > 0 && C.cols() > 0,
                  detail::cat("VccTree::build: C must be n_c x d with n_c, d >= 1; got C ",
                              detail::shape(C)));
    detail::check_finite(C, "C");
    RowMatrix leaves = C;
    build_from_rows(std::move(leaves));
  }

  /// As `build`, from a row-major matrix that is moved in (no copy).
  void build_from_rows(RowMatrix&& leaves) {
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

  /// n_c, the number of leaves (0 for an empty tree).
  Index size() const noexcept { return m_n; }
  /// d, the width of every node.
  Index dim() const noexcept { return m_d; }
  /// Level of the root: ceil(log2 n_c).
  Index depth() const noexcept { return m_depth; }
  /// Nodes on level l: ceil(n_c / 2^l).
  Index num_nodes(Index l) const noexcept { return ((m_n - 1) >> l) + 1; }
  /// First row covered by node (l, x).
  Index node_begin(Index l, Index x) const noexcept { return x << l; }
  /// Rows covered by node (l, x): 2^l, or fewer for the ragged last node of a level.
  Index node_count(Index l, Index x) const noexcept { return detail::vcc_node_count(m_n, l, x); }
  /// Whether node (l, x) has two children (otherwise it has one, or none on level 0).
  bool has_two_children(Index l, Index x) const noexcept {
    return detail::vcc_has_two_children(m_n, l, x);
  }
  /// The lowest node covering exactly the rows of `s`.
  /// \throws effattn::invalid_argument if no node does (s is not a dyadic segment of this tree).
  VccNode node_of(const VccSegment& s) const {
    const Index l = detail::ceil_log2(s.count);
    const bool ok = s.count >= 1 && s.begin >= 0 && l <= m_depth &&
                    (s.begin >> l << l) == s.begin && s.begin < m_n &&
                    node_count(l, s.begin >> l) == s.count;
    EFFATTN_CHECK(ok, detail::cat("VccTree: segment [", s.begin, ", ", s.begin + s.count,
                                  ") is not a node of the dyadic tree over n_c = ", m_n,
                                  " rows (a node (l, x) covers [x 2^l, min((x+1) 2^l, n_c)))"));
    return VccNode{l, s.begin >> l};
  }
  /// The segment of node (l, x), with its (lowest) level.
  VccSegment segment_of(Index l, Index x) const {
    const Index c = node_count(l, x);
    return VccSegment{x << l, c, detail::ceil_log2(c)};
  }

  /// Stored deltas of level l < depth() (num_nodes(l) x d, row x = parent mean - node mean).
  const RowMatrix& deltas(Index l) const { return m_delta[static_cast<std::size_t>(l)]; }
  /// The root mean (1 x d).
  const RowVector<Scalar>& root() const noexcept { return m_root; }

  /// Mean of node (l, x): the walk root - sum of the deltas on the path (eq. 63). O(depth d).
  RowVector<Scalar> mean(Index l, Index x) const {
    EFFATTN_CHECK(m_n > 0 && l >= 0 && l <= m_depth && x >= 0 && x < num_nodes(l),
                  detail::cat("VccTree::mean: node (", l, ", ", x, ") does not exist (depth ",
                              m_depth, ", n_c = ", m_n, ")"));
    RowVector<Scalar> c = m_root;
    for (Index k = m_depth - 1; k >= l; --k) c -= deltas(k).row(x >> (k - l));
    return c;
  }

  /// All node means of level l (num_nodes(l) x d), top-down. O(n_c d / 2^l).
  MatrixType level_means(Index l) const { return level_means_rows(l); }

  /// Row-major `level_means` (internal use by the selection).
  RowMatrix level_means_rows(Index l) const {
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

  /// Means of the segments of J (|J| x d): rows of S_c C. Consecutive segments share the walk
  /// from the root, so the cost is O(d) per distinct node visited, O((|J| + depth) d) for a
  /// partition.
  /// \throws effattn::invalid_argument if J is not a partition of [0, n_c) into tree nodes.
  MatrixType means(const std::vector<VccSegment>& J) const {
    vcc::check_partition(J, m_n, "VccTree::means");
    MatrixType out(static_cast<Index>(J.size()), m_d);
    PathWalker w(*this);
    for (std::size_t j = 0; j < J.size(); ++j) {
      const VccNode v = node_of(J[j]);
      out.row(static_cast<Index>(j)) = w.walk(v.level, v.index);
    }
    return out;
  }

  /// S_c C and the segment sizes (the compressed sequence of Claim 6.2).
  VccCompressed<Scalar> compress(const std::vector<VccSegment>& J) const {
    VccCompressed<Scalar> c;
    c.means = means(J);
    c.counts.reserve(J.size());
    for (const auto& s : J) c.counts.push_back(s.count);
    return c;
  }

  /// S_c^dagger Y (n_c x Y.cols()): every row of segment j receives Y.row(j).
  MatrixType decompress(const std::vector<VccSegment>& J, const Ref& Y) const {
    vcc::check_partition(J, m_n, "VccTree::decompress");
    return vcc::decompress<Scalar>(J, Y);
  }

  /// The full C (n_c x d), top-down: child = parent - delta. O(n_c d).
  MatrixType materialize() const {
    EFFATTN_CHECK(m_n > 0, "VccTree::materialize: the tree is empty");
    return level_means_rows(0);
  }

  /// Algorithm 2 of the paper: the tree of C_new = C + S_c^dagger (Y - S_c C), where J is a
  /// partition into tree nodes and row j of Y the new state of segment j (Claim 6.5:
  /// S_c C_new = Y). Level by level from the leaves, each dirty node gets its new parent mean
  /// (count-weighted mean of the two new children) and its delta is recomputed; the parent becomes
  /// dirty. Only J and its ancestors are touched (<= 2|J| + depth nodes, O(d) each); deltas
  /// strictly below J keep their bits (Claim 6.4).
  /// \throws effattn::invalid_argument if J is not a partition into tree nodes, Y is not |J| x d
  ///         or not finite.
  VccUpdateStats update(const std::vector<VccSegment>& J, const Ref& Y) {
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

  /// Chooses a partition J of [0, n_c) into tree nodes guided by the queries P (n_p x d, one
  /// row per VIP query, in the space of the tree's rows: score of a node = scale <p_i, c>).
  /// See `VccSelectOptions` for the policies. Deterministic (ties: higher score, then smaller
  /// begin) and independent of the thread count.
  /// \throws effattn::invalid_argument on bad options or an infeasible budget.
  std::vector<VccSegment> select(const Ref& P, const VccSelectOptions& o) const;

 private:
  // Walk from the root with a cached path: consecutive nodes reuse the common prefix.
  struct PathWalker {
    const VccTree& t;
    RowMatrix path;         // row k: mean of the node on level k of the current path
    std::vector<Index> px;  // x of that node, -1 when invalid
    explicit PathWalker(const VccTree& tree)
        : t(tree),
          path(tree.m_depth + 1, tree.m_d),
          px(static_cast<std::size_t>(tree.m_depth + 1), -1) {
      path.row(t.m_depth) = t.m_root;
      px[static_cast<std::size_t>(t.m_depth)] = 0;
    }
    // Mean of node (l, x). path.row(k) is always the mean of node (k, px[k]), so the walk
    // restarts below the lowest level whose cached node is an ancestor of (l, x).
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

  Index m_n = 0, m_d = 0, m_depth = 0;
  std::vector<RowMatrix> m_delta;
  RowVector<Scalar> m_root;
};

/// Tree over float rows.
using VccTreef = VccTree<float>;
/// Tree over double rows.
using VccTreed = VccTree<double>;

}  // namespace effattn

#include "detail/vcc_select.hpp"
