/// \file kep_svgp_impl.hpp
/// \brief Implementation of effattn/kep_svgp.hpp: kernel evaluation in row blocks, the three
/// truncated-KSVD engines (dense oracle, randomized range finder, factorised QR-QR-SVD), the
/// posterior assembly and sampling of KepSvgpAttention, and the trainer utilities.
#pragma once

#include "../kep_svgp.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/checks.hpp"
#include "../core/errors.hpp"
#include "../core/gemm.hpp"
#include "../core/parallel.hpp"
#include "../core/random.hpp"
#include "../core/softmax.hpp"
#include "../core/types.hpp"
#include "householder.hpp"
#include "jacobi_svd.hpp"

namespace effattn {
namespace detail {

/// Everything needed to evaluate kernel rows: pre-scaled keys (dense kernels, Features = false)
/// or the explicit features A (n x p), B (m x p) with K = A B^T (Features = true).
template <typename Scalar, bool Features>
struct KepKernelCtx {
  const ConstRef<Scalar>* Q = nullptr;
  Matrix<Scalar> Kt;    // d x m, scale * K^T (dense kernels)
  Matrix<Scalar> A, B;  // explicit features (feature kernels)
  Scalar shift = 0;     // ExpKernel: global max logit subtracted before exp
  Index n = 0, m = 0;
  Index block = 128;     // rows per kernel block
  bool softmax = false;  // row-normalise (SoftmaxRowKernel)
  Index num_blocks() const { return (n + block - 1) / block; }
};

/// Per-thread buffers of the streamed kernel passes, allocated once per thread per pass (sized
/// for a full block; the last, shorter block uses the leading rows): no allocation per block.
template <typename Scalar>
struct KepBlockWs {
  Matrix<Scalar> P;      ///< block x m: exp(logits - row max), NOT row-normalised
  Matrix<Scalar> Y;      ///< block x c: the block's product with the right-hand side
  Vector<Scalar> inv;    ///< block: 1 / row sum (softmax) or 1 (ExpKernel)
  Vector<Scalar> shift;  ///< block: row max (softmax)
  Eigen::ArrayXd sum;    ///< block: row sums (softmax) or squared row norms, in double
  KepBlockWs(Index block, Index m, Index c)
      : P(block, m), Y(block, c), inv(block), shift(block), sum(block) {}
};

/// Rows [r0, r0 + rows) of a dense kernel, unnormalised, into the leading rows of ws.P:
/// K_b = diag(ws.inv) ws.P. The logits are one GEMM (rows x d times d x m) in Scalar; the
/// exponentials are Eigen's vectorised exp, column by column over the (cache-resident) block,
/// with the masked scalar form only for columns holding a -inf; row sums are accumulated in
/// double. The row normalisation is applied by the callers to the skinny products (rows x c)
/// instead of the block (rows x m), which saves one pass over the block.
template <typename Scalar>
void kep_kernel_block(const KepKernelCtx<Scalar, false>& c, Index r0, Index rows,
                      KepBlockWs<Scalar>& ws) {
  auto P = ws.P.topRows(rows);
  gemm(Update::Assign, P, c.Q->middleRows(r0, rows), c.Kt);
  auto inv = ws.inv.head(rows);
  if (!c.softmax) {
    P = (P.array() - c.shift).exp().matrix();
    inv.setOnes();
    return;
  }
  auto shift = ws.shift.head(rows);
  auto mx = shift.array();
  row_max_into(P, mx);
  shift = finite_or_zero(shift.array()).matrix();
  auto sum = ws.sum.head(rows);
  sum.setZero();
  for_each_exp_column(P, shift, [&](Index j, const auto& e) {
    P.col(j).array() = e;
    sum += P.col(j).array().template cast<double>();
  });
  for (Index i = 0; i < rows; ++i)
    inv(i) = sum(i) > 0 ? static_cast<Scalar>(1.0 / sum(i)) : Scalar(0);
}

/// Number of fixed accumulation groups of the K^T products: partial sums are formed per group
/// and added in a fixed order, so results do not depend on the thread count (16 groups keep
/// two to eight threads busy to the end of a pass on a loaded machine).
constexpr Index kKepGroups = 16;

/// Sum of the group partials in group order (fixed rounding).
template <typename T>
T kep_sum_groups(std::vector<T>& part) {
  T z = std::move(part[0]);
  for (std::size_t g = 1; g < part.size(); ++g) z += part[g];
  return z;
}

/// Y = K X (n x c), streamed; optionally the squared row norms of K (double).
template <typename Scalar, bool Features>
Matrix<Scalar> kep_apply(const KepKernelCtx<Scalar, Features>& c, const Matrix<Scalar>& X,
                         Eigen::VectorXd* row_sq = nullptr) {
  Matrix<Scalar> Y(c.n, X.cols());
  if constexpr (Features) {
    run_serial([&] {
      gemm(Update::Assign, Y, c.A, matmul<Op::T>(c.B, X));
      if (row_sq) {
        const Matrix<double> G = matmul<Op::T>(c.B, c.B).template cast<double>();
        const Matrix<double> Ad = c.A.template cast<double>();
        *row_sq = matmul(Ad, G).cwiseProduct(Ad).rowwise().sum();
      }
    });
  } else {
    if (row_sq) row_sq->setZero(c.n);
    parallel_for(
        c.num_blocks(), [&] { return KepBlockWs<Scalar>(c.block, c.m, X.cols()); },
        [&](Index b, KepBlockWs<Scalar>& ws) {
          const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
          kep_kernel_block(c, r0, rows, ws);
          const auto P = ws.P.topRows(rows);
          const auto inv = ws.inv.head(rows);
          gemm(Update::Assign, Y.middleRows(r0, rows), P, X);
          Y.middleRows(r0, rows) = inv.asDiagonal() * Y.middleRows(r0, rows);
          if (row_sq) {
            auto sq = ws.sum.head(rows);
            sq.setZero();
            for (Index j = 0; j < c.m; ++j) sq += P.col(j).array().template cast<double>().square();
            row_sq->segment(r0, rows) =
                (sq * inv.array().template cast<double>().square()).matrix();
          }
        });
  }
  return Y;
}

/// Z = K^T X (m x c) for X (n x c), streamed with fixed groups; optionally the squared column
/// norms of K (double).
template <typename Scalar, bool Features>
Matrix<Scalar> kep_apply_transpose(const KepKernelCtx<Scalar, Features>& c, const Matrix<Scalar>& X,
                                   Eigen::VectorXd* col_sq = nullptr) {
  if constexpr (Features) {
    Matrix<Scalar> Z;
    run_serial([&] {
      Z = matmul(c.B, matmul<Op::T>(c.A, X));
      if (col_sq) {
        const Matrix<double> G = matmul<Op::T>(c.A, c.A).template cast<double>();
        const Matrix<double> Bd = c.B.template cast<double>();
        *col_sq = matmul(Bd, G).cwiseProduct(Bd).rowwise().sum();
      }
    });
    return Z;
  } else {
    const Index nb = c.num_blocks(), groups = std::min(kKepGroups, nb);
    std::vector<Matrix<Scalar>> part(static_cast<std::size_t>(groups));
    std::vector<Eigen::VectorXd> csq(static_cast<std::size_t>(groups));
    parallel_for(
        groups, [&] { return KepBlockWs<Scalar>(c.block, c.m, X.cols()); },
        [&](Index g, KepBlockWs<Scalar>& ws) {
          Matrix<Scalar>& Zg = part[static_cast<std::size_t>(g)];
          Zg.setZero(c.m, X.cols());
          if (col_sq) csq[static_cast<std::size_t>(g)].setZero(c.m);
          Eigen::ArrayXd inv_d;
          for (Index b = g * nb / groups; b < (g + 1) * nb / groups; ++b) {
            const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
            kep_kernel_block(c, r0, rows, ws);
            const auto P = ws.P.topRows(rows);
            const auto inv = ws.inv.head(rows);
            auto W = ws.Y.topRows(rows);
            W = inv.asDiagonal() * X.middleRows(r0, rows);  // K_b^T X_b = P^T diag(inv) X_b
            gemm<Op::T>(Update::Add, Zg, P, W);
            if (col_sq) {
              inv_d = inv.array().template cast<double>().square();
              auto& cs = csq[static_cast<std::size_t>(g)];
              for (Index j = 0; j < c.m; ++j)
                cs(j) += (P.col(j).array().template cast<double>().square() * inv_d).sum();
            }
          }
        });
    if (col_sq) *col_sq = kep_sum_groups(csq);
    return kep_sum_groups(part);
  }
}

/// Z = K^T K X (m x c) for X (m x c) in ONE streamed pass: each kernel block is formed once and
/// used twice, sum_b K_b^T (K_b X) = sum_b P_b^T (diag(inv_b)^2 P_b X), three GEMMs per block
/// (logits, P_b X, P_b^T W_b) on a block sized to stay in the L2 cache (fixed groups, fixed
/// summation order).
template <typename Scalar, bool Features>
Matrix<Scalar> kep_apply_gram(const KepKernelCtx<Scalar, Features>& c, const Matrix<Scalar>& X) {
  if constexpr (Features) {
    Matrix<Scalar> Z;
    run_serial([&] { Z = matmul(c.B, matmul(matmul<Op::T>(c.A, c.A), matmul<Op::T>(c.B, X))); });
    return Z;
  } else {
    const Index nb = c.num_blocks(), groups = std::min(kKepGroups, nb);
    std::vector<Matrix<Scalar>> part(static_cast<std::size_t>(groups));
    parallel_for(
        groups, [&] { return KepBlockWs<Scalar>(c.block, c.m, X.cols()); },
        [&](Index g, KepBlockWs<Scalar>& ws) {
          Matrix<Scalar>& Zg = part[static_cast<std::size_t>(g)];
          Zg.setZero(c.m, X.cols());
          for (Index b = g * nb / groups; b < (g + 1) * nb / groups; ++b) {
            const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
            kep_kernel_block(c, r0, rows, ws);
            const auto P = ws.P.topRows(rows);
            auto W = ws.Y.topRows(rows);
            gemm(Update::Assign, W, P, X);
            W = ws.inv.head(rows).array().square().matrix().asDiagonal() * W;
            gemm<Op::T>(Update::Add, Zg, P, W);
          }
        });
    return kep_sum_groups(part);
  }
}

/// The dense n x m kernel (DenseSvd only).
template <typename Scalar, bool Features>
Matrix<Scalar> kep_dense_kernel(const KepKernelCtx<Scalar, Features>& c) {
  if constexpr (Features) {
    return matmul<Op::N, Op::T>(c.A, c.B);
  } else {
    Matrix<Scalar> Kd(c.n, c.m);
    parallel_for(
        c.num_blocks(), [&] { return KepBlockWs<Scalar>(c.block, c.m, 0); },
        [&](Index b, KepBlockWs<Scalar>& ws) {
          const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
          kep_kernel_block(c, r0, rows, ws);
          Kd.middleRows(r0, rows) = ws.inv.head(rows).asDiagonal() * ws.P.topRows(rows);
        });
    return Kd;
  }
}

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
/// one-sided Jacobi (`thin_svd_qr_jacobi`, detail/jacobi_svd.hpp), in one serial region so that
/// its products round the same way for any thread count.
///
/// Not Eigen's BDCSVD, which the oracle used until 2026-12-01: Eigen 3.4.0's divide and conquer
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

/// Dense kernels: pre-scaled keys; ExpKernel also needs the global max logit (one extra pass).
template <typename Scalar>
void kep_prepare_dense(KepKernelCtx<Scalar, false>& c, const ConstRef<Scalar>& Q,
                       const ConstRef<Scalar>& K, double scale, bool softmax) {
  c.Q = &Q;
  c.n = Q.rows();
  c.m = K.rows();
  c.softmax = softmax;
  c.Kt = K.transpose() * static_cast<Scalar>(scale);
  if (softmax) return;
  std::vector<Scalar> mx(static_cast<std::size_t>(c.num_blocks()));
  parallel_for(
      c.num_blocks(), [] { return Matrix<Scalar>(); },
      [&](Index b, Matrix<Scalar>& L) {
        const Index r0 = b * c.block, rows = std::min(c.block, c.n - r0);
        gemm(Update::Assign, L, Q.middleRows(r0, rows), c.Kt);
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
/// underflow becomes zero. Runs serially (thread-count independent products).
template <typename Scalar>
void kep_prepare_prf(KepKernelCtx<Scalar, true>& c, const ConstRef<Scalar>& Q,
                     const ConstRef<Scalar>& K, double scale, Index features, std::uint64_t seed) {
  c.n = Q.rows();
  c.m = K.rows();
  run_serial([&] {
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
  });
}

/// Automatic kernel rows per block for m keys: about 2M entries, 32..256 rows. Measured at
/// n = m = 4096, float, 2 threads (time / exact Tiled, q = 0): 256 rows 2.78, 128 2.80, 64 2.83,
/// 32 3.18; the blocks stream from L3 at the same speed as from L2, and the GEMMs of taller
/// blocks (the K^T accumulation has the block's rows as its depth) are more efficient.
inline Index kep_auto_block(Index m) {
  return std::max<Index>(32, std::min<Index>(256, (Index{1} << 21) / std::max<Index>(m, 1)));
}

/// Builds the kernel context of policy `Kernel` for (Q, K) (the kernel itself is applied
/// lazily, in blocks, by kep_apply and friends).
template <typename Kernel, typename Scalar>
void kep_prepare(KepKernelCtx<Scalar, Kernel::has_features>& c, const ConstRef<Scalar>& Q,
                 const ConstRef<Scalar>& K, const KepSvgpOptions& o) {
  const Index m = K.rows();
  c.block =
      std::min(o.block_rows > 0 ? o.block_rows : kep_auto_block(m), std::max<Index>(Q.rows(), 1));
  c.n = Q.rows();
  c.m = m;
  const double scale = resolve_scale(o.scale, Q.cols());
  if constexpr (std::is_same_v<Kernel, policy::SoftmaxRowKernel>) {
    kep_prepare_dense(c, Q, K, scale, true);
  } else if constexpr (std::is_same_v<Kernel, policy::ExpKernel>) {
    kep_prepare_dense(c, Q, K, scale, false);
  } else if constexpr (std::is_same_v<Kernel, policy::CosineKernel>) {
    c.A = kep_l2_normalize(Q);
    c.B = kep_l2_normalize(K);
  } else if constexpr (std::is_same_v<Kernel, policy::LinearKernel>) {
    c.A = Q * static_cast<Scalar>(scale);
    c.B = K;
  } else {
    static_assert(is_prf_kernel<Kernel>::value,
                  "effattn: KepSvgpAttention Kernel must be policy::SoftmaxRowKernel, ExpKernel, "
                  "CosineKernel, LinearKernel or PositiveRandomFeatureKernel<M>");
    kep_prepare_prf(c, Q, K, scale, Kernel::features, o.seed);
  }
}

/// Dense oracle: the formed kernel, its full thin SVD (QR + one-sided Jacobi), exact residuals.
template <typename Scalar, bool Features>
void kep_svd_dense(const KepKernelCtx<Scalar, Features>& c, Index want, double rtol,
                   kepsvgp::KsvdResult<Scalar>& out) {
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
                           kepsvgp::KsvdResult<Scalar>& out) {
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
void kep_randomized_r(const KepKernelCtx<Scalar, Features>& c, kepsvgp::KsvdResult<Scalar>& out) {
  Eigen::VectorXd csq;
  out.R = kep_apply_transpose(c, out.He, &csq);
  out.res_col = kep_clamped_diff(csq, out.R.template cast<double>().rowwise().squaredNorm())
                    .template cast<Scalar>();
}

/// Exact KSVD of K = A B^T: thin QR of A and B, SVD of the small core R_A R_B^T. Residuals come
/// from the discarded part of the core (no cancellation). O((n + m) p^2 + p^3). Runs serially.
template <typename Scalar>
void kep_svd_factorized(const KepKernelCtx<Scalar, true>& c, Index want, double rtol,
                        kepsvgp::KsvdResult<Scalar>& out) {
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

/// var(:, c) += row norms^2 of F Lambda^-1 L_c (leading r x r block of L_c, lower part).
template <typename Scalar>
void kep_add_vp_variance(const Matrix<Scalar>& F, const Vector<Scalar>& inv,
                         const kepsvgp::VariationalParams<Scalar>& vp, Matrix<Scalar>& var) {
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
      is_one_of(m_opts.cov, {kepsvgp::CovMode::Full, kepsvgp::CovMode::Approx}) &&
          is_one_of(m_opts.prior,
                    {kepsvgp::PriorScale::Auto, kepsvgp::PriorScale::ValueSecondMoment,
                     kepsvgp::PriorScale::Unit}) &&
          is_one_of(m_opts.rbranch, {kepsvgp::RBranch::Shared, kepsvgp::RBranch::Transpose}),
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
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::operator()(const Ref& Q, const Ref& K,
                                                          const Ref& V) const {
  Result r = run(Q, K, V, nullptr);
  if (r.info != Info::Success) detail::throw_numerical_error(name, r.info);
  return std::move(r.output);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::Result
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::run(const Ref& Q, const Ref& K, const Ref& V,
                                                   const VariationalParams* vp) const {
  using detail::cat;
  detail::check_attention_inputs(Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), dv = V.cols();
  const Index want = std::min(m_opts.rank, std::min(n, m));
  const bool transpose = !kEOnly && m_opts.rbranch == kepsvgp::RBranch::Transpose;
  EFFATTN_CHECK(!(kAdd || transpose) || n == m,
                cat(name, ": Addition merge and RBranch::Transpose need n = m; got Q ",
                    detail::shape(Q), ", K ", detail::shape(K)));
  if (vp) check_vp(*vp, want, dv);

  Result res;
  detail::KepKernelCtx<Scalar, Kernel::has_features> c;
  detail::kep_prepare<Kernel>(c, Q, K, m_opts);
  res.kernel_shift = static_cast<double>(c.shift);
  kepsvgp::KsvdResult<Scalar>& ks = res.ksvd;
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
                                                      kepsvgp::SampleMode mode, Rng& rng) const {
  return draw(Q, K, res, mode, rng, nullptr);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kepsvgp::SampleMode mode, Rng& rng,
                                                      const VariationalParams& vp) const {
  return draw(Q, K, res, mode, rng, &vp);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kepsvgp::SampleMode mode,
                                                      std::uint64_t seed) const {
  Rng rng = make_rng(seed, 2);
  return draw(Q, K, res, mode, rng, nullptr);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::sample(const Ref& Q, const Ref& K, const Result& res,
                                                      kepsvgp::SampleMode mode, std::uint64_t seed,
                                                      const VariationalParams& vp) const {
  Rng rng = make_rng(seed, 2);
  return draw(Q, K, res, mode, rng, &vp);
}

template <typename Scalar_, typename Kernel, typename Svd, typename Merge>
typename KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::MatrixType
KepSvgpAttention<Scalar_, Kernel, Svd, Merge>::draw(const Ref& Q, const Ref& K, const Result& res,
                                                    kepsvgp::SampleMode mode, Rng& rng,
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
  if (mode == kepsvgp::SampleMode::Marginal) {
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
  const bool full = m_opts.cov == kepsvgp::CovMode::Full;
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

// ---- Trainer utilities --------------------------------------------------------------------------

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
