/// \file malloc_count.hpp
/// \brief Heap accounting for tests and benchmarks: replaces glibc's malloc family with thin
/// wrappers around the `__libc_*` implementations that count bytes while tracking is on.
///
/// Eigen allocates through malloc and `operator new` does too, so every heap byte of a
/// computation is seen. Include this header in exactly ONE translation unit of an executable (it
/// defines `malloc`, `free`, ...). Linux/glibc only and not under AddressSanitizer:
/// `EFFATTN_TRACK_MALLOC` is 1 where it works, 0 elsewhere (then `track_heap` returns -1s).
/// Used by tests/test_exact_memory.cpp and bench/bench_vcc.cpp.
#pragma once

#include <atomic>
#include <cstddef>
// Every declaration of the functions defined below comes first (the C library's, and
// <mm_malloc.h>'s posix_memalign through Eigen), so that the definitions match them.
#include <cstdlib>

#include <Eigen/Core>

#if defined(__SANITIZE_ADDRESS__)
#define EFFATTN_NO_MALLOC_TRACKING 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define EFFATTN_NO_MALLOC_TRACKING 1
#endif
#endif

#if defined(__GLIBC__) && !defined(EFFATTN_NO_MALLOC_TRACKING)
#define EFFATTN_TRACK_MALLOC 1
#include <malloc.h>
extern "C" {
void* __libc_malloc(std::size_t);
void __libc_free(void*);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
}
#else
#define EFFATTN_TRACK_MALLOC 0
#endif

namespace effattn {
namespace testing {

/// What `track_heap` measured over one call.
struct HeapStats {
  long long peak = -1;     ///< peak of (bytes live - bytes live at the start)
  long long largest = -1;  ///< largest single allocation
  long long count = -1;    ///< number of allocations
};

namespace malloc_count {
inline std::atomic<bool> tracking{false};
inline std::atomic<long long> live{0}, peak{0}, largest{0}, count{0};

inline void on_alloc(void* p) {
#if EFFATTN_TRACK_MALLOC
  if (p == nullptr || !tracking.load(std::memory_order_relaxed)) return;
  const auto sz = static_cast<long long>(malloc_usable_size(p));
  const long long now = live.fetch_add(sz) + sz;
  long long pk = peak.load();
  while (now > pk && !peak.compare_exchange_weak(pk, now)) {
  }
  long long lg = largest.load();
  while (sz > lg && !largest.compare_exchange_weak(lg, sz)) {
  }
  count.fetch_add(1);
#else
  (void)p;
#endif
}

inline void on_free(void* p) {
#if EFFATTN_TRACK_MALLOC
  if (p == nullptr || !tracking.load(std::memory_order_relaxed)) return;
  live.fetch_sub(static_cast<long long>(malloc_usable_size(p)));
#else
  (void)p;
#endif
}
}  // namespace malloc_count

/// Runs `f()` with tracking on and returns what it allocated (all -1 without tracking).
template <typename F>
HeapStats track_heap(F&& f) {
  namespace mc = malloc_count;
  mc::live = 0;
  mc::peak = 0;
  mc::largest = 0;
  mc::count = 0;
  mc::tracking = true;
  f();
  mc::tracking = false;
  if (!EFFATTN_TRACK_MALLOC) return {};
  return {mc::peak.load(), mc::largest.load(), mc::count.load()};
}

}  // namespace testing
}  // namespace effattn

#if EFFATTN_TRACK_MALLOC
extern "C" {
void* malloc(std::size_t n) {
  void* p = __libc_malloc(n);
  effattn::testing::malloc_count::on_alloc(p);
  return p;
}
void free(void* p) {
  effattn::testing::malloc_count::on_free(p);
  __libc_free(p);
}
void* calloc(std::size_t a, std::size_t b) {
  void* p = __libc_calloc(a, b);
  effattn::testing::malloc_count::on_alloc(p);
  return p;
}
void* realloc(void* old, std::size_t n) {
  effattn::testing::malloc_count::on_free(old);
  void* p = __libc_realloc(old, n);
  // A failed realloc (n > 0) leaves the old block allocated.
  effattn::testing::malloc_count::on_alloc(p != nullptr ? p : (n == 0 ? nullptr : old));
  return p;
}
void* memalign(std::size_t align, std::size_t n) {
  void* p = __libc_memalign(align, n);
  effattn::testing::malloc_count::on_alloc(p);
  return p;
}
void* aligned_alloc(std::size_t align, std::size_t n) {
  return memalign(align, n);
}
int posix_memalign(void** out, std::size_t align, std::size_t n) {
  void* p = memalign(align, n);
  if (p == nullptr) return 12;  // ENOMEM
  *out = p;
  return 0;
}
}
#endif
