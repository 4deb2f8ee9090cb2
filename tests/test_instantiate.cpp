// Explicit instantiation of every public class template for float and double, so that members
// no other test calls still compile (Sophus's cheapest guard for header-only templates).
#include "test_utils.hpp"

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

TEST_CASE("Every public class template instantiates for float and double", "[instantiate]") {
  // Every functor of the method list models the concept of core/concept.hpp.
  effattn::for_each_method<float>([](auto tag) {
    STATIC_REQUIRE(effattn::is_attention_functor_v<typename decltype(tag)::type>);
  });
  effattn::for_each_method<double>([](auto tag) {
    STATIC_REQUIRE(effattn::is_attention_functor_v<typename decltype(tag)::type>);
  });
  // The umbrella header compiled and the explicit instantiations above linked; check that the
  // aliases name the intended types.
  STATIC_REQUIRE(std::is_same<effattn::ExactAttentionf, effattn::ExactAttention<float>>::value);
  STATIC_REQUIRE(std::is_same<effattn::ExactAttentiond, effattn::ExactAttention<double>>::value);
  STATIC_REQUIRE(std::is_same<effattn::ExactAttentionf::Options, effattn::ExactOptions>::value);
  STATIC_REQUIRE(std::is_same<effattn::EvaAttentionf, effattn::EvaAttention<float>>::value);
  STATIC_REQUIRE(std::is_same<effattn::EvaAttentiond::Options, effattn::EvaOptions>::value);
  STATIC_REQUIRE(std::is_same<effattn::WildcatAttentionf::Options, effattn::WildcatOptions>::value);
  STATIC_REQUIRE(std::is_same<effattn::KepSvgpAttentiond::Options, effattn::KepSvgpOptions>::value);
  STATIC_REQUIRE(effattn::is_rp_kernel_v<effattn::ExpDotKernelf>);
  STATIC_REQUIRE(effattn::is_rp_kernel_v<effattn::GaussianKerneld>);
  STATIC_REQUIRE(EFFATTN_VERSION == ((EFFATTN_VERSION_MAJOR << 16) | (EFFATTN_VERSION_MINOR << 8) |
                                     EFFATTN_VERSION_PATCH));
}
