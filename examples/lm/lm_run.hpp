// effattn-lm's two jobs: held-out evaluation (bits per byte, per-layer attention error, times)
// and generation with a KV cache (exact, or WildCat's compressed cache).
#pragma once

#include "../compare_methods.hpp"  // compare::spearman
#include "lm_attention.hpp"
#include "lm_model.hpp"

#include <unistd.h>
#include <cstdio>
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
  Index tokens = 200;            ///< tokens to generate
  double temperature = 0.8;      ///< sampling temperature (0 = greedy)
  std::uint64_t seed = 42;       ///< sampling and WildCat seed
  Index recompress_every = 256;  ///< WildCat: re-compress the exact tail when it reaches this
};

struct GenerateResult {
  std::vector<int> tokens;  ///< the generated tokens
  Mat step_logits;          ///< logits of every decoding step (new_tokens x vocab)
  Mat prompt_logits;        ///< logits of the prompt (prefill)
  double prefill_seconds = 0, decode_seconds = 0;
  Index prompt_tokens = 0, cache_rows = 0;  ///< cache rows per key/value head at the end
};

/// Autoregressive sampling from the decoder: a prefill over the prompt (exact attention, its
/// rotated keys and values kept), then one token at a time against the KV cache: exact (keys
/// appended to a preallocated cache, `MultiHead::compute` with `seqused_k`) or WildCat
/// (`compress_kv` of the prompt, `append` per token, `recompress_tail` every
/// `recompress_every` tokens, `weighted_attention`). Cost per token: the projections and MLP
/// (O(D^2 + D F)) plus attention over the cache rows (exact: t; WildCat: about r + tail).
/// `forced` (tests): feed these tokens instead of sampling.
inline GenerateResult generate(const Model& model, const std::vector<int>& prompt,
                               const GenerateOptions& opt,
                               const std::vector<int>* forced = nullptr) {
  using clock = std::chrono::steady_clock;
  const Config& c = model.cfg;
  if (c.kind != Kind::Decoder) throw lm_error("effattn-lm: generate needs the decoder");
  if (prompt.empty()) throw lm_error("effattn-lm: empty prompt");
  if (opt.method != "exact" && opt.method != "wildcat")
    throw lm_error("effattn-lm: generate supports --method exact or wildcat");
  if (opt.tokens < 0 || opt.budget < 1 || opt.recompress_every < 1)
    throw lm_error("effattn-lm: bad generation options");
  const Index T0 = static_cast<Index>(prompt.size()), N = opt.tokens, Tmax = T0 + N;
  const Index H = c.heads, G = c.kv_heads, hd = c.head_dim;
  const HeadLayout layout{H, G};
  GenerateResult res;
  res.prompt_tokens = T0;
  // Prefill: exact attention, keeping every layer's rotated K and V.
  // Row-major caches: a token appends one contiguous row, and MultiHead's decoding kernel
  // streams row-major K and V without GEMM packing.
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<RowMat> Kc(static_cast<std::size_t>(c.layers)), Vc(Kc.size());
  ExactOptions eo;
  eo.causal = true;
  const MultiHead<ExactAttentionf> exact(eo, layout);
  // Decoding: one query against the cache's first pos + 1 rows (seqused_k), no mask needed.
  const MultiHead<ExactAttentionf> decode(ExactOptions{}, layout);
  const auto t0 = clock::now();
  res.prompt_logits =
      forward(model, prompt, [&](Index l, const Mat& q, const Mat& k, const Mat& v) {
        Kc[static_cast<std::size_t>(l)].setZero(Tmax, G * hd);
        Vc[static_cast<std::size_t>(l)].setZero(Tmax, G * hd);
        Kc[static_cast<std::size_t>(l)].topRows(T0) = k;
        Vc[static_cast<std::size_t>(l)].topRows(T0) = v;
        return Mat(exact.compute(q, k, v).output);
      });
  WildcatOptions wo;
  wo.rank = opt.budget;
  wo.seed = opt.seed;
  const MultiHead<WildcatAttentionf> wild(wo, layout);
  using Cache = decltype(wild.compress_kv(Kc[0].topRows(T0), Vc[0].topRows(T0)));
  std::vector<Cache> caches;
  std::vector<double> qrad(static_cast<std::size_t>(c.layers), 0.0);
  const bool wc = opt.method == "wildcat";
  res.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  const auto t1 = clock::now();
  if (wc) {
    // The prompt's queries are not kept; the query radius is that of the prompt's keys, a
    // stand-in of the same scale (RMS-normed inputs), raised as decoding sees larger queries.
    for (Index l = 0; l < c.layers; ++l) {
      const RowMat& K = Kc[static_cast<std::size_t>(l)];
      qrad[static_cast<std::size_t>(l)] = K.topRows(T0).rowwise().norm().maxCoeff();
      caches.push_back(wild.compress_kv(K.topRows(T0), Vc[static_cast<std::size_t>(l)].topRows(T0),
                                        {}, qrad[static_cast<std::size_t>(l)]));
    }
  }
  Rope rope;
  rope.build(Tmax, hd, c.rope_base);
  std::mt19937_64 rng(opt.seed);
  Eigen::RowVectorXf last = res.prompt_logits.row(T0 - 1);
  res.step_logits.resize(N, c.vocab);
  Eigen::RowVectorXf x(c.d_model);
  for (Index i = 0; i < N; ++i) {
    // Sample the next token from `last`.
    int next;
    if (forced) {
      next = (*forced)[static_cast<std::size_t>(i)];
    } else if (opt.temperature <= 0) {
      Index am;
      last.maxCoeff(&am);
      next = static_cast<int>(am);
    } else {
      const Eigen::ArrayXd z = (last.cast<double>().array() / opt.temperature);
      const Eigen::ArrayXd p = (z - z.maxCoeff()).exp();
      std::discrete_distribution<int> dist(p.data(), p.data() + p.size());
      next = dist(rng);
    }
    res.tokens.push_back(next);
    const Index pos = T0 + i;
    // One row: row vectors keep every projection a GEMV (no GEMM packing for one token).
    x = model.embed_t.col(next).transpose();
    for (Index l = 0; l < c.layers; ++l) {
      const Layer& L = model.layers[static_cast<std::size_t>(l)];
      Eigen::RowVectorXf h = rmsnorm_row(x, L.attn_norm, c.norm_eps);
      Mat q = h * L.wq, k = h * L.wk, v = h * L.wv;
      rope.apply(q, H, hd, pos);
      rope.apply(k, G, hd, pos);
      Mat a;
      if (!wc) {
        RowMat& K = Kc[static_cast<std::size_t>(l)];
        RowMat& V = Vc[static_cast<std::size_t>(l)];
        K.row(pos) = k.row(0);
        V.row(pos) = v.row(0);
        a = decode.compute(q, K, V, {0, 1}, {0, Tmax}, {pos + 1}).output;
      } else {
        auto& cache = caches[static_cast<std::size_t>(l)];
        wild.append(cache, k, v);
        double& qr = qrad[static_cast<std::size_t>(l)];
        for (Index hh = 0; hh < H; ++hh)
          qr = std::max<double>(qr, q.middleCols(hh * hd, hd).norm());
        if (cache.at(0, 0).tail_size() >= opt.recompress_every)
          for (Index g = 0; g < G; ++g) wild.functor().recompress_tail(cache.at(0, g), qr);
        a = wild.weighted_attention(q, cache).output;
        res.cache_rows = cache.at(0, 0).size();
      }
      x.noalias() += a.row(0) * L.wo;
      h = rmsnorm_row(x, L.mlp_norm, c.norm_eps);
      Eigen::RowVectorXf u = h * L.w1;
      u.array() = 0.5f * u.array() * (1.0f + (u.array() * 0.70710678118654752f).erf());
      x.noalias() += u * L.w2;
    }
    last = rmsnorm_row(x, model.final_norm, c.norm_eps) * model.embed_t;
    res.step_logits.row(i) = last;
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  if (!wc) res.cache_rows = Tmax;
  return res;
}

}  // namespace lm
}  // namespace effattn
