/// \file workloads.hpp
/// \brief Seeded synthetic attention workloads {Q, K, V} used by tests, benchmarks and demos.
///
/// Every generator is deterministic in (kind, shapes, parameters, seed) and independent of the
/// thread count. Q, K and V come from separate random streams, so changing dv leaves Q and K
/// unchanged. Shapes: Q is n x d, K is m x d, V is m x dv. The logit scale assumed by the
/// parameter defaults is the library default 1/sqrt(d).
///
// clang-format off
/// | kind         | construction | imitates |
/// |--------------|--------------|----------|
/// | `gaussian`   | Q, K, V i.i.d. N(0, 1); logits ~ N(0, 1) | diffuse, high-entropy heads (random init, early layers); a flat kernel spectrum, the worst case for low-rank methods |
/// | `sphere`     | rows of Q and K uniform on the sphere of radius R (default R = d^(1/4), so logits lie in [-1, 1]) | QK-normalised / cosine attention with bounded logits |
/// | `clustered`  | c centres ~ N(0, I) (default 16); each query and key is a random centre plus N(0, noise^2 I) (noise 0.1) | semantic / topic heads: block-structured, numerically low-rank attention |
/// | `positional` | shared content c ~ N(0, I) plus a smooth low-frequency drift and small noise, rotated by RoPE at the token position (keys at j, queries bottom-aligned at i + m - n) | position-dominated heads of RoPE models: logits nearly Toeplitz, mass concentrated near the diagonal with a heavy tail |
/// | `needles`    | gaussian, but a few queries (default max(1, n / 64)) equal gain x a random key (gain 2) | retrieval / copy heads: a few very peaked rows |
// clang-format on
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.hpp"
#include "core/random.hpp"
#include "core/types.hpp"

namespace effattn {
namespace workloads {

/// The workload families (see the file documentation).
enum class Kind { Gaussian, Sphere, Clustered, Positional, Needles };

/// All kinds, in a fixed order.
inline const std::array<Kind, 5>& all_kinds() {
  static const std::array<Kind, 5> kinds = {Kind::Gaussian, Kind::Sphere, Kind::Clustered,
                                            Kind::Positional, Kind::Needles};
  return kinds;
}

/// Lower-case name of a kind ("gaussian", "sphere", "clustered", "positional", "needles").
inline const char* name(Kind kind) noexcept {
  switch (kind) {
    case Kind::Gaussian:
      return "gaussian";
    case Kind::Sphere:
      return "sphere";
    case Kind::Clustered:
      return "clustered";
    case Kind::Positional:
      return "positional";
    case Kind::Needles:
      return "needles";
  }
  return "unknown";
}

/// The kind named `s`. \throws effattn::invalid_argument for an unknown name.
inline Kind parse_kind(const std::string& s) {
  for (Kind k : all_kinds())
    if (s == name(k)) return k;
  detail::throw_invalid_argument("workloads: unknown kind '" + s +
                                 "' (expected gaussian, sphere, clustered, positional or needles)");
}

/// Shapes and knobs. Zero means "the default" for every field documented so.
struct Params {
  Index n = 1024;            ///< queries
  Index m = 0;               ///< keys (0 = n)
  Index d = 64;              ///< query/key dimension
  Index dv = 0;              ///< value dimension (0 = d)
  std::uint64_t seed = 42;   ///< random seed
  double query_scale = 1.0;  ///< Q is multiplied by this at the end (sharpens every kind)
  double radius = 0;         ///< sphere: row norm R (0 = d^(1/4))
  Index clusters = 0;        ///< clustered: number of centres (0 = 16)
  double noise = 0.1;        ///< clustered / positional: per-token noise standard deviation
  double drift = 0.3;        ///< positional: amplitude of the smooth content drift
  double rope_base = 10000;  ///< positional: RoPE base (theta_k = base^(-2k/d))
  Index needles = 0;         ///< needles: number of copying queries (0 = max(1, n / 64))
  double needle_gain = 2.0;  ///< needles: q_i = gain * k_j

  /// Default knobs with the given shapes and seed.
  static Params shape(Index n_, Index m_, Index d_, Index dv_, std::uint64_t seed_ = 42) {
    Params p;
    p.n = n_;
    p.m = m_;
    p.d = d_;
    p.dv = dv_;
    p.seed = seed_;
    return p;
  }
};

/// A generated problem.
template <typename Scalar>
struct Workload {
  Matrix<Scalar> Q;            ///< n x d
  Matrix<Scalar> K;            ///< m x d
  Matrix<Scalar> V;            ///< m x dv
  Kind kind = Kind::Gaussian;  ///< the generator that made it
  /// needles only: (query row, key row) pairs with Q.row(query) = query_scale * gain * K.row(key).
  std::vector<std::pair<Index, Index>> needles;
};

namespace detail {

// Independent random streams of one workload.
enum Stream : std::uint64_t { kQ = 1, kK = 2, kV = 3, kAux = 4, kAux2 = 5 };

inline Params resolve(Params p) {
  if (p.m == 0) p.m = p.n;
  if (p.dv == 0) p.dv = p.d;
  EFFATTN_CHECK(p.n >= 1 && p.m >= 1 && p.d >= 1 && p.dv >= 1,
                effattn::detail::cat("workloads: n, m, d, dv must be >= 1; got n = ", p.n,
                                     ", m = ", p.m, ", d = ", p.d, ", dv = ", p.dv));
  EFFATTN_CHECK(std::isfinite(p.query_scale) && std::isfinite(p.noise) && p.noise >= 0 &&
                    std::isfinite(p.drift) && std::isfinite(p.needle_gain) &&
                    std::isfinite(p.radius) && p.radius >= 0 && p.rope_base > 1 &&
                    p.clusters >= 0 && p.needles >= 0,
                "workloads: parameters must be finite, noise/radius/clusters/needles >= 0 and "
                "rope_base > 1");
  return p;
}

// Rows of x rescaled to norm r (a zero row, probability 0, is left as e_1 * r).
template <typename Scalar>
void normalize_rows(Matrix<Scalar>& x, double r) {
  for (Index i = 0; i < x.rows(); ++i) {
    const double nrm = static_cast<double>(x.row(i).norm());
    if (nrm > 0) {
      x.row(i) *= static_cast<Scalar>(r / nrm);
    } else {
      x.row(i).setZero();
      x(i, 0) = static_cast<Scalar>(r);
    }
  }
}

// Applies the RoPE rotation of position pos(i) to row i of x (pairs (2k, 2k+1)).
template <typename Scalar, typename Pos>
void apply_rope(Matrix<Scalar>& x, Pos pos, double base) {
  const Index d = x.cols(), half = d / 2;
  for (Index k = 0; k < half; ++k) {
    const double theta = std::pow(base, -2.0 * static_cast<double>(k) / static_cast<double>(d));
    for (Index i = 0; i < x.rows(); ++i) {
      const double a = static_cast<double>(pos(i)) * theta;
      const double c = std::cos(a), s = std::sin(a);
      const double x0 = static_cast<double>(x(i, 2 * k)), x1 = static_cast<double>(x(i, 2 * k + 1));
      x(i, 2 * k) = static_cast<Scalar>(c * x0 - s * x1);
      x(i, 2 * k + 1) = static_cast<Scalar>(s * x0 + c * x1);
    }
  }
}

}  // namespace detail

/// Generates the workload `kind` with the given parameters.
/// \throws effattn::invalid_argument on non-positive sizes or invalid knobs.
template <typename Scalar = double>
Workload<Scalar> make(Kind kind, const Params& params) {
  static_assert(effattn::detail::is_supported_scalar_v<Scalar>,
                "effattn: Scalar must be float or double");
  const Params p = detail::resolve(params);
  const Index n = p.n, m = p.m, d = p.d, dv = p.dv;
  Workload<Scalar> w;
  w.kind = kind;
  Rng rq = make_rng(p.seed, detail::kQ), rk = make_rng(p.seed, detail::kK),
      rv = make_rng(p.seed, detail::kV), raux = make_rng(p.seed, detail::kAux);
  w.V = random_normal<Scalar>(m, dv, rv);

  switch (kind) {
    case Kind::Gaussian:
      w.Q = random_normal<Scalar>(n, d, rq);
      w.K = random_normal<Scalar>(m, d, rk);
      break;

    case Kind::Sphere: {
      const double r = p.radius > 0 ? p.radius : std::pow(static_cast<double>(d), 0.25);
      w.Q = random_normal<Scalar>(n, d, rq);
      w.K = random_normal<Scalar>(m, d, rk);
      detail::normalize_rows(w.Q, r);
      detail::normalize_rows(w.K, r);
      break;
    }

    case Kind::Clustered: {
      const Index c = p.clusters > 0 ? p.clusters : Index(16);
      const Matrix<Scalar> centres = random_normal<Scalar>(c, d, raux);
      w.Q = random_normal<Scalar>(n, d, rq) * static_cast<Scalar>(p.noise);
      w.K = random_normal<Scalar>(m, d, rk) * static_cast<Scalar>(p.noise);
      Rng rassign = make_rng(p.seed, detail::kAux2);
      for (Index i = 0; i < n; ++i) w.Q.row(i) += centres.row(uniform_index(rassign, c));
      for (Index j = 0; j < m; ++j) w.K.row(j) += centres.row(uniform_index(rassign, c));
      break;
    }

    case Kind::Positional: {
      // content(t) = c + drift * sum_h u_h sin(2 pi h t / T + phi_h) / sqrt(H): slow in t, so
      // logits depend mostly on the offset i - j (near-Toeplitz), with a smooth trend.
      constexpr Index H = 3;
      const double T = static_cast<double>(std::max(n, m));
      Vector<double> c(d);
      fill_normal(c, raux);
      Matrix<double> u(H, d);
      fill_normal(u, raux);
      Vector<double> phase(H);
      fill_uniform(phase, raux, 0.0, 6.283185307179586);
      const Index off = m - n;  // query i sits at position i + m - n (bottom-aligned)
      auto content = [&](double t, Rng& rng) {
        Eigen::RowVectorXd x = c.transpose();
        for (Index h = 0; h < H; ++h)
          x += (p.drift / std::sqrt(static_cast<double>(H))) *
               std::sin(6.283185307179586 * static_cast<double>(h + 1) * t / T + phase(h)) *
               u.row(h);
        for (Index k = 0; k < d; ++k) x(k) += p.noise * standard_normal(rng);
        return x;
      };
      w.Q.resize(n, d);
      w.K.resize(m, d);
      for (Index i = 0; i < n; ++i)
        w.Q.row(i) = content(static_cast<double>(i + off), rq).template cast<Scalar>();
      for (Index j = 0; j < m; ++j)
        w.K.row(j) = content(static_cast<double>(j), rk).template cast<Scalar>();
      detail::apply_rope(
          w.Q, [off](Index i) { return i + off; }, p.rope_base);
      detail::apply_rope(
          w.K, [](Index j) { return j; }, p.rope_base);
      break;
    }

    case Kind::Needles: {
      w.Q = random_normal<Scalar>(n, d, rq);
      w.K = random_normal<Scalar>(m, d, rk);
      const Index count = std::min(n, p.needles > 0 ? p.needles : std::max<Index>(1, n / 64));
      // `count` distinct query rows by a partial Fisher-Yates shuffle.
      std::vector<Index> rows(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i) rows[static_cast<std::size_t>(i)] = i;
      for (Index t = 0; t < count; ++t) {
        const Index s = t + uniform_index(raux, n - t);
        std::swap(rows[static_cast<std::size_t>(t)], rows[static_cast<std::size_t>(s)]);
        const Index qi = rows[static_cast<std::size_t>(t)], kj = uniform_index(raux, m);
        w.Q.row(qi) = w.K.row(kj) * static_cast<Scalar>(p.needle_gain);
        w.needles.emplace_back(qi, kj);
      }
      break;
    }
  }
  if (p.query_scale != 1.0) w.Q *= static_cast<Scalar>(p.query_scale);
  return w;
}

/// Self-attention sized workload: n = m queries and keys of dimension d (dv = d).
template <typename Scalar = double>
Workload<Scalar> make(Kind kind, Index n, Index d, std::uint64_t seed = 42) {
  return make<Scalar>(kind, Params::shape(n, n, d, d, seed));
}

/// As `make(kind, n, d, seed)` with the kind given by name.
template <typename Scalar = double>
Workload<Scalar> make(const std::string& kind, Index n, Index d, std::uint64_t seed = 42) {
  return make<Scalar>(parse_kind(kind), n, d, seed);
}

}  // namespace workloads
}  // namespace effattn

// ---------------------------------------------------------------------------------------------
// Structured VCC workload (appended for effattn/vcc.hpp; not a `Kind`, so the generic
// conformance suite does not iterate it).
#include <algorithm>

namespace effattn {
namespace workloads {

/// Parameters of `make_smooth_vip` (defaults: smooth AR(1) keys and peaked VIP queries).
struct SmoothVipParams {
  Index n = 4096;            ///< tokens
  Index d = 64;              ///< query/key dimension
  Index dv = 0;              ///< value dimension (0 = d)
  Index vip = 48;            ///< number of VIP rows n_p (distinct, uniformly random)
  Index centres = 4;         ///< positions the VIP queries look at
  double ar = 0.98;          ///< AR(1) coefficient rho of the keys along the sequence
  double innovation = 0.2;   ///< AR(1) innovation standard deviation sigma
  double query_gain = 3.0;   ///< |q| of the VIP queries before noise
  double query_noise = 0.3;  ///< per-coordinate noise of every query
  std::uint64_t seed = 1;    ///< random seed
};

/// A smooth-keys / peaked-VIP problem: Q, K (n x d), V (n x dv), the sorted VIP rows and the
/// logit scale the parameters were designed for.
template <typename Scalar>
struct SmoothVipWorkload {
  Matrix<Scalar> Q;            ///< n x d queries
  Matrix<Scalar> K;            ///< n x d keys
  Matrix<Scalar> V;            ///< n x dv values
  std::vector<Index> vip;      ///< sorted, unique VIP rows
  std::vector<Index> centres;  ///< the key rows the VIP queries point at
  double scale = 1.0 / 3.0;    ///< tau the defaults were designed for
};

/// A structured generator (smooth keys, peaked VIP queries) on which VIP-guided compression beats
/// uniform pooling:
/// - keys: a stationary AR(1) process along the sequence, x_t = rho x_{t-1} + sigma eps_t
///   (x_0 from the stationary law N(0, sigma^2 / (1 - rho^2))), K = X: smooth in t;
/// - values V = X W with W ~ N(0, 1/d) (d x dv): as smooth as the keys;
/// - VIP queries: gain * (unit vector of the key at one of `centres` random positions) + noise,
///   so with tau = 1/3 the VIP logits span about [-5, 12] and peak around the centres;
/// - other queries: gain * (unit vector of the row's own key) + noise (local attention).
/// Deterministic in the parameters. \throws effattn::invalid_argument on bad sizes.
template <typename Scalar = double>
SmoothVipWorkload<Scalar> make_smooth_vip(const SmoothVipParams& p = {}) {
  static_assert(effattn::detail::is_supported_scalar_v<Scalar>,
                "effattn: Scalar must be float or double");
  const Index n = p.n, d = p.d, dv = p.dv > 0 ? p.dv : p.d;
  EFFATTN_CHECK(n >= 1 && d >= 1 && dv >= 1 && p.vip >= 0 && p.vip <= n && p.centres >= 1 &&
                    std::abs(p.ar) < 1 && p.innovation > 0 && std::isfinite(p.query_gain) &&
                    std::isfinite(p.query_noise) && p.query_noise >= 0,
                effattn::detail::cat("workloads::make_smooth_vip: need n, d, dv, centres >= 1, "
                                     "0 <= vip <= n, |ar| < 1, innovation > 0; got n = ",
                                     n, ", d = ", d, ", dv = ", dv, ", vip = ", p.vip,
                                     ", centres = ", p.centres, ", ar = ", p.ar));
  Rng rx = make_rng(p.seed, 11), rw = make_rng(p.seed, 12), rsel = make_rng(p.seed, 13),
      rq = make_rng(p.seed, 14);
  Matrix<double> X(n, d);
  Vector<double> eps(d);
  fill_normal(eps, rx);
  X.row(0) = eps.transpose() * (p.innovation / std::sqrt(1.0 - p.ar * p.ar));
  for (Index t = 1; t < n; ++t) {
    fill_normal(eps, rx);
    X.row(t) = p.ar * X.row(t - 1) + p.innovation * eps.transpose();
  }
  Matrix<double> W(d, dv);
  fill_normal(W, rw, 0.0, 1.0 / std::sqrt(static_cast<double>(d)));
  SmoothVipWorkload<Scalar> w;
  w.K = X.cast<Scalar>();
  w.V = (X * W).cast<Scalar>();
  // VIP rows: a partial Fisher-Yates shuffle, then sorted. Centres: uniform rows.
  std::vector<Index> rows(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) rows[static_cast<std::size_t>(i)] = i;
  for (Index t = 0; t < p.vip; ++t)
    std::swap(rows[static_cast<std::size_t>(t)],
              rows[static_cast<std::size_t>(t + uniform_index(rsel, n - t))]);
  w.vip.assign(rows.begin(), rows.begin() + p.vip);
  std::sort(w.vip.begin(), w.vip.end());
  for (Index c = 0; c < p.centres; ++c) w.centres.push_back(uniform_index(rsel, n));
  Matrix<double> Q(n, d), noise(n, d);
  fill_normal(noise, rq, 0.0, p.query_noise);
  for (Index t = 0; t < n; ++t) Q.row(t) = X.row(t).normalized() * p.query_gain;
  for (const Index i : w.vip) {
    const Index c = w.centres[static_cast<std::size_t>(uniform_index(rsel, p.centres))];
    Q.row(i) = X.row(c).normalized() * p.query_gain;
  }
  w.Q = (Q + noise).cast<Scalar>();
  return w;
}

}  // namespace workloads
}  // namespace effattn
