// Compiled against effattn::compiled's definitions (EFFATTN_COMPILED) by two ctest entries
// (tests/CMakeLists.txt, compiler only, -fsyntax-only): without EFFATTN_ALL_POLICIES the headers
// declare only the default-policy functors, so instantiating VCC with another selection policy
// must stop at the static_assert that names the fix (test compiled_mode:other_policy_needs_macro);
// with EFFATTN_ALL_POLICIES the same TU must compile (test compiled_mode:all_policies), while the
// default functors used next to it still come from the library.
#include <effattn/effattn.hpp>

float run() {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(16, 4);
  const effattn::VccAttention<float, effattn::policy::BestFirstDyadic> vcc;
  const effattn::ExactAttentionf exact;  // a default: extern, from the library
  return (vcc(Q, Q, Q) - exact(Q, Q, Q)).norm();
}
