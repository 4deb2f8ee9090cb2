/// \file kep_svgp_training.hpp
/// \brief KEP-SVGP's trainer utilities (eq. 11, 20, 21): `kep_svgp::kl_divergence`, `ksvd_loss`,
/// `elbo`, `normalized_cumulative_spectrum` and `from_log_inv_sqrt`; and the paper's learned
/// layer, `kep_svgp::learned_layer` (primal projections, learned Lambda and q(u)), the forward of
/// a KEP-SVGP layer a trainer has fitted. `<effattn/kep_svgp.hpp>` includes this header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/types.hpp"
#include "kep_svgp.hpp"

namespace effattn {

namespace kep_svgp {

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

/// Parameters of one head of KEP-SVGP's learned layer (the paper's trained form, eq. 10 and
/// 16-19): primal projections, learned singular values and the variational distribution q(u).
template <typename Scalar>
struct LearnedLayer {
  Matrix<Scalar> W_e;            ///< d x s primal projection of the queries
  Matrix<Scalar> W_r;            ///< d x s primal projection of the keys
  Vector<Scalar> lambda;         ///< s learned singular values, finite and > 0
  VariationalParams<Scalar> vp;  ///< m_u (s x dv) and dv lower-triangular s x s factors L_c
};

/// Merge of `learned_layer`: the e-branch alone, or the sum of both branches (eq. 19, addition,
/// the paper's choice for text; self-attention, n = m).
enum class LearnedMerge { EOnly, Addition };

/// Result of `learned_layer`.
template <typename Scalar>
struct LearnedPosterior {
  Matrix<Scalar> mean;      ///< n x dv posterior mean F Lambda^-1 m_u
  Matrix<Scalar> variance;  ///< n x dv posterior variance ||L_c^T Lambda^-1 F_i^T||^2, >= 0
  Matrix<Scalar> E;         ///< n x s, E = phi(Q) W_e (for `ksvd_loss`)
  Matrix<Scalar> R;         ///< m x s, R = phi(K) W_r (for `ksvd_loss`)
};

/// KEP-SVGP's learned layer, one head: with the cosine feature map phi(x) = x / max(||x||, 1e-12)
/// (App. D.1; what the paper's experiments use), E = phi(Q) W_e, R = phi(K) W_r, F = E + R
/// (Addition) or E (EOnly) and G = F Lambda^-1, the posterior of value column c is (eq. 16-18,
/// covariance order of App. B.2, Remark 3.1's approximate covariance)
/// \f[ \mu_{i,c} = G_{i,:} m_c, \qquad \mathrm{var}_{i,c} = \|L_c^\top G_{i,:}^\top\|^2 . \f]
/// Unlike `KepSvgpAttention` nothing is decomposed: the singular pairs are the learned W_e, W_r
/// and lambda (the KSVD relations are only encouraged in training, by `ksvd_loss`), and the
/// values do not enter (the paper's layer has none; its output projection W_add, s -> head
/// dimension, is the caller's). O((n + m) d s + n s^2 dv) time, O((n + m) s + n dv) memory.
/// Marginal sampling (the official code's): mean + sqrt(variance) .* z, z ~ N(0, 1) per entry.
/// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, lambda <= 0 or
///         Addition with n != m.
template <typename Scalar>
LearnedPosterior<Scalar> learned_layer(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                                       const LearnedLayer<Scalar>& layer,
                                       LearnedMerge merge = LearnedMerge::Addition);

/// lambda from the official code's parameterisation Lambda^-1/2 = exp(theta): lambda =
/// exp(-2 theta).
template <typename Scalar>
Vector<Scalar> from_log_inv_sqrt(const Vector<Scalar>& theta) {
  return (Scalar(-2) * theta.array()).exp().matrix();
}

}  // namespace kep_svgp

namespace kep_svgp {

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
LearnedPosterior<Scalar> learned_layer(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                                       const LearnedLayer<Scalar>& layer, LearnedMerge merge) {
  using detail::cat;
  using detail::shape;
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), s = layer.lambda.size();
  const Index dv = layer.vp.m_u.cols();
  EFFATTN_CHECK(n > 0 && m > 0 && d > 0 && K.cols() == d,
                cat("learned_layer: need Q (n x d), K (m x d), n, m, d > 0; got Q ", shape(Q),
                    ", K ", shape(K)));
  EFFATTN_CHECK(s > 0 && layer.W_e.rows() == d && layer.W_e.cols() == s && layer.W_r.rows() == d &&
                    layer.W_r.cols() == s && layer.vp.m_u.rows() == s && dv > 0 &&
                    static_cast<Index>(layer.vp.L_u.size()) == dv,
                cat("learned_layer: need W_e, W_r (d x s), lambda (s), m_u (s x dv) and dv factors "
                    "with d = ",
                    d, "; got W_e ", shape(layer.W_e), ", W_r ", shape(layer.W_r), ", s = ", s,
                    ", m_u ", shape(layer.vp.m_u), ", ", layer.vp.L_u.size(), " factors"));
  EFFATTN_CHECK(merge != LearnedMerge::Addition || n == m,
                cat("learned_layer: the Addition merge needs n = m (self-attention); got n = ", n,
                    ", m = ", m));
  EFFATTN_CHECK(layer.lambda.allFinite() && (layer.lambda.array() > Scalar(0)).all(),
                "learned_layer: lambda must be finite and > 0");
  for (const auto& L : layer.vp.L_u)
    EFFATTN_CHECK(L.rows() == s && L.cols() == s && L.allFinite(),
                  cat("learned_layer: the factors L_c must be finite s x s; got ", shape(L)));
  EFFATTN_CHECK(Q.allFinite() && K.allFinite() && layer.W_e.allFinite() && layer.W_r.allFinite() &&
                    layer.vp.m_u.allFinite(),
                "learned_layer: inputs must be finite");
  LearnedPosterior<Scalar> out;
  out.E.noalias() = detail::kep_l2_normalize<Scalar>(Q) * layer.W_e;
  out.R.noalias() = detail::kep_l2_normalize<Scalar>(K) * layer.W_r;
  Matrix<Scalar> G = merge == LearnedMerge::Addition ? Matrix<Scalar>(out.E + out.R) : out.E;
  G = G * layer.lambda.cwiseInverse().asDiagonal();
  out.mean.noalias() = G * layer.vp.m_u;
  out.variance.resize(n, dv);
  Matrix<Scalar> GL(n, s);
  for (Index c = 0; c < dv; ++c) {
    GL.noalias() = G * layer.vp.L_u[static_cast<std::size_t>(c)];
    out.variance.col(c) = GL.rowwise().squaredNorm();
  }
  return out;
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

}  // namespace kep_svgp
}  // namespace effattn
