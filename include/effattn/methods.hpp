/// \file methods.hpp
/// \brief The one list of effattn's attention functors, for generic code.
///
/// `MethodList<Scalar>` names every functor at its default policies, in a fixed order; the
/// conformance, edge-case, thread-safety and fuzz tests, the comparison program and the layers
/// that wrap a functor (multi-head, Python) iterate it, so a new method is registered here once.
/// Each functor models the concept of `core/concept.hpp` (`is_attention_functor_v`), and its
/// capabilities are read through `functor_traits`.
///
/// \code{.cpp}
/// #include <effattn/methods.hpp>
/// effattn::for_each_method<float>([&](auto tag) {
///   using F = typename decltype(tag)::type;
///   std::printf("%s causal=%d\n", effattn::functor_traits<F>::name,
///               effattn::functor_traits<F>::supports_causal);
/// });
/// \endcode
#pragma once

#include <cstddef>
#include <utility>

#include "conv_basis.hpp"
#include "core/concept.hpp"
#include "eva.hpp"
#include "exact.hpp"
#include "kep_svgp.hpp"
#include "vcc.hpp"
#include "wildcat.hpp"

namespace effattn {

/// A list of types.
template <typename... T>
struct TypeList {
  /// Number of types in the list.
  static constexpr std::size_t size = sizeof...(T);
};

/// A value standing for the type `T` (passed to the callback of `for_each_type`).
template <typename T>
struct TypeTag {
  /// The type.
  using type = T;
};

/// Every attention functor at its default policies, for one scalar type: exact attention (Tiled,
/// then the Naive reference), Conv-Basis, VCC, EVA, Performer, WildCat, KEP-SVGP.
template <typename Scalar>
using MethodList =
    TypeList<ExactAttention<Scalar>, ExactAttention<Scalar, policy::Naive>,
             ConvBasisAttention<Scalar>, VccAttention<Scalar>, EvaAttention<Scalar>,
             PerformerAttention<Scalar>, WildcatAttention<Scalar>, KepSvgpAttention<Scalar>>;

/// Calls `f(TypeTag<T>{})` for every type `T` of `List`, in order.
template <typename List, typename F>
void for_each_type(F&& f);

/// \cond
namespace detail {
template <typename... T, typename F>
void for_each_type_impl(TypeList<T...>, F& f) {
  (f(TypeTag<T>{}), ...);
}
}  // namespace detail
/// \endcond

template <typename List, typename F>
void for_each_type(F&& f) {
  detail::for_each_type_impl(List{}, f);
}

/// Calls `f(TypeTag<F>{})` for every functor `F` of `MethodList<Scalar>`.
template <typename Scalar, typename F>
void for_each_method(F&& f) {
  for_each_type<MethodList<Scalar>>(std::forward<F>(f));
}

}  // namespace effattn
