// effattn-lm's two jobs: held-out evaluation (bits per byte, per-layer attention error, times)
// and generation with a KV cache (exact, or WildCat's compressed cache).
#pragma once

#include "../compare_methods.hpp"  // compare::spearman
#include "lm_attention.hpp"

#include <effattn/kv_press.hpp>
#include "lm_model.hpp"

#include <unistd.h>
#include <cstdio>
#include <optional>
#include <random>

namespace effattn {
namespace lm {

struct EvalOptions {
  Index context = 0;       ///< window length (0 = the model's training context)
  Index windows = 0;       ///< windows to evaluate (0 = every full window)
  Index first_window = 0;  ///< first window
  bool progress = false;   ///< progress bar on stderr
};

struct EvalResult {
  double bits_per_byte = 0;       ///< over every predicted position
  double bits_per_byte_tail = 0;  ///< decoder: positions of the recent window (the ones prefix
                                  ///< compression changes); encoder: same as bits_per_byte
  Index predicted = 0, predicted_tail = 0, windows = 0, context = 0;
  double forward_seconds = 0;    ///< whole forward passes (without the error measurement)
  double attention_seconds = 0;  ///< attention of every layer (method and exact layers)
  double method_seconds = 0;     ///< attention of the method layers
  double exact_seconds = 0;      ///< exact attention of the method layers, same inputs
  std::vector<double> layer_error;
  /// KEP-SVGP (encoder): Spearman rank correlation over masked tokens of the predictive
  /// variance with the realised loss; NaN otherwise.
  double variance_loss_spearman = std::numeric_limits<double>::quiet_NaN();
  double tokens_per_second() const {
    const double t = forward_seconds;
    return t > 0 ? static_cast<double>(windows * context) / t : 0;
  }
};

/// Held-out bits per byte of `model` with the attention of `ma` (FORMAT.md's evaluation).
inline EvalResult evaluate(const Model& model, const std::vector<int>& text, MethodAttention& ma,
                           const EvalOptions& opt) {
  const Config& c = model.cfg;
  const Index C = opt.context > 0 ? opt.context : c.context;
  const Index total = static_cast<Index>(text.size()) / C;
  if (C < 2) throw lm_error("effattn-lm: context must be >= 2");
  if (opt.first_window < 0 || opt.first_window >= total)
    throw lm_error("effattn-lm: the held-out text has " + std::to_string(total) + " windows of " +
                   std::to_string(C) + " bytes; first window " + std::to_string(opt.first_window) +
                   " does not exist");
  const Index nw =
      opt.windows > 0 ? std::min(opt.windows, total - opt.first_window) : total - opt.first_window;
  EvalResult res;
  res.context = C;
  res.windows = nw;
  double bits = 0, bits_tail = 0;
  std::vector<double> var, loss;
  const bool tty = opt.progress && isatty(2);
  for (Index wi = 0; wi < nw; ++wi) {
    const Index w = opt.first_window + wi;
    std::vector<int> tok(text.begin() + w * C, text.begin() + (w + 1) * C);
    std::vector<Index> masked;
    if (c.kind == Kind::Encoder) {
      masked = masked_positions(w, C);
      for (const Index t : masked) tok[static_cast<std::size_t>(t)] = c.mask_token;
    }
    ma.begin_window(masked);
    const double ex0 = ma.exact_seconds();
    ForwardTimes ft;
    const Mat logits = forward(model, tok, ma.fn(), &ft);
    const double ex = ma.exact_seconds() - ex0;  // error measurement, not part of the forward
    res.forward_seconds += ft.total - ex;
    res.attention_seconds += ft.attention - ex;
    if (c.kind == Kind::Decoder) {
      const Index tail0 = C - ma.recent(C);  // rows >= tail0 see the compressed prompt
      for (Index t = 1; t < C; ++t) {
        const double b = bits_of(logits.row(t - 1), text[static_cast<std::size_t>(w * C + t)]);
        bits += b;
        ++res.predicted;
        if (t - 1 >= tail0) bits_tail += b, ++res.predicted_tail;
      }
    } else {
      for (const Index t : masked) {
        const double b = bits_of(logits.row(t), text[static_cast<std::size_t>(w * C + t)]);
        bits += b;
        ++res.predicted;
        if (ma.variance().size() > 0) {
          var.push_back(ma.variance()(t));
          loss.push_back(b);
        }
      }
      bits_tail = bits;
      res.predicted_tail = res.predicted;
    }
    if (tty) {
      const int width = 30, done = static_cast<int>(width * (wi + 1) / nw);
      std::fprintf(stderr, "\r[%.*s%*s] %ld/%ld windows, %.3f bits/byte", done,
                   "##############################", width - done, "", static_cast<long>(wi + 1),
                   static_cast<long>(nw),
                   bits / static_cast<double>(std::max<Index>(1, res.predicted)));
      if (wi + 1 == nw) std::fprintf(stderr, "\n");
    }
  }
  res.bits_per_byte = bits / static_cast<double>(std::max<Index>(1, res.predicted));
  res.bits_per_byte_tail = bits_tail / static_cast<double>(std::max<Index>(1, res.predicted_tail));
  res.method_seconds = ma.method_seconds();
  res.exact_seconds = ma.exact_seconds();
  for (Index l = 0; l < c.layers; ++l) res.layer_error.push_back(ma.layer_error(l));
  if (var.size() > 2) res.variance_loss_spearman = compare::spearman(var, loss);
  return res;
}

struct GenerateOptions {
  std::string method = "exact";  ///< exact, or wildcat (compressed KV cache)
  Index budget = 256;            ///< WildCat: coreset rows per key/value head
  Index tokens = 200;            ///< tokens to generate per sequence
  Index batch = 1;               ///< sequences sampled together from the same prompt
  double temperature = 0.8;      ///< sampling temperature (0 = greedy)
  std::uint64_t seed = 42;       ///< sampling (sequence b: seed + b) and WildCat seed
  Index recompress_every = 256;  ///< WildCat: re-compress the exact tail when it reaches this
  /// A press (kv_press.hpp) of the prompt's cache, with method exact: the prompt's keys and
  /// values of every layer and kv head pressed to `keep` of their rows after the prefill; the
  /// decoded tokens are appended exactly. Empty: no press.
  std::string press;
  double keep = 0.1;             ///< the press's keep ratio
  KvPressOptions press_options;  ///< sinks, observation, pool (press, keep, seed set from above)
};

struct GenerateResult {
  std::vector<std::vector<int>> tokens;  ///< the generated tokens of each sequence
  Mat step_logits;    ///< sequence 0: logits after each fed token (tokens x vocab)
  Mat prompt_logits;  ///< logits of the prompt (prefill)
  double prefill_seconds = 0, decode_seconds = 0;
  double compress_seconds = 0;  ///< pressing the prompt's cache (part of decode_seconds)
  Index prompt_tokens = 0, cache_rows = 0;  ///< cache rows per (sequence, kv head) at the end
};

/// x W for a few rows: one row as a GEMV (a GEMM would pack W to multiply it by one row).
inline Mat rows_times(const Mat& x, const Mat& W) {
  if (x.rows() == 1) return Mat(x.row(0) * W);
  return x * W;
}

/// Autoregressive sampling of `batch` sequences from the decoder: a prefill over the prompt
/// (exact attention, its rotated keys and values kept), then one token per sequence and step
/// against the KV caches, the B sequences as one packed batch: exact (a preallocated row-major
/// cache region per sequence, `MultiHead::compute` with `cu_seqlens` and `seqused_k`, its
/// GEMM-free decoding kernel) or WildCat (`compress_kv` of the prompt, `append` per token,
/// `recompress_tail` every `recompress_every` tokens, `weighted_attention`). Cost per token: the
/// projections and MLP (O(D^2 + D F)) plus attention over the cache rows (exact: the tokens so
/// far; WildCat: about r + the tail). `forced` (tests): feed these tokens to every sequence
/// instead of sampling.
inline GenerateResult generate(const Model& model, const std::vector<int>& prompt,
                               const GenerateOptions& opt,
                               const std::vector<int>* forced = nullptr) {
  using clock = std::chrono::steady_clock;
  const Config& c = model.cfg;
  if (c.kind != Kind::Decoder) throw lm_error("effattn-lm: generate needs the decoder");
  if (prompt.empty()) throw lm_error("effattn-lm: empty prompt");
  if (opt.method != "exact" && opt.method != "wildcat")
    throw lm_error("effattn-lm: generate supports --method exact or wildcat");
  const bool pressed = !opt.press.empty();
  if (pressed && opt.method != "exact")
    throw lm_error("effattn-lm: --press runs with --method exact (the press is the cache)");
  if (opt.tokens < 0 || opt.budget < 1 || opt.recompress_every < 1 || opt.batch < 1)
    throw lm_error("effattn-lm: bad generation options");
  if (forced && static_cast<Index>(forced->size()) < opt.tokens)
    throw lm_error("effattn-lm: fewer forced tokens than steps");
  const Index T0 = static_cast<Index>(prompt.size()), N = opt.tokens, Tmax = T0 + N;
  const Index B = opt.batch, H = c.heads, G = c.kv_heads, hd = c.head_dim;
  const HeadLayout layout{H, G};
  GenerateResult res;
  res.prompt_tokens = T0;
  res.tokens.resize(static_cast<std::size_t>(B));
  // Row-major caches, one region of Tmax rows per sequence: a token appends one contiguous
  // row, and MultiHead's decoding kernel streams row-major K and V without GEMM packing.
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // Selection presses (every kept row a plain key / value) decode like exact attention, over a
  // compacted row-major cache; WildCat and the presses whose rows stand for several keys (vcc,
  // wildcat: log-scales, weights) decode against CompressedKV through weighted_attention.
  const bool selection = pressed && opt.press != "wildcat" && opt.press != "vcc";
  const bool wc = opt.method == "wildcat" || (pressed && !selection);
  const bool one_region = wc || pressed;  // the prefill's cache is pressed before decoding
  std::vector<RowMat> Kc(static_cast<std::size_t>(c.layers)), Vc(Kc.size());
  std::vector<Mat> Qp(pressed ? Kc.size() : 0);  // the prompt's queries, for query-guided presses
  std::optional<KvPressf> press;
  if (pressed) {
    KvPressOptions po = opt.press_options;
    po.press = kv_press::from_name(opt.press);
    po.keep = opt.keep;
    po.rows = 0;
    po.seed = opt.seed;
    po.query_heads = H / G;
    press.emplace(po);
  }
  ExactOptions eo;
  eo.causal = true;
  const MultiHead<ExactAttentionf> exact(eo, layout);
  // Decoding: one query per sequence against its region's first pos + 1 rows (seqused_k).
  const MultiHead<ExactAttentionf> decode(ExactOptions{}, layout);
  // Sequence b's cache region: rows [b Tcap, (b + 1) Tcap), the first r0 from the prompt.
  Index r0 = T0, Tcap = Tmax;
  SeqOffsets cu_q(static_cast<std::size_t>(B + 1)), regions(cu_q.size());
  const auto t0 = clock::now();
  res.prompt_logits =
      forward(model, prompt, [&](Index l, const Mat& q, const Mat& k, const Mat& v) {
        RowMat& K = Kc[static_cast<std::size_t>(l)];
        RowMat& V = Vc[static_cast<std::size_t>(l)];
        K.setZero(one_region ? T0 : B * Tmax, G * hd);
        V.setZero(K.rows(), G * hd);
        for (Index b = 0; b < (one_region ? 1 : B); ++b) {
          K.middleRows(b * Tmax, T0) = k;
          V.middleRows(b * Tmax, T0) = v;
        }
        if (pressed) Qp[static_cast<std::size_t>(l)] = q;
        return Mat(exact.compute(q, k, v).output);
      });
  res.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  const auto t1 = clock::now();
  WildcatOptions wo;
  wo.rank = opt.budget;
  wo.seed = opt.seed;
  const MultiHead<WildcatAttentionf> wild(wo, layout);
  using Cache = decltype(wild.compress_kv(Kc[0].topRows(T0), Vc[0].topRows(T0)));
  std::vector<Cache> caches;
  std::vector<double> qrad(static_cast<std::size_t>(c.layers), 0.0);
  if (pressed) {
    // Every layer's prompt cache pressed per kv head (the query-guided presses read the group's
    // prompt queries: all of them for observed and wildcat, the observation window otherwise),
    // then copied to every sequence.
    const Index group = H / G;
    const Index w = press->queries_read(T0);
    for (Index l = 0; l < c.layers; ++l) {
      const Mat K = Kc[static_cast<std::size_t>(l)], V = Vc[static_cast<std::size_t>(l)];
      const Mat& Q = Qp[static_cast<std::size_t>(l)];
      Cache all;
      all.batch = B;
      all.kv_heads = G;
      all.caches.resize(static_cast<std::size_t>(B * G));
      for (Index g = 0; g < G; ++g) {
        Mat Qg(w * group, hd);
        for (Index j = 0; j < group; ++j)
          Qg.middleRows(j * w, w) = Q.block(T0 - w, (g * group + j) * hd, w, hd);
        const auto one = press->compress(K.middleCols(g * hd, hd), V.middleCols(g * hd, hd), Qg);
        for (Index b = 0; b < B; ++b) all.at(b, g) = one;
      }
      Qp[static_cast<std::size_t>(l)].resize(0, 0);
      if (selection) {
        // The kept rows (as many for every kv head) at the start of each sequence's region.
        r0 = all.at(0, 0).size();
        Tcap = r0 + N;
        RowMat& Kl = Kc[static_cast<std::size_t>(l)];
        RowMat& Vl = Vc[static_cast<std::size_t>(l)];
        Kl.setZero(B * Tcap, G * hd);
        Vl.setZero(B * Tcap, G * hd);
        for (Index b = 0; b < B; ++b)
          for (Index g = 0; g < G; ++g) {
            Kl.block(b * Tcap, g * hd, r0, hd) = all.at(b, g).keys;
            Vl.block(b * Tcap, g * hd, r0, hd) = all.at(b, g).values;
          }
        continue;
      }
      caches.push_back(std::move(all));
      Kc[static_cast<std::size_t>(l)].resize(0, 0);
      Vc[static_cast<std::size_t>(l)].resize(0, 0);
    }
    res.compress_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  } else if (wc) {
    // The prompt's queries are not kept; the query radius is that of the prompt's keys, a
    // stand-in of the same scale (RMS-normed inputs), raised as decoding sees larger queries.
    // The prompt is compressed once and the caches copied to every sequence.
    for (Index l = 0; l < c.layers; ++l) {
      const RowMat& K = Kc[static_cast<std::size_t>(l)];
      double& qr = qrad[static_cast<std::size_t>(l)];
      qr = K.rowwise().norm().maxCoeff();
      const Cache one = wild.compress_kv(K, Vc[static_cast<std::size_t>(l)], {}, qr);
      Cache all;
      all.batch = B;
      all.kv_heads = G;
      for (Index b = 0; b < B; ++b)
        all.caches.insert(all.caches.end(), one.caches.begin(), one.caches.end());
      caches.push_back(std::move(all));
      Kc[static_cast<std::size_t>(l)].resize(0, 0);  // the prompt's exact keys are not needed
      Vc[static_cast<std::size_t>(l)].resize(0, 0);
    }
  }
  for (Index b = 0; b <= B; ++b) {
    cu_q[static_cast<std::size_t>(b)] = b;
    regions[static_cast<std::size_t>(b)] = b * Tcap;
  }
  Rope rope;
  rope.build(Tmax, hd, c.rope_base);
  std::vector<std::mt19937_64> rng;
  for (Index b = 0; b < B; ++b) rng.emplace_back(opt.seed + static_cast<std::uint64_t>(b));
  Mat last = res.prompt_logits.row(T0 - 1).replicate(B, 1);
  res.step_logits.resize(N, c.vocab);
  Mat x(B, c.d_model);
  for (Index i = 0; i < N; ++i) {
    const Index pos = T0 + i;
    for (Index b = 0; b < B; ++b) {  // sample each sequence's next token from its logits
      int next;
      if (forced) {
        next = (*forced)[static_cast<std::size_t>(i)];
      } else if (opt.temperature <= 0) {
        Index am;
        last.row(b).maxCoeff(&am);
        next = static_cast<int>(am);
      } else {
        const Eigen::ArrayXd z = last.row(b).transpose().cast<double>().array() / opt.temperature;
        const Eigen::ArrayXd p = (z - z.maxCoeff()).exp();
        std::discrete_distribution<int> dist(p.data(), p.data() + p.size());
        next = dist(rng[static_cast<std::size_t>(b)]);
      }
      res.tokens[static_cast<std::size_t>(b)].push_back(next);
      x.row(b) = model.embed_t.col(next).transpose();
    }
    for (Index l = 0; l < c.layers; ++l) {
      const Layer& L = model.layers[static_cast<std::size_t>(l)];
      Mat h = rmsnorm(x, L.attn_norm, c.norm_eps);
      Mat q = rows_times(h, L.wq), k = rows_times(h, L.wk), v = rows_times(h, L.wv);
      rope.apply_at(q, H, hd, pos);
      rope.apply_at(k, G, hd, pos);
      Mat a;
      if (!wc) {
        RowMat& K = Kc[static_cast<std::size_t>(l)];
        RowMat& V = Vc[static_cast<std::size_t>(l)];
        for (Index b = 0; b < B; ++b) {
          K.row(b * Tcap + r0 + i) = k.row(b);
          V.row(b * Tcap + r0 + i) = v.row(b);
        }
        const std::vector<Index> used(static_cast<std::size_t>(B), r0 + i + 1);
        a = decode.compute(q, K, V, cu_q, regions, used).output;
      } else {
        auto& cache = caches[static_cast<std::size_t>(l)];
        wild.append(cache, k, v, cu_q);
        double& qr = qrad[static_cast<std::size_t>(l)];
        for (Index b = 0; b < B; ++b)
          for (Index hh = 0; hh < H; ++hh)
            qr = std::max<double>(qr, q.block(b, hh * hd, 1, hd).norm());
        if (!pressed && cache.at(0, 0).tail_size() >= opt.recompress_every)
          for (auto& one : cache.caches) wild.functor().recompress_tail(one, qr);
        a = wild.weighted_attention(q, cache, cu_q).output;
        res.cache_rows = cache.at(0, 0).size();
      }
      x.noalias() += rows_times(a, L.wo);
      h = rmsnorm(x, L.mlp_norm, c.norm_eps);
      Mat u = rows_times(h, L.w1);
      gelu_inplace(u);
      x.noalias() += rows_times(u, L.w2);
    }
    last = rows_times(rmsnorm(x, model.final_norm, c.norm_eps), model.embed_t);
    res.step_logits.row(i) = last.row(0);
  }
  res.decode_seconds =
      std::chrono::duration<double>(clock::now() - t1).count() - res.compress_seconds;
  if (!wc) res.cache_rows = r0 + N;
  return res;
}

}  // namespace lm
}  // namespace effattn
