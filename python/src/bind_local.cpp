// VCC, EVA, Performer and AutoAttention from Python (MultiHead<F> over the packed views).
#include "common.hpp"

namespace effattn {
namespace python {

PyResult run_vcc(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<VccAttention<float>>(kw, causal);
  VccOptions o;
  kw.get("scale", o.scale);
  kw.get("budget", o.budget);
  kw.get("block_size", o.block_size);
  kw.get("fine_blocks", o.fine_blocks);
  kw.get("clamp_budget", o.clamp_budget);
  kw.get("lookahead", o.lookahead);
  kw.get("vip", o.vip);
  kw.finish();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<VccAttention<S>>(p, o, "vcc");
  });
}

PyResult run_eva(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<EvaAttention<float>>(kw, causal);
  EvaOptions o;
  kw.get("scale", o.scale);
  kw.get("window", o.window);
  kw.get("chunk_size", o.chunk_size);
  kw.get("samples", o.samples);
  kw.get("seed", o.seed);
  kw.get_enum("mass", o.mass,
              {{"log_count", eva::Mass::LogCount},
               {"literal", eva::Mass::Literal},
               {"gaussian_diag", eva::Mass::GaussianDiag}});
  kw.get_enum("proposal", o.proposal,
              {{"sum_means", eva::Proposal::SumMeans},
               {"half_sum", eva::Proposal::HalfSum},
               {"query_mean", eva::Proposal::QueryMean},
               {"zero", eva::Proposal::Zero}});
  kw.get_enum(
      "partition", o.partition,
      {{"disjoint", eva::Partition::Disjoint}, {"overlapping", eva::Partition::Overlapping}});
  kw.finish();
  o.causal = causal;
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<EvaAttention<S>>(p, o, "eva");
  });
}

PyResult run_performer(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<PerformerAttention<float>>(kw, causal);
  PerformerOptions o;
  kw.get("scale", o.scale);
  kw.get_renamed("features", "samples", o.features);
  kw.get("seed", o.seed);
  kw.finish();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<PerformerAttention<S>>(p, o, "performer");
  });
}

PyResult run_auto(const Packed& p, Kwargs& kw, bool causal) {
  AutoOptions o;
  kw.get("scale", o.scale);
  kw.get("target_error", o.target_error);
  kw.get_renamed("error_sample_rows", "probe_rows", o.error_sample_rows);
  kw.get("max_overhead", o.max_overhead);
  kw.get("safety", o.safety);
  kw.get("eva_min_target", o.eva_min_target);
  kw.get("wildcat_min_rank_error", o.wildcat_min_rank_error);
  kw.get("seed", o.seed);
  kw.get("allow_wildcat", o.allow_wildcat);
  kw.get("allow_eva", o.allow_eva);
  kw.finish();
  o.causal = causal;
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<AutoAttention<S>>(p, o, "auto");
  });
}

}  // namespace python
}  // namespace effattn
