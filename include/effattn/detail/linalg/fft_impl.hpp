/// \file fft_impl.hpp
/// \brief Definitions of `<effattn/numerics/fft.hpp>`: smooth sizes, the aligned scratch buffer,
/// the backends' out-of-class members, `conv_matrix` and the heavy members of `fft::CausalConv`
/// (out of class and not inline, so that `extern template` in compiled mode suppresses them).
#pragma once

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unsupported/Eigen/FFT>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../numerics/fft.hpp"

#ifdef EFFATTN_USE_FFTW
#include "fftw_traits.hpp"
#endif

namespace effattn {
namespace fft {

namespace detail {

/// Smallest m >= n whose prime factors are all in {2, 3, 5} (max_prime = 5) or {2, 3, 5, 7}.
inline Index smooth_size(Index n, Index max_prime) {
  EFFATTN_CHECK(n >= 1 && n <= (Index(1) << 60),
                cat("fft::good_size: n must be in [1, 2^60]; got ", n));
  Index best = 1;
  while (best < n) best *= 2;  // the power of two is a candidate
  for (Index p7 = 1; p7 < best; p7 *= (max_prime >= 7 ? 7 : best))
    for (Index p5 = p7; p5 < best; p5 *= 5)
      for (Index p3 = p5; p3 < best; p3 *= 3) {
        Index m = p3;
        while (m < n) m *= 2;
        best = std::min(best, m);
      }
  return best;
}

/// N log2 N (for cost models), with log2 clamped at 1.
inline double n_log2_n(Index N) {
  const double x = static_cast<double>(N);
  return x * std::max(1.0, std::log2(x));
}

/// 64-byte aligned, uninitialised array of trivially copyable T (64 >= FFTW's SIMD alignment).
template <typename T>
class AlignedBuffer {
 public:
  static constexpr std::size_t kAlign = 64;
  explicit AlignedBuffer(Index count = 0)
      : m_data(count > 0
                   ? static_cast<T*>(::operator new(static_cast<std::size_t>(count) * sizeof(T),
                                                    std::align_val_t(kAlign)))
                   : nullptr) {}
  T* data() const { return m_data.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(kAlign)); }
  };
  std::unique_ptr<T, Free> m_data;
};

#ifdef EFFATTN_USE_FFTW
/// FFTW planner flags of a Rigor.
inline unsigned fftw_flags(Rigor r) {
  switch (r) {
    case Rigor::Measure:
      return FFTW_MEASURE;
    case Rigor::Patient:
      return FFTW_PATIENT;
    case Rigor::WisdomOnly:
      return FFTW_MEASURE | FFTW_WISDOM_ONLY;
    case Rigor::Estimate:
      break;
  }
  return FFTW_ESTIMATE;
}
#endif

/// Validates n and the terms (shared by CausalConv and conv_matrix).
template <typename Scalar>
void check_conv_terms(Index n, const std::vector<ConvTerm<Scalar>>& terms, const char* who) {
  EFFATTN_CHECK(n >= 1, cat(who, ": n must be >= 1; got ", n));
  EFFATTN_CHECK(!terms.empty(), cat(who, ": terms must not be empty"));
  for (std::size_t j = 0; j < terms.size(); ++j) {
    const ConvTerm<Scalar>& t = terms[j];
    EFFATTN_CHECK(t.offset >= 0 && t.offset < n,
                  cat(who, ": terms[", j, "].offset must be in [0, n = ", n, "); got ", t.offset));
    EFFATTN_CHECK(t.end == -1 || (t.end > t.offset && t.end <= n),
                  cat(who, ": terms[", j, "].end must be -1 (= n) or in (offset = ", t.offset,
                      ", n = ", n, "]; got ", t.end));
    EFFATTN_CHECK(t.kernel.size() >= 1 && t.kernel.size() <= n - t.offset,
                  cat(who, ": terms[", j, "].kernel must have 1 to n - offset = ", n - t.offset,
                      " entries; got ", t.kernel.size()));
    check_finite(t.kernel, cat("terms[", j, "].kernel").c_str());
  }
}

inline Index term_end(Index end, Index n) {
  return end == -1 ? n : end;
}

}  // namespace detail

inline Index good_size(Index n) {
  return detail::smooth_size(n, 7);
}

// ---------------------------------------------------------------------------------------------
// Backends.

#ifdef EFFATTN_USE_FFTW
template <typename Real>
Fftw::Engine<Real>::Engine(Index size, Index batch, Rigor rigor)
    : ::effattn::detail::FftwEngine<Real>(size, batch, detail::fftw_flags(rigor)) {}
#endif

inline Index Fftw::fft_size(Index m) {
  return good_size(m);
}

inline double Fftw::transform_cost(Index N) {
  return 5.0 * detail::n_log2_n(N);
}

template <typename Real>
void Fftw::check_available() {
  static_assert(std::is_same<Real, float>::value || std::is_same<Real, double>::value,
                "effattn: fft::Fftw supports Real = float or double");
  (void)sizeof(Engine<Real>);  // fires the readable static_assert without EFFATTN_USE_FFTW
}

template <typename Real>
PlanCacheStats Fftw::cache_stats() {
  check_available<Real>();
  PlanCacheStats s;
#ifdef EFFATTN_USE_FFTW
  const auto& c = detail::fftw_counters<Real>();
  s.cached = detail::FftwPlanCache<Real>::instance().size();
  s.created = c.created;
  s.hits = c.hits;
  s.alive = c.alive;
#endif
  return s;
}

template <typename Real>
Index Fftw::clear_cache() {
  check_available<Real>();
#ifdef EFFATTN_USE_FFTW
  return detail::FftwPlanCache<Real>::instance().clear();
#else
  return 0;
#endif
}

template <typename Real>
std::string Fftw::export_wisdom() {
  check_available<Real>();
  std::string out;
#ifdef EFFATTN_USE_FFTW
  detail::with_fftw_planner_lock([&] {
    char* s = detail::fftw_traits<Real>::export_wisdom_to_string();
    if (s != nullptr) out = s;
    std::free(s);  // FFTW 3.3: the caller frees it with free()
  });
#endif
  return out;
}

template <typename Real>
bool Fftw::import_wisdom(const std::string& wisdom) {
  check_available<Real>();
#ifdef EFFATTN_USE_FFTW
  return detail::with_fftw_planner_lock(
      [&] { return detail::fftw_traits<Real>::import_wisdom_from_string(wisdom.c_str()) != 0; });
#else
  (void)wisdom;
  return false;
#endif
}

template <typename Real>
bool Fftw::export_wisdom_to_file(const std::string& path) {
  check_available<Real>();
#ifdef EFFATTN_USE_FFTW
  return detail::with_fftw_planner_lock(
      [&] { return detail::fftw_traits<Real>::export_wisdom_to_filename(path.c_str()) != 0; });
#else
  (void)path;
  return false;
#endif
}

template <typename Real>
bool Fftw::import_wisdom_from_file(const std::string& path) {
  check_available<Real>();
#ifdef EFFATTN_USE_FFTW
  return detail::with_fftw_planner_lock(
      [&] { return detail::fftw_traits<Real>::import_wisdom_from_filename(path.c_str()) != 0; });
#else
  (void)path;
  return false;
#endif
}

template <typename Real>
void Fftw::forget_wisdom() {
  check_available<Real>();
#ifdef EFFATTN_USE_FFTW
  detail::with_fftw_planner_lock([] { detail::fftw_traits<Real>::forget_wisdom(); });
#endif
}

template <typename Real>
EigenFft::Engine<Real>::Engine(Index size, Index batch, Rigor /*ignored*/)
    : m_size(size), m_batch(batch) {
  EFFATTN_CHECK(size >= 2 && size <= 0x7fffffff && batch >= 1,
                detail::cat("fft::EigenFft: size must be in [2, 2^31) and batch >= 1; got ", size,
                            ", ", batch));
  auto fft = std::make_shared<Fft>();
  fft->SetFlag(Fft::HalfSpectrum);
  fft->SetFlag(Fft::Unscaled);
  std::vector<Real> x(static_cast<std::size_t>(size), Real(0));
  std::vector<Complex> X(static_cast<std::size_t>(size / 2 + 1));
  fft->fwd(X.data(), x.data(), size);  // builds the twiddles of both directions once
  fft->inv(x.data(), X.data(), size);
  m_proto = std::move(fft);
}

inline Index EigenFft::fft_size(Index m) {
  return 4 * detail::smooth_size((m + 3) / 4, 5);
}

inline double EigenFft::transform_cost(Index N) {
  return 28.0 * detail::n_log2_n(N);
}

// ---------------------------------------------------------------------------------------------
// Batched causal convolution.

template <typename Real, typename Scalar>
Matrix<Real> conv_matrix(Index n, const std::vector<ConvTerm<Scalar>>& terms) {
  detail::check_conv_terms(n, terms, "conv_matrix");
  const std::size_t k = terms.size();
  std::vector<std::vector<std::size_t>> starts(static_cast<std::size_t>(n)),
      stops(static_cast<std::size_t>(n));
  for (std::size_t j = 0; j < k; ++j) {
    starts[static_cast<std::size_t>(terms[j].offset)].push_back(j);
    const Index e = detail::term_end(terms[j].end, n);
    if (e < n) stops[static_cast<std::size_t>(e)].push_back(j);
  }
  auto add = [&](Vector<Real>& acc, std::size_t j) {
    acc.head(terms[j].kernel.size()) += terms[j].kernel.template cast<Real>();
  };
  Matrix<Real> H = Matrix<Real>::Zero(n, n);
  Vector<Real> acc = Vector<Real>::Zero(n);
  std::vector<char> active(k, 0);
  for (Index col = 0; col < n; ++col) {
    const auto c = static_cast<std::size_t>(col);
    if (!stops[c].empty()) {
      for (std::size_t j : stops[c]) active[j] = 0;
      acc.setZero();
      for (std::size_t j = 0; j < k; ++j)
        if (active[j]) add(acc, j);
    }
    for (std::size_t j : starts[c]) {
      active[j] = 1;
      add(acc, j);
    }
    H.col(col).tail(n - col) = acc.head(n - col);
  }
  return H;
}

/// Per-thread buffers of `apply_fft`.
template <typename Scalar, typename Backend, typename Real>
struct CausalConv<Scalar, Backend, Real>::Workspace {
  Workspace(const Engine& engine, Index B, Index N, bool accumulate)
      : in(B * N),
        spec(B * (N / 2 + 1)),
        acc(accumulate ? B * (N / 2 + 1) : 0),
        scratch(engine.make_scratch()) {}
  detail::AlignedBuffer<Real> in;       // B x N zero-padded inputs, then the c2r outputs
  detail::AlignedBuffer<Complex> spec;  // B x (N/2+1) input spectra
  detail::AlignedBuffer<Complex> acc;   // B x (N/2+1) accumulated products (G > 1)
  typename Engine::Scratch scratch;
};

template <typename Scalar, typename Backend, typename Real>
CausalConv<Scalar, Backend, Real>::CausalConv(Index n, const std::vector<Term>& terms,
                                              const ConvOptions& opts)
    : m_n(n) {
  detail::check_conv_terms(n, terms, "CausalConv");
  EFFATTN_CHECK(opts.batch >= 0,
                detail::cat("CausalConv: ConvOptions::batch must be >= 0; got ", opts.batch));
  std::vector<Index> group_of(terms.size());
  std::map<std::pair<Index, Index>, Index> group_index;  // input range [s, e) -> group
  Index need = n;
  for (std::size_t j = 0; j < terms.size(); ++j) {
    const Index s = terms[j].offset, e = detail::term_end(terms[j].end, n);
    need = std::max(need, e + terms[j].kernel.size() - 1);
    const auto ins = group_index.emplace(std::make_pair(s, e), groups());
    if (ins.second) m_groups.emplace_back(s, e);
    group_of[j] = ins.first->second;
  }
  const Index G = groups(), N = Backend::fft_size(need);
  m_use_fft = opts.method == ConvMethod::Fft ||
              (opts.method == ConvMethod::Auto && !prefer_direct<Backend>(n, N, G));
  if (!m_use_fft) {
    m_dense = conv_matrix<Real>(n, terms);
    return;
  }
  m_fft_size = N;
  const Index H = N / 2 + 1;
  const Index auto_batch = (Index(1) << 16) / (N * Index(sizeof(Real)));
  m_batch = opts.batch > 0 ? opts.batch : std::max<Index>(1, std::min<Index>(16, auto_batch));
  m_engine = std::make_shared<const Engine>(N, m_batch, opts.rigor);
  m_spectra.setZero(H, G);
  auto scratch = m_engine->make_scratch();
  detail::AlignedBuffer<Real> in(m_batch * N);
  detail::AlignedBuffer<Complex> out(m_batch * H);
  const Index k = static_cast<Index>(terms.size());
  for (Index j0 = 0; j0 < k; j0 += m_batch) {
    const Index h = std::min(m_batch, k - j0);
    for (Index t = 0; t < h; ++t) {
      const auto& b = terms[static_cast<std::size_t>(j0 + t)].kernel;
      Real* col = in.data() + t * N;
      std::fill(col, col + N, Real(0));
      Eigen::Map<Vector<Real>>(col, b.size()) = b.template cast<Real>();
    }
    m_engine->forward(h, in.data(), out.data(), scratch);
    for (Index t = 0; t < h; ++t)
      m_spectra.col(group_of[static_cast<std::size_t>(j0 + t)]) +=
          Eigen::Map<const CVector>(out.data() + t * H, H) * (Real(1) / static_cast<Real>(N));
  }
}

template <typename Scalar, typename Backend, typename Real>
void CausalConv<Scalar, Backend, Real>::apply(const ConstRef<Scalar>& X,
                                              Eigen::Ref<Matrix<Scalar>> Y) const {
  EFFATTN_CHECK(X.rows() == m_n && X.cols() >= 1,
                detail::cat("CausalConv: X must be n x c with n = ", m_n, ", c >= 1; got X ",
                            detail::shape(X)));
  EFFATTN_CHECK(
      Y.rows() == m_n && Y.cols() == X.cols(),
      detail::cat("CausalConv: Y must be ", m_n, " x ", X.cols(), "; got Y ", detail::shape(Y)));
  detail::check_finite(X, "X");
  if (m_use_fft)
    apply_fft(X, Y);
  else
    apply_direct(X, Y);
}

template <typename Scalar, typename Backend, typename Real>
void CausalConv<Scalar, Backend, Real>::apply_direct(const ConstRef<Scalar>& X,
                                                     Eigen::Ref<Matrix<Scalar>> Y) const {
  if constexpr (std::is_same<Real, Scalar>::value) {
    Y.noalias() = m_dense.template triangularView<Eigen::Lower>() * X;
  } else {
    const Matrix<Real> Xr = X.template cast<Real>();
    Y = (m_dense.template triangularView<Eigen::Lower>() * Xr).template cast<Scalar>();
  }
}

template <typename Scalar, typename Backend, typename Real>
void CausalConv<Scalar, Backend, Real>::apply_fft(const ConstRef<Scalar>& X,
                                                  Eigen::Ref<Matrix<Scalar>> Y) const {
  const Index c = X.cols(), B = m_batch, N = m_fft_size, H = N / 2 + 1, G = groups();
  auto make_workspace = [&] { return Workspace(*m_engine, B, N, G > 1); };
  auto body = [&](Index chunk, Workspace& ws) {
    const Index c0 = chunk * B, h = std::min(B, c - c0);
    Complex* const prod = G == 1 ? ws.spec.data() : ws.acc.data();
    for (Index g = 0; g < G; ++g) {
      const Index s = m_groups[static_cast<std::size_t>(g)].first;
      const Index e = m_groups[static_cast<std::size_t>(g)].second;
      for (Index t = 0; t < h; ++t) {
        Real* col = ws.in.data() + t * N;
        std::fill(col, col + s, Real(0));
        Eigen::Map<Vector<Real>>(col + s, e - s) =
            X.col(c0 + t).segment(s, e - s).template cast<Real>();
        std::fill(col + e, col + N, Real(0));
      }
      m_engine->forward(h, ws.in.data(), ws.spec.data(), ws.scratch);
      const auto K = m_spectra.col(g).array();
      for (Index t = 0; t < h; ++t) {
        Eigen::Map<CArray> S(ws.spec.data() + t * H, H), P(prod + t * H, H);
        if (G == 1 || g == 0)
          P = K * S;
        else
          P += K * S;
      }
    }
    m_engine->inverse(h, prod, ws.in.data(), ws.scratch);  // c2r destroys prod
    for (Index t = 0; t < h; ++t)
      Y.col(c0 + t) =
          Eigen::Map<const Vector<Real>>(ws.in.data() + t * N, m_n).template cast<Scalar>();
  };
  const Index chunks = (c + B - 1) / B;
  if (chunks == 1) {  // no parallel region for one batch (the body has no Eigen GEMM inside)
    Workspace ws = make_workspace();
    body(0, ws);
  } else {
    ::effattn::detail::parallel_for(chunks, make_workspace, body);
  }
}

}  // namespace fft
}  // namespace effattn
