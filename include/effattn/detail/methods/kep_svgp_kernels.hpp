/// \file kep_svgp_kernels.hpp
/// \brief Internal: KEP-SVGP's attention kernels: the kernel context (pre-scaled keys or explicit
/// features), kernel rows evaluated in row blocks and applied to matrices (K X, K^T X, the Gram
/// product, the dense kernel), and the preparation of the context for each kernel policy.
/// Include <effattn/kep_svgp.hpp> instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/gemm.hpp"
#include "../../core/parallel.hpp"
#include "../../core/random.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "../../kep_svgp.hpp"

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

}  // namespace detail
}  // namespace effattn
