// effattn::compiled: WildCat attention (default pivot rule), float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/wildcat.hpp>

namespace effattn {
template class WildcatAttention<float>;
template class WildcatAttention<double>;
}  // namespace effattn
