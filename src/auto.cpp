// effattn::compiled: AutoAttention, float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/auto.hpp>

namespace effattn {
template class AutoAttention<float>;
template class AutoAttention<double>;
}  // namespace effattn
