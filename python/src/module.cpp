// The effattn Python module: argument parsing, layout detection (read in place or convert once),
// dispatch to the method translation units, the Result class and the exception mapping.
#include "common.hpp"

#include <effattn/core/isa.hpp>
#include <effattn/version.hpp>
#include <effattn/workloads.hpp>

#include <sstream>

namespace effattn {
namespace python {

namespace {

std::string shape_str(const py::array& a) {
  std::ostringstream os;
  os << "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

/// obj as a NumPy array, without a copy for arrays and CPU tensors (through __array__).
py::array as_array(const py::object& obj, const char* name, const std::string& fn) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  py::array a = py::array::ensure(obj);
  if (!a)
    throw py::value_error(fn + ": " + name +
                          " must be an array (numpy.ndarray, or a CPU torch.Tensor that does not "
                          "require grad: use .detach()); got " +
                          py::str(py::type::of(obj)).cast<std::string>());
  return a;
}

bool is_dtype(const py::array& a, Dtype d) {
  return d == Dtype::F32 ? a.dtype().is(py::dtype::of<float>())
                         : a.dtype().is(py::dtype::of<double>());
}

bool is_bf16_bits(const py::array& a) {
  return a.dtype().is(py::dtype::of<std::uint16_t>());
}

/// float64 when any input is float64, else float32.
Dtype pick_dtype(std::initializer_list<const py::array*> arrays) {
  for (const py::array* a : arrays)
    if (a->dtype().is(py::dtype::of<double>())) return Dtype::F64;
  return Dtype::F32;
}

py::dtype numpy_dtype(Dtype d) {
  return d == Dtype::F32 ? py::dtype::of<float>() : py::dtype::of<double>();
}

py::module_ numpy() {
  return py::module_::import("numpy");
}

/// Element strides of a, or false when a stride is negative or not a multiple of the item size.
bool element_strides(const py::array& a, std::vector<Index>& s) {
  const Index item = static_cast<Index>(a.itemsize());
  s.resize(static_cast<std::size_t>(a.ndim()));
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    const Index b = static_cast<Index>(a.strides(i));
    if (b < 0 || b % item != 0) return false;
    s[static_cast<std::size_t>(i)] = b / item;
  }
  return true;
}

/// Rows over the dimensions `dims` (outermost first) of a, with `cols` contiguous elements each:
/// true when every row starts at r * outer for one outer >= cols (dimensions of size 1 ignored).
bool uniform_rows(const py::array& a, const std::vector<Index>& s,
                  std::initializer_list<py::ssize_t> dims, Index cols, Index& outer) {
  outer = -1;
  Index inner = 1;
  std::vector<py::ssize_t> ds(dims);
  for (auto it = ds.rbegin(); it != ds.rend(); ++it) {
    const Index n = static_cast<Index>(a.shape(*it));
    const Index st = s[static_cast<std::size_t>(*it)];
    if (n == 1) continue;
    if (outer < 0) {
      if (st % inner != 0) return false;
      outer = st / inner;
    } else if (st != inner * outer) {
      return false;
    }
    inner *= n;
  }
  if (outer < 0) outer = cols;
  return outer >= cols && outer > 0;
}

/// Packed view (rows over `row_dims`, columns the head dim `xdim` (-1: none) times the last dim)
/// of an array in place, when its layout allows it: the last dim contiguous, the head dim of
/// stride D, rows equally spaced.
bool packed_view(const py::array& a, std::initializer_list<py::ssize_t> row_dims, py::ssize_t xdim,
                 View& v) {
  std::vector<Index> s;
  if (!element_strides(a, s)) return false;
  const py::ssize_t nd = a.ndim();
  const Index D = static_cast<Index>(a.shape(nd - 1));
  const Index X = xdim < 0 ? 1 : static_cast<Index>(a.shape(xdim));
  if (D > 1 && s[static_cast<std::size_t>(nd - 1)] != 1) return false;
  if (X > 1 && s[static_cast<std::size_t>(xdim)] != D) return false;
  Index outer = 0;
  if (!uniform_rows(a, s, row_dims, X * D, outer)) return false;
  Index rows = 1;
  for (py::ssize_t d : row_dims) rows *= static_cast<Index>(a.shape(d));
  v.owner = a;
  v.data = a.data();
  v.rows = rows;
  v.cols = X * D;
  v.outer = outer;
  return true;
}

/// Sequence (rows (B, X, L), columns d) view of a 4-D array in place.
bool seq_view(const py::array& a, View& v) {
  std::vector<Index> s;
  if (!element_strides(a, s)) return false;
  const Index D = static_cast<Index>(a.shape(3));
  if (D > 1 && s[3] != 1) return false;
  Index outer = 0;
  if (!uniform_rows(a, s, {0, 1, 2}, D, outer)) return false;
  v.owner = a;
  v.data = a.data();
  v.rows = static_cast<Index>(a.shape(0) * a.shape(1) * a.shape(2));
  v.cols = D;
  v.outer = outer;
  return true;
}

SeqOffsets multiples(Index count, Index len) {
  SeqOffsets cu(static_cast<std::size_t>(count + 1));
  for (Index i = 0; i <= count; ++i) cu[static_cast<std::size_t>(i)] = i * len;
  return cu;
}

SeqOffsets offsets_from(const py::object& obj, const char* name, const std::string& fn) {
  py::array a = as_array(obj, name, fn);
  if (a.ndim() != 1)
    throw py::value_error(fn + ": " + name + " must be a 1-D array of B + 1 offsets; got shape " +
                          shape_str(a));
  if (a.dtype().kind() != 'i' && a.dtype().kind() != 'u')
    throw py::value_error(fn + ": " + name + " must hold integers; got dtype " +
                          py::str(a.dtype()).cast<std::string>());
  auto c = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  SeqOffsets cu(static_cast<std::size_t>(c.size()));
  for (py::ssize_t i = 0; i < c.size(); ++i) cu[static_cast<std::size_t>(i)] = c.at(i);
  return cu;
}

using Runner = PyResult (*)(const Packed&, Kwargs&, bool);

const std::vector<std::pair<std::string, Runner>>& methods() {
  static const std::vector<std::pair<std::string, Runner>> m = {{"exact", run_exact},
                                                                {"conv_basis", run_conv_basis},
                                                                {"vcc", run_vcc},
                                                                {"eva", run_eva},
                                                                {"performer", run_performer},
                                                                {"wildcat", run_wildcat},
                                                                {"kep_svgp", run_kep_svgp},
                                                                {"auto", run_auto}};
  return m;
}

Runner find_method(const std::string& name, const std::string& fn) {
  std::string valid;
  for (const auto& m : methods()) {
    if (m.first == name) return m.second;
    valid += (valid.empty() ? "'" : ", '") + m.first + "'";
  }
  throw py::value_error(fn + ": unknown method '" + name + "' (methods: " + valid + ")");
}

// ---------------------------------------------------------------------------------------------

PyResult attention(const py::object& q, const py::object& k, const py::object& v,
                   const std::string& method, bool causal, bool check, const py::kwargs& kwargs) {
  const std::string fn = "effattn.attention";
  const py::array qa = as_array(q, "q", fn), ka = as_array(k, "k", fn), va = as_array(v, "v", fn);
  Kwargs kw(kwargs, method, fn);
  const int bf16 = int(is_bf16_bits(qa)) + int(is_bf16_bits(ka)) + int(is_bf16_bits(va));
  if (bf16 != 0) {
    if (bf16 != 3)
      throw py::value_error(fn +
                            ": uint16 arrays hold bf16 bit patterns; q, k and v must then all "
                            "be uint16");
    if (method != "exact")
      throw py::value_error(fn + ": bf16 (uint16) input needs method='exact' (policy tiled_bf16)");
    PyResult r = run_exact_bf16(qa, ka, va, kw, causal);
    check_info(r, check, fn);
    return r;
  }
  const Runner run = find_method(method, fn);
  Packed p;
  p.dtype = pick_dtype({&qa, &ka, &va});
  p.q = view_2d(qa, p.dtype, "q", fn);
  p.k = view_2d(ka, p.dtype, "k", fn);
  p.v = view_2d(va, p.dtype, "v", fn);
  p.out = OutKind::Matrix;
  PyResult r = run(p, kw, causal);
  check_info(r, check, fn);
  return r;
}

/// Brings a 4-D (B, X, L, D) array into the target layout: in place when possible, else one copy.
View view_4d(const py::array& a, Dtype d, bool packed, const char* name) {
  View v;
  if (is_dtype(a, d) && (packed ? packed_view(a, {0, 2}, 1, v) : seq_view(a, v))) return v;
  // packed: a contiguous (B, L, X, D) copy, seen as (B, X, L, D) again
  py::array c =
      packed ? numpy()
                   .attr("ascontiguousarray")(a.attr("transpose")(0, 2, 1, 3), numpy_dtype(d))
                   .attr("transpose")(0, 2, 1, 3)
             : numpy().attr("ascontiguousarray")(a, numpy_dtype(d));
  const bool ok = packed ? packed_view(c, {0, 2}, 1, v) : seq_view(c, v);
  if (!ok) throw std::logic_error(std::string("effattn: could not view ") + name);
  v.copied = true;
  return v;
}

/// The packed problem of an sdpa call (layouts: see the comment below); `causal` may be dropped
/// (exact, one query per sequence). `grad_output` (sdpa_backward) is brought into the output's
/// layout, into `dO`.
Packed pack_sdpa(const py::array& qa, const py::array& ka, const py::array& va, bool& causal,
                 const std::string& method, const py::object& cu_seqlens_q,
                 const py::object& cu_seqlens_k, const std::string& fn,
                 const py::array* grad_output = nullptr, View* dO = nullptr) {
  for (const py::array* a : {&qa, &ka, &va})
    if (is_bf16_bits(*a))
      throw py::value_error(fn +
                            ": bf16 (uint16) input is accepted by effattn.attention only; "
                            "pass float32 with policy='tiled_bf16'");
  Packed p;
  p.dtype = pick_dtype({&qa, &ka, &va});
  p.per_head = method != "exact";
  const bool varlen = !cu_seqlens_q.is_none() || !cu_seqlens_k.is_none();
  if (varlen) {
    if (cu_seqlens_q.is_none()) throw py::value_error(fn + ": cu_seqlens_k needs cu_seqlens_q");
    if (qa.ndim() != 3 || ka.ndim() != 3 || va.ndim() != 3)
      throw py::value_error(fn +
                            ": with cu_seqlens_q, q, k and v must be packed (T, H, d), "
                            "(T_k, G, d), (T_k, G, dv) arrays; got shapes " +
                            shape_str(qa) + ", " + shape_str(ka) + ", " + shape_str(va));
    const Index H = static_cast<Index>(qa.shape(1)), G = static_cast<Index>(ka.shape(1));
    if (va.shape(1) != ka.shape(1) || va.shape(0) != ka.shape(0))
      throw py::value_error(fn + ": v must have k's tokens and heads; got k " + shape_str(ka) +
                            ", v " + shape_str(va));
    if (ka.shape(2) != qa.shape(2))
      throw py::value_error(fn + ": k must have q's head dimension d; got q " + shape_str(qa) +
                            ", k " + shape_str(ka));
    p.layout = {H, G};
    auto view3 = [&](const py::array& a, const char* name) {
      View vw;
      if (is_dtype(a, p.dtype) && packed_view(a, {0}, 1, vw)) return vw;
      py::array c = numpy().attr("ascontiguousarray")(a, numpy_dtype(p.dtype));
      if (!packed_view(c, {0}, 1, vw)) throw std::logic_error(std::string("view ") + name);
      vw.copied = true;
      return vw;
    };
    p.q = view3(qa, "q");
    p.k = view3(ka, "k");
    p.v = view3(va, "v");
    if (grad_output) {
      if (grad_output->ndim() != 3 || grad_output->shape(0) != qa.shape(0) ||
          grad_output->shape(1) != qa.shape(1) || grad_output->shape(2) != va.shape(2))
        throw py::value_error(fn + ": grad_output must have the output's shape (T, H, dv); got " +
                              shape_str(*grad_output));
      *dO = view3(*grad_output, "grad_output");
    }
    p.cu_q = offsets_from(cu_seqlens_q, "cu_seqlens_q", fn);
    if (!cu_seqlens_k.is_none()) p.cu_k = offsets_from(cu_seqlens_k, "cu_seqlens_k", fn);
    if (p.cu_q.empty() || p.cu_q.back() != p.q.rows || p.cu_q.front() != 0)
      throw py::value_error(fn + ": cu_seqlens_q must hold B + 1 offsets from 0 to q.shape[0] = " +
                            std::to_string(p.q.rows));
    p.out = OutKind::Varlen;
    p.H = H;
    p.B = static_cast<Index>(p.cu_q.size()) - 1;
  } else {
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4)
      throw py::value_error(fn +
                            ": q, k and v must be (B, H, L, d), (B, G, S, d), (B, G, S, dv) "
                            "arrays (or packed (T, H, d) with cu_seqlens_q); got shapes " +
                            shape_str(qa) + ", " + shape_str(ka) + ", " + shape_str(va));
    const Index B = static_cast<Index>(qa.shape(0)), H = static_cast<Index>(qa.shape(1)),
                L = static_cast<Index>(qa.shape(2));
    const Index G = static_cast<Index>(ka.shape(1)), S = static_cast<Index>(ka.shape(2));
    if (ka.shape(0) != B || va.shape(0) != B)
      throw py::value_error(fn + ": q, k and v must have the same batch size; got shapes " +
                            shape_str(qa) + ", " + shape_str(ka) + ", " + shape_str(va));
    if (va.shape(1) != G || va.shape(2) != S)
      throw py::value_error(fn + ": v must have k's heads and length; got k " + shape_str(ka) +
                            ", v " + shape_str(va));
    if (ka.shape(3) != qa.shape(3))
      throw py::value_error(fn + ": k must have q's head dimension d; got q " + shape_str(qa) +
                            ", k " + shape_str(ka));
    if (G < 1 || H % G != 0)
      throw py::value_error(fn + ": q's heads (" + std::to_string(H) +
                            ") must be a multiple of k's heads (" + std::to_string(G) + ")");
    p.B = B;
    p.H = H;
    p.L = L;
    // The layout MultiHead reads (docs/python.md, "Layouts and copies"):
    //  - sequences: each (b, h) an L x d row-major block (C-contiguous (B, H, L, d)): one
    //    sequence per (b, h), one head. GQA: the r = H / G query heads of a group are stacked
    //    as rows of one sequence (exact attention without a mask: rows are independent);
    //  - packed: (B, L, H, d) memory seen as (B, H, L, d) (q.transpose(1, 2) of a contiguous
    //    (B, L, H, d) tensor): B sequences of L rows of H d columns, MultiHead's own layout.
    View tmp;
    const bool q_seq = is_dtype(qa, p.dtype) && seq_view(qa, tmp);
    const bool q_packed = is_dtype(qa, p.dtype) && packed_view(qa, {0, 2}, 1, tmp);
    // One query per sequence (decoding): the bottom-right aligned mask shows it every key, so
    // exact attention drops the mask and reads a (B, G, S, d) cache in place even with GQA.
    if (method == "exact" && L == 1) causal = false;
    const bool rows_independent = method == "exact" && !causal;
    bool packed = false;
    if (G == H)
      packed = q_packed && !q_seq;
    else
      packed = !(rows_independent && q_seq);
    p.q = view_4d(qa, p.dtype, packed, "q");
    p.k = view_4d(ka, p.dtype, packed, "k");
    p.v = view_4d(va, p.dtype, packed, "v");
    p.G = G;
    p.S = S;
    if (grad_output) {
      if (grad_output->ndim() != 4 || grad_output->shape(0) != B || grad_output->shape(1) != H ||
          grad_output->shape(2) != L || grad_output->shape(3) != va.shape(3))
        throw py::value_error(fn +
                              ": grad_output must have the output's shape (B, H, L, dv); got " +
                              shape_str(*grad_output));
      *dO = view_4d(*grad_output, p.dtype, packed, "grad_output");
    }
    if (packed) {
      p.layout = {H, G};
      if (B > 1) {
        p.cu_q = multiples(B, L);
        p.cu_k = multiples(B, S);
      }
      p.out = OutKind::Packed;
    } else {
      p.layout = {1, 1};
      const Index r = H / G;
      p.stacked = r > 1;
      p.cu_q = multiples(B * G, r * L);
      p.cu_k = multiples(B * G, S);
      p.out = OutKind::Contiguous;
    }
  }
  return p;
}

/// The gradients of any method with a backward: its forward with the state kept, then the
/// state's backward (eva, performer; ValueError naming the others).
py::tuple backward_through_state(Packed p, Runner run, Kwargs& kw, bool causal, const View& dO,
                                 const std::string& fn) {
  std::shared_ptr<GradState> state;
  p.keep = &state;
  p.per_head = false;
  const PyResult r = run(p, kw, causal);
  check_info(r, true, fn);
  if (!state || !state->has_backward())
    throw py::value_error(fn + ": method '" + kw.method() +
                          "' has no backward (gradients exist for exact, conv_basis, eva and "
                          "performer)");
  return state->backward(dO);
}

PyResult sdpa(const py::object& q, const py::object& k, const py::object& v, bool is_causal,
              const std::string& method, const py::object& cu_seqlens_q,
              const py::object& cu_seqlens_k, bool check, bool keep_state,
              const py::kwargs& kwargs) {
  const std::string fn = "effattn.sdpa";
  const py::array qa = as_array(q, "q", fn), ka = as_array(k, "k", fn), va = as_array(v, "v", fn);
  Kwargs kw(kwargs, method, fn);
  const Runner run = find_method(method, fn);
  bool causal = is_causal;
  Packed p = pack_sdpa(qa, ka, va, causal, method, cu_seqlens_q, cu_seqlens_k, fn);
  std::shared_ptr<GradState> state;
  if (keep_state) {
    p.keep = &state;
    p.per_head = false;  // the per-head Results stay in the state, untouched
  }
  PyResult r = run(p, kw, causal);
  check_info(r, check, fn);
  if (keep_state) r.extras["state"] = state ? py::cast(state) : py::none();
  return r;
}

/// grad_output (the output's shape) in the packed layout of the state's forward.
View grad_view(const GradState& st, const py::object& grad_output) {
  const std::string fn = "effattn.GradState.backward";
  const Packed& p = st.p;
  const py::array g = as_array(grad_output, "grad_output", fn);
  const Index dv = p.layout.kv_heads > 0 ? p.v.cols / p.layout.kv_heads : p.v.cols;
  std::vector<Index> want;
  if (p.out == OutKind::Varlen)
    want = {p.q.rows, p.H, dv};
  else
    want = {p.B, p.H, p.L, dv};
  bool ok = g.ndim() == static_cast<py::ssize_t>(want.size());
  for (std::size_t i = 0; ok && i < want.size(); ++i)
    ok = g.shape(static_cast<py::ssize_t>(i)) == want[i];
  if (!ok) {
    std::string w;
    for (Index x : want) w += (w.empty() ? "" : ", ") + std::to_string(x);
    throw py::value_error(fn + ": grad_output must have the output's shape (" + w + "); got " +
                          shape_str(g));
  }
  if (p.out == OutKind::Varlen) {
    View vw;
    if (is_dtype(g, p.dtype) && packed_view(g, {0}, 1, vw)) return vw;
    py::array c = numpy().attr("ascontiguousarray")(g, numpy_dtype(p.dtype));
    if (!packed_view(c, {0}, 1, vw)) throw std::logic_error("effattn: could not view grad_output");
    vw.copied = true;
    return vw;
  }
  return view_4d(g, p.dtype, p.out == OutKind::Packed, "grad_output");
}

py::tuple sdpa_backward(const py::object& q, const py::object& k, const py::object& v,
                        const py::object& grad_output, bool is_causal, const std::string& method,
                        const py::object& cu_seqlens_q, const py::object& cu_seqlens_k,
                        const py::kwargs& kwargs) {
  const std::string fn = "effattn.sdpa_backward";
  const py::array qa = as_array(q, "q", fn), ka = as_array(k, "k", fn), va = as_array(v, "v", fn),
                  ga = as_array(grad_output, "grad_output", fn);
  Kwargs kw(kwargs, method, fn);
  const Runner run = find_method(method, fn);
  bool causal = is_causal;
  View dO;
  const Packed p = pack_sdpa(qa, ka, va, causal, method, cu_seqlens_q, cu_seqlens_k, fn, &ga, &dO);
  if (method == "exact") return sdpa_backward_exact(p, kw, causal, dO);
  if (method == "conv_basis") return sdpa_backward_conv_basis(p, kw, causal, dO);
  return backward_through_state(p, run, kw, causal, dO, fn);
}

py::tuple attention_backward(const py::object& q, const py::object& k, const py::object& v,
                             const py::object& grad_output, const std::string& method, bool causal,
                             const py::object& result, const py::kwargs& kwargs) {
  const std::string fn = "effattn.attention_backward";
  const py::array qa = as_array(q, "q", fn), ka = as_array(k, "k", fn), va = as_array(v, "v", fn),
                  ga = as_array(grad_output, "grad_output", fn);
  Kwargs kw(kwargs, method, fn);
  Packed p;
  p.dtype = pick_dtype({&qa, &ka, &va});
  p.q = view_2d(qa, p.dtype, "q", fn);
  p.k = view_2d(ka, p.dtype, "k", fn);
  p.v = view_2d(va, p.dtype, "v", fn);
  const View dO = view_2d(ga, p.dtype, "grad_output", fn);
  if (method == "exact") return backward_exact(p, kw, causal, result, dO);
  if (method == "conv_basis") return backward_conv_basis(p, kw, causal, result, dO);
  if (!result.is_none())
    throw py::value_error(fn + ": result= is read by methods 'exact' and 'conv_basis' only; '" +
                          method + "' runs its forward again (pass result=None)");
  p.out = OutKind::Matrix;
  return backward_through_state(p, find_method(method, fn), kw, causal, dO, fn);
}

py::tuple workload(const std::string& kind, Index n, Index d, std::uint64_t seed,
                   const std::string& dtype) {
  auto make = [&](auto tag) {
    using S = typename decltype(tag)::type;
    workloads::Workload<S> w;
    try {
      w = workloads::make<S>(kind, n, d, seed);
    } catch (const std::exception& e) {
      throw py::value_error(std::string("effattn.workload: ") + e.what());
    }
    RowMatrix<S> Q = w.Q, K = w.K, V = w.V;
    return py::make_tuple(own_matrix(std::move(Q)), own_matrix(std::move(K)),
                          own_matrix(std::move(V)));
  };
  if (dtype == "float32") return make(TypeTag<float>{});
  if (dtype == "float64") return make(TypeTag<double>{});
  throw py::value_error("effattn.workload: dtype must be 'float32' or 'float64'; got '" + dtype +
                        "'");
}

std::string result_repr(const PyResult& r) {
  std::ostringstream os;
  os << "effattn.Result(method='" << r.method << "', info='" << r.info << "'";
  if (py::hasattr(r.output, "shape"))
    os << ", output shape " << py::str(r.output.attr("shape")).cast<std::string>();
  for (auto d : r.diagnostics)
    os << ", " << py::str(d.first).cast<std::string>() << "="
       << py::str(d.second).cast<std::string>();
  os << ")";
  return os.str();
}

}  // namespace

View view_2d(const py::array& a, Dtype d, const char* name, const std::string& fn) {
  if (a.ndim() != 2)
    throw py::value_error(fn + ": " + name + " must be a 2-D (tokens, features) array; got shape " +
                          shape_str(a));
  View v;
  if (is_dtype(a, d) && packed_view(a, {0}, -1, v)) return v;
  py::array c = numpy().attr("ascontiguousarray")(a, numpy_dtype(d));
  if (!packed_view(c, {0}, -1, v)) throw std::logic_error(std::string("effattn: view ") + name);
  v.copied = true;
  return v;
}

}  // namespace python
}  // namespace effattn

namespace ep = effattn::python;

PYBIND11_MODULE(_effattn, m) {
  namespace py = pybind11;
  using namespace effattn::python;
  m.doc() =
      "effattn: fast exact and approximate softmax attention on the CPU (C++17 / Eigen).\n\n"
      "attention(q, k, v, method, causal, **options)  one head, (L, d) arrays\n"
      "sdpa(q, k, v, is_causal, method, **options)   (B, H, L, d) arrays, GQA, varlen\n"
      "attention_backward(...), sdpa_backward(...)   gradients (exact, conv_basis, eva, "
      "performer)\n"
      "compress_kv(k, v, ...), weighted_attention(q, cache, ...)   WildCat KV caches\n\n"
      "Methods: exact (policy tiled | naive | tiled_bf16), conv_basis, vcc, eva, performer,\n"
      "wildcat, kep_svgp, auto (the fastest that meets target_error). Options are the C++\n"
      "Options fields, as keyword arguments.\n"
      "C-contiguous float32 / float64 inputs are read in place; other dtypes and layouts are\n"
      "converted once. Bad input raises ValueError, numerical failure FloatingPointError.\n"
      "Threads: OpenMP (OMP_NUM_THREADS). The GIL is released while a kernel runs.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const effattn::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const effattn::numerical_error& e) {
      PyErr_SetString(PyExc_FloatingPointError, e.what());
    } catch (const ep::floating_point_error& e) {
      PyErr_SetString(PyExc_FloatingPointError, e.what());
    }
  });

  py::class_<ep::PyResult>(
      m, "Result",
      "The result of attention / sdpa / weighted_attention.\n\n"
      "output       the attention output (NumPy array; no copy was made)\n"
      "info         'Success', 'NumericalIssue', 'NoConvergence' or "
      "'NotComputed'\n"
      "method       the method name\n"
      "diagnostics  dict of the method's scalar diagnostics "
      "(Result::diagnostics() in C++)\n"
      "seconds      wall time of the C++ computation (GIL released)\n"
      "heads        sdpa, non-exact methods: per-(b, h) Results (output None), "
      "index b * H + h\n"
      "Method arrays and diagnostics are attributes too: lse (exact), "
      "offsets (conv_basis),\nsegments / vip (vcc), pivots / error_bound / "
      "row_error_bound (wildcat), variance /\nprior_variance / "
      "singular_values (kep_svgp), chosen / reason (auto), copies, data_ptrs, dtype.")
      .def_readonly("output", &ep::PyResult::output)
      .def_readonly("info", &ep::PyResult::info)
      .def_readonly("method", &ep::PyResult::method)
      .def_readonly("diagnostics", &ep::PyResult::diagnostics)
      .def_readonly("seconds", &ep::PyResult::seconds)
      .def_readonly("heads", &ep::PyResult::heads)
      .def_readonly("extras", &ep::PyResult::extras)
      .def(
          "__getattr__",
          [](const ep::PyResult& r, const std::string& name) -> py::object {
            if (r.extras.contains(name)) return r.extras[name.c_str()];
            if (r.diagnostics.contains(name)) return r.diagnostics[name.c_str()];
            throw py::attribute_error("effattn.Result of method '" + r.method +
                                      "' has no attribute '" + name + "'");
          },
          py::arg("name"))
      .def("__dir__",
           [](const ep::PyResult& r) {
             py::list l;
             for (const char* s :
                  {"output", "info", "method", "diagnostics", "seconds", "heads", "extras"})
               l.append(s);
             for (auto x : r.extras) l.append(x.first);
             for (auto x : r.diagnostics) l.append(x.first);
             return l;
           })
      .def("__repr__", &result_repr);

  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("method") = "exact", py::arg("causal") = false, py::arg("check") = true,
        R"doc(attention(q, k, v, method="exact", causal=False, check=True, **options) -> Result

One attention head: softmax(scale q k^T [+ causal mask]) v, exact or approximated.

q: (n, d), k: (m, d), v: (m, dv) arrays (NumPy, or CPU torch tensors through __array__).
float32 arrays compute in float32, float64 (any input) in float64, other dtypes are converted
to float32. C-contiguous inputs (any row stride, unit column stride) are read in place; the
output is a new C-contiguous (n, dv) array. uint16 arrays are bf16 bit patterns (method
'exact', policy 'tiled_bf16'; float32 output).

method:  'exact'       options: scale, block_q, block_k, policy ('tiled' | 'naive' | 'tiled_bf16'),
                       bf16_scores ('auto' | 'single' | 'split': tiled_bf16's score product)
         'conv_basis'  causal by construction (pass causal=True); num_bases, probe, threshold,
                       epsilon, sliding_window, mask_block, guard, guard_tolerance,
                       conv_method
         'vcc'         budget, block_size, fine_blocks, clamp_budget, lookahead, vip (row list)
         'eva'         window, chunk_size, samples, seed, mass, proposal, partition
         'performer'   features, seed
         'wildcat'     rank, bins, seed, clip, rel_tol, q_radius, temperature, fallback,
                       denominator_tol, proposal_block, target_error, error_sample_rows,
                       fit_temperature, bf16_attention
         'kep_svgp'    rank, oversample, power_iters, rank_rtol, cov, prior, rbranch,
                       block_rows, seed
         'auto'        target_error, error_sample_rows, max_overhead, safety, eva_min_target,
                       wildcat_min_rank_error, seed, allow_wildcat, allow_eva (AutoAttention: the fastest of exact,
                       wildcat and eva meeting target_error on sampled exact rows; the
                       Result's chosen, reason and diagnostics say which and why)
         every method: scale (0 = 1/sqrt(d)).
causal:  bottom-right aligned mask (query i sees keys j <= i + m - n); methods without a
         causal form raise ValueError when it is set.
check:   raise FloatingPointError when info != 'Success' (False: return the Result).

Returns a Result (output, info, diagnostics, method arrays such as lse, pivots, variance).
Raises ValueError on bad input (shapes, NaN / Inf, unknown method or option, bad option value).)doc");

  py::class_<GradState, std::shared_ptr<GradState>>(
      m, "GradState",
      "The forward state sdpa(..., keep_state=True) keeps for one backward: the inputs (read in "
      "place, not copied),\nthe functor and its per-head results (exact: lse; eva, performer: "
      "the random draws; conv_basis:\nthe basis offsets). The Result's output is a view of the "
      "state's output. Used by effattn.torch.")
      .def_readonly("method", &GradState::method)
      .def_property_readonly("has_backward", &GradState::has_backward)
      .def(
          "backward",
          [](const GradState& st, const py::object& grad_output) {
            return st.backward(grad_view(st, grad_output));
          },
          py::arg("grad_output"),
          "backward(grad_output) -> (dq, dk, dv): the gradients of the kept forward given "
          "dL/d output (the output's shape),\nin q's, k's and v's shapes (GQA: key / value "
          "gradients summed over a group's query heads).\nRaises ValueError for a method "
          "without a backward, naming it.");

  m.def(
      "sdpa", &sdpa, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("is_causal") = false,
      py::arg("method") = "exact", py::arg("cu_seqlens_q") = py::none(),
      py::arg("cu_seqlens_k") = py::none(), py::arg("check") = true, py::arg("keep_state") = false,
      R"doc(sdpa(q, k, v, is_causal=False, method="exact", cu_seqlens_q=None, cu_seqlens_k=None, check=True, keep_state=False, **options) -> Result

Scaled dot-product attention in PyTorch's layout, every head of a batch in one call.

Padded batch: q (B, H, L, d), k (B, G, S, d), v (B, G, S, dv); G may divide H (GQA / MQA:
query head h reads key/value head h // (H // G)). Output (B, H, L, dv).
Variable length (flash-attention's varlen layout): q (T, H, d), k (T_k, G, d), v (T_k, G, dv)
with cu_seqlens_q / cu_seqlens_k the B + 1 cumulative offsets (int arrays or lists; k's
default: q's); output (T, H, dv).

Read in place (no copy) when the dtype is float32 / float64 and:
 - (B, H, L, d) is C-contiguous per (b, h) block (the usual layout), with G == H, or with GQA
   for method 'exact' without a mask; or
 - (B, H, L, d) is a transposed view of a contiguous (B, L, H, d) buffer (x.transpose(1, 2),
   any GQA, any method); the output then has the same (B, L, H, dv) memory order;
 - varlen: (T, H, d) with contiguous heads.
Otherwise the input is converted once (result.copies says which). causal is bottom-right
aligned per sequence (as flash-attention; the same as torch's is_causal when L == S).
Results: output, info, diagnostics (batch, heads, kv_heads, tasks), lse (exact: (B, H, L), or
(H, T) varlen) and heads (per-(b, h) Results of the other methods, index b * H + h).
keep_state=True: the Result's `state` (a GradState) keeps what the backward needs;
state.backward(grad_output) returns (dq, dk, dv) without running the forward again (heads is
then empty). effattn.torch is built on it.)doc");

  m.def(
      "sdpa_backward", &sdpa_backward, py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("grad_output"), py::arg("is_causal") = false, py::arg("method") = "exact",
      py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(),
      R"doc(sdpa_backward(q, k, v, grad_output, is_causal=False, method="exact", cu_seqlens_q=None, cu_seqlens_k=None, **options) -> (dq, dk, dv)

Gradients of a loss through sdpa(q, k, v, is_causal, method, ...) given grad_output (the
output's shape): (dL/dq, dL/dk, dL/dv) with q's, k's and v's shapes (GQA: the key / value
gradients summed over the query heads of a group). Runs the forward and MultiHead's backward in
one call; methods 'exact' (policies tiled, naive), 'conv_basis', 'eva' and 'performer' (the
others raise ValueError). Layouts as in sdpa.)doc");

  m.def(
      "attention_backward", &attention_backward, py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("grad_output"), py::arg("method") = "exact", py::arg("causal") = false,
      py::arg("result") = py::none(),
      R"doc(attention_backward(q, k, v, grad_output, method="exact", causal=False, result=None, **options) -> (dq, dk, dv)

Gradients of a loss L through attention(q, k, v, method, causal, **options) given
grad_output = dL/d output (n, dv): returns (dL/dq, dL/dk, dL/dv) as arrays of q's, k's, v's
shapes. method 'exact' (any policy but tiled_bf16; flash-attention-2 style backward for tiled),
'conv_basis' (gradient with the basis starts frozen at result.offsets; exact at
num_bases = n), 'eva' or 'performer' (the gradient of the forward's random draw). result: the
Result of that forward call (exact, conv_basis: its lse / offsets are reused); None runs the
forward first. One head; inputs are copied to column-major once.)doc");

  m.def("workload", &workload, py::arg("kind"), py::arg("n"), py::arg("d"), py::arg("seed") = 42,
        py::arg("dtype") = "float32",
        R"doc(workload(kind, n, d, seed=42, dtype="float32") -> (q, k, v)

effattn's synthetic workloads (effattn/workloads.hpp): kind 'gaussian', 'sphere', 'clustered',
'positional' or 'needles'; (n, d) arrays, deterministic in (kind, n, d, seed).)doc");

  m.def(
      "active_isa", [] { return std::string(effattn::active_isa()); },
      "The bf16 kernel path of this machine: 'amx', 'avx512bf16' or 'generic' (EFFATTN_ISA "
      "forces a lower one).");

  ep::bind_wildcat_cache(m);
  ep::bind_kep_svgp_layer(m);

  py::list names;
  for (const auto& x : methods()) names.append(x.first);
  m.attr("methods") = py::tuple(names);
  m.attr("__version__") = std::to_string(EFFATTN_VERSION_MAJOR) + "." +
                          std::to_string(EFFATTN_VERSION_MINOR) + "." +
                          std::to_string(EFFATTN_VERSION_PATCH);
}
