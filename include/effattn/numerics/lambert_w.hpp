/// \file lambert_w.hpp
/// \brief Principal branch W0 of the Lambert W function for z >= 0, and its log-argument form.
///
/// W0(z) is the w >= 0 with w e^w = z. WildCat's closed-form temperature (eq. 12 of the WildCat
/// paper) needs W0 of arguments that may be astronomically large, hence `lambert_w0_exp(x)` =
/// W0(e^x), which never forms e^x.
///
/// Method: the iteration of Loczi (2022, "Guaranteed- and high-precision evaluation of the
/// Lambert W function"), beta <- beta / (1 + beta) * (1 + log z - log beta), started at
/// log z - log log z for z > e and at z / e otherwise. It converges quadratically from that start
/// (the guaranteed error after k steps is below max(0.32^(2^k), 0.633^(2^k) / 3): 6e-14 after
/// 6 steps); we iterate until the update is at round-off, at most 12 times, in double.
/// Accuracy: relative error <= 1e-14 over z in [1e-300, 1e300] and x in [-690, 1e12] (tested).
#pragma once

#include <cmath>
#include <limits>

#include "../core/errors.hpp"

namespace effattn {

/// W0(e^x) for any finite real x: the w > 0 with w + log w = x. Never overflows.
/// \throws effattn::invalid_argument if x is NaN or infinite.
inline double lambert_w0_exp(double x) {
  EFFATTN_CHECK(std::isfinite(x), detail::cat("lambert_w0_exp: x must be finite; got ", x));
  // Start: log z - log log z for z = e^x > e (x > 1), z / e = e^(x - 1) otherwise.
  double beta = x > 1.0 ? x - std::log(x) : std::exp(x - 1.0);
  if (beta == 0.0) return 0.0;  // e^x underflows relative to the result: W0(z) = z = 0 in double
  for (int k = 0; k < 12; ++k) {
    const double next = beta / (1.0 + beta) * (1.0 + x - std::log(beta));
    const double delta = std::abs(next - beta);
    beta = next;
    if (delta <= 4.0 * std::numeric_limits<double>::epsilon() * beta) break;
  }
  return beta;
}

/// Principal branch W0(z) for z >= 0 (W0(0) = 0, W0(e) = 1, W0(z) ~ z for small z).
/// \throws effattn::invalid_argument if z < 0 or z is NaN. W0(+inf) = +inf.
inline double lambert_w0(double z) {
  EFFATTN_CHECK(z >= 0.0,
                detail::cat("lambert_w0: z must be >= 0 (the W0 branch used here); got ", z));
  if (z == 0.0) return 0.0;
  if (std::isinf(z)) return z;
  if (z < 1e-8) return z * (1.0 - z * (1.0 - 1.5 * z));  // series z - z^2 + 3/2 z^3, error O(z^4)
  return lambert_w0_exp(std::log(z));
}

}  // namespace effattn
