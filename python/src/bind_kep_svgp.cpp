// KEP-SVGP from Python (MultiHead<KepSvgpAttention<S>>): mean output and predictive variance;
// and the learned layer with its trainer utilities (kep_svgp_layer, kep_svgp_kl,
// kep_svgp_ksvd_loss), one head at a time.
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
              {{"full", kep_svgp::CovMode::Full}, {"approx", kep_svgp::CovMode::Approx}});
  kw.get_enum("prior", o.prior,
              {{"auto", kep_svgp::PriorScale::Auto},
               {"value_second_moment", kep_svgp::PriorScale::ValueSecondMoment},
               {"unit", kep_svgp::PriorScale::Unit}});
  kw.get_enum("rbranch", o.rbranch,
              {{"shared", kep_svgp::RBranch::Shared}, {"transpose", kep_svgp::RBranch::Transpose}});
  kw.get("block_rows", o.block_rows);
  kw.get("seed", o.seed);
  kw.finish();
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<KepSvgpAttention<S>>(p, o, "kep_svgp");
  });
}

namespace {

bool any_f64(std::initializer_list<const py::object*> objs) {
  for (const py::object* o : objs) {
    const py::array a = py::array::ensure(*o);
    if (a && a.dtype().is(py::dtype::of<double>())) return true;
  }
  return false;
}

template <typename S>
Vector<S> vector_arg(const py::object& o, const char* name, const std::string& fn) {
  const py::array a = py::array::ensure(o);
  if (!a || a.ndim() != 1) throw py::value_error(fn + ": " + name + " must be a 1-D array");
  return result_matrix<S>(a.attr("reshape")(1, -1), name, fn).transpose();
}

template <typename S>
kep_svgp::VariationalParams<S> vp_arg(const py::object& m_u, const py::object& l_u,
                                      const std::string& fn) {
  kep_svgp::VariationalParams<S> vp;
  vp.m_u = result_matrix<S>(m_u, "m_u", fn);
  const py::array l = py::array::ensure(l_u);
  if (!l || l.ndim() != 3)
    throw py::value_error(fn + ": l_u must be a 3-D (dv, s, s) array of lower-triangular factors");
  for (py::ssize_t c = 0; c < l.shape(0); ++c)
    vp.L_u.push_back(result_matrix<S>(l[py::int_(c)], "l_u[c]", fn));
  return vp;
}

kep_svgp::LearnedMerge merge_arg(const std::string& merge, const std::string& fn) {
  if (merge == "addition") return kep_svgp::LearnedMerge::Addition;
  if (merge == "e_only") return kep_svgp::LearnedMerge::EOnly;
  throw py::value_error(fn + ": merge must be 'addition' or 'e_only'; got '" + merge + "'");
}

py::tuple kep_svgp_layer(const py::object& q, const py::object& k, const py::object& w_e,
                         const py::object& w_r, const py::object& lam, const py::object& m_u,
                         const py::object& l_u, const std::string& merge) {
  const std::string fn = "effattn.kep_svgp_layer";
  auto run = [&](auto tag) {
    using S = decltype(tag);
    kep_svgp::LearnedLayer<S> layer;
    layer.W_e = result_matrix<S>(w_e, "w_e", fn);
    layer.W_r = result_matrix<S>(w_r, "w_r", fn);
    layer.lambda = vector_arg<S>(lam, "lam", fn);
    layer.vp = vp_arg<S>(m_u, l_u, fn);
    const Matrix<S> Q = result_matrix<S>(q, "q", fn), K = result_matrix<S>(k, "k", fn);
    kep_svgp::LearnedPosterior<S> r;
    {
      py::gil_scoped_release release;
      r = kep_svgp::learned_layer<S>(Q, K, layer, merge_arg(merge, fn));
    }
    return py::make_tuple(own_matrix(std::move(r.mean)), own_matrix(std::move(r.variance)),
                          own_matrix(std::move(r.E)), own_matrix(std::move(r.R)));
  };
  if (any_f64({&q, &k, &w_e, &w_r, &lam, &m_u, &l_u})) return run(double{});
  return run(float{});
}

double kep_svgp_kl(const py::object& lam, const py::object& m_u, const py::object& l_u) {
  const std::string fn = "effattn.kep_svgp_kl";
  if (any_f64({&lam, &m_u, &l_u}))
    return kep_svgp::kl_divergence<double>(vector_arg<double>(lam, "lam", fn),
                                           vp_arg<double>(m_u, l_u, fn));
  return kep_svgp::kl_divergence<float>(vector_arg<float>(lam, "lam", fn),
                                        vp_arg<float>(m_u, l_u, fn));
}

double kep_svgp_ksvd_loss(const py::object& e, const py::object& r, const py::object& lam,
                          const py::object& w_e, const py::object& w_r,
                          const std::string& reduction) {
  const std::string fn = "effattn.kep_svgp_ksvd_loss";
  if (reduction != "mean" && reduction != "sum")
    throw py::value_error(fn + ": reduction must be 'mean' or 'sum'; got '" + reduction + "'");
  const auto red = reduction == "mean" ? kep_svgp::Reduction::Mean : kep_svgp::Reduction::Sum;
  auto run = [&](auto tag) {
    using S = decltype(tag);
    return kep_svgp::ksvd_loss<S>(result_matrix<S>(e, "e", fn), result_matrix<S>(r, "r", fn),
                                  vector_arg<S>(lam, "lam", fn), result_matrix<S>(w_e, "w_e", fn),
                                  result_matrix<S>(w_r, "w_r", fn), red);
  };
  if (any_f64({&e, &r, &lam, &w_e, &w_r})) return run(double{});
  return run(float{});
}

}  // namespace

void bind_kep_svgp_layer(py::module_& m) {
  m.def(
      "kep_svgp_layer", &kep_svgp_layer, py::arg("q"), py::arg("k"), py::arg("w_e"), py::arg("w_r"),
      py::arg("lam"), py::arg("m_u"), py::arg("l_u"), py::arg("merge") = "addition",
      R"doc(kep_svgp_layer(q, k, w_e, w_r, lam, m_u, l_u, merge='addition') -> (mean, variance, e, r)

KEP-SVGP's learned layer for one head (C++ kep_svgp::learned_layer): q (n, d), k (m, d), primal
projections w_e, w_r (d, s), learned singular values lam (s,) > 0, q(u) as m_u (s, dv) and
lower-triangular factors l_u (dv, s, s). With the cosine feature map, E = phi(q) w_e,
R = phi(k) w_r, F = E + R ('addition', n = m) or E ('e_only'): mean F diag(1/lam) m_u and
variance ||L_c^T diag(1/lam) F_i||^2, each (n, dv); also E (n, s) and R (m, s). float64 when
any input is, float32 otherwise. effattn.torch.kep_svgp_layer is its differentiable reference.)doc");
  m.def("kep_svgp_kl", &kep_svgp_kl, py::arg("lam"), py::arg("m_u"), py::arg("l_u"),
        R"doc(kep_svgp_kl(lam, m_u, l_u) -> float

KL(q(u) || p(u)) of KEP-SVGP (eq. 21) with p(u_c) = N(0, diag(lam)^2), q(u_c) = N(m_c, L_c L_c^T),
summed over the dv columns (C++ kep_svgp::kl_divergence, accumulated in double).)doc");
  m.def("kep_svgp_ksvd_loss", &kep_svgp_ksvd_loss, py::arg("e"), py::arg("r"), py::arg("lam"),
        py::arg("w_e"), py::arg("w_r"), py::arg("reduction") = "sum",
        R"doc(kep_svgp_ksvd_loss(e, r, lam, w_e, w_r, reduction='sum') -> float

KEP-SVGP's KSVD regulariser J^2 (eq. 11; 'mean' divides the two token sums by the token counts,
as the official code does) (C++ kep_svgp::ksvd_loss).)doc");
}

}  // namespace python
}  // namespace effattn
