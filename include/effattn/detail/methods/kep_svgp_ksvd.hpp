/// \file kep_svgp_ksvd.hpp
/// \brief Internal: KEP-SVGP's three truncated-KSVD engines (`policy::DenseSvd`, the dense oracle;
/// `policy::RandomizedSvd`, the randomized range finder; `policy::FactorizedSvd`, QR-QR-SVD of
/// explicit features) and their small SVD helpers. Include <effattn/kep_svgp.hpp> instead.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../core/gemm.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../kep_svgp.hpp"
#include "../linalg/householder.hpp"
#include "../linalg/jacobi_svd.hpp"
#include "kep_svgp_kernels.hpp"

namespace effattn {
namespace detail {

/// Thin orthonormal basis of the columns of X (Householder QR; orthonormal even when X is
/// rank deficient).
template <typename Scalar>
Matrix<Scalar> kep_orth(const Matrix<Scalar>& X) {
  Matrix<Scalar> qr = X;
  Vector<Scalar> tau;
  householder_qr(qr, tau);
  return householder_thin_q(qr, tau, X.cols());
}

/// Thin SVD X = U diag(s) W^T for the dense oracle (policy::DenseSvd): Householder QR and
/// one-sided Jacobi (`thin_svd_qr_jacobi`, detail/linalg/jacobi_svd.hpp), in one serial region so
/// that its products round the same way for any thread count.
///
/// Not Eigen's BDCSVD, which the oracle used before: Eigen 3.4.0's divide and conquer
/// is wrong on near-degenerate inputs, the near-permutation softmax kernels of large logits with
/// repeated singular values. Measured on 40 x 40 row-softmax kernels of Gaussian Q and K (d = 8),
/// 300 seeds at each logit scale 10, 100 and 1000, with -march=native on an AMD Zen 5 (AVX-512):
/// g++ -O2 returned finite factors whose product missed X by more than 1e-10 (up to 1.0, the size
/// of the entries) on 59 of the 900 inputs (57 at scale 1000) and NaN on 11; clang -O1 on 53 and
/// 13. Built for plain x86-64, g++ stops at Eigen's assertion
/// `index >= 0 && index < size()` in BDCSVD::perturbCol0, which reads perm(-1): an out-of-bounds
/// read when assertions are off. A result check cannot guard against the latter, so the oracle no
/// longer calls it. The price is speed (n = m, softmax kernel, d = 64, one core of the same
/// machine: 0.013 / 0.11 / 0.83 / 9.0 s at n = 128 / 256 / 512 / 1024 against BDCSVD's 0.005 /
/// 0.019 / 0.09 / 0.46 s) and the last digits (max |X - U S W^T| 1e-14 to 4e-14 against
/// 2e-16 to 1e-15); the oracle serves tests and small comparisons. It also drops BDCSVD's 25 s
/// of g++ -O2 per scalar type from every TU that instantiates the oracle.
template <typename Scalar>
void kep_thin_svd_dense(const Matrix<Scalar>& X, Matrix<Scalar>& U, Vector<Scalar>& s,
                        Matrix<Scalar>& W) {
  run_serial([&] { thin_svd_qr_jacobi(X, U, s, W); });
}

/// How many leading singular values to keep: at most `want`, and only those > rtol * s_0.
template <typename Scalar>
Index kep_keep(const Vector<Scalar>& s, Index want, double rtol) {
  const Index top = std::min<Index>(want, s.size());
  if (top == 0 || !(s(0) > Scalar(0))) return 0;
  Index r = 0;
  while (r<top&& static_cast<double>(s(r))> rtol * static_cast<double>(s(0))) ++r;
  return r;
}

/// Sign convention: the largest-magnitude entry of every H_r column is positive (H_e follows).
template <typename Scalar>
void kep_canonical_signs(Matrix<Scalar>& He, Matrix<Scalar>& Hr) {
  for (Index k = 0; k < Hr.cols(); ++k) {
    Index i = 0;
    Hr.col(k).cwiseAbs().maxCoeff(&i);
    if (Hr(i, k) < Scalar(0)) {
      Hr.col(k) = -Hr.col(k);
      He.col(k) = -He.col(k);
    }
  }
}

/// Clamped difference a - b (double), for residual norms ||K_i||^2 - ||E_i||^2.
template <typename = void>  // instantiated where used (compile cost)
inline Eigen::VectorXd kep_clamped_diff(const Eigen::VectorXd& a, const Eigen::VectorXd& b) {
  return (a - b).cwiseMax(0.0);
}

/// Dense oracle: the formed kernel, its full thin SVD (QR + one-sided Jacobi), exact residuals.
template <typename Scalar, bool Features>
void kep_svd_dense(const KepKernelCtx<Scalar, Features>& c, Index want, double rtol,
                   kep_svgp::KsvdResult<Scalar>& out) {
  const Matrix<Scalar> Kd = kep_dense_kernel(c);
  Matrix<Scalar> U, W;
  Vector<Scalar> s;
  kep_thin_svd_dense(Kd, U, s, W);
  const Index r = kep_keep(s, want, rtol);
  out.He = U.leftCols(r);
  out.Hr = W.leftCols(r);
  out.lambda = s.head(r);
  out.spectrum = s;
  kep_canonical_signs(out.He, out.Hr);
  gemm(Update::Assign, out.E, Kd, out.Hr);
  gemm<Op::T>(Update::Assign, out.R, Kd, out.He);
  // Residuals formed directly from K (no cancellation): (K - K_s) and (K - H_e H_e^T K).
  // Through gemm (its fixed panels outside a region): the oracle is thread-count invariant.
  Matrix<double> Res = Kd.template cast<double>();
  gemm<Op::N, Op::T>(Update::Sub, Res, as_double(out.E), as_double(out.Hr));
  out.res_row = Res.rowwise().squaredNorm().template cast<Scalar>();
  Res = Kd.template cast<double>();
  gemm<Op::N, Op::T>(Update::Sub, Res, as_double(out.He), as_double(out.R));
  out.res_col = Res.colwise().squaredNorm().transpose().template cast<Scalar>();
  out.sketch = std::min(c.n, c.m);
}

/// Gaussian sketch (rows x cols, standard normals) of stream 0 of `seed`: Box-Muller on the
/// uniforms of `standard_normal_pair` (u1 open, u2; two engine outputs per pair, pairs in
/// column-major order as `fill_normal`), with the logarithm, square root, sine and cosine
/// evaluated as Eigen array expressions (vectorised; the scalar libm sincos of `random_normal`
/// took 4 ms for the 4096 x 42 sketch, as long as the serial QR and SVD together). Values agree
/// with `random_normal` to a few units in the last place of Scalar.
template <typename Scalar>
Matrix<Scalar> kep_sketch(Index rows, Index cols, std::uint64_t seed) {
  using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  Rng rng = make_rng(seed, 0);
  const Index total = rows * cols, pairs = (total + 1) / 2;
  Eigen::ArrayXd u1(pairs), u2(pairs);
  for (Index k = 0; k < pairs; ++k) {
    u1(k) = uniform_open01(rng);
    u2(k) = uniform01(rng);
  }
  const Array r = (-2.0 * u1.log()).sqrt().template cast<Scalar>();
  const Array th = (6.283185307179586476925286766559 * u2).template cast<Scalar>();
  Matrix<Scalar> out(rows, cols);
  // Even entries r cos(theta), odd entries r sin(theta) (fill_normal's order).
  Eigen::Map<Array, 0, Eigen::InnerStride<2>>(out.data(), pairs) = r * th.cos();
  Eigen::Map<Array, 0, Eigen::InnerStride<2>>(out.data() + 1, total / 2) =
      r.head(total / 2) * th.head(total / 2).sin();
  return out;
}

/// The randomized range finder on the ROW space (Halko, Martinsson, Tropp 2011, Alg. 4.4
/// applied to K^T): Z <- orth(K^T K Z) for power + 1 fused passes from a Gaussian m x l start,
/// then C = K Z exactly (one more pass, with the squared row norms of K, double). Each kernel
/// block is formed once per pass: power + 2 kernel passes in total (the column-space algorithm
/// needs 2 power + 2). One parallel region per pass and one serial region per QR.
///
/// Default power = 0 (KepSvgpOptions::power_iters): 2 passes instead of 4. Measured on
/// `clustered`, n = 4096, d = 64, s = 32, p = 10, float, 6 sketch seeds, relative error of the
/// mean against exact attention: power 2: 0.00918 +- 1e-5, 1: 0.00919 +- 2e-5, 0: 0.00922
/// +- 1e-5 (time / exact Tiled at 2 threads: 5.6, 4.7, 2.8); flatter spectra lose more
/// (positional 0.899 -> 0.928), see the Options documentation.
template <typename Scalar, bool Features>
void kep_randomized_range(const KepKernelCtx<Scalar, Features>& c, Index want, Index oversample,
                          int power, std::uint64_t seed, Matrix<Scalar>& Z, Matrix<Scalar>& C,
                          Eigen::VectorXd& rsq) {
  const Index l = std::min(want + oversample, std::min(c.n, c.m));
  // A sketch as wide as min(n, m) has no oversampling left to absorb the conditioning of the
  // square Gaussian factor K Omega (a random square matrix: condition ~ its size), so the
  // subspace of ONE pass loses eps * that in the small directions (float, full rank, n = 61,
  // m = 150: 5e-4 relative error of the output against 1e-6 with a second pass). Such sketches
  // (only small problems reach them) always get at least one power iteration.
  if (l >= std::min(c.n, c.m)) power = std::max(power, 1);
  Z = kep_sketch<Scalar>(c.m, l, seed);
  for (int t = 0; t <= power; ++t) {
    const Matrix<Scalar> G = kep_apply_gram(c, Z);
    run_serial([&] { Z = kep_orth(G); });
  }
  C = kep_apply(c, Z, &rsq);
}

/// The Rayleigh-Ritz step of the randomized KSVD from the range finder's Z (m x l, orthonormal)
/// and C = K Z (n x l): thin SVD of C, H_r = Z W, E = C W (an exact product, so
/// ||K_i||^2 - ||E_i||^2 is the exact projection residual of the computed subspace). R and
/// res_col are left empty (kep_randomized_r adds them for the merges that need them). Opens no
/// region: the caller runs it inside one (run_serial), together with the posterior assembly.
template <typename Scalar>
void kep_randomized_finish(const Matrix<Scalar>& Z, const Matrix<Scalar>& C,
                           const Eigen::VectorXd& rsq, Index want, double rtol,
                           kep_svgp::KsvdResult<Scalar>& out) {
  Matrix<Scalar> U, W;
  Vector<Scalar> s;
  thin_svd_qr_jacobi(C, U, s, W);
  const Index r = kep_keep(s, want, rtol);
  out.He = U.leftCols(r);
  Matrix<Scalar> Wr = W.leftCols(r);
  gemm(Update::Assign, out.Hr, Z, Wr);
  out.lambda = s.head(r);
  out.spectrum = s;
  for (Index k = 0; k < r; ++k) {
    Index i = 0;
    out.Hr.col(k).cwiseAbs().maxCoeff(&i);
    if (out.Hr(i, k) < Scalar(0)) {
      out.Hr.col(k) = -out.Hr.col(k);
      out.He.col(k) = -out.He.col(k);
      Wr.col(k) = -Wr.col(k);
    }
  }
  gemm(Update::Assign, out.E, C, Wr);
  out.res_row = kep_clamped_diff(rsq, out.E.template cast<double>().rowwise().squaredNorm())
                    .template cast<Scalar>();
  out.sketch = Z.cols();
}

/// R = K^T H_e and the column residuals ||K_{:,j}||^2 - ||R_j||^2 of a randomized KSVD (one more
/// streamed kernel pass).
template <typename Scalar, bool Features>
void kep_randomized_r(const KepKernelCtx<Scalar, Features>& c, kep_svgp::KsvdResult<Scalar>& out) {
  Eigen::VectorXd csq;
  out.R = kep_apply_transpose(c, out.He, &csq);
  out.res_col = kep_clamped_diff(csq, out.R.template cast<double>().rowwise().squaredNorm())
                    .template cast<Scalar>();
}

/// Exact KSVD of K = A B^T: thin QR of A and B, SVD of the small core R_A R_B^T. Residuals come
/// from the discarded part of the core (no cancellation). O((n + m) p^2 + p^3). Runs serially.
template <typename Scalar>
void kep_svd_factorized(const KepKernelCtx<Scalar, true>& c, Index want, double rtol,
                        kep_svgp::KsvdResult<Scalar>& out) {
  run_serial([&] {
    const Index p = c.A.cols();
    const Index pa = std::min(c.n, p), pb = std::min(c.m, p);
    Matrix<Scalar> qa = c.A, qb = c.B;
    Vector<Scalar> ta, tb;
    householder_qr(qa, ta);
    householder_qr(qb, tb);
    const Matrix<Scalar> QA = householder_thin_q(qa, ta, pa);
    const Matrix<Scalar> QB = householder_thin_q(qb, tb, pb);
    const Matrix<Scalar> RA = qa.topRows(pa).template triangularView<Eigen::Upper>();
    const Matrix<Scalar> RB = qb.topRows(pb).template triangularView<Eigen::Upper>();
    const Matrix<Scalar> core = matmul<Op::N, Op::T>(RA, RB);
    Matrix<Scalar> U, W;
    Vector<Scalar> s;
    thin_svd_qr_jacobi(core, U, s, W);
    const Index r = kep_keep(s, want, rtol), k = s.size();
    out.He = matmul(QA, U.leftCols(r));
    out.Hr = matmul(QB, W.leftCols(r));
    out.lambda = s.head(r);
    out.spectrum = s;
    kep_canonical_signs(out.He, out.Hr);
    gemm(Update::Assign, out.E, c.A, matmul<Op::T>(c.B, out.Hr));
    gemm(Update::Assign, out.R, c.B, matmul<Op::T>(c.A, out.He));
    const Matrix<Scalar> TA =
        matmul(QA, Matrix<Scalar>(U.rightCols(k - r) * s.tail(k - r).asDiagonal()));
    const Matrix<Scalar> TB =
        matmul(QB, Matrix<Scalar>(W.rightCols(k - r) * s.tail(k - r).asDiagonal()));
    out.res_row = TA.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
    out.res_col = TB.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
    out.sketch = k;
  });
}

}  // namespace detail
}  // namespace effattn
