/// \file kep_svgp_impl.hpp
/// \brief Internals of effattn/kep_svgp.hpp: kernel evaluation in row blocks and the three
/// truncated-KSVD engines (dense oracle, randomized range finder, factorised QR-QR-SVD).
#pragma once

#ifndef EFFATTN_KEP_SVGP_INTERNAL
#error "effattn/detail/kep_svgp_impl.hpp is internal: include <effattn/kep_svgp.hpp>"
#endif

#include <Eigen/QR>
#include <Eigen/SVD>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace effattn {
namespace detail {

/// Everything needed to evaluate kernel rows: pre-scaled keys (dense kernels) or the explicit
/// features A (n x p), B (m x p) with K = A B^T (feature kernels).
template <typename Scalar>
struct KepKernelCtx {
  const ConstRef<Scalar>* Q = nullptr;
  Matrix<Scalar> Kt;    // d x m, scale * K^T (dense kernels)
  Matrix<Scalar> A, B;  // explicit features (feature kernels)
  Scalar shift = 0;     // ExpKernel: global max logit subtracted before exp
  Index n = 0, m = 0;
  Index block = 128;  // rows per kernel block
  bool features = false;
  bool softmax = false;  // row-normalise (SoftmaxRowKernel)
  Index num_blocks() const { return (n + block - 1) / block; }
};

/// Runs `f` inside a one-task effattn parallel region. Eigen's GEMM is serial there, so the
/// products in `f` do not depend on the thread count (Eigen's own parallel GEMM picks its
/// blocking from the thread count, which changes the rounding).
template <typename F>
void kep_serial(F&& f) {
  parallel_for(
      1, [] { return 0; }, [&](Index, int&) { f(); });
}

/// Rows [r0, r0 + rows) of the kernel into `out` (rows x m).
template <typename Scalar>
void kep_kernel_block(const KepKernelCtx<Scalar>& c, Index r0, Index rows, Matrix<Scalar>& out) {
  out.resize(rows, c.m);
  if (c.features) {
    out.noalias() = c.A.middleRows(r0, rows) * c.B.transpose();
    return;
  }
  out.noalias() = c.Q->middleRows(r0, rows) * c.Kt;
  if (c.softmax)
    row_softmax_inplace(out);
  else
    out = (out.array() - c.shift).exp().matrix();
}

/// Adds the squared norm of every row of `Kb` (accumulated in double) to `acc`.
template <typename Scalar>
void kep_row_sqnorms(const Matrix<Scalar>& Kb, Eigen::Ref<Eigen::VectorXd> acc) {
  for (Index j = 0; j < Kb.cols(); ++j)
    acc.array() += Kb.col(j).array().template cast<double>().square();
}

/// Number of fixed accumulation groups of the K^T products: partial sums are formed per group
/// and added in a fixed order, so results do not depend on the thread count.
constexpr Index kKepGroups = 8;

/// Y = K X (n x c), streamed; optionally the squared row norms of K (double).
template <typename Scalar>
Matrix<Scalar> kep_apply(const KepKernelCtx<Scalar>& c, const Matrix<Scalar>& X,
                         Eigen::VectorXd* row_sq = nullptr) {
  Matrix<Scalar> Y(c.n, X.cols());
  if (c.features) {
    kep_serial([&] {
      Y.noalias() = c.A * (c.B.transpose() * X);
      if (row_sq) {
        const Matrix<double> G = (c.B.transpose() * c.B).template cast<double>();
        const Matrix<double> Ad = c.A.template cast<double>();
        *row_sq = (Ad * G).cwiseProduct(Ad).rowwise().sum();
      }
    });
    return Y;
  }
  if (row_sq) row_sq->setZero(c.n);
  parallel_for(
      c.num_blocks(), [] { return Matrix<Scalar>(); },
      [&](Index b, Matrix<Scalar>& Kb) {
        const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
        kep_kernel_block(c, r0, rows, Kb);
        Y.middleRows(r0, rows).noalias() = Kb * X;
        if (row_sq) kep_row_sqnorms(Kb, row_sq->segment(r0, rows));
      });
  return Y;
}

/// Z = K^T X (m x c) for X (n x c), streamed with fixed groups; optionally the squared column
/// norms of K (double).
template <typename Scalar>
Matrix<Scalar> kep_apply_transpose(const KepKernelCtx<Scalar>& c, const Matrix<Scalar>& X,
                                   Eigen::VectorXd* col_sq = nullptr) {
  if (c.features) {
    Matrix<Scalar> Z;
    kep_serial([&] {
      Z = c.B * (c.A.transpose() * X);
      if (col_sq) {
        const Matrix<double> G = (c.A.transpose() * c.A).template cast<double>();
        const Matrix<double> Bd = c.B.template cast<double>();
        *col_sq = (Bd * G).cwiseProduct(Bd).rowwise().sum();
      }
    });
    return Z;
  }
  const Index nb = c.num_blocks(), groups = std::min(kKepGroups, nb);
  std::vector<Matrix<Scalar>> part(static_cast<std::size_t>(groups));
  std::vector<Eigen::VectorXd> csq(static_cast<std::size_t>(groups));
  parallel_for(
      groups, [] { return Matrix<Scalar>(); },
      [&](Index g, Matrix<Scalar>& Kb) {
        Matrix<Scalar>& Zg = part[static_cast<std::size_t>(g)];
        Zg.setZero(c.m, X.cols());
        if (col_sq) csq[static_cast<std::size_t>(g)].setZero(c.m);
        for (Index b = g * nb / groups; b < (g + 1) * nb / groups; ++b) {
          const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
          kep_kernel_block(c, r0, rows, Kb);
          Zg.noalias() += Kb.transpose() * X.middleRows(r0, rows);
          if (col_sq)
            csq[static_cast<std::size_t>(g)] +=
                Kb.template cast<double>().colwise().squaredNorm().transpose();
        }
      });
  Matrix<Scalar> Z = std::move(part[0]);
  for (std::size_t g = 1; g < part.size(); ++g) Z += part[g];
  if (col_sq) {
    *col_sq = csq[0];
    for (std::size_t g = 1; g < csq.size(); ++g) *col_sq += csq[g];
  }
  return Z;
}

/// Z = K^T K X (m x c) for X (m x c) in ONE streamed pass: each kernel block is formed once and
/// used twice, sum_b K_b^T (K_b X) (fixed groups, fixed summation order).
template <typename Scalar>
Matrix<Scalar> kep_apply_gram(const KepKernelCtx<Scalar>& c, const Matrix<Scalar>& X) {
  if (c.features) {
    Matrix<Scalar> Z;
    kep_serial([&] { Z = c.B * ((c.A.transpose() * c.A) * (c.B.transpose() * X)); });
    return Z;
  }
  const Index nb = c.num_blocks(), groups = std::min(kKepGroups, nb);
  std::vector<Matrix<Scalar>> part(static_cast<std::size_t>(groups));
  struct Ws {
    Matrix<Scalar> Kb, Yb;
  };
  parallel_for(
      groups, [] { return Ws(); },
      [&](Index g, Ws& ws) {
        Matrix<Scalar>& Zg = part[static_cast<std::size_t>(g)];
        Zg.setZero(c.m, X.cols());
        for (Index b = g * nb / groups; b < (g + 1) * nb / groups; ++b) {
          const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
          kep_kernel_block(c, r0, rows, ws.Kb);
          ws.Yb.noalias() = ws.Kb * X;
          Zg.noalias() += ws.Kb.transpose() * ws.Yb;
        }
      });
  Matrix<Scalar> Z = std::move(part[0]);
  for (std::size_t g = 1; g < part.size(); ++g) Z += part[g];
  return Z;
}

/// The dense n x m kernel (oracle paths only).
template <typename Scalar>
Matrix<Scalar> kep_dense_kernel(const KepKernelCtx<Scalar>& c) {
  if (c.features) return c.A * c.B.transpose();
  Matrix<Scalar> Kd(c.n, c.m);
  parallel_for(
      c.num_blocks(), [] { return Matrix<Scalar>(); },
      [&](Index b, Matrix<Scalar>& Kb) {
        const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
        kep_kernel_block(c, r0, rows, Kb);
        Kd.middleRows(r0, rows) = Kb;
      });
  return Kd;
}

/// Thin orthonormal basis of the columns of X (Householder QR; orthonormal even when X is
/// rank deficient).
template <typename Scalar>
Matrix<Scalar> kep_orth(const Matrix<Scalar>& X) {
  Eigen::HouseholderQR<Matrix<Scalar>> qr(X);
  return qr.householderQ() * Matrix<Scalar>::Identity(X.rows(), X.cols());
}

/// Thin SVD of a small or dense matrix: JacobiSVD up to 16 columns/rows, BDCSVD beyond.
template <typename Scalar>
void kep_thin_svd(const Matrix<Scalar>& X, Matrix<Scalar>& U, Vector<Scalar>& s,
                  Matrix<Scalar>& W) {
  if (std::min(X.rows(), X.cols()) > 16) {
    Eigen::BDCSVD<Matrix<Scalar>> svd(X, Eigen::ComputeThinU | Eigen::ComputeThinV);
    U = svd.matrixU();
    s = svd.singularValues();
    W = svd.matrixV();
    // Eigen 3.4's BDCSVD can return NaN on exactly degenerate inputs (e.g. a near-permutation
    // softmax kernel with repeated rows); JacobiSVD is slower but robust.
    if (all_finite(U) && all_finite(W) && all_finite(s)) return;
  }
  Eigen::JacobiSVD<Matrix<Scalar>> svd(X, Eigen::ComputeThinU | Eigen::ComputeThinV);
  U = svd.matrixU();
  s = svd.singularValues();
  W = svd.matrixV();
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
inline Eigen::VectorXd kep_clamped_diff(const Eigen::VectorXd& a, const Eigen::VectorXd& b) {
  return (a - b).cwiseMax(0.0);
}

/// Dense kernels: pre-scaled keys; ExpKernel also needs the global max logit (one extra pass).
template <typename Scalar>
void kep_prepare_dense(KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                       const ConstRef<Scalar>& K, double scale, bool softmax) {
  c.Q = &Q;
  c.n = Q.rows();
  c.m = K.rows();
  c.features = false;
  c.softmax = softmax;
  c.Kt = K.transpose() * static_cast<Scalar>(scale);
  if (softmax) return;
  std::vector<Scalar> mx(static_cast<std::size_t>(c.num_blocks()));
  parallel_for(
      c.num_blocks(), [] { return Matrix<Scalar>(); },
      [&](Index b, Matrix<Scalar>& L) {
        const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
        L.noalias() = Q.middleRows(r0, rows) * c.Kt;
        mx[static_cast<std::size_t>(b)] = L.maxCoeff();
      });
  c.shift = *std::max_element(mx.begin(), mx.end());
}

/// Rows of X divided by max(||x||, 1e-12) (torch.nn.functional.normalize): zero rows stay zero.
/// blueNorm: a plain norm() squares the entries, so rows of ~1e200 became zero rows (the norm
/// overflowed to inf). Rows with norm below 1e-12 are divided by 1e-12, as torch does.
template <typename Scalar>
Matrix<Scalar> kep_l2_normalize(const ConstRef<Scalar>& X) {
  const Eigen::VectorXd nrm = X.template cast<double>().rowwise().blueNorm();
  return (nrm.cwiseMax(1e-12).cwiseInverse().template cast<Scalar>().asDiagonal() * X);
}

/// Positive random features of exp(scale q.k), row-normalised (Performer / FAVOR+):
/// phi(x)_r = exp(w_r.x~ - |x~|^2/2), x~ = sqrt(scale) x, w_r ~ N(0, I_d) from stream 1 of the
/// seed. Query features are shifted by their row max and key features by their global max
/// (both cancel in the row normalisation), so nothing overflows. A row whose features all
/// underflow becomes zero.
template <typename Scalar>
void kep_prepare_prf_serial(KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q,
                            const ConstRef<Scalar>& K, double scale, Index features,
                            std::uint64_t seed) {
  Rng rng = make_rng(seed, 1);
  const Matrix<double> Wf = random_normal<double>(Q.cols(), features, rng);
  const double rs = std::sqrt(scale);
  auto logfeat = [&](const ConstRef<Scalar>& X) {
    const Matrix<double> Xs = X.template cast<double>() * rs;
    Matrix<double> L = Xs * Wf;
    L.colwise() -= 0.5 * Xs.rowwise().squaredNorm();
    return L;
  };
  Matrix<double> Lq = logfeat(Q), Lk = logfeat(K);
  const Eigen::VectorXd qmax = Lq.rowwise().maxCoeff();
  Lq.colwise() -= qmax;
  const double kmax = Lk.maxCoeff();
  Matrix<double> Aq = Lq.array().exp().matrix();
  const Matrix<double> Bk = (Lk.array() - kmax).exp().matrix();
  const Eigen::VectorXd den = Aq * Bk.colwise().sum().transpose();
  for (Index i = 0; i < c.n; ++i) Aq.row(i) *= den(i) > 0 ? 1.0 / den(i) : 0.0;
  c.A = Aq.template cast<Scalar>();
  c.B = Bk.template cast<Scalar>();
}

template <typename Scalar>
void kep_prepare_prf(KepKernelCtx<Scalar>& c, const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                     double scale, Index features, std::uint64_t seed) {
  c.n = Q.rows();
  c.m = K.rows();
  c.features = true;
  kep_serial([&] { kep_prepare_prf_serial(c, Q, K, scale, features, seed); });
}

/// Dense oracle: the formed kernel, BDCSVD (JacobiSVD up to 16), exact residuals.
template <typename Scalar>
void kep_svd_dense(const KepKernelCtx<Scalar>& c, Index want, double rtol,
                   kepsvgp::KsvdResult<Scalar>& out) {
  const Matrix<Scalar> Kd = kep_dense_kernel(c);
  Matrix<Scalar> U, W;
  Vector<Scalar> s;
  kep_thin_svd(Kd, U, s, W);
  const Index r = kep_keep(s, want, rtol);
  out.He = U.leftCols(r);
  out.Hr = W.leftCols(r);
  out.lambda = s.head(r);
  out.spectrum = s;
  kep_canonical_signs(out.He, out.Hr);
  out.E.noalias() = Kd * out.Hr;
  out.R.noalias() = Kd.transpose() * out.He;
  // Residuals formed directly from K (no cancellation): (K - K_s) and (K - H_e H_e^T K).
  Matrix<double> Res = Kd.template cast<double>();
  Res.noalias() -= out.E.template cast<double>() * out.Hr.template cast<double>().transpose();
  out.res_row = Res.rowwise().squaredNorm().template cast<Scalar>();
  Res = Kd.template cast<double>();
  Res.noalias() -= out.He.template cast<double>() * out.R.template cast<double>().transpose();
  out.res_col = Res.colwise().squaredNorm().transpose().template cast<Scalar>();
  out.sketch = std::min(c.n, c.m);
}

/// Randomized range finder on the ROW space (Halko, Martinsson, Tropp 2011, Alg. 4.4 applied to
/// K^T): Z <- orth(K^T K Z) for power + 1 fused passes from a Gaussian m x l start, then
/// C = K Z exactly, SVD of C. Each kernel block is formed once per pass; q + 2 kernel passes in
/// total (the column-space algorithm needs 2q + 2). E = K H_r = C W is exact, so the residual
/// ||K_i||^2 - ||E_i||^2 is the exact projection residual of the computed subspace.
template <typename Scalar>
void kep_svd_randomized(const KepKernelCtx<Scalar>& c, Index want, double rtol, Index oversample,
                        int power, std::uint64_t seed, bool need_r,
                        kepsvgp::KsvdResult<Scalar>& out) {
  const Index l = std::min(want + oversample, std::min(c.n, c.m));
  Rng rng = make_rng(seed, 0);
  Matrix<Scalar> Z = random_normal<Scalar>(c.m, l, rng);
  for (int t = 0; t <= power; ++t) {
    const Matrix<Scalar> G = kep_apply_gram(c, Z);
    kep_serial([&] { Z = kep_orth(G); });
  }
  Eigen::VectorXd rsq;
  const Matrix<Scalar> C = kep_apply(c, Z, &rsq);
  Matrix<Scalar> U, W;
  Vector<Scalar> s;
  kep_serial([&] { kep_thin_svd(C, U, s, W); });
  const Index r = kep_keep(s, want, rtol);
  out.He = U.leftCols(r);
  Matrix<Scalar> Wr = W.leftCols(r);
  kep_serial([&] { out.Hr.noalias() = Z * Wr; });
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
  kep_serial([&] { out.E.noalias() = C * Wr; });
  out.res_row = kep_clamped_diff(rsq, out.E.template cast<double>().rowwise().squaredNorm())
                    .template cast<Scalar>();
  out.sketch = l;
  if (need_r) {
    Eigen::VectorXd csq;
    out.R = kep_apply_transpose(c, out.He, &csq);
    out.res_col = kep_clamped_diff(csq, out.R.template cast<double>().rowwise().squaredNorm())
                      .template cast<Scalar>();
  } else {
    out.R.resize(0, 0);
    out.res_col.resize(0);
  }
}

/// Exact KSVD of K = A B^T: thin QR of A and B, SVD of the small core R_A R_B^T. Residuals come
/// from the discarded part of the core (no cancellation). O((n + m) p^2 + p^3).
template <typename Scalar>
void kep_svd_factorized_serial(const KepKernelCtx<Scalar>& c, Index want, double rtol,
                               kepsvgp::KsvdResult<Scalar>& out) {
  const Index p = c.A.cols();
  const Index pa = std::min(c.n, p), pb = std::min(c.m, p);
  Eigen::HouseholderQR<Matrix<Scalar>> qa(c.A), qb(c.B);
  const Matrix<Scalar> QA = qa.householderQ() * Matrix<Scalar>::Identity(c.n, pa);
  const Matrix<Scalar> QB = qb.householderQ() * Matrix<Scalar>::Identity(c.m, pb);
  const Matrix<Scalar> RA = qa.matrixQR().topRows(pa).template triangularView<Eigen::Upper>();
  const Matrix<Scalar> RB = qb.matrixQR().topRows(pb).template triangularView<Eigen::Upper>();
  const Matrix<Scalar> core = RA * RB.transpose();
  Matrix<Scalar> U, W;
  Vector<Scalar> s;
  kep_thin_svd(core, U, s, W);
  const Index r = kep_keep(s, want, rtol), k = s.size();
  out.He = QA * U.leftCols(r);
  out.Hr = QB * W.leftCols(r);
  out.lambda = s.head(r);
  out.spectrum = s;
  kep_canonical_signs(out.He, out.Hr);
  out.E.noalias() = c.A * (c.B.transpose() * out.Hr);
  out.R.noalias() = c.B * (c.A.transpose() * out.He);
  const Matrix<Scalar> TA = QA * (U.rightCols(k - r) * s.tail(k - r).asDiagonal());
  const Matrix<Scalar> TB = QB * (W.rightCols(k - r) * s.tail(k - r).asDiagonal());
  out.res_row = TA.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
  out.res_col = TB.template cast<double>().rowwise().squaredNorm().template cast<Scalar>();
  out.sketch = k;
}

template <typename Scalar>
void kep_svd_factorized(const KepKernelCtx<Scalar>& c, Index want, double rtol,
                        kepsvgp::KsvdResult<Scalar>& out) {
  kep_serial([&] { kep_svd_factorized_serial(c, want, rtol, out); });
}

}  // namespace detail
}  // namespace effattn
