/// \file vcc_impl.hpp
/// \brief Definitions of `VccAttention` (declared in `<effattn/vcc.hpp>`): the input checks, the
/// selection call and the compressed attention. The selection itself, shared with
/// `VccTree::select`, is `detail::vcc_select` in `detail/methods/vcc_select.hpp`.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../exact.hpp"
#include "../../vcc.hpp"
#include "vcc_select.hpp"

namespace effattn {
namespace detail {

/// Sorted copy of `vip`. \throws invalid_argument on an out-of-range or duplicate index.
inline std::vector<Index> vcc_check_vip(const std::vector<Index>& vip, Index n) {
  std::vector<Index> s = vip;
  std::sort(s.begin(), s.end());
  for (std::size_t i = 0; i < s.size(); ++i) {
    EFFATTN_CHECK(s[i] >= 0 && s[i] < n,
                  cat("VccAttention: vip indices must be rows of Q, K and V in [0, n) with n = ", n,
                      "; got ", s[i]));
    EFFATTN_CHECK(i == 0 || s[i] != s[i - 1],
                  cat("VccAttention: vip indices must be unique; ", s[i], " appears twice"));
  }
  return s;
}

}  // namespace detail

template <typename Scalar_, typename Select, typename Score, typename NonVip>
VccAttention<Scalar_, Select, Score, NonVip>::VccAttention(Options opts) : m_opts(std::move(opts)) {
  detail::check_scale_option(m_opts.scale, "VccAttention");
  EFFATTN_CHECK(m_opts.budget >= 0,
                detail::cat("VccAttention: Options::budget (r) must be >= 0 (0 = automatic); "
                            "got ",
                            m_opts.budget));
  detail::vcc_check_select_options(m_opts.block_size, m_opts.fine_blocks, "VccAttention: Options");
  std::vector<Index> vip = m_opts.vip;
  std::sort(vip.begin(), vip.end());
  for (std::size_t i = 0; i < vip.size(); ++i) {
    EFFATTN_CHECK(vip[i] >= 0,
                  detail::cat("VccAttention: Options::vip indices must be >= 0; got ", vip[i]));
    EFFATTN_CHECK(i == 0 || vip[i] != vip[i - 1],
                  detail::cat("VccAttention: Options::vip indices must be unique; ", vip[i],
                              " appears twice"));
  }
}

template <typename Scalar_, typename Select, typename Score, typename NonVip>
std::vector<VccSegment> VccAttention<Scalar_, Select, Score, NonVip>::select(
    const Ref& Q, const Ref& K, const std::vector<Index>& vip,
    const std::vector<detail::VccRun>& runs, Index n_c, double tau, Result& r) const {
  const Index n_p = static_cast<Index>(vip.size()), n = n_p + n_c;
  detail::VccSelectRule rule;
  rule.who = "VccAttention";
  rule.budget_form = true;
  rule.budget = m_opts.budget;
  rule.fixed = m_opts.budget > 0;
  rule.segments = rule.fixed ? std::min(m_opts.budget, n) - n_p : 0;  // m = r - n_p
  rule.block_size = m_opts.block_size;
  rule.fine_blocks = m_opts.fine_blocks;
  rule.lookahead = m_opts.lookahead;
  rule.clamp = m_opts.clamp_budget;
  Matrix<Scalar> QPs(n_p, Q.cols());  // the scaled VIP queries
  for (Index i = 0; i < n_p; ++i) QPs.row(i) = Q.row(vip[static_cast<std::size_t>(i)]);
  QPs *= static_cast<Scalar>(tau);
  detail::VccSelectReport rep;
  std::vector<VccSegment> J =
      detail::vcc_select<Select, Score>(detail::VccRowKeys<Scalar>{K, runs, n_c}, QPs, rule, rep);
  r.fine_blocks = rep.fine_blocks;
  r.uniform_fallback = rep.uniform_fallback;
  return J;
}

template <typename Scalar_, typename Select, typename Score, typename NonVip>
typename VccAttention<Scalar_, Select, Score, NonVip>::Result
VccAttention<Scalar_, Select, Score, NonVip>::run(const Ref& Q, const Ref& K, const Ref& V,
                                                  const std::vector<Index>& vip_in,
                                                  const std::vector<VccSegment>* given) const {
  detail::check_attention_inputs(Q, K, V, "VccAttention");
  EFFATTN_CHECK(Q.rows() == K.rows(),
                detail::cat("VccAttention: VCC is self-attention over one token sequence: Q "
                            "must be n x d and K n x d with the same n; got Q ",
                            detail::shape(Q), ", K ", detail::shape(K)));
  const Index n = Q.rows(), dv = V.cols();
  Result r;
  r.vip = detail::vcc_check_vip(vip_in, n);
  const std::vector<Index>& vip = r.vip;
  const Index n_p = static_cast<Index>(vip.size()), n_c = n - n_p;
  const double tau = detail::resolve_scale(m_opts.scale, Q.cols());
  ExactOptions eo;
  eo.scale = tau;
  const ExactAttention<Scalar> attend(eo);

  if (n_c == 0) {  // every row is VIP: exact attention
    if (given != nullptr) vcc::check_partition(*given, 0, "VccAttention");
    auto e = attend.compute(Q, K, V);
    r.output = std::move(e.output);
    r.info = e.info;
    r.budget_effective = n;
    return r;
  }
  const std::vector<detail::VccRun> runs = detail::vcc_runs(n, vip);
  if (given != nullptr) {
    vcc::check_partition(*given, n_c, "VccAttention");
    r.segments = *given;
  } else {
    r.segments = select(Q, K, vip, runs, n_c, tau, r);
  }
  const std::vector<VccSegment>& J = r.segments;
  const Index m = static_cast<Index>(J.size()), rr = n_p + m;
  r.budget_effective = rr;

  // K' = [K_P; S_c K_C], V' = [V_P; S_c V_C], b = [0; log s_j].
  MatrixType Kc(rr, Q.cols()), Vc(rr, dv);
  Vector<Scalar> bias(rr);
  for (Index i = 0; i < n_p; ++i) {
    Kc.row(i) = K.row(vip[static_cast<std::size_t>(i)]);
    Vc.row(i) = V.row(vip[static_cast<std::size_t>(i)]);
    bias(i) = Scalar(0);
  }
  detail::vcc_segment_means<Scalar>(K, runs, J, Kc, n_p);
  detail::vcc_segment_means<Scalar>(V, runs, J, Vc, n_p);
  for (Index j = 0; j < m; ++j)
    bias(n_p + j) =
        static_cast<Scalar>(std::log(static_cast<double>(J[static_cast<std::size_t>(j)].count)));

  Info info = Info::Success;
  if constexpr (std::is_same_v<NonVip, policy::ExactQuery>) {
    auto e = attend.compute(Q, Kc, Vc, bias);
    r.output = std::move(e.output);
    info = e.info;
  } else {
    constexpr bool decompress = std::is_same_v<NonVip, policy::Decompress>;
    const Index nq = n_p + (decompress ? m : 0);
    r.output = MatrixType::Zero(n, dv);
    if (nq > 0) {
      MatrixType Qs(nq, Q.cols());
      for (Index i = 0; i < n_p; ++i) Qs.row(i) = Q.row(vip[static_cast<std::size_t>(i)]);
      if constexpr (decompress) detail::vcc_segment_means<Scalar>(Q, runs, J, Qs, n_p);
      auto e = attend.compute(Qs, Kc, Vc, bias);
      info = e.info;
      for (Index i = 0; i < n_p; ++i)
        r.output.row(vip[static_cast<std::size_t>(i)]) = e.output.row(i);
      if constexpr (decompress)
        detail::vcc_scatter_segments<Scalar>(e.output, n_p, runs, J, r.output);
    }
  }
  r.info =
      info == Info::Success && detail::all_finite(r.output) ? Info::Success : Info::NumericalIssue;
  return r;
}

}  // namespace effattn
