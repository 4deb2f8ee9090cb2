/// \file rp_cholesky_impl.hpp
/// \brief Internals of effattn/numerics/rp_cholesky.hpp: the loops of the three pivot rules, the
/// Gaussian-coordinate point set of the provided kernels, and the out-of-class definitions of
/// `RpCholesky`, `ExpDotKernel` and `GaussianKernel`. Not a public header.
///
/// Notation (see rp_cholesky.hpp): K is the PSD kernel matrix the algorithm factorises (m x m),
/// w the per-point sampling weights (all ones if the kernel has none), F the row-major factor
/// (rows [0, k) hold the k pivots taken so far), res the residual diagonal diag(K - F^T F) with
/// entries <= tol set to zero, and p_l = w_l res_l the unnormalised pivot distribution, whose sum
/// is the (weighted) residual trace.
///
/// Precision split: the O(r m d) kernel rows and the O(r^2 m) factor updates (GEMM, triangular
/// solve by column tiles) run in the kernel's selection scalar S, the sequential bookkeeping in
/// double whatever S: res, w, the sampling prefix sums, the traces, the candidates' b x b residual
/// block and its rejection Cholesky. With S = double every value is what it was before the split
/// (the same operations on the same types); with S = float the GEMMs run at float speed (about
/// 2x) while sampling and the stopping rules keep double round-off (see `RpWork::commit_row`).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/parallel.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../numerics/rp_cholesky.hpp"

namespace effattn {
namespace detail {

/// out(i) = sum_c X(i, c)^2 in double, column by column: contiguous and vectorised for a
/// column-major X, where Eigen's rowwise() reduction walks every row with stride X.rows() (it was
/// 2-3% of WildCat at n = 16384 for the query norms alone).
/// Chunks of 4096 rows run in parallel (serially inside an enclosing region); the result does
/// not depend on the thread count.
template <typename Derived>
Vector<double> row_squared_norms(const Eigen::MatrixBase<Derived>& X) {
  constexpr Index kChunk = 4096;
  const Index n = X.rows();
  Vector<double> out = Vector<double>::Zero(n);
  auto chunk = [&](Index t) {
    const Index i0 = t * kChunk, h = std::min(kChunk, n - i0);
    for (Index c = 0; c < X.cols(); ++c)
      out.segment(i0, h).array() +=
          X.col(c).segment(i0, h).template cast<double>().array().square();
  };
  parallel_for_if(n > kChunk, (n + kChunk - 1) / kChunk, chunk);
  return out;
}

/// Compile-time check of the Kernel concept with one readable message per missing piece.
template <typename K>
constexpr void static_check_kernel() {
  static_assert(kernel_scalar<K>::valid,
                "effattn: an RPCholesky Kernel must define `using Scalar = float or double;` "
                "(the selection scalar; see the Kernel concept in numerics/rp_cholesky.hpp)");
  static_assert(has_kernel_size<K>::value,
                "effattn: an RPCholesky Kernel needs `Index size() const` (the m of the m x m "
                "kernel matrix)");
  static_assert(has_kernel_diagonal<K>::value,
                "effattn: an RPCholesky Kernel needs `void diagonal(Eigen::Ref<Vector<Scalar>> "
                "out) const` filling the m diagonal entries");
  static_assert(has_kernel_rows<K>::value,
                "effattn: an RPCholesky Kernel needs `void rows(const std::vector<Index>& idx, "
                "RowsRef<Scalar> out) const` filling out(j, :) = K(idx[j], :)");
}

/// out = K(idx, idx), via the kernel's `principal_submatrix` when it has one, else cut out of
/// |idx| full rows (O(|idx| m) extra work and memory).
template <typename K, typename S, typename Out>
void rp_principal_submatrix(const K& kernel, const std::vector<Index>& idx, Out& out) {
  if constexpr (has_principal_submatrix<K>::value) {
    kernel.principal_submatrix(idx, out);
  } else {
    const auto b = static_cast<Index>(idx.size());
    RowMajorMatrix<S> rows(b, kernel.size());
    kernel.rows(idx, rows);
    for (Index j = 0; j < b; ++j)
      for (Index i = 0; i < b; ++i) out(i, j) = rows(i, idx[static_cast<std::size_t>(j)]);
  }
}

// ---- The pivot rules ----

/// Working state shared by the three pivot rules; becomes the result at the end. F is in the
/// selection scalar S, everything else in double (see the file documentation).
template <typename S>
struct RpWork {
  Index m = 0;                 ///< kernel size
  Index r = 0;                 ///< pivot budget, min(rank, m)
  double tol = 0;              ///< residuals <= tol are zero (round-off threshold)
  double rel_tol = 0;          ///< stop once trace <= rel_tol * trace[0] (0 = off)
  RowMajorMatrix<S> F;         ///< r x m; rows [0, k) are final
  Vector<double> res;          ///< residual diagonal (thresholded)
  Vector<double> w;            ///< sampling weights; empty = all ones
  std::vector<double> prefix;  ///< cumulative sums of p, for inverse-CDF sampling
  std::vector<Index> pivots;   ///< pivots taken, in order
  std::vector<double> trace;   ///< weighted residual trace after 0, 1, ..., k pivots
  double initial_trace = 0;    ///< trace[0] as first computed (the rel_tol reference)
  RpStopReason stop = RpStopReason::RankReached;
  bool broke_down = false;  ///< a non-finite factor row was met
  Index proposals = 0, blocks = 0;

  Index k() const { return static_cast<Index>(pivots.size()); }

  /// sum_l w_l res_l.
  double weighted_trace() const {
    if (w.size() == 0) return res.sum();
    return (w.array() * res.array()).sum();
  }

  /// prefix[l] = p_0 + ... + p_l (left to right); returns the total.
  double build_prefix() {
    prefix.resize(static_cast<std::size_t>(m));
    double acc = 0;
    for (Index l = 0; l < m; ++l) {
      acc += w.size() == 0 ? res(l) : w(l) * res(l);
      prefix[static_cast<std::size_t>(l)] = acc;
    }
    return acc;
  }

  /// The l with prefix[l-1] <= u * total < prefix[l] (inverse CDF; needs total > 0). The chosen
  /// l always has p_l > 0. If rounding makes u * total == total, the last l with p_l > 0.
  Index sample(double u) const {
    const double total = prefix.back(), target = u * total;
    auto it = std::upper_bound(prefix.begin(), prefix.end(), target);
    if (it == prefix.end()) it = std::lower_bound(prefix.begin(), prefix.end(), total);
    return static_cast<Index>(it - prefix.begin());
  }

  /// Decides at the top of the loop whether to stop (and why). Order: rank, exhausted, rel_tol.
  bool should_stop() {
    if (broke_down) return true;
    if (k() >= r) {
      stop = RpStopReason::RankReached;
      return true;
    }
    if (!(trace.back() > 0)) {
      stop = RpStopReason::Exhausted;
      return true;
    }
    if (rel_tol > 0 && trace.back() <= rel_tol * initial_trace) {
      stop = RpStopReason::RelTolReached;
      return true;
    }
    return false;
  }

  /// Finalises factor row `row` (already K(pivot,:) - F^T F(:,pivot) scaled by 1/sqrt(res)):
  /// zeroes it at the earlier pivots (exact triangular structure of F(:, S), which round-off would
  /// otherwise blur), subtracts its square from the residuals (in double: a float row's squares
  /// are exact in double, so the residuals accumulate no float round-off of their own), thresholds
  /// them, and records the pivot and the new trace. Returns false (and marks a breakdown) for a
  /// non-finite row.
  bool commit_row(Index row, Index pivot) {
    auto f = F.row(row);
    // |f|^2 is finite iff every entry is (F entries are bounded by sqrt(max diag) in exact
    // arithmetic, so an overflow is a breakdown too).
    if (!std::isfinite(static_cast<double>(f.squaredNorm()))) {
      broke_down = true;
      stop = RpStopReason::Breakdown;
      return false;
    }
    for (Index p : pivots) f(p) = S(0);
    const auto updated = res.array() - f.transpose().array().template cast<double>().square();
    res.array() = (updated > tol).select(updated, 0.0);  // one pass; negatives clamp to 0
    res(pivot) = 0;
    pivots.push_back(pivot);
    trace.push_back(weighted_trace());
    return true;
  }

  /// Sequential step: row k of F for pivot s, by one kernel row and one GEMV. O(m (k + cost of a
  /// kernel row)).
  template <typename Kernel>
  void add_single_pivot(const Kernel& kernel, Index s, std::vector<Index>& one, Vector<S>& g) {
    const Index k0 = k();
    auto row = F.middleRows(k0, 1);
    one.assign(1, s);
    kernel.rows(one, row);
    if (k0 > 0) {
      g.head(k0) = F.col(s).head(k0);
      row.noalias() -= g.head(k0).transpose() * F.topRows(k0);
    }
    row /= static_cast<S>(std::sqrt(res(s)));
    commit_row(k0, s);
  }
};

/// Sequential RPCholesky (Chen, Epperly, Tropp & Webber 2025): one uniform per pivot, inverse CDF.
template <typename S, typename Kernel>
void rp_run_sequential(const Kernel& kernel, RpWork<S>& st, Rng& rng) {
  std::vector<Index> one(1);
  Vector<S> g(st.r);
  while (!st.should_stop()) {
    st.build_prefix();
    const Index s = st.sample(uniform01(rng));
    ++st.proposals;
    st.add_single_pivot(kernel, s, one, g);
  }
}

/// Greedy (largest weighted residual, smallest index on ties): deterministic pivoted Cholesky.
template <typename S, typename Kernel>
void rp_run_greedy(const Kernel& kernel, RpWork<S>& st) {
  std::vector<Index> one(1);
  Vector<S> g(st.r);
  while (!st.should_stop()) {
    Index s = 0;
    double best = -1;
    for (Index l = 0; l < st.m; ++l) {
      const double p = st.w.size() == 0 ? st.res(l) : st.w(l) * st.res(l);
      if (p > best) best = p, s = l;
    }
    ++st.proposals;
    st.add_single_pivot(kernel, s, one, g);
  }
}

/// out(i, j) = F(i, cols[j]) for i < rows (out: rows x |cols|, row-major, any scalar): row by row
/// and in increasing column order. F is row-major, so a column walk strides by m (a TLB miss per
/// entry) and an unordered gather a cache miss per entry; sorted, each row of F streams through
/// the cache once (nystrom_pivot_block was 7% of WildCat at m = 4096, r = 1024 before).
template <typename S, typename Out>
void gather_columns(const RowMajorMatrix<S>& F, Index rows, const std::vector<Index>& cols,
                    RowMajorMatrix<Out>& out) {
  const auto c = static_cast<Index>(cols.size());
  std::vector<std::pair<Index, Index>> order(static_cast<std::size_t>(c));
  for (Index j = 0; j < c; ++j)
    order[static_cast<std::size_t>(j)] = {cols[static_cast<std::size_t>(j)], j};
  std::sort(order.begin(), order.end());
  out.resize(rows, c);
  for (Index i = 0; i < rows; ++i) {
    const S* Fi = F.row(i).data();
    Out* oi = out.row(i).data();
    for (const auto& [col, j] : order) oi[j] = static_cast<Out>(Fi[col]);
  }
}

/// R <- L^{-1} R for lower-triangular L (a x a) and a row block R (a x m): recursive block
/// forward substitution. Mathematically Eigen's TRSM, but the halves are coupled by one GEMM
/// (R2 -= L21 R1) so that most of the a^2 m flops run at GEMM speed; Eigen's TRSM does its
/// diagonal panels with scalar code (measured: 2x slower than GEMM for a ~ 170, m = 16384).
template <typename S>
void lower_solve_in_place(const Eigen::Ref<const Matrix<S>>& L, RowsRef<S> R) {
  constexpr Index kLeaf = 16;
  const Index a = L.rows();
  if (a <= kLeaf) {
    // Row-oriented forward substitution: each step is a vectorised AXPY along a contiguous row of
    // R (Eigen's TRSM spent more on packing these small panels than on their flops: 9% of a float
    // selection at m = 16384, r = 256).
    for (Index i = 0; i < a; ++i) {
      auto Ri = R.row(i);
      for (Index j = 0; j < i; ++j) Ri -= L(i, j) * R.row(j);
      Ri /= L(i, i);
    }
    return;
  }
  const Index h = a / 2;
  auto R1 = R.topRows(h);
  auto R2 = R.bottomRows(a - h);
  lower_solve_in_place<S>(L.topLeftCorner(h, h), R1);
  // R2 -= L21 R1 on row-major R, written as R2^T -= R1^T L21^T on column-major views.
  gemm<Op::N, Op::T>(Update::Sub, R2.transpose(), R1.transpose(), L.bottomLeftCorner(a - h, h));
  lower_solve_in_place<S>(L.bottomRightCorner(a - h, a - h), R2);
}

/// Columns per tile of the accelerated block update and of the Gaussian kernels' rows.
constexpr Index kRpTile = 256;

/// Runs body(t) for the independent column tiles t in [0, tiles) of a block of `rows` rows: as
/// one `parallel_for` when there are several tiles and several rows, serially otherwise. The
/// parallel loop matters beyond its speed-up: inside it Eigen's GEMMs stay serial, whereas a
/// serial loop of tile GEMMs would let Eigen open one OpenMP region per GEMM (measured: 7x slower
/// than one thread at m = 4096, r = 64 on a loaded 2-core machine). A single row (the
/// sequential rules) is a GEMV, which Eigen never parallelises, and needs no region. Each tile is
/// computed the same way on any thread, so results are bit-identical for any thread count.
template <typename Body>
void rp_for_tiles(Index tiles, Index rows, Body&& body) {
  parallel_for_if(rows > 1, tiles, std::forward<Body>(body));
}

/// Automatic proposal count of the next accelerated block. Deterministic (a function of counts
/// only, never of timings, so a seed fixes the pivots): aim to fill the remaining budget given
/// the acceptance rate of the previous block, within [min(32, m), b_max] with
/// b_max = clamp(m / 16, 64, 1024). Rationale: forming the b x b residual block costs
/// O(b^2 (k + d)) (GEMM) and the left-looking rejection Cholesky O(b a^2), against O(a m (k + d))
/// for the block update of the a accepted rows, so b up to ~m / 16 keeps the rejection step a
/// small fraction of the work, while each block must accept enough rows (ideally >= 32) for the
/// update to run at GEMM speed.
inline Index rp_auto_block(Index m, Index remaining, double last_rate) {
  const Index b_max = std::min<Index>(1024, std::max<Index>(64, m / 16));
  const Index b_min = std::min<Index>(32, m);
  const double rate = std::max(last_rate, 1.0 / 16.0);
  const auto want = static_cast<Index>(std::ceil(static_cast<double>(remaining) / rate));
  return std::max(b_min, std::min(b_max, want));
}

/// Accelerated RPCholesky with rejection sampling (Epperly, Tropp & Webber, "Embrace rejection",
/// arXiv 2410.03969). Per block: propose b candidates i.i.d. from p0 (the pivot distribution at
/// the start of the block, proportional to w res0), form the b x b residual block
/// H = K(c, c) - F(:, c)^T F(:, c), and run a Cholesky over it in candidate order that accepts
/// candidate j with probability H_jj / res0(c_j), where H_jj is its residual given every pivot
/// accepted so far (including earlier candidates of this block). Residuals only decrease, so this
/// is a probability, and an accepted candidate has law proportional to w res0 * H / res0 = w H:
/// exactly the law of the sequential rule's next pivot (rejection sampling with fresh i.i.d.
/// proposals). Hence the pivot sequence has the same distribution as `rp_run_sequential`'s. The
/// a accepted rows then take one GEMM (a x k by k x m) and one triangular solve with the a x a
/// accepted Cholesky factor, by column tiles.
template <typename S, typename Kernel>
void rp_run_accelerated(const Kernel& kernel, RpWork<S>& st, Rng& rng, Index block_option) {
  std::vector<Index> cand, accepted, idx;
  std::vector<double> u0;
  Matrix<S> H;           // the candidates' residual block (upper triangle)
  Matrix<double> L;      // its rejection Cholesky factor
  Matrix<S> Ls;          // L in S for the tile solves
  RowMajorMatrix<S> Fc;  // F(:, c) (see gather_columns)
  Matrix<S> Fa;
  Vector<double> y;
  double last_rate = 1.0;
  while (!st.should_stop()) {
    const Index k0 = st.k(), remaining = st.r - k0;
    const Index b = block_option > 0 ? block_option : rp_auto_block(st.m, remaining, last_rate);
    st.build_prefix();
    cand.resize(static_cast<std::size_t>(b));
    u0.resize(static_cast<std::size_t>(b));
    for (Index j = 0; j < b; ++j) {
      const Index c = st.sample(uniform01(rng));
      cand[static_cast<std::size_t>(j)] = c;
      u0[static_cast<std::size_t>(j)] = st.res(c);
    }
    st.proposals += b;
    ++st.blocks;

    // Residual block H = K(c, c) - F(:, c)^T F(:, c), upper triangle (a GEMM-shaped update, in
    // S). The rejection loop reads its entries in double where it needs them, O(b a) of them
    // (column j above the diagonal: contiguous), instead of converting the b x b block.
    if (H.rows() < b) H.resize(b, b), advise_huge_pages(H);
    auto Hb = H.topLeftCorner(b, b);
    gather_columns(st.F, k0, cand, Fc);
    rp_principal_submatrix<Kernel, S>(kernel, cand, Hb);
    if (k0 > 0) Hb.template selfadjointView<Eigen::Upper>().rankUpdate(Fc.transpose(), S(-1));

    // Rejection Cholesky in candidate order, left-looking: candidate j's row of the block factor
    // against the a candidates accepted so far, y = L^{-1} H(accepted, j), gives its current
    // residual H_jj - |y|^2 in O(a^2); candidates after the budget is filled cost nothing.
    const Index a_max = std::min(b, remaining);
    if (L.rows() < a_max) L.resize(a_max, a_max), y.resize(a_max);
    accepted.clear();
    Index examined = 0, a = 0;
    for (Index j = 0; j < b && a < remaining; ++j, ++examined) {
      for (Index p = 0; p < a; ++p)
        y(p) = static_cast<double>(Hb(accepted[static_cast<std::size_t>(p)], j));
      if (a > 0)
        L.topLeftCorner(a, a).template triangularView<Eigen::Lower>().solveInPlace(y.head(a));
      const double hjj = static_cast<double>(Hb(j, j)) - y.head(a).squaredNorm();
      const double u = uniform01(rng);
      if (!(hjj > st.tol) || u * u0[static_cast<std::size_t>(j)] >= hjj) continue;
      L.row(a).head(a) = y.head(a).transpose();
      L(a, a) = std::sqrt(hjj);
      accepted.push_back(j);
      ++a;
    }
    last_rate = examined > 0 ? static_cast<double>(a) / static_cast<double>(examined) : 1.0;
    if (a == 0) {
      // Every candidate rejected. Almost surely the first candidate is accepted (H_00 equals its
      // proposal residual up to round-off), so this happens when the maintained residuals and
      // the freshly computed H_jj disagree at round-off level: resynchronise the candidates'
      // residuals with the fresher values so the next block makes progress.
      for (Index j = 0; j < b; ++j) {
        const Index c = cand[static_cast<std::size_t>(j)];
        const double h = static_cast<double>(Hb(j, j));
        st.res(c) = h > st.tol ? std::min(h, st.res(c)) : 0.0;
      }
      st.trace.back() = st.weighted_trace();
      continue;
    }

    // Block update of the a accepted rows: R = K(idx, :) - F(:, idx)^T F, then L^{-1} R.
    idx.resize(static_cast<std::size_t>(a));
    Fa.resize(k0, a);
    for (Index p = 0; p < a; ++p) {
      const Index jp = accepted[static_cast<std::size_t>(p)];
      idx[static_cast<std::size_t>(p)] = cand[static_cast<std::size_t>(jp)];
      // k0 = 0: Fc and Fa have no rows and may hold null data, where a column block's pointer
      // offset is already undefined behaviour (UBSan; the fuzz regression input
      // tests/fuzz/regressions/wildcat_first_block_offset.bin)
      if (k0 > 0) Fa.col(p) = Fc.col(jp);
    }
    auto R = st.F.middleRows(k0, a);
    kernel.rows(idx, R);
    // Column tiles of kRpTile: the a x tile block of R stays in cache (L2) between its GEMM
    // update and its triangular solve instead of streaming the whole a x m block through memory
    // once per step of the solve (measured 15-20% faster at m = 16384, a ~ 170). Tiles are
    // independent: they run as one parallel loop (Eigen stays serial inside it), which also
    // avoids opening one OpenMP region per small GEMM.
    Ls = L.topLeftCorner(a, a).template cast<S>();  // (a copy when S = double: O(a^2))
    const Index tiles = (st.m + kRpTile - 1) / kRpTile;
    rp_for_tiles(tiles, a, [&](Index t) {
      const Index c0 = t * kRpTile, w = std::min(kRpTile, st.m - c0);
      auto Rt = R.middleCols(c0, w);
      // Rt -= Fa^T F(:, tile) on row-major F and R, as Rt^T -= F(:, tile)^T Fa (column-major).
      if (k0 > 0)
        gemm(Update::Sub, Rt.transpose(), st.F.topRows(k0).middleCols(c0, w).transpose(), Fa);
      lower_solve_in_place<S>(Ls, Rt);
    });
    for (Index t = 0; t < a; ++t) {
      if (t > 0 && st.should_stop()) break;  // rel_tol / exhausted inside the block
      if (!st.commit_row(k0 + t, idx[static_cast<std::size_t>(t)])) break;
    }
  }
}

// ---- The point set of the provided kernels ----

/// The unit-diagonal Gaussian G(y, z) = exp(-||y - z||^2 / 2) over points y_l = f (x_l - c)
/// (f a scale, c the mean point: G is translation invariant and centring shrinks the norms, so
/// the expanded form exp(<y, z> - |y|^2/2 - |z|^2/2) used for GEMM-shaped rows loses less to
/// cancellation). The exponent is clamped at <= 0, so entries lie in [0, 1]. Points are stored
/// as the columns of Z (d x m) in the selection scalar S.
template <typename S>
class GaussianCore {
 public:
  /// The points f x_l of X (m x d) without a scaled copy of X: m_z = (f X - mean)^T written
  /// directly; `sq` receives the squared norms of the uncentred scaled points f x_l.
  template <typename In>
  void init_scaled(const ConstRef<In>& X, double f, Vector<double>& sq) {
    const auto Xs = X.template cast<double>() * f;
    const RowVector<double> mean = Xs.colwise().mean();
    sq = row_squared_norms(Xs);
    const Index m = X.rows(), d = X.cols();
    m_z.resize(d, m);
    advise_huge_pages(m_z);
    // Transposed by blocks of kBlock points, reading each column of X contiguously: the block
    // of m_z being written (d x kBlock) stays in L1, whereas a transposed assignment reads X
    // with stride m per entry (a latency-bound gather: 5% of WildCat at n = 16384).
    // Chunks of 1024 points run in parallel.
    constexpr Index kBlock = 64, kChunk = 1024;
    m_half_sq.resize(m);
    parallel_for_if(m > kChunk, (m + kChunk - 1) / kChunk, [&](Index t) {
      const Index e = std::min(m, (t + 1) * kChunk);
      for (Index l0 = t * kChunk; l0 < e; l0 += kBlock) {
        const Index w = std::min(kBlock, e - l0);
        for (Index c = 0; c < d; ++c) {
          const In* src = X.col(c).data() + l0;
          const double mc = mean(c);
          S* dst = m_z.data() + l0 * d + c;
          for (Index j = 0; j < w; ++j)
            dst[j * d] = static_cast<S>(static_cast<double>(src[j]) * f - mc);
        }
      }
      const Index l0 = t * kChunk;
      m_half_sq.segment(l0, e - l0) =
          (0.5 * m_z.middleCols(l0, e - l0).template cast<double>().colwise().squaredNorm())
              .template cast<S>();
    });
  }

  /// `Xs`: the m x d points already multiplied by f, in double.
  void init(const Matrix<double>& Xs) {
    const RowVector<double> mean = Xs.colwise().mean();
    m_z = (Xs.rowwise() - mean).transpose().template cast<S>();
    m_half_sq = (0.5 * m_z.template cast<double>().colwise().squaredNorm()).template cast<S>();
  }
  Index size() const noexcept { return m_z.cols(); }

  /// out(j, :) = G(z_idx[j], Z): (a x d)(d x m) products by column tiles, a x m exponentials.
  void rows(const std::vector<Index>& idx, RowsRef<S> out) const {
    const auto a = static_cast<Index>(idx.size());
    Matrix<S> za(m_z.rows(), a);
    for (Index j = 0; j < a; ++j) za.col(j) = m_z.col(idx[static_cast<std::size_t>(j)]);
    // Column tiles: each a x 256 tile is produced and exponentiated while it is in cache (one
    // pass over the a x m output instead of three: zero-fill, GEMM, exp). A block of rows runs
    // its tiles as one parallel loop; a single row (the sequential rules) stays serial.
    const Index m = m_z.cols(), tiles = (m + kRpTile - 1) / kRpTile;
    rp_for_tiles(tiles, a, [&](Index t) {
      const Index c0 = t * kRpTile, w = std::min(kRpTile, m - c0);
      auto tile = out.middleCols(c0, w);
      gemm<Op::T>(Update::Assign, tile.transpose(), m_z.middleCols(c0, w), za);  // (w x d)(d x a)
      for (Index j = 0; j < a; ++j)
        tile.row(j).array() = (tile.row(j).array() - m_half_sq.segment(c0, w).array() -
                               m_half_sq(idx[static_cast<std::size_t>(j)]))
                                  .min(S(0))
                                  .exp();
    });
  }

  /// out = G(Z_idx, Z_idx) (column by column: contiguous, vectorised exponentials).
  void principal_submatrix(const std::vector<Index>& idx, Eigen::Ref<Matrix<S>> out) const {
    const auto b = static_cast<Index>(idx.size());
    Matrix<S> zb(m_z.rows(), b);
    Vector<S> hb(b);
    for (Index j = 0; j < b; ++j) {
      zb.col(j) = m_z.col(idx[static_cast<std::size_t>(j)]);
      hb(j) = m_half_sq(idx[static_cast<std::size_t>(j)]);
    }
    gemm<Op::T>(Update::Assign, out, zb, zb);
    for (Index j = 0; j < b; ++j)
      out.col(j).array() = (out.col(j).array() - hb.array() - hb(j)).min(S(0)).exp();
  }

 private:
  Matrix<S> m_z;           // d x m centred, scaled points
  RowVector<S> m_half_sq;  // ||z_l||^2 / 2
};

template <typename Scalar>
void check_kernel_points(const ConstRef<Scalar>& X, const char* who) {
  EFFATTN_CHECK(X.rows() > 0 && X.cols() > 0,
                cat(who, ": X must be m x d with m, d >= 1; got X ", shape(X)));
  check_finite(X, "X");
}

}  // namespace detail

// ---- RpCholesky ----

template <typename PivotRule>
RpCholesky<PivotRule>::RpCholesky(Options opts)
    : m_opts(detail::resolve_renamed(opts, "RpCholesky")) {
  EFFATTN_CHECK(m_opts.rank >= 1,
                detail::cat("RpCholesky: Options::rank must be >= 1; got ", m_opts.rank));
  EFFATTN_CHECK(
      m_opts.rel_tol >= 0 && m_opts.rel_tol < 1,
      detail::cat("RpCholesky: Options::rel_tol must be in [0, 1); got ", m_opts.rel_tol));
  EFFATTN_CHECK(
      m_opts.proposal_block >= 0,
      detail::cat("RpCholesky: Options::proposal_block must be >= 0 (0 = automatic); got ",
                  m_opts.proposal_block));
  EFFATTN_CHECK(std::isfinite(m_opts.roundoff_factor) && m_opts.roundoff_factor >= 0,
                detail::cat("RpCholesky: Options::roundoff_factor must be finite and >= 0; got ",
                            m_opts.roundoff_factor));
}

template <typename PivotRule>
template <typename Kernel>
RpCholeskyResult<detail::kernel_scalar_t<Kernel>> RpCholesky<PivotRule>::compute(
    const Kernel& kernel) const {
  detail::static_check_kernel<Kernel>();
  using S = detail::kernel_scalar_t<Kernel>;
  detail::RpWork<S> st;
  st.m = static_cast<Index>(kernel.size());
  EFFATTN_CHECK(st.m >= 1, detail::cat("RpCholesky: the kernel is empty (size ", st.m, ")"));
  st.r = std::min(m_opts.rank, st.m);
  st.rel_tol = m_opts.rel_tol;
  {
    Vector<S> diag(st.m);
    kernel.diagonal(diag);
    EFFATTN_CHECK(diag.allFinite() && (diag.array() >= S(0)).all(),
                  "RpCholesky: Kernel::diagonal must be finite and >= 0");
    st.res = diag.template cast<double>();
  }
  if constexpr (detail::has_sampling_weights<Kernel>::value) {
    Vector<S> w(st.m);
    kernel.sampling_weights(w);
    EFFATTN_CHECK(w.allFinite() && (w.array() >= S(0)).all(),
                  "RpCholesky: Kernel::sampling_weights must be finite and >= 0");
    st.w = w.template cast<double>();
  }
  // The threshold follows the precision of F, whose round-off the residuals inherit: float rows
  // carry ~eps_f relative errors, so a residual the exact arithmetic would make zero (a
  // duplicated point after its twin) comes out as a few eps_f, not eps_d.
  st.tol = m_opts.roundoff_factor * static_cast<double>(std::numeric_limits<S>::epsilon()) *
           st.res.maxCoeff();
  st.res = (st.res.array() > st.tol).select(st.res, 0.0);
  st.F.resize(st.r, st.m);
  detail::advise_huge_pages(st.F);
  st.initial_trace = st.weighted_trace();
  st.trace.push_back(st.initial_trace);

  Rng rng = make_rng(m_opts.seed);
  if constexpr (std::is_same_v<PivotRule, policy::RandomlyPivoted>)
    detail::rp_run_sequential(kernel, st, rng);
  else if constexpr (std::is_same_v<PivotRule, policy::GreedyPivoted>)
    detail::rp_run_greedy(kernel, st);
  else
    detail::rp_run_accelerated(kernel, st, rng, m_opts.proposal_block);

  RpCholeskyResult<S> out;
  const Index k = st.k();
  if (k == st.r)
    out.factor = std::move(st.F);
  else
    out.factor = st.F.topRows(k);
  out.pivots = std::move(st.pivots);
  if constexpr (std::is_same_v<S, double>)
    out.residual_diagonal = std::move(st.res);
  else
    out.residual_diagonal = st.res.template cast<S>();
  out.residual_trace = std::move(st.trace);
  out.initial_trace = st.initial_trace;
  out.stop = st.stop;
  out.info = st.broke_down ? Info::NumericalIssue : Info::Success;
  out.proposals = st.proposals;
  out.blocks = st.blocks;
  return out;
}

// ---- ExpDotKernel ----

template <typename InScalar, typename SelectionScalar>
ExpDotKernel<InScalar, SelectionScalar>::ExpDotKernel(const ConstRef<InputScalar>& X,
                                                      double scale) {
  detail::check_kernel_points(X, "ExpDotKernel");
  EFFATTN_CHECK(std::isfinite(scale) && scale > 0,
                detail::cat("ExpDotKernel: scale must be finite and > 0; got ", scale));
  Vector<double> sq;
  m_core.init_scaled(X, std::sqrt(scale), sq);
  m_log_scale = sq.maxCoeff();
  m_half_sq = (0.5 * sq).template cast<Scalar>();
  m_weights = (sq.array() - m_log_scale).exp().matrix().template cast<Scalar>();
}

template <typename InScalar, typename SelectionScalar>
RowMajorMatrix<SelectionScalar> ExpDotKernel<InScalar, SelectionScalar>::original_factor(
    const RowMajorMatrix<Scalar>& F) const {
  return F * m_half_sq.array().exp().matrix().asDiagonal();
}

template <typename InScalar, typename SelectionScalar>
RowMajorMatrix<SelectionScalar> ExpDotKernel<InScalar, SelectionScalar>::original_weights(
    const RowMajorMatrix<Scalar>& W, const std::vector<Index>& landmarks) const {
  EFFATTN_CHECK(W.rows() == static_cast<Index>(landmarks.size()) && W.cols() == size(),
                detail::cat("ExpDotKernel::original_weights: W must be |landmarks| x m = ",
                            landmarks.size(), " x ", size(), "; got ", detail::shape(W)));
  RowMajorMatrix<Scalar> out(W.rows(), W.cols());
  for (Index i = 0; i < W.rows(); ++i) {
    const Index s = landmarks[static_cast<std::size_t>(i)];
    EFFATTN_CHECK(s >= 0 && s < size(), detail::cat("ExpDotKernel::original_weights: landmark ", s,
                                                    " out of range [0, ", size(), ")"));
    out.row(i).array() = W.row(i).array() * (m_half_sq.transpose().array() - m_half_sq(s)).exp();
  }
  return out;
}

// ---- GaussianKernel ----

template <typename InScalar, typename SelectionScalar>
GaussianKernel<InScalar, SelectionScalar>::GaussianKernel(const ConstRef<InputScalar>& X,
                                                          double sigma) {
  detail::check_kernel_points(X, "GaussianKernel");
  EFFATTN_CHECK(std::isfinite(sigma) && sigma > 0,
                detail::cat("GaussianKernel: sigma must be finite and > 0; got ", sigma));
  m_core.init(X.template cast<double>() / sigma);
}

}  // namespace effattn
