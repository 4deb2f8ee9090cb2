/// \file kep_svgp_impl.hpp
/// \brief Implementation of effattn/kep_svgp.hpp: the posterior assembly and sampling of
/// KepSvgpAttention. Kernel evaluation in row blocks is in `kep_svgp_kernels.hpp`, the three
/// truncated-KSVD engines (dense oracle, randomized range finder, factorised QR-QR-SVD) in
/// `kep_svgp_ksvd.hpp`; the trainer utilities are in <effattn/kep_svgp_training.hpp>.
#pragma once

#include "../../kep_svgp.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/gemm.hpp"
#include "../../core/parallel.hpp"
#include "../../core/random.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "kep_svgp_kernels.hpp"
#include "kep_svgp_ksvd.hpp"

namespace effattn {
namespace detail {

/// var(:, c) += row norms^2 of F Lambda^-1 L_c (leading r x r block of L_c, lower part).
template <typename Scalar>
void kep_add_vp_variance(const Matrix<Scalar>& F, const Vector<Scalar>& inv,
                         const kep_svgp::VariationalParams<Scalar>& vp, Matrix<Scalar>& var) {
  const Index r = inv.size();
  const Matrix<Scalar> G = F * inv.asDiagonal();
  for (Index j = 0; j < var.cols(); ++j) {
    const Matrix<Scalar> L = vp.L_u[static_cast<std::size_t>(j)]
                                 .topLeftCorner(r, r)
                                 .template triangularView<Eigen::Lower>();
    const Matrix<Scalar> T = matmul(G, L);
    var.col(j).head(G.rows()) +=
        T.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
  }
}

/// [top; bottom] (rows stacked).
template <typename Scalar>
Matrix<Scalar> kep_stack(const Matrix<Scalar>& top, const Matrix<Scalar>& bottom) {
  Matrix<Scalar> out(top.rows() + bottom.rows(), top.cols());
  out << top, bottom;
  return out;
}

}  // namespace detail

// ---- KepSvgpResult ------------------------------------------------------------------------------

template <typename Scalar>
Diagnostics KepSvgpResult<Scalar>::diagnostics() const {
  const Vector<Scalar>& lam = ksvd.lambda;
  const bool has_var = variance.size() > 0;
  return {{"rank_used", static_cast<double>(rank_used)},
          {"sketch", static_cast<double>(ksvd.sketch)},
          {"kernel_shift", kernel_shift},
          {"lambda_max", lam.size() > 0 ? static_cast<double>(lam(0)) : 0.0},
          {"lambda_min", lam.size() > 0 ? static_cast<double>(lam(lam.size() - 1)) : 0.0},
          {"mean_variance", has_var ? variance.template cast<double>().mean() : 0.0},
          {"max_variance", has_var ? static_cast<double>(variance.maxCoeff()) : 0.0}};
}

// ---- KepSvgpAttention ---------------------------------------------------------------------------

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::KepSvgpAttention(Options opts)
    : m_opts(std::move(opts)) {
  using detail::cat;
  using detail::is_one_of;
  detail::check_scale_option(m_opts.scale, name);
  EFFATTN_CHECK(m_opts.rank >= 1, cat(name, ": Options::rank (s) must be >= 1; got ", m_opts.rank));
  EFFATTN_CHECK(m_opts.oversample >= 0,
                cat(name, ": Options::oversample must be >= 0; got ", m_opts.oversample));
  EFFATTN_CHECK(m_opts.power_iters >= 0,
                cat(name, ": Options::power_iters must be >= 0; got ", m_opts.power_iters));
  EFFATTN_CHECK(std::isfinite(m_opts.rank_rtol) && m_opts.rank_rtol >= 0 && m_opts.rank_rtol < 1,
                cat(name, ": Options::rank_rtol must be in [0, 1); got ", m_opts.rank_rtol));
  EFFATTN_CHECK(m_opts.block_rows >= 0,
                cat(name, ": Options::block_rows must be >= 0; got ", m_opts.block_rows));
  EFFATTN_CHECK(
      is_one_of(m_opts.cov, {kep_svgp::CovMode::Full, kep_svgp::CovMode::Approx}) &&
          is_one_of(m_opts.prior,
                    {kep_svgp::PriorScale::Auto, kep_svgp::PriorScale::ValueSecondMoment,
                     kep_svgp::PriorScale::Unit}) &&
          is_one_of(m_opts.rbranch, {kep_svgp::RBranch::Shared, kep_svgp::RBranch::Transpose}),
      cat(name, ": Options::cov, prior or rbranch is not a valid enumerator"));
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::Result
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::compute(const Ref& Q, const Ref& K,
                                                       const Ref& V) const {
  return run(Q, K, V, nullptr);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::Result
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::compute(const Ref& Q, const Ref& K, const Ref& V,
                                                       const VariationalParams& vp) const {
  return run(Q, K, V, &vp);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::Result
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::run(const Ref& Q, const Ref& K, const Ref& V,
                                                   const VariationalParams* vp) const {
  using detail::cat;
  detail::check_attention_inputs(Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), dv = V.cols();
  const Index want = std::min(m_opts.rank, std::min(n, m));
  const bool transpose = !kEOnly && m_opts.rbranch == kep_svgp::RBranch::Transpose;
  EFFATTN_CHECK(!(kAdd || transpose) || n == m,
                cat(name, ": Addition merge and RBranch::Transpose need n = m; got Q ",
                    detail::shape(Q), ", K ", detail::shape(K)));
  if (vp) check_vp(*vp, want, dv);

  Result res;
  detail::KepKernelCtx<Scalar, Kernel::has_features> c;
  detail::kep_prepare<Kernel>(c, Q, K, m_opts);
  res.kernel_shift = static_cast<double>(c.shift);
  kep_svgp::KsvdResult<Scalar>& ks = res.ksvd;
  const double rtol =
      m_opts.rank_rtol > 0 ? m_opts.rank_rtol : (std::is_same_v<Scalar, float> ? 1e-6 : 1e-12);
  if constexpr (std::is_same_v<Svd, policy::DenseSvd>) {
    detail::kep_svd_dense(c, want, rtol, ks);
  } else if constexpr (std::is_same_v<Svd, policy::FactorizedSvd>) {
    detail::kep_svd_factorized(c, want, rtol, ks);
  }
  // Posterior assembly; serial Eigen products (thread-count independent rounding). Everything
  // after the last kernel pass runs in ONE serial region: on a loaded machine every region
  // waits for the whole team to wake up (measured several ms per region at load 4 on 2 cores).
  const auto finish = [&] {
    const Index r = ks.lambda.size();
    ks.rank_used = r;
    res.rank_used = r;
    assemble(res, V, vp, transpose);
  };
  if constexpr (std::is_same_v<Svd, policy::RandomizedSvd>) {
    MatrixType Z, C;
    Eigen::VectorXd rsq;
    detail::kep_randomized_range(c, want, m_opts.oversample, m_opts.power_iters, m_opts.seed, Z, C,
                                 rsq);
    if constexpr (kEOnly) {
      detail::run_serial([&] {
        detail::kep_randomized_finish(Z, C, rsq, want, rtol, ks);
        finish();
      });
    } else {
      detail::run_serial([&] { detail::kep_randomized_finish(Z, C, rsq, want, rtol, ks); });
      detail::kep_randomized_r(c, ks);
      detail::run_serial(finish);
    }
  } else {
    detail::run_serial(finish);
  }
  bool finite = detail::all_finite(res.output) && detail::all_finite(res.variance);
  if constexpr (kConcat)
    finite = finite && detail::all_finite(res.output_keys) && detail::all_finite(res.variance_keys);
  res.info = finite ? Info::Success : Info::NumericalIssue;
  return res;
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
void KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::assemble(Result& res, const Ref& V,
                                                             const VariationalParams* vp,
                                                             bool transpose) const {
  const auto& ks = res.ksvd;
  const Index r = ks.rank_used, n = ks.E.rows(), m = ks.Hr.rows(), dv = V.cols();
  // Prior scales sigma_c^2.
  const kep_svgp::PriorScale ps =
      m_opts.prior == kep_svgp::PriorScale::Auto
          ? (vp ? kep_svgp::PriorScale::Unit : kep_svgp::PriorScale::ValueSecondMoment)
          : m_opts.prior;
  res.prior_variance.resize(dv);
  for (Index j = 0; j < dv; ++j)
    res.prior_variance(j) =
        ps == kep_svgp::PriorScale::Unit
            ? Scalar(1)
            : static_cast<Scalar>(V.col(j).template cast<double>().squaredNorm() /
                                  static_cast<double>(m));
  const bool full = m_opts.cov == kep_svgp::CovMode::Full;
  const Vector<Scalar> inv = ks.lambda.cwiseInverse();

  // Coefficients in the H basis: mean = E Lambda^-1 m_u = E coef.
  MatrixType coef_e(r, dv);
  if (vp)
    coef_e = inv.asDiagonal() * vp->m_u.topRows(r);
  else  // Lambda^-1 (Lambda H_r^T V)
    detail::gemm<detail::Op::T>(detail::Update::Assign, coef_e, ks.Hr, V);
  MatrixType mean_e = MatrixType::Zero(n, dv), var_e = MatrixType::Zero(n, dv);
  if (r > 0) detail::gemm(detail::Update::Assign, mean_e, ks.E, coef_e);
  if (full) var_e = ks.res_row * res.prior_variance.transpose();
  if constexpr (kEOnly) {
    if (vp && r > 0) detail::kep_add_vp_variance(ks.E, inv, *vp, var_e);
    res.output = std::move(mean_e);
    res.variance = std::move(var_e);
  } else {
    const MatrixType coef_r = transpose && !vp ? detail::matmul<detail::Op::T>(ks.He, V) : coef_e;
    MatrixType mean_r = MatrixType::Zero(m, dv), var_r = MatrixType::Zero(m, dv);
    if (r > 0) detail::gemm(detail::Update::Assign, mean_r, ks.R, coef_r);
    if (full) var_r = ks.res_col * res.prior_variance.transpose();
    if constexpr (kAdd) {
      res.output = mean_e + mean_r;
      res.variance = var_e + var_r;
      if (vp && r > 0) detail::kep_add_vp_variance(MatrixType(ks.E + ks.R), inv, *vp, res.variance);
    } else {
      if (vp && r > 0) {
        detail::kep_add_vp_variance(ks.E, inv, *vp, var_e);
        detail::kep_add_vp_variance(ks.R, inv, *vp, var_r);
      }
      res.output = std::move(mean_e);
      res.variance = std::move(var_e);
      res.output_keys = std::move(mean_r);
      res.variance_keys = std::move(var_r);
    }
  }
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kep_svgp::SampleMode mode, Rng& rng) const {
  return draw(Q, K, res, mode, rng, nullptr);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kep_svgp::SampleMode mode, Rng& rng,
                                                      const VariationalParams& vp) const {
  return draw(Q, K, res, mode, rng, &vp);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kep_svgp::SampleMode mode,
                                                      std::uint64_t seed) const {
  Rng rng = make_rng(seed, 2);
  return draw(Q, K, res, mode, rng, nullptr);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kep_svgp::SampleMode mode, std::uint64_t seed,
                                                      const VariationalParams& vp) const {
  Rng rng = make_rng(seed, 2);
  return draw(Q, K, res, mode, rng, &vp);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::draw(const Ref& Q, const Ref& K, const Result& res,
                                                    kep_svgp::SampleMode mode, Rng& rng,
                                                    const VariationalParams* vp) const {
  using detail::cat;
  const auto& ks = res.ksvd;
  const Index r = ks.rank_used, dv = res.output.cols();
  EFFATTN_CHECK(res.info == Info::Success && res.variance.rows() == res.output.rows() &&
                    res.variance.cols() == dv,
                cat(name, ": sample needs a successful Result of compute"));
  if constexpr (kConcat)
    EFFATTN_CHECK(res.output_keys.cols() == dv &&
                      res.variance_keys.rows() == res.output_keys.rows() &&
                      res.variance_keys.cols() == dv,
                  cat(name, ": sample needs a successful Result of compute"));
  // The draw covers every output of the Result: [output; output_keys] for Concatenation.
  const auto mean = [&] {
    if constexpr (kConcat)
      return detail::kep_stack(res.output, res.output_keys);
    else
      return res.output;
  };
  if (mode == kep_svgp::SampleMode::Marginal) {
    MatrixType out = mean();
    MatrixType z(out.rows(), dv);
    fill_normal(z, rng);
    if constexpr (kConcat)
      return out + (detail::kep_stack(res.variance, res.variance_keys).array().sqrt() * z.array())
                       .matrix();
    else
      return out + (res.variance.array().sqrt() * z.array()).matrix();
  }
  EFFATTN_CHECK(Q.rows() == ks.E.rows() && K.rows() == ks.Hr.rows() && Q.cols() == K.cols(),
                cat(name, ": sample needs the Q and K of compute; got Q ", detail::shape(Q), ", K ",
                    detail::shape(K)));
  if (vp) check_vp(*vp, vp->m_u.rows(), dv);
  const bool full = m_opts.cov == kep_svgp::CovMode::Full;
  EFFATTN_CHECK(kEOnly || !full, cat(name,
                                     ": a Joint sample of the Addition / Concatenation merges "
                                     "is implemented for CovMode::Approx only"));
  MatrixType out = mean();
  const Vector<Scalar> inv = ks.lambda.cwiseInverse();
  if (vp && r > 0)
    detail::run_serial([&] {
      MatrixType F;
      if constexpr (kAdd)
        F = ks.E + ks.R;
      else
        F = ks.E;
      Vector<Scalar> eps(r);
      for (Index j = 0; j < dv; ++j) {
        fill_normal(eps, rng);
        const auto L = vp->L_u[static_cast<std::size_t>(j)].topLeftCorner(r, r);
        const Vector<Scalar> u =
            inv.asDiagonal() * (L.template triangularView<Eigen::Lower>() * eps);
        out.col(j).head(F.rows()).noalias() += F * u;
        if constexpr (kConcat) out.col(j).tail(ks.R.rows()).noalias() += ks.R * u;
      }
    });
  if constexpr (kEOnly) {
    if (full) {
      detail::KepKernelCtx<Scalar, Kernel::has_features> c;
      detail::kep_prepare<Kernel>(c, Q, K, m_opts);
      MatrixType Xi(K.rows(), dv);
      fill_normal(Xi, rng);
      MatrixType resid = detail::kep_apply(c, Xi);
      detail::run_serial([&] {
        if (r > 0)
          detail::gemm(detail::Update::Sub, resid, ks.E, detail::matmul<detail::Op::T>(ks.Hr, Xi));
        out += resid * res.prior_variance.cwiseSqrt().asDiagonal();
      });
    }
  }
  return out;
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
void KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::check_vp(const VariationalParams& vp, Index s,
                                                             Index dv) {
  using detail::cat;
  EFFATTN_CHECK(vp.m_u.rows() == s && vp.m_u.cols() == dv,
                cat(name, ": vp.m_u must be s x dv = ", s, " x ", dv,
                    " (s = min(rank, n, m)); got ", detail::shape(vp.m_u)));
  EFFATTN_CHECK(static_cast<Index>(vp.L_u.size()) == dv,
                cat(name, ": vp.L_u must hold dv = ", dv, " factors; got ", vp.L_u.size()));
  detail::check_finite(vp.m_u, "vp.m_u");
  for (const MatrixType& L : vp.L_u) {
    EFFATTN_CHECK(L.rows() == s && L.cols() == s,
                  cat(name, ": every vp.L_u factor must be s x s = ", s, " x ", s, "; got ",
                      detail::shape(L)));
    detail::check_finite(L, "vp.L_u");
  }
}

}  // namespace effattn
