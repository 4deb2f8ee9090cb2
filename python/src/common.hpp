// Shared machinery of the effattn Python module: the packed problem every call is reduced to,
// NumPy <-> Eigen without copies, keyword options, the Result object and the generic MultiHead
// runner. Included by every binding translation unit.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <effattn/effattn.hpp>
#include <effattn/multi_head.hpp>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace effattn {
namespace python {

namespace py = pybind11;

template <typename S>
using RowMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename S>
using RowMap = Eigen::Map<const RowMatrix<S>, 0, Eigen::OuterStride<>>;

/// A numerical failure (Result::info != Success): FloatingPointError in Python.
struct floating_point_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The scalar type a call computes in.
enum class Dtype { F32, F64 };

/// One input matrix as MultiHead reads it: row-major, inner stride 1, `outer` elements between
/// rows, the data owned by `owner` (the caller's array, or the one copy made of it).
struct View {
  py::array owner;
  const void* data = nullptr;
  Index rows = 0, cols = 0, outer = 0;
  bool copied = false;  ///< the binding made a copy (dtype or layout conversion)

  template <typename S>
  RowMap<S> map() const {
    return RowMap<S>(static_cast<const S*>(data), rows, cols,
                     Eigen::OuterStride<>(outer > 0 ? outer : cols));
  }
};

/// How the T_q x (heads dv) row-major output of MultiHead is shown to Python.
enum class OutKind {
  Matrix,      ///< (n, dv): one head
  Contiguous,  ///< (B, H, L, dv) C-contiguous: one sequence per (b, h) (or per GQA group)
  Packed,      ///< (B, H, L, dv) view of the (B, L, H, dv) buffer
  Varlen       ///< (T, H, dv)
};

struct GradState;

/// A call reduced to one MultiHead::compute: Q, K, V views, the head layout, the offsets and
/// how to present the output and the per-head results.
struct Packed {
  Dtype dtype = Dtype::F32;
  View q, k, v;
  HeadLayout layout{1, 1};
  SeqOffsets cu_q, cu_k;
  OutKind out = OutKind::Matrix;
  Index B = 1, H = 1, L = 0;  ///< user-level batch, query heads, query length (not varlen)
  Index G = 1, S = 0;         ///< user-level key/value heads and key length (not varlen)
  SeqOffsets user_cu_q;       ///< varlen: the user's offsets (for lse as (H, T))
  bool per_head = false;      ///< sdpa: return per-(b, h) Results (non-exact methods)
  bool stacked = false;       ///< GQA heads stacked as rows (exact, non-causal)
  /// sdpa(keep_state=True): where run_packed leaves the forward state for a later backward
  /// (nullptr: nothing is kept).
  std::shared_ptr<GradState>* keep = nullptr;
};

/// The state of one sdpa forward kept for its backward (effattn.torch): the packed inputs (their
/// owners keep the caller's arrays alive), the functor and its MultiHead result. The output array
/// Python sees is a view of the result's output, which the backward reads as well.
struct GradState {
  GradState(Packed p_, std::string method_) : p(std::move(p_)), method(std::move(method_)) {
    p.keep = nullptr;
  }
  virtual ~GradState() = default;
  GradState(const GradState&) = delete;
  GradState& operator=(const GradState&) = delete;
  /// Whether the method has a backward (the others raise ValueError in `backward`).
  virtual bool has_backward() const = 0;
  /// (dq, dk, dv) in the inputs' shapes, from dO in the output's packed layout.
  virtual py::tuple backward(const View& dO) const = 0;

  Packed p;
  std::string method;
};

/// The Python `effattn.Result`.
struct PyResult {
  py::object output = py::none();
  std::string info = "NotComputed";
  std::string method;
  double seconds = 0;  ///< wall time of the C++ computation (GIL released)
  py::dict diagnostics;
  py::dict extras;
  py::list heads;
};

/// Options passed as keyword arguments, read field by field; unknown names are an error.
class Kwargs {
 public:
  Kwargs(const py::kwargs& kw, std::string method, std::string function)
      : m_method(std::move(method)), m_function(std::move(function)) {
    for (auto item : kw) m_left[item.first] = item.second;
  }

  const std::string& method() const { return m_method; }
  const std::string& function() const { return m_function; }

  bool has(const char* name) const { return m_left.contains(name); }

  /// Reads option `name` into `out` when it was passed.
  template <typename T>
  void get(const char* name, T& out) {
    m_known.emplace_back(name);
    if (!m_left.contains(name)) return;
    py::object value = m_left[name];
    PyDict_DelItemString(m_left.ptr(), name);
    try {
      if constexpr (std::is_same_v<T, bool>) {  // no silent int / None -> bool
        const bool numpy_bool = py::hasattr(value, "dtype") &&
                                value.attr("dtype").attr("kind").cast<std::string>() == "b";
        if (!py::isinstance<py::bool_>(value) && !numpy_bool) throw py::cast_error();
      }
      out = value.cast<T>();
    } catch (const py::cast_error&) {
      throw py::value_error(m_function + ": option " + name + " of method '" + m_method +
                            "' has the wrong type (" +
                            py::str(py::type::of(value)).cast<std::string>() + ")");
    }
  }

  /// Reads option `name` into `out`, also under its deprecated spelling `old_name` (a renamed
  /// Options field): the old keyword works with a DeprecationWarning, and passing both with
  /// different values raises ValueError. The old spelling is not listed among the options.
  template <typename T>
  void get_renamed(const char* name, const char* old_name, T& out) {
    if (!m_left.contains(old_name)) {
      get(name, out);
      return;
    }
    const bool both = m_left.contains(name);
    T old_value = out;
    get(old_name, old_value);
    m_known.pop_back();
    get(name, out);
    const std::string msg = m_function + ": option " + old_name + " of method '" + m_method +
                            "' is deprecated; use " + name;
    if (PyErr_WarnEx(PyExc_DeprecationWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
    if (both && !(old_value == out))
      throw py::value_error(m_function + ": options " + name + " and its deprecated spelling " +
                            old_name + " of method '" + m_method +
                            "' were both passed with different values; pass only " + name);
    out = old_value;
  }

  /// Reads an enum option given as a string.
  template <typename E>
  void get_enum(const char* name, E& out,
                std::initializer_list<std::pair<const char*, E>> choices) {
    std::string s;
    get(name, s);
    if (s.empty()) return;
    std::string valid;
    for (const auto& c : choices) {
      if (s == c.first) {
        out = c.second;
        return;
      }
      valid += std::string(valid.empty() ? "" : ", ") + "'" + c.first + "'";
    }
    throw py::value_error(m_function + ": option " + name + " of method '" + m_method +
                          "' must be one of " + valid + "; got '" + s + "'");
  }

  /// Throws ValueError naming the first option no reader consumed.
  void finish() const {
    if (py::len(m_left) == 0) return;
    std::string valid;
    for (const auto& k : m_known) valid += (valid.empty() ? "" : ", ") + k;
    const std::string name = py::str(m_left.begin()->first).cast<std::string>();
    throw py::value_error(m_function + ": unknown option '" + name + "' for method '" + m_method +
                          "' (its options: " + valid + ")");
  }

 private:
  py::dict m_left;
  std::vector<std::string> m_known;
  std::string m_method, m_function;
};

/// Checks that a method without a causal form was not asked for one, and that a causal-only one
/// was (effattn never ignores a mask it cannot honour).
template <typename F>
void check_causal(const Kwargs& kw, bool causal) {
  if (functor_traits<F>::causal_only && !causal)
    throw py::value_error(
        kw.function() + ": method '" + kw.method() +
        "' is causal by construction; pass causal=True (is_causal=True for sdpa)");
  if (!functor_traits<F>::supports_causal && !functor_traits<F>::causal_only && causal)
    throw py::value_error(kw.function() + ": method '" + kw.method() +
                          "' has no causal form (it cannot honour a causal mask)");
}

// ---------------------------------------------------------------------------------------------
// Eigen -> NumPy without copies: the array owns the (moved) Eigen object through a capsule.

template <typename M>
py::array own_matrix(M&& m) {
  using Mat = std::decay_t<M>;
  using S = typename Mat::Scalar;
  auto* p = new Mat(std::forward<M>(m));
  py::capsule owner(p, [](void* x) { delete static_cast<Mat*>(x); });
  const auto sz = static_cast<py::ssize_t>(sizeof(S));
  if constexpr (Mat::ColsAtCompileTime == 1) {
    return py::array_t<S>({static_cast<py::ssize_t>(p->size())}, {sz}, p->data(), owner);
  } else if constexpr (Mat::IsRowMajor) {
    return py::array_t<S>(
        {static_cast<py::ssize_t>(p->rows()), static_cast<py::ssize_t>(p->cols())},
        {sz * p->cols(), sz}, p->data(), owner);
  } else {
    return py::array_t<S>(
        {static_cast<py::ssize_t>(p->rows()), static_cast<py::ssize_t>(p->cols())},
        {sz, sz * p->rows()}, p->data(), owner);
  }
}

/// An array of the given shape and byte strides over the data of `m`, which it owns.
template <typename S>
py::array own_view(RowMatrix<S>&& m, std::vector<py::ssize_t> shape,
                   std::vector<py::ssize_t> strides) {
  auto* p = new RowMatrix<S>(std::move(m));
  py::capsule owner(p, [](void* x) { delete static_cast<RowMatrix<S>*>(x); });
  for (auto& s : strides) s *= static_cast<py::ssize_t>(sizeof(S));
  return py::array_t<S>(shape, strides, p->data(), owner);
}

inline py::array index_array(const std::vector<Index>& v) {
  py::array_t<std::int64_t> a(static_cast<py::ssize_t>(v.size()));
  auto m = a.mutable_unchecked<1>();
  for (std::size_t i = 0; i < v.size(); ++i) m(static_cast<py::ssize_t>(i)) = v[i];
  return a;
}

// ---------------------------------------------------------------------------------------------
// Per-method extras of a single-head Result (arrays and lists beyond the scalar diagnostics).

template <typename R>
void fill_extras(R&, py::dict&) {}  // methods with scalar diagnostics only

template <typename S>
void fill_extras(ExactResult<S>& r, py::dict& e) {
  e["lse"] = own_matrix(std::move(r.lse));
}

template <typename S>
void fill_extras(ConvBasisResult<S>& r, py::dict& e) {
  e["offsets"] = index_array(r.offsets);
}

template <typename S>
void fill_extras(VccResult<S>& r, py::dict& e) {
  py::array_t<std::int64_t> seg({static_cast<py::ssize_t>(r.segments.size()), py::ssize_t{2}});
  auto m = seg.mutable_unchecked<2>();
  for (std::size_t j = 0; j < r.segments.size(); ++j) {
    m(static_cast<py::ssize_t>(j), 0) = r.segments[j].begin;
    m(static_cast<py::ssize_t>(j), 1) = r.segments[j].count;
  }
  e["segments"] = seg;
  e["vip"] = index_array(r.vip);
}

template <typename S>
void fill_extras(WildcatResult<S>& r, py::dict& e) {
  e["pivots"] = index_array(r.pivots);
  e["row_error_bound"] = own_matrix(std::move(r.row_error_bound));
}

template <typename S>
void fill_extras(KepSvgpResult<S>& r, py::dict& e) {
  e["variance"] = own_matrix(std::move(r.variance));
  e["prior_variance"] = own_matrix(std::move(r.prior_variance));
  e["singular_values"] = own_matrix(std::move(r.ksvd.lambda));
}

template <typename S>
void fill_extras(AutoResult<S>& r, py::dict& e) {
  e["chosen"] = std::string(to_string(r.method));
  e["reason"] = r.reason;
  if (r.lse.size() > 0) e["lse"] = own_matrix(std::move(r.lse));
}

template <typename R>
void fill_diagnostics(const R& r, PyResult& out) {
  for (const Diagnostic& d : r.diagnostics()) out.diagnostics[d.name] = d.value;
}

inline const char* dtype_name(Dtype d) {
  return d == Dtype::F32 ? "float32" : "float64";
}

/// Raises FloatingPointError for a failed computation when `check` is set.
inline void check_info(const PyResult& r, bool check, const std::string& function) {
  if (check && r.info != "Success")
    throw floating_point_error(function + ": method '" + r.method + "' failed numerically (info " +
                               r.info + "); pass check=False to get the Result anyway");
}

// ---------------------------------------------------------------------------------------------
// The generic runner: MultiHead<F> on the packed views, GIL released, output without copies.

/// Converts the head results of a MultiHead call for Python (see Packed and OutKind).
template <typename F, typename MR>
void convert_heads(MR& r, const Packed& p, PyResult& out) {
  using S = typename F::Scalar;
  using HR = typename F::Result;
  if constexpr (std::is_same_v<HR, ExactResult<S>>) {
    // lse: (n,) for one head, (B, H, L) for sdpa (the head results in index order are exactly
    // that, stacked GQA groups included), (H, T) for varlen (flash-attention's layout).
    Index total = 0;
    for (const auto& h : r.head_results) total += h.lse.size();
    Vector<S> lse(total);
    if (p.out == OutKind::Varlen) {
      const Index T = p.cu_q.back(), H = p.H;
      for (Index b = 0; b + 1 < static_cast<Index>(p.cu_q.size()); ++b)
        for (Index h = 0; h < H; ++h) {
          const auto& hr = r.head_results[static_cast<std::size_t>(b * H + h)];
          lse.segment(h * T + p.cu_q[static_cast<std::size_t>(b)], hr.lse.size()) = hr.lse;
        }
    } else {
      Index at = 0;
      for (const auto& h : r.head_results) {
        lse.segment(at, h.lse.size()) = h.lse;
        at += h.lse.size();
      }
    }
    py::array a = own_matrix(std::move(lse));
    if (p.out == OutKind::Varlen)
      a = a.attr("reshape")(p.H, p.cu_q.back());
    else if (p.out != OutKind::Matrix)
      a = a.attr("reshape")(p.B, p.H, p.L);
    out.extras["lse"] = a;
    if (!r.head_results.empty()) fill_diagnostics(r.head_results.front(), out);
  } else if (p.out == OutKind::Matrix) {
    fill_diagnostics(r.head_results.front(), out);
    fill_extras(r.head_results.front(), out.extras);
  } else if (p.per_head) {
    for (auto& hr : r.head_results) {
      PyResult h;
      h.method = out.method;
      h.info = to_string(hr.info);
      fill_diagnostics(hr, h);
      fill_extras(hr, h.extras);
      out.heads.append(py::cast(std::move(h)));
    }
  }
}

template <typename F>
py::tuple packed_gradients(const Packed& p,
                           MultiHeadGradients<typename F::Scalar, Eigen::RowMajor>&& g);

/// GradState of functor F: MultiHead<F> and its result.
template <typename F>
struct GradStateOf final : GradState {
  using S = typename F::Scalar;
  GradStateOf(const Packed& p_, const typename F::Options& o, const std::string& method_)
      : GradState(p_, method_), mh(o, p_.layout) {}

  bool has_backward() const override { return detail::has_backward<F>::value; }

  py::tuple backward(const View& dO) const override {
    if constexpr (detail::has_backward<F>::value) {
      const RowMap<S> Q = p.q.map<S>(), K = p.k.map<S>(), V = p.v.map<S>(), G = dO.map<S>();
      MultiHeadGradients<S, Eigen::RowMajor> g;
      {
        py::gil_scoped_release release;
        g = mh.backward(Q, K, V, r, G, p.cu_q, p.cu_k);
      }
      return packed_gradients<F>(p, std::move(g));
    } else {
      (void)dO;
      throw py::value_error("effattn: method '" + method +
                            "' has no backward (gradients exist for exact, conv_basis, eva and "
                            "performer)");
    }
  }

  const MultiHead<F> mh;
  MultiHeadResult<F, Eigen::RowMajor> r;
};

/// Runs MultiHead<F>(o, p.layout) on p; fills the output, info, diagnostics and extras. With
/// p.keep, the functor and its result stay alive in a GradState stored there, and the output
/// array is a view of the result's output (no copy).
template <typename F>
PyResult run_packed(const Packed& p, const typename F::Options& o, const std::string& method) {
  using S = typename F::Scalar;
  std::shared_ptr<GradStateOf<F>> st;
  std::unique_ptr<MultiHead<F>> own;
  if (p.keep)
    st = std::make_shared<GradStateOf<F>>(p, o, method);
  else
    own = std::make_unique<MultiHead<F>>(o, p.layout);
  const MultiHead<F>& mh = st ? st->mh : *own;
  const RowMap<S> Q = p.q.map<S>(), K = p.k.map<S>(), V = p.v.map<S>();
  MultiHeadResult<F, Eigen::RowMajor> local;
  MultiHeadResult<F, Eigen::RowMajor>& r = st ? st->r : local;
  double seconds = 0;
  {
    py::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    r = mh.compute(Q, K, V, p.cu_q, p.cu_k);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  PyResult out;
  out.method = method;
  out.info = to_string(r.info);
  out.seconds = seconds;
  const Index dv = p.layout.kv_heads > 0 ? p.v.cols / p.layout.kv_heads : p.v.cols;
  convert_heads<F>(r, p, out);
  if (p.out != OutKind::Matrix)
    for (const Diagnostic& d : r.diagnostics()) out.diagnostics[d.name] = d.value;
  const Index rows = r.output.rows();
  std::vector<py::ssize_t> shape, strides;
  switch (p.out) {
    case OutKind::Matrix:
      shape = {rows, dv}, strides = {dv, 1};
      break;
    case OutKind::Contiguous:
      shape = {p.B, p.H, p.L, dv}, strides = {p.H * p.L * dv, p.L * dv, dv, 1};
      break;
    case OutKind::Packed:
      shape = {p.B, p.H, p.L, dv}, strides = {p.L * p.H * dv, dv, p.H * dv, 1};
      break;
    case OutKind::Varlen:
      shape = {rows, p.H, dv}, strides = {p.H * dv, dv, 1};
      break;
  }
  if (st) {  // a view of the kept result's output, owning a reference to the state
    for (auto& x : strides) x *= static_cast<py::ssize_t>(sizeof(S));
    auto* holder = new std::shared_ptr<GradState>(st);
    py::capsule owner(holder, [](void* x) { delete static_cast<std::shared_ptr<GradState>*>(x); });
    out.output = py::array_t<S>(shape, strides, r.output.data(), owner);
    *p.keep = st;
  } else {
    out.output = own_view<S>(std::move(r.output), shape, strides);
  }
  py::dict copies;
  copies["q"] = p.q.copied;
  copies["k"] = p.k.copied;
  copies["v"] = p.v.copied;
  out.extras["copies"] = copies;
  out.extras["data_ptrs"] = py::make_tuple(reinterpret_cast<std::uintptr_t>(p.q.data),
                                           reinterpret_cast<std::uintptr_t>(p.k.data),
                                           reinterpret_cast<std::uintptr_t>(p.v.data));
  out.extras["dtype"] = dtype_name(p.dtype);
  return out;
}

/// Calls `fn(TypeTag<float>{})` or `fn(TypeTag<double>{})` for the dtype.
template <typename Fn>
auto by_dtype(Dtype d, Fn&& fn) {
  if (d == Dtype::F32) return fn(TypeTag<float>{});
  return fn(TypeTag<double>{});
}

// ---------------------------------------------------------------------------------------------
// Entry points of the binding translation units (module.cpp dispatches on the method name).

PyResult run_exact(const Packed& p, Kwargs& kw, bool causal);
PyResult run_conv_basis(const Packed& p, Kwargs& kw, bool causal);
PyResult run_vcc(const Packed& p, Kwargs& kw, bool causal);
PyResult run_eva(const Packed& p, Kwargs& kw, bool causal);
PyResult run_performer(const Packed& p, Kwargs& kw, bool causal);
PyResult run_wildcat(const Packed& p, Kwargs& kw, bool causal);
PyResult run_auto(const Packed& p, Kwargs& kw, bool causal);
PyResult run_kep_svgp(const Packed& p, Kwargs& kw, bool causal);

/// bf16 exact attention on uint16 arrays holding bf16 bit patterns (one head).
PyResult run_exact_bf16(const py::array& q, const py::array& k, const py::array& v, Kwargs& kw,
                        bool causal);

/// Gradients of exact / Conv-Basis attention (one head); `result` (a Result of the same forward
/// call: output and lse / offsets are read from it) may be None.
py::tuple backward_exact(const Packed& p, Kwargs& kw, bool causal, const py::object& result,
                         const View& dO);
py::tuple backward_conv_basis(const Packed& p, Kwargs& kw, bool causal, const py::object& result,
                              const View& dO);

/// Gradients of sdpa (MultiHead<F>::compute then backward), in the inputs' shapes.
py::tuple sdpa_backward_exact(const Packed& p, Kwargs& kw, bool causal, const View& dO);
py::tuple sdpa_backward_conv_basis(const Packed& p, Kwargs& kw, bool causal, const View& dO);

/// A packed gradient (rows x (heads width), row-major) shown in the layout of the input it
/// belongs to: X heads and `len` rows per sequence (see OutKind).
template <typename S>
py::array shape_gradient(RowMatrix<S>&& g, const Packed& p, Index X, Index len) {
  const Index rows = g.rows(), cols = g.cols(), w = X > 0 ? cols / X : 0;
  switch (p.out) {
    case OutKind::Contiguous:  // one sequence per (b, x) block (heads = 1 in MultiHead)
      return own_view<S>(std::move(g), {p.B, X, len, cols}, {X * len * cols, len * cols, cols, 1});
    case OutKind::Packed:
      return own_view<S>(std::move(g), {p.B, X, len, w}, {len * X * w, w, X * w, 1});
    case OutKind::Varlen:
      return own_view<S>(std::move(g), {rows, X, w}, {X * w, w, 1});
    case OutKind::Matrix:
      break;
  }
  return own_view<S>(std::move(g), {rows, cols}, {cols, 1});
}

/// The gradients of MultiHead<F>::backward in the shapes of the inputs they belong to.
template <typename F>
py::tuple packed_gradients(const Packed& p,
                           MultiHeadGradients<typename F::Scalar, Eigen::RowMajor>&& g) {
  using S = typename F::Scalar;
  const bool varlen = p.out == OutKind::Varlen;
  const Index Hq = varlen ? p.layout.heads : p.H, Hk = varlen ? p.layout.kv_heads : p.G;
  return py::make_tuple(shape_gradient<S>(std::move(g.dQ), p, Hq, p.L),
                        shape_gradient<S>(std::move(g.dK), p, Hk, p.S),
                        shape_gradient<S>(std::move(g.dV), p, Hk, p.S));
}

/// MultiHead<F>(o, p.layout): forward, then backward with dO; the gradients in the inputs' shapes.
template <typename F>
py::tuple run_packed_backward(const Packed& p, const typename F::Options& o, const View& dO,
                              const std::string& fn) {
  using S = typename F::Scalar;
  const MultiHead<F> mh(o, p.layout);
  const RowMap<S> Q = p.q.map<S>(), K = p.k.map<S>(), V = p.v.map<S>(), G = dO.map<S>();
  MultiHeadGradients<S, Eigen::RowMajor> g;
  Info info = Info::Success;
  {
    py::gil_scoped_release release;
    const auto r = mh.compute(Q, K, V, p.cu_q, p.cu_k);
    info = r.info;
    if (info == Info::Success) g = mh.backward(Q, K, V, r, G, p.cu_q, p.cu_k);
  }
  if (info != Info::Success)
    throw floating_point_error(fn + ": the forward pass failed numerically (info " +
                               to_string(info) + ")");
  return packed_gradients<F>(p, std::move(g));
}

/// Registers CompressedKV, compress_kv and weighted_attention.
void bind_wildcat_cache(py::module_& m);
/// Registers kep_svgp_layer, kep_svgp_kl and kep_svgp_ksvd_loss.
void bind_kep_svgp_layer(py::module_& m);

/// Converts a 2-D array to a row-major view of dtype d (in place when it already is one).
View view_2d(const py::array& a, Dtype d, const char* name, const std::string& function);

/// A float array attribute of a Result as an Eigen matrix / vector of scalar S (a copy).
template <typename S>
Matrix<S> result_matrix(const py::object& a, const char* name, const std::string& fn) {
  View v =
      view_2d(py::array::ensure(a), std::is_same_v<S, float> ? Dtype::F32 : Dtype::F64, name, fn);
  return v.map<S>();
}

/// The gradients (column-major Eigen matrices) as a tuple of arrays (no copy).
template <typename G>
py::tuple gradients_tuple(G&& g) {
  return py::make_tuple(own_matrix(std::move(g.dQ)), own_matrix(std::move(g.dK)),
                        own_matrix(std::move(g.dV)));
}

/// Checks that `result` is a successful Result of `method`; returns it.
inline const PyResult& forward_result(const py::object& result, const std::string& method,
                                      const std::string& fn) {
  if (!py::isinstance<PyResult>(result))
    throw py::value_error(fn + ": result must be an effattn.Result (or None)");
  const PyResult& r = result.cast<const PyResult&>();
  if (r.method != method)
    throw py::value_error(fn + ": result comes from method '" + r.method + "', not '" + method +
                          "'");
  if (r.info != "Success")
    throw py::value_error(fn + ": result must be a successful forward result; got info '" + r.info +
                          "'");
  return r;
}

}  // namespace python
}  // namespace effattn
