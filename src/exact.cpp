// effattn::compiled: exact attention, both policies, float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/exact.hpp>

namespace effattn {
template class ExactAttention<float, policy::Tiled>;
template class ExactAttention<double, policy::Tiled>;
template class ExactAttention<float, policy::Naive>;
template class ExactAttention<double, policy::Naive>;
template class ExactAttention<float, policy::TiledBf16>;
}  // namespace effattn
