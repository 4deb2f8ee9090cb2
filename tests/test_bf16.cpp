// Tests of policy::TiledBf16 (exact.hpp) and its kernels (detail/bf16_*.hpp, core/isa.hpp):
// every kernel path this machine has (a missing one is skipped with a printed reason) against
// the fp64 Naive oracle on every workload, float and bf16 inputs, causal and not, split-KV, key
// bias, n and m not multiples of any tile, d in {16, 64, 80, 128, 256}; the paths against each
// other; bit-identical results for 1 and 2 threads; strided inputs; the ISA override.
#include "test_utils.hpp"

#include <effattn/core/concept.hpp>
#include <effattn/core/isa.hpp>
#include <effattn/exact.hpp>
#include <effattn/multi_head.hpp>
#include <effattn/workloads.hpp>

#include <string>
#include <vector>

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::for_each_nonfinite_entry;
using effattn::testing::max_abs_error;
using effattn::testing::rel_fro_error;
using effattn::testing::with_threads;

namespace {

using detail::Isa;
using Bf16Matrix = Matrix<Eigen::bfloat16>;

// Relative Frobenius error tolerance (bf16 keeps 8 significand bits); measured 1.8e-3 to
// 4e-3 on these problems (every workload, d, mask and path).
constexpr double kRelTol = 1e-2;
// Per-element bound: |O - O_ref| <= kElemTol * max |V|. Each output is a convex combination of
// value rows whose weights carry a relative error of a few 2^-9 (logits, P and V rounded once
// each); measured max 2.6e-3 (positional, d = 256, causal).
constexpr double kElemTol = 1e-2;

const std::vector<Isa>& all_isas() {
  static const std::vector<Isa> v = {Isa::Generic, Isa::Avx512Bf16, Isa::Amx};
  return v;
}

// True when `isa` can run here; otherwise prints why it is skipped (never a silent fallback).
bool available_or_warn(Isa isa) {
  if (detail::isa_available(isa)) return true;
  WARN("SKIP bf16 path '" << detail::isa_name(isa) << "': not available on this machine "
                          << "(highest detected: '" << detail::isa_name(detail::detected_isa())
                          << "')");
  return false;
}

struct Bf16Out {
  Matrix<float> out;
  Vector<float> lse;
  detail::TilePlan plan;
};

// The bf16 kernel on an explicit path, with the plan of the public functor.
// `split`: the split score product (Bf16Scores::Split); false: one bf16 product.
template <typename In>
Bf16Out run_path(Isa isa, const Matrix<In>& Q, const Matrix<In>& K, const Matrix<In>& V,
                 const float* bias, bool causal, Index block_q = 0, Index block_k = 0,
                 bool split = false) {
  Bf16Out r;
  r.plan = detail::plan_bf16_tiles(Q.rows(), K.rows(), Q.cols(), V.cols(), block_q, block_k);
  const float scale = static_cast<float>(detail::resolve_scale(0, Q.cols()));
  detail::tiled_attention_bf16<In>(Q, K, V, bias, scale, causal, r.plan, isa, r.out, r.lse, split);
  return r;
}

// What the functor's default options (Bf16Scores::Auto) choose for float inputs of width d.
bool default_split(Index d) {
  return detail::bf16_split_scores<float>(ExactOptions{}, d);
}

struct Reference {
  Matrix<double> out;
  Vector<double> lse;
};

Reference reference(const Matrix<float>& Q, const Matrix<float>& K, const Matrix<float>& V,
                    const Vector<float>* bias, bool causal) {
  ExactOptions o;
  o.causal = causal;
  const ExactAttention<double, policy::Naive> f(o);
  const Matrix<double> Qd = Q.cast<double>(), Kd = K.cast<double>(), Vd = V.cast<double>();
  const auto r = bias ? f.compute(Qd, Kd, Vd, bias->cast<double>()) : f.compute(Qd, Kd, Vd);
  REQUIRE(r.info == Info::Success);
  return {r.output, r.lse};
}

void check_against(const Bf16Out& got, const Reference& ref, const Matrix<float>& V) {
  const double rel = rel_fro_error(got.out, ref.out);
  const double elem = max_abs_error(got.out, ref.out) / V.cwiseAbs().maxCoeff();
  INFO("rel Frobenius error " << rel << ", max element error / max|V| " << elem);
  CHECK(rel <= kRelTol);
  CHECK(elem <= kElemTol);
  // lse carries the logit error directly: |d logit| <~ 2^-8 |s q k|, here |s q k| <~ 10;
  // measured max 3.3e-2.
  CHECK(max_abs_error(got.lse, ref.lse) <= 5e-2);
}

Bf16Matrix to_bf16(const Matrix<float>& x) {
  return x.cast<Eigen::bfloat16>();
}

}  // namespace

TEST_CASE("active_isa names the path and EFFATTN_ISA can only lower it", "[bf16][isa]") {
  const std::string isa = active_isa();
  CHECK((isa == "amx" || isa == "avx512bf16" || isa == "generic"));
  WARN("bf16 kernel path in use: " << isa << " (detected: "
                                   << detail::isa_name(detail::detected_isa()) << ")");
  CHECK(detail::isa_available(Isa::Generic));
  CHECK(static_cast<int>(detail::selected_isa()) <= static_cast<int>(detail::detected_isa()));
  using detail::apply_isa_override;
  CHECK(apply_isa_override(Isa::Amx, nullptr) == Isa::Amx);
  CHECK(apply_isa_override(Isa::Amx, "generic") == Isa::Generic);
  CHECK(apply_isa_override(Isa::Amx, "avx512bf16") == Isa::Avx512Bf16);
  CHECK(apply_isa_override(Isa::Avx512Bf16, "amx") == Isa::Avx512Bf16);  // never raised
  CHECK(apply_isa_override(Isa::Generic, "avx512bf16") == Isa::Generic);
  CHECK(apply_isa_override(Isa::Amx, "AMX ") == Isa::Amx);  // unknown: ignored
}

TEST_CASE("bf16 rounding is round-to-nearest-even like Eigen::bfloat16", "[bf16]") {
  Rng rng = make_rng(3);
  const Matrix<float> x = random_normal<float>(500, 1, rng) * 100.0f;
  for (Index i = 0; i < x.rows(); ++i) {
    const Eigen::bfloat16 e(x(i));
    CHECK(detail::bf16_bits(x(i)) == e.value);
  }
  CHECK(detail::bf16_bits(1.0f + 1.0f / 256.0f) == 0x3F80);  // tie to even: down
  CHECK(detail::bf16_bits(1.0f + 3.0f / 256.0f) == 0x3F82);  // tie to even: up
}

TEST_CASE("every bf16 path is within 1e-2 of fp64 on every workload, d and mask", "[bf16]") {
  std::vector<Isa> isas;
  for (const Isa isa : all_isas())
    if (available_or_warn(isa)) isas.push_back(isa);
  for (const auto kind : workloads::all_kinds())
    for (const Index d : {16, 64, 80, 128, 256}) {
      // n, m not multiples of 16 or 32; block sizes 32 x 64 so several tiles and a partial last
      // tile are visited, and the automatic ones.
      const auto w = workloads::make<float>(kind, workloads::Params::shape(45, 83, d, d, 7));
      for (const bool causal : {false, true}) {
        const Reference ref = reference(w.Q, w.K, w.V, nullptr, causal);
        for (const Isa isa : isas) {
          INFO("path " << detail::isa_name(isa) << ", " << workloads::name(kind) << ", d = " << d
                       << ", causal = " << causal);
          // The default score product (split at d <= 32), and the other one.
          const bool split = default_split(d);
          check_against(run_path<float>(isa, w.Q, w.K, w.V, nullptr, causal, 32, 64, split), ref,
                        w.V);
          check_against(run_path<float>(isa, w.Q, w.K, w.V, nullptr, causal, 0, 0, split), ref,
                        w.V);
          check_against(run_path<float>(isa, w.Q, w.K, w.V, nullptr, causal, 0, 0, !split), ref,
                        w.V);
        }
      }
    }
}

TEST_CASE("bf16 split-KV (decoding and short prompts) and key bias on every path", "[bf16]") {
  std::vector<Isa> isas;
  for (const Isa isa : all_isas())
    if (available_or_warn(isa)) isas.push_back(isa);
  // 3 queries: the decoding kernels; 40 queries: one query block on the panels.
  for (const Index n : {3, 40})
    for (const Index d : {64, 80}) {
      const Index m = 9001;
      const auto w =
          workloads::make<float>(workloads::Kind::Gaussian, workloads::Params::shape(n, m, d, d));
      Vector<float> bias = Vector<float>::LinSpaced(m, -1.0f, 1.0f);
      for (Index j = 5; j < m; j += 7) bias(j) = -std::numeric_limits<float>::infinity();
      for (const bool causal : {false, true}) {
        const Reference plain_ref = reference(w.Q, w.K, w.V, nullptr, causal);
        const Reference bias_ref = reference(w.Q, w.K, w.V, &bias, causal);
        for (const Isa isa : isas) {
          INFO("path " << detail::isa_name(isa) << ", n = " << n << ", d = " << d
                       << ", causal = " << causal);
          const Bf16Out plain = run_path<float>(isa, w.Q, w.K, w.V, nullptr, causal);
          REQUIRE(plain.plan.kv_splits > 1);
          check_against(plain, plain_ref, w.V);
          check_against(run_path<float>(isa, w.Q, w.K, w.V, bias.data(), causal), bias_ref, w.V);
        }
      }
    }
}

TEST_CASE("bf16 fused decoding kernel: 1-16 rows, tails, rescales, bias, bf16 inputs",
          "[bf16][decode]") {
  std::vector<Isa> isas;
  for (const Isa isa : {Isa::Avx512Bf16, Isa::Amx})
    if (available_or_warn(isa)) isas.push_back(isa);
  // 1-4 rows: the FMA form; 5, 9, 16: the vdpbf16ps form (16 score rows) on avx512bf16, the tile
  // form on amx (dv = d + 2: a partial group of 16 value columns).
  for (const Index n : {1, 2, 3, 4, 5, 9, 16})
    // 17: an odd column (a pair with a zero partner); 18: a one-column pass after four (FMA
    // form) and a one-pair pass (vdpbf16ps form).
    for (const Index d : {16, 17, 18, 128})
      // 5: one chunk; 531: a block tail; 900: a whole first half and a short second half of a
      // block (the AMX form rounds K and V half a block at a time); 4099: splits with tails.
      for (const Index m : {5, 531, 900, 4099}) {
        const auto w = workloads::make<float>(workloads::Kind::Gaussian,
                                              workloads::Params::shape(n, m, d, d + 2));
        // A bias rising by 100 along the cache: each 512-key block exceeds the running maximum by
        // more than the lazy threshold (8), so the accumulator is rescaled. (Growing the keys
        // instead gives logits of ~20 whose bf16 rounding alone is a 2% output error on every
        // path.)
        Vector<float> bias = Vector<float>::LinSpaced(m, 0.0f, 100.0f);
        for (Index j = 3; j < m; j += 11) bias(j) = -std::numeric_limits<float>::infinity();
        for (const bool causal : {false, true}) {
          if (causal && m < n) continue;  // causal needs a key for every query
          const Reference ref = reference(w.Q, w.K, w.V, nullptr, causal);
          const Reference bref = reference(w.Q, w.K, w.V, &bias, causal);
          for (const Isa isa : isas) {
            INFO("path " << detail::isa_name(isa) << ", n = " << n << ", d = " << d << ", m = " << m
                         << ", causal = " << causal);
            const Bf16Out r = run_path<float>(isa, w.Q, w.K, w.V, nullptr, causal);
            REQUIRE(detail::fused_decode_applies(n, r.plan, isa));
            check_against(r, ref, w.V);
            check_against(run_path<float>(isa, w.Q, w.K, w.V, bias.data(), causal), bref, w.V);
            // bf16 inputs: the same values give the same bits.
            const Matrix<float> Qr = to_bf16(w.Q).cast<float>(), Kr = to_bf16(w.K).cast<float>(),
                                Vr = to_bf16(w.V).cast<float>();
            const Bf16Out rf = run_path<float>(isa, Qr, Kr, Vr, nullptr, causal);
            const Bf16Out rb = run_path<Eigen::bfloat16>(isa, to_bf16(w.Q), to_bf16(w.K),
                                                         to_bf16(w.V), nullptr, causal);
            CHECK(bitwise_equal(rf.out, rb.out));
            CHECK(bitwise_equal(rf.lse, rb.lse));
          }
        }
      }
}

TEST_CASE("bf16 decoding: a non-finite key or value anywhere throws (K and V not pre-scanned)",
          "[bf16][decode]") {
  const ExactAttentionBf16 f;
  // 2 queries: the FMA form; 8: the vdpbf16ps or the tile form (by path).
  for (const Index n : {2, 8}) {
    const auto w = workloads::make<float>(workloads::Kind::Gaussian,
                                          workloads::Params::shape(n, 3000, 64, 64));
    REQUIRE(f.compute(w.Q, w.K, w.V).info == Info::Success);
    INFO("n = " << n);
    for_each_nonfinite_entry(w.K.rows(), w.K.cols(), [&](float bad, Index row, Index col) {
      Matrix<float> K = w.K, V = w.V;
      K(row, col) = bad;
      CHECK_THROWS_WITH(f.compute(w.Q, K, w.V), Catch::Contains("K ("));
      CHECK_THROWS_WITH(f.compute(to_bf16(w.Q), to_bf16(K), to_bf16(w.V)), Catch::Contains("K ("));
      V(row, col) = bad;
      CHECK_THROWS_WITH(f.compute(w.Q, w.K, V), Catch::Contains("V ("));
    });
  }
}

TEST_CASE("the bf16 paths agree with each other", "[bf16]") {
  for (const Index d : {16, 80, 128}) {
    const auto w =
        workloads::make<float>(workloads::Kind::Clustered, workloads::Params::shape(70, 300, d, d));
    const Bf16Out base = run_path<float>(Isa::Generic, w.Q, w.K, w.V, nullptr, true);
    for (const Isa isa : {Isa::Avx512Bf16, Isa::Amx}) {
      if (!available_or_warn(isa)) continue;
      const Bf16Out r = run_path<float>(isa, w.Q, w.K, w.V, nullptr, true);
      INFO("path " << detail::isa_name(isa) << " vs generic, d = " << d);
      // Same bf16 operands, fp32 sums in another order, so a few P entries round to the other
      // bf16 neighbour: measured rel. difference up to 1.5e-4 (clustered, d = 128).
      CHECK(rel_fro_error(r.out, base.out) <= 1e-3);
      CHECK(rel_fro_error(r.out, base.out) <= kRelTol);
    }
  }
}

TEST_CASE("bf16 results are bit-identical for 1 and 2 threads on every path", "[bf16][threads]") {
  if (!effattn::testing::has_openmp()) {
    WARN("SKIP: built without OpenMP, thread-count determinism is vacuous");
    return;
  }
  for (const Isa isa : all_isas()) {
    if (!available_or_warn(isa)) continue;
    // Query blocks in parallel; split-KV (both fused forms); both score products.
    for (const Index n : {300, 4, 16})
      for (const bool split : {false, true}) {
        const auto w = workloads::make<float>(workloads::Kind::Needles,
                                              workloads::Params::shape(n, 1500, 64, 48));
        auto run = [&] { return run_path<float>(isa, w.Q, w.K, w.V, nullptr, false, 0, 0, split); };
        const Bf16Out one = with_threads(1, run);
        const Bf16Out two = with_threads(2, run);
        INFO("path " << detail::isa_name(isa) << ", n = " << n << ", split = " << split);
        CHECK(bitwise_equal(one.out, two.out));
        CHECK(bitwise_equal(one.lse, two.lse));
      }
  }
}

TEST_CASE("ExactAttention<float, TiledBf16>: float and bf16 inputs, bias, strided views",
          "[bf16]") {
  STATIC_REQUIRE(effattn::is_attention_functor_v<ExactAttentionBf16>);
  const auto w = workloads::make<float>(workloads::Kind::Positional,
                                        workloads::Params::shape(130, 260, 64, 40));
  // Inputs that are exactly bf16 values: then bf16 and float inputs give the same bits (d = 64,
  // the scale 1/8 is a power of two, so the scaled queries round the same way).
  const Bf16Matrix Qb = to_bf16(w.Q), Kb = to_bf16(w.K), Vb = to_bf16(w.V);
  const Matrix<float> Qr = Qb.cast<float>(), Kr = Kb.cast<float>(), Vr = Vb.cast<float>();
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    o.block_q = 50;  // rounded up to 64
    const ExactAttentionBf16 f(o);
    const auto rf = f.compute(Qr, Kr, Vr);
    const auto rb = f.compute(Qb, Kb, Vb);
    REQUIRE(rf.info == Info::Success);
    REQUIRE(rb.info == Info::Success);
    CHECK(rf.block_q == 64);
    CHECK(rf.block_k % 32 == 0);
    CHECK(bitwise_equal(rf.output, rb.output));
    CHECK(bitwise_equal(rf.lse, rb.lse));
    const Reference ref = reference(Qr, Kr, Vr, nullptr, causal);
    check_against({rf.output, rf.lse, {}}, ref, Vr);

    // Key bias, float and bf16 inputs.
    Vector<float> bias = Vector<float>::LinSpaced(260, 0.5f, -0.5f);
    bias(3) = -std::numeric_limits<float>::infinity();
    const auto bf = f.compute(Qr, Kr, Vr, bias);
    const auto bb = f.compute(Qb, Kb, Vb, bias);
    CHECK(bitwise_equal(bf.output, bb.output));
    check_against({bf.output, bf.lse, {}}, reference(Qr, Kr, Vr, &bias, causal), Vr);

    // Column blocks of wider matrices (strided Maps) give the same bits as contiguous copies.
    Matrix<float> wide(260, 3 * 64);
    wide.setRandom();
    wide.middleCols(64, 64) = Kr;
    Matrix<float> wideq(130, 100);
    wideq.setRandom();
    wideq.middleCols(7, 64) = Qr;
    const Eigen::Map<const Matrix<float>, 0, Eigen::OuterStride<>> Qmap(
        wideq.data() + 7 * 130, 130, 64, Eigen::OuterStride<>(130));
    const auto rs = f.compute(Qmap, wide.middleCols(64, 64), Vr);
    CHECK(bitwise_equal(rs.output, rf.output));
  }
  // Decoding (3 queries: the decoding kernels) with bf16 and float inputs, on every path.
  const Matrix<float> Qd = Qr.topRows(3);
  for (const Isa isa : all_isas()) {
    if (!available_or_warn(isa)) continue;
    INFO("decoding, path " << detail::isa_name(isa));
    const Bf16Out df = run_path<float>(isa, Qd, Kr, Vr, nullptr, false);
    const Bf16Out db = run_path<Eigen::bfloat16>(isa, to_bf16(Qd), Kb, Vb, nullptr, false);
    CHECK(bitwise_equal(df.out, db.out));
    check_against(df, reference(Qd, Kr, Vr, nullptr, false), Vr);
  }
  // The other policies accept bf16 inputs by widening them once.
  const auto tiled = ExactAttentionf().compute(Qb, Kb, Vb);
  CHECK(bitwise_equal(tiled.output, ExactAttentionf().compute(Qr, Kr, Vr).output));
}

TEST_CASE("TiledBf16 rejects bad inputs and unavailable paths", "[bf16]") {
  const ExactAttentionBf16 f;
  const Matrix<float> Q = Matrix<float>::Ones(4, 8), K = Matrix<float>::Ones(6, 8),
                      V = Matrix<float>::Ones(6, 3);
  CHECK_THROWS_AS(f.compute(Q, Matrix<float>::Ones(6, 7), V), effattn::invalid_argument);
  // Empty operands (a decoding-sized call plans its key splits only after the checks).
  CHECK_THROWS_AS(f.compute(Matrix<float>(0, 8), K, V), effattn::invalid_argument);
  CHECK_THROWS_AS(f.compute(Q, Matrix<float>(0, 8), Matrix<float>(0, 3)),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(f.compute(Matrix<float>(4, 0), Matrix<float>(6, 0), V),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(f.compute(Q, K, Matrix<float>(6, 0)), effattn::invalid_argument);
  CHECK_THROWS_AS(ExactAttentionf().compute(Matrix<float>(0, 8), K, V), effattn::invalid_argument);
  CHECK_THROWS_AS(ExactAttentionf().compute(Q, K, Matrix<float>(6, 0)), effattn::invalid_argument);
  Bf16Matrix Kb = to_bf16(K);
  Kb(2, 3) = Eigen::bfloat16(std::numeric_limits<float>::quiet_NaN());
  CHECK_THROWS_AS(f.compute(to_bf16(Q), Kb, to_bf16(V)), effattn::invalid_argument);
  ExactOptions o;
  o.causal = true;
  CHECK_THROWS_AS(ExactAttentionBf16(o).compute(to_bf16(K), to_bf16(Q), to_bf16(Q)),
                  effattn::invalid_argument);  // m < n
  Vector<float> bias = Vector<float>::Constant(6, -std::numeric_limits<float>::infinity());
  CHECK_THROWS_AS(f.compute(to_bf16(Q), to_bf16(K), to_bf16(V), bias), effattn::invalid_argument);
  for (const Isa isa : all_isas())
    if (!detail::isa_available(isa)) {
      CHECK_THROWS_AS(run_path<float>(isa, Q, K, V, nullptr, false), effattn::invalid_argument);
    }
}

TEST_CASE("MultiHead<ExactAttentionBf16> equals the per-head bf16 calls (GQA, ragged)",
          "[bf16][multi_head]") {
  const SeqOffsets cu = {0, 1, 8, 8, 138};  // lengths 1, 7, 0, 130
  const Index T = cu.back(), H = 4, G = 2, d = 16, dv = 8;
  Rng rng = make_rng(11);
  const Matrix<float> Q = random_normal<float>(T, H * d, rng),
                      K = random_normal<float>(T, G * d, rng),
                      V = random_normal<float>(T, G * dv, rng);
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    const auto r = MultiHead<ExactAttentionBf16>(o, HeadLayout{H, G}).compute(Q, K, V, cu, cu);
    REQUIRE(r.info == Info::Success);
    const ExactAttentionBf16 f(o);
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      const Index s0 = cu[b], len = cu[b + 1] - cu[b];
      if (len == 0) continue;
      for (Index h = 0; h < H; ++h) {
        const Index g = h / (H / G);
        const auto one = f.compute(Q.block(s0, h * d, len, d), K.block(s0, g * d, len, d),
                                   V.block(s0, g * dv, len, dv));
        INFO("sequence " << b << ", head " << h << ", causal " << causal);
        CHECK(bitwise_equal(r.output.block(s0, h * dv, len, dv), one.output));
        const Reference ref = reference(Q.block(s0, h * d, len, d), K.block(s0, g * d, len, d),
                                        V.block(s0, g * dv, len, dv), nullptr, causal);
        CHECK(rel_fro_error(one.output, ref.out) <= kRelTol);
      }
    }
  }
}

TEST_CASE("bf16 needle rows at small d against a long cache: the split score product", "[bf16]") {
  // A needle query is 2 x a key, so at d = 16 its logit against that key is ~8 (up to ~14),
  // where its weight competes with 9000 others; one bf16 score product's logit error
  // ~2^-8 |s q k| moves the weights by ~1-3%: relative Frobenius error 1.28e-2 to 1.41e-2
  // (measured, every path alike), above the 1e-2 target. The split product (the default at
  // d <= 32) takes the logit error to ~2^-16 |s q k|, leaving the rounding of P and V: measured
  // 1.4e-3 to 1.6e-3, and 7e-7 where the fused decoding kernel runs its fp32 form (x86 paths).
  REQUIRE(default_split(16));
  for (const Index n : {3, 9, 40}) {  // the fused decoding forms (1-4, 5-16 rows), the panels
    const auto w = workloads::make<float>(workloads::Kind::Needles,
                                          workloads::Params::shape(n, 9001, 16, 16, 7));
    const Reference ref = reference(w.Q, w.K, w.V, nullptr, false);
    for (const Isa isa : all_isas()) {
      if (!available_or_warn(isa)) continue;
      const Bf16Out split = run_path<float>(isa, w.Q, w.K, w.V, nullptr, false, 0, 0, true);
      const Bf16Out single = run_path<float>(isa, w.Q, w.K, w.V, nullptr, false, 0, 0, false);
      const double rel_split = rel_fro_error(split.out, ref.out),
                   rel_single = rel_fro_error(single.out, ref.out);
      INFO("n = " << n << ", path " << detail::isa_name(isa) << ": rel. error split " << rel_split
                  << ", single " << rel_single);
      check_against(split, ref, w.V);
      CHECK(rel_split <= 4e-3);
      // One product stays within 2e-2; the split one is several times closer.
      CHECK(rel_single <= 2e-2);
      CHECK(rel_split * 3 <= rel_single);
    }
    // The functor's default options take the split product.
    const auto r = ExactAttentionBf16().compute(w.Q, w.K, w.V);
    REQUIRE(r.info == Info::Success);
    CHECK(rel_fro_error(r.output, ref.out) <= 4e-3);
  }
}

TEST_CASE("Bf16Scores: the option, its validation, and bf16 inputs (no remainder to split)",
          "[bf16]") {
  const auto w = workloads::make<float>(workloads::Kind::Clustered,
                                        workloads::Params::shape(70, 300, 24, 24, 3));
  const Reference ref = reference(w.Q, w.K, w.V, nullptr, true);
  ExactOptions o;
  o.causal = true;
  o.bf16_scores = Bf16Scores::Split;
  const auto split = ExactAttentionBf16(o).compute(w.Q, w.K, w.V);
  o.bf16_scores = Bf16Scores::Single;
  const auto single = ExactAttentionBf16(o).compute(w.Q, w.K, w.V);
  o.bf16_scores = Bf16Scores::Auto;
  const auto automatic = ExactAttentionBf16(o).compute(w.Q, w.K, w.V);
  check_against({split.output, split.lse, {}}, ref, w.V);
  check_against({single.output, single.lse, {}}, ref, w.V);
  CHECK(bitwise_equal(automatic.output, split.output));  // d = 24 <= 32
  CHECK(!bitwise_equal(single.output, split.output));
  // Closer to fp64 in lse (the logit error): measured max 1.0e-4 split against 6.2e-3 single.
  CHECK(max_abs_error(split.lse, ref.lse) * 10 <= max_abs_error(single.lse, ref.lse));
  // bf16 inputs: K has no remainder, the option changes nothing.
  const Bf16Matrix Qb = to_bf16(w.Q), Kb = to_bf16(w.K), Vb = to_bf16(w.V);
  o.bf16_scores = Bf16Scores::Split;
  const auto bs = ExactAttentionBf16(o).compute(Qb, Kb, Vb);
  o.bf16_scores = Bf16Scores::Single;
  CHECK(bitwise_equal(bs.output, ExactAttentionBf16(o).compute(Qb, Kb, Vb).output));
  // Not a Bf16Scores value.
  o.bf16_scores = static_cast<Bf16Scores>(7);
  CHECK_THROWS_WITH(ExactAttentionBf16{o}, Catch::Contains("bf16_scores"));
  // The other policies do not form bf16 scores: any value but Auto is an error naming the
  // option and the policy, never silently ignored.
  STATIC_REQUIRE(ExactAttentionBf16::uses_bf16_scores);
  STATIC_REQUIRE_FALSE(ExactAttentionf::uses_bf16_scores);
  STATIC_REQUIRE_FALSE(NaiveAttentiond::uses_bf16_scores);
  for (const Bf16Scores s : {Bf16Scores::Single, Bf16Scores::Split}) {
    o.bf16_scores = s;
    CHECK_THROWS_WITH(ExactAttentionf{o},
                      Catch::Contains("bf16_scores") && Catch::Contains("policy::Tiled,"));
    CHECK_THROWS_WITH(ExactAttentiond{o}, Catch::Contains("policy::Tiled,"));
    CHECK_THROWS_WITH(NaiveAttentionf{o},
                      Catch::Contains("bf16_scores") && Catch::Contains("policy::Naive"));
    CHECK_THROWS_AS((MultiHead<ExactAttentionf>(o, HeadLayout{2, 1})), effattn::invalid_argument);
  }
  o.bf16_scores = Bf16Scores::Auto;
  CHECK_NOTHROW(ExactAttentionf{o});
  CHECK_NOTHROW(NaiveAttentiond{o});
}

TEST_CASE("bf16: scores that overflow (finite inputs) give NumericalIssue, not a silent output",
          "[bf16]") {
  // Key 0 = (1e20, -1e20, 0, ...) against queries starting (1e20, 1e20): the two products
  // overflow fp32 to +inf and -inf, and their sum is a NaN score, while every other score is
  // finite (~1e19). The fused update of the x86 kernels (max and exp would drop the NaN) marks
  // such a row NaN itself; the shared update propagates it. Either way info says so. A second
  // case makes every score +inf.
  for (const Index n : {64, 300}) {  // one and several query blocks
    Rng rng = make_rng(5);
    Matrix<float> Q = random_normal<float>(n, 64, rng), K = random_normal<float>(700, 64, rng);
    const Matrix<float> V = random_normal<float>(700, 16, rng);
    Q.leftCols(2).setConstant(1e20f);  // bf16(Q / 8) = 1.25e19: times 1e20 overflows
    K.row(0).setZero();
    K(0, 0) = 1e20f;
    K(0, 1) = -1e20f;
    for (const bool all_inf : {false, true}) {
      if (all_inf) {
        K.col(0).setConstant(1e20f);
        K.col(1).setZero();
      }
      for (const Isa isa : all_isas()) {
        if (!available_or_warn(isa)) continue;
        INFO("n = " << n << ", path " << detail::isa_name(isa) << ", all_inf = " << all_inf);
        const Bf16Out r = run_path<float>(isa, Q, K, V, nullptr, false);
        CHECK(!r.out.array().isFinite().all());
      }
      CHECK(ExactAttentionBf16().compute(Q, K, V).info == Info::NumericalIssue);
    }
    // A score that overflows to -inf is a weight of 0, as exp(-inf) is: the output is the
    // attention over the other keys.
    // (The other keys are 0 in the two large query columns.)
    K = random_normal<float>(700, 64, rng);
    K.leftCols(2).setZero();
    K(0, 0) = K(0, 1) = -1e20f;
    const Reference ref = reference(Q, K.bottomRows(699), V.bottomRows(699), nullptr, false);
    for (const Isa isa : all_isas()) {
      if (!available_or_warn(isa)) continue;
      INFO("-inf score, n = " << n << ", path " << detail::isa_name(isa));
      const Bf16Out r = run_path<float>(isa, Q, K, V, nullptr, false);
      REQUIRE(r.out.array().isFinite().all());
      CHECK(rel_fro_error(r.out, ref.out) <= kRelTol);
    }
  }
}
