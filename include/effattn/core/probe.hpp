/// \file probe.hpp
/// \brief A-posteriori error estimates from sampled exact rows: draw s query rows, compute their
/// exact softmax attention (O(s m (d + dv)), no n x m matrix), and compare an approximation's
/// rows with them. Used by `AutoAttention` (effattn/auto.hpp); `estimate_relative_error` is the
/// public entry point for any method's output.
///
/// The estimate of the relative Frobenius error ||O - Ohat||_F / ||O||_F is the same ratio over
/// the sampled rows: unbiased in numerator and denominator separately for uniform samples, and
/// consistent, but not a bound. Rows whose error is much larger than the others' (a few
/// "needle" queries) are caught only when sampled, so it can be low on such data.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "errors.hpp"
#include "gemm.hpp"
#include "parallel.hpp"
#include "random.hpp"
#include "types.hpp"

namespace effattn {
namespace detail {

/// `s` distinct query rows of [0, n), increasing, drawn uniformly without replacement (partial
/// Fisher-Yates on the stream derive_seed(seed, stream)). s >= n returns every row.
inline std::vector<Index> sample_rows(Index n, Index s, std::uint64_t seed, std::uint64_t stream) {
  s = std::clamp<Index>(s, 0, n);
  std::vector<Index> all(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
  Rng rng = make_rng(seed, stream);
  for (Index i = 0; i < s; ++i) {
    const auto j =
        i + std::min(n - i - 1, static_cast<Index>(uniform01(rng) * static_cast<double>(n - i)));
    std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(j)]);
  }
  all.resize(static_cast<std::size_t>(s));
  std::sort(all.begin(), all.end());
  return all;
}

/// The rows `rows` (increasing) of Q, as a dense s x d matrix.
template <typename Scalar, typename DQ>
Matrix<Scalar> gather_rows(const Eigen::MatrixBase<DQ>& Q, const std::vector<Index>& rows) {
  Matrix<Scalar> out(static_cast<Index>(rows.size()), Q.cols());
  for (std::size_t i = 0; i < rows.size(); ++i) out.row(static_cast<Index>(i)) = Q.row(rows[i]);
  return out;
}

/// Exact softmax attention, in double, of the query rows `rows` (increasing indices into an
/// n-row Q) given as Qs (s x d), over K (m x d), V (m x dv), logit scale beta. With `causal`,
/// row i sees keys [0, i + m - n] (bottom-right aligned, as ExactAttention). Chunks of 16 rows:
/// one GEMM of the keys the chunk needs against the chunk, a max-shifted exp per column, one GEMM
/// with V; chunks run in parallel with serial GEMMs, so the bits do not depend on the thread
/// count. O(s m (d + dv)) time, O(16 m) memory per thread.
template <typename Scalar>
Matrix<double> exact_rows(const ConstRef<Scalar>& Qs, const std::vector<Index>& rows, Index n,
                          const ConstRef<Scalar>& K, const ConstRef<Scalar>& V, double beta,
                          bool causal) {
  const Index s = Qs.rows(), m = K.rows(), dv = V.cols();
  constexpr Index kChunk = 16;
  Matrix<double> out(s, dv);
  const auto visible = [&](Index i) {  // keys row i sees
    return causal ? std::clamp<Index>(rows[static_cast<std::size_t>(i)] + m - n + 1, 0, m) : m;
  };
  parallel_for((s + kChunk - 1) / kChunk, [&] { return Matrix<Scalar>(m, kChunk); },
               [&](Index t, Matrix<Scalar>& Z) {
                 const Index i0 = t * kChunk, c = std::min(kChunk, s - i0);
                 const Index len = visible(i0 + c - 1);  // rows increase, so the last sees the most
                 if (len == 0) {
                   out.middleRows(i0, c).setZero();
                   return;
                 }
                 auto Zc = Z.topLeftCorner(len, c);
                 gemm<Op::N, Op::T>(Update::Assign, Zc, K.topRows(len), Qs.middleRows(i0, c),
                                    static_cast<Scalar>(beta));
                 Matrix<double> num(dv, c);
                 for (Index j = 0; j < c; ++j) {
                   const Index lj = visible(i0 + j);
                   if (lj == 0) {
                     // A causal row with no visible key (m < n): ExactAttention gives zeros there.
                     Zc.col(j).setZero();
                     continue;
                   }
                   const Scalar mx = Zc.col(j).head(lj).maxCoeff();
                   Zc.col(j).head(lj) = (Zc.col(j).head(lj).array() - mx).exp();
                   Zc.col(j).tail(len - lj).setZero();
                 }
                 num = matmul<Op::T>(V.topRows(len), Zc).template cast<double>();
                 for (Index j = 0; j < c; ++j) {
                   const double den = Zc.col(j).template cast<double>().sum();
                   out.row(i0 + j) = den > 0 ? (num.col(j) / den).transpose()
                                             : Eigen::RowVectorXd::Zero(dv).eval();
                 }
               });
  return out;
}

/// ||A - B||_F / ||B||_F of an approximation A (s x dv, any scalar) against exact rows B
/// (double); 0 when both are zero, +inf when A is not finite.
template <typename DA>
double relative_error(const Eigen::MatrixBase<DA>& A, const Matrix<double>& B) {
  const double num = (A.template cast<double>() - B).norm();
  if (!std::isfinite(num)) return std::numeric_limits<double>::infinity();
  const double den = B.norm();
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return num / den;
}

}  // namespace detail

/// \brief A-posteriori estimate of the relative Frobenius error ||O - Ohat||_F / ||O||_F of any
/// method's output `approx` (n x dv) for Q (n x d), K (m x d), V (m x dv): the same ratio over
/// `rows` query rows drawn uniformly with `seed`, whose exact attention is computed in double.
/// O(rows m (d + dv)) time, O(16 m) memory per thread; no n x m matrix.
///
/// Works for every functor's output (EVA, Conv-Basis, KEP-SVGP, VCC's VIP rows excepted); WildCat
/// and AutoAttention compute it themselves (`target_error`). It is an estimate, not a bound: rare
/// rows much worse than the rest are seen only if sampled.
/// \param Q queries, n x d.
/// \param K keys, m x d.
/// \param V values, m x dv.
/// \param approx the approximation to judge, n x dv (the method's Result::out).
/// \param causal bottom-right aligned causal mask (requires m >= n).
/// \param rows number of query rows sampled (clamped to n; all rows when rows >= n).
/// \param scale logit scale (0 = 1/sqrt(d)), as the method's Options::scale.
/// \param seed seed of the row sample (same seed, same rows).
/// \throws effattn::invalid_argument on mismatched shapes, rows < 1, or causal with m < n.
template <typename Scalar>
double estimate_relative_error(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                               const ConstRef<Scalar>& V, const ConstRef<Scalar>& approx,
                               bool causal = false, Index rows = 64, double scale = 0,
                               std::uint64_t seed = 0x5eedULL) {
  const Index n = Q.rows(), m = K.rows();
  EFFATTN_CHECK(n > 0 && m > 0 && Q.cols() == K.cols() && V.rows() == m && approx.rows() == n &&
                    approx.cols() == V.cols(),
                detail::cat("estimate_relative_error: need Q n x d, K m x d, V m x dv and the "
                            "output n x dv; got Q ",
                            detail::shape(Q), ", K ", detail::shape(K), ", V ", detail::shape(V),
                            ", output ", detail::shape(approx)));
  EFFATTN_CHECK(rows >= 1, detail::cat("estimate_relative_error: rows must be >= 1; got ", rows));
  EFFATTN_CHECK(
      !causal || m >= n,
      detail::cat("estimate_relative_error: causal needs m >= n; got n = ", n, ", m = ", m));
  EFFATTN_CHECK(std::isfinite(scale) && scale >= 0,
                detail::cat("estimate_relative_error: scale must be finite and >= 0; got ", scale));
  const double beta = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(Q.cols()));
  const std::vector<Index> r = detail::sample_rows(n, rows, seed, 0xe57ULL);
  const Matrix<Scalar> Qs = detail::gather_rows<Scalar>(Q, r);
  const Matrix<double> ref = detail::exact_rows<Scalar>(Qs, r, n, K, V, beta, causal);
  return detail::relative_error(detail::gather_rows<Scalar>(approx, r), ref);
}

}  // namespace effattn
