// effattn-compare: every effattn method against exact attention on one workload.
//
// With no arguments: n = m = 4096, d = 64, float, the `positional` workload, every method at 2-3
// budgets. For each (method, budget) it prints the relative Frobenius and max-abs error against
// ExactAttention<Tiled> on the same inputs (causal exact for causal methods, the VIP rows for
// VCC), the median time of --repeat calls, the speed-up over the matching exact kernel measured in
// the same run, and the method's diagnostics. --json / --csv write the same table.
// Run `effattn-compare --help` for the flags.
#include <effattn/effattn.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "compare_methods.hpp"
#include "lm/lm_workload.hpp"

namespace {

using namespace effattn;
using effattn::compare::Method;
using effattn::compare::Problem;
using effattn::compare::Run;

const char* kUsage =
    "usage: effattn-compare [flags]\n"
    "  --n N            queries (default 4096)\n"
    "  --m M            keys (default n; methods that need n = m are skipped otherwise)\n"
    "  --d D            query/key dimension (default 64)\n"
    "  --dv DV          value dimension (default d)\n"
    "  --workload W     gaussian | sphere | clustered | positional | needles (default "
    "positional),\n"
    "                   or lm:decoder|encoder:LAYER:HEAD, the real Q, K, V of one head of a\n"
    "                   trained model (examples/lm) on the first n held-out bytes (d = head dim,\n"
    "                   m = n, one head; the decoder's heads imply --causal)\n"
    "  --methods LIST   comma-separated subset of: exact, naive, eva, performer, vcc, wildcat,\n"
    "                   conv_basis, kep_svgp (default: all but naive)\n"
    "  --budgets LIST   comma-separated budgets for every method, each in its own unit: EVA chunk\n"
    "                   size, Performer features, VCC compressed length, WildCat rank, Conv-Basis\n"
    "                   bases, KEP-SVGP rank (default: 2-3 per method, see the table)\n"
    "  --heads H        query heads (default 1): Q is n x (H d), every method runs through\n"
    "                   MultiHead<F> on the packed layout\n"
    "  --kv-heads G     key/value heads (default H; H must be a multiple of G: GQA, MQA)\n"
    "  --threads T      OpenMP threads (default: all)\n"
    "  --causal         causal masking; methods without a causal mode are skipped\n"
    "  --seed S         workload and method seed (default 42)\n"
    "  --repeat R       timed calls per row, the median is reported (default 3)\n"
    "  --double         double instead of float\n"
    "  --precision P    fp32 (default) or bf16: bf16 adds the row exact_bf16, ExactAttention\n"
    "                   with policy::TiledBf16 on the kernel path effattn::active_isa() (float)\n"
    "  --auto           add the row auto: AutoAttention picks the fastest of exact, WildCat and\n"
    "                   EVA that meets --target on sampled exact rows and says why (without\n"
    "                   --methods only exact and auto run)\n"
    "  --target E       AutoAttention's relative error target (default 0.01)\n"
    "  --json FILE      also write the table as JSON\n"
    "  --csv FILE       also write the table as CSV\n"
    "  --help           this text\n";

struct Flags {
  Index n = 4096, m = 0, d = 64, dv = 0;
  std::string workload = "positional";
  std::vector<std::string> methods;
  std::vector<Index> budgets;
  int threads = 0;
  bool causal = false;
  std::uint64_t seed = 42;
  Index heads = 1, kv_heads = 0;
  int repeat = 3;
  bool use_double = false;
  bool bf16 = false;
  bool use_auto = false;
  double target = 1e-2;
  std::string json, csv;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "effattn-compare: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

long long parse_int(const std::string& flag, const std::string& v, long long lo) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo)
    usage_error(flag + " expects an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  return x;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--n") {
      f.n = parse_int(a, value(), 1);
    } else if (a == "--m") {
      f.m = parse_int(a, value(), 1);
    } else if (a == "--d") {
      f.d = parse_int(a, value(), 1);
    } else if (a == "--dv") {
      f.dv = parse_int(a, value(), 1);
    } else if (a == "--workload") {
      f.workload = value();
    } else if (a == "--methods") {
      f.methods = split(value());
      if (f.methods.empty()) usage_error("--methods needs at least one method");
    } else if (a == "--budgets") {
      for (const auto& b : split(value())) f.budgets.push_back(parse_int(a, b, 1));
      if (f.budgets.empty()) usage_error("--budgets needs at least one value");
    } else if (a == "--heads") {
      f.heads = static_cast<Index>(parse_int(a, value(), 1));
    } else if (a == "--kv-heads") {
      f.kv_heads = static_cast<Index>(parse_int(a, value(), 1));
    } else if (a == "--threads") {
      f.threads = static_cast<int>(parse_int(a, value(), 1));
    } else if (a == "--causal") {
      f.causal = true;
    } else if (a == "--seed") {
      f.seed = static_cast<std::uint64_t>(parse_int(a, value(), 0));
    } else if (a == "--repeat") {
      f.repeat = static_cast<int>(parse_int(a, value(), 1));
    } else if (a == "--double") {
      f.use_double = true;
    } else if (a == "--precision") {
      const std::string v = value();
      if (v != "fp32" && v != "bf16")
        usage_error("--precision expects fp32 or bf16, got '" + v + "'");
      f.bf16 = v == "bf16";
    } else if (a == "--auto") {
      f.use_auto = true;
    } else if (a == "--target") {
      const std::string v = value();
      char* end = nullptr;
      f.target = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !std::isfinite(f.target) || f.target < 0)
        usage_error("--target expects a number >= 0, got '" + v + "'");
    } else if (a == "--json") {
      f.json = value();
    } else if (a == "--csv") {
      f.csv = value();
    } else {
      usage_error("unknown flag '" + a + "'");
    }
  }
  if (f.m == 0) f.m = f.n;
  if (f.dv == 0) f.dv = f.d;
  if (f.kv_heads == 0) f.kv_heads = f.heads;
  if (f.heads % f.kv_heads != 0)
    usage_error("--heads (" + std::to_string(f.heads) + ") must be a multiple of --kv-heads (" +
                std::to_string(f.kv_heads) + ")");
  try {
    lm::WorkloadSpec spec;
    if (lm::parse_workload(f.workload, spec)) {
      if (f.heads != 1 || f.kv_heads != 1) usage_error("an lm: workload is one head");
      f.m = f.n;
    } else {
      (void)workloads::parse_kind(f.workload);
    }
  } catch (const lm::lm_error& e) {
    usage_error(e.what());
  } catch (const std::exception&) {
    usage_error("unknown workload '" + f.workload +
                "' (gaussian, sphere, clustered, positional or needles)");
  }
  return f;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

std::string num(double x, const char* fmt = "%.6g") {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, x);
  return buf;
}

template <typename Scalar>
int run_problem(const Flags& f, const Matrix<Scalar>& Q, const Matrix<Scalar>& K,
                const Matrix<Scalar>& V);

template <typename Scalar>
int run_all(const Flags& f) {
  using Mat = Matrix<Scalar>;
  lm::WorkloadSpec spec;
  if (lm::parse_workload(f.workload, spec)) {  // one real head; d and dv are the model's
    const auto h = lm::real_head<Scalar>(spec, f.n);
    Flags g = f;
    g.d = g.dv = h.Q.cols();
    g.causal = f.causal || h.causal;
    return run_problem<Scalar>(g, h.Q, h.K, h.V);
  }
  const auto kind = workloads::parse_kind(f.workload);
  // One workload per key/value head g (seed + g) with n * (heads / kv_heads) queries: the query
  // heads of group g take consecutive n-row slices of its queries, so each head's queries have
  // the structure of its keys. Packed side by side (one head: the workload itself).
  const Index group = f.heads / f.kv_heads;
  Mat Q(f.n, f.heads * f.d), K(f.m, f.kv_heads * f.d), V(f.m, f.kv_heads * f.dv);
  for (Index g = 0; g < f.kv_heads; ++g) {
    const auto w = workloads::make<Scalar>(
        kind, workloads::Params::shape(f.n * group, f.m, f.d, f.dv,
                                       f.seed + static_cast<std::uint64_t>(g)));
    K.middleCols(g * f.d, f.d) = w.K;
    V.middleCols(g * f.dv, f.dv) = w.V;
    for (Index j = 0; j < group; ++j)
      Q.middleCols((g * group + j) * f.d, f.d) = w.Q.middleRows(j * f.n, f.n);
  }
  return run_problem<Scalar>(f, Q, K, V);
}

template <typename Scalar>
int run_problem(const Flags& f, const Matrix<Scalar>& Q, const Matrix<Scalar>& K,
                const Matrix<Scalar>& V) {
  using Mat = Matrix<Scalar>;
  Problem<Scalar> p{Q, K, V, f.causal, f.seed, f.repeat, HeadLayout{f.heads, f.kv_heads}};

  auto all = compare::methods<Scalar>();
  if constexpr (std::is_same<Scalar, float>::value) {
    if (f.bf16) {  // --precision bf16: the bf16 exact kernel as one more method
      Method<Scalar> m;
      m.name = "exact_bf16";
      m.default_budgets = [](const Problem<Scalar>&) { return std::vector<Index>{}; };
      m.applicable = [](const Problem<Scalar>&, std::string&) { return true; };
      m.run = [](const Problem<Scalar>& pr, Index) {
        compare::Output<Scalar> o;
        ExactOptions opts;
        opts.causal = pr.causal;
        if (pr.layout.heads > 1 || pr.layout.kv_heads > 1) {  // packed heads: MultiHead
          const MultiHead<ExactAttentionBf16> mh(opts, pr.layout);
          o.seconds = compare::median_time(pr.repeat, [&] {
            auto r = mh.compute(pr.Q, pr.K, pr.V);
            o.info = r.info;
            o.output = std::move(r.output);
          });
        } else {
          const ExactAttentionBf16 a(opts);
          ExactAttentionBf16::Result last;
          o.seconds = compare::median_time(pr.repeat, [&] { last = a.compute(pr.Q, pr.K, pr.V); });
          o.info = last.info;
          o.output = last.output;
          for (const Diagnostic& d : last.diagnostics()) o.diag[d.name] = d.value;
        }
        o.config = std::string("TiledBf16 (") + active_isa() + ")";
        return o;
      };
      all.push_back(std::move(m));
    }
  }
  std::vector<std::string> auto_reasons;  // --auto: AutoAttention's reason, per head
  if (f.use_auto) {                       // AutoAttention at --target as one more method
    Method<Scalar> m;
    m.name = "auto";
    m.default_budgets = [](const Problem<Scalar>&) { return std::vector<Index>{}; };
    m.applicable = [](const Problem<Scalar>&, std::string&) { return true; };
    m.run = [&f, &auto_reasons](const Problem<Scalar>& pr, Index) {
      compare::Output<Scalar> o;
      AutoOptions opts;
      opts.causal = pr.causal;
      opts.target_error = f.target;
      opts.seed = pr.seed;
      const MultiHead<AutoAttention<Scalar>> mh(opts, pr.layout);
      typename AutoAttention<Scalar>::Result last;
      if (pr.layout.heads > 1 || pr.layout.kv_heads > 1) {
        MultiHeadResult<AutoAttention<Scalar>> r;
        o.seconds = compare::median_time(pr.repeat, [&] { r = mh.compute(pr.Q, pr.K, pr.V); });
        o.info = r.info;
        o.output = std::move(r.output);
        last = r.head(0, 0);
      } else {
        const AutoAttention<Scalar> a(opts);
        o.seconds = compare::median_time(pr.repeat, [&] { last = a.compute(pr.Q, pr.K, pr.V); });
        o.info = last.info;
        o.output = last.output;
      }
      for (const Diagnostic& d : last.diagnostics()) o.diag[d.name] = d.value;
      o.config = std::string("target ") + num(f.target, "%.3g") + " -> " + to_string(last.method);
      if (last.method != AutoMethod::Exact) o.config += " " + std::to_string(last.budget);
      auto_reasons.assign(1, last.reason);
      return o;
    };
    all.push_back(std::move(m));
  }
  std::vector<std::string> names = f.methods;
  if (f.use_auto && names.empty()) names = {"exact", "auto"};
  if (f.use_auto && std::find(names.begin(), names.end(), "auto") == names.end())
    names.push_back("auto");
  if (f.bf16 && !names.empty() &&
      std::find(names.begin(), names.end(), "exact_bf16") == names.end())
    names.push_back("exact_bf16");
  if (names.empty())
    for (const auto& m : all)
      if (m.name != "naive") names.push_back(m.name);
  for (const auto& nm : names)
    if (nm != "exact" &&
        std::none_of(all.begin(), all.end(), [&](const Method<Scalar>& m) { return m.name == nm; }))
      usage_error("unknown method '" + nm + "'");

  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  };
  bool progress_shown = false;
  auto progress = [&](const std::string& what) {
    if (elapsed() < 1.0) return;
    std::fprintf(stderr, "\r[%6.1f s] %-60s", elapsed(), what.c_str());
    std::fflush(stderr);
    progress_shown = true;
  };

  // References: exact Tiled, non-causal and (when some method needs it) causal, timed like
  // every other row.
  std::map<bool, std::pair<Mat, double>> exact;  // causal -> (output, median seconds)
  auto reference = [&](bool causal) -> const std::pair<Mat, double>& {
    auto it = exact.find(causal);
    if (it != exact.end()) return it->second;
    progress(std::string("exact") + (causal ? " (causal)" : ""));
    ExactOptions o;
    o.causal = causal;
    const ExactAttention<Scalar> ex(o);
    const MultiHead<ExactAttention<Scalar>> mh(o, p.layout);
    Mat out;
    const double t = compare::median_time(f.repeat, [&] {
      out = f.heads == 1 ? ex(p.Q, p.K, p.V) : Mat(mh.compute(p.Q, p.K, p.V).output);
    });
    return exact.emplace(causal, std::make_pair(std::move(out), t)).first->second;
  };

  std::vector<Run> rows;
  for (const auto& nm : names) {
    if (nm == "exact") {  // the reference rows are always shown; make sure this one exists
      (void)reference(p.causal);
      continue;
    }
    const auto& m = *std::find_if(all.begin(), all.end(),
                                  [&](const Method<Scalar>& x) { return x.name == nm; });
    const std::vector<Index> budgets = f.budgets.empty() ? m.default_budgets(p) : f.budgets;
    for (const Index b : budgets.empty() ? std::vector<Index>{0} : budgets) {
      Run r;
      r.method = m.name;
      r.budget = b;
      std::string why;
      if (!m.applicable(p, why)) {
        r.status = "skipped: " + why;
        rows.push_back(r);
        break;
      }
      progress(m.name + " budget " + std::to_string(b));
      try {
        compare::Output<Scalar> o = m.run(p, b);
        r.config = o.config;
        r.diag = o.diag;
        r.seconds = o.seconds;
        const bool causal_ref = p.causal || o.causal;
        const auto& ref = reference(causal_ref);
        r.reference = causal_ref ? "exact causal" : "exact";
        r.speedup = ref.second / o.seconds;
        Mat a, e;
        if (!o.rows.empty()) {
          a.resize(static_cast<Index>(o.rows.size()), o.output.cols());
          e.resizeLike(a);
          for (std::size_t i = 0; i < o.rows.size(); ++i) {
            a.row(static_cast<Index>(i)) = o.output.row(o.rows[i]);
            e.row(static_cast<Index>(i)) = ref.first.row(o.rows[i]);
          }
          r.reference += " (VIP rows)";
        } else {
          a = o.output;
          e = ref.first;
        }
        const double en = static_cast<double>(e.template cast<double>().norm());
        const Mat diff = a - e;
        r.rel_err = static_cast<double>(diff.template cast<double>().norm()) / std::max(en, 1e-300);
        r.max_abs_err = static_cast<double>(diff.cwiseAbs().maxCoeff());
        if (o.variance.size() > 0 && o.rows.empty() && diff.rows() > 1) {
          std::vector<double> var(static_cast<std::size_t>(diff.rows())), err(var.size());
          for (Index i = 0; i < diff.rows(); ++i) {
            var[static_cast<std::size_t>(i)] = o.variance.row(i).template cast<double>().sum();
            err[static_cast<std::size_t>(i)] = diff.row(i).template cast<double>().squaredNorm();
          }
          r.diag["var_err_spearman"] = compare::spearman(var, err);
        }
        r.status = o.info == Info::Success ? "ok" : std::string("info: ") + to_string(o.info);
      } catch (const std::exception& ex) {
        r.status = std::string("error: ") + ex.what();
      }
      rows.push_back(r);
    }
  }
  if (progress_shown) std::fprintf(stderr, "\r%-72s\r", "");

  // The exact rows themselves (error 0 by construction: they are the reference).
  for (auto& [causal, ref] : exact) {
    Run r;
    r.method = "exact";
    r.config = causal ? "Tiled, causal (reference)" : "Tiled (reference)";
    r.reference = causal ? "exact causal" : "exact";
    r.seconds = ref.second;
    r.speedup = 1;
    r.rel_err = 0;
    r.max_abs_err = 0;
    r.status = "ok";
    rows.insert(rows.begin(), r);
  }

  // Table.
  std::printf(
      "effattn %d.%d.%d compare: %s workload, n = %ld, m = %ld, d = %ld, dv = %ld, heads %ld / "
      "kv heads %ld, %s, %s, %d thread(s), seed %llu, median of %d call(s)\n",
      EFFATTN_VERSION_MAJOR, EFFATTN_VERSION_MINOR, EFFATTN_VERSION_PATCH, f.workload.c_str(),
      static_cast<long>(f.n), static_cast<long>(f.m), static_cast<long>(f.d),
      static_cast<long>(f.dv), static_cast<long>(f.heads), static_cast<long>(f.kv_heads),
      f.use_double ? "double" : "float", f.causal ? "causal" : "non-causal", max_threads(),
      static_cast<unsigned long long>(f.seed), f.repeat);
  std::printf("%-11s %-34s %10s %10s %10s %8s  %s\n", "method", "policy / budget", "rel.err",
              "max.abs", "time[ms]", "speedup", "diagnostics");
  for (const auto& r : rows) {
    if (r.status.rfind("skipped", 0) == 0 || r.status.rfind("error", 0) == 0) {
      std::printf("%-11s %-34s %s\n", r.method.c_str(), r.config.c_str(), r.status.c_str());
      continue;
    }
    std::string diag;
    for (const auto& [k, v] : r.diag) diag += k + "=" + num(v, "%.4g") + " ";
    if (r.status != "ok") diag += "[" + r.status + "] ";
    if (r.reference.find("VIP") != std::string::npos) diag += "(error on VIP rows) ";
    if (r.reference.find("causal") != std::string::npos && !f.causal) diag += "(vs causal exact)";
    std::printf("%-11s %-34s %10.2e %10.2e %10.2f %8.1f  %s\n", r.method.c_str(), r.config.c_str(),
                r.rel_err, r.max_abs_err, 1e3 * r.seconds, r.speedup, diag.c_str());
  }

  if (!f.json.empty()) {
    std::ofstream js(f.json);
    if (!js) usage_error("cannot write '" + f.json + "'");
    js << "{\n  \"n\": " << f.n << ", \"m\": " << f.m << ", \"d\": " << f.d << ", \"dv\": " << f.dv
       << ", \"heads\": " << f.heads << ", \"kv_heads\": " << f.kv_heads << ",\n  \"workload\": \""
       << f.workload << "\", \"scalar\": \"" << (f.use_double ? "double" : "float")
       << "\", \"causal\": " << (f.causal ? "true" : "false") << ", \"threads\": " << max_threads()
       << ", \"seed\": " << f.seed << ", \"repeat\": " << f.repeat << ",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      js << "    {\"method\": \"" << json_escape(r.method) << "\", \"config\": \""
         << json_escape(r.config) << "\", \"budget\": " << r.budget << ", \"status\": \""
         << json_escape(r.status) << "\", \"reference\": \"" << json_escape(r.reference)
         << "\", \"rel_err\": " << num(r.rel_err) << ", \"max_abs_err\": " << num(r.max_abs_err)
         << ", \"seconds\": " << num(r.seconds) << ", \"speedup\": " << num(r.speedup)
         << ", \"diagnostics\": {";
      std::size_t k = 0;
      for (const auto& [key, v] : r.diag)
        js << (k++ ? ", " : "") << "\"" << json_escape(key) << "\": " << num(v);
      js << "}}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    js << "  ]\n}\n";
  }
  if (!f.csv.empty()) {
    std::ofstream cs(f.csv);
    if (!cs) usage_error("cannot write '" + f.csv + "'");
    cs << "method,config,budget,status,reference,rel_err,max_abs_err,seconds,speedup,diagnostics\n";
    for (const auto& r : rows) {
      std::string diag;
      for (const auto& [k, v] : r.diag) diag += (diag.empty() ? "" : ";") + k + "=" + num(v);
      cs << r.method << ",\"" << r.config << "\"," << r.budget << ",\"" << r.status << "\",\""
         << r.reference << "\"," << num(r.rel_err) << "," << num(r.max_abs_err) << ","
         << num(r.seconds) << "," << num(r.speedup) << ",\"" << diag << "\"\n";
    }
  }
  for (const std::string& why : auto_reasons)
    std::printf("auto%s: %s\n", f.heads > 1 ? " (head 0)" : "", why.c_str());
  // Exit status 1 when a method threw or returned a non-finite error (skips are not failures).
  const bool failed = std::any_of(rows.begin(), rows.end(), [](const Run& r) {
    return r.status.rfind("error", 0) == 0 ||
           (r.status.rfind("skipped", 0) != 0 && !std::isfinite(r.rel_err));
  });
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
#ifdef _OPENMP
  if (f.threads > 0) omp_set_num_threads(f.threads);
#endif
  try {
    if (f.use_double && f.bf16) usage_error("--precision bf16 needs float inputs (drop --double)");
    return f.use_double ? run_all<double>(f) : run_all<float>(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "effattn-compare: %s\n", e.what());
    return 2;
  }
}
