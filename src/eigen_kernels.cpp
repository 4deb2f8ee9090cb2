// effattn::compiled: Eigen's matrix-product kernels for float and double, compiled once for
// effattn's own targets, which declare them `extern template` (see
// include/effattn/detail/linalg/eigen_kernels.hpp; EFFATTN_EXTERN_EIGEN_KERNELS, set by the
// project's CMake). A user of the installed library does not see the declarations; these
// instantiations are then weak definitions beside the user's own.
#include <effattn/detail/linalg/eigen_kernels.hpp>

EFFATTN_EIGEN_KERNELS(, float)
EFFATTN_EIGEN_KERNELS(, double)
