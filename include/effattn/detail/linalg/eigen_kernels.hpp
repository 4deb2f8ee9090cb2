/// \file eigen_kernels.hpp
/// \brief Build-time device of effattn's own targets (not for users): Eigen's matrix-product
/// kernels compiled once, in effattn::compiled, instead of in every translation unit.
///
/// Every translation unit that multiplies dynamic Eigen matrices instantiates Eigen's
/// general block-panel kernel (`gebp_kernel`), its packing routines and its matrix-vector
/// kernels for each scalar, and optimises them again: measured on the asan preset (clang, -O1
/// with ASan + UBSan), test_wildcat 71.6 s of compiler CPU without this file, 49.1 s with it,
/// the whole tree 1168 s against 902 s. These members
/// are `EIGEN_DONT_INLINE` (never inlined into their callers), so compiling them once changes
/// no generated code of the callers and no result; the GEMM drivers
/// (`general_matrix_matrix_product<...>::run`, inline) stay available for inlining as before
/// (the `extern` declaration only stops each translation unit from emitting its own copy).
///
/// `EFFATTN_EIGEN_KERNELS(EXT, S)` lists the instantiations for scalar S (the kernel shapes come
/// from Eigen's own `gebp_traits`, so they follow the translation unit's SIMD flags). With
/// `EFFATTN_EXTERN_EIGEN_KERNELS` defined, core/types.hpp includes this file and the list is
/// declared `extern template` for float and double; src/eigen_kernels.cpp defines it in
/// effattn::compiled. The project's CMake defines the macro for the compiled library's own
/// sources and for the tests, benchmarks, examples, Python module and fuzz target it builds with
/// the same flags; it is not part of the installed targets' interface, because a user translation
/// unit built with other SIMD flags needs other kernel shapes than the library holds (its link
/// would fail).
#pragma once

#include <Eigen/Core>

#define EFFATTN_EIGEN_KERNELS(EXT, S)                                                              \
  namespace Eigen {                                                                                \
  namespace internal {                                                                             \
  EXT template struct gebp_kernel<S, S, Index, blas_data_mapper<S, Index, ColMajor, Unaligned, 1>, \
                                  gebp_traits<S, S>::mr, gebp_traits<S, S>::nr, false, false>;     \
  EXT template struct gemm_pack_lhs<S, Index, const_blas_data_mapper<S, Index, ColMajor>,          \
                                    gebp_traits<S, S>::mr, gebp_traits<S, S>::LhsProgress,         \
                                    gebp_traits<S, S>::LhsPacket4Packing, ColMajor, false, false>; \
  EXT template struct gemm_pack_lhs<S, Index, const_blas_data_mapper<S, Index, RowMajor>,          \
                                    gebp_traits<S, S>::mr, gebp_traits<S, S>::LhsProgress,         \
                                    gebp_traits<S, S>::LhsPacket4Packing, RowMajor, false, false>; \
  EXT template struct gemm_pack_rhs<S, Index, const_blas_data_mapper<S, Index, ColMajor>,          \
                                    gebp_traits<S, S>::nr, ColMajor, false, false>;                \
  EXT template struct gemm_pack_rhs<S, Index, const_blas_data_mapper<S, Index, RowMajor>,          \
                                    gebp_traits<S, S>::nr, RowMajor, false, false>;                \
  EXT template struct gemm_pack_rhs<S, Index, blas_data_mapper<S, Index, ColMajor, Unaligned, 1>,  \
                                    gebp_traits<S, S>::nr, ColMajor, false, true>;                 \
  EXT template struct general_matrix_matrix_product<Index, S, ColMajor, false, S, ColMajor, false, \
                                                    ColMajor, 1>;                                  \
  EXT template struct general_matrix_matrix_product<Index, S, ColMajor, false, S, RowMajor, false, \
                                                    ColMajor, 1>;                                  \
  EXT template struct general_matrix_matrix_product<Index, S, RowMajor, false, S, ColMajor, false, \
                                                    ColMajor, 1>;                                  \
  EXT template struct general_matrix_vector_product<                                               \
      Index, S, const_blas_data_mapper<S, Index, RowMajor>, RowMajor, false, S,                    \
      const_blas_data_mapper<S, Index, ColMajor>, false, Specialized>;                             \
  EXT template struct general_matrix_vector_product<                                               \
      Index, S, const_blas_data_mapper<S, Index, ColMajor>, ColMajor, false, S,                    \
      const_blas_data_mapper<S, Index, RowMajor>, false, Specialized>;                             \
  EXT template struct general_matrix_vector_product<                                               \
      Index, S, const_blas_data_mapper<S, Index, RowMajor>, RowMajor, false, S,                    \
      const_blas_data_mapper<S, Index, RowMajor>, false, BuiltIn>;                                 \
  }                                                                                                \
  }

#ifdef EFFATTN_EXTERN_EIGEN_KERNELS
EFFATTN_EIGEN_KERNELS(extern, float)
EFFATTN_EIGEN_KERNELS(extern, double)
#endif
