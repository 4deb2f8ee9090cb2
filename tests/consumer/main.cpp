// Consumer check and the compile-cost probe (docs/building.md): a downstream translation unit that
// includes the umbrella header and calls each of the seven functors once (float, default
// options). It is built against the installed package two ways (tests/consumer/CMakeLists.txt):
// compiled (effattn::compiled) and without FFTW (effattn::headers); every build must give exact
// attention equal to the materialised reference and finite n x dv outputs from every method it
// calls. The build without FFTW defines EFFATTN_CONSUMER_FFT_ONLY: it includes every header like
// the other but calls only exact attention and Conv-Basis, the one method with an FFT
// (EFFATTN_USE_FFTW changes nothing else). Each method's header-only build, with FFTW, is
// method.cpp, one translation unit per method.
#include <effattn/effattn.hpp>

#include <cstdio>

#include "inputs.hpp"

namespace {

template <typename Functor>
bool check(const char* name, const Eigen::MatrixXf& Q, const Eigen::MatrixXf& K,
           const Eigen::MatrixXf& V, const Eigen::MatrixXf& exact) {
  const auto r = Functor().compute(Q, K, V);
  const bool ok = r.info == effattn::Info::Success && r.output.rows() == Q.rows() &&
                  r.output.cols() == V.cols() && r.output.allFinite();
  const double err = ok ? (r.output - exact).norm() / exact.norm() : -1.0;
  std::printf("  %-20s %-8s rel. error vs exact %.3e, %zu diagnostics\n", name,
              ok ? "ok" : "FAILED", err, r.diagnostics().size());
  return ok;
}

}  // namespace

int main() {
  const Eigen::Index n = 256, d = 32;
  const ConsumerInputs in = consumer_inputs(n, d);
  const Eigen::MatrixXf &Q = in.Q, &K = in.K, &V = in.V;
  const Eigen::MatrixXf exact = effattn::NaiveAttentionf()(Q, K, V);
  effattn::ExactAttentionf::Options causal;
  causal.causal = true;
  const Eigen::MatrixXf exact_causal = effattn::NaiveAttentionf(causal)(Q, K, V);
  std::printf("effattn consumer: version 0x%06x%s\n", EFFATTN_VERSION,
#ifdef EFFATTN_COMPILED
              " (effattn::compiled)"
#else
              " (header-only)"
#endif
  );
  bool ok = true;
  ok &= check<effattn::ExactAttentionf>("ExactAttention", Q, K, V, exact);
  ok &= check<effattn::ConvBasisAttentionf>("ConvBasisAttention", Q, K, V, exact_causal);
#ifndef EFFATTN_CONSUMER_FFT_ONLY
  ok &= check<effattn::VccAttentionf>("VccAttention", Q, K, V, exact);
  ok &= check<effattn::EvaAttentionf>("EvaAttention", Q, K, V, exact);
  ok &= check<effattn::PerformerAttentionf>("PerformerAttention", Q, K, V, exact);
  ok &= check<effattn::WildcatAttentionf>("WildcatAttention", Q, K, V, exact);
  ok &= check<effattn::KepSvgpAttentionf>("KepSvgpAttention", Q, K, V, exact);
#endif
  const double tiled_err =
      (effattn::ExactAttentionf()(Q, K, V) - exact).norm() / static_cast<double>(exact.norm());
  std::printf("  Tiled vs Naive: %.2e\n", tiled_err);
  return ok && tiled_err < 1e-5 ? 0 : 1;
}
