// effattn-lm: the two small byte-level transformers of examples/lm (trained on the King James
// Bible, FORMAT.md) run on Eigen with any effattn method in place of exact attention.
//
//   effattn-lm eval --model decoder|encoder --method NAME [--budget B] [--context C]
//                   [--windows W] [--layers 0,2] [--recent R] [--seed S] [--json FILE]
//   effattn-lm generate --prompt TEXT [--tokens N] [--method exact|wildcat] [--budget B]
//                   [--temperature T] [--seed S] [--json FILE]
//   effattn-lm methods
//
// eval prints held-out bits per byte, tokens per second, the attention time of the method layers
// against exact attention on the same inputs, and the per-layer attention-output error.
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
      "  effattn-lm generate --prompt TEXT [--tokens N] [--method exact|wildcat]\n"
      "                  [--budget B] [--temperature T] [--seed S] [--json FILE]\n"
      "  effattn-lm methods\n"
      "decoder methods: exact conv_basis eva wildcat vcc (wildcat, vcc: prefix compression)\n"
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

int run_eval(const std::vector<std::string>& args) {
  std::string model_name, json, weights;
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
  const Model model = load_model(weights.empty() ? weights_path(model_name) : weights);
  const std::vector<int> text = read_text(heldout_path());
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
  std::string prompt = "In the beginning", json, weights;
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
    else
      usage("unknown argument '" + a + "'");
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
  std::fprintf(stderr,
               "effattn-lm generate (%s): %ld x %zu tokens at %.0f tokens/s (prefill %ld tokens at "
               "%.0f tokens/s); cache rows per (sequence, kv head) at the end: %ld\n",
               go.method.c_str(), static_cast<long>(go.batch), r.tokens[0].size(), tps,
               static_cast<long>(r.prompt_tokens), pps, static_cast<long>(r.cache_rows));
  if (!json.empty()) {
    std::ofstream o(json);
    o << "{\"method\": \"" << go.method << "\", \"prompt_tokens\": " << r.prompt_tokens
      << ", \"batch\": " << go.batch << ", \"tokens\": " << r.tokens[0].size()
      << ", \"tokens_per_second\": " << num(tps) << ", \"prefill_tokens_per_second\": " << num(pps)
      << ", \"cache_rows\": " << r.cache_rows << ", \"text\": \"" << json_escape(out) << "\"}\n";
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
