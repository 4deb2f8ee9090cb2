/// \file method_configs.hpp
/// \brief Per-method test configurations for the list-driven tests (edge cases, thread safety).
///
/// The tests iterate `effattn::MethodList<Scalar>` (effattn/methods.hpp) and read the method's
/// capabilities from `functor_traits`; what a generic test cannot know (options that make a method
/// exact, small-budget options, which output to compare) lives here, one specialization per
/// functor of the list. A functor added to the list without a specialization does not compile in
/// those tests: a new method is registered in the list once and configured here once.
///
/// Each specialization of `MethodTestConfig<F>` provides:
/// - `using Approx`: the functor (F, or the same method with other policies) of the approximate
///   configuration;
/// - `static constexpr bool has_exact_limit`, and `exact_limit(n, m)`: options of F that make it
///   exact softmax attention (up to round-off) on an n x m problem;
/// - `approx(n, m)`: small-budget options of `Approx` (often larger than m on tiny cases);
/// - `stress()`: options of `Approx` for the 8-thread stress test (moderate budgets);
/// - `exact_tol_eps(is_double)`: the exact-limit tolerance in units of epsilon;
/// - `static constexpr bool convex`: the approximate output is a convex combination of value rows
///   (checked against V's column ranges); otherwise |o_ic| <= ||V_c||_2 is checked;
/// - `observed(result)`: what the stress test compares bit for bit.
#pragma once

#include <effattn/methods.hpp>

#include <algorithm>

namespace effattn {
namespace testing {

template <typename F>
struct MethodTestConfig;

/// Defaults shared by most specializations.
template <typename F>
struct MethodTestConfigBase {
  using Approx = F;
  static constexpr bool has_exact_limit = true;
  static constexpr bool convex = true;
  static double exact_tol_eps(bool /*is_double*/) { return 32; }
  template <typename R>
  static Matrix<typename F::Scalar> observed(const R& r) {
    return r.output;
  }
};

template <typename S>
struct MethodTestConfig<ExactAttention<S>> : MethodTestConfigBase<ExactAttention<S>> {
  static ExactOptions exact_limit(Index, Index) {
    ExactOptions o;
    o.block_q = 16;  // several blocks on the larger cases
    o.block_k = 24;
    return o;
  }
  static ExactOptions approx(Index n, Index m) { return exact_limit(n, m); }
  static ExactOptions stress() {
    ExactOptions o;
    o.block_q = 32;
    o.block_k = 48;
    return o;
  }
};

template <typename S>
struct MethodTestConfig<ExactAttention<S, policy::Naive>>
    : MethodTestConfigBase<ExactAttention<S, policy::Naive>> {
  static ExactOptions exact_limit(Index, Index) { return {}; }
  static ExactOptions approx(Index, Index) { return {}; }
  static ExactOptions stress() {
    ExactOptions o;
    o.causal = true;
    return o;
  }
};

template <typename S>
struct MethodTestConfig<ConvBasisAttention<S>> : MethodTestConfigBase<ConvBasisAttention<S>> {
  using Options = typename ConvBasisAttention<S>::Options;
  static Options exact_limit(Index n, Index) {
    Options o;  // k = n, T = 1, threshold 0: exact causal (Cor. 4.5 of the Conv-Basis paper)
    o.num_bases = n;
    o.probe = 1;
    return o;
  }
  static Options approx(Index, Index) {
    Options o;
    o.num_bases = 4;
    o.probe = 4;
    return o;
  }
  static Options stress() {
    Options o;
    o.num_bases = 6;
    o.probe = 4;
    return o;
  }
  // k = n goes through FFTs of exp(U_r - mu) whose dynamic range is e^(2 max|logit|): measured
  // 1.2e-13 (550 eps) in double on the d = 1 case (logits up to 8.8), at most 2.8e-7 (2.3 eps) in
  // float (FFTs in double). 4500 eps = 1e-12 in double is the paper-derived tolerance of the
  // method's exact limit; it would be 5.4e-4 in float, so float keeps 32 eps.
  static double exact_tol_eps(bool is_double) { return is_double ? 4500.0 : 32.0; }
};

template <typename S>
struct MethodTestConfig<VccAttention<S>> : MethodTestConfigBase<VccAttention<S>> {
  using Approx = VccAttention<S, policy::BestFirstDyadic>;
  static VccOptions exact_limit(Index n, Index) {
    VccOptions o;
    o.budget = n;  // budget >= n: exact
    o.vip = {0};
    return o;
  }
  static VccOptions approx(Index, Index) {
    VccOptions o;
    o.budget = 8;
    o.clamp_budget = true;
    o.vip = {0};
    return o;
  }
  static VccOptions stress() {
    VccOptions o;
    o.budget = 40;
    o.vip = {0, 5, 9};
    return o;
  }
};

template <typename S>
struct MethodTestConfig<EvaAttention<S>> : MethodTestConfigBase<EvaAttention<S>> {
  static EvaOptions exact_limit(Index, Index m) {
    EvaOptions o;
    o.window = m;  // one exact block holds every key
    return o;
  }
  static EvaOptions approx(Index, Index) {
    EvaOptions o;
    o.window = 4;
    o.chunk_size = 2;
    o.samples = 2;
    return o;
  }
  static EvaOptions stress() {
    EvaOptions o;
    o.window = 16;
    o.chunk_size = 8;
    o.samples = 2;
    return o;
  }
};

template <typename S>
struct MethodTestConfig<PerformerAttention<S>> : MethodTestConfigBase<PerformerAttention<S>> {
  using Options = typename PerformerAttention<S>::Options;
  static constexpr bool has_exact_limit = false;  // random features are never exact
  static Options exact_limit(Index, Index) { return {}; }
  static Options approx(Index, Index) {
    Options o;
    o.features = 16;
    return o;
  }
  static Options stress() {
    Options o;
    o.features = 32;
    return o;
  }
};

template <typename S>
struct MethodTestConfig<WildcatAttention<S>> : MethodTestConfigBase<WildcatAttention<S>> {
  static WildcatOptions exact_limit(Index, Index m) {
    WildcatOptions o;  // rank >= m: every key kept with weight 1 (exact)
    o.rank = m;
    return o;
  }
  static WildcatOptions approx(Index, Index) {
    WildcatOptions o;  // a coreset well below m on the larger cases, 2 bins
    o.rank = 6;
    o.bins = 2;
    return o;
  }
  static WildcatOptions stress() {
    WildcatOptions o;
    o.rank = 24;
    o.bins = 2;
    return o;
  }
};

template <typename S>
struct MethodTestConfig<KepSvgpAttention<S>> : MethodTestConfigBase<KepSvgpAttention<S>> {
  static constexpr bool convex = false;
  static KepSvgpOptions exact_limit(Index n, Index m) {
    KepSvgpOptions o;  // s = min(n, m): the KSVD spans K's row space
    o.rank = std::min(n, m);
    return o;
  }
  static KepSvgpOptions approx(Index, Index) {
    KepSvgpOptions o;
    o.rank = 3;
    return o;
  }
  static KepSvgpOptions stress() {
    KepSvgpOptions o;
    o.rank = 8;
    return o;
  }
  // Full rank goes through an SVD of the n x m kernel (singular values below 1e-12 sigma_1
  // dropped, 1e-6 in float): measured 1.95e-13 (880 eps) in double on the d = 1 case (a
  // numerically rank-deficient kernel), 1.3e-6 (11 eps) in float. Double gets 1e-12 (4500 eps),
  // float keeps 32 eps.
  static double exact_tol_eps(bool is_double) { return is_double ? 4500.0 : 32.0; }
  /// The stress test compares the mean and the variance.
  template <typename R>
  static Matrix<S> observed(const R& r) {
    Matrix<S> both(r.output.rows(), 2 * r.output.cols());
    both << r.output, r.variance;
    return both;
  }
};

}  // namespace testing
}  // namespace effattn
