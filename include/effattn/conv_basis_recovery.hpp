/// \file conv_basis_recovery.hpp
/// \brief The public building blocks of `<effattn/conv_basis.hpp>`: the basis description
/// (`conv_basis::Basis`), the logit oracles, the three recovery policies (`BinarySearch`, `Scan`,
/// `Grid`) and the FFT evaluator with its dynamic-range guard. `conv_basis.hpp` includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "numerics/fft.hpp"
#include "core/parallel.hpp"
#include "core/softmax.hpp"
#include "core/types.hpp"

namespace effattn {
namespace conv_basis {

/// A k-conv basis of the causal logits of one sequence of n tokens, in the cumulative form of
/// convbasis spec 2.2: basis r starts at column `starts[r]` (s_0 = 0 < s_1 < ... < s_{k-1} < n)
/// and `columns[r]` = U_r is the (scaled) logit column at s_r read from the diagonal down,
/// U_r[t] = H[s_r + t, s_r], of length K_r <= n - s_r (K_r < n - s_r only under a sliding
/// window, whose mask zeroes every lag >= K_r). The approximated logits are
/// H'[i, j] = U_r[i - j] for s_r <= j < s_{r+1} (s_k = n) and i - j < K_r; the paper's
/// increments are b'_r = U_r - U_{r-1} (restricted to the first n - s_r entries).
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
/// driving the recovery with arbitrary lower-triangular logits.
class DenseOracle {
 public:
  explicit DenseOracle(const Matrix<double>& H) : m_H(H) {
    EFFATTN_CHECK(
        H.rows() == H.cols() && H.rows() >= 1,
        detail::cat("conv_basis::DenseOracle: H must be n x n, n >= 1; got H ", detail::shape(H)));
  }
  Index size() const { return m_H.rows(); }
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

 private:
  const Matrix<double>& m_H;
};

/// Logit oracle H[i, j] = <Qs_i, K_j> for a pre-scaled Qs (= scale * Q): d flops per entry.
template <typename Scalar>
class QKOracle {
 public:
  QKOracle(const Matrix<Scalar>& Qs, const ConstRef<Scalar>& K) : m_Q(Qs), m_K(K) {}
  Index size() const { return m_Q.rows(); }
  void column(Index j, Index len, double* out) const {
    Eigen::Map<Vector<double>>(out, len) =
        (m_Q.middleRows(j, len) * m_K.row(j).transpose()).template cast<double>();
  }
  /// Heads of the first J columns: for each lag t one pass over the d columns (vectorised,
  /// O(J T d), no temporaries).
  Matrix<double> heads(Index T, Index J) const {
    Matrix<double> h(T, J);
    Vector<Scalar> acc(J);
    for (Index t = 0; t < T; ++t) {
      acc.setZero();
      for (Index c = 0; c < m_Q.cols(); ++c)
        acc += m_Q.col(c).segment(t, J).cwiseProduct(m_K.col(c).head(J));
      h.row(t) = acc.template cast<double>().transpose();
    }
    return h;
  }

 private:
  const Matrix<Scalar>& m_Q;
  const ConstRef<Scalar>& m_K;
};

namespace detail {
using namespace ::effattn::detail;

/// Probe width actually used: T clamped to n and to the window.
inline Index effective_probe(Index n, const RecoveryParams& p) {
  Index T = std::min(p.probe, n);
  if (p.max_lag > 0) T = std::min(T, p.max_lag);
  return std::max<Index>(T, 1);
}

/// Reads the full (window-truncated) columns at `starts` into a Basis; columns in parallel.
template <typename Oracle>
void read_columns(const Oracle& oracle, const RecoveryParams& p, Basis& b) {
  const Index n = oracle.size(), k = b.size();
  b.columns.assign(static_cast<std::size_t>(k), Vector<double>());
  for (Index r = 0; r < k; ++r) {
    const Index s = b.starts[static_cast<std::size_t>(r)];
    const Index len = p.max_lag > 0 ? std::min(n - s, p.max_lag) : n - s;
    b.columns[static_cast<std::size_t>(r)].resize(len);
    b.entries += len;
  }
  auto read = [&](Index r, int&) {
    auto& col = b.columns[static_cast<std::size_t>(r)];
    oracle.column(b.starts[static_cast<std::size_t>(r)], col.size(), col.data());
  };
  // A parallel region costs more than it saves for small reads (and stalls on a loaded machine);
  // either way every column is computed the same way, so results do not depend on it.
  if (b.entries < (Index(1) << 16)) {
    int unused = 0;
    for (Index r = 0; r < k; ++r) read(r, unused);
  } else {
    parallel_for(
        k, [] { return 0; }, read);
  }
}

/// l1 distance of two length-T heads.
inline double head_l1(const double* a, const double* b, Index T) {
  double s = 0;
  for (Index t = 0; t < T; ++t) s += std::abs(a[t] - b[t]);
  return s;
}

/// The linear scan of spec 2.4 over precomputed heads (T x J): column 0 opens the first basis,
/// column j opens a new one when ||head_j - head_current||_1 >= tau. Stops early (returning
/// more than `limit` starts) once the count exceeds `limit`.
inline std::vector<Index> scan_starts(const Matrix<double>& heads, double tau, Index limit) {
  const Index T = heads.rows(), J = heads.cols();
  std::vector<Index> starts{0};
  Index cur = 0;
  for (Index j = 1; j < J; ++j) {
    if (head_l1(heads.col(j).data(), heads.col(cur).data(), T) >= tau) {
      starts.push_back(j);
      cur = j;
      if (static_cast<Index>(starts.size()) > limit) break;
    }
  }
  return starts;
}
}  // namespace detail

/// \ingroup Policies
/// Recovery by the paper's binary search (Algorithms 2-3 of Gu et al., arXiv 2405.05219v1) with
/// the spec's fixes (section 7, P1/P2): the first basis is forced to start at column 0, each later
/// search runs over (s_prev, n - T] with threshold thr = delta - 2 T eps on
/// alpha_j = ||H[j : j + T, j] - U_cur[0 : T]||_1, the column it returns is tested (the paper
/// returns it untested) and the recovery stops when that test fails or the range is exhausted, so
/// it returns k_eff <= num_bases bases and no spurious tail basis. Exact when the logits have a
/// non-degenerate k-conv basis whose changes show in the first T entries and the deviation is
/// monotone in j (Lemma A.15); otherwise change points can be jumped over (spec P3).
/// Logits evaluated: k ceil(log2 n) T for the probes plus the k full columns.
struct BinarySearch {
  template <typename Oracle>
  static Basis recover(const Oracle& oracle, const RecoveryParams& p) {
    const Index n = oracle.size(), T = detail::effective_probe(n, p);
    const Index k = std::min(p.num_bases, n), last = n - T;  // last column with T entries
    const double thr = p.threshold - 2.0 * static_cast<double>(T) * p.epsilon;
    Basis b;
    b.n = n;
    b.threshold_used = thr;
    b.starts.push_back(0);
    Vector<double> cur(T), head(T);
    oracle.column(0, T, cur.data());
    b.entries += T;
    auto alpha = [&](Index j) {
      oracle.column(j, T, head.data());
      ++b.probes;
      b.entries += T;
      return detail::head_l1(head.data(), cur.data(), T);
    };
    for (Index i = 1; i < k; ++i) {
      Index lo = b.starts.back() + 1, hi = last;
      if (lo > hi) break;  // exhausted
      while (lo < hi) {
        const Index mid = lo + (hi - lo) / 2;
        if (alpha(mid) >= thr)
          hi = mid;
        else
          lo = mid + 1;
      }
      if (!(alpha(lo) >= thr)) break;  // P2: no change point left
      b.starts.push_back(lo);
      cur = head;
    }
    detail::read_columns(oracle, p, b);
    return b;
  }
};

/// \ingroup Policies
/// Recovery by a linear scan (spec 2.4, library extension): the first T logits of every column
/// j in [0, n - T] are read (O(n T d)); column j opens a new basis when it differs from the
/// current basis column by ||.||_1 >= tau = `threshold`. k comes out of the data; when the scan
/// would open more than `num_bases` bases, tau is raised (bisection, 50 steps) to the smallest
/// value found that opens at most `num_bases` (reported in Basis::threshold_used). Needs no
/// monotonicity; like BinarySearch it only sees the first T lags, so a change hidden beyond lag
/// T - 1 is missed by design.
struct Scan {
  template <typename Oracle>
  static Basis recover(const Oracle& oracle, const RecoveryParams& p) {
    const Index n = oracle.size(), T = detail::effective_probe(n, p);
    const Index k = std::min(p.num_bases, n), J = n - T + 1;
    const Matrix<double> heads = oracle.heads(T, J);
    Basis b;
    b.n = n;
    b.probes = J;
    b.entries = J * T;
    double tau = p.threshold;
    std::vector<Index> starts = detail::scan_starts(heads, tau, k);
    if (static_cast<Index>(starts.size()) > k) {
      // Every deviation is <= 2 max_j ||head_j||_1 < hi, so the scan at hi opens one basis.
      double lo = tau, hi = 2.0 * heads.cwiseAbs().colwise().sum().maxCoeff() + 1.0;
      hi = std::max(hi, 2.0 * std::abs(tau) + 1.0);
      std::vector<Index> best{0};
      for (int it = 0; it < 50; ++it) {
        const double mid = 0.5 * (lo + hi);
        std::vector<Index> s = detail::scan_starts(heads, mid, k);
        if (static_cast<Index>(s.size()) > k) {
          lo = mid;
        } else {
          hi = mid;
          best = std::move(s);
        }
      }
      tau = hi;
      starts = std::move(best);
    }
    b.threshold_used = tau;
    b.starts = std::move(starts);
    detail::read_columns(oracle, p, b);
    return b;
  }
};

/// \ingroup Policies
/// Fixed starts (no search): `grid_starts` if given (must start at 0, strictly increasing,
/// < n), else the uniform grid s_r = floor(r n / k), r < k = min(num_bases, n). The baseline
/// for error-vs-k sweeps; k = n gives exact attention.
struct Grid {
  template <typename Oracle>
  static Basis recover(const Oracle& oracle, const RecoveryParams& p) {
    const Index n = oracle.size();
    Basis b;
    b.n = n;
    if (!p.grid_starts.empty()) {
      const auto& g = p.grid_starts;
      EFFATTN_CHECK(g[0] == 0, detail::cat("ConvBasisAttention: Options::grid_starts must start "
                                           "at column 0; got ",
                                           g[0]));
      for (std::size_t r = 1; r < g.size(); ++r)
        EFFATTN_CHECK(g[r] > g[r - 1] && g[r] < n,
                      detail::cat("ConvBasisAttention: Options::grid_starts must be strictly "
                                  "increasing and < n = ",
                                  n, "; got ", g[r], " at position ", r));
      b.starts = g;
    } else {
      const Index k = std::min(p.num_bases, n);
      for (Index r = 0; r < k; ++r) b.starts.push_back(r * n / k);
    }
    detail::read_columns(oracle, p, b);
    return b;
  }
};

/// Output of `evaluate`.
template <typename Scalar>
struct Evaluation {
  Matrix<Scalar> output;
  Index rows_recomputed = 0;
  Index fft_size = 0;  ///< transform size N (0 for the direct method)
  bool finite = true;
};

/// How `evaluate` runs.
struct EvalParams {
  fft::ConvMethod method = fft::ConvMethod::Fft;
  fft::Rigor rigor = fft::Rigor::Estimate;
  bool guard = true;      ///< recompute rows whose estimated error exceeds `row_tol`
  double row_tol = 1e-9;  ///< relative to max |V_c|, per column c of V
};

namespace detail {

/// Output row i recomputed directly from the basis in O(i d): logits H'[i, j] with its own max
/// subtraction (so no under/overflow), weights in double.
template <typename Scalar>
void direct_row(const Basis& b, const Matrix<double>& Vd, Index i, Vector<double>& w,
                Matrix<Scalar>& Y) {
  constexpr double ninf = -std::numeric_limits<double>::infinity();
  const Index k = b.size();
  auto wi = w.head(i + 1);
  wi.setConstant(ninf);
  for (Index r = 0; r < k; ++r) {
    const Index s = b.starts[static_cast<std::size_t>(r)];
    if (s > i) break;
    const Index e = r + 1 < k ? b.starts[static_cast<std::size_t>(r + 1)] : b.n;
    const auto& U = b.columns[static_cast<std::size_t>(r)];
    for (Index j = std::max(s, i - U.size() + 1); j < std::min(e, i + 1); ++j) wi(j) = U(i - j);
  }
  const double mx = wi.maxCoeff();
  wi = masked_exp(wi.array(), mx).matrix();
  const double sum = wi.sum();
  Y.row(i) = ((Vd.topRows(i + 1).transpose() * wi) / sum).transpose().template cast<Scalar>();
}

}  // namespace detail

/// Evaluates softmax attention with the logits of basis `b` (see Basis) on V (n x dv):
/// weights c_r = exp(U_r - mu) with one global mu = max U (cancels in the ratio), segment form
/// sum_r T(c_r) S_r V through `fft::CausalConv` (spectra summed per column before one inverse
/// transform; N = smooth size >= n + longest segment - 1), denominators by exact O(k n) prefix /
/// suffix sums in long double (the cheaper-to-cancel side per window). Guard (spec 7, P5): the
/// absolute error of column c of the FFT numerator is bounded by
/// err_c = eps_Real log2(N) sum_r ||c_r||_2 ||S_r V_c||_2 (measured constant ~1-2 without the log
/// factor); a row i with err_c / D_i (plus the denominator's own cancellation estimate) above
/// row_tol max|V_c| for some column c is recomputed directly (detail::direct_row, O(i d)), and so
/// is any row with D_i = 0 (all weights underflowed).
/// Deviations from the spec: (1) spec 2.3 calls prefix-sum denominators fully accurate, but a
/// difference of prefix sums cancels when the excluded lags carry most of the mass; we take the
/// side (prefix or suffix) with the smaller excluded mass, in long double, and feed the remaining
/// cancellation estimate to the guard. (2) row_tol is relative to max|V_c| of each column (the
/// spec's e_i already carries ||V||_inf, so its absolute tolerance would depend on the units of
/// V; and one global max|V| let a column of 1e200 grant the other columns an absolute error of
/// 1e191: found by fuzz_conv_basis, see the regression test "ConvBasis guard is per column"). (3)
/// No switch to the dense path above n/8 flagged rows: every flagged row is recomputed directly,
/// which costs the same O(i d) per row as a dense row and keeps the result identical either way.
template <typename Backend, typename Real, typename Scalar>
Evaluation<Scalar> evaluate(const Basis& b, const ConstRef<Scalar>& V, const EvalParams& ep) {
  const Index n = b.n, k = b.size();
  Evaluation<Scalar> ev;
  double mu = -std::numeric_limits<double>::infinity();
  for (const auto& U : b.columns) mu = std::max(mu, U.maxCoeff());
  if (!std::isfinite(mu)) {
    ev.finite = false;
    return ev;
  }
  const Matrix<double> Vd = V.template cast<double>();
  std::vector<fft::ConvTerm<double>> terms(static_cast<std::size_t>(k));
  // Absolute error bound of each column's numerator (before the eps log2 N factor).
  Vector<double> fft_err = Vector<double>::Zero(V.cols());
  for (Index r = 0; r < k; ++r) {
    auto& t = terms[static_cast<std::size_t>(r)];
    t.kernel = (b.columns[static_cast<std::size_t>(r)].array() - mu).exp().matrix();
    t.offset = b.starts[static_cast<std::size_t>(r)];
    t.end = r + 1 < k ? b.starts[static_cast<std::size_t>(r + 1)] : n;
    // blueNorm, not norm(): the kernel entries exp(U - mu) can be ~1e-183, whose squares
    // underflow to 0; a zero bound then let FFT round-off of that size through the guard on rows
    // whose denominator is smaller still (found by fuzz_conv_basis, see the regression test
    // "ConvBasis guard bound survives underflowing kernel norms").
    fft_err += t.kernel.blueNorm() *
               Vd.middleRows(t.offset, t.end - t.offset).colwise().blueNorm().transpose();
  }
  // Denominators: D_i = sum_r sum_{lag in [max(0, i - e_r + 1), min(i - s_r, K_r - 1)]} c_r[lag].
  Vector<double> D = Vector<double>::Zero(n), D_err = Vector<double>::Zero(n);
  {
    std::vector<long double> P(static_cast<std::size_t>(n) + 1), S(static_cast<std::size_t>(n) + 1);
    for (Index r = 0; r < k; ++r) {
      const auto& t = terms[static_cast<std::size_t>(r)];
      const Index K = t.kernel.size();
      P[0] = 0;
      for (Index x = 0; x < K; ++x)
        P[static_cast<std::size_t>(x + 1)] = P[static_cast<std::size_t>(x)] + t.kernel(x);
      S[static_cast<std::size_t>(K)] = 0;
      for (Index x = K - 1; x >= 0; --x)
        S[static_cast<std::size_t>(x)] = S[static_cast<std::size_t>(x + 1)] + t.kernel(x);
      for (Index i = t.offset; i < n; ++i) {
        const Index lo = std::max<Index>(0, i - t.end + 1), hi = std::min(i - t.offset, K - 1);
        if (lo > hi) continue;
        const auto ul = static_cast<std::size_t>(lo), uh = static_cast<std::size_t>(hi + 1);
        // Use the side whose excluded mass (what cancels) is smaller.
        const long double ex_p = P[ul], ex_s = S[uh];
        const long double v = ex_p <= ex_s ? P[uh] - P[ul] : S[ul] - S[uh];
        D(i) += static_cast<double>(v);
        D_err(i) += static_cast<double>(std::min(ex_p, ex_s));
      }
    }
  }
  fft::ConvOptions co;
  co.method = ep.method;
  co.rigor = ep.rigor;
  const fft::CausalConv<double, Backend, Real> conv(n, terms, co);
  ev.fft_size = conv.fft_size();
  Matrix<double> num = conv(Vd);
  ev.output = (num.array().colwise() / D.array()).matrix().template cast<Scalar>();

  if (ep.guard) {
    const double eps_r = static_cast<double>(std::numeric_limits<Real>::epsilon());
    const double log_n = conv.uses_fft() ? std::log2(static_cast<double>(conv.fft_size()))
                                         : std::log2(static_cast<double>(n)) + 1.0;
    const double eps_eff = conv.uses_fft() ? eps_r : std::numeric_limits<double>::epsilon();
    const Vector<double> err = eps_eff * std::max(1.0, log_n) * fft_err;
    const Vector<double> vmax = Vd.cwiseAbs().colwise().maxCoeff().transpose();
    // Long double prefix sums: rounding ~ eps_ld * K relative to the excluded mass.
    const double ld_eps =
        static_cast<double>(std::numeric_limits<long double>::epsilon()) * static_cast<double>(n);
    std::vector<Index> rows;
    for (Index i = 0; i < n; ++i) {
      // Per column: (err_c + ld_eps D_err_i vmax_c) / D_i <= row_tol vmax_c.
      const bool ok = D(i) > 0 && (((err + (ld_eps * D_err(i)) * vmax) / D(i)).array() <=
                                   (ep.row_tol * vmax).array())
                                      .all();
      if (!ok) rows.push_back(i);
    }
    ev.rows_recomputed = static_cast<Index>(rows.size());
    if (rows.size() == 1) {
      Vector<double> w(n);
      detail::direct_row(b, Vd, rows[0], w, ev.output);
    } else if (!rows.empty()) {
      ::effattn::detail::parallel_for(
          static_cast<Index>(rows.size()), [n] { return Vector<double>(n); },
          [&](Index t, Vector<double>& w) {
            detail::direct_row(b, Vd, rows[static_cast<std::size_t>(t)], w, ev.output);
          });
    }
  }
  ev.finite = ::effattn::detail::all_finite(ev.output);
  return ev;
}

}  // namespace conv_basis
}  // namespace effattn
