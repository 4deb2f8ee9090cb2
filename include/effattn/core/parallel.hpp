/// \file parallel.hpp
/// \brief The one place effattn opens OpenMP regions.
///
/// effattn parallelises only over independent units of work (query blocks, heads, bins, FFT
/// columns) whose decomposition depends on the problem shape and the options, never on the thread
/// count, so results are bit-identical for any number of threads. Inside an effattn parallel
/// region Eigen's own GEMM runs single-threaded (Eigen refuses to nest), so there is no
/// oversubscription. Compile with `-fopenmp` to enable; define `EFFATTN_DONT_PARALLELIZE` to
/// disable. The thread count is OpenMP's (`OMP_NUM_THREADS`, `omp_set_num_threads`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>

#include "types.hpp"

#if EFFATTN_HAS_OPENMP
#include <omp.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace effattn {

/// Number of threads effattn's parallel loops use at this point (1 without OpenMP).
inline int max_threads() noexcept {
#if EFFATTN_HAS_OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

namespace detail {

/// Number of threads a `parallel_for` opened here would run on: 1 inside a parallel region
/// (where it runs serially), otherwise `max_threads()`.
inline int region_threads() noexcept {
#if EFFATTN_HAS_OPENMP
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

/// The huge-page size (2 MiB) and whether a buffer of `bytes` is one that `advise_huge_pages`
/// backs with huge pages and `populate_pages` maps up front: 8 to 64 MiB (see both).
inline constexpr std::size_t kHugePage = std::size_t(1) << 21;
inline constexpr bool huge_page_sized(std::size_t bytes) noexcept {
  return bytes >= 4 * kHugePage && bytes <= 32 * kHugePage;
}

/// Asks the kernel to back the 2 MiB-aligned part of a large, freshly allocated and not yet
/// touched buffer with transparent huge pages (Linux `madvise(MADV_HUGEPAGE)`; a no-op elsewhere,
/// for buffers under 8 MiB or over 64 MiB, or when THP is disabled). A fresh buffer is zeroed by
/// the kernel page by page on first touch: measured 15 ms for 32 MiB with 4 KiB pages against
/// 4 ms with 2 MiB pages (this machine); WildCat at m = 16384 (factor, key copies, Nystrom
/// operands, ~80 MiB) went from ~165 to ~143 ms per call with it. Over 64 MiB (the 128 MiB
/// factor at m = 65536, r = 256) the first call of a process was measured 20-40% slower with
/// huge pages, so such buffers are left alone. Values are unaffected.
inline void advise_huge_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = kHugePage;
  if (data == nullptr || !huge_page_sized(bytes)) return;
  const auto p = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t lo = (p + kHuge - 1) & ~(kHuge - 1), hi = (p + bytes) & ~(kHuge - 1);
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

/// Maps every page of a freshly allocated buffer of 8 to 64 MiB (the sizes `advise_huge_pages`
/// backs with huge pages) that is about to be written whole, in one call before the parallel
/// kernel writes it (Linux 5.14+ `madvise(MADV_POPULATE_WRITE)`; a no-op for other sizes,
/// elsewhere, or on older kernels, where the first writes fault the pages in as before). A first
/// write into an unmapped page is a fault whose handler zeroes the page; inside a parallel kernel
/// the threads writing into the same fresh huge page wait for each other. MultiHead's 64 MiB
/// prefill output (B = 8, L = 512, 32 heads of 128): `compute` took 12-18 ms more than
/// `compute_into` a reused buffer, 3-4 ms more with the pages populated first (4 calls each, 2
/// threads). Over 64 MiB (4 KiB pages) the one serial call costs more than
/// the threads' own faults: the 256 MiB output at L = 2048 ran 4-8% slower with it. Values are
/// unaffected.
inline void populate_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__)
#ifdef MADV_POPULATE_WRITE
  constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
  constexpr int kPopulateWrite = 23;  // the Linux value, for C libraries that predate it
#endif
  if (data == nullptr || !huge_page_sized(bytes)) return;
  constexpr std::uintptr_t kPage = 4096;
  const auto p = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t lo = p & ~(kPage - 1), hi = p + bytes;
  // The page holding the buffer's start may hold other data: populating maps, it never writes.
  (void)madvise(reinterpret_cast<void*>(lo), hi - lo, kPopulateWrite);
#else
  (void)data;
  (void)bytes;
#endif
}

/// `populate_pages` for the storage of a dense Eigen object.
template <typename Dense>
void populate_pages(const Dense& x) noexcept {
  populate_pages(x.data(), static_cast<std::size_t>(x.size()) * sizeof(typename Dense::Scalar));
}

/// `advise_huge_pages` for the storage of a dense Eigen object.
template <typename Dense>
void advise_huge_pages(const Dense& x) noexcept {
  advise_huge_pages(x.data(), static_cast<std::size_t>(x.size()) * sizeof(typename Dense::Scalar));
}

/// Runs `body(task, workspace)` for every task in [0, count). Each thread builds one workspace
/// with `make_workspace()` and reuses it for all the tasks it runs (dynamic schedule, chunk 1).
/// The exception of the lowest-numbered task that threw is rethrown after the region ends, so
/// the error a caller sees does not depend on the thread count or the schedule (the serial path
/// stops at that task).
template <typename MakeWorkspace, typename Body>
void parallel_for(Index count, MakeWorkspace&& make_workspace, Body&& body) {
  if (count <= 0) return;
  std::exception_ptr error;
#if EFFATTN_HAS_OPENMP
  if (omp_in_parallel()) {
    // Already inside a parallel region (a MultiHead task, a WildCat bin, a user's region):
    // run on this thread without opening a nested one. A nested region would be a team of one
    // whose Eigen GEMMs pick their blocking for omp_get_max_threads() threads, so results
    // would depend on the thread count; here Eigen sees the enclosing team and stays serial.
    try {
      auto workspace = make_workspace();
      for (Index t = 0; t < count; ++t) body(t, workspace);
    } catch (...) {
      error = std::current_exception();
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  std::mutex error_mutex;
  Index error_task = count;  // lowest task that threw (count: none)
  // The region is opened even for a single task: inside it Eigen's GEMM is always serial, so
  // every task computes bit-identical results whatever the thread count.
#pragma omp parallel
  {
    try {
      auto workspace = make_workspace();
#pragma omp for schedule(dynamic, 1)
      for (Index t = 0; t < count; ++t) {
        try {
          body(t, workspace);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (t < error_task) {
            error_task = t;
            error = std::current_exception();
          }
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
#else
  try {
    auto workspace = make_workspace();
    for (Index t = 0; t < count; ++t) body(t, workspace);
  } catch (...) {
    error = std::current_exception();
  }
#endif
  if (error) std::rethrow_exception(error);
}

/// Runs `f()` as the single task of an effattn parallel region. Inside it Eigen's own GEMMs are
/// serial, so products in `f` round the same way for any thread count (Eigen's threaded GEMM
/// picks its blocking from the thread count, which changes the rounding).
template <typename F>
void run_serial(F&& f) {
  parallel_for(
      1, [] { return 0; }, [&](Index, int&) { f(); });
}

/// Runs `body(t)` for t in [0, count): as one `parallel_for` (no workspace) when `worth_it`,
/// otherwise in order on the calling thread without opening a region. Use it where a region
/// costs more than it gains (one task, or tasks that are GEMVs, which Eigen never threads).
template <typename Body>
void parallel_for_if(bool worth_it, Index count, Body&& body) {
  if (worth_it && count > 1) {
    parallel_for(
        count, [] { return 0; }, [&](Index t, int&) { body(t); });
  } else {
    for (Index t = 0; t < count; ++t) body(t);
  }
}

}  // namespace detail
}  // namespace effattn
