/// \file config.hpp
/// \brief Every macro a user may set, in one place.
///
/// Macros the user may define before including any effattn header:
/// - `EFFATTN_USE_FFTW`: use FFTW for the FFT backends (the CMake target defines it when
///   `EFFATTN_WITH_FFTW=ON` and FFTW was found). Binaries then fall under FFTW's GPL terms.
/// - `EFFATTN_DONT_PARALLELIZE`: never open OpenMP regions inside effattn, even when compiled
///   with `-fopenmp` (mirrors `EIGEN_DONT_PARALLELIZE`).
/// - `EFFATTN_NO_DEBUG`: compile out `EFFATTN_ASSERT` (implied by `NDEBUG`).
/// - `EFFATTN_ASSERT(cond)`: may be predefined to route internal-invariant failures elsewhere.
/// - `EFFATTN_COMPILED`: the heavy members of the default-policy functors are compiled into the
///   `effattn::compiled` library; the headers then declare them `extern template` and user
///   translation units do not instantiate them. The CMake target `effattn::compiled` defines it;
///   define it by hand only when linking that library. The headers of Exact, EVA / Performer,
///   Conv-Basis, VCC and AutoAttention then leave out their implementation headers
///   (`detail/*_impl.hpp`), which were most of a user TU's compile time: the default-policy
///   functors (`ExactAttentionf`, `VccAttentiond`, ...) need only their declarations (WildCat,
///   KEP-SVGP and VCC's tree keep theirs for their free function templates). Instantiating a
///   functor with another policy in such a TU stops at a `static_assert` that names the fix: define
///   `EFFATTN_ALL_POLICIES`.
/// - `EFFATTN_ALL_POLICIES`: with `EFFATTN_COMPILED`, include the implementation headers anyway,
///   so that this TU can instantiate any policy (the defaults still come from the library). No
///   effect in header-only builds, which always include them.
///
/// Macros effattn defines for its own use: `EFFATTN_HAS_OPENMP` (0 or 1),
/// `EFFATTN_DETAIL_WITH_IMPL` (0 or 1: whether the implementation headers are included),
/// `EFFATTN_LIKELY`, `EFFATTN_UNLIKELY`, `EFFATTN_COLD`, `EFFATTN_NOINLINE`.
#pragma once

#include "version.hpp"

#if defined(_OPENMP) && !defined(EFFATTN_DONT_PARALLELIZE)
/// 1 when effattn opens OpenMP regions (compiled with OpenMP and not EFFATTN_DONT_PARALLELIZE).
#define EFFATTN_HAS_OPENMP 1
#else
/// 0: effattn runs serially (no OpenMP, or EFFATTN_DONT_PARALLELIZE).
#define EFFATTN_HAS_OPENMP 0
#endif

#if !defined(EFFATTN_COMPILED) || defined(EFFATTN_ALL_POLICIES)
/// 1: the method headers include their implementation headers (header-only, or
/// `EFFATTN_ALL_POLICIES`).
#define EFFATTN_DETAIL_WITH_IMPL 1
#else
/// 0: compiled mode without `EFFATTN_ALL_POLICIES`: declarations only, the default-policy
/// instantiations come from `effattn::compiled`.
#define EFFATTN_DETAIL_WITH_IMPL 0
#endif

#if defined(__GNUC__) || defined(__clang__)
/// Branch hint: `x` is usually true.
#define EFFATTN_LIKELY(x) __builtin_expect(!!(x), 1)
/// Branch hint: `x` is usually false.
#define EFFATTN_UNLIKELY(x) __builtin_expect(!!(x), 0)
/// Marks a function that runs rarely (error paths).
#define EFFATTN_COLD __attribute__((cold))
/// Keeps a function out of line (error paths).
#define EFFATTN_NOINLINE __attribute__((noinline))
#else
/// Branch hint (no-op on this compiler).
#define EFFATTN_LIKELY(x) (x)
/// Branch hint (no-op on this compiler).
#define EFFATTN_UNLIKELY(x) (x)
/// Cold-function hint (no-op on this compiler).
#define EFFATTN_COLD
/// No-inline hint (no-op on this compiler).
#define EFFATTN_NOINLINE
#endif

#if defined(NDEBUG) && !defined(EFFATTN_NO_DEBUG)
#define EFFATTN_NO_DEBUG
#endif
