// effattn::compiled: VCC attention (default policies) and its compression tree, float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/vcc.hpp>

namespace effattn {
template class VccAttention<float>;
template class VccAttention<double>;
template class VccTree<float>;
template class VccTree<double>;
}  // namespace effattn
