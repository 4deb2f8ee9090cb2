// effattn::compiled: Conv-Basis attention and the batched causal convolution, float and double.
// The headers declare these instantiations `extern template` when EFFATTN_COMPILED is defined
// (the target defines it for itself and its users), so they are compiled once, here.
#include <effattn/conv_basis.hpp>

namespace effattn {
template class ConvBasisAttention<float>;
template class ConvBasisAttention<double>;
template class fft::CausalConv<float>;
template class fft::CausalConv<double>;
}  // namespace effattn
