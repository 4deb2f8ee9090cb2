// effattn-lm's KV-cache evaluation: the decoder's prompt compressed by a press (kv_press.hpp),
// the bytes after it scored against exact attention on the same units, with paired-bootstrap
// confidence intervals.
//
// A unit is a span of the text (`--spans`: the model runs on the `context` bytes that end at the
// span's end, the bytes before the span are the prompt) or, without spans, a window of `context`
// bytes whose last `recent` bytes play the span. Per unit: the prompt is prefilled once with
// exact attention (its per-layer rotated keys, values and queries kept); then, for exact
// attention and every (press, keep), each layer's prompt keys and values are pressed per kv head
// and the span's bytes are run through the model against the pressed prompt plus their own keys
// (causally), as decoding with a compressed cache does. Only the span's bytes are scored (its
// first byte is predicted by the prompt's last position, which saw the whole prompt, so that
// byte's bits are the same for every press). The prompt's own prediction is the same for every
// press and is reported separately.
#pragma once

#include <effattn/kv_press.hpp>

#include "lm_attention.hpp"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace effattn {
namespace lm {

/// A byte range of the text whose bytes are scored.
struct Span {
  Index start = 0, length = 0;
};

/// Reads a spans file: one `START LENGTH` per line (byte offsets into the text); blank lines and
/// lines starting with '#' are skipped. Every span must lie inside the text, start at byte 1 or
/// later (byte 0 has nothing before it to be predicted from) and be at most `context` bytes.
inline std::vector<Span> read_spans(const std::string& path, Index text_size, Index context) {
  std::ifstream in(path);
  if (!in) throw lm_error("effattn-lm: --spans: cannot read " + path);
  std::vector<Span> spans;
  std::string line;
  for (Index no = 1; std::getline(in, line); ++no) {
    if (line.empty() || line[0] == '#' || line.find_first_not_of(" \t\r") == std::string::npos)
      continue;
    std::istringstream ss(line);
    long long a = -1, b = -1;
    std::string rest;
    const std::string where = "effattn-lm: --spans " + path + " line " + std::to_string(no);
    if (!(ss >> a >> b) || (ss >> rest))
      throw lm_error(where + ": expected 'START LENGTH', got '" + line + "'");
    if (a < 1 || b < 1 || a + b > text_size)
      throw lm_error(where + ": span " + std::to_string(a) + " + " + std::to_string(b) +
                     " is outside the text (" + std::to_string(text_size) +
                     " bytes; START >= 1, LENGTH >= 1)");
    if (b >= context)
      throw lm_error(where + ": span length " + std::to_string(b) + " must be shorter than " +
                     "--context " + std::to_string(context) + " (the prompt is the rest)");
    spans.push_back({a, b});
  }
  if (spans.empty()) throw lm_error("effattn-lm: --spans " + path + " holds no span");
  return spans;
}

/// One press at one keep ratio ("exact" = every prompt row kept).
struct PressConfig {
  std::string press;
  double keep = 1;
};

struct PressEvalOptions {
  Index context = 0;        ///< window length (0 = the model's training context)
  Index windows = 0;        ///< window mode: windows to evaluate (0 = every full window)
  Index first_window = 0;   ///< window mode: first window
  Index recent = 0;         ///< window mode: scored bytes at each window's end (0 = context / 2)
  std::vector<Span> spans;  ///< span mode when not empty
  std::vector<PressConfig> presses;
  KvPressOptions press;    ///< sinks, observation, pool, seed (press and keep per config)
  Index bootstrap = 2000;  ///< bootstrap resamples
  std::uint64_t bootstrap_seed = 7;
  bool progress = false;
};

/// What one press scored.
struct PressRow {
  PressConfig config;
  double bits_per_byte = 0;        ///< every predicted byte of the units (prompt + span)
  double span_bits_per_byte = 0;   ///< the span bytes
  double delta = 0;                ///< span bits per byte minus exact's, same units
  double ci_low = 0, ci_high = 0;  ///< 95% paired-bootstrap interval of delta
  double compress_seconds = 0;     ///< in the press
  double span_seconds = 0;         ///< the span forward against the pressed prompt
  double mean_rows = 0;            ///< cache rows per (layer, kv head), averaged over units
  std::vector<double> unit_bits;   ///< span bits per unit
};

struct PressEvalResult {
  Index units = 0, context = 0;
  Index prompt_bytes = 0, span_bytes = 0;  ///< predicted bytes (prompt bytes from position 1)
  double prompt_bits_per_byte = 0;         ///< the prompts' own bytes (exact for every press)
  double prefill_seconds = 0;
  PressRow exact;
  std::vector<PressRow> rows;
  std::vector<double> unit_bytes;  ///< scored span bytes per unit
};

namespace detail {

/// 2.5% and 97.5% percentiles of (sum b - sum a) / sum n over `reps` resamples of the units with
/// replacement (effattn's seeded generator: deterministic).
inline std::pair<double, double> paired_bootstrap(const std::vector<double>& a,
                                                  const std::vector<double>& b,
                                                  const std::vector<double>& n, Index reps,
                                                  std::uint64_t seed) {
  const auto N = static_cast<Index>(a.size());
  if (N == 0 || reps < 1) return {0.0, 0.0};
  Rng rng = make_rng(seed, 0xb0075ULL);
  std::vector<double> stats(static_cast<std::size_t>(reps));
  for (auto& s : stats) {
    double da = 0, db = 0, dn = 0;
    for (Index i = 0; i < N; ++i) {
      const auto u = static_cast<std::size_t>(uniform_index(rng, N));
      da += a[u];
      db += b[u];
      dn += n[u];
    }
    s = (db - da) / std::max(dn, 1.0);
  }
  std::sort(stats.begin(), stats.end());
  const auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(std::llround(q * static_cast<double>(reps - 1)));
    return stats[i];
  };
  return {at(0.025), at(0.975)};
}

}  // namespace detail

/// The KV-cache evaluation of the decoder (see the file comment).
inline PressEvalResult press_evaluate(const Model& model, const std::vector<int>& text,
                                      const PressEvalOptions& opt) {
  using clock = std::chrono::steady_clock;
  const auto secs = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  const Config& c = model.cfg;
  if (!c.causal()) throw lm_error("effattn-lm: --press compresses the decoder's prompt");
  const Index C = opt.context > 0 ? opt.context : c.context;
  if (C < 2) throw lm_error("effattn-lm: --context must be >= 2");
  const auto total = static_cast<Index>(text.size());
  const Index H = c.heads, G = c.kv_heads, hd = c.head_dim, group = H / G;
  const float beta = 1.0f / std::sqrt(static_cast<float>(hd));
  // The units: [begin, end) of the bytes the model runs on, and the prompt length.
  struct Unit {
    Index begin, prompt, end;
  };
  std::vector<Unit> units;
  if (!opt.spans.empty()) {
    for (const Span& s : opt.spans) {
      const Index end = s.start + s.length, begin = std::max<Index>(0, end - C);
      units.push_back({begin, s.start - begin, end});
    }
  } else {
    const Index nw = total / C, recent = opt.recent > 0 ? opt.recent : C / 2;
    if (recent >= C) throw lm_error("effattn-lm: --recent must be smaller than --context");
    if (opt.first_window < 0 || opt.first_window >= nw)
      throw lm_error("effattn-lm: the text has " + std::to_string(nw) + " windows of " +
                     std::to_string(C) + " bytes; first window " +
                     std::to_string(opt.first_window) + " does not exist");
    const Index n =
        opt.windows > 0 ? std::min(opt.windows, nw - opt.first_window) : nw - opt.first_window;
    for (Index w = opt.first_window; w < opt.first_window + n; ++w)
      units.push_back({w * C, C - recent, (w + 1) * C});
  }
  std::vector<PressConfig> configs = opt.presses;
  std::vector<KvPress<float>> presses;
  for (const PressConfig& pc : configs) {
    KvPressOptions o = opt.press;
    o.press = kv_press::from_name(pc.press);
    o.keep = pc.keep;
    o.rows = 0;
    o.query_heads = group;
    presses.emplace_back(o);  // validates keep
  }
  PressEvalResult res;
  res.context = C;
  res.units = static_cast<Index>(units.size());
  res.exact.config = {"exact", 1.0};
  res.rows.resize(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) res.rows[i].config = configs[i];
  double prompt_bits = 0;
  ExactOptions eo;
  eo.causal = true;
  const MultiHead<ExactAttentionf> exact(eo, HeadLayout{H, G});
  const bool tty = opt.progress && isatty(2);
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    const Unit& u = units[ui];
    const std::vector<int> tok(text.begin() + u.begin, text.begin() + u.end);
    const Index P = u.prompt, S = u.end - u.begin - P;
    // Prefill: the prompt with exact attention, its per-layer q, k, v kept.
    std::vector<Mat> Qp(static_cast<std::size_t>(c.layers)), Kp(Qp.size()), Vp(Qp.size());
    const auto t0 = clock::now();
    const Mat prompt_logits = forward(model, std::vector<int>(tok.begin(), tok.begin() + P),
                                      [&](Index l, const Mat& q, const Mat& k, const Mat& v) {
                                        Qp[static_cast<std::size_t>(l)] = q;
                                        Kp[static_cast<std::size_t>(l)] = k;
                                        Vp[static_cast<std::size_t>(l)] = v;
                                        return Mat(exact.compute(q, k, v).output);
                                      });
    res.prefill_seconds += secs(t0);
    for (Index t = 1; t < P; ++t)
      prompt_bits += bits_of(prompt_logits.row(t - 1), tok[static_cast<std::size_t>(t)]);
    res.prompt_bytes += P - 1;
    const double first_bits = bits_of(prompt_logits.row(P - 1), tok[static_cast<std::size_t>(P)]);
    res.unit_bytes.push_back(static_cast<double>(S));
    res.span_bytes += S;
    // The span against a pressed prompt; press < 0 is exact.
    const auto run = [&](Index pi, PressRow& row) {
      std::vector<std::vector<CompressedKV<float>>> caches(static_cast<std::size_t>(c.layers));
      const auto t1 = clock::now();
      Index rows = 0;
      for (Index l = 0; l < c.layers; ++l) {
        const Mat& K = Kp[static_cast<std::size_t>(l)];
        const Mat& V = Vp[static_cast<std::size_t>(l)];
        const Mat& Q = Qp[static_cast<std::size_t>(l)];
        for (Index g = 0; g < G; ++g) {
          CompressedKV<float> ck;
          const auto Kg = K.middleCols(g * hd, hd), Vg = V.middleCols(g * hd, hd);
          if (pi < 0) {
            ck.keys = Kg;
            ck.values = Vg;
            ck.weights = Vec::Ones(P);
            ck.log_scale = Vec::Zero(P);
          } else {
            const KvPress<float>& press = presses[static_cast<std::size_t>(pi)];
            // The queries a press reads, the group's query heads stacked.
            const Index w = press.queries_read(P);
            Mat Qg(w * group, hd);
            for (Index j = 0; j < group; ++j)
              Qg.middleRows(j * w, w) = Q.block(P - w, (g * group + j) * hd, w, hd);
            ck = press.compress(Kg, Vg, Qg);
          }
          rows += ck.size();
          caches[static_cast<std::size_t>(l)].push_back(std::move(ck));
        }
      }
      row.compress_seconds += pi < 0 ? 0.0 : secs(t1);
      row.mean_rows += static_cast<double>(rows) / static_cast<double>(c.layers * G);
      double bits = first_bits;
      if (S > 1) {
        const auto t2 = clock::now();
        const bool clip = pi >= 0 && configs[static_cast<std::size_t>(pi)].press == "wildcat";
        const Mat logits = forward(
            model, std::vector<int>(tok.begin() + P, tok.end() - 1),
            [&](Index l, const Mat& q, const Mat& k, const Mat& v) {
              Mat out(q.rows(), H * hd);
              for (Index h = 0; h < H; ++h) {
                const Index g = h / group;
                const CompressedKV<float>& ck =
                    caches[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)];
                const auto Vr = v.middleCols(g * hd, hd);
                Eigen::RowVectorXf lo, hi;
                if (clip) {
                  lo = ck.vmin.cwiseMin(Vr.colwise().minCoeff());
                  hi = ck.vmax.cwiseMax(Vr.colwise().maxCoeff());
                }
                out.middleCols(h * hd, hd) = detail::prefix_attend(
                    q.middleCols(h * hd, hd), ck.keys, ck.values, ck.weights, ck.log_scale,
                    k.middleCols(g * hd, hd), Vr, beta, clip ? &lo : nullptr, clip ? &hi : nullptr);
              }
              return out;
            },
            nullptr, P);
        for (Index i = 1; i < S; ++i)
          bits += bits_of(logits.row(i - 1), tok[static_cast<std::size_t>(P + i)]);
        row.span_seconds += secs(t2);
      }
      row.unit_bits.push_back(bits);
    };
    run(-1, res.exact);
    for (std::size_t pi = 0; pi < presses.size(); ++pi) run(static_cast<Index>(pi), res.rows[pi]);
    if (tty) {
      std::fprintf(stderr, "\r%zu/%zu units", ui + 1, units.size());
      if (ui + 1 == units.size()) std::fprintf(stderr, "\n");
    }
  }
  const auto sum = [](const std::vector<double>& x) {
    double s = 0;
    for (const double v : x) s += v;
    return s;
  };
  const double nspan = static_cast<double>(res.span_bytes);
  const double nall = static_cast<double>(res.span_bytes + res.prompt_bytes);
  res.prompt_bits_per_byte =
      prompt_bits / std::max<double>(1.0, static_cast<double>(res.prompt_bytes));
  const auto finish = [&](PressRow& row) {
    const double b = sum(row.unit_bits);
    row.span_bits_per_byte = b / nspan;
    row.bits_per_byte = (b + prompt_bits) / nall;
    row.delta = (b - sum(res.exact.unit_bits)) / nspan;
    row.mean_rows /= static_cast<double>(std::max<Index>(1, res.units));
    std::tie(row.ci_low, row.ci_high) = detail::paired_bootstrap(
        res.exact.unit_bits, row.unit_bits, res.unit_bytes, opt.bootstrap, opt.bootstrap_seed);
  };
  finish(res.exact);
  for (PressRow& row : res.rows) finish(row);
  return res;
}

}  // namespace lm
}  // namespace effattn
