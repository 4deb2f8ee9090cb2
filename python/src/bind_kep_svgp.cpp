// KEP-SVGP from Python (MultiHead<KepSvgpAttention<S>>): mean output and predictive variance.
#include "common.hpp"

namespace effattn {
namespace python {

PyResult run_kep_svgp(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<KepSvgpAttention<float>>(kw, causal);
  KepSvgpOptions o;
  kw.get("scale", o.scale);
  kw.get("rank", o.rank);
  kw.get("oversample", o.oversample);
  kw.get("power_iters", o.power_iters);
  kw.get("rank_rtol", o.rank_rtol);
  kw.get_enum("cov", o.cov,
              {{"full", kepsvgp::CovMode::Full}, {"approx", kepsvgp::CovMode::Approx}});
  kw.get_enum("prior", o.prior,
              {{"auto", kepsvgp::PriorScale::Auto},
               {"value_second_moment", kepsvgp::PriorScale::ValueSecondMoment},
               {"unit", kepsvgp::PriorScale::Unit}});
  kw.get_enum("rbranch", o.rbranch,
              {{"shared", kepsvgp::RBranch::Shared}, {"transpose", kepsvgp::RBranch::Transpose}});
  kw.get("block_rows", o.block_rows);
  kw.get("seed", o.seed);
  kw.finish();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<KepSvgpAttention<S>>(p, o, "kep_svgp");
  });
}

}  // namespace python
}  // namespace effattn
