// libFuzzer target for one effattn functor, chosen at compile time with -DEFFATTN_FUZZ_<NAME>
// (EXACT, NAIVE, EVA, PERFORMER, VCC, CONV_BASIS, WILDCAT, KEP_SVGP). The input bytes decode
// shapes, options and matrix contents (NaN, Inf, denormals, huge and tiny magnitudes, duplicated
// and zero rows); the target checks the library contract:
//  - either a documented exception (effattn::invalid_argument) is thrown,
//  - or the output is n x dv, and info == Success implies every entry is finite, and every finite
//    entry lies inside [min, max] of its column of V (up to round-off): all these methods return
//    convex combinations of value rows (KEP-SVGP: |o_ic| <= ||V_c||_2 and variance >= 0, see
//    check_kep).
// Any other exception, a crash or a sanitizer report is a bug (libFuzzer stops and saves the
// input). Built by tests/fuzz/CMakeLists.txt with clang -fsanitize=fuzzer,address,undefined.
#include <effattn/effattn.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
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

template <typename Scalar>
void run(Bytes& b) {
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
  try {
#if defined(EFFATTN_FUZZ_EXACT) || defined(EFFATTN_FUZZ_NAIVE)
#if defined(EFFATTN_FUZZ_EXACT)
    using Policy = policy::Tiled;
#else
    using Policy = policy::Naive;
#endif
    ExactOptions o;
    o.scale = scale;
    o.causal = causal;
    o.block_q = opt2 & 7;         // 0 = automatic
    o.block_k = (opt2 >> 3) & 7;  // 0 = automatic
    check(ExactAttention<Scalar, Policy>(o).compute(Q, K, V), n, V);
#elif defined(EFFATTN_FUZZ_EVA) || defined(EFFATTN_FUZZ_PERFORMER)
    EvaOptions o;
    o.scale = scale;
    o.seed = opt2;
#if defined(EFFATTN_FUZZ_EVA)
    o.causal = causal;
    o.window = (opt >> 1) & 7;    // 0 (non-causal only) .. 7
    o.chunk_size = opt2 & 7;      // 0 = automatic; must divide / be a multiple of window
    o.samples = (opt2 >> 3) & 3;  // 0 = deterministic
    o.mass = static_cast<eva::Mass>((opt2 >> 5) % 3);
    o.proposal = static_cast<eva::Proposal>((opt >> 4) & 1 ? 1 : 0);
    check(EvaAttention<Scalar>(o).compute(Q, K, V), n, V);
#else
    o.samples = 1 + (opt2 & 31);
    check(PerformerAttention<Scalar>(o).compute(Q, K, V), n, V);
#endif
#elif defined(EFFATTN_FUZZ_VCC)
    VccOptions o;
    o.scale = scale;
    o.budget = opt2 & 31;  // 0 = the two-level default
    o.block_size = 1 + ((opt >> 1) & 7);
    o.fine_blocks = (opt >> 4) & 1 ? 2 : 90;
    o.clamp_budget = (flags >> 6) & 1;
    std::vector<Index> vip;
    for (Index i = 0; i < n; ++i)
      if ((b.next() & 3) == 0) vip.push_back(i);
    if (opt & 1)
      check(VccAttention<Scalar, vcc::BestFirstDyadic>(o).compute(Q, K, V, vip), n, V);
    else
      check(VccAttention<Scalar>(o).compute(Q, K, V, vip), n, V);
#elif defined(EFFATTN_FUZZ_CONV_BASIS)
    ConvBasisOptions o;
    o.scale = scale;
    o.num_bases = 1 + (opt2 & 15);
    o.probe = 1 + ((opt2 >> 4) & 7);
    o.threshold = (opt >> 1) & 1 ? 0.0 : 0.5;
    o.window = (opt >> 2) & 1 ? 3 : 0;
    o.block_size = (opt >> 3) & 1 ? 5 : 0;
    check(ConvBasisAttention<Scalar>(o).compute(Q, K, V), n, V);
#elif defined(EFFATTN_FUZZ_WILDCAT)
    WildcatOptions o;
    o.scale = scale;
    o.rank = opt2 & 15;  // 0 must throw
    o.bins = 1 + ((opt2 >> 4) & 3);
    o.seed = flags;
    o.rel_tol = (opt >> 1) & 1 ? 1e-3 : 0.0;
    o.fallback = (opt >> 2) & 1 ? wildcat::Fallback::Midpoint : wildcat::Fallback::Zero;
    o.causal = causal && ((opt >> 3) & 1);  // must throw
    check(WildcatAttention<Scalar>(o).compute(Q, K, V), n, V);
#elif defined(EFFATTN_FUZZ_KEP_SVGP)
    KepSvgpOptions o;
    o.scale = scale;
    o.rank = opt2 & 15;  // 0 must throw
    o.oversample = (opt2 >> 4) & 7;
    o.power_iters = (opt >> 1) & 3;
    o.seed = flags;
    check_kep(KepSvgpAttention<Scalar>(o).compute(Q, K, V), n, V);
#else
#error "define one EFFATTN_FUZZ_<NAME>"
#endif
  } catch (const effattn::invalid_argument&) {
    // Documented: bad shapes, non-finite inputs, bad options.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes b{data, size};
  if (b.next() & 1)
    run<double>(b);
  else
    run<float>(b);
  return 0;
}
