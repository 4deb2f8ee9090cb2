// The methods effattn-compare runs: one adapter per method mapping a budget (in the method's own
// unit) to options, running it, and reporting its diagnostics. Add a method by appending one
// Method to `methods()`.
#pragma once

#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace effattn {
namespace compare {

/// The problem every method gets.
template <typename Scalar>
struct Problem {
  const Matrix<Scalar>& Q;
  const Matrix<Scalar>& K;
  const Matrix<Scalar>& V;
  bool causal;         ///< --causal
  std::uint64_t seed;  ///< --seed (methods' seeds)
  int repeat;          ///< timed calls
};

/// What a method adapter returns.
template <typename Scalar>
struct Output {
  Matrix<Scalar> output;
  Info info = Info::NotComputed;
  double seconds = 0;  ///< median time of one call
  std::string config;  ///< policy / budget description
  std::map<std::string, double> diag;
  std::vector<Index> rows;  ///< compare only these rows (VCC: the VIP rows); empty = all
  bool causal = false;      ///< the method is causal by construction (Conv-Basis)
  /// Per-entry predictive variance (KEP-SVGP), n x dv; empty otherwise. When set, the driver
  /// reports the Spearman rank correlation over tokens of the row's total variance with the
  /// row's realised squared error against exact attention ("var_err_spearman").
  Matrix<Scalar> variance;
};

/// Spearman rank correlation of x and y (average ranks for ties).
inline double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  auto ranks = [](const std::vector<double>& v) {
    std::vector<std::size_t> idx(v.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return v[a] < v[b]; });
    std::vector<double> r(v.size());
    for (std::size_t i = 0; i < idx.size();) {
      std::size_t j = i;
      while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (std::size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * static_cast<double>(i + j);
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> rx = ranks(x), ry = ranks(y);
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) mx += rx[i] / n, my += ry[i] / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : std::numeric_limits<double>::quiet_NaN();
}

/// One table row.
struct Run {
  std::string method, config, status, reference;
  Index budget = 0;
  double rel_err = std::numeric_limits<double>::quiet_NaN();
  double max_abs_err = std::numeric_limits<double>::quiet_NaN();
  double seconds = 0, speedup = 0;
  std::map<std::string, double> diag;
};

/// A method: name (the --methods key), default budgets, applicability and the runner.
template <typename Scalar>
struct Method {
  std::string name;
  std::function<std::vector<Index>(const Problem<Scalar>&)> default_budgets;
  std::function<bool(const Problem<Scalar>&, std::string&)> applicable;
  std::function<Output<Scalar>(const Problem<Scalar>&, Index)> run;
};

/// Median wall time of `repeat` calls of f (each call's result is kept by f itself).
template <typename F>
double median_time(int repeat, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < std::max(1, repeat); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Runs `fn()` (returning a Result with output and info) `repeat` times; fills out.
template <typename Scalar, typename F>
void timed(const Problem<Scalar>& p, Output<Scalar>& out, F&& fn) {
  out.seconds = median_time(p.repeat, [&] {
    auto r = fn();
    out.info = r.info;
    out.output = std::move(r.output);
  });
}

inline bool always(std::string&) {
  return true;
}

/// The VIP rows VCC serves: the last min(48, n / 8) tokens (a question after a long context).
inline std::vector<Index> vip_rows(Index n) {
  const Index np = std::max<Index>(1, std::min<Index>(48, n / 8));
  std::vector<Index> v;
  for (Index i = n - np; i < n; ++i) v.push_back(i);
  return v;
}

template <typename Scalar>
std::vector<Method<Scalar>> methods() {
  using P = Problem<Scalar>;
  using O = Output<Scalar>;
  std::vector<Method<Scalar>> ms;

  // Exact Naive (materialised scores in double): the reference kernel of the tests.
  ms.push_back({"naive", [](const P&) { return std::vector<Index>{}; },
                [](const P&, std::string& w) { return always(w); },
                [](const P& p, Index) {
                  O o;
                  ExactOptions eo;
                  eo.causal = p.causal;
                  const ExactAttention<Scalar, policy::Naive> a(eo);
                  timed(p, o, [&] { return a.compute(p.Q, p.K, p.V); });
                  o.config = "Naive (scores in double)";
                  return o;
                }});

  // EVA: exact local window of 64 keys; budget = chunk size (divides or is a multiple of 64).
  ms.push_back({"eva",
                [](const P&) {
                  return std::vector<Index>{128, 64, 16};
                },
                [](const P&, std::string& w) { return always(w); },
                [](const P& p, Index b) {
                  O o;
                  EvaOptions eo;
                  eo.causal = p.causal;
                  eo.window = 64;
                  eo.chunk_size = b;
                  const EvaAttention<Scalar> a(eo);
                  EvaResult<Scalar> last;
                  o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V); });
                  o.info = last.info;
                  o.output = last.output;
                  o.config = "window 64, chunk " + std::to_string(b);
                  o.diag["logits"] = static_cast<double>(last.max_logits);
                  o.diag["chunks"] = static_cast<double>(last.num_chunks);
                  return o;
                }});

  // Performer (positive random features); budget = features.
  ms.push_back({"performer",
                [](const P&) {
                  return std::vector<Index>{64, 256};
                },
                [](const P& p, std::string& w) {
                  if (p.causal) w = "no causal mode (needs a prefix recurrence)";
                  return !p.causal;
                },
                [](const P& p, Index b) {
                  O o;
                  EvaOptions eo;
                  eo.samples = b;
                  eo.seed = p.seed;
                  const PerformerAttention<Scalar> a(eo);
                  timed(p, o, [&] { return a.compute(p.Q, p.K, p.V); });
                  o.config = std::to_string(b) + " features";
                  return o;
                }});

  // VCC: TwoLevel selection, decompressed non-VIP rows; budget = compressed length r; the error
  // is measured on the VIP rows (the rows VCC is designed for).
  ms.push_back({"vcc",
                [](const P&) {
                  return std::vector<Index>{512, 1024};
                },
                [](const P& p, std::string& w) {
                  if (p.causal) w = "no causal mode (compressed keys mix positions)";
                  if (p.Q.rows() != p.K.rows()) w = "self-attention only (n = m)";
                  return w.empty();
                },
                [](const P& p, Index b) {
                  O o;
                  VccOptions vo;
                  vo.budget = b;
                  vo.clamp_budget = true;
                  const VccAttention<Scalar> a(vo);
                  const auto vip = vip_rows(p.Q.rows());
                  VccResult<Scalar> last;
                  o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V, vip); });
                  o.info = last.info;
                  o.output = last.output;
                  o.rows = vip;
                  o.config = "TwoLevel, r " + std::to_string(last.budget_effective) + ", " +
                             std::to_string(vip.size()) + " VIP";
                  o.diag["budget_eff"] = static_cast<double>(last.budget_effective);
                  o.diag["segments"] = static_cast<double>(last.segments.size());
                  return o;
                }});

  // Conv-Basis (causal by construction; compared with causal exact): budget = bases k.
  ms.push_back({"conv_basis",
                [](const P&) {
                  return std::vector<Index>{4, 16, 64};
                },
                [](const P& p, std::string& w) {
                  if (p.Q.rows() != p.K.rows()) w = "self-attention only (n = m)";
                  return w.empty();
                },
                [](const P& p, Index b) {
                  O o;
                  ConvBasisOptions co;
                  co.num_bases = b;
                  const ConvBasisAttention<Scalar> a(co);
                  ConvBasisResult<Scalar> last;
                  o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V); });
                  o.info = last.info;
                  o.output = last.output;
                  o.causal = true;
                  o.config = "Scan, k <= " + std::to_string(b) + ", T " + std::to_string(co.probe);
                  o.diag["bases_used"] = static_cast<double>(last.bases_used);
                  o.diag["rows_recomputed"] = static_cast<double>(last.rows_recomputed);
                  return o;
                }});

  // WildCat: RPNys coreset of the keys; budget = coreset size r (total over bins).
  ms.push_back({"wildcat",
                [](const P& p) {
                  std::vector<Index> b;
                  for (Index r : {Index(64), Index(256), Index(1024)})
                    if (r < p.K.rows()) b.push_back(r);
                  if (b.empty()) b.push_back(p.K.rows());
                  return b;
                },
                [](const P& p, std::string& w) {
                  if (p.causal) w = "no causal mode (the paper's limitation)";
                  return w.empty();
                },
                [](const P& p, Index b) {
                  O o;
                  WildcatOptions wo;
                  wo.rank = b;
                  wo.seed = p.seed;
                  const WildcatAttention<Scalar> a(wo);
                  WildcatResult<Scalar> last;
                  o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V); });
                  o.info = last.info;
                  o.output = last.output;
                  o.config = "RPNys, r " + std::to_string(b) + ", B " + std::to_string(wo.bins);
                  o.diag["pivots"] = static_cast<double>(last.rank);
                  o.diag["error_bound"] = last.error_bound;
                  return o;
                }});

  // KEP-SVGP: rank-s kernel SVD (randomized) of the row-softmax kernel; budget = s. The mean is
  // compared with exact attention; the variance's rank correlation with the realised error is
  // reported by the driver.
  ms.push_back({"kep_svgp",
                [](const P& p) {
                  std::vector<Index> b;
                  for (Index s : {Index(8), Index(32), Index(128)})
                    if (s < std::min(p.Q.rows(), p.K.rows())) b.push_back(s);
                  if (b.empty()) b.push_back(std::min(p.Q.rows(), p.K.rows()));
                  return b;
                },
                [](const P& p, std::string& w) {
                  if (p.causal) w = "no causal mode";
                  return w.empty();
                },
                [](const P& p, Index b) {
                  O o;
                  KepSvgpOptions ko;
                  ko.rank = b;
                  ko.seed = p.seed;
                  const KepSvgpAttention<Scalar> a(ko);
                  KepSvgpResult<Scalar> last;
                  o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V); });
                  o.info = last.info;
                  o.output = last.output;
                  o.variance = last.variance;
                  o.config = "Randomized SVD, s " + std::to_string(b);
                  o.diag["rank_used"] = static_cast<double>(last.rank_used);
                  return o;
                }});

  return ms;
}

}  // namespace compare
}  // namespace effattn
