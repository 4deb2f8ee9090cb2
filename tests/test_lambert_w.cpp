// Tests of numerics/lambert_w.hpp against mathematical identities and independently computed
// values.
#include "test_utils.hpp"

#include <effattn/numerics/lambert_w.hpp>

using effattn::lambert_w0;
using effattn::lambert_w0_exp;

TEST_CASE("Lambert W0 at known points", "[core][lambert_w]") {
  CHECK(lambert_w0(0.0) == 0.0);
  // W0(w e^w) = w at integer w.
  CHECK(std::abs(lambert_w0(std::exp(1.0)) - 1.0) <= 1e-15);
  CHECK(std::abs(lambert_w0(2.0 * std::exp(2.0)) - 2.0) <= 2e-15);
  CHECK(std::abs(lambert_w0(10.0 * std::exp(10.0)) - 10.0) <= 1e-14);
  // The omega constant, W0(1) = 0.56714329040978387299996866221035554975... (OEIS A030178).
  CHECK(std::abs(lambert_w0(1.0) - 0.56714329040978387299996866221035554975) <= 1e-16);
  // W0(2 / e^2) = 0.217715105757090 (computed independently by a Halley iteration).
  CHECK(std::abs(lambert_w0(2.0 / std::exp(2.0)) - 0.217715105757090) <= 1e-14);
}

TEST_CASE("Lambert W0 satisfies w e^w = z over a log-spaced range", "[core][lambert_w]") {
  // The relative error of w implied by the residual is |w e^w - z| / (z (1 + w)) (d(w e^w)/dw =
  // e^w (1 + w)). For z up to 1e300, w e^w is formed as exp(log w + w) to avoid overflow.
  double worst = 0;
  for (double lz = -690.0; lz <= 690.0; lz += 0.37) {
    const double z = std::exp(lz);
    const double w = lambert_w0(z);
    REQUIRE(w >= 0);
    const double back = std::exp(std::log(w) + w);  // w e^w
    worst = std::max(worst, std::abs(back - z) / (z * (1.0 + w)));
  }
  INFO("worst relative error of w: " << worst);
  CHECK(worst <= 1e-14);
}

TEST_CASE("lambert_w0_exp(x) = W0(e^x) without overflow", "[core][lambert_w]") {
  // Identity: w + log w = x. The
  // derivative of w + log w is 1 + 1/w, so delta_w = |residual| / (1 + 1/w), relative = delta_w/w.
  double worst = 0;
  for (double x = -700; x <= 1e12; x = x < 0 ? x + 3.1 : (x < 1e3 ? x + 7.3 : x * 1.7)) {
    const double w = lambert_w0_exp(x);
    REQUIRE(w > 0);
    const double residual = w + std::log(w) - x;
    const double rel = std::abs(residual) / (1.0 + 1.0 / w) / w;
    // The residual itself carries round-off of x (|x| eps): allow that on top of 1e-14.
    worst = std::max(worst, rel - std::abs(x) * 2.3e-16 / w);
  }
  INFO("worst relative error of w beyond the round-off of x: " << worst);
  CHECK(worst <= 1e-14);
  // Consistency with the direct form where both apply.
  for (double z : {1e-5, 0.3, 1.0, 7.0, 1e3, 1e100}) {
    CHECK(std::abs(lambert_w0_exp(std::log(z)) - lambert_w0(z)) <= 1e-15 * (1 + lambert_w0(z)));
  }
}

TEST_CASE("Lambert W0 for tiny z follows the series z - z^2", "[core][lambert_w]") {
  for (double z : {1e-300, 1e-200, 1e-20, 1e-9, 1e-7}) {
    const double w = lambert_w0(z);
    CHECK(std::abs(w - (z - z * z)) <= 1e-14 * z + 2 * z * z * z);
  }
  CHECK(lambert_w0(std::numeric_limits<double>::denorm_min()) ==
        std::numeric_limits<double>::denorm_min());
}

TEST_CASE("WildCat temperature golden values via Lambert W0", "[core][lambert_w]") {
  // tau^2 from the WildCat closed form (eq. 12 of the paper), computed here with lambert_w0 and
  // compared with golden values computed independently (Halley iteration for W0):
  //   b0 = log(m) / (beta R_Q R_K) + 2; rho = b0 / (2 W0(b0 / (2 rho0))); tau^2 = (R_K / R_Q) rho,
  //   rho0 = sqrt(1 + exp(W0(2 / e^2) + 2)).
  const double rho0 = std::sqrt(1.0 + std::exp(lambert_w0(2.0 / std::exp(2.0)) + 2.0));
  CHECK(std::abs(rho0 - 3.191601025323704) <= 1e-14);
  struct Row {
    double beta, rq, rk, m, tau2;
  };
  const Row rows[] = {{1.0 / 8, 11, 11, 1024, 4.259285737487},
                      {1.0 / 8, 10, 5, 4096, 2.294123761685},
                      {1.0, 1, 1, 1024, 6.407530175895},
                      {1.0 / 8, 20, 20, 128, 4.117257931079},
                      {1.0 / 4, 2, 2, 1, 4.078439693319}};
  for (const Row& r : rows) {
    const double b0 = std::log(r.m) / (r.beta * r.rq * r.rk) + 2.0;
    const double rho = b0 / (2.0 * lambert_w0(b0 / (2.0 * rho0)));
    const double tau2 = (r.rk / r.rq) * rho;
    INFO("beta " << r.beta << " R_Q " << r.rq << " R_K " << r.rk << " m " << r.m);
    CHECK(std::abs(tau2 - r.tau2) <= 1e-11);  // the golden values carry 13 significant digits
  }
}

TEST_CASE("Lambert W0 rejects its domain errors", "[core][lambert_w][errors]") {
  CHECK_THROWS_AS(lambert_w0(-1e-3), effattn::invalid_argument);
  CHECK_THROWS_AS(lambert_w0(std::nan("")), effattn::invalid_argument);
  CHECK_THROWS_AS(lambert_w0_exp(std::numeric_limits<double>::infinity()),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(lambert_w0_exp(std::nan("")), effattn::invalid_argument);
  CHECK(std::isinf(lambert_w0(std::numeric_limits<double>::infinity())));
}
