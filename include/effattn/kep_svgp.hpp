/// \file kep_svgp.hpp
/// \brief KEP-SVGP: attention as a pair of sparse variational GPs on the kernel-eigen pairs of
/// the asymmetric attention kernel (Chen, Tao, Tonin, Suykens, "Self-Attention through
/// Kernel-Eigen Pair Sparse Variational Gaussian Processes", ICML 2024, arXiv 2402.01476), in a
/// training-free form, plus the KL / KSVD-loss / ELBO utilities a trainer needs (eq. 11, 20, 21;
/// in `kep_svgp_training.hpp`, which this header includes).
///
/// \par What is training-free and what is not
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
/// in and are then used as in eq. 16, with the covariance E Lambda^-1 S Lambda^-1 E^T (the order
/// of App. B.2; the main text's Lambda^-1 E^T S E Lambda^-1 does not type-check for n != s).
///
/// \par Complexity
/// The paper's O(N s^2) assumes learned primal projections. An exact KSVD of a softmax kernel
/// must apply the kernel: `policy::RandomizedSvd` costs (q + 2) streamed kernel passes,
/// O((q + 2) n m (d + s)) time and O((n + m) s + block m) memory (the n x m kernel is never
/// stored); `policy::DenseSvd` is O(n m min(n, m)) and stores K. Only explicit-feature kernels
/// (cosine, linear, positive random features; p features) are linear in n with
/// `policy::FactorizedSvd`: O((n + m) p^2 + p^3).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/functor.hpp"
#include "core/random.hpp"
#include "core/types.hpp"

namespace effattn {
namespace kep_svgp {

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
  Matrix<Scalar> R;         ///< m x r, R_X = K^T H_e (RandomizedSvd + EOnly: empty, not computed)
  Vector<Scalar> lambda;    ///< r singular values, non-increasing, > rank_rtol * lambda_1
  Vector<Scalar> spectrum;  ///< every singular value the engine computed (sketch size)
  Vector<Scalar> res_row;   ///< n values ||(K - K H_r H_r^T)_i||^2
  Vector<Scalar> res_col;   ///< m values ||(K - H_e H_e^T K)_{:,j}||^2 (empty when R is)
  Index rank_used = 0;      ///< r
  Index sketch = 0;         ///< columns of the sketch (RandomizedSvd: min(s + p, n, m))
};

/// User-supplied variational parameters of q(u) = N(m_u, S_c), S_c = L_c L_c^T.
template <typename Scalar>
struct VariationalParams {
  Matrix<Scalar> m_u;               ///< s x dv means (column c = m_u[c])
  std::vector<Matrix<Scalar>> L_u;  ///< dv lower-triangular s x s factors, positive diagonal
};

}  // namespace kep_svgp

/// Deprecated name of `kep_svgp` (the enum namespace takes its header's name, as `eva::` and
/// `wildcat::` do). Kept for one release; C++ cannot mark a namespace alias `[[deprecated]]`, so
/// the compiler does not warn: see CHANGELOG.md.
namespace kepsvgp = kep_svgp;

namespace policy {

/// \ingroup Policies
/// KEP-SVGP kernel: row softmax of eq. 8, K = rowsoftmax(scale Q K^T); row-stochastic, so
/// lambda_1 >= 1. Evaluated in row blocks with max subtraction; never stored by RandomizedSvd.
struct SoftmaxRowKernel {
  static constexpr bool has_features = false;  ///< no explicit feature map
};
/// \ingroup Policies
/// KEP-SVGP kernel: unnormalised exponential K = exp(scale Q K^T - c), c = the largest logit (a
/// global constant, `KepSvgpResult::kernel_shift`, so nothing overflows; it scales K and lambda
/// by e^-c). Symmetric positive definite when Q = K.
struct ExpKernel {
  static constexpr bool has_features = false;  ///< no explicit feature map
};
/// \ingroup Policies
/// KEP-SVGP kernel of the paper's experiments (App. D.1, official code): K = Qhat Khat^T with
/// phi(x) = x / max(||x||, 1e-12) (zero rows stay zero). Entries in [-1, 1], rank <= d, not
/// row-normalised; `scale` is not used.
struct CosineKernel {
  static constexpr bool has_features = true;  ///< K = A B^T with p = d features
};
/// \ingroup Policies
/// KEP-SVGP kernel: linear K = scale Q K^T (explicit features A = scale Q, B = K).
struct LinearKernel {
  static constexpr bool has_features = true;  ///< K = A B^T with p = d features
};
/// \ingroup Policies
/// KEP-SVGP kernel: positive random features (Performer / FAVOR+, M features drawn from the
/// seed) approximating the softmax kernel, row-normalised: A = diag(Phi_q Phi_k^T 1)^-1 Phi_q,
/// B = Phi_k, phi(x)_r = exp(w_r.x~ - |x~|^2 / 2), x~ = sqrt(scale) x, w_r ~ N(0, I_d).
template <Index M = 256>
struct PositiveRandomFeatureKernel {
  static_assert(M >= 1, "effattn: PositiveRandomFeatureKernel needs M >= 1 features");
  static constexpr bool has_features = true;  ///< K = A B^T with p = M features
  static constexpr Index features = M;        ///< M
};

/// \ingroup Policies
/// KEP-SVGP SVD engine: form K (n x m) and take its full thin SVD by Householder QR and
/// one-sided Jacobi (the engine of the small SVDs below, run on the whole kernel): the oracle,
/// O(n m min(n, m)) time (about 10 sweeps of 3.5 min(n, m)^3; 0.8 s at n = m = 512, 9 s at 1024
/// on one core of an AMD Zen 5), O(n m) memory, serial, bit-identical for any thread count. Not
/// Eigen 3.4's BDCSVD, which is faster but returns wrong factors, NaN or reads out of bounds on
/// near-degenerate kernels (large logits; see detail/methods/kep_svgp_ksvd.hpp).
struct DenseSvd {};
/// \ingroup Policies
/// KEP-SVGP SVD engine: randomized range finder (Halko, Martinsson, Tropp 2011) on the row space
/// with oversampling p, q power iterations (each a fused K^T K pass, re-orthonormalised by
/// Householder QR) and the kernel applied in row blocks, never stored. Gaussian sketch from the
/// seed. O((q + 2) n m (d + s)) time; q = 0 by default (two kernel passes). The n x (s + p) SVD of
/// the Rayleigh-Ritz step is Householder QR and one-sided Jacobi in double: O(n l^2 + 10 l^3),
/// l = s + p; negligible at l <= 64, but at s = 128 and n = 512 the call takes 31x exact Tiled
/// (17x with Eigen's BDCSVD, which costs 25 s more to compile; 10.2x against 9.2x at n = 4096).
struct RandomizedSvd {};
/// \ingroup Policies
/// KEP-SVGP SVD engine: exact KSVD of an explicit-feature kernel K = A B^T by thin QR of A and B
/// and the SVD of the p x p core (QR and one-sided Jacobi): O((n + m) p^2 + p^3), linear in n.
struct FactorizedSvd {};

/// \ingroup Policies
/// KEP-SVGP merge: the e-branch only (default; its mean approximates attention K V).
struct EOnly {};
/// \ingroup Policies
/// KEP-SVGP merge: F = F^e + F^r (eq. 19, addition; needs n = m).
struct Addition {};
/// \ingroup Policies
/// KEP-SVGP merge: token-axis concatenation [F^e; F^r] (eq. 19; the learned N x 2N mixer
/// W1^cat is not applied). `output` / `variance` hold the query-side branch F^e (n x dv) and
/// `output_keys` / `variance_keys` the key-side branch F^r (m x dv).
struct Concatenation {};

}  // namespace policy

namespace detail {
/// True for policy::PositiveRandomFeatureKernel<M> (any M).
template <typename Kernel>
struct is_prf_kernel : std::false_type {};
template <Index M>
struct is_prf_kernel<policy::PositiveRandomFeatureKernel<M>> : std::true_type {};
}  // namespace detail

/// Options of `KepSvgpAttention`.
struct KepSvgpOptions {
  /// Logit scale of the softmax / exp / random-feature kernels: logit = scale * <q, k>;
  /// 0 means 1/sqrt(d). Cosine and linear kernels: see their documentation.
  double scale = 0;
  /// s, the KSVD rank (number of kernel-eigen pairs). Clamped to min(n, m); the rank actually
  /// used (also after dropping singular values <= rank_rtol * lambda_1) is `Result::rank_used`.
  Index rank = 10;
  /// RandomizedSvd: oversampling p (sketch size min(s + p, n, m)). At power_iters = 0 the
  /// error is flat in p on `clustered` (p = 0..20 within 1e-5 of each other, see power_iters);
  /// p = 20 helps flatter spectra a little (gaussian 0.674 vs 0.677, sphere 0.0901 vs 0.0913).
  Index oversample = 10;
  /// RandomizedSvd: power iterations q: q + 1 fused passes of K^T K (each re-orthonormalised)
  /// and one pass of K, so q + 2 kernel passes in all. Default 0 (two passes; the first is
  /// already a K^T K product, so its subspace is that of one half power step): the time of
  /// each pass is about that of exact attention, and q = 0 is what keeps the method within 3x of
  /// it. Measured relative error of the rank-32 mean against exact attention, n = 4096,
  /// d = 64, float, mean +- sd over 6 sketch seeds (q = 2 / 1 / 0, p = 10):
  /// clustered 0.00918 +- 1e-5 / 0.00919 +- 2e-5 / 0.00922 +- 1e-5 (0.4% more than q = 2);
  /// gaussian 0.666 / 0.668 / 0.677 (+- 0.003); sphere 0.0901 / 0.0906 / 0.0913 (+- 0.001);
  /// positional 0.899 / 0.906 / 0.928 (+- 0.005). Time / exact Tiled at 2 threads: q = 0 2.8,
  /// q = 1 4.7, q = 2 5.6. Take q = 1 or 2 for flat spectra where the last percent matters.
  /// A sketch of min(n, m) columns (full rank) always gets q >= 1, for accuracy in float.
  int power_iters = 0;
  /// Relative cut-off of the singular values; 0 = 1e-12 (double) / 1e-6 (float).
  double rank_rtol = 0;
  /// Full (default; training-free variance) or Approx (Remark 3.1).
  kep_svgp::CovMode cov = kep_svgp::CovMode::Full;
  /// Prior scale sigma_c^2 per value column.
  kep_svgp::PriorScale prior = kep_svgp::PriorScale::Auto;
  /// r-branch semantics (Addition / Concatenation merges).
  kep_svgp::RBranch rbranch = kep_svgp::RBranch::Shared;
  /// Kernel rows per streamed block; 0 = automatic (about 2M entries, 32..256 rows).
  Index block_rows = 0;
  /// Seed of the randomized sketch and of the random features. Its default differs from the
  /// 0x5eed of the other randomized methods (EVA, Performer, WildCat, AutoAttention, KvPress):
  /// it is kept so that default outputs do not change; a seed passed explicitly gives the same
  /// output whatever the defaults.
  std::uint64_t seed = 0x6b6570ULL;
};

/// Result of `KepSvgpAttention::compute`.
template <typename Scalar>
struct KepSvgpResult : AttentionResult<Scalar> {
  /// Predictive variance of every entry of `output` (n x dv), >= 0.
  Matrix<Scalar> variance;
  /// Concatenation merge: posterior mean of the key-side branch F^r (m x dv), the rows the
  /// token-axis concatenation [F^e; F^r] appends below `output`. Empty for the other merges.
  Matrix<Scalar> output_keys;
  /// Concatenation merge: predictive variance of `output_keys` (m x dv); empty otherwise.
  Matrix<Scalar> variance_keys;
  /// sigma_c^2 used for every value column (dv).
  Vector<Scalar> prior_variance;
  /// The truncated KSVD.
  kep_svgp::KsvdResult<Scalar> ksvd;
  /// Rank r actually used (= ksvd.rank_used).
  Index rank_used = 0;
  /// ExpKernel: the constant c in K = exp(scale Q K^T - c); 0 otherwise.
  double kernel_shift = 0;

  /// {"rank_used", "sketch", "kernel_shift", "lambda_max", "lambda_min", "mean_variance",
  /// "max_variance"}: r, the sketch size, c, lambda_1 and lambda_r (0 when r = 0) and the mean and
  /// largest entry of `variance` (0 when empty).
  Diagnostics diagnostics() const;
};

/// \ingroup Methods
/// \brief KEP-SVGP attention, training-free: truncated KSVD of the attention kernel and the
/// e-branch / r-branch GP posteriors, with a per-token, per-column predictive variance.
///
/// With K ~ H_e Lambda H_r^T (rank r), E = K H_r and R = K^T H_e (eq. 10), the e-branch posterior
/// of value column c is (eq. 16 with the covariance order of App. B.2)
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
/// ||L_c^T Lambda^-1 (E + R)_{i,:}^T||^2. `output` is always n x dv; Concatenation puts its
/// key-side branch in `output_keys` / `variance_keys`.
///
/// \tparam Scalar_ float or double.
/// \tparam Kernel policy::SoftmaxRowKernel (default), ExpKernel, CosineKernel, LinearKernel,
///         PositiveRandomFeatureKernel<M>.
/// \tparam Svd policy::RandomizedSvd (default), DenseSvd, FactorizedSvd (explicit-feature
///         kernels only).
/// \tparam Merge policy::EOnly (default), Addition, Concatenation.
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
///     Q, K, r, effattn::kep_svgp::SampleMode::Joint, std::uint64_t{7});
/// \endcode
///
/// \par Gradients
/// No `backward`: the posterior mean and variance go through an eigendecomposition / Cholesky of
/// the s x s inducing-point kernel and randomised inducing points; a gradient would need the
/// derivative of that factorisation (and a choice about the random draw), which the method's
/// training objective (the ELBO of the paper) handles separately. Use `ExactAttention::backward`
/// for the attention itself.
///
/// \par Threading and determinism
/// `compute` is const and keeps no state. Kernel blocks run in parallel (OpenMP) with a fixed
/// decomposition and fixed summation groups, and every other product runs with Eigen's GEMM in
/// serial mode: every SVD engine gives bit-identical results for any thread count.
template <typename Scalar_, typename Kernel = policy::SoftmaxRowKernel,
          typename Svd = policy::RandomizedSvd, typename Merge = policy::EOnly>
class KepSvgpAttention
    : public AttentionFunctor<KepSvgpAttention<Scalar_, Kernel, Svd, Merge>, Scalar_> {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");
  static_assert(std::is_same_v<Svd, policy::DenseSvd> ||
                    std::is_same_v<Svd, policy::RandomizedSvd> ||
                    std::is_same_v<Svd, policy::FactorizedSvd>,
                "effattn: KepSvgpAttention Svd must be policy::DenseSvd, RandomizedSvd or "
                "FactorizedSvd");
  static_assert(!std::is_same_v<Svd, policy::FactorizedSvd> || Kernel::has_features,
                "effattn: policy::FactorizedSvd needs an explicit-feature kernel (CosineKernel, "
                "LinearKernel, PositiveRandomFeatureKernel)");
  static_assert(std::is_same_v<Merge, policy::EOnly> || std::is_same_v<Merge, policy::Addition> ||
                    std::is_same_v<Merge, policy::Concatenation>,
                "effattn: KepSvgpAttention Merge must be policy::EOnly, Addition or Concatenation");

 public:
  using Scalar = Scalar_;                ///< the scalar type (float or double)
  using Options = KepSvgpOptions;        ///< the options struct
  using Result = KepSvgpResult<Scalar>;  ///< the result of `compute`
  using MatrixType = Matrix<Scalar>;     ///< `Matrix<Scalar>`
  using Ref = ConstRef<Scalar>;          ///< the input type, `ConstRef<Scalar>`
  using VariationalParams =
      kep_svgp::VariationalParams<Scalar>;  ///< variational parameters of the trainer interface

  /// Name used in messages.
  static constexpr const char* name = "KepSvgpAttention";
  /// No causal form (the KSVD is of the full kernel).
  static constexpr bool supports_causal = false;
  /// The output depends on `Options::seed`: the RandomizedSvd sketch and the random features of
  /// PositiveRandomFeatureKernel are drawn from it (DenseSvd or FactorizedSvd with a
  /// deterministic kernel do not use it).
  static constexpr bool randomized =
      std::is_same_v<Svd, policy::RandomizedSvd> || detail::is_prf_kernel<Kernel>::value;
  /// Q and K may have different numbers of rows (except Addition and RBranch::Transpose).
  static constexpr bool self_attention_only = false;
  /// The default output is the rank-10 truncation K_s V, not exact attention.
  static constexpr bool exact = false;

  /// \throws effattn::invalid_argument on rank < 1, oversample < 0, power_iters < 0, a bad
  ///         scale, rank_rtol outside [0, 1), block_rows < 0 or an invalid enumerator.
  explicit KepSvgpAttention(Options opts = {});

  /// Posterior mean (`output`, n x dv) and variance of Q (n x d) over K (m x d), V (m x dv),
  /// training-free (no variational parameters). Time O((q + 2) n m (d + l)) with RandomizedSvd
  /// (l = min(s + p, n, m), plus one kernel pass for the r-branch merges), O(n m min(n, m)) with
  /// DenseSvd, O((n + m) p^2 + p^3) with FactorizedSvd; then O((n + m) r dv) for the posterior.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, or Addition /
  ///         RBranch::Transpose with n != m.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V) const;

  /// As `compute(Q, K, V)` with variational parameters `vp` (m_u: s x dv, dv lower-triangular
  /// factors s x s, s = min(rank, n, m)): mean E Lambda^-1 m_u and the shared-u variance term.
  /// \throws effattn::invalid_argument as `compute(Q, K, V)`, or on a malformed `vp`.
  [[nodiscard]] Result compute(const Ref& Q, const Ref& K, const Ref& V,
                               const VariationalParams& vp) const;

  /// One posterior draw of a `res` of `compute(Q, K, V)` with a caller-owned generator. Shaped
  /// like `output` (n x dv); Concatenation: the joint draw of both branches stacked as
  /// [output; output_keys] ((n + m) x dv). Marginal: mean + sqrt(variance) .* z, independent per
  /// entry. Joint: mean plus, in CovMode::Full (EOnly only), sigma_c (K - K H_r H_r^T) xi_c with
  /// xi_c ~ N(0, I_m) (one more kernel pass; exact residual covariance); Addition and
  /// Concatenation draw jointly in CovMode::Approx only. `Q`, `K` must be those of `compute`.
  /// \throws effattn::invalid_argument on mismatched arguments or an unsupported combination.
  [[nodiscard]] MatrixType sample(const Ref& Q, const Ref& K, const Result& res,
                                  kep_svgp::SampleMode mode, Rng& rng) const;
  /// As above for a `res` of `compute(Q, K, V, vp)` (same `vp`): the Joint draw also adds
  /// F Lambda^-1 L_c eps_c (F = E; E + R for Addition; eps_c in R^r shared by all tokens and,
  /// for Addition / Concatenation, by both branches, eq. 18).
  [[nodiscard]] MatrixType sample(const Ref& Q, const Ref& K, const Result& res,
                                  kep_svgp::SampleMode mode, Rng& rng,
                                  const VariationalParams& vp) const;
  /// As the `Rng&` form, with a generator seeded from `seed` (stream 2).
  [[nodiscard]] MatrixType sample(const Ref& Q, const Ref& K, const Result& res,
                                  kep_svgp::SampleMode mode, std::uint64_t seed) const;
  /// As the `Rng&` form with `vp`, with a generator seeded from `seed` (stream 2).
  [[nodiscard]] MatrixType sample(const Ref& Q, const Ref& K, const Result& res,
                                  kep_svgp::SampleMode mode, std::uint64_t seed,
                                  const VariationalParams& vp) const;

  /// The options this functor was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  static constexpr bool kEOnly = std::is_same_v<Merge, policy::EOnly>;
  static constexpr bool kAdd = std::is_same_v<Merge, policy::Addition>;
  static constexpr bool kConcat = std::is_same_v<Merge, policy::Concatenation>;

  Result run(const Ref& Q, const Ref& K, const Ref& V, const VariationalParams* vp) const;
  MatrixType draw(const Ref& Q, const Ref& K, const Result& res, kep_svgp::SampleMode mode,
                  Rng& rng, const VariationalParams* vp) const;
  void assemble(Result& res, const Ref& V, const VariationalParams* vp, bool transpose) const;
  static void check_vp(const VariationalParams& vp, Index s, Index dv);

  Options m_opts;
};

/// KEP-SVGP (softmax kernel, randomized KSVD, e-branch), float.
using KepSvgpAttentionf = KepSvgpAttention<float>;
/// KEP-SVGP (softmax kernel, randomized KSVD, e-branch), double.
using KepSvgpAttentiond = KepSvgpAttention<double>;

}  // namespace effattn

#include "detail/methods/kep_svgp_impl.hpp"
#include "kep_svgp_training.hpp"

#ifdef EFFATTN_COMPILED
namespace effattn {
EFFATTN_EXTERN_INSTANCE(KepSvgpAttention<float>)  // default policies only
EFFATTN_EXTERN_INSTANCE(KepSvgpAttention<double>)
extern template struct KepSvgpResult<float>;  // diagnostics() is defined in the impl header
extern template struct KepSvgpResult<double>;
}  // namespace effattn
#endif
