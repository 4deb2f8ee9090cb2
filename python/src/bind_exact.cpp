// Exact attention from Python: policies tiled (MultiHead's multi-head kernel, inputs read in
// place), naive and tiled_bf16 (per-head calls), bf16 bit-pattern input, and the backward.
#include "common.hpp"

namespace effattn {
namespace python {

namespace {

ExactOptions exact_options(Kwargs& kw, bool causal, std::string& policy) {
  ExactOptions o;
  kw.get("scale", o.scale);
  kw.get("block_q", o.block_q);
  kw.get("block_k", o.block_k);
  kw.get_enum(
      "bf16_scores", o.bf16_scores,
      {{"auto", Bf16Scores::Auto}, {"single", Bf16Scores::Single}, {"split", Bf16Scores::Split}});
  policy = "tiled";
  kw.get("policy", policy);
  kw.finish();
  if (policy != "tiled" && policy != "naive" && policy != "tiled_bf16")
    throw py::value_error(kw.function() +
                          ": option policy of method 'exact' must be 'tiled', 'naive' or "
                          "'tiled_bf16'; got '" +
                          policy + "'");
  o.causal = causal;
  return o;
}

}  // namespace

PyResult run_exact(const Packed& p, Kwargs& kw, bool causal) {
  std::string policy;
  const ExactOptions o = exact_options(kw, causal, policy);
  if (policy == "tiled_bf16") {
    if (p.dtype != Dtype::F32)
      throw py::value_error(kw.function() +
                            ": policy 'tiled_bf16' takes float32 (or uint16 bf16) input");
    return run_packed<ExactAttention<float, policy::TiledBf16>>(p, o, "exact");
  }
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if (policy == "naive") return run_packed<ExactAttention<S, policy::Naive>>(p, o, "exact");
    return run_packed<ExactAttention<S>>(p, o, "exact");
  });
}

PyResult run_exact_bf16(const py::array& q, const py::array& k, const py::array& v, Kwargs& kw,
                        bool causal) {
  std::string policy;
  ExactOptions o = exact_options(kw, causal, policy);
  if (!kw.has("policy") && policy == "tiled") policy = "tiled_bf16";
  if (policy != "tiled_bf16")
    throw py::value_error(kw.function() + ": bf16 (uint16) input needs policy 'tiled_bf16'; got '" +
                          policy + "'");
  using Bf16 = Eigen::bfloat16;
  using RowBf16 = Eigen::Map<const RowMatrix<Bf16>, 0, Eigen::OuterStride<>>;
  auto map = [&](const py::array& a, const char* name) {
    if (a.ndim() != 2)
      throw py::value_error(kw.function() + ": " + name +
                            " must be a 2-D (tokens, features) array");
    py::array c = py::array_t<std::uint16_t, py::array::c_style>::ensure(a);
    return std::make_pair(c, RowBf16(static_cast<const Bf16*>(c.data()), c.shape(0), c.shape(1),
                                     Eigen::OuterStride<>(std::max<Index>(1, c.shape(1)))));
  };
  const auto Q = map(q, "q"), K = map(k, "k"), V = map(v, "v");
  const ExactAttention<float, policy::TiledBf16> f(o);
  ExactResult<float> r;
  double seconds = 0;
  {
    py::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    // Bf16Ref is column-major: the row-major bf16 inputs are copied once (2 bytes per value).
    r = f.compute(Q.second, K.second, V.second);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  PyResult out;
  out.method = "exact";
  out.info = to_string(r.info);
  out.seconds = seconds;
  fill_diagnostics(r, out);
  RowMatrix<float> o_row = r.output;
  out.output = own_matrix(std::move(o_row));
  fill_extras(r, out.extras);
  out.extras["dtype"] = "bfloat16";
  return out;
}

py::tuple backward_exact(const Packed& p, Kwargs& kw, bool causal, const py::object& result,
                         const View& dO) {
  std::string policy;
  const ExactOptions o = exact_options(kw, causal, policy);
  if (policy == "tiled_bf16")
    throw py::value_error(kw.function() + ": no backward for policy 'tiled_bf16'");
  const std::string fn = kw.function();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    auto run = [&](auto functor) {
      const Matrix<S> Q = p.q.map<S>(), K = p.k.map<S>(), V = p.v.map<S>(), G = dO.map<S>();
      ExactResult<S> fwd;
      if (result.is_none()) {
        py::gil_scoped_release release;
        fwd = functor.compute(Q, K, V);
      } else {
        const PyResult& r = forward_result(result, "exact", fn);
        fwd.output = result_matrix<S>(r.output, "result.output", fn);
        if (!r.extras.contains("lse"))
          throw py::value_error(fn + ": result has no lse (not a single-head exact result)");
        const Matrix<S> lse =
            result_matrix<S>(r.extras["lse"].attr("reshape")(-1, 1), "result.lse", fn);
        fwd.lse = lse.col(0);
        fwd.info = Info::Success;
      }
      if (fwd.info != Info::Success)
        throw floating_point_error(fn + ": the forward pass failed numerically (info " +
                                   to_string(fwd.info) + ")");
      typename ExactAttention<S>::Gradients g;
      {
        py::gil_scoped_release release;
        g = functor.backward(Q, K, V, fwd, G);
      }
      return gradients_tuple(std::move(g));
    };
    if (policy == "naive") return run(ExactAttention<S, policy::Naive>(o));
    return run(ExactAttention<S>(o));
  });
}

}  // namespace python
}  // namespace effattn

namespace effattn {
namespace python {

py::tuple sdpa_backward_exact(const Packed& p, Kwargs& kw, bool causal, const View& dO) {
  std::string policy;
  const ExactOptions o = exact_options(kw, causal, policy);
  if (policy == "tiled_bf16")
    throw py::value_error(kw.function() + ": no backward for policy 'tiled_bf16' from Python");
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if (policy == "naive")
      return run_packed_backward<ExactAttention<S, policy::Naive>>(p, o, dO, kw.function());
    return run_packed_backward<ExactAttention<S>>(p, o, dO, kw.function());
  });
}

}  // namespace python
}  // namespace effattn
