// Compiled as effattn::compiled's users compile (EFFATTN_COMPILED, no EFFATTN_ALL_POLICIES) by the
// ctest entry compiled_mode:in_class_members (tests/CMakeLists.txt, -fsyntax-only): the explicit
// instantiation definitions below instantiate every member defined inside the class bodies of the
// functors whose implementation headers such a TU leaves out (Exact, EVA, Performer, Conv-Basis,
// VCC, Auto; config.hpp) and of MultiHead over them, so any of those bodies that needs code of an
// implementation header fails to compile here. (Members defined out of class are not
// instantiated: their definitions are not visible, by design. WildCat and KEP-SVGP keep their
// implementation headers.)
#include <effattn/effattn.hpp>

#include "compiled_instances.inc"  // the functors
template class effattn::MultiHead<effattn::ExactAttentionf>;
template class effattn::MultiHead<effattn::ExactAttentionBf16>;
template class effattn::MultiHead<effattn::VccAttentiond>;
template class effattn::MultiHead<effattn::EvaAttentionf>;
template class effattn::MultiHead<effattn::PerformerAttentionf>;
template class effattn::MultiHead<effattn::ConvBasisAttentionf>;
