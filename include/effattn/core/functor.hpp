/// \file functor.hpp
/// \brief `AttentionFunctor`: the base every attention functor derives from (CRTP). It holds
/// what the functors share: `operator()(Q, K, V)` (compute, check, throw) and the defaults of
/// the capability flags that `functor_traits` reads.
///
/// A functor `F` derives from `AttentionFunctor<F, Scalar>`, defines `compute(Q, K, V)` returning
/// a result with `output` and `info`, its `name`, and redeclares the capability flags whose value
/// differs from the default (a redeclaration in `F` hides the base's):
/// \code{.cpp}
/// template <typename Scalar_>
/// class MyAttention : public AttentionFunctor<MyAttention<Scalar_>, Scalar_> {
///  public:
///   static constexpr const char* name = "MyAttention";
///   static constexpr bool supports_causal = true;   // the others keep their defaults
///   MyResult<Scalar_> compute(const ConstRef<Scalar_>& Q, const ConstRef<Scalar_>& K,
///                             const ConstRef<Scalar_>& V) const;
/// };
/// \endcode
#pragma once

#include <utility>

#include "errors.hpp"
#include "types.hpp"

namespace effattn {

/// Base of the attention functors (CRTP: `Derived` is the functor, `Scalar_` its scalar type).
/// Provides `operator()` and the capability flags' defaults (see the file documentation). It has
/// no data: deriving from it changes neither a functor's size nor its results.
template <typename Derived, typename Scalar_>
class AttentionFunctor {
 public:
  /// `Options::causal` exists and is honoured (bottom-right aligned mask). Default: false.
  static constexpr bool supports_causal = false;
  /// The method is causal by construction (no non-causal form). Default: false.
  static constexpr bool causal_only = false;
  /// The output depends on `Options::seed`. Default: false (deterministic).
  static constexpr bool randomized = false;
  /// Q and K must have the same number of rows (one token sequence). Default: false.
  static constexpr bool self_attention_only = false;
  /// At default options the output is softmax attention up to round-off. Default: false.
  static constexpr bool exact = false;

  /// Convenience: `compute(Q, K, V).output` of the derived functor.
  /// \throws effattn::numerical_error if the result's `info` is not `Info::Success` (e.g. a
  ///         non-finite output), and whatever `compute` throws (effattn::invalid_argument on bad
  ///         inputs or options).
  Matrix<Scalar_> operator()(const ConstRef<Scalar_>& Q, const ConstRef<Scalar_>& K,
                             const ConstRef<Scalar_>& V) const {
    return checked_output(static_cast<const Derived&>(*this).compute(Q, K, V));
  }

 protected:
  /// The output of a result `r` of the derived functor, moved out.
  /// \throws effattn::numerical_error naming the functor if `r.info` is not `Info::Success`.
  template <typename Result>
  static Matrix<Scalar_> checked_output(Result&& r) {
    if (r.info != Info::Success) detail::throw_numerical_error(Derived::name, r.info);
    return std::move(r.output);
  }
};

}  // namespace effattn
