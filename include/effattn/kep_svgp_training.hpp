/// \file kep_svgp_training.hpp
/// \brief KEP-SVGP's trainer utilities (eq. 11, 20, 21): `kepsvgp::kl_divergence`, `ksvd_loss`,
/// `elbo`, `normalized_cumulative_spectrum` and `from_log_inv_sqrt`. `<effattn/kep_svgp.hpp>`
/// includes this header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/types.hpp"
#include "kep_svgp.hpp"

namespace effattn {

namespace kepsvgp {

/// KL(q(u) || p(u)) of eq. 21 (Prop. 4.1), p(u_c) = N(0, Lambda^2), q(u_c) = N(m_c, L_c L_c^T),
/// summed over the dv columns: 1/2 sum_c [ ||Lambda^-1 L_c||_F^2 + m_c^T Lambda^-2 m_c
/// + log|Lambda^2| - 2 sum_k log L_c,kk - s ]. Accumulated in double; O(dv s^2). (The official
/// code stores S as one s x s x s tensor, which makes S_c singular for c > 1; here every L_c is a
/// full factor.)
/// \throws effattn::invalid_argument on shape mismatch, lambda <= 0, a non-positive diagonal or
///         a non-zero strictly upper entry of some L_c.
template <typename Scalar>
double kl_divergence(const Vector<Scalar>& lambda, const VariationalParams<Scalar>& vp);

/// KSVD regulariser of eq. 11: J^2 with J = -1/2 sum_i e_i^T Lambda^-1 e_i
/// - 1/2 sum_j r_j^T Lambda^-1 r_j + Tr(W_e^T W_r). Reduction::Mean divides the two sums by
/// the token counts (official code; then J = 0 is no longer the KKT condition). Double sums;
/// O((n + m + p) s). \throws effattn::invalid_argument on mismatched shapes or lambda <= 0.
template <typename Scalar>
double ksvd_loss(const Matrix<Scalar>& E, const Matrix<Scalar>& R, const Vector<Scalar>& lambda,
                 const Matrix<Scalar>& We, const Matrix<Scalar>& Wr,
                 Reduction reduction = Reduction::Sum);

/// ELBO of eq. 20: expected log-likelihood minus kl_weight times the total KL.
inline double elbo(double expected_loglik, double kl_total, double kl_weight = 1.0) {
  return expected_loglik - kl_weight * kl_total;
}

/// Normalised cumulative spectrum (App. D.6): c_k = sum_{m <= k} sigma_m^p / sum_m sigma_m^p over
/// the values sorted non-increasingly (p = 1 or 2). \throws invalid_argument on negative,
/// non-finite or all-zero input.
template <typename Scalar>
Vector<Scalar> normalized_cumulative_spectrum(const Vector<Scalar>& sigma, Power p = Power::One);

/// lambda from the official code's parameterisation Lambda^-1/2 = exp(theta): lambda =
/// exp(-2 theta).
template <typename Scalar>
Vector<Scalar> from_log_inv_sqrt(const Vector<Scalar>& theta) {
  return (Scalar(-2) * theta.array()).exp().matrix();
}

}  // namespace kepsvgp

namespace kepsvgp {

template <typename Scalar>
double kl_divergence(const Vector<Scalar>& lambda, const VariationalParams<Scalar>& vp) {
  using detail::cat;
  const Index s = lambda.size();
  EFFATTN_CHECK(s >= 1 && vp.m_u.rows() == s && static_cast<Index>(vp.L_u.size()) == vp.m_u.cols(),
                cat("kl_divergence: need lambda (s), m_u (s x dv) and dv factors; got s = ", s,
                    ", m_u ", detail::shape(vp.m_u), ", ", vp.L_u.size(), " factors"));
  const Eigen::VectorXd lam = lambda.template cast<double>();
  EFFATTN_CHECK((lam.array() > 0).all() && lam.allFinite(),
                "kl_divergence: lambda must be finite and > 0");
  const Eigen::VectorXd il = lam.cwiseInverse();
  const double logdet_p = 2.0 * lam.array().log().sum();
  double kl = 0;
  for (Index c = 0; c < vp.m_u.cols(); ++c) {
    const Matrix<double> L = vp.L_u[static_cast<std::size_t>(c)].template cast<double>();
    EFFATTN_CHECK(L.rows() == s && L.cols() == s,
                  cat("kl_divergence: L_u factors must be s x s; got ", detail::shape(L)));
    EFFATTN_CHECK((L.diagonal().array() > 0).all() && L.allFinite(),
                  "kl_divergence: L_u factors need a finite, positive diagonal");
    EFFATTN_CHECK(L.template triangularView<Eigen::StrictlyUpper>().toDenseMatrix().isZero(0),
                  "kl_divergence: L_u factors must be lower triangular");
    const double tr = (il.asDiagonal() * L).squaredNorm();
    const double quad = il.cwiseProduct(vp.m_u.col(c).template cast<double>()).squaredNorm();
    const double logdet_s = 2.0 * L.diagonal().array().log().sum();
    kl += 0.5 * (tr + quad + logdet_p - logdet_s - static_cast<double>(s));
  }
  return kl;
}

template <typename Scalar>
double ksvd_loss(const Matrix<Scalar>& E, const Matrix<Scalar>& R, const Vector<Scalar>& lambda,
                 const Matrix<Scalar>& We, const Matrix<Scalar>& Wr, Reduction reduction) {
  using detail::cat;
  const Index s = lambda.size();
  EFFATTN_CHECK(E.cols() == s && R.cols() == s && We.cols() == s && Wr.cols() == s &&
                    We.rows() == Wr.rows() && E.rows() > 0 && R.rows() > 0,
                cat("ksvd_loss: need E (n x s), R (m x s), lambda (s), W_e, W_r (p x s); got E ",
                    detail::shape(E), ", R ", detail::shape(R), ", s = ", s, ", W_e ",
                    detail::shape(We), ", W_r ", detail::shape(Wr)));
  EFFATTN_CHECK((lambda.array() > Scalar(0)).all(), "ksvd_loss: lambda must be > 0");
  const Eigen::VectorXd il = lambda.template cast<double>().cwiseInverse();
  const Matrix<double> Ed = E.template cast<double>(), Rd = R.template cast<double>();
  double se = (Ed.array().square().matrix() * il).sum();
  double sr = (Rd.array().square().matrix() * il).sum();
  if (reduction == Reduction::Mean) {
    se /= static_cast<double>(E.rows());
    sr /= static_cast<double>(R.rows());
  }
  const double tr = (We.template cast<double>().array() * Wr.template cast<double>().array()).sum();
  const double J = -0.5 * se - 0.5 * sr + tr;
  return J * J;
}

template <typename Scalar>
Vector<Scalar> normalized_cumulative_spectrum(const Vector<Scalar>& sigma, Power p) {
  EFFATTN_CHECK(sigma.size() > 0 && sigma.allFinite() && (sigma.array() >= Scalar(0)).all() &&
                    sigma.maxCoeff() > Scalar(0),
                "normalized_cumulative_spectrum: need finite, non-negative, not all-zero values");
  std::vector<double> v(static_cast<std::size_t>(sigma.size()));
  for (Index i = 0; i < sigma.size(); ++i) {
    const double x = static_cast<double>(sigma(i));
    v[static_cast<std::size_t>(i)] = p == Power::Two ? x * x : x;
  }
  std::sort(v.begin(), v.end(), [](double a, double b) { return a > b; });
  double total = 0;
  for (double x : v) total += x;
  Vector<Scalar> c(sigma.size());
  double acc = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    acc += v[i];
    c(static_cast<Index>(i)) = static_cast<Scalar>(acc / total);
  }
  return c;
}

}  // namespace kepsvgp
}  // namespace effattn
