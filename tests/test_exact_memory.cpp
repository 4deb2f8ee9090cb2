// Heap accounting for the Tiled kernel: peak extra memory at n = m = 16384, no n x m allocation,
// and a number of allocations that does not grow with the number of tiles.
//
// The heap accounting is tests/malloc_count.hpp (glibc malloc interposition, shared with
// bench_vcc). Linux/glibc only, and not usable under sanitizers (CMake option EFFATTN_TEST_MEMORY).
#include "malloc_count.hpp"
#include "test_utils.hpp"

#include <effattn/exact.hpp>
#include <effattn/multi_head.hpp>
#include <effattn/workloads.hpp>
#include <utility>

namespace {
using Stats = effattn::testing::HeapStats;
// Runs f with tracking on; returns the peak of (bytes live - bytes live at start).
template <typename F>
Stats track(F&& f) {
  static_assert(EFFATTN_TRACK_MALLOC, "test_exact_memory needs glibc malloc interposition");
  return effattn::testing::track_heap(std::forward<F>(f));
}
}  // namespace

using namespace effattn;

TEST_CASE("The accounting sees Eigen allocations", "[exact][memory]") {
  // Guards the test itself: a 1000 x 1000 double matrix must be counted (8 MB).
  const Stats s = track([] {
    Matrix<double> big(1000, 1000);
    big.setZero();
    REQUIRE(big(0, 0) == 0.0);
  });
  CHECK(s.largest >= 8'000'000);
  CHECK(s.peak >= 8'000'000);
}

TEST_CASE("Tiled at n = m = 16384 stays under 64 MiB beyond the inputs", "[exact][memory][slow]") {
  const Index n = 16384, d = 64;
  const auto w = workloads::make<float>(workloads::Kind::Gaussian, n, d, 1);
  const ExactAttentionf f;
  (void)f.compute(w.Q.topRows(256), w.K.topRows(256), w.V.topRows(256));  // warm up OpenMP
  ExactResult<float> r;
  const Stats s = track([&] { r = f.compute(w.Q, w.K, w.V); });
  REQUIRE(r.info == Info::Success);
  const long long scores_bytes =
      static_cast<long long>(n) * n * static_cast<long long>(sizeof(float));
  INFO("peak extra heap " << s.peak << " B, largest block " << s.largest << " B, " << s.count
                          << " allocations; n x m float scores would be " << scores_bytes << " B");
  CHECK(s.peak < 64LL * 1024 * 1024);
  // Nothing close to n x m: the largest block is the n x dv output (4 MiB).
  CHECK(s.largest < scores_bytes / 64);
  CHECK(s.largest >= static_cast<long long>(n * d * 4));
}

TEMPLATE_TEST_CASE("The number of allocations does not grow with the number of tiles",
                   "[exact][memory]", float, double) {
  for (const Index d : {64, 128}) {
    for (const bool causal : {false, true}) {
      ExactOptions o;
      o.causal = causal;
      const ExactAttention<TestType> f(o);
      auto count_for = [&](Index n) {
        const auto w = workloads::make<TestType>(workloads::Kind::Gaussian, n, d, 2);
        (void)f.compute(w.Q, w.K, w.V);  // warm-up (thread pool, lazily initialised state)
        return track([&] { (void)f.compute(w.Q, w.K, w.V); }).count;
      };
      const long long small = count_for(1024);  // 8 x 4 tiles
      const long long large = count_for(4096);  // 32 x 16 tiles: 16x more GEMM pairs
      INFO("d = " << d << ", causal = " << causal << ": " << small << " allocations at n = 1024, "
                  << large << " at n = 4096");
      // Allocations are per call and per thread (K^T, workspaces, output), never per tile or GEMM.
      CHECK(large <= small + 4);
      CHECK(large < 64);
    }
  }
}

TEST_CASE("MultiHead exact reads row-major inputs in place", "[exact][memory][multi_head]") {
  // B = 4, heads = 16, kv_heads = 4, d = 128, L = 512, causal: the extra heap beyond the output
  // is the per-thread tile workspaces, the per-(sequence, head) lse and the task plan, never a
  // copy of Q, K or V (each 1 to 4 MiB here).
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Index B = 4, H = 16, G = 4, d = 128, L = 512, T = B * L;
  const RowMat Q = RowMat::Random(T, H * d), K = RowMat::Random(T, G * d),
               V = RowMat::Random(T, G * d);
  SeqOffsets cu{0};
  for (Index b = 0; b < B; ++b) cu.push_back(cu.back() + L);
  ExactOptions o;
  o.causal = true;
  const MultiHead<ExactAttentionf> mh(o, {H, G});
  (void)mh.compute(Q.topRows(L), K.topRows(L), V.topRows(L));  // warm up OpenMP
  MultiHeadResult<ExactAttentionf, Eigen::RowMajor> r;
  const Stats s = track([&] { r = mh.compute(Q, K, V, cu, cu); });
  REQUIRE(r.info == Info::Success);
  const long long out_bytes = static_cast<long long>(T) * H * d * 4;
  const long long lse_bytes = static_cast<long long>(T) * H * 4;
  // One workspace per thread: bq x (d + bk + dv) floats with bq = 128, bk = 256 (2 score tiles).
  const long long tile_bytes = 128LL * 256 * 4;
  const long long threads = max_threads();
  const long long extra = s.peak - out_bytes - lse_bytes;
  INFO("peak " << s.peak << " B: output " << out_bytes << ", lse " << lse_bytes << ", rest "
               << extra << " (" << threads << " threads; one tile " << tile_bytes << " B); K is "
               << K.size() * 4 << " B");
  CHECK(extra <= 2 * tile_bytes * threads + 64 * 1024);  // + the task plan (a few KiB)
}

TEST_CASE("Tiled backward allocates nothing n x m, and a tile-count-independent number of blocks",
          "[exact][memory][gradients]") {
  const Index n = 8192, d = 64;
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    const ExactAttentionf f(o);
    const auto w = workloads::make<float>(workloads::Kind::Gaussian, n, d, 3);
    const Matrix<float> dO = workloads::make<float>(workloads::Kind::Gaussian, n, d, 4).V;
    const ExactResult<float> r = f.compute(w.Q, w.K, w.V);
    REQUIRE(r.info == Info::Success);
    AttentionGradients<float> g;
    const Stats s = track([&] { g = f.backward(w.Q, w.K, w.V, r, dO); });
    REQUIRE(g.dQ.rows() == n);
    const long long scores_bytes =
        static_cast<long long>(n) * n * static_cast<long long>(sizeof(float));
    INFO("causal " << causal << ": peak extra heap " << s.peak << " B, largest block " << s.largest
                   << " B, " << s.count << " allocations; n x m float scores would be "
                   << scores_bytes << " B");
    // dQ, dK, dV, s Q, K^T, V^T and 3 partial dQ sums: nine n x d float matrices of 2 MiB, plus
    // per-thread tiles.
    CHECK(s.largest <= static_cast<long long>(n * d * 4) + 4096);
    CHECK(s.peak < 24LL * 1024 * 1024);
    // Allocations per call and per thread (inputs prepared once, one workspace per thread), never
    // per tile: the same count at 1/4 of the size (16x fewer tiles).
    const auto small = workloads::make<float>(workloads::Kind::Gaussian, n / 4, d, 5);
    const ExactResult<float> rs = f.compute(small.Q, small.K, small.V);
    const Matrix<float> dOs = dO.topRows(n / 4);
    (void)f.backward(small.Q, small.K, small.V, rs, dOs);  // warm-up
    const Stats c = track([&] { (void)f.backward(small.Q, small.K, small.V, rs, dOs); });
    INFO(c.count << " allocations at n = " << n / 4 << ", " << s.count << " at n = " << n);
    CHECK(s.count <= c.count + 4);
    CHECK(s.count < 64);
  }
}
