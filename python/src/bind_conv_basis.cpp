// Conv-Basis attention from Python: forward through MultiHead<ConvBasisAttention<S>> and the
// backward with the basis starts frozen at the forward result's offsets.
#include "common.hpp"

namespace effattn {
namespace python {

namespace {

ConvBasisOptions conv_basis_options(Kwargs& kw) {
  ConvBasisOptions o;
  kw.get("scale", o.scale);
  kw.get("num_bases", o.num_bases);
  kw.get("probe", o.probe);
  kw.get("threshold", o.threshold);
  kw.get("epsilon", o.epsilon);
  kw.get_renamed("sliding_window", "window", o.sliding_window);
  kw.get_renamed("mask_block", "block_size", o.mask_block);
  kw.get("guard", o.guard);
  kw.get("guard_tolerance", o.guard_tolerance);
  kw.get_enum("conv_method", o.conv_method,
              {{"fft", fft::ConvMethod::Fft},
               {"direct", fft::ConvMethod::Direct},
               {"auto", fft::ConvMethod::Auto}});
  kw.finish();
  return o;
}

}  // namespace

PyResult run_conv_basis(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<ConvBasisAttention<float>>(kw, causal);
  const ConvBasisOptions o = conv_basis_options(kw);
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<ConvBasisAttention<S>>(p, o, "conv_basis");
  });
}

py::tuple backward_conv_basis(const Packed& p, Kwargs& kw, bool causal, const py::object& result,
                              const View& dO) {
  check_causal<ConvBasisAttention<float>>(kw, causal);
  const ConvBasisOptions o = conv_basis_options(kw);
  const std::string fn = kw.function();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const ConvBasisAttention<S> f(o);
    const Matrix<S> Q = p.q.map<S>(), K = p.k.map<S>(), V = p.v.map<S>(), G = dO.map<S>();
    ConvBasisResult<S> fwd;
    if (result.is_none()) {
      py::gil_scoped_release release;
      fwd = f.compute(Q, K, V);
    } else {
      const PyResult& r = forward_result(result, "conv_basis", fn);
      fwd.output = result_matrix<S>(r.output, "result.output", fn);
      if (!r.extras.contains("offsets"))
        throw py::value_error(fn + ": result has no offsets (not a single-head conv_basis result)");
      const auto off = py::array_t<std::int64_t, py::array::forcecast>::ensure(r.extras["offsets"]);
      for (py::ssize_t i = 0; i < off.size(); ++i) fwd.offsets.push_back(off.at(i));
      fwd.bases_used = static_cast<Index>(fwd.offsets.size());
      fwd.info = Info::Success;
    }
    if (fwd.info != Info::Success)
      throw floating_point_error(fn + ": the forward pass failed numerically (info " +
                                 to_string(fwd.info) + ")");
    typename ConvBasisAttention<S>::Gradients g;
    {
      py::gil_scoped_release release;
      g = f.backward(Q, K, V, fwd, G);
    }
    return gradients_tuple(std::move(g));
  });
}

}  // namespace python
}  // namespace effattn

namespace effattn {
namespace python {

py::tuple sdpa_backward_conv_basis(const Packed& p, Kwargs& kw, bool causal, const View& dO) {
  check_causal<ConvBasisAttention<float>>(kw, causal);
  const ConvBasisOptions o = conv_basis_options(kw);
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed_backward<ConvBasisAttention<S>>(p, o, dO, kw.function());
  });
}

}  // namespace python
}  // namespace effattn
