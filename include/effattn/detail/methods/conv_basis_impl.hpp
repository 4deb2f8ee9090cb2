/// \file conv_basis_impl.hpp
/// \brief Definitions of `<effattn/conv_basis.hpp>` and `<effattn/conv_basis_recovery.hpp>`: the
/// recovery algorithms (`conv_basis::recover`, dispatched on the policy with `if constexpr`), the
/// evaluator `conv_basis::evaluate`, and the members of `ConvBasisAttention` (out of class and
/// not inline, so that `extern template` in compiled mode suppresses them).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../conv_basis.hpp"
#include "../../conv_basis_recovery.hpp"
#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/parallel.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "../../numerics/fft.hpp"

namespace effattn {
namespace conv_basis {
namespace detail {
using namespace ::effattn::detail;

/// Probe width actually used: T clamped to n and to the window.
inline Index effective_probe(Index n, const RecoveryParams& p) {
  Index T = std::min(p.probe, n);
  if (p.max_lag > 0) T = std::min(T, p.max_lag);
  return std::max<Index>(T, 1);
}

/// Whether an oracle has `width()` (the cost of one logit, in multiply-adds).
template <typename Oracle, typename = void>
struct has_width : std::false_type {};
template <typename Oracle>
struct has_width<Oracle, std::void_t<decltype(std::declval<const Oracle&>().width())>>
    : std::true_type {};

/// Whether an oracle has the optional batched read `gather(i0, rows, cols)`.
template <typename Oracle, typename = void>
struct has_gather : std::false_type {};
template <typename Oracle>
struct has_gather<Oracle, std::void_t<decltype(std::declval<const Oracle&>().gather(
                              Index(0), Index(0), std::declval<const std::vector<Index>&>()))>>
    : std::true_type {};

/// d of a QK-style oracle (its `width()`), or 1.
template <typename Oracle>
Index oracle_width(const Oracle& o) {
  if constexpr (has_width<Oracle>::value)
    return o.width();
  else
    return 1;
}

/// Reads the full (window-truncated) columns at `starts` into a Basis. With an oracle that has
/// `gather` (QKOracle) and without a window, all k columns come from ONE batched read of rows
/// [0, n) (an n x d by d x k GEMM: Q is streamed once instead of once per column; measured
/// 47 -> ~2 ms at n = 65536, k = 16); the entries above each start are computed and dropped
/// (at most 2x the flops at GEMM speed). Otherwise (a window, where each column is short, or
/// a plain oracle) each column is one GEMV (never threaded by Eigen), so reading them in
/// parallel or in order gives the same bits; a parallel region costs more than it saves for
/// small reads and stalls on a loaded machine (BinarySearch, n = 4096, k = 16, 67K entries:
/// 0.4 ms serial, 8-16 ms with a region at load 4 on 2 cores), hence 2^20 entries.
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
  if constexpr (has_gather<Oracle>::value) {
    // Small reads stay GEMVs: below ~16M multiply-adds the parallel region of the batched read
    // costs more than streaming Q k times (n = 4096, k = 16: 4M, 0.3 ms as GEMVs).
    if (p.max_lag == 0 && k > 1 && n * k * oracle_width(oracle) >= (Index(1) << 24)) {
      const Matrix<double> g = oracle.gather(0, n, b.starts);
      for (Index r = 0; r < k; ++r) {
        auto& col = b.columns[static_cast<std::size_t>(r)];
        col = g.col(r).segment(b.starts[static_cast<std::size_t>(r)], col.size());
      }
      return;
    }
  }
  parallel_for_if(b.entries >= (Index(1) << 20), k, [&](Index r) {
    auto& col = b.columns[static_cast<std::size_t>(r)];
    oracle.column(b.starts[static_cast<std::size_t>(r)], col.size(), col.data());
  });
}

/// l1 distance of two length-T heads.
inline double head_l1(const double* a, const double* b, Index T) {
  double s = 0;
  for (Index t = 0; t < T; ++t) s += std::abs(a[t] - b[t]);
  return s;
}

/// The linear scan over precomputed heads (T x J): column 0 opens the first basis, column j opens
/// a new one when ||head_j - head_current||_1 >= tau. Stops early (returning more than `limit`
/// starts) once the count exceeds `limit`.
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

/// policy::BinarySearch (see its documentation).
template <typename Oracle>
Basis recover_binary_search(const Oracle& oracle, const RecoveryParams& p) {
  const Index n = oracle.size(), T = effective_probe(n, p);
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
    return head_l1(head.data(), cur.data(), T);
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
    if (!(alpha(lo) >= thr)) break;  // the returned column is tested: no change point left
    b.starts.push_back(lo);
    cur = head;
  }
  read_columns(oracle, p, b);
  return b;
}

/// policy::Scan (see its documentation).
template <typename Oracle>
Basis recover_scan(const Oracle& oracle, const RecoveryParams& p) {
  const Index n = oracle.size(), T = effective_probe(n, p);
  const Index k = std::min(p.num_bases, n), J = n - T + 1;
  const Matrix<double> heads = oracle.heads(T, J);
  Basis b;
  b.n = n;
  b.probes = J;
  b.entries = J * T;
  double tau = p.threshold;
  std::vector<Index> starts = scan_starts(heads, tau, k);
  if (static_cast<Index>(starts.size()) > k) {
    // Every deviation is <= 2 max_j ||head_j||_1 < hi, so the scan at hi opens one basis.
    double lo = tau, hi = 2.0 * heads.cwiseAbs().colwise().sum().maxCoeff() + 1.0;
    hi = std::max(hi, 2.0 * std::abs(tau) + 1.0);
    std::vector<Index> best{0};
    for (int it = 0; it < 50; ++it) {
      const double mid = 0.5 * (lo + hi);
      std::vector<Index> s = scan_starts(heads, mid, k);
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
  read_columns(oracle, p, b);
  return b;
}

/// policy::Grid (see its documentation).
template <typename Oracle>
Basis recover_grid(const Oracle& oracle, const RecoveryParams& p) {
  const Index n = oracle.size();
  Basis b;
  b.n = n;
  if (!p.grid_starts.empty()) {
    const auto& g = p.grid_starts;
    EFFATTN_CHECK(g[0] == 0, cat("ConvBasisAttention: Options::grid_starts must start "
                                 "at column 0; got ",
                                 g[0]));
    for (std::size_t r = 1; r < g.size(); ++r)
      EFFATTN_CHECK(g[r] > g[r - 1] && g[r] < n,
                    cat("ConvBasisAttention: Options::grid_starts must be strictly "
                        "increasing and < n = ",
                        n, "; got ", g[r], " at position ", r));
    b.starts = g;
  } else {
    const Index k = std::min(p.num_bases, n);
    for (Index r = 0; r < k; ++r) b.starts.push_back(r * n / k);
  }
  read_columns(oracle, p, b);
  return b;
}

/// Output row i recomputed directly from the basis in O(i d): logits H'[i, j] with its own max
/// subtraction (so no under/overflow), weights in double.
template <typename = void>  // instantiated where used (compile cost)
inline void direct_row(const Basis& b, const Matrix<double>& Vd, Index i, Vector<double>& w,
                       Matrix<double>& Y) {
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
  Y.row(i) = ((Vd.topRows(i + 1).transpose() * wi) / sum).transpose();
}

/// mu = the largest logit of the basis (the shift of every kernel; -inf or +inf when the logits
/// are not finite).
inline double basis_max(const Basis& b) {
  double mu = -std::numeric_limits<double>::infinity();
  for (const auto& U : b.columns) mu = std::max(mu, U.maxCoeff());
  return mu;
}

/// The segment-form terms of basis `b`: kernel c_r = exp(U_r - mu) over keys [s_r, s_{r+1}).
inline std::vector<fft::ConvTerm<double>> basis_terms(const Basis& b, double mu) {
  const Index k = b.size();
  std::vector<fft::ConvTerm<double>> terms(static_cast<std::size_t>(k));
  for (Index r = 0; r < k; ++r) {
    auto& t = terms[static_cast<std::size_t>(r)];
    t.kernel = (b.columns[static_cast<std::size_t>(r)].array() - mu).exp().matrix();
    t.offset = b.starts[static_cast<std::size_t>(r)];
    t.end = r + 1 < k ? b.starts[static_cast<std::size_t>(r + 1)] : b.n;
  }
  return terms;
}

/// Denominators of the segment-form `terms` of an n-token basis: D_i = sum_r sum_{lag in
/// [max(0, i - e_r + 1), min(i - s_r, K_r - 1)]} c_r[lag], by O(k n) prefix / suffix sums; D_err
/// receives the cancellation estimate (see `evaluate`).
inline void basis_denominators(const std::vector<fft::ConvTerm<double>>& terms, Index n,
                               Vector<double>& D, Vector<double>& D_err) {
  // A difference of prefix sums cancels when the excluded lags carry most of the mass, so each
  // row takes the side (prefix or suffix) with the smaller excluded mass, in long double, and
  // the remaining cancellation estimate goes to the guard.
  D.setZero(n);
  D_err.setZero(n);
  std::vector<long double> P(static_cast<std::size_t>(n) + 1), S(static_cast<std::size_t>(n) + 1);
  for (const auto& t : terms) {
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

/// `evaluate` in double, whatever the data type (so float and double data share one
/// instantiation): output in double, `finite` = false only when the logits overflowed.
template <typename Backend, typename Real>
Evaluation<double> evaluate_double(const Basis& b, const Matrix<double>& Vd, const EvalParams& ep) {
  const Index n = b.n, k = b.size();
  Evaluation<double> ev;
  const double mu = basis_max(b);
  if (!std::isfinite(mu)) {
    ev.finite = false;
    return ev;
  }
  const std::vector<fft::ConvTerm<double>> terms = basis_terms(b, mu);
  // Absolute error bound of each column's numerator (before the eps log2 N factor).
  Vector<double> fft_err = Vector<double>::Zero(Vd.cols());
  for (Index r = 0; r < k; ++r) {
    const auto& t = terms[static_cast<std::size_t>(r)];
    // blueNorm, not norm(): the kernel entries exp(U - mu) can be ~1e-183, whose squares
    // underflow to 0; a zero bound then let FFT round-off of that size through the guard on rows
    // whose denominator is smaller still (found by fuzz_conv_basis, see the regression test
    // "ConvBasis guard bound survives underflowing kernel norms").
    fft_err += t.kernel.blueNorm() *
               Vd.middleRows(t.offset, t.end - t.offset).colwise().blueNorm().transpose();
  }
  // Denominators: D_i = sum_r sum_{lag in [max(0, i - e_r + 1), min(i - s_r, K_r - 1)]} c_r[lag].
  Vector<double> D, D_err;
  basis_denominators(terms, n, D, D_err);
  fft::ConvOptions co;
  co.method = ep.method;
  co.rigor = ep.rigor;
  const fft::CausalConv<double, Backend, Real> conv(n, terms, co);
  ev.fft_size = conv.fft_size();
  Matrix<double> num = conv(Vd);
  ev.output = (num.array().colwise() / D.array()).matrix();

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
      direct_row(b, Vd, rows[0], w, ev.output);
    } else if (!rows.empty()) {
      parallel_for(
          static_cast<Index>(rows.size()), [n] { return Vector<double>(n); },
          [&](Index t, Vector<double>& w) {
            direct_row(b, Vd, rows[static_cast<std::size_t>(t)], w, ev.output);
          });
    }
  }
  return ev;
}

}  // namespace detail

template <typename Recovery, typename Oracle>
Basis recover(const Oracle& oracle, const RecoveryParams& p) {
  static_assert(is_recovery_policy_v<Recovery>,
                "effattn: conv_basis::recover: Recovery must be policy::Scan, "
                "policy::BinarySearch or policy::Grid");
  if constexpr (std::is_same<Recovery, policy::BinarySearch>::value)
    return detail::recover_binary_search(oracle, p);
  else if constexpr (std::is_same<Recovery, policy::Scan>::value)
    return detail::recover_scan(oracle, p);
  else
    return detail::recover_grid(oracle, p);
}

template <typename Backend, typename Real, typename Scalar>
Evaluation<Scalar> evaluate(const Basis& b, const ConstRef<Scalar>& V, const EvalParams& ep) {
  const Matrix<double> Vd = V.template cast<double>();
  if constexpr (std::is_same<Scalar, double>::value) {
    Evaluation<double> ev = detail::evaluate_double<Backend, Real>(b, Vd, ep);
    if (ev.finite) ev.finite = ::effattn::detail::all_finite(ev.output);
    return ev;
  } else {
    // Every output entry is rounded to Scalar once, from the same double as in the double path.
    const Evaluation<double> e = detail::evaluate_double<Backend, Real>(b, Vd, ep);
    Evaluation<Scalar> ev;
    ev.rows_recomputed = e.rows_recomputed;
    ev.fft_size = e.fft_size;
    ev.finite = e.finite;
    if (!ev.finite) return ev;
    ev.output = e.output.template cast<Scalar>();
    ev.finite = ::effattn::detail::all_finite(ev.output);
    return ev;
  }
}

}  // namespace conv_basis

// ---------------------------------------------------------------------------------------------
// ConvBasisAttention members.

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::ConvBasisAttention(Options opts)
    : m_opts(detail::resolve_renamed(std::move(opts), name)) {
  using detail::cat;
  detail::check_scale_option(m_opts.scale, name);
  EFFATTN_CHECK(m_opts.num_bases >= 1,
                cat(name, ": Options::num_bases (k) must be >= 1; got ", m_opts.num_bases));
  EFFATTN_CHECK(m_opts.probe >= 1,
                cat(name, ": Options::probe (T) must be >= 1; got ", m_opts.probe));
  EFFATTN_CHECK(std::isfinite(m_opts.threshold) && m_opts.threshold >= 0,
                cat(name, ": Options::threshold must be finite and >= 0; got ", m_opts.threshold));
  EFFATTN_CHECK(std::isfinite(m_opts.epsilon) && m_opts.epsilon >= 0,
                cat(name, ": Options::epsilon must be finite and >= 0; got ", m_opts.epsilon));
  EFFATTN_CHECK(std::isfinite(m_opts.guard_tolerance) && m_opts.guard_tolerance >= 0,
                cat(name,
                    ": Options::guard_tolerance must be finite and >= 0 (0 = default); "
                    "got ",
                    m_opts.guard_tolerance));
  EFFATTN_CHECK(
      m_opts.sliding_window >= 0,
      cat(name, ": Options::sliding_window must be >= 0 (0 = none); got ", m_opts.sliding_window));
  EFFATTN_CHECK(
      m_opts.mask_block >= 0,
      cat(name, ": Options::mask_block must be >= 0 (0 = one block); got ", m_opts.mask_block));
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
auto ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::compute(const Ref& Q, const Ref& K,
                                                                      const Ref& V) const
    -> Result {
  check_inputs(Q, K, V);
  return run(Q, K, V, m_opts.sliding_window, m_opts.mask_block);
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
auto ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::compute(const Ref& Q, const Ref& K,
                                                                      const Ref& V,
                                                                      const MaskRef& mask) const
    -> Result {
  check_inputs(Q, K, V);
  EFFATTN_CHECK(m_opts.sliding_window == 0 && m_opts.mask_block == 0,
                detail::cat(name,
                            ": an explicit mask needs Options::sliding_window = 0 and "
                            "Options::mask_block = 0"));
  const std::pair<Index, Index> wb = classify_mask(mask, Q.rows());
  return run(Q, K, V, wb.first, wb.second);
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
conv_basis::Basis ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::recover(
    const Ref& Q, const Ref& K) const {
  detail::check_attention_inputs(Q, K, K, name);
  EFFATTN_CHECK(K.rows() == Q.rows(), detail::cat(name,
                                                  ": self-attention only: K must be n x d "
                                                  "with n = Q.rows() = ",
                                                  Q.rows(), "; got K ", detail::shape(K)));
  const MatrixType Qs = Q * static_cast<Scalar>(detail::resolve_scale(m_opts.scale, Q.cols()));
  return conv_basis::recover<Recovery>(conv_basis::QKOracle<Scalar>(Qs, K),
                                       params(m_opts.sliding_window));
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
auto ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::apply(const conv_basis::Basis& basis,
                                                                    const Ref& V) const -> Result {
  check_basis(basis);
  EFFATTN_CHECK(
      V.rows() == basis.n && V.cols() >= 1,
      detail::cat(name, ": V must be n x dv with n = ", basis.n, "; got V ", detail::shape(V)));
  detail::check_finite(V, "V");
  Result r;
  r.output.resize(basis.n, V.cols());
  if (!add_block(basis, V, 0, r)) return r;
  r.info = Info::Success;
  return r;
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
void ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::check_inputs(const Ref& Q,
                                                                           const Ref& K,
                                                                           const Ref& V) const {
  detail::check_attention_inputs(Q, K, V, name);
  EFFATTN_CHECK(K.rows() == Q.rows(),
                detail::cat(name,
                            ": self-attention only (n = m): K must be n x d with n = "
                            "Q.rows() = ",
                            Q.rows(), "; got Q ", detail::shape(Q), ", K ", detail::shape(K)));
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
conv_basis::RecoveryParams ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::params(
    Index window) const {
  conv_basis::RecoveryParams p;
  p.num_bases = m_opts.num_bases;
  p.probe = m_opts.probe;
  p.threshold = m_opts.threshold;
  p.epsilon = m_opts.epsilon;
  p.max_lag = window;
  p.grid_starts = m_opts.grid_starts;
  return p;
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
void ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::check_basis(
    const conv_basis::Basis& b) const {
  using detail::cat;
  EFFATTN_CHECK(
      b.n >= 1 && !b.starts.empty() && b.starts.size() == b.columns.size() && b.starts[0] == 0,
      cat(name,
          ": malformed basis (need n >= 1, starts[0] = 0 and one column per "
          "start)"));
  for (std::size_t r = 0; r < b.starts.size(); ++r) {
    const Index s = b.starts[r], len = b.columns[r].size();
    EFFATTN_CHECK((r == 0 || s > b.starts[r - 1]) && s < b.n && len >= 1 && len <= b.n - s,
                  cat(name, ": malformed basis at r = ", r, " (start ", s, ", column length ", len,
                      ", n = ", b.n, ")"));
  }
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
bool ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::add_block(const conv_basis::Basis& b,
                                                                        const Ref& V, Index row0,
                                                                        Result& r) const {
  constexpr double default_tol = std::is_same<Real, double>::value ? 1e-9 : 1e-4;
  conv_basis::EvalParams ep;
  ep.method = m_opts.conv_method;
  ep.rigor = m_opts.rigor;
  ep.guard = m_opts.guard;
  ep.row_tol = m_opts.guard_tolerance > 0 ? m_opts.guard_tolerance : default_tol;
  auto ev = conv_basis::evaluate<FftBackend, Real, Scalar>(b, V, ep);
  for (const Index s : b.starts) r.offsets.push_back(row0 + s);
  r.bases_used += b.size();
  r.probes += b.probes;
  r.entries_evaluated += b.entries;
  r.threshold_used = b.threshold_used;
  if (!ev.finite) {
    // Logits overflowed (e.g. |scale q.k| beyond the Scalar range): report it, and never leave
    // stale or partial rows behind that could be mistaken for a result.
    r.info = Info::NumericalIssue;
    r.output.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    return false;
  }
  r.output.middleRows(row0, b.n) = ev.output;
  r.rows_recomputed += ev.rows_recomputed;
  r.fft_size = std::max(r.fft_size, ev.fft_size);
  return true;
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
auto ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::run(const Ref& Q, const Ref& K,
                                                                  const Ref& V, Index window,
                                                                  Index block) const -> Result {
  const Index n = Q.rows();
  const MatrixType Qs = Q * static_cast<Scalar>(detail::resolve_scale(m_opts.scale, Q.cols()));
  const conv_basis::RecoveryParams p = params(window);
  const Index bs = block > 0 ? std::min(block, n) : n;
  Result r;
  r.output.resize(n, V.cols());
  for (Index b0 = 0; b0 < n; b0 += bs) {
    const Index len = std::min(bs, n - b0);
    const MatrixType Qb = Qs.middleRows(b0, len);
    const auto Kb = K.middleRows(b0, len);
    const Ref Kr(Kb);
    const conv_basis::Basis basis =
        conv_basis::recover<Recovery>(conv_basis::QKOracle<Scalar>(Qb, Kr), p);
    if (!add_block(basis, V.middleRows(b0, len), b0, r)) return r;
  }
  r.info = Info::Success;
  return r;
}

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
std::pair<Index, Index> ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::classify_mask(
    const MaskRef& M, Index n) {
  using detail::cat;
  EFFATTN_CHECK(M.rows() == n && M.cols() == n,
                cat(name, ": mask must be n x n with n = ", n, "; got mask ", detail::shape(M)));
  const char* what =
      ": unsupported mask: only causal, sliding-window causal and block-diagonal causal masks "
      "have a conv-basis form";
  std::vector<Index> lo(static_cast<std::size_t>(n));
  Index w = 1;
  for (Index i = 0; i < n; ++i) {
    Index l = i;
    EFFATTN_CHECK(M(i, i), cat(name, what, " (row ", i, " does not see its own key)"));
    while (l > 0 && M(i, l - 1)) --l;
    lo[static_cast<std::size_t>(i)] = l;
    w = std::max(w, i - l + 1);
  }
  // Block starts: rows that see only themselves although the window would allow more.
  Index block = 0;
  if (w > 1) {
    for (Index i = 1; i < n && block == 0; ++i)
      if (lo[static_cast<std::size_t>(i)] == i) block = i;
  }
  const Index window = w >= n ? 0 : w;
  for (Index i = 0; i < n; ++i) {
    const Index b0 = block > 0 ? (i / block) * block : 0;
    const Index l = window > 0 ? std::max(b0, i - window + 1) : b0;
    for (Index j = 0; j < n; ++j)
      EFFATTN_CHECK(M(i, j) == (j >= l && j <= i), cat(name, what, " (entry ", i, ", ", j, ")"));
  }
  return {window, block};
}

}  // namespace effattn
