// effattn::compiled: KEP-SVGP attention (default kernel, SVD engine and merge), double.
// See kep_svgp.cpp.
#include <effattn/kep_svgp.hpp>

namespace effattn {
template class KepSvgpAttention<double>;
template struct KepSvgpResult<double>;
}  // namespace effattn
