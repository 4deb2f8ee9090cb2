// effattn::compiled: KEP-SVGP attention (default kernel, SVD engine and merge), float.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here. Float and
// double are separate translation units (kep_svgp_double.cpp), so the two build in parallel (each
// once instantiated Eigen's BDCSVD, then the most expensive code of the library).
#include <effattn/kep_svgp.hpp>

namespace effattn {
template class KepSvgpAttention<float>;
template struct KepSvgpResult<float>;
}  // namespace effattn
