// effattn-lm: the two small byte-level transformers of examples/lm (trained on the King James
// Bible, FORMAT.md) run on Eigen with any effattn method in place of exact attention.
//
//   effattn-lm eval --model decoder|encoder --method NAME [--budget B] [--context C]
//                   [--windows W] [--layers 0,2] [--recent R] [--seed S] [--json FILE]
//                   [--text FILE] [--spans FILE] [--press NAME[,NAME..] --keep R[,R..]]
//   effattn-lm generate --prompt TEXT [--tokens N] [--method exact|wildcat] [--budget B]
//                   [--temperature T] [--seed S] [--json FILE]
//   effattn-lm methods
//
// eval prints held-out bits per byte, tokens per second, the attention time of the method layers
// against exact attention on the same inputs, and the per-layer attention-output error.
#include "lm_press.hpp"
#include "lm_run.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

namespace {

using namespace effattn::lm;

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(
      stderr,
      "effattn-lm: %s\n"
      "usage:\n"
      "  effattn-lm eval --model decoder|encoder --method NAME [--budget B] [--context C]\n"
      "                  [--windows W] [--first-window F] [--layers 0,2] [--recent R]\n"
      "                  [--seed S] [--no-layer-error] [--json FILE] [--weights FILE]\n"
      "                  [--text FILE] [--spans FILE] [--press NAME[,NAME...]]\n"
      "                  [--keep RATIO[,RATIO...]] [--sinks N] [--observation N]\n"
      "  effattn-lm generate --prompt TEXT [--tokens N] [--method exact|wildcat]\n"
      "                  [--budget B] [--temperature T] [--seed S] [--json FILE]\n"
      "                  [--prompt-file FILE [--prompt-bytes N]] [--press NAME --keep R]\n"
      "  effattn-lm methods\n"
      "decoder methods: exact conv_basis eva wildcat vcc (wildcat, vcc: prefix compression)\n"
      "presses (decoder, --method exact): drop streaming uniform knorm snapkv observed wildcat\n"
      "  vcc; each (press, keep) is scored against exact attention on the same spans/windows\n"
      "encoder methods: exact wildcat vcc eva performer kep_svgp\n"
      "files: $EFFATTN_LM_DIR (default %s)/weights/*.eflm, data/heldout.txt\n",
      msg.c_str(), lm_dir().c_str());
  std::exit(2);
}

long parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') usage(flag + " needs an integer, got '" + v + "'");
  return x;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", ch);
      o += b;
    } else {
      o += ch;
    }
  }
  return o;
}

std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  std::ostringstream s;
  s.precision(9);
  s << x;
  return s.str();
}

double parse_double(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0') usage(flag + " needs a number, got '" + v + "'");
  return x;
}

std::vector<std::string> split_commas(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

/// The text to evaluate on: --text FILE or the held-out split; an empty file is an error.
std::vector<int> eval_text(const std::string& path) {
  const std::string p = path.empty() ? heldout_path() : path;
  std::vector<int> t = read_text(p);
  if (t.size() < 2)
    throw lm_error("effattn-lm: " + std::string(path.empty() ? "the held-out text " : "--text ") +
                   p + " holds " + std::to_string(t.size()) + " bytes; at least 2 are needed");
  return t;
}

void print_press_row(const PressRow& r) {
  std::printf(
      "  %-10s keep %-6.3g span %.4f  delta %+.4f [%+.4f, %+.4f]  rows %.0f  "
      "compress %.3f s  span %.3f s\n",
      r.config.press.c_str(), r.config.keep, r.span_bits_per_byte, r.delta, r.ci_low, r.ci_high,
      r.mean_rows, r.compress_seconds, r.span_seconds);
}

void write_press_row(std::ostream& o, const PressRow& r) {
  o << "{\"press\": \"" << r.config.press << "\", \"keep\": " << num(r.config.keep)
    << ", \"bits_per_byte\": " << num(r.bits_per_byte)
    << ", \"span_bits_per_byte\": " << num(r.span_bits_per_byte) << ", \"delta\": " << num(r.delta)
    << ", \"ci95\": [" << num(r.ci_low) << ", " << num(r.ci_high)
    << "], \"mean_rows\": " << num(r.mean_rows)
    << ", \"compress_seconds\": " << num(r.compress_seconds)
    << ", \"span_seconds\": " << num(r.span_seconds) << "}";
}

/// eval --press: the KV-cache evaluation (lm_press.hpp).
int run_press_eval(const Model& model, const std::string& model_name, const std::vector<int>& text,
                   PressEvalOptions po, const std::string& spans_path, const std::string& text_path,
                   const std::string& json) {
  const Index C = po.context > 0 ? po.context : model.cfg.context;
  if (!spans_path.empty()) po.spans = read_spans(spans_path, static_cast<Index>(text.size()), C);
  const PressEvalResult r = press_evaluate(model, text, po);
  std::printf("effattn-lm eval: %s, context %ld, %ld %s (%ld scored bytes), text %s\n",
              model_name.c_str(), static_cast<long>(r.context), static_cast<long>(r.units),
              po.spans.empty() ? "windows" : "spans", static_cast<long>(r.span_bytes),
              text_path.empty() ? heldout_path().c_str() : text_path.c_str());
  std::printf("  prompt bits per byte %.4f (exact, every press)\n", r.prompt_bits_per_byte);
  std::printf("  exact      span %.4f  (bits per byte of the scored bytes)\n",
              r.exact.span_bits_per_byte);
  for (const PressRow& row : r.rows) print_press_row(row);
  if (!json.empty()) {
    std::ofstream o(json);
    if (!o) throw lm_error("effattn-lm: cannot write " + json);
    const PressRow& main = r.rows.size() == 1 ? r.rows[0] : r.exact;
    o << "{\n  \"model\": \"" << model_name
      << "\", \"method\": \"exact\", \"context\": " << r.context << ", \"units\": " << r.units
      << ", \"spans\": " << (po.spans.empty() ? "false" : "true") << ", \"text\": \""
      << json_escape(text_path) << "\""
      << ",\n  \"span_bytes\": " << r.span_bytes << ", \"prompt_bytes\": " << r.prompt_bytes
      << ", \"prompt_bits_per_byte\": " << num(r.prompt_bits_per_byte)
      << ", \"prefill_seconds\": " << num(r.prefill_seconds) << ",\n  \"press\": \""
      << main.config.press << "\", \"keep\": " << num(main.config.keep)
      << ", \"bits_per_byte\": " << num(main.bits_per_byte)
      << ", \"span_bits_per_byte\": " << num(main.span_bits_per_byte)
      << ", \"delta\": " << num(main.delta) << ", \"ci95\": [" << num(main.ci_low) << ", "
      << num(main.ci_high) << "],\n  \"exact\": ";
    write_press_row(o, r.exact);
    o << ",\n  \"presses\": [";
    for (std::size_t i = 0; i < r.rows.size(); ++i) {
      o << (i ? ",\n    " : "\n    ");
      write_press_row(o, r.rows[i]);
    }
    o << "],\n  \"bootstrap\": {\"resamples\": " << po.bootstrap
      << ", \"seed\": " << po.bootstrap_seed << ", \"unit\": \""
      << (po.spans.empty() ? "window" : "span") << "\"}\n}\n";
  }
  return 0;
}

int run_eval(const std::vector<std::string>& args) {
  std::string model_name, json, weights, text_path, spans_path;
  std::vector<std::string> press_names;
  std::vector<double> keeps;
  PressEvalOptions po;
  MethodSpec spec;
  EvalOptions eo;
  eo.progress = true;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) usage(a + " needs a value");
      return args[++i];
    };
    if (a == "--model")
      model_name = value();
    else if (a == "--method")
      spec.name = value();
    else if (a == "--budget")
      spec.budget = parse_int(a, value());
    else if (a == "--context")
      eo.context = parse_int(a, value());
    else if (a == "--windows")
      eo.windows = parse_int(a, value());
    else if (a == "--first-window")
      eo.first_window = parse_int(a, value());
    else if (a == "--recent")
      spec.recent = parse_int(a, value());
    else if (a == "--seed")
      spec.seed = static_cast<std::uint64_t>(parse_int(a, value()));
    else if (a == "--json")
      json = value();
    else if (a == "--weights")
      weights = value();
    else if (a == "--no-layer-error")
      spec.layer_error = false;
    else if (a == "--text")
      text_path = value();
    else if (a == "--spans")
      spans_path = value();
    else if (a == "--press")
      press_names = split_commas(value());
    else if (a == "--keep") {
      for (const std::string& k : split_commas(value())) {
        const double x = parse_double(a, k);
        if (!(x > 0 && x <= 1)) usage("--keep must be in (0, 1], got '" + k + "'");
        keeps.push_back(x);
      }
    } else if (a == "--sinks")
      po.press.sinks = parse_int(a, value());
    else if (a == "--observation")
      po.press.observation = parse_int(a, value());
    else if (a == "--pool")
      po.press.pool = parse_int(a, value());
    else if (a == "--bootstrap")
      po.bootstrap = parse_int(a, value());
    else if (a == "--no-progress")
      eo.progress = false;
    else if (a == "--layers") {
      std::stringstream ss(value());
      std::string item;
      while (std::getline(ss, item, ',')) spec.layers.push_back(parse_int("--layers", item));
    } else
      usage("unknown argument '" + a + "'");
  }
  if (model_name != "decoder" && model_name != "encoder")
    usage("--model must be decoder or encoder");
  if (eo.context < 0 || eo.windows < 0 || spec.recent < 0) usage("negative value");
  for (const std::string& p : press_names) {
    bool known = false;
    for (const auto k : effattn::kv_press::all()) known = known || p == effattn::kv_press::name(k);
    if (!known)
      usage("--press: unknown press '" + p +
            "' (presses: drop streaming uniform knorm snapkv observed wildcat vcc)");
  }
  if (!press_names.empty() && keeps.empty()) usage("--press needs --keep RATIO");
  if (press_names.empty() && !keeps.empty()) usage("--keep goes with --press NAME");
  if (press_names.empty() && !spans_path.empty()) usage("--spans goes with --press NAME");
  if (!press_names.empty() && model_name != "decoder")
    usage("--press compresses the decoder's prompt: use --model decoder");
  if (!press_names.empty() && spec.name != "exact")
    usage("--press runs with --method exact (the press replaces the prompt's cache)");
  const Model model = load_model(weights.empty() ? weights_path(model_name) : weights);
  const std::vector<int> text = eval_text(text_path);
  if (!press_names.empty()) {
    for (const std::string& p : press_names)
      for (const double k : keeps) po.presses.push_back({p, k});
    po.context = eo.context;
    po.windows = eo.windows;
    po.first_window = eo.first_window;
    po.recent = spec.recent;
    po.press.seed = spec.seed;
    po.progress = eo.progress;
    return run_press_eval(model, model_name, text, po, spans_path, text_path, json);
  }
  MethodAttention ma(model.cfg, spec);
  const EvalResult r = evaluate(model, text, ma, eo);
  const MethodSpec& s = ma.spec();
  std::printf("effattn-lm eval: %s, method %s, budget %ld, context %ld, %ld windows\n",
              model_name.c_str(), s.name.c_str(), static_cast<long>(s.budget),
              static_cast<long>(r.context), static_cast<long>(r.windows));
  std::printf("  bits per byte      %.4f  (%ld predicted bytes)\n", r.bits_per_byte,
              static_cast<long>(r.predicted));
  if (model.cfg.causal())
    std::printf("  tail bits per byte %.4f  (last %ld positions of each window)\n",
                r.bits_per_byte_tail, static_cast<long>(ma.recent(r.context)));
  std::printf("  tokens per second  %.0f   (forward %.2f s, attention %.2f s)\n",
              r.tokens_per_second(), r.forward_seconds, r.attention_seconds);
  if (s.layer_error && s.name != "exact") {
    std::printf("  method layers: attention %.3f s vs exact %.3f s on the same inputs (%.2fx)\n",
                r.method_seconds, r.exact_seconds,
                r.method_seconds > 0 ? r.exact_seconds / r.method_seconds : 0.0);
    std::printf("  per-layer relative error of the attention output:");
    for (std::size_t l = 0; l < r.layer_error.size(); ++l)
      std::printf(" L%zu %s", l,
                  std::isfinite(r.layer_error[l]) ? num(r.layer_error[l]).c_str() : "-");
    std::printf("\n");
  }
  if (std::isfinite(r.variance_loss_spearman))
    std::printf("  Spearman(variance, loss) over masked bytes: %.3f\n", r.variance_loss_spearman);
  if (!json.empty()) {
    std::ofstream o(json);
    if (!o) throw lm_error("effattn-lm: cannot write " + json);
    o << "{\n  \"model\": \"" << model_name << "\", \"method\": \"" << s.name
      << "\", \"budget\": " << s.budget << ", \"context\": " << r.context
      << ", \"windows\": " << r.windows
      << ", \"recent\": " << (model.cfg.causal() ? ma.recent(r.context) : 0)
      << ",\n  \"layers\": [";
    for (Index l = 0; l < model.cfg.layers; ++l)
      o << (l ? ", " : "") << (ma.uses(l) ? "true" : "false");
    o << "],\n  \"bits_per_byte\": " << num(r.bits_per_byte)
      << ", \"bits_per_byte_tail\": " << num(r.bits_per_byte_tail)
      << ", \"predicted\": " << r.predicted
      << ",\n  \"tokens_per_second\": " << num(r.tokens_per_second())
      << ", \"forward_seconds\": " << num(r.forward_seconds)
      << ", \"attention_seconds\": " << num(r.attention_seconds)
      << ",\n  \"method_attention_seconds\": " << num(r.method_seconds)
      << ", \"exact_attention_seconds\": " << num(r.exact_seconds) << ",\n  \"layer_error\": [";
    for (std::size_t l = 0; l < r.layer_error.size(); ++l)
      o << (l ? ", " : "") << num(r.layer_error[l]);
    o << "],\n  \"variance_loss_spearman\": " << num(r.variance_loss_spearman) << "\n}\n";
  }
  return 0;
}

int run_generate(const std::vector<std::string>& args) {
  GenerateOptions go;
  std::string prompt = "In the beginning", json, weights, prompt_file;
  long prompt_bytes = 0;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) usage(a + " needs a value");
      return args[++i];
    };
    if (a == "--prompt")
      prompt = value();
    else if (a == "--tokens")
      go.tokens = parse_int(a, value());
    else if (a == "--batch")
      go.batch = parse_int(a, value());
    else if (a == "--method")
      go.method = value();
    else if (a == "--budget")
      go.budget = parse_int(a, value());
    else if (a == "--seed")
      go.seed = static_cast<std::uint64_t>(parse_int(a, value()));
    else if (a == "--recompress-every")
      go.recompress_every = parse_int(a, value());
    else if (a == "--temperature")
      go.temperature = std::atof(value().c_str());
    else if (a == "--json")
      json = value();
    else if (a == "--weights")
      weights = value();
    else if (a == "--press")
      go.press = value();
    else if (a == "--keep") {
      go.keep = parse_double(a, value());
      if (!(go.keep > 0 && go.keep <= 1)) usage("--keep must be in (0, 1]");
    } else if (a == "--sinks")
      go.press_options.sinks = parse_int(a, value());
    else if (a == "--observation")
      go.press_options.observation = parse_int(a, value());
    else if (a == "--prompt-file")
      prompt_file = value();
    else if (a == "--prompt-bytes")
      prompt_bytes = parse_int(a, value());
    else
      usage("unknown argument '" + a + "'");
  }
  if (!go.press.empty()) {
    bool known = false;
    for (const auto k : effattn::kv_press::all())
      known = known || go.press == effattn::kv_press::name(k);
    if (!known)
      usage("--press: unknown press '" + go.press +
            "' (presses: drop streaming uniform knorm snapkv observed wildcat vcc)");
  }
  if (!prompt_file.empty()) {
    const std::vector<int> t = read_text(prompt_file);
    if (t.empty()) usage("--prompt-file " + prompt_file + " is empty");
    const std::size_t n =
        prompt_bytes > 0 ? std::min<std::size_t>(t.size(), static_cast<std::size_t>(prompt_bytes))
                         : t.size();
    prompt.assign(t.end() - static_cast<std::ptrdiff_t>(n), t.end());
  } else if (prompt_bytes > 0) {
    usage("--prompt-bytes goes with --prompt-file");
  }
  if (prompt.empty()) usage("--prompt must not be empty");
  if (go.tokens < 1) usage("--tokens must be >= 1");
  if (go.batch < 1) usage("--batch must be >= 1");
  const Model model = load_model(weights.empty() ? weights_path("decoder") : weights);
  std::vector<int> p(prompt.begin(), prompt.end());
  for (int& t : p) t &= 0xff;
  const GenerateResult r = generate(model, p, go);
  std::string out;
  for (std::size_t b = 0; b < r.tokens.size(); ++b) {
    const std::string text(r.tokens[b].begin(), r.tokens[b].end());
    if (r.tokens.size() > 1) std::printf("--- sample %zu\n", b);
    std::printf("%s%s\n", prompt.c_str(), text.c_str());
    if (b == 0) out = text;
  }
  const double tps =
      static_cast<double>(go.batch * static_cast<Index>(r.tokens[0].size())) / r.decode_seconds;
  const double pps = static_cast<double>(r.prompt_tokens) / r.prefill_seconds;
  const std::string what = go.press.empty() ? go.method : "press " + go.press;
  std::fprintf(stderr,
               "effattn-lm generate (%s): %ld x %zu tokens at %.0f tokens/s (prefill %ld tokens at "
               "%.0f tokens/s); cache rows per (sequence, kv head) at the end: %ld\n",
               what.c_str(), static_cast<long>(go.batch), r.tokens[0].size(), tps,
               static_cast<long>(r.prompt_tokens), pps, static_cast<long>(r.cache_rows));
  if (!json.empty()) {
    std::ofstream o(json);
    o << "{\"method\": \"" << go.method << "\", \"press\": \"" << go.press
      << "\", \"keep\": " << num(go.press.empty() ? 1.0 : go.keep)
      << ", \"compress_seconds\": " << num(r.compress_seconds)
      << ", \"decode_seconds\": " << num(r.decode_seconds)
      << ", \"prompt_tokens\": " << r.prompt_tokens << ", \"batch\": " << go.batch
      << ", \"tokens\": " << r.tokens[0].size() << ", \"tokens_per_second\": " << num(tps)
      << ", \"prefill_tokens_per_second\": " << num(pps) << ", \"cache_rows\": " << r.cache_rows
      << ", \"text\": \"" << json_escape(out) << "\"}\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "eval") return run_eval(args);
    if (cmd == "generate") return run_generate(args);
    if (cmd == "methods") {
      for (const Kind k : {Kind::Decoder, Kind::Encoder}) {
        std::printf("%s:", k == Kind::Decoder ? "decoder" : "encoder");
        for (const auto& m : methods_for(k))
          std::printf(" %s (default budget %ld)", m.c_str(), static_cast<long>(default_budget(m)));
        std::printf("\n");
      }
      return 0;
    }
    usage(cmd.empty() ? "missing command" : "unknown command '" + cmd + "'");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
