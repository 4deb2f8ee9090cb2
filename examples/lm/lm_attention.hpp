// effattn-lm's attention: every effattn method in place of a model's exact attention, through
// the multi-head entry point (MultiHead<F>, GQA layout of the model), with the per-layer error
// against exact attention on the same inputs and the attention times of both.
//
// Per model (the mask each method supports):
// - decoder (causal): exact, conv_basis (k bases), eva (causal, window 64, chunk = budget), and
//   wildcat / vcc as prefix (KV-cache) compression: the first P = T - recent positions (the
//   prompt) are attended exactly among themselves; the last `recent` queries attend to the
//   prompt's keys and values compressed to `budget` rows (WildCat: `compress_kv`, RPNys coreset
//   with Nystrom weights; VCC: the VIP-guided TwoLevel partition of the prompt's keys into
//   `budget` segments, each a mean key / value with its count) plus the recent keys exactly and
//   causally, in one softmax. This is the KV-cache setting of the WildCat paper.
// - encoder (bidirectional): exact, wildcat (rank = budget), vcc (the masked positions as VIP
//   rows, compressed length = budget), eva (chunk = budget), performer (features = budget),
//   kep_svgp (rank = budget; its per-token variance is returned for the uncertainty check).
#pragma once

#include <effattn/effattn.hpp>

#include "lm_model.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <vector>

namespace effattn {
namespace lm {

/// What replaces exact attention, and where.
struct MethodSpec {
  std::string name = "exact";
  Index budget = 0;           ///< the method's own unit (see the file comment); 0 = its default
  std::vector<Index> layers;  ///< layers that use the method (empty = all); the others are exact
  Index recent = 0;           ///< decoder prefix methods: exact recent window (0 = T / 2)
  std::uint64_t seed = 42;    ///< seeds of the randomised methods
  bool layer_error = true;    ///< also run exact attention on each method layer's inputs
};

/// The methods a model kind supports, in table order.
inline std::vector<std::string> methods_for(Kind k) {
  if (k == Kind::Decoder) return {"exact", "conv_basis", "eva", "wildcat", "vcc"};
  return {"exact", "wildcat", "vcc", "eva", "performer", "kep_svgp"};
}

/// Default budget of a method (what `--budget 0` means).
inline Index default_budget(const std::string& m) {
  if (m == "conv_basis") return 16;
  if (m == "eva") return 16;
  if (m == "wildcat") return 256;
  if (m == "vcc") return 256;
  if (m == "performer") return 256;
  if (m == "kep_svgp") return 64;
  return 0;
}

namespace detail {

/// Softmax attention of the recent queries Qr over `rows` compressed rows (keys Kc, values Vc,
/// weights w, log-scales ls: row s contributes e^{beta <q, k_s> + ls_s} to the numerator with
/// Vc_s and to the denominator with w_s) plus the recent keys Kr / values Vr, causally (recent
/// query i sees recent keys j <= i). One max-shifted exponential per row. A row whose
/// denominator is not positive (WildCat's weights can be negative) keeps its exact recent part
/// only. With clip bounds (WildCat) the output is clipped to [lo, hi] per column.
inline Mat prefix_attend(const Eigen::Ref<const Mat>& Qr, const Mat& Kc, const Mat& Vc,
                         const Vec& w, const Vec& ls, const Eigen::Ref<const Mat>& Kr,
                         const Eigen::Ref<const Mat>& Vr, float beta,
                         const Eigen::RowVectorXf* lo = nullptr,
                         const Eigen::RowVectorXf* hi = nullptr) {
  const Index n = Qr.rows();
  Mat S1 = beta * (Qr * Kc.transpose());
  S1.rowwise() += ls.transpose();
  Mat S2 = beta * (Qr * Kr.transpose());
  const float ninf = -std::numeric_limits<float>::infinity();
  for (Index j = 1; j < n; ++j) S2.col(j).head(j).setConstant(ninf);  // key j > query i
  Eigen::VectorXf mx = S2.rowwise().maxCoeff();                       // the diagonal is finite
  if (S1.cols() > 0) mx = mx.cwiseMax(S1.rowwise().maxCoeff());
  S1 = (S1.colwise() - mx).array().exp().matrix();
  S2 = (S2.colwise() - mx).array().exp().matrix();
  Mat num = S2 * Vr;
  Eigen::VectorXf den_exact = S2.rowwise().sum();
  Eigen::VectorXf den = den_exact;
  if (S1.cols() > 0) {
    num.noalias() += S1 * Vc;
    den.noalias() += S1 * w;
  }
  for (Index i = 0; i < n; ++i) {
    if (den(i) > 0 && std::isfinite(den(i))) {
      num.row(i) /= den(i);
    } else {
      num.row(i) = (S2.row(i) * Vr) / den_exact(i);
    }
  }
  if (lo && hi)
    for (Index i = 0; i < n; ++i) num.row(i) = num.row(i).cwiseMax(*lo).cwiseMin(*hi);
  return num;
}

}  // namespace detail

/// Attention by a method, with statistics; an AttentionFn (see `fn()`).
class MethodAttention {
 public:
  MethodAttention(const Config& cfg, MethodSpec spec) : m_cfg(cfg), m_spec(std::move(spec)) {
    const auto ms = methods_for(cfg.kind);
    if (std::find(ms.begin(), ms.end(), m_spec.name) == ms.end()) {
      std::string list;
      for (const auto& s : ms) list += (list.empty() ? "" : ", ") + s;
      throw lm_error("effattn-lm: method '" + m_spec.name + "' does not run on the " + cfg.name() +
                     " (its methods: " + list + ")");
    }
    if (m_spec.budget == 0) m_spec.budget = default_budget(m_spec.name);
    if (m_spec.budget < 0) throw lm_error("effattn-lm: negative budget");
    if (m_spec.name == "exact") m_spec.layer_error = false;
    for (const Index l : m_spec.layers)
      if (l < 0 || l >= cfg.layers)
        throw lm_error("effattn-lm: layer " + std::to_string(l) + " outside [0, " +
                       std::to_string(cfg.layers) + ")");
    m_err_num.assign(static_cast<std::size_t>(cfg.layers), 0.0);
    m_err_den.assign(static_cast<std::size_t>(cfg.layers), 0.0);
  }

  const MethodSpec& spec() const { return m_spec; }
  bool uses(Index layer) const {
    return m_spec.name != "exact" &&
           (m_spec.layers.empty() ||
            std::find(m_spec.layers.begin(), m_spec.layers.end(), layer) != m_spec.layers.end());
  }
  /// True for the decoder's prefix-compression methods.
  bool prefix_mode() const {
    return m_cfg.causal() && (m_spec.name == "wildcat" || m_spec.name == "vcc");
  }
  /// First row whose output the method changes for a window of T tokens.
  Index first_changed_row(Index T) const { return prefix_mode() ? T - recent(T) : 0; }
  Index recent(Index T) const {
    const Index r = m_spec.recent > 0 ? m_spec.recent : T / 2;
    return std::min(std::max<Index>(r, 1), T);
  }

  /// Per window: the VIP rows (encoder VCC: the masked positions); resets the variances.
  void begin_window(std::vector<Index> vip) {
    m_vip = std::move(vip);
    m_variance.resize(0);
  }

  /// KEP-SVGP: per-token predictive variance of this window, summed over heads, value columns
  /// and method layers (empty for other methods).
  const Eigen::VectorXd& variance() const { return m_variance; }
  /// Relative Frobenius error of layer l's attention output against exact attention on the same
  /// inputs, over the rows the method changes, accumulated over windows (NaN when not measured).
  double layer_error(Index l) const {
    const double d = m_err_den[static_cast<std::size_t>(l)];
    return d > 0 ? std::sqrt(m_err_num[static_cast<std::size_t>(l)] / d)
                 : std::numeric_limits<double>::quiet_NaN();
  }
  double method_seconds() const { return m_method_s; }  ///< time in the method's attention
  double exact_seconds() const { return m_exact_s; }    ///< exact attention, same inputs

  /// The AttentionFn for `forward`.
  AttentionFn fn() {
    return [this](Index l, const Mat& q, const Mat& k, const Mat& v) { return run(l, q, k, v); };
  }

  Mat run(Index l, const Mat& q, const Mat& k, const Mat& v) {
    using clock = std::chrono::steady_clock;
    if (!uses(l)) return exact(q, k, v);
    const auto t0 = clock::now();
    Mat out = method(q, k, v);
    m_method_s += std::chrono::duration<double>(clock::now() - t0).count();
    if (m_spec.layer_error) {
      const auto t1 = clock::now();
      const Mat ex = exact(q, k, v);
      m_exact_s += std::chrono::duration<double>(clock::now() - t1).count();
      const Index r0 = first_changed_row(q.rows());
      const Index nr = q.rows() - r0;
      m_err_num[static_cast<std::size_t>(l)] +=
          (out.bottomRows(nr) - ex.bottomRows(nr)).cast<double>().squaredNorm();
      m_err_den[static_cast<std::size_t>(l)] += ex.bottomRows(nr).cast<double>().squaredNorm();
    }
    return out;
  }

  /// Exact attention (the model's own mask) through MultiHead<ExactAttention>.
  Mat exact(const Mat& q, const Mat& k, const Mat& v) const {
    ExactOptions o;
    o.causal = m_cfg.causal();
    return MultiHead<ExactAttentionf>(o, layout()).compute(q, k, v).output;
  }

 private:
  HeadLayout layout() const { return {m_cfg.heads, m_cfg.kv_heads}; }

  template <typename F>
  Mat through(const typename F::Options& o, const Mat& q, const Mat& k, const Mat& v) {
    auto r = MultiHead<F>(o, layout()).compute(q, k, v);
    if (r.info != Info::Success)
      throw lm_error(std::string("effattn-lm: ") + m_spec.name + " failed: " + to_string(r.info));
    if constexpr (std::is_same<F, KepSvgpAttentionf>::value) {
      if (m_variance.size() == 0) m_variance = Eigen::VectorXd::Zero(q.rows());
      for (Index h = 0; h < m_cfg.heads; ++h)
        m_variance += r.head(0, h).variance.rowwise().sum().template cast<double>();
    }
    return r.output;
  }

  Mat method(const Mat& q, const Mat& k, const Mat& v) {
    const std::string& n = m_spec.name;
    const Index b = m_spec.budget;
    if (prefix_mode()) return prefix(q, k, v);
    if (n == "conv_basis") {
      ConvBasisAttentionf::Options o;
      o.num_bases = b;
      // k >= n is the exact setting only with one probe row (T = 1, Cor. 4.5 of the paper);
      // the default probe skips bases whose rows look alike.
      if (b >= q.rows()) o.probe = 1;
      return through<ConvBasisAttentionf>(o, q, k, v);
    }
    if (n == "eva") {
      EvaOptions o;
      o.causal = m_cfg.causal();
      o.window = 64;
      o.chunk_size = b;
      return through<EvaAttentionf>(o, q, k, v);
    }
    if (n == "performer") {
      PerformerAttentionf::Options o;
      o.features = b;
      o.seed = m_spec.seed;
      return through<PerformerAttentionf>(o, q, k, v);
    }
    if (n == "kep_svgp") {
      KepSvgpOptions o;
      o.rank = b;
      o.seed = m_spec.seed;
      return through<KepSvgpAttentionf>(o, q, k, v);
    }
    if (n == "wildcat") {
      WildcatOptions o;
      o.rank = b;
      o.seed = m_spec.seed;
      return through<WildcatAttentionf>(o, q, k, v);
    }
    if (n == "vcc") {
      VccOptions o;
      o.budget = b;
      o.clamp_budget = true;
      o.vip = m_vip;
      return through<VccAttentionf>(o, q, k, v);
    }
    throw lm_error("effattn-lm: unknown method '" + n + "'");
  }

  /// Decoder prefix compression (see the file comment).
  Mat prefix(const Mat& q, const Mat& k, const Mat& v) {
    const Index T = q.rows(), nr = recent(T), P = T - nr, hd = m_cfg.head_dim;
    const Index H = m_cfg.heads, G = m_cfg.kv_heads, group = H / G;
    const float beta = 1.0f / std::sqrt(static_cast<float>(hd));
    Mat out(T, H * hd);
    if (P == 0) return exact(q, k, v);  // nothing to compress
    const Mat kp = k.topRows(P), vp = v.topRows(P);
    out.topRows(P) = exact(q.topRows(P), kp, vp);  // the prompt among itself, causal
    if (m_spec.name == "wildcat") {
      double qr = 0;
      for (Index h = 0; h < H; ++h)
        qr = std::max<double>(qr, q.block(P, h * hd, nr, hd).rowwise().norm().maxCoeff());
      WildcatOptions o;
      o.rank = m_spec.budget;
      o.seed = m_spec.seed;
      const MultiHead<WildcatAttentionf> mh(o, layout());
      const auto cache = mh.compress_kv(kp, vp, {}, qr);
      for (Index h = 0; h < H; ++h) {
        const Index g = h / group;
        const auto& c = cache.at(0, g);
        const auto Vr = v.block(P, g * hd, nr, hd);
        const Eigen::RowVectorXf lo = c.vmin.cwiseMin(Vr.colwise().minCoeff());
        const Eigen::RowVectorXf hi = c.vmax.cwiseMax(Vr.colwise().maxCoeff());
        out.block(P, h * hd, nr, hd) =
            detail::prefix_attend(q.block(P, h * hd, nr, hd), c.keys, c.values, c.weights,
                                  c.log_scale, k.block(P, g * hd, nr, hd), Vr, beta, &lo, &hi);
      }
      return out;
    }
    // VCC: per query head, the TwoLevel partition of the prompt's keys guided by the recent
    // queries, each segment one row (mean key, mean value, log-scale log count, weight 1).
    VccSelectOptions so;
    so.segments = m_spec.budget;
    so.block_size = 16;
    so.scale = beta;
    for (Index g = 0; g < G; ++g) {
      const Mat kg = kp.middleCols(g * hd, hd), vg = vp.middleCols(g * hd, hd);
      const VccTree<float> tree(kg);
      for (Index h = g * group; h < (g + 1) * group; ++h) {
        const Mat qr = q.block(P, h * hd, nr, hd);
        const std::vector<VccSegment> J = tree.select(qr, so);
        const Index r = static_cast<Index>(J.size());
        Mat Kc(r, hd), Vc(r, hd);
        Vec ls(r), w = Vec::Ones(r);
        for (Index s = 0; s < r; ++s) {
          const VccSegment& seg = J[static_cast<std::size_t>(s)];
          const float inv = 1.0f / static_cast<float>(seg.count);
          Kc.row(s) = kg.middleRows(seg.begin, seg.count).colwise().sum() * inv;
          Vc.row(s) = vg.middleRows(seg.begin, seg.count).colwise().sum() * inv;
          ls(s) = std::log(static_cast<float>(seg.count));
        }
        out.block(P, h * hd, nr, hd) = detail::prefix_attend(
            qr, Kc, Vc, w, ls, k.block(P, g * hd, nr, hd), v.block(P, g * hd, nr, hd), beta);
      }
    }
    return out;
  }

  Config m_cfg;
  MethodSpec m_spec;
  std::vector<Index> m_vip;
  Eigen::VectorXd m_variance;
  std::vector<double> m_err_num, m_err_den;
  double m_method_s = 0, m_exact_s = 0;
};

}  // namespace lm
}  // namespace effattn
