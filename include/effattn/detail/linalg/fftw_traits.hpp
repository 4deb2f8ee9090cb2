/// \file fftw_traits.hpp
/// \brief FFTW internals of `fft::Fftw`: the fftw_/fftwf_ symbol mapping, the process-wide plan
/// cache and the batched engine that executes cached plans. Not part of the public API (namespace
/// effattn::detail); included by numerics/fft.hpp only when `EFFATTN_USE_FFTW` is defined.
///
/// Thread-safety model (FFTW 3.3 manual, "Thread safety"): only `fftw_execute` and the new-array
/// execute functions are thread-safe. Every other FFTW call made here -- planning, destroying a
/// plan, wisdom import/export/forget, for both precisions -- runs under ONE process-wide mutex,
/// `fftw_planner_mutex()`. Execution never takes the lock.
///
/// Lifetime: the cache maps a `FftwPlanKey` to a `shared_ptr` whose deleter destroys the plan
/// under the mutex, so a plan stays valid while any engine still holds it, even after
/// `clear_cache()`. The mutex and the cache are deliberately leaked singletons (never destroyed),
/// so objects with static storage duration that hold plans can be destroyed in any order.
#pragma once

#include <fftw3.h>

#include <atomic>
#include <complex>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>

#include "../../core/errors.hpp"

namespace effattn {
namespace detail {

/// Maps the FFTW API onto `Real` (fftw_* for double, fftwf_* for float).
template <typename Real>
struct fftw_traits;

#define EFFATTN_FFTW_TRAITS(REAL, X)                                                            \
  template <>                                                                                   \
  struct fftw_traits<REAL> {                                                                    \
    using plan = X##plan;                                                                       \
    using complex = X##complex;                                                                 \
    static plan plan_r2c(int n, int howmany, REAL* in, int istride, int idist, complex* out,    \
                         int ostride, int odist, unsigned flags) {                              \
      return X##plan_many_dft_r2c(1, &n, howmany, in, nullptr, istride, idist, out, nullptr,    \
                                  ostride, odist, flags);                                       \
    }                                                                                           \
    static plan plan_c2r(int n, int howmany, complex* in, int istride, int idist, REAL* out,    \
                         int ostride, int odist, unsigned flags) {                              \
      return X##plan_many_dft_c2r(1, &n, howmany, in, nullptr, istride, idist, out, nullptr,    \
                                  ostride, odist, flags);                                       \
    }                                                                                           \
    static void execute_r2c(plan p, REAL* in, complex* out) { X##execute_dft_r2c(p, in, out); } \
    static void execute_c2r(plan p, complex* in, REAL* out) { X##execute_dft_c2r(p, in, out); } \
    static void destroy(plan p) { X##destroy_plan(p); }                                         \
    static int alignment_of(REAL* p) { return X##alignment_of(p); }                             \
    static char* export_wisdom_to_string() { return X##export_wisdom_to_string(); }             \
    static int import_wisdom_from_string(const char* s) {                                       \
      return X##import_wisdom_from_string(s);                                                   \
    }                                                                                           \
    static int export_wisdom_to_filename(const char* f) {                                       \
      return X##export_wisdom_to_filename(f);                                                   \
    }                                                                                           \
    static int import_wisdom_from_filename(const char* f) {                                     \
      return X##import_wisdom_from_filename(f);                                                 \
    }                                                                                           \
    static void forget_wisdom() { X##forget_wisdom(); }                                         \
    static void* alloc(std::size_t bytes) { return X##malloc(bytes); }                          \
    static void release(void* p) { X##free(p); }                                                \
  };

EFFATTN_FFTW_TRAITS(double, fftw_)
EFFATTN_FFTW_TRAITS(float, fftwf_)
#undef EFFATTN_FFTW_TRAITS

/// The single lock around every non-execute FFTW call (both precisions). Leaked on purpose.
inline std::mutex& fftw_planner_mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

/// Identifies one cached plan: 1-D real transform of size `n`, batched `howmany` times with the
/// given strides/distances (in elements of the input and output type), direction, alignment class
/// (`aligned`: both arrays at FFTW's SIMD alignment; otherwise planned with FFTW_UNALIGNED) and
/// planner flags. Precision is the cache's template parameter.
struct FftwPlanKey {
  bool r2c = true;
  Index n = 0, howmany = 1, istride = 1, idist = 0, ostride = 1, odist = 0;
  bool aligned = true;
  unsigned flags = FFTW_ESTIMATE;

  bool operator<(const FftwPlanKey& o) const {
    return std::tie(r2c, n, howmany, istride, idist, ostride, odist, aligned, flags) <
           std::tie(o.r2c, o.n, o.howmany, o.istride, o.idist, o.ostride, o.odist, o.aligned,
                    o.flags);
  }
};

/// Counters of one precision's plan cache (see `fft::Fftw::cache_stats`).
struct FftwCacheCounters {
  std::atomic<Index> created{0};  ///< plans created by the planner
  std::atomic<Index> hits{0};     ///< lookups answered from the cache
  std::atomic<Index> alive{0};    ///< plans not yet destroyed (cached or still held)
};

template <typename Real>
FftwCacheCounters& fftw_counters() {
  static FftwCacheCounters* c = new FftwCacheCounters;
  return *c;
}

/// Owns one FFTW plan; destroyed under the planner mutex.
template <typename Real>
class FftwPlan {
 public:
  using Traits = fftw_traits<Real>;
  explicit FftwPlan(typename Traits::plan p) : m_plan(p) { ++fftw_counters<Real>().alive; }
  ~FftwPlan() {
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    Traits::destroy(m_plan);
    --fftw_counters<Real>().alive;
  }
  FftwPlan(const FftwPlan&) = delete;
  FftwPlan& operator=(const FftwPlan&) = delete;
  typename Traits::plan get() const { return m_plan; }

 private:
  typename Traits::plan m_plan;
};

/// Process-wide plan cache of one precision. Lookups and planning hold the planner mutex; the
/// returned plan is executed without it.
template <typename Real>
class FftwPlanCache {
 public:
  using Plan = FftwPlan<Real>;
  using Traits = fftw_traits<Real>;
  using Complex = std::complex<Real>;

  static FftwPlanCache& instance() {
    static FftwPlanCache* c = new FftwPlanCache;  // leaked: see the file comment
    return *c;
  }

  /// The plan for `key`, created on first use.
  /// \throws effattn::invalid_argument when FFTW returns no plan. FFTW's planners return NULL
  /// only for a request they cannot satisfy: FFTW_WISDOM_ONLY (Rigor::WisdomOnly) without
  /// matching wisdom, or transform parameters FFTW does not support. Both are a precondition of
  /// the caller's options, not numerical trouble, and not a resource failure: FFTW does not
  /// report memory exhaustion through a NULL plan (its allocator aborts), so std::bad_alloc would
  /// be wrong. \throws std::bad_alloc if the planning arrays cannot be allocated.
  std::shared_ptr<const Plan> get(const FftwPlanKey& key) {
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    auto it = m_plans.find(key);
    if (it != m_plans.end()) {
      ++fftw_counters<Real>().hits;
      return it->second;
    }
    const Index n_complex = key.n / 2 + 1;
    const Index real_len = (key.howmany - 1) * (key.r2c ? key.idist : key.odist) +
                           (key.n - 1) * (key.r2c ? key.istride : key.ostride) + 1;
    const Index cplx_len = (key.howmany - 1) * (key.r2c ? key.odist : key.idist) +
                           (n_complex - 1) * (key.r2c ? key.ostride : key.istride) + 1;
    // Planning arrays: FFTW_MEASURE overwrites them, FFTW_ESTIMATE only reads their alignment.
    struct Free {
      void operator()(void* q) const { Traits::release(q); }
    };
    std::unique_ptr<void, Free> re_mem(Traits::alloc(sizeof(Real) * to_size(real_len)));
    std::unique_ptr<void, Free> cx_mem(Traits::alloc(sizeof(Complex) * to_size(cplx_len)));
    if (!re_mem || !cx_mem) throw std::bad_alloc();
    auto* re = static_cast<Real*>(re_mem.get());
    auto* c = static_cast<typename Traits::complex*>(cx_mem.get());
    const unsigned flags = key.flags | (key.aligned ? 0u : unsigned(FFTW_UNALIGNED));
    typename Traits::plan p =
        key.r2c
            ? Traits::plan_r2c(to_int(key.n), to_int(key.howmany), re, to_int(key.istride),
                               to_int(key.idist), c, to_int(key.ostride), to_int(key.odist), flags)
            : Traits::plan_c2r(to_int(key.n), to_int(key.howmany), c, to_int(key.istride),
                               to_int(key.idist), re, to_int(key.ostride), to_int(key.odist),
                               flags);
    if (p == nullptr)
      throw_invalid_argument(
          cat("fft::Fftw: FFTW could not plan a ", key.r2c ? "r2c" : "c2r", " transform of size ",
              key.n, " x ", key.howmany,
              (key.flags & FFTW_WISDOM_ONLY) ? " (Rigor::WisdomOnly and no wisdom for it)" : ""));
    std::shared_ptr<const Plan> plan = std::make_shared<const Plan>(p);
    ++fftw_counters<Real>().created;
    m_plans.emplace(key, plan);
    return plan;
  }

  /// Number of plans in the cache.
  Index size() {
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    return static_cast<Index>(m_plans.size());
  }

  /// Drops every cached plan (plans still held elsewhere live on until released). Returns the
  /// number dropped. The map is moved out first: the deleters take the same mutex.
  Index clear() {
    std::map<FftwPlanKey, std::shared_ptr<const Plan>> old;
    {
      std::lock_guard<std::mutex> lock(fftw_planner_mutex());
      old.swap(m_plans);
    }
    return static_cast<Index>(old.size());
  }

 private:
  FftwPlanCache() = default;
  static std::size_t to_size(Index v) { return static_cast<std::size_t>(v); }
  static int to_int(Index v) {
    EFFATTN_CHECK(v >= 0 && v <= 0x7fffffff, cat("fft: FFTW dimension ", v, " exceeds int"));
    return static_cast<int>(v);
  }
  std::map<FftwPlanKey, std::shared_ptr<const Plan>> m_plans;
};

/// Batched real FFTs of size N via cached FFTW plans. Immutable and shareable across threads;
/// each thread passes its own Scratch (which caches plans for partial batches / other alignment).
template <typename Real>
class FftwEngine {
  using Traits = fftw_traits<Real>;
  using PlanPtr = std::shared_ptr<const FftwPlan<Real>>;

 public:
  using Complex = std::complex<Real>;
  /// Per-thread state: plans for batches other than `batch()` or for unaligned arrays.
  class Scratch {
    friend class FftwEngine;
    std::map<std::pair<Index, int>, PlanPtr> m_plans;
  };

  /// Fetches (plans on first use) the r2c and c2r plans of size `size` batched `batch` times,
  /// with FFTW planner `flags`.
  FftwEngine(Index size, Index batch, unsigned flags)
      : m_size(size), m_batch(batch), m_flags(flags) {
    EFFATTN_CHECK(size >= 1 && batch >= 1,
                  cat("fft::Fftw: size and batch must be >= 1; got ", size, ", ", batch));
    m_r2c = plan(true, batch, true);
    m_c2r = plan(false, batch, true);
  }
  Index size() const { return m_size; }
  Index batch() const { return m_batch; }
  Scratch make_scratch() const { return Scratch(); }

  /// r2c of `howmany` (<= batch) columns: in[t N + i] -> out[t (N/2+1) + f]. in is preserved.
  void forward(Index howmany, const Real* in, Complex* out, Scratch& s) const {
    Real* i = const_cast<Real*>(in);  // out-of-place r2c preserves its input (FFTW default)
    const bool al = Traits::alignment_of(i) == 0 && Traits::alignment_of(real_ptr(out)) == 0;
    const PlanPtr& p = (howmany == m_batch && al) ? m_r2c : lookup(s, true, howmany, al);
    Traits::execute_r2c(p->get(), i, reinterpret_cast<typename Traits::complex*>(out));
  }
  /// Unnormalised c2r of `howmany` columns: in[t (N/2+1) + f] -> out[t N + i]. Destroys in.
  void inverse(Index howmany, Complex* in, Real* out, Scratch& s) const {
    const bool al = Traits::alignment_of(real_ptr(in)) == 0 && Traits::alignment_of(out) == 0;
    const PlanPtr& p = (howmany == m_batch && al) ? m_c2r : lookup(s, false, howmany, al);
    Traits::execute_c2r(p->get(), reinterpret_cast<typename Traits::complex*>(in), out);
  }

 private:
  static Real* real_ptr(Complex* p) { return reinterpret_cast<Real*>(p); }
  PlanPtr plan(bool r2c, Index howmany, bool aligned) const {
    EFFATTN_CHECK(howmany >= 1 && howmany <= m_batch,
                  cat("fft::Fftw: howmany must be in [1, ", m_batch, "]; got ", howmany));
    FftwPlanKey key;
    key.r2c = r2c;
    key.n = m_size;
    key.howmany = howmany;
    key.idist = r2c ? m_size : m_size / 2 + 1;
    key.odist = r2c ? m_size / 2 + 1 : m_size;
    key.aligned = aligned;
    key.flags = m_flags;
    return FftwPlanCache<Real>::instance().get(key);
  }
  const PlanPtr& lookup(Scratch& s, bool r2c, Index howmany, bool aligned) const {
    PlanPtr& p = s.m_plans[{howmany, 2 * int(r2c) + int(aligned)}];
    if (!p) p = plan(r2c, howmany, aligned);
    return p;
  }
  Index m_size, m_batch;
  unsigned m_flags;
  PlanPtr m_r2c, m_c2r;
};

/// Runs `f` under the planner mutex (wisdom calls).
template <typename F>
auto with_fftw_planner_lock(F&& f) -> decltype(f()) {
  std::lock_guard<std::mutex> lock(fftw_planner_mutex());
  return f();
}

}  // namespace detail
}  // namespace effattn
