/// \file vcc_tree.hpp
/// \brief VCC's public building blocks: segments (`VccSegment`), the selection and score policies
/// (the tags `policy::TwoLevel`, `policy::BestFirstDyadic`, `policy::Uniform`, `policy::MeanProb`,
/// `policy::SumExp` and their runtime forms `vcc::SelectKind`, `vcc::ScoreKind`), the partition
/// helpers and the count-weighted dyadic tree `VccTree` (T(C) of Zeng et al., NeurIPS 2023,
/// Sec. 3.4 / App. 6.3). `<effattn/vcc.hpp>` includes it. The definitions are included at the
/// end: the selection that `VccTree::select` and `VccAttention` share in
/// `detail/methods/vcc_select.hpp`, which includes the tree's members and the partition helpers
/// (`detail/methods/vcc_tree_impl.hpp`).
#pragma once

#include <algorithm>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
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
  /// Same rows (the level is informational and not compared).
  friend bool operator==(const VccSegment& a, const VccSegment& b) {
    return a.begin == b.begin && a.count == b.count;
  }
  /// Different rows.
  friend bool operator!=(const VccSegment& a, const VccSegment& b) { return !(a == b); }
};

/// A node (level, index) of `VccTree`: level 0 holds the single rows, the node (l, x) covers
/// the rows [x 2^l, min((x + 1) 2^l, n_c)).
struct VccNode {
  Index level = 0;  ///< l, 0 for the leaves
  Index index = 0;  ///< x, the position on the level
  /// Same node.
  friend bool operator==(const VccNode& a, const VccNode& b) {
    return a.level == b.level && a.index == b.index;
  }
  /// Level order, then index.
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
  Matrix<Scalar> means;       ///< |J| x d segment means
  std::vector<Index> counts;  ///< s_j, the rows of each segment
};

namespace policy {
/// \ingroup Policies
/// VCC selection: TwoLevel (paper Sec. 4 and official code, default). C is cut into blocks of
/// `block_size` k; the h blocks with the highest VIP score are expanded to single tokens.
/// |J| = ceil(n_c / k) + sum over fine blocks of (size - 1). Cost O((n_c / k) n_p d).
struct TwoLevel {};
/// \ingroup Policies
/// VCC selection: best-first refinement of the dyadic tree (library extension, not in the paper):
/// a max-heap over the current segments, splitting the best until |J| = r - n_p. The priority is
/// mass-weighted, log(s) + log(score), so levels compare (an unweighted score, eq. 53 of the
/// paper, keeps refining small segments). Refinements nest as the budget grows. Cost
/// O(n_c d) for the tree plus O(|J| n_p d).
struct BestFirstDyadic {};
/// \ingroup Policies
/// VCC selection without VIP guidance: split the largest segment first (ties: leftmost), giving
/// near-equal dyadic segments. The uniform-pooling baseline, and the fallback when n_p = 0.
struct Uniform {};
/// \ingroup Policies
/// VCC score: mean over VIP rows i of p_i(seg) = exp(tau q_i.kbar + log s - lse_i), with lse_i the
/// row's log-sum-exp over a reference partition (TwoLevel: the k-blocks; best-first: the tree
/// level of size ~k), all with the log-count bias. The official code's "averaged attention
/// scores" (Sec. 3.3); default.
struct MeanProb {};
/// \ingroup Policies
/// VCC score: eq. 53 of the paper with the mass weight, log sum_i exp(tau q_i.kbar + log s), in
/// log space.
struct SumExp {};
}  // namespace policy

namespace vcc {

/// Selection policy of `VccSelectOptions` (runtime form of the tags `policy::TwoLevel`,
/// `policy::BestFirstDyadic`, `policy::Uniform`).
enum class SelectKind {
  TwoLevel,         ///< the paper's experiments and code: k-blocks, the h best become fine
  BestFirstDyadic,  ///< budgeted best-first refinement of the dyadic tree (library extension)
  Uniform           ///< no VIP guidance: near-equal dyadic segments (the pooling baseline)
};
/// Score policy of `VccSelectOptions` (runtime form of `policy::MeanProb`, `policy::SumExp`).
enum class ScoreKind {
  MeanProb,  ///< mean over VIP rows of the softmax probability (official code; default)
  SumExp     ///< log sum over VIP rows of exp(logit) (eq. 53)
};

}  // namespace vcc

/// Options of `VccTree::select`, the runtime form of the selection inside `VccAttention` (which
/// takes the policies as tags and the numbers from `VccOptions`).
struct VccSelectOptions {
  vcc::SelectKind select = vcc::SelectKind::TwoLevel;  ///< selection policy
  vcc::ScoreKind score = vcc::ScoreKind::MeanProb;     ///< score policy
  /// |J|, the number of segments to produce (the compressed length without the VIP rows).
  /// 0 = the two-level length ceil(n_c / k) + h (k - 1) with k = block_size, h = fine_blocks.
  /// Capped at n_c. TwoLevel with queries needs at least ceil(n_c / k).
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
inline void check_partition(const std::vector<VccSegment>& J, Index n_c, const char* who);

/// S_c^dagger Y = S_c^T D Y (Claim 6.3 of the paper): row t of the n_c x cols result is row j(t)
/// of Y, the row of the segment containing t. O(n_c cols).
/// \throws effattn::invalid_argument if Y.rows() != |J| or J is not a partition.
template <typename Scalar>
Matrix<Scalar> decompress(const std::vector<VccSegment>& J, const ConstRef<Scalar>& Y);

/// The non-VIP rows 0 <= t < n, in order (the row order of C). `vip` must be sorted and unique.
inline std::vector<Index> nonvip_rows(Index n, const std::vector<Index>& vip);

}  // namespace vcc

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
  using Scalar = Scalar_;             ///< float or double
  using MatrixType = Matrix<Scalar>;  ///< `Matrix<Scalar>`
  /// The storage of the levels (row-major: a node is one contiguous row).
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Ref = ConstRef<Scalar>;  ///< the input type, `ConstRef<Scalar>`

  /// An empty tree (size() == 0).
  VccTree() = default;
  /// `build(C)`.
  explicit VccTree(const Ref& C) { build(C); }

  /// Builds T(C) bottom-up: pairwise count-weighted means (eq. 14), then the deltas. O(n_c d).
  /// \throws effattn::invalid_argument if C is empty or not finite.
  void build(const Ref& C);

  /// As `build`, from a row-major matrix that is moved in (no copy, no checks).
  void build_from_rows(RowMatrix&& leaves);

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
  Index node_count(Index l, Index x) const noexcept {
    return std::min((x + 1) << l, m_n) - (x << l);
  }
  /// Whether node (l, x) has two children (otherwise it has one, or none on level 0).
  bool has_two_children(Index l, Index x) const noexcept {
    return l > 0 && ((2 * x + 1) << (l - 1)) < m_n;
  }
  /// The lowest node covering exactly the rows of `s`.
  /// \throws effattn::invalid_argument if no node does (s is not a dyadic segment of this tree).
  VccNode node_of(const VccSegment& s) const;
  /// The segment of node (l, x), with its (lowest) level.
  VccSegment segment_of(Index l, Index x) const;

  /// Stored deltas of level l < depth() (num_nodes(l) x d, row x = parent mean - node mean).
  const RowMatrix& deltas(Index l) const { return m_delta[static_cast<std::size_t>(l)]; }
  /// The root mean (1 x d).
  const RowVector<Scalar>& root() const noexcept { return m_root; }

  /// Mean of node (l, x): the walk root - sum of the deltas on the path (eq. 63). O(depth d).
  /// \throws effattn::invalid_argument if the node does not exist.
  RowVector<Scalar> mean(Index l, Index x) const;

  /// All node means of level l (num_nodes(l) x d), top-down. O(n_c d / 2^l).
  /// \throws effattn::invalid_argument if the level does not exist.
  MatrixType level_means(Index l) const { return level_means_rows(l); }

  /// Row-major `level_means` (what the selection reads).
  RowMatrix level_means_rows(Index l) const;

  /// Means of the segments of J (|J| x d): rows of S_c C. Consecutive segments share the walk
  /// from the root, so the cost is O(d) per distinct node visited, O((|J| + depth) d) for a
  /// partition.
  /// \throws effattn::invalid_argument if J is not a partition of [0, n_c) into tree nodes.
  MatrixType means(const std::vector<VccSegment>& J) const;

  /// S_c C and the segment sizes (the compressed sequence of Claim 6.2).
  /// \throws effattn::invalid_argument as `means`.
  VccCompressed<Scalar> compress(const std::vector<VccSegment>& J) const;

  /// S_c^dagger Y (n_c x Y.cols()): every row of segment j receives Y.row(j).
  /// \throws effattn::invalid_argument if J is not a partition of [0, n_c) or Y is not |J| rows.
  MatrixType decompress(const std::vector<VccSegment>& J, const Ref& Y) const;

  /// The full C (n_c x d), top-down: child = parent - delta. O(n_c d).
  /// \throws effattn::invalid_argument if the tree is empty.
  MatrixType materialize() const;

  /// Algorithm 2 of the paper: the tree of C_new = C + S_c^dagger (Y - S_c C), where J is a
  /// partition into tree nodes and row j of Y the new state of segment j (Claim 6.5:
  /// S_c C_new = Y). Level by level from the leaves, each dirty node gets its new parent mean
  /// (count-weighted mean of the two new children) and its delta is recomputed; the parent becomes
  /// dirty. Only J and its ancestors are touched (<= 2|J| + depth nodes, O(d) each); deltas
  /// strictly below J keep their bits (Claim 6.4).
  /// \throws effattn::invalid_argument if J is not a partition into tree nodes, Y is not |J| x d
  ///         or not finite.
  VccUpdateStats update(const std::vector<VccSegment>& J, const Ref& Y);

  /// Chooses a partition J of [0, n_c) into tree nodes guided by the queries P (n_p x d, one
  /// row per VIP query, in the space of the tree's rows: score of a node = scale <p_i, c>).
  /// See `VccSelectOptions` for the policies. Deterministic (ties: higher score, then smaller
  /// begin) and independent of the thread count.
  ///
  /// This is the selection of `VccAttention` (one implementation, the same rules: |J| from
  /// `segments` or the two-level length, capped at n_c; TwoLevel with queries needs
  /// |J| >= ceil(n_c / k); no queries = Uniform; |J| = n_c = singletons), run on the tree: the
  /// TwoLevel blocks are the tree nodes of level log2(k), so k must be a power of two and the
  /// block means are the tree's node means (VccAttention averages the rows of K directly, so the
  /// two agree up to the rounding of the means), and an infeasible |J| always throws (there is
  /// no clamp_budget). Compared with the earlier separate implementation only the order of the
  /// checks changed (the |J| >= ceil(n_c / k) check comes first, before the power-of-two check)
  /// and its message; every partition is the same.
  /// \throws effattn::invalid_argument on bad options, an empty tree, P not n_p x d or not
  ///         finite, or an infeasible |J|.
  std::vector<VccSegment> select(const Ref& P, const VccSelectOptions& o) const;

 private:
  Index m_n = 0, m_d = 0, m_depth = 0;
  std::vector<RowMatrix> m_delta;
  RowVector<Scalar> m_root;
};

/// Tree over float rows.
using VccTreef = VccTree<float>;
/// Tree over double rows.
using VccTreed = VccTree<double>;

}  // namespace effattn

#include "detail/methods/vcc_select.hpp"

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(VccTree<float>)
EFFATTN_EXTERN_INSTANCE(VccTree<double>)
}  // namespace effattn
#endif
