// One method as a user who needs only that method writes it: the method's public header alone,
// its default float functor, one call. tests/consumer/CMakeLists.txt builds this file once per
// method, header-only (effattn::effattn), with one of the macros below defined; the translation
// units are the per-method rows of bench/compile_cost.sh. Each executable checks that the output
// is n x dv and finite.
#if defined(EFFATTN_CONSUMER_EXACT)
#include <effattn/exact.hpp>
using Functor = effattn::ExactAttentionf;
#elif defined(EFFATTN_CONSUMER_CONV_BASIS)
#include <effattn/conv_basis.hpp>
using Functor = effattn::ConvBasisAttentionf;
#elif defined(EFFATTN_CONSUMER_VCC)
#include <effattn/vcc.hpp>
using Functor = effattn::VccAttentionf;
#elif defined(EFFATTN_CONSUMER_EVA)
#include <effattn/eva.hpp>
using Functor = effattn::EvaAttentionf;
#elif defined(EFFATTN_CONSUMER_PERFORMER)
#include <effattn/eva.hpp>
using Functor = effattn::PerformerAttentionf;
#elif defined(EFFATTN_CONSUMER_WILDCAT)
#include <effattn/wildcat.hpp>
using Functor = effattn::WildcatAttentionf;
#elif defined(EFFATTN_CONSUMER_KEP_SVGP)
#include <effattn/kep_svgp.hpp>
using Functor = effattn::KepSvgpAttentionf;
#elif defined(EFFATTN_CONSUMER_AUTO)
#include <effattn/auto.hpp>
using Functor = effattn::AutoAttentionf;
#elif defined(EFFATTN_CONSUMER_MULTI_HEAD)
#include <effattn/multi_head.hpp>
using Functor = effattn::MultiHead<effattn::ExactAttentionf>;
#else
#error "define one EFFATTN_CONSUMER_<METHOD> (tests/consumer/CMakeLists.txt)"
#endif

#include <cmath>
#include <cstdio>

#include "inputs.hpp"

int main() {
  const Eigen::Index n = 256, d = 32;
  const ConsumerInputs in = consumer_inputs(n, d);
  const Eigen::MatrixXf &Q = in.Q, &K = in.K, &V = in.V;
  const Functor f;
#if defined(EFFATTN_CONSUMER_MULTI_HEAD)
  const Eigen::MatrixXf out = f.compute(Q, K, V).output;  // one head: the default layout
#else
  const Eigen::MatrixXf out = f(Q, K, V);
#endif
  const bool ok = out.rows() == n && out.cols() == d && out.allFinite();
  std::printf("effattn method consumer: %-36s %s\n", Functor::name, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
