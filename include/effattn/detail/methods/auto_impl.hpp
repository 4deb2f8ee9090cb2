// Implementation of effattn/auto.hpp. Private: include <effattn/auto.hpp> instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

#include "../../core/errors.hpp"
#include "../../core/probe.hpp"
#include "../../eva.hpp"
#include "../../exact.hpp"
#include "../../wildcat.hpp"

namespace effattn {
namespace detail {

/// \brief The cost model of AutoAttention, in units of exact Tiled attention's cost per (query,
/// visible key, d + dv): exact attention costs n m_vis (d + dv) units.
///
/// The coefficients are fitted to `bench_auto`'s calibration rows (float, d = dv = 64, 2
/// threads, n = m = 4096, 16384, 65536, r = 64, 256, 1024; docs/methods/auto.md), rounded
/// up so that the model errs on the expensive side: an
/// over-estimate only makes AutoAttention probe less. Refitted after WildCat's float selection
/// the selection measured 0.23-0.52 of the old model (1.8 r^2 m + 5.5 r m D + 1200 m
/// D), which capped the probe at r = 512 on `sphere`, n = 65536, where r = 1024 meets a 1e-2 target
/// at 0.11 of exact's time. Least squares at m = 65536 gave 0.575 r^2 m + 2.29 r m D + 206 m D
/// (within 0.7-0.9 of the m = 4096 / 16384 rows); attention 0.87 n r D + 99 n D.
struct AutoCostModel {
  static constexpr double kProbe = 2.7;      ///< sampled exact rows (16-column GEMMs, double sums)
  static constexpr double kSelR2 = 0.75;     ///< WildCat selection, per r^2 m (factor updates)
  static constexpr double kSelRd = 3.0;      ///< WildCat selection, per r m (d + dv) (kernel rows)
  static constexpr double kSelM = 300.0;     ///< WildCat selection, per m (d + dv) (fixed part)
  static constexpr double kAttend = 1.0;     ///< WildCat attention, per n r (d + dv)
  static constexpr double kAttendN = 120.0;  ///< WildCat attention, per n (d + dv) (fixed part)
  static constexpr double kEva = 4.2;        ///< EVA, per n (window + chunks) (d + dv)
  static constexpr double kEvaM = 42.0;      ///< EVA, per m (d + dv) (chunk summaries)

  /// Keys a query sees on average (causal: bottom-right aligned).
  static double visible_keys(Index n, Index m, bool causal) {
    return causal ? static_cast<double>(m - n) + 0.5 * static_cast<double>(n + 1)
                  : static_cast<double>(m);
  }
  static double exact(Index n, Index m, Index d, Index dv, bool causal) {
    return static_cast<double>(n) * visible_keys(n, m, causal) * static_cast<double>(d + dv);
  }
  static double probe(Index s, Index n, Index m, Index d, Index dv, bool causal) {
    return kProbe * static_cast<double>(s) * visible_keys(n, m, causal) *
           static_cast<double>(d + dv);
  }
  static double wildcat_select(Index r, Index m, Index d, Index dv) {
    const double R = static_cast<double>(r), M = static_cast<double>(m),
                 D = static_cast<double>(d + dv);
    return kSelR2 * R * R * M + kSelRd * R * M * D + kSelM * M * D;
  }
  static double wildcat_attend(Index n, Index r, Index d, Index dv) {
    return (kAttend * static_cast<double>(r) + kAttendN) * static_cast<double>(n) *
           static_cast<double>(d + dv);
  }
  static double eva(Index n, Index m, Index d, Index dv, Index window, Index chunks) {
    return kEva * static_cast<double>(n) * static_cast<double>(window + chunks) *
               static_cast<double>(d + dv) +
           kEvaM * static_cast<double>(m) * static_cast<double>(d + dv);
  }
};

inline void check_auto_options(const AutoOptions& o) {
  check_scale_option(o.scale, "AutoAttention");
  EFFATTN_CHECK(
      std::isfinite(o.target_error) && o.target_error >= 0,
      cat("AutoAttention: Options::target_error must be finite and >= 0; got ", o.target_error));
  EFFATTN_CHECK(o.error_sample_rows >= 0,
                cat("AutoAttention: Options::error_sample_rows must be >= 0 (0 = automatic); got ",
                    o.error_sample_rows));
  EFFATTN_CHECK(
      std::isfinite(o.max_overhead) && o.max_overhead >= 0,
      cat("AutoAttention: Options::max_overhead must be finite and >= 0; got ", o.max_overhead));
  EFFATTN_CHECK(o.safety > 0 && o.safety <= 1,
                cat("AutoAttention: Options::safety must be in (0, 1]; got ", o.safety));
  EFFATTN_CHECK(std::isfinite(o.wildcat_min_rank_error) && o.wildcat_min_rank_error >= 0,
                cat("AutoAttention: Options::wildcat_min_rank_error must be finite and >= 0; got ",
                    o.wildcat_min_rank_error));
  EFFATTN_CHECK(std::isfinite(o.eva_min_target) && o.eva_min_target >= 0,
                cat("AutoAttention: Options::eva_min_target must be finite and >= 0; got ",
                    o.eva_min_target));
}

/// Largest WildCat rank (a power of two >= 16, < m / 2) whose selection fits `budget` units.
inline Index auto_wildcat_rank_cap(Index m, Index d, Index dv, double budget) {
  Index best = 0;
  for (Index r = 16; 2 * r < m; r *= 2) {
    if (AutoCostModel::wildcat_select(r, m, d, dv) > budget) break;
    best = r;
  }
  return best;
}

inline std::string auto_fmt(double x) {
  std::ostringstream s;
  s.precision(3);
  s << x;
  return s.str();
}

}  // namespace detail

template <typename Scalar_>
AutoAttention<Scalar_>::AutoAttention(Options opts) : m_opts(detail::resolve_renamed(opts, name)) {
  detail::check_auto_options(m_opts);
}

template <typename Scalar_>
AutoResult<Scalar_> AutoAttention<Scalar_>::compute(const Ref& Q, const Ref& K,
                                                    const Ref& V) const {
  using detail::auto_fmt;
  using detail::AutoCostModel;
  detail::check_attention_inputs(Q, K, V, name);
  const Index n = Q.rows(), m = K.rows(), d = Q.cols(), dv = V.cols();
  const Options& o = m_opts;
  EFFATTN_CHECK(!o.causal || m >= n,
                detail::cat(name,
                            ": causal attention needs m >= n (bottom-right aligned mask); "
                            "got n = ",
                            n, ", m = ", m));
  const double beta = detail::resolve_scale(o.scale, d);
  const double exact_cost = AutoCostModel::exact(n, m, d, dv, o.causal);
  const double budget = o.max_overhead * exact_cost;
  Result res;

  auto run_exact = [&](std::string why, double spent) {
    ExactOptions eo;
    eo.scale = o.scale;
    eo.causal = o.causal;
    ExactResult<Scalar> er = ExactAttention<Scalar>(eo).compute(Q, K, V);
    res.output = std::move(er.output);
    res.info = er.info;
    res.lse = std::move(er.lse);
    res.method = AutoMethod::Exact;
    res.budget = 0;
    res.estimated_error = 0;
    res.predicted_cost = 1 + spent / exact_cost;
    res.reason = std::move(why);
  };

  if (o.target_error <= 0) {
    run_exact("target_error = 0: exact attention", 0);
    return res;
  }

  // The candidates that fit the probe budget together with the sampled rows.
  const Index s = std::min(
      n, o.error_sample_rows > 0 ? o.error_sample_rows : std::clamp<Index>(n / 64, 32, 256));
  const double probe_cost = AutoCostModel::probe(s, n, m, d, dv, o.causal);
  const double room = budget - probe_cost;
  const bool wildcat_ok = o.allow_wildcat && !o.causal;
  const Index affordable =
      wildcat_ok && room > 0 ? detail::auto_wildcat_rank_cap(m, d, dv, room) : 0;
  const bool wildcat_can_meet =
      static_cast<double>(affordable) * o.target_error >= o.wildcat_min_rank_error;
  const Index rank_cap = wildcat_can_meet ? affordable : 0;
  EvaOptions eva_o;
  eva_o.scale = o.scale;
  eva_o.causal = o.causal;
  // EVA at its defaults: window 64, about 64 chunks.
  const Index eva_chunks = std::min<Index>(64, m);
  const double eva_cost = AutoCostModel::eva(n, m, d, dv, eva_o.window, eva_chunks);
  const bool eva_target = o.target_error >= o.eva_min_target;
  const bool eva_ok = o.allow_eva && eva_target && room > 0 && eva_cost <= room;
  if (rank_cap == 0 && !eva_ok) {
    std::string why = "exact attention: no approximation fits the probe budget (max_overhead " +
                      auto_fmt(o.max_overhead) + " x exact) at n = " + std::to_string(n) +
                      ", m = " + std::to_string(m);
    if (o.causal && o.allow_wildcat) why += "; WildCat has no causal form";
    if (affordable > 0 && !wildcat_can_meet)
      why += "; the affordable WildCat rank " + std::to_string(affordable) + " x target " +
             auto_fmt(o.target_error) + " < " + auto_fmt(o.wildcat_min_rank_error) +
             " (wildcat_min_rank_error)";
    if (o.allow_eva && !eva_target)
      why += "; EVA's error floor (~0.08) is above the target " + auto_fmt(o.target_error);
    run_exact(std::move(why), 0);
    return res;
  }

  // The probe: s sampled rows and their exact attention.
  const std::vector<Index> rows = detail::sample_rows(n, s, o.seed, 0xa0705ULL);
  const Matrix<Scalar> Qs = detail::gather_rows<Scalar>(Q, rows);
  const Matrix<double> exact_s = detail::exact_rows<Scalar>(Qs, rows, n, K, V, beta, o.causal);
  detail::set_error_sample_rows(res, s);
  double spent = probe_cost;
  const double accept = o.safety * o.target_error;

  // Candidates in order of predicted cost: EVA's whole run, then WildCat's selection.
  const bool eva_first =
      eva_ok && (rank_cap == 0 || eva_cost <= AutoCostModel::wildcat_select(rank_cap, m, d, dv));
  auto try_eva = [&]() -> bool {
    if (!eva_ok || spent + eva_cost > budget) return false;
    EvaResult<Scalar> er = EvaAttention<Scalar>(eva_o).compute(Q, K, V);
    spent += eva_cost;
    AutoCandidate c;
    c.method = AutoMethod::Eva;
    c.budget = eva_o.window;
    c.predicted_cost = eva_cost / exact_cost;
    c.estimated_error =
        er.info == Info::Success
            ? detail::relative_error(detail::gather_rows<Scalar>(er.output, rows), exact_s)
            : std::numeric_limits<double>::infinity();
    c.accepted = c.estimated_error <= accept;
    res.candidates.push_back(c);
    if (!c.accepted) return false;
    res.output = std::move(er.output);
    res.info = er.info;
    res.method = AutoMethod::Eva;
    res.budget = c.budget;
    res.estimated_error = c.estimated_error;
    res.predicted_cost = spent / exact_cost;
    res.reason = "eva (window " + std::to_string(c.budget) + "): estimated error " +
                 auto_fmt(c.estimated_error) + " <= " + auto_fmt(o.safety) + " x target " +
                 auto_fmt(o.target_error) + " on " + std::to_string(s) + " sampled rows";
    return true;
  };
  auto try_wildcat = [&]() -> bool {
    if (rank_cap == 0) return false;
    WildcatOptions wo;
    wo.scale = o.scale;
    wo.seed = o.seed;
    // Residual-trace tolerance: a relative trace t gives an error of about t to 1.5 t near
    // 1e-2 on sphere (WildcatOptions::target_error; 0.0108 at t = 0.007, n = 65536), so start
    // at half the accepted error.
    wo.rel_tol = std::clamp(0.5 * accept, 1e-12, 0.5);
    const double rq = std::sqrt(Q.template cast<double>().rowwise().squaredNorm().maxCoeff());
    for (int round = 0; round < 3; ++round) {
      // The rank is capped by what is left of the budget (the rank a tolerance stops at is
      // known only after the selection).
      const Index cap = detail::auto_wildcat_rank_cap(m, d, dv, budget - spent);
      if (cap == 0) return false;
      wo.rank = cap;
      const WildcatAttention<Scalar> wc(wo);
      CompressedKV<Scalar> ckv = wc.compress_kv(K, V, rq);
      const Index used = ckv.size();
      spent += AutoCostModel::wildcat_select(std::max<Index>(used, 1), m, d, dv);
      AutoCandidate c;
      c.method = AutoMethod::Wildcat;
      c.budget = used;
      c.predicted_cost =
          AutoCostModel::wildcat_select(std::max<Index>(used, 1), m, d, dv) / exact_cost;
      if (used == 0) {  // numerical breakdown of the compression
        c.estimated_error = std::numeric_limits<double>::infinity();
        res.candidates.push_back(c);
        return false;
      }
      const WildcatResult<Scalar> probe = wc.weighted_attention(Qs, ckv);
      c.estimated_error = probe.info == Info::Success
                              ? detail::relative_error(probe.output, exact_s)
                              : std::numeric_limits<double>::infinity();
      c.accepted = c.estimated_error <= accept;
      res.candidates.push_back(c);
      if (c.accepted) {
        WildcatResult<Scalar> wr = wc.weighted_attention(Q, ckv);
        spent += AutoCostModel::wildcat_attend(n, used, d, dv);
        res.output = std::move(wr.output);
        res.info = wr.info;
        res.method = AutoMethod::Wildcat;
        res.budget = used;
        res.estimated_error = c.estimated_error;
        res.predicted_cost = spent / exact_cost;
        res.reason = "wildcat (rank " + std::to_string(used) + "): estimated error " +
                     auto_fmt(c.estimated_error) + " <= " + auto_fmt(o.safety) + " x target " +
                     auto_fmt(o.target_error) + " on " + std::to_string(s) + " sampled rows";
        return true;
      }
      // Missed: the rank is at its cap (more rank is not affordable) or the tolerance stopped
      // it early; tighten the tolerance as WildCat's own target mode does and try again.
      if (used >= cap || !std::isfinite(c.estimated_error)) return false;
      const double ratio = accept / c.estimated_error;
      wo.rel_tol *= std::clamp(0.5 * ratio * ratio, 1e-4, 0.5);
    }
    return false;
  };

  if (eva_first ? (try_eva() || try_wildcat()) : (try_wildcat() || try_eva())) return res;

  std::string why = "exact attention: no candidate met " + auto_fmt(o.safety) + " x target " +
                    auto_fmt(o.target_error) + " within the probe budget (";
  for (std::size_t i = 0; i < res.candidates.size(); ++i) {
    const AutoCandidate& c = res.candidates[i];
    why += std::string(i ? ", " : "") + to_string(c.method) + " " + std::to_string(c.budget) +
           ": " + auto_fmt(c.estimated_error);
  }
  why += ")";
  run_exact(std::move(why), spent);
  return res;
}

}  // namespace effattn
