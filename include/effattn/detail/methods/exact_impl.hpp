/// \file exact_impl.hpp
/// \brief Implementation of `ExactAttention` (exact.hpp): the Naive kernel and the out-of-class
/// member definitions. The Tiled kernel is the shared online-softmax kernel of
/// `core/online_softmax.hpp`.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../../core/checks.hpp"
#include "../../core/gemm.hpp"
#include "../../core/isa.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/softmax.hpp"
#include "../../core/types.hpp"
#include "../../exact.hpp"
#include "bf16_attention.hpp"

namespace effattn {
namespace detail {

/// The softmax probabilities of the Naive kernel, in double: S = (s Q) K^T + 1 b^T with the
/// causal mask as -inf, replaced in place by row_softmax(S) (max-subtracted, sums in double);
/// returns the row log-sum-exp values. n m doubles of memory, 2 n m d flops. Shared by the Naive
/// forward and backward.
template <typename Scalar>
Vector<double> naive_probabilities(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K,
                                   const Scalar* bias, double scale, bool causal,
                                   Matrix<double>& S) {
  const Index n = Q.rows(), m = K.rows();
  const Index off = m - n;
  // As Eigen evaluates (Q.cast<double>() * scale) * K.cast<double>().transpose(): both casts
  // materialised (double inputs read in place), the scale applied as the GEMM's alpha.
  gemm<Op::N, Op::T>(Update::Assign, S, as_double(Q), as_double(K), scale);
  if (bias != nullptr)
    for (Index j = 0; j < m; ++j) S.col(j).array() += static_cast<double>(bias[j]);
  if (causal)
    for (Index j = 0; j < m; ++j) {
      const Index hidden = std::min(n, std::max<Index>(0, j - off));  // rows i < j - off
      S.col(j).head(hidden).setConstant(-std::numeric_limits<double>::infinity());
    }
  return row_softmax_inplace(S);
}

/// The Naive kernel, computed entirely in double: P = `naive_probabilities`, O = P V, lse = the
/// row log-sum-exp values. 2 n m (d + dv) flops, n m doubles of memory.
template <typename Scalar>
void exact_naive(const ConstRef<Scalar>& Q, const ConstRef<Scalar>& K, const ConstRef<Scalar>& V,
                 const Scalar* bias, double scale, bool causal, Matrix<Scalar>& out,
                 Vector<Scalar>& lse) {
  Matrix<double> S;
  const Vector<double> lse_d = naive_probabilities<Scalar>(Q, K, bias, scale, causal, S);
  const Matrix<double> O = matmul(S, as_double(V));
  out = O.template cast<Scalar>();
  lse = lse_d.template cast<Scalar>();
}

/// Validates Q, K, V for `method` (shapes, finiteness, causal needs m >= n). Any scalar type
/// (bf16 inputs are checked through a cast to float).
template <typename DQ, typename DK, typename DV>
void check_exact_inputs(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, bool causal, const char* method,
                        bool check_kv = true) {
  check_attention_inputs(Q, K, V, method, check_kv);
  EFFATTN_CHECK(!causal || K.rows() >= Q.rows(),
                cat(method,
                    ": causal attention needs m >= n (query i sees keys j <= i + m - n, "
                    "so the first n - m queries would see none); got n = ",
                    Q.rows(), ", m = ", K.rows()));
}

/// Fills r's block sizes and info after a tiled call with `plan`. `deferred`: K and V were not
/// scanned before the call (the fused decoding kernel checks them as it reads them); when then a
/// raw score (`scores_finite` false) or the output is not finite, they are scanned now, so that
/// the same `invalid_argument` as from the up-front check is thrown.
template <typename DK, typename DV>
void finish_tiled_result(const TilePlan& plan, bool deferred, bool scores_finite,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         ExactResult<float>& r) {
  r.block_q = plan.bq;
  r.block_k = plan.bk;
  r.kv_splits = plan.kv_splits;
  r.info = all_finite(r.output) && all_finite(r.lse) ? Info::Success : Info::NumericalIssue;
  if (deferred && (!scores_finite || r.info != Info::Success)) {
    check_finite(K, "K");
    check_finite(V, "V");
  }
}

/// Whether `exact_bf16` splits the score product (`Bf16Scores`): float inputs only (a bf16 K has
/// no remainder to add).
template <typename In>
bool bf16_split_scores(const ExactOptions& opts, Index d) noexcept {
  return std::is_same_v<In, float> &&
         (opts.bf16_scores == Bf16Scores::Split ||
          (opts.bf16_scores == Bf16Scores::Auto && d <= kBf16SplitScoresMaxDim));
}

/// The TiledBf16 kernel on the path `selected_isa()` for inputs of scalar In (float or
/// Eigen::bfloat16): validates them (`method` names the caller), fills r's output, lse, block
/// sizes and info. When the fused decoding kernel runs (`reads_kv_checked` of the chosen kernel), K
/// and V are not scanned beforehand: that scan read the cache a second time and took as long as the
/// kernel (measured: 15% of a decoding call's profile against 19% for the kernel). The kernel
/// checks every raw score (a non-finite key makes its score non-finite, the queries being finite),
/// a non-finite value makes the output non-finite (0 * inf is NaN), and only then are K and V
/// scanned, so the same `invalid_argument` is thrown.
template <typename In>
void exact_bf16(const Eigen::Ref<const Matrix<In>>& Q, const Eigen::Ref<const Matrix<In>>& K,
                const Eigen::Ref<const Matrix<In>>& V, const float* bias, double scale,
                const ExactOptions& opts, const char* method, ExactResult<float>& r) {
  const Isa isa = selected_isa();
  const bool split = bf16_split_scores<In>(opts, Q.cols());
  // Empty inputs are rejected by the checks before any plan is made (a plan divides by n).
  const bool deferred =
      Q.rows() > 0 && Q.cols() > 0 && K.rows() > 0 && V.cols() > 0 &&
      reads_kv_checked(choose_exact_kernel(
          ExactFamily::TiledBf16, std::is_same_v<In, float>, split, Q.rows(),
          plan_bf16_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(), opts.block_q, opts.block_k),
          isa));
  check_exact_inputs(Q.template cast<float>(), K.template cast<float>(), V.template cast<float>(),
                     opts.causal, method, !deferred);
  const TilePlan plan =
      plan_bf16_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(), opts.block_q, opts.block_k);
  const bool scores_finite = tiled_attention_bf16<In>(
      Q, K, V, bias, static_cast<float>(scale), opts.causal, plan, isa, r.output, r.lse, split);
  finish_tiled_result(plan, deferred, scores_finite, K.template cast<float>(),
                      V.template cast<float>(), r);
}

/// fp32 Tiled decoding with the fused AVX-512 kernel (`fused_decode_run<false>`, 1 to
/// `kFusedDecodeFp32MaxRows` queries in one block, an AVX-512 path selected): validates the inputs
/// (K and V as `exact_bf16` does: through the kernel's score check and the output), fills r and
/// returns true; returns false, having done nothing, when the kernel does not apply. The Tiled
/// kernel's GEMMs of 1-4 rows against a column-major K read 5-10% of the streaming-read rate
/// (bench_bf16, fp32-tiled decode: 2-5 GB/s); the fused kernel reads at the memory rate.
/// A template only so that the kernel is instantiated where the float Tiled functor is (not in
/// every translation unit that includes exact.hpp: +0.6 s for a compiled-mode user TU).
template <typename = void>
bool exact_fp32_decode(const ConstRef<float>& Q, const ConstRef<float>& K, const ConstRef<float>& V,
                       const float* bias, double scale, const ExactOptions& opts,
                       const char* method, ExactResult<float>& r) {
#if EFFATTN_BF16_X86
  if (Q.rows() < 1 || Q.cols() < 1 || K.rows() < 1 || V.cols() < 1) return false;
  const TilePlan plan =
      plan_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(), 4, opts.block_q, opts.block_k);
  if (choose_exact_kernel(ExactFamily::Tiled, true, false, Q.rows(), plan, selected_isa()) !=
      ExactKernel::FusedDecodeFp32)
    return false;
  check_exact_inputs(Q, K, V, opts.causal, method, /*check_kv=*/false);
  const bool scores_finite = fused_decode_run<false, float>(
      Q, K, V, bias, static_cast<float>(scale), opts.causal, plan, r.output, r.lse);
  finish_tiled_result(plan, /*deferred=*/true, scores_finite, K, V, r);
  return true;
#else
  (void)Q, (void)K, (void)V, (void)bias, (void)scale, (void)opts, (void)method, (void)r;
  return false;
#endif
}

}  // namespace detail

template <typename Scalar_, typename Policy>
typename ExactAttention<Scalar_, Policy>::Result ExactAttention<Scalar_, Policy>::compute(
    const Ref& Q, const Ref& K, const Ref& V, const ConstVectorRef<Scalar>& key_bias) const {
  check_key_bias(key_bias, Q.rows(), K.rows());
  return run(Q, K, V, key_bias.data());
}

template <typename Scalar_, typename Policy>
typename ExactAttention<Scalar_, Policy>::Result ExactAttention<Scalar_, Policy>::compute(
    const Bf16Ref& Q, const Bf16Ref& K, const Bf16Ref& V,
    const ConstVectorRef<Scalar>& key_bias) const {
  check_key_bias(key_bias, Q.rows(), K.rows());
  return run_bf16(Q, K, V, key_bias.data());
}

template <typename Scalar_, typename Policy>
void ExactAttention<Scalar_, Policy>::check_key_bias(const ConstVectorRef<Scalar>& key_bias,
                                                     Index n, Index m) const {
  EFFATTN_CHECK(key_bias.size() == m, detail::cat(name, ": key_bias must have m = K.rows() = ", m,
                                                  " entries; got ", key_bias.size()));
  Index first_visible = -1;
  for (Index j = 0; j < key_bias.size(); ++j) {
    const Scalar b = key_bias(j);
    EFFATTN_CHECK(!std::isnan(b) && b != std::numeric_limits<Scalar>::infinity(),
                  detail::cat(name, ": key_bias must be finite or -inf (a masked key); got ", b,
                              " at index ", j));
    if (first_visible < 0 && std::isfinite(b)) first_visible = j;
  }
  // Query 0 sees the fewest keys: 0 .. m - n with `causal`, all of them otherwise.
  const Index last_allowed = m_opts.causal ? m - n : m - 1;
  EFFATTN_CHECK(
      first_visible >= 0 && first_visible <= last_allowed,
      detail::cat(name, ": key_bias masks every key visible to query 0 (first unmasked key: ",
                  first_visible, ")"));
}

template <typename Scalar_, typename Policy>
double ExactAttention<Scalar_, Policy>::check_inputs(const Ref& Q, const Ref& K,
                                                     const Ref& V) const {
  detail::check_exact_inputs(Q, K, V, m_opts.causal, name);
  return detail::resolve_scale(m_opts.scale, Q.cols());
}

template <typename Scalar_, typename Policy>
typename ExactAttention<Scalar_, Policy>::Result ExactAttention<Scalar_, Policy>::run(
    const Ref& Q, const Ref& K, const Ref& V, const Scalar* bias) const {
  // Which kernel runs is decided by detail::choose_exact_kernel (exact_dispatch.hpp), from the
  // policy, the inputs' shape and the kernel path.
  Result r;
  if constexpr (std::is_same_v<Policy, policy::TiledBf16>) {
    // Validates the inputs itself (its decoding kernel checks K and V as it reads them).
    detail::exact_bf16<Scalar>(Q, K, V, bias, detail::resolve_scale(m_opts.scale, Q.cols()), m_opts,
                               name, r);
    return r;
  }
  if constexpr (std::is_same_v<Policy, policy::Tiled> && std::is_same_v<Scalar, float>) {
    if (detail::exact_fp32_decode(Q, K, V, bias, detail::resolve_scale(m_opts.scale, Q.cols()),
                                  m_opts, name, r))
      return r;
  }
  const double scale = check_inputs(Q, K, V);
  if constexpr (std::is_same_v<Policy, policy::Naive>) {
    detail::exact_naive<Scalar>(Q, K, V, bias, scale, m_opts.causal, r.output, r.lse);
  } else {
    const detail::TilePlan plan =
        detail::plan_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(),
                           static_cast<Index>(sizeof(Scalar)), m_opts.block_q, m_opts.block_k);
    detail::tiled_attention<Scalar>(Q, K, V, bias, static_cast<Scalar>(scale), m_opts.causal, plan,
                                    r.output, r.lse);
    r.block_q = plan.bq;
    r.block_k = plan.bk;
    r.kv_splits = plan.kv_splits;
  }
  r.info = detail::all_finite(r.output) && detail::all_finite(r.lse) ? Info::Success
                                                                     : Info::NumericalIssue;
  return r;
}

template <typename Scalar_, typename Policy>
typename ExactAttention<Scalar_, Policy>::Result ExactAttention<Scalar_, Policy>::run_bf16(
    const Bf16Ref& Q, const Bf16Ref& K, const Bf16Ref& V, const Scalar* bias) const {
  if constexpr (std::is_same_v<Policy, policy::TiledBf16>) {
    Result r;
    detail::exact_bf16<Eigen::bfloat16>(
        Q, K, V, bias, detail::resolve_scale(m_opts.scale, Q.cols()), m_opts, name, r);
    return r;
  } else {
    // Other policies: widen once and run as for Scalar inputs.
    const MatrixType Qs = Q.template cast<Scalar>(), Ks = K.template cast<Scalar>(),
                     Vs = V.template cast<Scalar>();
    return run(Qs, Ks, Vs, bias);
  }
}

}  // namespace effattn
