/// \file conv_basis_recovery.hpp
/// \brief The public building blocks of Conv-Basis attention (`<effattn/conv_basis.hpp>`, Gu,
/// Liang, Liu, Shi, Song and Yin, arXiv 2405.05219v1): the basis description
/// (`conv_basis::Basis`), the logit oracles, the three recovery policies (`policy::BinarySearch`,
/// `policy::Scan`, `policy::Grid`) run by `conv_basis::recover`, and the FFT evaluator
/// `conv_basis::evaluate` with its dynamic-range guard. Their definitions live in
/// `detail/methods/conv_basis_impl.hpp`; this header includes `conv_basis.hpp`, which includes
/// them.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/gemm.hpp"
#include "core/parallel.hpp"
#include "core/types.hpp"
#include "numerics/fft.hpp"

namespace effattn {

namespace policy {
/// \ingroup Policies
/// Conv-Basis recovery by the paper's binary search (Algorithms 2-3 of Gu et al., arXiv
/// 2405.05219v1), with three fixes: the first basis is forced to start at column 0 (the paper's
/// search can return a later column when the leading logits are zero); each later search runs
/// over (s_prev, n - T] with threshold thr = delta - 2 T eps on
/// alpha_j = ||H[j : j + T, j] - U_cur[0 : T]||_1; and the column it returns is tested (the paper
/// returns it untested), the recovery stopping when that test fails or the range is exhausted, so
/// it returns k_eff <= num_bases bases and no spurious tail basis. Exact when the logits have a
/// non-degenerate k-conv basis whose changes show in the first T entries and the deviation is
/// monotone in j (Lemma A.15); otherwise a change point can be jumped over. Logits evaluated:
/// k ceil(log2 n) T for the probes plus the k full columns; time O((k n + k T log n) d).
struct BinarySearch {};
/// \ingroup Policies
/// Conv-Basis recovery by a linear scan (library extension, the default): the first T logits of
/// every column j in [0, n - T] are read (O(n T d)); column j opens a new basis when it differs
/// from the current basis column by ||.||_1 >= tau = `threshold`. k comes out of the data; when
/// the scan would open more than `num_bases` bases, tau is raised (bisection, 50 steps) to the
/// smallest value found that opens at most `num_bases` (reported in Basis::threshold_used).
/// Needs no monotonicity; like BinarySearch it only sees the first T lags, so a change hidden
/// beyond lag T - 1 is missed by design. Time O((k n + n T) d).
struct Scan {};
/// \ingroup Policies
/// Conv-Basis "recovery" at fixed starts (no search): `grid_starts` if given (must start at 0,
/// strictly increasing, < n), else the uniform grid s_r = floor(r n / k), r < k =
/// min(num_bases, n). The baseline for error-vs-k sweeps; k = n gives exact causal attention.
/// Time O(k n d).
struct Grid {};
}  // namespace policy

namespace conv_basis {

/// True for the recovery policies `conv_basis::recover` accepts.
template <typename Recovery>
constexpr bool is_recovery_policy_v =
    std::is_same<Recovery, policy::BinarySearch>::value ||
    std::is_same<Recovery, policy::Scan>::value || std::is_same<Recovery, policy::Grid>::value;

/// A k-conv basis of the causal logits of one sequence of n tokens, in cumulative form: basis r
/// starts at column `starts[r]` (s_0 = 0 < s_1 < ... < s_{k-1} < n) and `columns[r]` = U_r is the
/// (scaled) logit column at s_r read from the diagonal down, U_r[t] = H[s_r + t, s_r], of length
/// K_r <= n - s_r (K_r < n - s_r only under a sliding window, whose mask zeroes every lag
/// >= K_r). The approximated logits are H'[i, j] = U_r[i - j] for s_r <= j < s_{r+1} (s_k = n)
/// and i - j < K_r; the paper's increments are b'_r = U_r - U_{r-1} (restricted to the first
/// n - s_r entries), and H' = sum_r conv(b'_r, n - s_r) (Claim A.11).
struct Basis {
  Index n = 0;                          ///< sequence length
  std::vector<Index> starts;            ///< s_r, strictly increasing, starts[0] = 0
  std::vector<Vector<double>> columns;  ///< U_r (scaled logits, double)
  Index probes = 0;                     ///< columns whose first T logits were tested
  Index entries = 0;                    ///< logits the recovery evaluated
  double threshold_used = 0;            ///< the threshold the recovery ended with (Scan raises it)
  Index size() const { return static_cast<Index>(starts.size()); }  ///< k
};

/// What a recovery policy reads (see `ConvBasisOptions` for the meaning of each field).
struct RecoveryParams {
  Index num_bases = 16;            ///< k (the most bases)
  Index probe = 8;                 ///< T
  double threshold = 0;            ///< delta (BinarySearch) or tau (Scan)
  double epsilon = 0;              ///< eps (BinarySearch: threshold - 2 T eps)
  Index max_lag = 0;               ///< sliding window w (columns are read to lag w - 1); 0 = none
  std::vector<Index> grid_starts;  ///< Grid: explicit starts (empty = uniform)
};

/// Logit oracle over an explicit dense matrix (its lower triangle is used): for tests and for
/// driving the recovery with arbitrary lower-triangular logits. An oracle has `size()` (n),
/// `column(j, len, out)` (out[t] = H[j + t, j], t < len) and `heads(T, J)` (T x J, column j =
/// H[j : j + T, j]); optionally `gather(i0, rows, cols)` (rows x cols.size(), entry (t, r) =
/// H[i0 + t, cols[r]]), which `recover` then uses to read all the basis columns in one batch
/// (QKOracle: one GEMM instead of k GEMVs that each stream Q). Keeps a reference to H.
class DenseOracle {
 public:
  /// \throws effattn::invalid_argument unless H is n x n with n >= 1.
  explicit DenseOracle(const Matrix<double>& H) : m_H(H) {
    EFFATTN_CHECK(
        H.rows() == H.cols() && H.rows() >= 1,
        detail::cat("conv_basis::DenseOracle: H must be n x n, n >= 1; got H ", detail::shape(H)));
  }
  Index size() const { return m_H.rows(); }  ///< n
  /// out[t] = H[j + t, j], t < len.
  void column(Index j, Index len, double* out) const {
    Eigen::Map<Vector<double>>(out, len) = m_H.col(j).segment(j, len);
  }
  /// T x J matrix, column j = H[j : j + T, j], for j < J (J + T - 1 <= n).
  Matrix<double> heads(Index T, Index J) const {
    Matrix<double> h(T, J);
    for (Index j = 0; j < J; ++j) column(j, T, h.col(j).data());
    return h;
  }
  /// rows x cols.size() matrix, entry (t, r) = H[i0 + t, cols[r]].
  Matrix<double> gather(Index i0, Index rows, const std::vector<Index>& cols) const {
    Matrix<double> g(rows, static_cast<Index>(cols.size()));
    for (std::size_t r = 0; r < cols.size(); ++r)
      g.col(static_cast<Index>(r)) = m_H.col(cols[r]).segment(i0, rows);
    return g;
  }

 private:
  const Matrix<double>& m_H;
};

/// Logit oracle H[i, j] = <Qs_i, K_j> for a pre-scaled Qs (= scale * Q): d flops per entry.
/// Keeps references to Qs and K.
template <typename Scalar>
class QKOracle {
  static constexpr Index kHeadChunk = 1024;   // columns per heads() chunk
  static constexpr Index kGatherRows = 4096;  // rows per gather() GEMM

 public:
  /// Oracle over Qs (n x d, already scaled) and K (n x d); both must outlive it.
  QKOracle(const Matrix<Scalar>& Qs, const ConstRef<Scalar>& K) : m_Q(Qs), m_K(K) {}
  Index size() const { return m_Q.rows(); }   ///< n
  Index width() const { return m_Q.cols(); }  ///< d (multiply-adds per logit)
  /// out[t] = <Qs_{j+t}, K_j>, t < len (one GEMV, in Scalar).
  void column(Index j, Index len, double* out) const {
    Eigen::Map<Vector<double>>(out, len) =
        (m_Q.middleRows(j, len) * m_K.row(j).transpose()).template cast<double>();
  }
  /// Heads of the first J columns, in column chunks of kHeadChunk: for each chunk and lag t,
  /// one pass over the d columns of Qs and K restricted to the chunk (vectorised, O(J T d), no
  /// temporaries beyond one accumulator per thread). The chunk's slices of Qs and K (2 x 256 KiB
  /// in float) stay in the L2 cache across the T lags, where the unchunked passes streamed
  /// 2 n d scalars from memory per lag (n = 65536, T = 8: 40% of the recovery time). Chunks run
  /// in parallel when the work is large; every entry is the same sum over c in the same order
  /// as one unchunked pass, so the bits do not depend on the chunking or the thread count.
  Matrix<double> heads(Index T, Index J) const {
    Matrix<double> h(T, J);
    // Small problems: one chunk on this thread (chunks cost loop overhead, a region costs more).
    const bool parallel = J * T * m_Q.cols() >= (Index(1) << 22);
    const Index chunk = parallel ? std::min(kHeadChunk, J) : J;
    const Index chunks = (J + chunk - 1) / chunk;
    const auto body = [&](Index b, Vector<Scalar>& acc) {
      const Index j0 = b * chunk, len = std::min(chunk, J - j0);
      auto a = acc.head(len);
      for (Index t = 0; t < T; ++t) {
        a.setZero();
        for (Index c = 0; c < m_Q.cols(); ++c)
          a += m_Q.col(c).segment(j0 + t, len).cwiseProduct(m_K.col(c).segment(j0, len));
        h.row(t).segment(j0, len) = a.template cast<double>().transpose();
      }
    };
    if (parallel && chunks > 1) {
      ::effattn::detail::parallel_for(
          chunks, [&] { return Vector<Scalar>(chunk); }, body);
    } else {
      Vector<Scalar> acc(chunk);
      for (Index b = 0; b < chunks; ++b) body(b, acc);
    }
    return h;
  }
  /// rows x cols.size() matrix, entry (t, r) = <Qs_{i0+t}, K_{cols[r]}>: row chunks of
  /// kGatherRows, each one GEMM (in Scalar), in parallel (one region, in which Eigen's GEMM is
  /// serial): thread-count independent.
  Matrix<double> gather(Index i0, Index rows, const std::vector<Index>& cols) const {
    const Index k = static_cast<Index>(cols.size());
    Matrix<Scalar> Kc(k, m_K.cols());
    for (Index r = 0; r < k; ++r) Kc.row(r) = m_K.row(cols[static_cast<std::size_t>(r)]);
    Matrix<double> g(rows, k);
    const Index chunks = (rows + kGatherRows - 1) / kGatherRows;
    ::effattn::detail::parallel_for(
        chunks, [] { return 0; },
        [&](Index c, int&) {
          const Index r0 = c * kGatherRows, len = std::min(kGatherRows, rows - r0);
          g.middleRows(r0, len) =
              ::effattn::detail::matmul<::effattn::detail::Op::N, ::effattn::detail::Op::T>(
                  m_Q.middleRows(i0 + r0, len), Kc)
                  .template cast<double>();
        });
    return g;
  }

 private:
  const Matrix<Scalar>& m_Q;
  const ConstRef<Scalar>& m_K;
};

/// Recovers a conv basis of the causal logits `oracle` gives (see DenseOracle for the oracle
/// interface) with recovery policy `Recovery` (`policy::Scan`, `policy::BinarySearch` or
/// `policy::Grid`; see each for the algorithm and its cost), reading O(k n + n T) logits, never
/// the n x n matrix. Full columns are read in one batch when the oracle has `gather` (QKOracle,
/// no window, n k d >= 2^24: one GEMM streams Q once for all k columns), else one GEMV each, in
/// parallel; the probe heads of Scan come from QKOracle::heads in L2-sized column chunks. The
/// result does not depend on the thread count.
/// \throws effattn::invalid_argument on invalid Grid starts.
template <typename Recovery, typename Oracle>
Basis recover(const Oracle& oracle, const RecoveryParams& p);

/// Output of `evaluate`.
template <typename Scalar>
struct Evaluation {
  Matrix<Scalar> output;      ///< n x dv
  Index rows_recomputed = 0;  ///< rows the guard recomputed directly
  Index fft_size = 0;         ///< transform size N (0 for the direct method)
  bool finite = true;         ///< false: the logits or the output overflowed
};

/// How `evaluate` runs.
struct EvalParams {
  fft::ConvMethod method = fft::ConvMethod::Fft;  ///< Fft, Direct or Auto (fft::CausalConv)
  fft::Rigor rigor = fft::Rigor::Estimate;        ///< FFTW planner rigor
  bool guard = true;      ///< recompute rows whose estimated error exceeds `row_tol`
  double row_tol = 1e-9;  ///< relative to max |V_c|, per column c of V
};

/// Evaluates softmax attention with the logits of basis `b` (see Basis) on V (n x dv):
/// weights c_r = exp(U_r - mu) with one global mu = max U (cancels in the ratio), segment form
/// \f[ Y = D^{-1} \sum_r T(c_r) S_r V \f]
/// through `fft::CausalConv<double, Backend, Real>` (spectra summed per column before one inverse
/// transform; N = smooth size >= n + longest segment - 1), denominators
/// D_i = sum_r sum_{j in [s_r, s_{r+1}), j <= i} c_r[i - j] by exact O(k n) prefix / suffix sums
/// in long double (the side with the smaller excluded mass, which is what cancels, whose
/// remaining cancellation estimate feeds the guard).
///
/// Guard (dynamic range): FFT round-off is absolute, so a row whose denominator is tiny compared
/// with the kernels loses its relative accuracy. The absolute error of column c of the FFT
/// numerator is bounded by err_c = eps_Real log2(N) sum_r ||c_r||_2 ||S_r V_c||_2 (measured
/// constant ~1-2 without the log factor); a row i with err_c / D_i (plus the denominator's own
/// cancellation estimate) above row_tol max|V_c| for some column c is recomputed directly (O(i d),
/// its own max subtraction, weights in double), and so is any row with D_i = 0 (all weights
/// underflowed). The tolerance is per column of V: one global max|V| would let a column of 1e200
/// grant the other columns an absolute error of 1e191 (found by fuzzing, see the regression test
/// "ConvBasis guard is per column"). Every flagged row is recomputed the same way however many
/// there are, so the result does not depend on a switch-over heuristic.
///
/// Cost O(k dv N log N) time, O((k + dv) N) memory, plus O(i dv) per guarded row.
template <typename Backend, typename Real, typename Scalar>
Evaluation<Scalar> evaluate(const Basis& b, const ConstRef<Scalar>& V, const EvalParams& ep);

}  // namespace conv_basis
}  // namespace effattn

#include "conv_basis.hpp"  // the functor, and through it detail/methods/conv_basis_impl.hpp
