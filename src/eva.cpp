// effattn::compiled: EVA and Performer attention, float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/eva.hpp>

namespace effattn {
template class EvaAttention<float>;
template class EvaAttention<double>;
template class PerformerAttention<float>;
template class PerformerAttention<double>;
}  // namespace effattn
