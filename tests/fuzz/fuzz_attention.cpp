// libFuzzer target for every effattn functor of effattn::MethodList, one chosen per process by
// the environment variable EFFATTN_FUZZ_METHOD (exact, naive, eva, performer, vcc, conv_basis,
// wildcat, kep_svgp, and multi_head: MultiHead<ExactAttention> on packed batches;
// EFFATTN_FUZZ_LIST=1 prints them). The input bytes decode shapes, options and matrix contents
// (NaN, Inf, denormals, huge and tiny magnitudes, duplicated and zero rows); the target checks the
// library contract:
//  - either a documented exception (effattn::invalid_argument) is thrown,
//  - or the output is n x dv, and info == Success implies every entry is finite, and every finite
//    entry lies inside [min, max] of its column of V (up to round-off): all these methods return
//    convex combinations of value rows (KEP-SVGP: |o_ic| <= ||V_c||_2 and variance >= 0, see
//    check_kep).
// Any other exception, a crash or a sanitizer report is a bug (libFuzzer stops and saves the
// input). Built by tests/fuzz/CMakeLists.txt with clang -fsanitize=fuzzer,address,undefined
// against effattn::compiled (built with the same instrumentation), so the default-policy
// functors are compiled once, in parallel, outside this file.
#include <effattn/methods.hpp>
#include <effattn/multi_head.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace effattn;

/// Reads the fuzzer input as a byte stream (zeros once exhausted).
struct Bytes {
  const std::uint8_t* p;
  std::size_t n, i = 0;
  std::uint8_t next() { return i < n ? p[i++] : 0; }
  std::uint16_t next16() { return static_cast<std::uint16_t>(next() | (next() << 8)); }
};

/// One matrix entry: a special value from a table, or a quantised ordinary value.
double entry(Bytes& b) {
  static const double special[] = {0.0,
                                   -0.0,
                                   1.0,
                                   -1.0,
                                   1e-30,
                                   -1e-30,
                                   std::numeric_limits<float>::denorm_min(),
                                   std::numeric_limits<double>::denorm_min(),
                                   1e4,
                                   -1e4,
                                   1e19,
                                   -1e19,
                                   1e200,
                                   std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity()};
  const std::uint8_t tag = b.next();
  if (tag >= 240) return special[tag - 240];
  // Ordinary: a value in [-8, 8) with 12 bits, scaled by 2^(tag % 8 - 2).
  const double v = (static_cast<double>(b.next16() & 0x0fff) / 256.0) - 8.0;
  return std::ldexp(v, static_cast<int>(tag % 8) - 2);
}

template <typename Scalar>
Matrix<Scalar> matrix(Bytes& b, Index r, Index c, std::uint8_t flags) {
  Matrix<Scalar> x(r, c);
  for (Index j = 0; j < c; ++j)
    for (Index i = 0; i < r; ++i) x(i, j) = static_cast<Scalar>(entry(b));
  if ((flags & 1) && r > 1) x.bottomRows(r - 1).rowwise() = x.row(0);  // duplicated rows
  if ((flags & 2) && r > 2) x.row(r / 2).setZero();                    // a zero row
  return x;
}

/// KEP-SVGP: the rank-s mean K H H^T V of a row-softmax kernel is not a convex combination, but
/// every row of K H H^T has 2-norm <= 1, so |o_ic| <= ||V_c||_2; the variance is >= 0.
template <typename Scalar>
void check_kep(const KepSvgpResult<Scalar>& r, Index n, const Matrix<Scalar>& V) {
  if (r.output.rows() != n || r.output.cols() != V.cols() || r.variance.rows() != n ||
      r.variance.cols() != V.cols()) {
    std::fprintf(stderr, "wrong output or variance shape\n");
    std::abort();
  }
  for (Index c = 0; c < V.cols(); ++c) {
    const double bound = V.col(c).template cast<double>().norm();
    for (Index i = 0; i < n; ++i) {
      const double o = static_cast<double>(r.output(i, c));
      const double v = static_cast<double>(r.variance(i, c));
      if (!std::isfinite(o) || !std::isfinite(v)) {
        if (r.info == Info::Success) {
          std::fprintf(stderr, "non-finite mean or variance with info Success\n");
          std::abort();
        }
        continue;
      }
      if (std::abs(o) > bound * (1 + 1e-3) + 1e-3 || v < 0) {
        std::fprintf(stderr, "mean %g at (%ld, %ld) above ||V_c|| = %g, or variance %g < 0\n", o,
                     static_cast<long>(i), static_cast<long>(c), bound, v);
        std::abort();
      }
    }
  }
}

template <typename Scalar>
void check(const AttentionResult<Scalar>& r, Index n, const Matrix<Scalar>& V) {
  if (r.output.rows() != n || r.output.cols() != V.cols()) {
    std::fprintf(stderr, "wrong output shape\n");
    std::abort();
  }
  for (Index c = 0; c < V.cols(); ++c) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (Index j = 0; j < V.rows(); ++j) {
      lo = std::min(lo, static_cast<double>(V(j, c)));
      hi = std::max(hi, static_cast<double>(V(j, c)));
    }
    const double slack = 1e-3 * std::max(1.0, std::max(std::abs(lo), std::abs(hi)));
    for (Index i = 0; i < n; ++i) {
      const double o = static_cast<double>(r.output(i, c));
      if (!std::isfinite(o)) {
        if (r.info == Info::Success) {
          std::fprintf(stderr, "non-finite output (%g) with info Success at (%ld, %ld)\n", o,
                       static_cast<long>(i), static_cast<long>(c));
          std::abort();
        }
        continue;
      }
      if (o < lo - slack || o > hi + slack) {
        std::fprintf(stderr, "output %g at (%ld, %ld) outside the value range [%g, %g]\n", o,
                     static_cast<long>(i), static_cast<long>(c), lo, hi);
        std::abort();
      }
    }
  }
}

/// What every fuzz configuration gets: the decoded shapes, the option bytes and the inputs.
template <typename Scalar>
struct Input {
  Index n;
  std::uint8_t opt, opt2, flags;
  double scale;
  bool causal;
  const Matrix<Scalar>& Q;
  const Matrix<Scalar>& K;
  const Matrix<Scalar>& V;
};

/// How the input bytes become options, one specialization per functor of effattn::MethodList
/// (a functor of the list without one does not compile here). `id` names the fuzz target;
/// `run` may read more bytes from `b` (VCC: its VIP rows).
template <typename F>
struct FuzzConfig;

template <typename S>
struct FuzzConfig<ExactAttention<S>> {
  static constexpr const char* id = "exact";
  template <typename Policy = policy::Tiled>
  static void run(const Input<S>& in, Bytes&) {
    ExactOptions o;
    o.scale = in.scale;
    o.causal = in.causal;
    o.block_q = in.opt2 & 7;         // 0 = automatic
    o.block_k = (in.opt2 >> 3) & 7;  // 0 = automatic
    check(ExactAttention<S, Policy>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<ExactAttention<S, policy::Naive>> {
  static constexpr const char* id = "naive";
  static void run(const Input<S>& in, Bytes& b) {
    FuzzConfig<ExactAttention<S>>::template run<policy::Naive>(in, b);
  }
};

template <typename S>
struct FuzzConfig<EvaAttention<S>> {
  static constexpr const char* id = "eva";
  static void run(const Input<S>& in, Bytes&) {
    EvaOptions o;
    o.scale = in.scale;
    o.seed = in.opt2;
    o.causal = in.causal;
    o.window = (in.opt >> 1) & 7;    // 0 (non-causal only) .. 7
    o.chunk_size = in.opt2 & 7;      // 0 = automatic; must divide / be a multiple of window
    o.samples = (in.opt2 >> 3) & 3;  // 0 = deterministic
    static const eva::Mass masses[] = {eva::Mass::Literal, eva::Mass::LogCount,
                                       eva::Mass::GaussianDiag};
    o.mass = masses[(in.opt2 >> 5) % 3];
    o.proposal = (in.opt >> 4) & 1 ? eva::Proposal::HalfSum : eva::Proposal::SumMeans;
    check(EvaAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<PerformerAttention<S>> {
  static constexpr const char* id = "performer";
  static void run(const Input<S>& in, Bytes&) {
    typename PerformerAttention<S>::Options o;
    o.scale = in.scale;
    o.seed = in.opt2;
    o.features = 1 + (in.opt2 & 31);
    check(PerformerAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<VccAttention<S>> {
  static constexpr const char* id = "vcc";
  static void run(const Input<S>& in, Bytes& b) {
    VccOptions o;
    o.scale = in.scale;
    o.budget = in.opt2 & 31;  // 0 = the two-level default
    o.block_size = 1 + ((in.opt >> 1) & 7);
    o.fine_blocks = (in.opt >> 4) & 1 ? 2 : 90;
    o.clamp_budget = (in.flags >> 6) & 1;
    for (Index i = 0; i < in.n; ++i)
      if ((b.next() & 3) == 0) o.vip.push_back(i);
    if (in.opt & 1)
      check(VccAttention<S, policy::BestFirstDyadic>(o).compute(in.Q, in.K, in.V), in.n, in.V);
    else
      check(VccAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<ConvBasisAttention<S>> {
  static constexpr const char* id = "conv_basis";
  static void run(const Input<S>& in, Bytes&) {
    typename ConvBasisAttention<S>::Options o;
    o.scale = in.scale;
    o.num_bases = 1 + (in.opt2 & 15);
    o.probe = 1 + ((in.opt2 >> 4) & 7);
    o.threshold = (in.opt >> 1) & 1 ? 0.0 : 0.5;
    o.sliding_window = (in.opt >> 2) & 1 ? 3 : 0;
    o.mask_block = (in.opt >> 3) & 1 ? 5 : 0;
    check(ConvBasisAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<WildcatAttention<S>> {
  static constexpr const char* id = "wildcat";
  static void run(const Input<S>& in, Bytes&) {
    WildcatOptions o;
    o.scale = in.scale;
    o.rank = in.opt2 & 15;  // 0 must throw
    o.bins = 1 + ((in.opt2 >> 4) & 3);
    o.seed = in.flags;
    o.rel_tol = (in.opt >> 1) & 1 ? 1e-3 : 0.0;
    o.fallback = (in.opt >> 2) & 1 ? wildcat::Fallback::Midpoint : wildcat::Fallback::Zero;
    check(WildcatAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

template <typename S>
struct FuzzConfig<KepSvgpAttention<S>> {
  static constexpr const char* id = "kep_svgp";
  static void run(const Input<S>& in, Bytes&) {
    KepSvgpOptions o;
    o.scale = in.scale;
    o.rank = in.opt2 & 15;  // 0 must throw
    o.oversample = (in.opt2 >> 4) & 7;
    o.power_iters = (in.opt >> 1) & 3;
    o.seed = in.flags;
    check_kep(KepSvgpAttention<S>(o).compute(in.Q, in.K, in.V), in.n, in.V);
  }
};

/// The "multi_head" target: MultiHead<ExactAttention> (Tiled) on a packed batch whose layout,
/// offsets (valid or not), seqused_k, storage order and mask come from the input bytes. Bad
/// layouts and offsets must throw invalid_argument; otherwise every output row of head h must be
/// a convex combination of the value rows its sequence uses (|slack| 1e-3), and ASan checks that
/// nothing outside the inputs is read.
template <typename Scalar>
void run_multi_head(Bytes& b) {
  const std::uint8_t a = b.next(), c = b.next(), e = b.next();
  const Index kv = 1 + (a & 3),
              heads = kv * (1 + ((a >> 2) & 3)) + ((a >> 4) & 1);  // may not divide
  const Index d = 1 + (c & 7), dv = 1 + ((c >> 3) & 7), B = 1 + (e & 3);
  const bool causal = (e & 4) != 0, row_major = (e & 8) != 0, use_seqused = (e & 16) != 0;
  SeqOffsets cq{0}, ck{0};
  std::vector<Index> used;
  for (Index s = 0; s < B; ++s) {
    const std::uint8_t l = b.next();
    cq.push_back(cq.back() + (l & 7));
    ck.push_back(ck.back() + ((l >> 3) & 31));
    used.push_back((b.next() & 31));
  }
  if (e & 32) cq[static_cast<std::size_t>(b.next() % (B + 1))] += 1;  // maybe invalid offsets
  const Index tq = std::max<Index>(0, cq.back()), tk = std::max<Index>(0, ck.back());
  using RowM = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Matrix<Scalar> Q = matrix<Scalar>(b, tq, heads * d, 0);
  const Matrix<Scalar> K = matrix<Scalar>(b, tk, kv * d, 0);
  const Matrix<Scalar> V = matrix<Scalar>(b, tk, kv * dv, 0);
  ExactOptions o;
  o.causal = causal;
  o.block_q = b.next() & 3;
  o.block_k = b.next() & 7;
  try {
    const MultiHead<ExactAttention<Scalar>> mh(o, {heads, kv});
    const std::vector<Index> none;
    const auto r =
        row_major
            ? Matrix<Scalar>(
                  mh.compute(RowM(Q), RowM(K), RowM(V), cq, ck, use_seqused ? used : none).output)
            : mh.compute(Q, K, V, cq, ck, use_seqused ? used : none).output;
    if (r.rows() != tq || r.cols() != heads * dv) {
      std::fprintf(stderr, "wrong multi-head output shape\n");
      std::abort();
    }
    for (Index s = 0; s < B; ++s) {
      const std::size_t i = static_cast<std::size_t>(s);
      const Index nk = use_seqused ? used[i] : ck[i + 1] - ck[i];
      if (cq[i + 1] == cq[i] || nk == 0) continue;  // no output rows to check
      for (Index h = 0; h < heads; ++h) {
        const Index g = h / (heads / kv);
        const auto Vs = V.block(ck[i], g * dv, nk, dv);
        for (Index cc = 0; cc < dv; ++cc) {
          const double lo = static_cast<double>(Vs.col(cc).minCoeff());
          const double hi = static_cast<double>(Vs.col(cc).maxCoeff());
          const double slack = 1e-3 * std::max(1.0, std::max(std::abs(lo), std::abs(hi)));
          for (Index q = cq[i]; q < cq[i + 1]; ++q) {
            const double x = static_cast<double>(r(q, h * dv + cc));
            if (std::isfinite(x) && (x < lo - slack || x > hi + slack)) {
              std::fprintf(stderr, "multi-head output %g outside [%g, %g]\n", x, lo, hi);
              std::abort();
            }
          }
        }
      }
    }
  } catch (const effattn::invalid_argument&) {
    // Documented: bad layouts, offsets, seqused_k, non-finite inputs.
  }
}

/// The fuzz target chosen by EFFATTN_FUZZ_METHOD (an `id` above), set once per process.
std::string& selected() {
  static std::string id;
  return id;
}

template <typename Scalar>
void run(Bytes& b) {
  if (selected() == "multi_head") {
    run_multi_head<Scalar>(b);
    return;
  }
  const std::uint8_t shape = b.next(), shape2 = b.next(), opt = b.next(), opt2 = b.next();
  const Index n = 1 + (shape & 15), m = 1 + (shape >> 4), d = 1 + (shape2 & 7),
              dv = 1 + ((shape2 >> 3) & 7);
  const std::uint8_t flags = b.next();
  // scale: 0 (default), a tiny, a moderate, a huge, a negative (must throw), or NaN (must throw).
  static const double scales[] = {0, 1e-6, 0.25, 1, 3, 1e6, -1, std::nan("")};
  const double scale = scales[(opt >> 5) & 7];
  const bool causal = (opt & 1) != 0;
  const Matrix<Scalar> Q = matrix<Scalar>(b, n, d, flags & 3);
  const Matrix<Scalar> K = matrix<Scalar>(b, m, d, (flags >> 2) & 3);
  const Matrix<Scalar> V = matrix<Scalar>(b, m, dv, (flags >> 4) & 3);
  const Input<Scalar> in{n, opt, opt2, flags, scale, causal, Q, K, V};
  try {
    for_each_method<Scalar>([&](auto tag) {
      using C = FuzzConfig<typename decltype(tag)::type>;
      if (selected() != C::id) return;
      C::run(in, b);
    });
  } catch (const effattn::invalid_argument&) {
    // Documented: bad shapes, non-finite inputs, bad options.
  }
}

}  // namespace

/// EFFATTN_FUZZ_METHOD selects the target; EFFATTN_FUZZ_LIST=1 prints the targets (one per
/// functor of effattn::MethodList) and exits: tests/fuzz/run.sh reads the list from here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (std::getenv("EFFATTN_FUZZ_LIST") != nullptr) {
    for_each_method<float>(
        [](auto tag) { std::printf("%s\n", FuzzConfig<typename decltype(tag)::type>::id); });
    std::printf("multi_head\n");
    std::exit(0);
  }
  const char* id = std::getenv("EFFATTN_FUZZ_METHOD");
  bool known = id != nullptr && std::string(id) == "multi_head";
  for_each_method<float>([&](auto tag) {
    known |= id != nullptr && std::string(FuzzConfig<typename decltype(tag)::type>::id) == id;
  });
  if (!known) {
    std::fprintf(stderr, "set EFFATTN_FUZZ_METHOD to a target of EFFATTN_FUZZ_LIST=1\n");
    std::exit(2);
  }
  selected() = id;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes b{data, size};
  if (b.next() & 1)
    run<double>(b);
  else
    run<float>(b);
  return 0;
}
