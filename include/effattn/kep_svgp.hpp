/// \file kep_svgp.hpp
/// \brief KEP-SVGP: attention as a pair of sparse variational GPs on the kernel-eigen pairs of
/// the asymmetric attention kernel (Chen, Tao, Tonin, Suykens, "Self-Attention through
/// Kernel-Eigen Pair Sparse Variational Gaussian Processes", ICML 2024, arXiv 2402.01476), in the
/// training-free form of the library spec (shared/specs/kepsvgp.md, section 3.2), plus the
/// KL / KSVD-loss / ELBO utilities a trainer needs (eq. 11, 20, 21).
///
/// \par What is training-free and what is not (spec 3.1)
/// The paper's layer is trained: W_q, W_k, the primal projections W_e, W_r, the diagonal Lambda,
/// the variational parameters (m_u, S_u), the merge weights and the output projection are all
/// learned with an ELBO plus eta * L_KSVD, and no number of the paper's tables can be reproduced
/// without that training. What IS computable from (Q, K, V) alone, and what this header does:
/// the truncated KSVD K ~ H_e Lambda H_r^T of a given asymmetric kernel (so Lambda are true
/// singular values, not learned), the dual projections E_X = K H_r, R_X = K^T H_e (eq. 10), and
/// the exact GP posterior of the e-branch prior (f = K w, w ~ N(0, sigma^2 I)) conditioned on the
/// eigen-features u = H_e^T f of the observed values: mean K H_r H_r^T V (= K_s V, rank-s
/// attention) and per-token variance sigma_c^2 ||(K - K_s)_i||^2 (the expected squared
/// truncation error of that token under white-noise values). Learned (m_u, L_u) can be passed
/// in and are then used as in eq. 16 (covariance E Lambda^-1 S Lambda^-1 E^T, spec 7.1).
///
/// \par Complexity (spec 7.11)
/// The paper's O(N s^2) assumes learned primal projections. An exact KSVD of a softmax kernel
/// must apply the kernel: `Randomized` costs (q + 2) streamed kernel passes, O(q n m (d + s))
/// time and O((n + m) s + block m) memory (the n x m kernel is never stored); `Dense` is
/// O(n m min(n, m)) and stores K. Only explicit-feature kernels (cosine, linear, positive random
/// features; p features) are linear in n with `Factorized`: O((n + m) p^2 + p^3).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/parallel.hpp"
#include "core/random.hpp"
#include "core/softmax.hpp"
#include "core/types.hpp"

namespace effattn {
namespace kepsvgp {

/// Posterior covariance: Full keeps the truncation residual K K^T - H_e Lambda^2 H_e^T (needed
/// for any training-free variance), Approx drops it (the paper's Remark 3.1).
enum class CovMode { Full, Approx };
/// Prior scale sigma_c^2 of value column c. Auto = ValueSecondMoment without variational
/// parameters, Unit with them (the paper's prior N(0, Lambda^2) that `kl_divergence` assumes).
enum class PriorScale { Auto, ValueSecondMoment, Unit };
/// r-branch mean: Shared = R Lambda^-1 m_u with the e-branch's m_u (paper, eq. 17);
/// Transpose = the transpose model g = K^T w, mean R H_e^T V (needs n = m).
enum class RBranch { Shared, Transpose };
/// Joint: one eps in R^s per value column shared by all tokens (a draw from the joint
/// posterior); Marginal: independent per token (the official code's sampling).
enum class SampleMode { Joint, Marginal };
/// Reduction of `ksvd_loss`: Sum (paper, eq. 11) or Mean over tokens (official code).
enum class Reduction { Sum, Mean };
/// Exponent of `normalized_cumulative_spectrum`.
enum class Power { One, Two };

/// Result of a truncated KSVD K ~ H_e diag(lambda) H_r^T (rank r = rank_used).
template <typename Scalar>
struct KsvdResult {
  Matrix<Scalar> He;        ///< n x r left singular vectors (orthonormal columns)
  Matrix<Scalar> Hr;        ///< m x r right singular vectors (orthonormal columns)
  Matrix<Scalar> E;         ///< n x r, E_X = K H_r (exact product, eq. 10)
  Matrix<Scalar> R;         ///< m x r, R_X = K^T H_e (Randomized + EOnly: empty, not computed)
  Vector<Scalar> lambda;    ///< r singular values, non-increasing, > rank_rtol * lambda_1
  Vector<Scalar> spectrum;  ///< every singular value the engine computed (sketch size)
  Vector<Scalar> res_row;   ///< n values ||(K - K H_r H_r^T)_i||^2
  Vector<Scalar> res_col;   ///< m values ||(K - H_e H_e^T K)_{:,j}||^2 (empty when R is)
  Index rank_used = 0;      ///< r
  Index sketch = 0;         ///< columns of the sketch (Randomized: min(s + p, n, m))
};

/// User-supplied variational parameters of q(u) = N(m_u, S_c), S_c = L_c L_c^T.
template <typename Scalar>
struct VariationalParams {
  Matrix<Scalar> m_u;               ///< s x dv means (column c = m_u[c])
  std::vector<Matrix<Scalar>> L_u;  ///< dv lower-triangular s x s factors, positive diagonal
};

}  // namespace kepsvgp

/// Options of `KepSvgpAttention`.
struct KepSvgpOptions {
  /// Logit scale of the softmax / exp / random-feature kernels: logit = scale * <q, k>;
  /// 0 means 1/sqrt(d). Cosine and linear kernels: see their documentation.
  double scale = 0;
  /// s, the KSVD rank (number of kernel-eigen pairs). Clamped to min(n, m); the rank actually
  /// used (also after dropping singular values <= rank_rtol * lambda_1) is `Result::rank_used`.
  Index rank = 10;
  /// Randomized: oversampling p (sketch size min(s + p, n, m)).
  Index oversample = 10;
  /// Randomized: power iterations q (q + 1 passes of K^T K, each re-orthonormalised).
  int power_iters = 2;
  /// Relative cut-off of the singular values; 0 = 1e-12 (double) / 1e-6 (float).
  double rank_rtol = 0;
  /// Full (default; training-free variance) or Approx (Remark 3.1).
  kepsvgp::CovMode cov = kepsvgp::CovMode::Full;
  /// Prior scale sigma_c^2 per value column.
  kepsvgp::PriorScale prior = kepsvgp::PriorScale::Auto;
  /// r-branch semantics (Addition / Concatenation merges).
  kepsvgp::RBranch rbranch = kepsvgp::RBranch::Shared;
  /// Kernel rows per streamed block; 0 = automatic (about 2M entries, 32..256 rows).
  Index block_rows = 0;
  /// Seed of the randomized sketch and of the random features.
  std::uint64_t seed = 0x6b6570ULL;
};

}  // namespace effattn

#define EFFATTN_KEP_SVGP_INTERNAL
#include "detail/kep_svgp_impl.hpp"
#undef EFFATTN_KEP_SVGP_INTERNAL

namespace effattn {
namespace kepsvgp {

/// \ingroup Policies
/// Row-softmax kernel of eq. 8, K = rowsoftmax(scale Q K^T): row-stochastic, lambda_1 >= 1.
/// Evaluated in row blocks with max subtraction; never stored by `Randomized`.
struct SoftmaxRowKernel {
  static constexpr bool has_features = false;  ///< no explicit feature map
  template <typename Scalar>
  static void prepare(detail::KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                      const ConstRef<Scalar>& K, double scale, std::uint64_t /*seed*/) {
    detail::kep_prepare_dense(c, Q, K, scale, true);
  }
};

/// \ingroup Policies
/// Unnormalised exponential kernel K = exp(scale Q K^T - c), c = the largest logit (a global
/// constant, `Result::kernel_shift`, so nothing overflows; it scales K and lambda by e^-c).
/// Symmetric positive definite when Q = K.
struct ExpKernel {
  static constexpr bool has_features = false;  ///< no explicit feature map
  template <typename Scalar>
  static void prepare(detail::KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                      const ConstRef<Scalar>& K, double scale, std::uint64_t /*seed*/) {
    detail::kep_prepare_dense(c, Q, K, scale, false);
  }
};

/// \ingroup Policies
/// The paper's experimental kernel (App. D.1, official code): K = Qhat Khat^T with
/// phi(x) = x / max(||x||, 1e-12) (zero rows stay zero). Entries in [-1, 1], rank <= d, not
/// row-normalised; `scale` is not used.
struct CosineKernel {
  static constexpr bool has_features = true;  ///< K = A B^T with p = d features
  template <typename Scalar>
  static void prepare(detail::KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                      const ConstRef<Scalar>& K, double /*scale*/, std::uint64_t /*seed*/) {
    c.n = Q.rows();
    c.m = K.rows();
    c.features = true;
    c.A = detail::kep_l2_normalize(Q);
    c.B = detail::kep_l2_normalize(K);
  }
};

/// \ingroup Policies
/// Linear kernel K = scale Q K^T (explicit features A = scale Q, B = K).
struct LinearKernel {
  static constexpr bool has_features = true;  ///< K = A B^T with p = d features
  template <typename Scalar>
  static void prepare(detail::KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                      const ConstRef<Scalar>& K, double scale, std::uint64_t /*seed*/) {
    c.n = Q.rows();
    c.m = K.rows();
    c.features = true;
    c.A = Q * static_cast<Scalar>(scale);
    c.B = K;
  }
};

/// \ingroup Policies
/// Positive random features (Performer / FAVOR+, M features drawn from the seed) approximating
/// the softmax kernel, row-normalised: A = diag(Phi_q Phi_k^T 1)^-1 Phi_q, B = Phi_k.
template <Index M = 256>
struct PositiveRandomFeatureKernel {
  static_assert(M >= 1, "effattn: PositiveRandomFeatureKernel needs M >= 1 features");
  static constexpr bool has_features = true;  ///< K = A B^T with p = M features
  template <typename Scalar>
  static void prepare(detail::KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                      const ConstRef<Scalar>& K, double scale, std::uint64_t seed) {
    detail::kep_prepare_prf(c, Q, K, scale, M, seed);
  }
};

/// \ingroup Policies
/// SVD policy: form K (n x m) and take Eigen's BDCSVD (JacobiSVD up to 16): the oracle,
/// O(n m min(n, m)) time, O(n m) memory.
struct Dense {};
/// \ingroup Policies
/// SVD policy: randomized range finder (Halko, Martinsson, Tropp 2011) on the row space with
/// oversampling p, q power iterations (each a fused K^T K pass, re-orthonormalised by Householder
/// QR) and the kernel applied in row blocks, never stored. Gaussian sketch from the seed.
struct Randomized {};
/// \ingroup Policies
/// SVD policy: exact KSVD of an explicit-feature kernel K = A B^T by thin QR of A and B and the
/// SVD of the p x p core: linear in n.
struct Factorized {};
using DenseSvd = Dense;            ///< spec name
using RandomizedSvd = Randomized;  ///< spec name
using FactorizedSvd = Factorized;  ///< spec name

/// \ingroup Policies
/// Merge: the e-branch only (default; its mean approximates attention K V). Output n x dv.
struct EOnly {};
/// \ingroup Policies
/// Merge: F = F^e + F^r (eq. 19, addition; needs n = m). Output n x dv.
struct Addition {};
/// \ingroup Policies
/// Merge: token-axis concatenation [F^e; F^r] (eq. 19; the learned N x 2N mixer W1^cat is not
/// applied). Output (n + m) x dv.
struct Concatenation {};

}  // namespace kepsvgp

/// Result of `KepSvgpAttention::compute`.
template <typename Scalar>
struct KepSvgpResult : AttentionResult<Scalar> {
  /// Predictive variance of every output entry (same shape as `output`), >= 0.
  Matrix<Scalar> variance;
  /// sigma_c^2 used for every value column (dv).
  Vector<Scalar> prior_variance;
  /// The truncated KSVD.
  kepsvgp::KsvdResult<Scalar> ksvd;
  /// Rank r actually used (= ksvd.rank_used).
  Index rank_used = 0;
  /// ExpKernel: the constant c in K = exp(scale Q K^T - c); 0 otherwise.
  double kernel_shift = 0;
};

/// \ingroup Methods
/// \brief KEP-SVGP attention, training-free (spec 3.2): truncated KSVD of the attention kernel
/// and the e-branch / r-branch GP posteriors, with a per-token, per-column predictive variance.
///
/// With K ~ H_e Lambda H_r^T (rank r), E = K H_r and R = K^T H_e (eq. 10), the e-branch posterior
/// of value column c is (eq. 16 with the covariance order of B.2, spec 7.1)
/// \f[ \mu_c = E \Lambda^{-1} m_c,\qquad
///     \mathrm{var}_{i,c} = \sigma_c^2 \|(K - K H_r H_r^\top)_{i,:}\|^2
///                        + \|L_c^\top \Lambda^{-1} E_{i,:}^\top\|^2 , \f]
/// the first term only in CovMode::Full. Without variational parameters m_c = Lambda H_r^T V_c
/// and L_c = 0 (the observed values fix u exactly), so the mean is K H_r H_r^T V (= K_s V,
/// rank-s attention; exact attention at full rank) and the variance is the truncation residual:
/// >= 0, non-increasing in s, 0 at full rank. sigma_c^2 = mean_j V_jc^2 (PriorScale).
/// r-branch (Addition, Concatenation): mean R Lambda^-1 m_c (Shared) or R H_e^T V (Transpose),
/// residual variance sigma_c^2 ||(K - H_e H_e^T K)_{:,j}||^2. Addition adds the two means; its
/// variance adds the residual terms (treated as independent) to the shared-u term
/// ||L_c^T Lambda^-1 (E + R)_{i,:}^T||^2.
///
/// \tparam Scalar_ float or double.
/// \tparam Kernel kepsvgp::SoftmaxRowKernel (default), ExpKernel, CosineKernel, LinearKernel,
///         PositiveRandomFeatureKernel<M>.
/// \tparam Svd kepsvgp::Randomized (default), Dense, Factorized (explicit-feature kernels only).
/// \tparam Merge kepsvgp::EOnly (default), Addition, Concatenation.
///
/// \par Example
/// \code{.cpp}
/// #include <effattn/kep_svgp.hpp>
/// Eigen::MatrixXd Q = Eigen::MatrixXd::Random(2048, 64), K = Q, V = Q;
/// effattn::KepSvgpAttentiond::Options o;
/// o.rank = 32;
/// auto r = effattn::KepSvgpAttentiond(o).compute(Q, K, V);
/// // r.output: rank-32 attention (2048 x 64); r.variance: its per-entry predictive variance
/// Eigen::MatrixXd draw = effattn::KepSvgpAttentiond(o).sample(
///     Q, K, r, effattn::kepsvgp::SampleMode::Joint, std::uint64_t{7});
/// \endcode
///
/// \par Threading and determinism
/// `compute` is const and keeps no state. Kernel blocks run in parallel (OpenMP) with a fixed
/// decomposition and fixed summation groups, and every other product runs with Eigen's GEMM in
/// serial mode: Randomized and Factorized give bit-identical results for any thread count. Dense
/// (the oracle) lets Eigen parallelise its BDCSVD and is reproducible for a fixed thread count.
template <typename Scalar_, typename Kernel = kepsvgp::SoftmaxRowKernel,
          typename Svd = kepsvgp::Randomized, typename Merge = kepsvgp::EOnly>
class KepSvgpAttention {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same<Svd, kepsvgp::Dense>::value ||
                    std::is_same<Svd, kepsvgp::Randomized>::value ||
                    std::is_same<Svd, kepsvgp::Factorized>::value,
                "effattn: KepSvgpAttention Svd must be kepsvgp::Dense, Randomized or Factorized");
  static_assert(!std::is_same<Svd, kepsvgp::Factorized>::value || Kernel::has_features,
                "effattn: kepsvgp::Factorized needs an explicit-feature kernel (CosineKernel, "
                "LinearKernel, PositiveRandomFeatureKernel)");
  static_assert(std::is_same<Merge, kepsvgp::EOnly>::value ||
                    std::is_same<Merge, kepsvgp::Addition>::value ||
                    std::is_same<Merge, kepsvgp::Concatenation>::value,
                "effattn: KepSvgpAttention Merge must be kepsvgp::EOnly, Addition or "
                "Concatenation");
  static constexpr bool kEOnly = std::is_same<Merge, kepsvgp::EOnly>::value;
  static constexpr bool kAdd = std::is_same<Merge, kepsvgp::Addition>::value;
  static constexpr const char* kName = "KepSvgpAttention";

 public:
  using Scalar = Scalar_;
  using Options = KepSvgpOptions;
  using MatrixType = Matrix<Scalar>;
  using Ref = ConstRef<Scalar>;
  using Result = KepSvgpResult<Scalar>;
  using VariationalParams = kepsvgp::VariationalParams<Scalar>;

  /// \throws effattn::invalid_argument on rank < 1, oversample < 0, power_iters < 0, a bad
  ///         scale, rank_rtol outside [0, 1), block_rows < 0 or an invalid enumerator.
  explicit KepSvgpAttention(Options opts = {}) : m_opts(std::move(opts)) {
    using detail::cat;
    detail::check_scale_option(m_opts.scale, kName);
    EFFATTN_CHECK(m_opts.rank >= 1,
                  cat(kName, ": Options::rank (s) must be >= 1; got ", m_opts.rank));
    EFFATTN_CHECK(m_opts.oversample >= 0,
                  cat(kName, ": Options::oversample must be >= 0; got ", m_opts.oversample));
    EFFATTN_CHECK(m_opts.power_iters >= 0,
                  cat(kName, ": Options::power_iters must be >= 0; got ", m_opts.power_iters));
    EFFATTN_CHECK(std::isfinite(m_opts.rank_rtol) && m_opts.rank_rtol >= 0 && m_opts.rank_rtol < 1,
                  cat(kName, ": Options::rank_rtol must be in [0, 1); got ", m_opts.rank_rtol));
    EFFATTN_CHECK(m_opts.block_rows >= 0,
                  cat(kName, ": Options::block_rows must be >= 0; got ", m_opts.block_rows));
    EFFATTN_CHECK(static_cast<unsigned>(m_opts.cov) <= 1U &&
                      static_cast<unsigned>(m_opts.prior) <= 2U &&
                      static_cast<unsigned>(m_opts.rbranch) <= 1U,
                  cat(kName, ": Options::cov, prior or rbranch is not a valid enumerator"));
  }

  /// Posterior mean (`output`) and variance of Q (n x d) over K (m x d), V (m x dv); optional
  /// variational parameters `vp` (m_u: s x dv, dv factors s x s, s = min(rank, n, m)).
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, Addition or
  ///         RBranch::Transpose with n != m, or malformed `vp`.
  Result compute(const Ref& Q, const Ref& K, const Ref& V,
                 const VariationalParams* vp = nullptr) const {
    using detail::cat;
    detail::check_attention_inputs(Q, K, V, kName);
    const Index n = Q.rows(), m = K.rows(), dv = V.cols();
    const Index want = std::min(m_opts.rank, std::min(n, m));
    const bool transpose = m_opts.rbranch == kepsvgp::RBranch::Transpose && !kEOnly;
    EFFATTN_CHECK(!(kAdd || transpose) || n == m,
                  cat(kName, ": Addition merge and RBranch::Transpose need n = m; got Q ",
                      detail::shape(Q), ", K ", detail::shape(K)));
    if (vp) check_vp(*vp, want, dv);

    Result res;
    detail::KepKernelCtx<Scalar> c;
    prepare(c, Q, K);
    res.kernel_shift = static_cast<double>(c.shift);
    kepsvgp::KsvdResult<Scalar>& ks = res.ksvd;
    const double rtol = m_opts.rank_rtol > 0 ? m_opts.rank_rtol
                                             : (std::is_same<Scalar, float>::value ? 1e-6 : 1e-12);
    if constexpr (std::is_same<Svd, kepsvgp::Dense>::value)
      detail::kep_svd_dense(c, want, rtol, ks);
    else if constexpr (std::is_same<Svd, kepsvgp::Factorized>::value)
      detail::kep_svd_factorized(c, want, rtol, ks);
    else
      detail::kep_svd_randomized(c, want, rtol, m_opts.oversample, m_opts.power_iters, m_opts.seed,
                                 !kEOnly, ks);
    const Index r = ks.lambda.size();
    ks.rank_used = r;
    res.rank_used = r;

    // Posterior assembly; serial Eigen products (thread-count independent rounding).
    detail::kep_serial([&] { assemble(res, V, vp, transpose); });
    res.info = detail::all_finite(res.output) && detail::all_finite(res.variance)
                   ? Info::Success
                   : Info::NumericalIssue;
    return res;
  }

  /// Convenience: `compute(Q, K, V).output` (the posterior mean).
  /// \throws effattn::numerical_error if the result is not finite; invalid_argument as compute.
  MatrixType operator()(const Ref& Q, const Ref& K, const Ref& V) const {
    Result r = compute(Q, K, V);
    if (r.info != Info::Success) detail::throw_numerical_error(kName, r.info);
    return std::move(r.output);
  }

  /// One posterior draw, shaped like `res.output`, with a caller-owned generator.
  /// Marginal: output + sqrt(variance) .* z, independent per entry. Joint: EOnly draws
  /// E Lambda^-1 L_c eps_c (eps_c in R^r shared by all tokens) plus, in CovMode::Full,
  /// sigma_c (K - K H_r H_r^T) xi_c with xi_c ~ N(0, I_m) (one more kernel pass; exact residual
  /// covariance). Addition / Concatenation share eps between the branches (eq. 18); their Joint
  /// draw is available in CovMode::Approx only. `Q`, `K` and `vp` must be those of `compute`.
  /// \throws effattn::invalid_argument on mismatched arguments or an unsupported combination.
  MatrixType sample(const Ref& Q, const Ref& K, const Result& res, kepsvgp::SampleMode mode,
                    Rng& rng, const VariationalParams* vp = nullptr) const {
    using detail::cat;
    const auto& ks = res.ksvd;
    const Index r = ks.rank_used, dv = res.output.cols();
    EFFATTN_CHECK(res.info == Info::Success && res.variance.rows() == res.output.rows() &&
                      res.variance.cols() == dv,
                  cat(kName, ": sample needs a successful Result of compute"));
    if (mode == kepsvgp::SampleMode::Marginal) {
      MatrixType z(res.output.rows(), dv);
      fill_normal(z, rng);
      return res.output + (res.variance.array().sqrt() * z.array()).matrix();
    }
    EFFATTN_CHECK(Q.rows() == ks.E.rows() && K.rows() == ks.Hr.rows() && Q.cols() == K.cols(),
                  cat(kName, ": sample needs the Q and K of compute; got Q ", detail::shape(Q),
                      ", K ", detail::shape(K)));
    if (vp) check_vp(*vp, vp->m_u.rows(), dv);
    const bool full = m_opts.cov == kepsvgp::CovMode::Full;
    EFFATTN_CHECK(kEOnly || !full, cat(kName,
                                       ": a Joint sample of the Addition / Concatenation merges "
                                       "is implemented for CovMode::Approx only"));
    MatrixType out = res.output;
    const Vector<Scalar> inv = ks.lambda.cwiseInverse();
    if (vp && r > 0)
      detail::kep_serial([&] {
        MatrixType F = kEOnly ? ks.E : (kAdd ? MatrixType(ks.E + ks.R) : MatrixType(ks.E));
        Vector<Scalar> eps(r);
        for (Index j = 0; j < dv; ++j) {
          fill_normal(eps, rng);
          const auto L = vp->L_u[static_cast<std::size_t>(j)].topLeftCorner(r, r);
          const Vector<Scalar> u =
              inv.asDiagonal() * (L.template triangularView<Eigen::Lower>() * eps);
          out.col(j).head(F.rows()).noalias() += F * u;
          if (!kEOnly && !kAdd) out.col(j).tail(ks.R.rows()).noalias() += ks.R * u;
        }
      });
    if (full) {
      detail::KepKernelCtx<Scalar> c;
      prepare(c, Q, K);
      MatrixType Xi(K.rows(), dv);
      fill_normal(Xi, rng);
      MatrixType resid = detail::kep_apply(c, Xi);
      detail::kep_serial([&] {
        if (r > 0) resid.noalias() -= ks.E * (ks.Hr.transpose() * Xi);
        out += resid * res.prior_variance.cwiseSqrt().asDiagonal();
      });
    }
    return out;
  }

  /// As the other `sample`, with a generator seeded from `seed` (stream 2).
  MatrixType sample(const Ref& Q, const Ref& K, const Result& res, kepsvgp::SampleMode mode,
                    std::uint64_t seed, const VariationalParams* vp = nullptr) const {
    Rng rng = make_rng(seed, 2);
    return sample(Q, K, res, mode, rng, vp);
  }

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  // Means and variances from the KSVD (see the class documentation).
  void assemble(Result& res, const Ref& V, const VariationalParams* vp, bool transpose) const {
    const auto& ks = res.ksvd;
    const Index r = ks.rank_used, n = ks.E.rows(), m = ks.Hr.rows(), dv = V.cols();
    // Prior scales sigma_c^2.
    const kepsvgp::PriorScale ps =
        m_opts.prior == kepsvgp::PriorScale::Auto
            ? (vp ? kepsvgp::PriorScale::Unit : kepsvgp::PriorScale::ValueSecondMoment)
            : m_opts.prior;
    res.prior_variance.resize(dv);
    for (Index j = 0; j < dv; ++j)
      res.prior_variance(j) =
          ps == kepsvgp::PriorScale::Unit
              ? Scalar(1)
              : static_cast<Scalar>(V.col(j).template cast<double>().squaredNorm() /
                                    static_cast<double>(m));
    const bool full = m_opts.cov == kepsvgp::CovMode::Full;
    const Vector<Scalar> inv = ks.lambda.cwiseInverse();

    // Coefficients in the H basis: mean = E Lambda^-1 m_u = E coef.
    MatrixType coef_e(r, dv), coef_r;
    if (vp)
      coef_e = inv.asDiagonal() * vp->m_u.topRows(r);
    else
      coef_e.noalias() = ks.Hr.transpose() * V;  // Lambda^-1 (Lambda H_r^T V)
    MatrixType mean_e = MatrixType::Zero(n, dv), var_e = MatrixType::Zero(n, dv);
    if (r > 0) mean_e.noalias() = ks.E * coef_e;
    if (full) var_e = ks.res_row * res.prior_variance.transpose();
    if (kEOnly) {
      if (vp && r > 0) add_vp_variance(ks.E, inv, *vp, var_e);
      res.output = std::move(mean_e);
      res.variance = std::move(var_e);
    } else {
      coef_r = transpose && !vp ? MatrixType(ks.He.transpose() * V) : coef_e;
      MatrixType mean_r = MatrixType::Zero(m, dv), var_r = MatrixType::Zero(m, dv);
      if (r > 0) mean_r.noalias() = ks.R * coef_r;
      if (full) var_r = ks.res_col * res.prior_variance.transpose();
      if (kAdd) {
        res.output = mean_e + mean_r;
        res.variance = var_e + var_r;
        if (vp && r > 0) add_vp_variance(MatrixType(ks.E + ks.R), inv, *vp, res.variance);
      } else {
        if (vp && r > 0) {
          add_vp_variance(ks.E, inv, *vp, var_e);
          add_vp_variance(ks.R, inv, *vp, var_r);
        }
        res.output.resize(n + m, dv);
        res.output << mean_e, mean_r;
        res.variance.resize(n + m, dv);
        res.variance << var_e, var_r;
      }
    }
  }

  void prepare(detail::KepKernelCtx<Scalar>& c, const Ref& Q, const Ref& K) const {
    const Index m = K.rows();
    c.block =
        m_opts.block_rows > 0
            ? m_opts.block_rows
            : std::max<Index>(32, std::min<Index>(256, (Index{1} << 21) / std::max<Index>(m, 1)));
    c.n = Q.rows();
    c.m = m;
    Kernel::prepare(c, Q, K, detail::resolve_scale(m_opts.scale, Q.cols()), m_opts.seed);
  }

  static void check_vp(const VariationalParams& vp, Index s, Index dv) {
    using detail::cat;
    EFFATTN_CHECK(vp.m_u.rows() == s && vp.m_u.cols() == dv,
                  cat(kName, ": vp.m_u must be s x dv = ", s, " x ", dv,
                      " (s = min(rank, n, m)); got ", detail::shape(vp.m_u)));
    EFFATTN_CHECK(static_cast<Index>(vp.L_u.size()) == dv,
                  cat(kName, ": vp.L_u must hold dv = ", dv, " factors; got ", vp.L_u.size()));
    detail::check_finite(vp.m_u, "vp.m_u");
    for (const MatrixType& L : vp.L_u) {
      EFFATTN_CHECK(L.rows() == s && L.cols() == s,
                    cat(kName, ": every vp.L_u factor must be s x s = ", s, " x ", s, "; got ",
                        detail::shape(L)));
      detail::check_finite(L, "vp.L_u");
    }
  }

  // var(:, c) += row norms^2 of F Lambda^-1 L_c (leading r x r block of L_c, lower part).
  static void add_vp_variance(const MatrixType& F, const Vector<Scalar>& inv,
                              const VariationalParams& vp, MatrixType& var) {
    const Index r = inv.size();
    const MatrixType G = F * inv.asDiagonal();
    for (Index j = 0; j < var.cols(); ++j) {
      const MatrixType L = vp.L_u[static_cast<std::size_t>(j)]
                               .topLeftCorner(r, r)
                               .template triangularView<Eigen::Lower>();
      const MatrixType T = G * L;
      var.col(j).head(G.rows()) +=
          T.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
    }
  }

  Options m_opts;
};

/// KEP-SVGP (softmax kernel, randomized KSVD, e-branch), float.
using KepSvgpAttentionf = KepSvgpAttention<float>;
/// KEP-SVGP (softmax kernel, randomized KSVD, e-branch), double.
using KepSvgpAttentiond = KepSvgpAttention<double>;

namespace kepsvgp {

/// KL(q(u) || p(u)) of eq. 21 (Prop. 4.1), p(u_c) = N(0, Lambda^2), q(u_c) = N(m_c, L_c L_c^T),
/// summed over the dv columns: 1/2 sum_c [ ||Lambda^-1 L_c||_F^2 + m_c^T Lambda^-2 m_c
/// + log|Lambda^2| - 2 sum_k log L_c,kk - s ]. Accumulated in double. (The official code's
/// s x s x s layout makes S_c singular for c > 1, spec 7.3; here every L_c is a full factor.)
/// \throws effattn::invalid_argument on shape mismatch, lambda <= 0, a non-positive diagonal or
///         a non-zero strictly upper entry of some L_c.
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

/// KSVD regulariser of eq. 11: J^2 with J = -1/2 sum_i e_i^T Lambda^-1 e_i
/// - 1/2 sum_j r_j^T Lambda^-1 r_j + Tr(W_e^T W_r). Reduction::Mean divides the two sums by
/// the token counts (official code; then J = 0 is no longer the KKT condition). Double sums.
template <typename Scalar>
double ksvd_loss(const Matrix<Scalar>& E, const Matrix<Scalar>& R, const Vector<Scalar>& lambda,
                 const Matrix<Scalar>& We, const Matrix<Scalar>& Wr,
                 Reduction reduction = Reduction::Sum) {
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

/// ELBO of eq. 20: expected log-likelihood minus kl_weight times the total KL.
inline double elbo(double expected_loglik, double kl_total, double kl_weight = 1.0) {
  return expected_loglik - kl_weight * kl_total;
}

/// Normalised cumulative spectrum (App. D.6): c_k = sum_{m <= k} sigma_m^p / sum_m sigma_m^p over
/// the values sorted non-increasingly (p = 1 or 2). \throws invalid_argument on negative,
/// non-finite or all-zero input.
template <typename Scalar>
Vector<Scalar> normalized_cumulative_spectrum(const Vector<Scalar>& sigma, Power p = Power::One) {
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

/// lambda from the code's parameterisation Lambda^-1/2 = exp(theta): lambda = exp(-2 theta).
template <typename Scalar>
Vector<Scalar> from_log_inv_sqrt(const Vector<Scalar>& theta) {
  return (Scalar(-2) * theta.array()).exp().matrix();
}

}  // namespace kepsvgp
}  // namespace effattn
