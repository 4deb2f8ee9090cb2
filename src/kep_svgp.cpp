// effattn::compiled: KEP-SVGP attention (default kernel, SVD engine and merge), float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/kep_svgp.hpp>

namespace effattn {
template class KepSvgpAttention<float>;
template class KepSvgpAttention<double>;
}  // namespace effattn
