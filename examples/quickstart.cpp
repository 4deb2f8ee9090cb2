// effattn quick start: exact attention two ways on a synthetic RoPE-like workload, checked
// against each other, with timings. Usage: effattn-quickstart [n] [d]
#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  using namespace effattn;
  const Index n = argc > 1 ? std::atol(argv[1]) : 4096;
  const Index d = argc > 2 ? std::atol(argv[2]) : 64;
  if (n < 1 || d < 1) {
    std::fprintf(stderr, "usage: effattn-quickstart [n >= 1] [d >= 1]\n");
    return 2;
  }

  // Q, K, V for n tokens: n x d, n x d, n x d (tokens are rows).
  const auto w = workloads::make<float>(workloads::Kind::Positional, n, d, /*seed=*/42);

  auto seconds = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };

  ExactAttentionf::Options opts;  // scale 0 = 1/sqrt(d), non-causal, automatic tiles
  ExactResult<float> tiled, naive, causal;
  const double t_tiled = seconds([&] { tiled = ExactAttentionf(opts).compute(w.Q, w.K, w.V); });
  const double t_naive = seconds([&] { naive = NaiveAttentionf(opts).compute(w.Q, w.K, w.V); });
  opts.causal = true;
  const double t_causal = seconds([&] { causal = ExactAttentionf(opts).compute(w.Q, w.K, w.V); });

  const double err = (tiled.output - naive.output).norm() / naive.output.norm();
  std::printf(
      "effattn %d.%d.%d quick start: positional workload, n = m = %ld, d = %ld, float, %d "
      "thread(s)\n",
      EFFATTN_VERSION_MAJOR, EFFATTN_VERSION_MINOR, EFFATTN_VERSION_PATCH, static_cast<long>(n),
      static_cast<long>(d), max_threads());
  std::printf("  %-34s %10s %12s\n", "method", "time [ms]", "rel. error");
  std::printf("  %-34s %10.1f %12s\n", "ExactAttention<Naive> (reference)", 1e3 * t_naive, "-");
  std::printf("  %-34s %10.1f %12.2e\n", "ExactAttention<Tiled>", 1e3 * t_tiled, err);
  std::printf("  %-34s %10.1f %12s\n", "ExactAttention<Tiled>, causal", 1e3 * t_causal, "-");
  std::printf("  tiles: %ld x %ld, info: %s; lse[0] = %.4f\n", static_cast<long>(tiled.block_q),
              static_cast<long>(tiled.block_k), to_string(tiled.info),
              static_cast<double>(tiled.lse(0)));
  return tiled.info == Info::Success && err < 1e-4 ? 0 : 1;
}
