/// \file concept.hpp
/// \brief The attention-functor concept every method models, its capability traits, and the
/// uniform diagnostics of a Result.
///
/// An attention functor `F` (ExactAttention, ConvBasisAttention, VccAttention, EvaAttention,
/// PerformerAttention, WildcatAttention, KepSvgpAttention) has:
/// - `F::Scalar` (float or double), `F::Options`, `F::Result`;
/// - an `explicit F(Options = {})` constructor that validates the options and throws
///   `effattn::invalid_argument` on bad ones;
/// - `[[nodiscard]] Result compute(Q, K, V) const` for Q (n x d), K (m x d), V (m x dv), never
///   throwing on numerical trouble (it sets `Result::info`), with `Result::output` always n x dv;
/// - `Matrix<Scalar> operator()(Q, K, V) const` returning `compute(Q, K, V).output` and throwing
///   `effattn::numerical_error` when `info != Info::Success`;
/// - `const Options& options() const`;
/// - `Result::diagnostics()`, the method's scalar diagnostics as (name, value) pairs, so that
///   generic code (the comparison program, the conformance suite, the multi-head layer) can print
///   them without knowing the method;
/// - static capability constants, read through `functor_traits<F>`: `name`, `supports_causal`
///   (Options has `causal` and honours it), `causal_only` (causal by construction), `randomized`
///   (the output depends on `Options::seed`), `self_attention_only` (Q and K must have the same
///   rows) and `exact` (the default output equals softmax attention up to round-off).
///
/// The library's functors derive from `AttentionFunctor<F, Scalar>` (core/functor.hpp), which
/// provides `operator()` and the capability constants' defaults (each functor redeclares the
/// ones that differ).
///
/// `is_attention_functor_v<F>` checks all of this at compile time (the tests assert it for every
/// functor of the method list).
#pragma once

#include <type_traits>
#include <utility>

#include "types.hpp"

namespace effattn {

/// Compile-time capabilities of an attention functor `F` (see the file documentation).
template <typename F>
struct functor_traits {
  /// The method's name, as in messages ("ExactAttention", "WildcatAttention", ...).
  static constexpr const char* name = F::name;
  /// `Options::causal` exists and is honoured (bottom-right aligned mask).
  static constexpr bool supports_causal = F::supports_causal;
  /// The method is causal by construction (no non-causal form).
  static constexpr bool causal_only = F::causal_only;
  /// The output depends on `Options::seed` (fixed seed: bit-identical results).
  static constexpr bool randomized = F::randomized;
  /// Q and K must have the same number of rows (one token sequence).
  static constexpr bool self_attention_only = F::self_attention_only;
  /// At default options the output is exact softmax attention up to round-off.
  static constexpr bool exact = F::exact;
};

namespace detail {

template <typename F, typename = void>
struct has_functor_types : std::false_type {};
template <typename F>
struct has_functor_types<F,
                         std::void_t<typename F::Scalar, typename F::Options, typename F::Result>>
    : std::bool_constant<is_supported_scalar_v<typename F::Scalar>> {};

template <typename F, typename = void>
struct has_functor_members : std::false_type {};
template <typename F>
struct has_functor_members<
    F, std::void_t<
           decltype(std::declval<const F&>().compute(
               std::declval<const ConstRef<typename F::Scalar>&>(),
               std::declval<const ConstRef<typename F::Scalar>&>(),
               std::declval<const ConstRef<typename F::Scalar>&>())),
           decltype(std::declval<const F&>()(std::declval<const ConstRef<typename F::Scalar>&>(),
                                             std::declval<const ConstRef<typename F::Scalar>&>(),
                                             std::declval<const ConstRef<typename F::Scalar>&>())),
           decltype(std::declval<const F&>().options()),
           decltype(std::declval<const typename F::Result&>().output),
           decltype(std::declval<const typename F::Result&>().info),
           decltype(std::declval<const typename F::Result&>().diagnostics()),
           decltype(functor_traits<F>::name), decltype(functor_traits<F>::supports_causal),
           decltype(functor_traits<F>::causal_only), decltype(functor_traits<F>::randomized),
           decltype(functor_traits<F>::self_attention_only), decltype(functor_traits<F>::exact)>> {
  using S = typename F::Scalar;
  using R = typename F::Result;
  static constexpr bool value =
      std::is_same<decltype(std::declval<const F&>().compute(std::declval<const ConstRef<S>&>(),
                                                             std::declval<const ConstRef<S>&>(),
                                                             std::declval<const ConstRef<S>&>())),
                   R>::value &&
      std::is_same<decltype(std::declval<const F&>()(std::declval<const ConstRef<S>&>(),
                                                     std::declval<const ConstRef<S>&>(),
                                                     std::declval<const ConstRef<S>&>())),
                   Matrix<S>>::value &&
      std::is_same<decltype(std::declval<const F&>().options()),
                   const typename F::Options&>::value &&
      std::is_same<std::decay_t<decltype(std::declval<const R&>().output)>, Matrix<S>>::value &&
      std::is_same<std::decay_t<decltype(std::declval<const R&>().info)>, Info>::value &&
      std::is_same<decltype(std::declval<const R&>().diagnostics()), Diagnostics>::value &&
      // Options -> F only explicitly; default construction works.
      std::is_constructible<F, typename F::Options>::value &&
      !std::is_convertible<typename F::Options, F>::value &&
      std::is_default_constructible<F>::value;
};

template <typename F, bool = has_functor_types<F>::value>
struct is_attention_functor_impl : std::false_type {};
template <typename F>
struct is_attention_functor_impl<F, true> : std::bool_constant<has_functor_members<F>::value> {};

}  // namespace detail

/// True when `F` models the attention-functor concept (see the file documentation).
template <typename F>
constexpr bool is_attention_functor_v = detail::is_attention_functor_impl<F>::value;

}  // namespace effattn
