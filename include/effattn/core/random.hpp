/// \file random.hpp
/// \brief Seeded, toolchain-independent randomness.
///
/// The engine is `std::mt19937_64`, whose output sequence the C++ standard fixes. The standard
/// *distributions* are implementation-defined, so effattn never uses them: the transforms below
/// (53-bit uniforms, Lemire's unbiased bounded integers, Box-Muller normals) are ours and give the
/// same numbers with every conforming compiler and standard library (the normals additionally
/// rely on the platform's `std::log`, `std::sqrt`, `std::cos` and `std::sin`; glibc's are
/// deterministic across runs).
///
/// Parallel code never shares an engine: each independent unit of work (a head, a block, a bin)
/// gets its own engine seeded with `derive_seed(seed, unit_index)`, so results do not depend on
/// the thread count or on scheduling.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "errors.hpp"

namespace effattn {

/// The engine used throughout effattn.
using Rng = std::mt19937_64;

/// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche.
constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// Seed of the independent stream number `stream` derived from a user seed.
/// Distinct `(seed, stream)` pairs give (with overwhelming probability) distinct seeds.
constexpr std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t stream) noexcept {
  return splitmix64(splitmix64(seed) ^ splitmix64(stream + 0x632BE59BD9B4E019ULL));
}

/// An engine for stream `stream` of `seed`.
inline Rng make_rng(std::uint64_t seed, std::uint64_t stream = 0) {
  return Rng(derive_seed(seed, stream));
}

/// Uniform double in [0, 1) from the top 53 bits of one engine output.
inline double uniform01(Rng& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

/// Uniform double in the open interval (0, 1): (k + 1/2) / 2^52 for a 52-bit k. (With 53 bits,
/// k + 1/2 is not representable for k >= 2^52 and the top value would round to exactly 1.)
inline double uniform_open01(Rng& rng) {
  return (static_cast<double>(rng() >> 12) + 0.5) * 0x1.0p-52;
}

/// Uniform integer in [0, n) without modulo bias (rejection of the low 2^64 mod n outputs).
inline Index uniform_index(Rng& rng, Index n) {
  EFFATTN_CHECK(n > 0, detail::cat("uniform_index: n must be >= 1; got ", n));
  const auto range = static_cast<std::uint64_t>(n);
  const std::uint64_t threshold = (0 - range) % range;  // = 2^64 mod range
  std::uint64_t r = rng();
  while (r < threshold) r = rng();
  return static_cast<Index>(r % range);
}

/// A pair of independent standard normals from two engine outputs (Box-Muller).
inline void standard_normal_pair(Rng& rng, double& z0, double& z1) {
  const double u1 = uniform_open01(rng);
  const double u2 = uniform01(rng);
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 6.283185307179586476925286766559 * u2;
  z0 = r * std::cos(theta);
  z1 = r * std::sin(theta);
}

/// One standard normal (uses two engine outputs; the second normal of the pair is discarded).
inline double standard_normal(Rng& rng) {
  double z0, z1;
  standard_normal_pair(rng, z0, z1);
  return z0;
}

/// Fills `m` with i.i.d. N(mean, stddev^2) in column-major order, two entries per Box-Muller pair.
template <typename Derived>
void fill_normal(Eigen::DenseBase<Derived>& m, Rng& rng, double mean = 0.0, double stddev = 1.0) {
  using S = typename Derived::Scalar;
  const Index rows = m.rows(), total = m.size();
  double z0 = 0, z1 = 0;
  for (Index k = 0; k < total; ++k) {
    double z;
    if ((k & 1) == 0) {
      standard_normal_pair(rng, z0, z1);
      z = z0;
    } else {
      z = z1;
    }
    m(k % rows, k / rows) = static_cast<S>(mean + stddev * z);
  }
}

/// Fills `m` with i.i.d. uniforms on [lo, hi) in column-major order (lo < hi). Values that round
/// up to `hi` in the target scalar (possible for float) are replaced by the largest scalar < hi.
template <typename Derived>
void fill_uniform(Eigen::DenseBase<Derived>& m, Rng& rng, double lo = 0.0, double hi = 1.0) {
  using S = typename Derived::Scalar;
  const Index rows = m.rows();
  const S top = static_cast<S>(hi);
  const S below_top = std::nextafter(top, static_cast<S>(lo));
  for (Index k = 0; k < m.size(); ++k) {
    const S x = static_cast<S>(lo + (hi - lo) * uniform01(rng));
    m(k % rows, k / rows) = x < top ? x : below_top;
  }
}

/// Fills `m` with i.i.d. Rademacher signs (+1/-1), 64 signs per engine output.
template <typename Derived>
void fill_rademacher(Eigen::DenseBase<Derived>& m, Rng& rng) {
  using S = typename Derived::Scalar;
  const Index rows = m.rows();
  std::uint64_t bits = 0;
  for (Index k = 0; k < m.size(); ++k) {
    if ((k & 63) == 0) bits = rng();
    m(k % rows, k / rows) = (bits >> (k & 63)) & 1U ? S(1) : S(-1);
  }
}

/// A matrix of i.i.d. standard normals.
template <typename Scalar>
Matrix<Scalar> random_normal(Index rows, Index cols, Rng& rng) {
  Matrix<Scalar> m(rows, cols);
  fill_normal(m, rng);
  return m;
}

}  // namespace effattn
