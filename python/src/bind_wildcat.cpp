// WildCat from Python: attention through MultiHead<WildcatAttention<S>>, and the compressed KV
// cache (compress_kv, CompressedKV.append, weighted_attention) for one head; the KV-cache
// presses (kv_press), which return the same cache type.
#include "common.hpp"

#include <effattn/kv_press.hpp>

namespace effattn {
namespace python {

namespace {

WildcatOptions wildcat_options(Kwargs& kw, WildcatOptions o = {}) {
  kw.get("scale", o.scale);
  kw.get("rank", o.rank);
  kw.get("bins", o.bins);
  kw.get("seed", o.seed);
  kw.get("clip", o.clip);
  kw.get("rel_tol", o.rel_tol);
  kw.get("q_radius", o.q_radius);
  kw.get("temperature", o.temperature);
  kw.get_enum("fallback", o.fallback,
              {{"zero", wildcat::Fallback::Zero}, {"midpoint", wildcat::Fallback::Midpoint}});
  kw.get("denominator_tol", o.denominator_tol);
  kw.get_renamed("proposal_block", "block_size", o.proposal_block);
  kw.get("fit_temperature", o.fit_temperature);
  kw.get("bf16_attention", o.bf16_attention);
  kw.get("target_error", o.target_error);
  kw.get("error_sample_rows", o.error_sample_rows);
  kw.finish();
  return o;
}

/// A WildCat compressed KV cache of one head (float32 or float64).
struct PyCache {
  std::shared_ptr<CompressedKV<float>> f;
  std::shared_ptr<CompressedKV<double>> d;
  WildcatOptions opts;

  Dtype dtype() const { return f ? Dtype::F32 : Dtype::F64; }
  template <typename Fn>
  auto visit(Fn&& fn) const {
    if (f) return fn(*f);
    return fn(*d);
  }
};

py::array copy_out(const Matrix<float>& m) {
  return own_matrix(Matrix<float>(m));
}
py::array copy_out(const Matrix<double>& m) {
  return own_matrix(Matrix<double>(m));
}
py::array copy_out(const Vector<float>& m) {
  return own_matrix(Vector<float>(m));
}
py::array copy_out(const Vector<double>& m) {
  return own_matrix(Vector<double>(m));
}

/// The prompt of a cache from Python: k (m, d) and v (m, dv) viewed in one dtype (float64 when
/// either is, float32 otherwise).
struct KvInput {
  Dtype dtype;
  View K, V;
};
KvInput kv_input(const py::object& k, const py::object& v, const std::string& fn) {
  const py::array ka = py::array::ensure(k), va = py::array::ensure(v);
  if (!ka || !va) throw py::value_error(fn + ": k and v must be arrays");
  const Dtype dt =
      (ka.dtype().is(py::dtype::of<double>()) || va.dtype().is(py::dtype::of<double>()))
          ? Dtype::F64
          : Dtype::F32;
  return {dt, view_2d(ka, dt, "k", fn), view_2d(va, dt, "v", fn)};
}

/// A cache of `dtype` filled by `fill(cache)` (a generic lambda over CompressedKV<S>), run with
/// the GIL released; `opts` are kept for weighted_attention.
template <typename Fill>
PyCache make_cache(Dtype dtype, const WildcatOptions& opts, Fill&& fill) {
  PyCache c;
  c.opts = opts;
  auto run = [&](auto tag) {
    using S = typename decltype(tag)::type;
    auto cache = std::make_shared<CompressedKV<S>>();
    {
      py::gil_scoped_release release;
      fill(*cache);
    }
    if constexpr (std::is_same_v<S, float>)
      c.f = cache;
    else
      c.d = cache;
  };
  if (dtype == Dtype::F32)
    run(TypeTag<float>{});
  else
    run(TypeTag<double>{});
  return c;
}

template <typename Cache>
using CacheScalar = typename std::decay_t<decltype(std::declval<Cache&>().keys)>::Scalar;

PyCache compress_kv(const py::object& k, const py::object& v, double q_radius,
                    const py::kwargs& kwargs) {
  const std::string fn = "effattn.compress_kv";
  Kwargs kw(kwargs, "wildcat", fn);
  const KvInput in = kv_input(k, v, fn);
  const WildcatOptions o = wildcat_options(kw);
  return make_cache(in.dtype, o, [&](auto& cache) {
    using S = CacheScalar<decltype(cache)>;
    // Row-major views become column-major Refs: K and V are copied once.
    cache = WildcatAttention<S>(o).compress_kv(in.K.map<S>(), in.V.map<S>(), q_radius);
  });
}

PyCache kv_press_py(const py::object& k, const py::object& v, const std::string& press, double keep,
                    Index rows, const py::object& q, const py::kwargs& kwargs) {
  const std::string fn = "effattn.kv_press";
  Kwargs kw(kwargs, press, fn);
  KvPressOptions o;
  o.press = kv_press::from_name(press);  // invalid_argument -> ValueError (module translator)
  o.keep = keep;
  o.rows = rows;
  kw.get("sinks", o.sinks);
  kw.get("observation", o.observation);
  kw.get("pool", o.pool);
  kw.get("causal", o.causal);
  kw.get("query_heads", o.query_heads);
  kw.get("scale", o.scale);
  kw.get("seed", o.seed);
  kw.get("q_radius", o.q_radius);
  kw.get("block_size", o.block_size);
  kw.finish();
  const KvInput in = kv_input(k, v, fn);
  const bool has_q = !q.is_none();
  py::array qa;
  if (has_q) {
    qa = py::array::ensure(q);
    if (!qa) throw py::value_error(fn + ": q must be an array or None");
  }
  const View Q = has_q ? view_2d(qa, in.dtype, "q", fn) : in.K;  // in.K: unused stand-in
  WildcatOptions wo;
  wo.scale = o.scale;  // weighted_attention must use the press's logit scale
  const auto run = [&](auto& cache) {
    using S = CacheScalar<decltype(cache)>;
    const Matrix<S> Qm = has_q ? Matrix<S>(Q.map<S>()) : Matrix<S>(0, in.K.map<S>().cols());
    cache = KvPress<S>(o).compress(in.K.map<S>(), in.V.map<S>(), Qm);
  };
  return make_cache(in.dtype, wo, run);
}

PyResult weighted_attention(const py::object& q, const PyCache& cache, bool check,
                            const py::kwargs& kwargs) {
  const std::string fn = "effattn.weighted_attention";
  Kwargs kw(kwargs, "wildcat", fn);
  const WildcatOptions o = wildcat_options(kw, cache.opts);
  const py::array qa = py::array::ensure(q);
  if (!qa) throw py::value_error(fn + ": q must be an array");
  const View Q = view_2d(qa, cache.dtype(), "q", fn);
  PyResult out = cache.visit([&](const auto& ckv) {
    using S = typename std::decay_t<decltype(ckv.keys)>::Scalar;
    const WildcatAttention<S> f(o);
    WildcatResult<S> r;
    PyResult res;
    {
      py::gil_scoped_release release;
      const auto t0 = std::chrono::steady_clock::now();
      r = f.weighted_attention(Q.map<S>(), ckv);
      res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    res.method = "wildcat";
    res.info = to_string(r.info);
    fill_diagnostics(r, res);
    RowMatrix<S> o_row = r.output;
    res.output = own_matrix(std::move(o_row));
    fill_extras(r, res.extras);
    return res;
  });
  check_info(out, check, fn);
  return out;
}

}  // namespace

PyResult run_wildcat(const Packed& p, Kwargs& kw, bool causal) {
  check_causal<WildcatAttention<float>>(kw, causal);
  const WildcatOptions o = wildcat_options(kw);
  return by_dtype(p.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run_packed<WildcatAttention<S>>(p, o, "wildcat");
  });
}

void bind_wildcat_cache(py::module_& m) {
  py::class_<PyCache>(m, "CompressedKV",
                      "A WildCat compressed KV cache of one head (compress_kv): r coreset keys "
                      "with Nystrom-compressed values,\nplus an exact tail of appended tokens. "
                      "Attend with weighted_attention(q, cache).")
      .def_property_readonly(
          "size", [](const PyCache& c) { return c.visit([](const auto& x) { return x.size(); }); },
          "coreset rows (compressed rows plus tail)")
      .def_property_readonly(
          "tokens",
          [](const PyCache& c) { return c.visit([](const auto& x) { return x.tokens; }); },
          "tokens represented (compressed plus tail)")
      .def_property_readonly(
          "tail_size",
          [](const PyCache& c) { return c.visit([](const auto& x) { return x.tail_size(); }); },
          "rows of the exact appended tail")
      .def_property_readonly("dtype",
                             [](const PyCache& c) { return std::string(dtype_name(c.dtype())); })
      .def_property_readonly(
          "keys",
          [](const PyCache& c) { return c.visit([](const auto& x) { return copy_out(x.keys); }); },
          "(r, d) coreset keys (a copy)")
      .def_property_readonly(
          "values",
          [](const PyCache& c) {
            return c.visit([](const auto& x) { return copy_out(x.values); });
          },
          "(r, dv) compressed values, log-scaled (a copy)")
      .def_property_readonly(
          "weights",
          [](const PyCache& c) {
            return c.visit([](const auto& x) { return copy_out(x.weights); });
          },
          "(r,) compressed softmax weights, log-scaled (a copy)")
      .def_property_readonly(
          "log_scale",
          [](const PyCache& c) {
            return c.visit([](const auto& x) { return copy_out(x.log_scale); });
          },
          "(r,) per-row log-scales (0 for rows kept exactly)")
      .def_property_readonly(
          "pivots",
          [](const PyCache& c) {
            return c.visit([](const auto& x) { return index_array(x.pivots); });
          },
          "sequence position of the token behind each row")
      .def(
          "append",
          [](PyCache& c, const py::object& k, const py::object& v) {
            const std::string fn = "effattn.CompressedKV.append";
            const py::array ka = py::array::ensure(k), va = py::array::ensure(v);
            if (!ka || !va) throw py::value_error(fn + ": k and v must be arrays");
            const View K = view_2d(ka, c.dtype(), "k", fn), V = view_2d(va, c.dtype(), "v", fn);
            if (c.f)
              c.f->append(K.map<float>(), V.map<float>());
            else
              c.d->append(K.map<double>(), V.map<double>());
          },
          py::arg("k"), py::arg("v"),
          "Appends newly decoded tokens (k: (t, d), v: (t, dv)) exactly (weight 1).")
      .def("__repr__", [](const PyCache& c) {
        return "effattn.CompressedKV(size=" +
               std::to_string(c.visit([](const auto& x) { return x.size(); })) +
               ", tokens=" + std::to_string(c.visit([](const auto& x) { return x.tokens; })) +
               ", dtype=" + dtype_name(c.dtype()) + ")";
      });

  m.def("compress_kv", &compress_kv, py::arg("k"), py::arg("v"), py::arg("q_radius") = 0.0,
        R"doc(compress_kv(k, v, q_radius=0.0, **options) -> CompressedKV

WildCat's CompressKV for one head: k (m, d), v (m, dv) -> a coreset cache of `rank` rows
(options as for attention(method="wildcat"): rank, bins, seed, scale, ...). q_radius bounds the
norms of the queries that will attend (0: each bin's key radius). The options are stored with
the cache and used by weighted_attention unless overridden there (scale must match).)doc");
  m.def("kv_press", &kv_press_py, py::arg("k"), py::arg("v"), py::arg("press"),
        py::arg("keep") = 0.0, py::arg("rows") = 0, py::arg("q") = py::none(),
        R"doc(kv_press(k, v, press, keep=0.0, rows=0, q=None, **options) -> CompressedKV

A KV-cache press of one key/value head: k (m, d), v (m, dv) -> a CompressedKV of at most
`rows` rows (or round(keep m), keep in (0, 1]). press: 'drop', 'streaming', 'uniform', 'knorm',
'snapkv', 'observed', 'wildcat' or 'vcc'. q (query_heads w, d): the prompt's last queries, read
by snapkv, observed, vcc and wildcat. Options: sinks, observation, pool, causal, query_heads,
scale, seed, q_radius, block_size (C++ KvPressOptions). Attend with weighted_attention; decode
with CompressedKV.append.)doc");
  m.def("weighted_attention", &weighted_attention, py::arg("q"), py::arg("cache"),
        py::arg("check") = true,
        R"doc(weighted_attention(q, cache, check=True, **options) -> Result

Attention of q (n, d) over a CompressedKV (WildCat's WtdAttn with clipping): output (n, dv),
error_bound, pivots and the other WildCat diagnostics.)doc");
}

}  // namespace python
}  // namespace effattn
