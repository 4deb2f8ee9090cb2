// Explicit instantiation of every public class template for float and double, so that members
// no other test calls still compile (Sophus's cheapest guard for header-only templates).
//
// Nothing here runs: the check is that this file compiles, so ctest runs the compiler on it with
// -fsyntax-only (tests/CMakeLists.txt, test `test_instantiate`). GCC instantiates every member of
// an explicit instantiation definition and every function the static_asserts below call under
// -fsyntax-only as well (it reports the errors of instantiated bodies); it skips only the code
// generation, which took 208 of the 298 s (3.7 GB) the linked -O0 executable cost the ci build:
// 90 s and 2.8 GB now, at test time.
#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

// The default-policy functors: in compiled mode (this test links effattn::compiled when it is
// built) src/ instantiates exactly these, with the same explicit instantiation definitions, so
// compiling them again here would only repeat that work (they were most of this file's 530 s).
#ifndef EFFATTN_COMPILED
#include "compiled_instances.inc"
template class effattn::VccTree<float>;
template class effattn::VccTree<double>;
template class effattn::WildcatAttention<float>;
template class effattn::WildcatAttention<double>;
template class effattn::KepSvgpAttention<float>;
template class effattn::KepSvgpAttention<double>;
template class effattn::fft::CausalConv<float>;
template class effattn::fft::CausalConv<double>;
#endif

template struct effattn::ExactResult<float>;
template struct effattn::ExactResult<double>;
template struct effattn::workloads::Workload<float>;
template struct effattn::workloads::Workload<double>;
template class effattn::VccAttention<double, effattn::policy::BestFirstDyadic,
                                     effattn::policy::SumExp, effattn::policy::ExactQuery>;
template class effattn::RpCholesky<effattn::policy::RandomlyPivoted>;
template class effattn::RpCholesky<effattn::policy::AcceleratedRandomlyPivoted>;
template class effattn::RpCholesky<effattn::policy::GreedyPivoted>;
template class effattn::ExpDotKernel<float>;
template class effattn::ExpDotKernel<double>;
template class effattn::ExpDotKernel<float, float>;
template class effattn::GaussianKernel<float>;
template class effattn::GaussianKernel<double>;
template struct effattn::RpCholeskyResult<float>;
template struct effattn::RpCholeskyResult<double>;
template struct effattn::NystromResult<double>;
template class effattn::ConvBasisAttention<double, effattn::fft::EigenFft,
                                           effattn::policy::BinarySearch>;
template class effattn::ConvBasisAttention<float, effattn::fft::Default, effattn::policy::Grid,
                                           float>;
template class effattn::WildcatAttention<double, effattn::policy::RandomlyPivoted>;
template struct effattn::CompressedKV<float>;
template struct effattn::CompressedKV<double>;
template class effattn::KepSvgpAttention<double, effattn::policy::SoftmaxRowKernel,
                                         effattn::policy::DenseSvd, effattn::policy::Addition>;
template class effattn::KepSvgpAttention<float, effattn::policy::CosineKernel,
                                         effattn::policy::FactorizedSvd,
                                         effattn::policy::Concatenation>;
template class effattn::fft::CausalConv<float, effattn::fft::EigenFft, float>;

// Compile-time checks (evaluated when this function is instantiated, i.e. by the compiler run).
void check_functor_traits();
void check_functor_traits() {
  // Every functor of the method list models the concept of core/concept.hpp.
  effattn::for_each_method<float>([](auto tag) {
    static_assert(effattn::is_attention_functor_v<typename decltype(tag)::type>,
                  "effattn: a functor of the method list misses the concept (core/concept.hpp)");
  });
  effattn::for_each_method<double>([](auto tag) {
    static_assert(effattn::is_attention_functor_v<typename decltype(tag)::type>,
                  "effattn: a functor of the method list misses the concept (core/concept.hpp)");
  });
  // The aliases name the intended types.
  static_assert(std::is_same<effattn::ExactAttentionf, effattn::ExactAttention<float>>::value, "");
  static_assert(std::is_same<effattn::ExactAttentiond, effattn::ExactAttention<double>>::value, "");
  static_assert(std::is_same<effattn::ExactAttentionf::Options, effattn::ExactOptions>::value, "");
  static_assert(std::is_same<effattn::EvaAttentionf, effattn::EvaAttention<float>>::value, "");
  static_assert(std::is_same<effattn::EvaAttentiond::Options, effattn::EvaOptions>::value, "");
  static_assert(std::is_same<effattn::WildcatAttentionf::Options, effattn::WildcatOptions>::value,
                "");
  static_assert(std::is_same<effattn::KepSvgpAttentiond::Options, effattn::KepSvgpOptions>::value,
                "");
  static_assert(effattn::is_rp_kernel_v<effattn::ExpDotKernelf>, "");
  static_assert(effattn::is_rp_kernel_v<effattn::GaussianKerneld>, "");
  static_assert(EFFATTN_VERSION == ((EFFATTN_VERSION_MAJOR << 16) | (EFFATTN_VERSION_MINOR << 8) |
                                    EFFATTN_VERSION_PATCH),
                "");
}
