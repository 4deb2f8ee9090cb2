// The methods effattn-compare runs: every functor of effattn::MethodList (effattn/methods.hpp),
// with one CompareConfig per functor mapping a budget (in the method's own unit) to options; the
// diagnostics are each Result's own `diagnostics()`.
#pragma once

#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
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
  /// --heads / --kv-heads: Q is n x (heads d), K and V are m x (kv_heads d) in the packed layout
  /// and every method runs through MultiHead<F>; 1 / 1 = one head, the functor called directly.
  HeadLayout layout = {1, 1};
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

/// The candidate budgets below `limit` (the budget at which a method becomes exact), or `limit`
/// itself when none is (tiny problems).
inline std::vector<Index> budgets_below(std::initializer_list<Index> candidates, Index limit) {
  std::vector<Index> b;
  for (const Index c : candidates)
    if (c < limit) b.push_back(c);
  if (b.empty()) b.push_back(limit);
  return b;
}

/// How effattn-compare runs one functor of effattn::MethodList: its `--methods` key, its default
/// budgets (in the method's own unit), the options for a budget and a description of them. One
/// specialization per functor of the list (a functor without one does not compile here); the
/// diagnostics come from `Result::diagnostics()` and applicability from `functor_traits`.
template <typename F>
struct CompareConfig;

template <typename S>
struct CompareConfig<ExactAttention<S>> {  // the reference: the driver runs it itself
  static constexpr const char* id = "exact";
};

template <typename S>
struct CompareConfig<ExactAttention<S, policy::Naive>> {
  static constexpr const char* id = "naive";
  static std::vector<Index> budgets(const Problem<S>&) { return {}; }
  static ExactOptions options(const Problem<S>& p, Index) {
    ExactOptions o;
    o.causal = p.causal;
    return o;
  }
  template <typename R>
  static std::string describe(const ExactOptions&, const R&) {
    return "Naive (scores in double)";
  }
};

template <typename S>
struct CompareConfig<EvaAttention<S>> {  // exact window of 64 keys; budget = chunk size
  static constexpr const char* id = "eva";
  static std::vector<Index> budgets(const Problem<S>&) { return {128, 64, 16}; }
  static EvaOptions options(const Problem<S>& p, Index b) {
    EvaOptions o;
    o.causal = p.causal;
    o.window = 64;
    o.chunk_size = b;
    return o;
  }
  template <typename R>
  static std::string describe(const EvaOptions& o, const R&) {
    return "window 64, chunk " + std::to_string(o.chunk_size);
  }
};

template <typename S>
struct CompareConfig<PerformerAttention<S>> {  // budget = random features
  static constexpr const char* id = "performer";
  using Options = typename PerformerAttention<S>::Options;
  static std::vector<Index> budgets(const Problem<S>&) { return {64, 256}; }
  static Options options(const Problem<S>& p, Index b) {
    Options o;
    o.features = b;
    o.seed = p.seed;
    return o;
  }
  template <typename R>
  static std::string describe(const Options& o, const R&) {
    return std::to_string(o.features) + " features";
  }
};

template <typename S>
struct CompareConfig<VccAttention<S>> {  // TwoLevel; budget = compressed length r; VIP rows
  static constexpr const char* id = "vcc";
  static std::vector<Index> budgets(const Problem<S>&) { return {512, 1024}; }
  static VccOptions options(const Problem<S>& p, Index b) {
    VccOptions o;
    o.budget = b;
    o.clamp_budget = true;
    o.vip = vip_rows(p.Q.rows());
    return o;
  }
  template <typename R>
  static std::string describe(const VccOptions& o, const R& r) {
    return "TwoLevel, r " + std::to_string(r.budget_effective) + ", " +
           std::to_string(o.vip.size()) + " VIP";
  }
  /// The error is measured on the VIP rows, the rows VCC is designed for.
  static std::vector<Index> rows(const VccOptions& o) { return o.vip; }
};

template <typename S>
struct CompareConfig<ConvBasisAttention<S>> {  // causal by construction; budget = bases k
  static constexpr const char* id = "conv_basis";
  using Options = typename ConvBasisAttention<S>::Options;
  static std::vector<Index> budgets(const Problem<S>&) { return {4, 16, 64}; }
  static Options options(const Problem<S>&, Index b) {
    Options o;
    o.num_bases = b;
    return o;
  }
  template <typename R>
  static std::string describe(const Options& o, const R&) {
    return "Scan, k <= " + std::to_string(o.num_bases) + ", T " + std::to_string(o.probe);
  }
};

template <typename S>
struct CompareConfig<WildcatAttention<S>> {  // RPNys coreset; budget = coreset size r
  static constexpr const char* id = "wildcat";
  static std::vector<Index> budgets(const Problem<S>& p) {
    return budgets_below({64, 256, 1024}, p.K.rows());
  }
  static WildcatOptions options(const Problem<S>& p, Index b) {
    WildcatOptions o;
    o.rank = b;
    o.seed = p.seed;
    return o;
  }
  template <typename R>
  static std::string describe(const WildcatOptions& o, const R&) {
    return "RPNys, r " + std::to_string(o.rank) + ", B " + std::to_string(o.bins);
  }
};

template <typename S>
struct CompareConfig<KepSvgpAttention<S>> {  // rank-s randomized kernel SVD; budget = s
  static constexpr const char* id = "kep_svgp";
  static std::vector<Index> budgets(const Problem<S>& p) {
    return budgets_below({8, 32, 128}, std::min(p.Q.rows(), p.K.rows()));
  }
  static KepSvgpOptions options(const Problem<S>& p, Index b) {
    KepSvgpOptions o;
    o.rank = b;
    o.seed = p.seed;
    return o;
  }
  template <typename R>
  static std::string describe(const KepSvgpOptions& o, const R&) {
    return "Randomized SVD, s " + std::to_string(o.rank);
  }
};

template <typename C, typename O, typename = void>
struct has_rows : std::false_type {};
template <typename C, typename O>
struct has_rows<C, O, std::void_t<decltype(C::rows(std::declval<const O&>()))>> : std::true_type {};

template <typename R, typename = void>
struct has_variance : std::false_type {};
template <typename R>
struct has_variance<R, std::void_t<decltype(std::declval<const R&>().variance)>> : std::true_type {
};

/// Every functor of effattn::MethodList except the exact reference, as a Method.
template <typename Scalar>
std::vector<Method<Scalar>> methods() {
  using P = Problem<Scalar>;
  std::vector<Method<Scalar>> ms;
  for_each_method<Scalar>([&](auto tag) {
    using F = typename decltype(tag)::type;
    using T = functor_traits<F>;
    using C = CompareConfig<F>;
    if constexpr (!std::is_same<F, ExactAttention<Scalar>>::value) {
      Method<Scalar> m;
      m.name = C::id;
      m.default_budgets = [](const P& p) { return C::budgets(p); };
      m.applicable = [](const P& p, std::string& w) {
        if (p.causal && !T::supports_causal && !T::causal_only) w = "no causal mode";
        if (T::self_attention_only && p.Q.rows() != p.K.rows()) w = "self-attention only (n = m)";
        return w.empty();
      };
      m.run = [](const P& p, Index b) {
        Output<Scalar> o;
        const auto opts = C::options(p, b);
        const F a(opts);
        typename F::Result last;
        if (p.layout.heads == 1 && p.layout.kv_heads == 1) {
          o.seconds = median_time(p.repeat, [&] { last = a.compute(p.Q, p.K, p.V); });
          o.info = last.info;
          o.output = last.output;
        } else {
          // Every (sequence, head) through MultiHead; the diagnostics shown are head 0's.
          const MultiHead<F> mh(opts, p.layout);
          MultiHeadResult<F> r;
          o.seconds = median_time(p.repeat, [&] { r = mh.compute(p.Q, p.K, p.V); });
          o.info = r.info;
          o.output = r.output;
          last = r.head(0, 0);
          if constexpr (has_variance<typename F::Result>::value) {
            // Per-head variances side by side, as the packed output.
            o.variance.resize(r.output.rows(), r.output.cols());
            const Index dv = r.output.cols() / p.layout.heads;
            for (Index h = 0; h < p.layout.heads; ++h)
              o.variance.middleCols(h * dv, dv) = r.head(0, h).variance;
          }
        }
        o.causal = T::causal_only;
        o.config = C::describe(opts, last);
        for (const Diagnostic& d : last.diagnostics()) o.diag[d.name] = d.value;
        if constexpr (has_rows<C, decltype(opts)>::value) o.rows = C::rows(opts);
        if constexpr (has_variance<typename F::Result>::value)
          if (o.variance.size() == 0) o.variance = last.variance;
        return o;
      };
      ms.push_back(std::move(m));
    }
  });
  return ms;
}

}  // namespace compare
}  // namespace effattn
