// Tests of effattn/exact.hpp: Tiled vs Naive vs an independent long-double loop oracle, causal
// and not, odd sizes, block sizes that do not divide n, split-KV, lse, invariances, bias, masks,
// strided inputs and every bad input.
#include "test_utils.hpp"

#include <effattn/core/concept.hpp>
#include <effattn/exact.hpp>
#include <effattn/workloads.hpp>

#include <set>
#include <string>
#include <tuple>

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::for_each_nonfinite_entry;
using effattn::testing::loop_attention;
using effattn::testing::max_abs_error;
using effattn::testing::randn;

namespace {

// Tolerance for max |O - O_ref| relative to max |V|: float round-off grows with the number of
// terms; 2e-5 for float is ~170 ulp, measured errors are below 2e-6 on these sizes.
template <typename Scalar>
double out_tol() {
  return std::is_same<Scalar, float>::value ? 2e-5 : 1e-12;
}

template <typename Scalar>
double lse_tol(double scale_of_lse) {
  return (std::is_same<Scalar, float>::value ? 4e-6 : 1e-13) * std::max(1.0, scale_of_lse);
}

}  // namespace

TEST_CASE("ExactAttention models the functor concept and states its capabilities", "[exact]") {
  STATIC_REQUIRE(effattn::is_attention_functor_v<ExactAttention<float>>);
  STATIC_REQUIRE(effattn::is_attention_functor_v<ExactAttention<double>>);
  STATIC_REQUIRE(effattn::is_attention_functor_v<ExactAttention<float, policy::Naive>>);
  STATIC_REQUIRE(effattn::is_attention_functor_v<ExactAttention<double, policy::Naive>>);
  using T = effattn::functor_traits<ExactAttention<float>>;
  STATIC_REQUIRE(T::supports_causal);
  STATIC_REQUIRE_FALSE(T::causal_only);
  STATIC_REQUIRE_FALSE(T::randomized);
  STATIC_REQUIRE_FALSE(T::self_attention_only);
  STATIC_REQUIRE(T::exact);
  CHECK(std::string(T::name) == "ExactAttention");
  CHECK(std::string(effattn::functor_traits<ExactAttention<double, policy::Naive>>::name) ==
        "ExactAttention");
}

TEMPLATE_TEST_CASE("diagnostics() lists block_q, block_k, kv_splits with unique names", "[exact]",
                   float, double) {
  using Scalar = TestType;
  const Matrix<Scalar> Q = randn<Scalar>(50, 8, 1), K = randn<Scalar>(70, 8, 2),
                       V = randn<Scalar>(70, 4, 3);
  ExactOptions o;
  o.block_q = 16;
  o.block_k = 32;
  const auto tiled = ExactAttention<Scalar>(o).compute(Q, K, V);
  const auto naive = ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, V);
  REQUIRE(tiled.info == Info::Success);
  REQUIRE(naive.info == Info::Success);
  for (const auto& r : {tiled, naive}) {
    const Diagnostics diag = r.diagnostics();
    REQUIRE(diag.size() == 3);
    std::set<std::string> names;
    for (const Diagnostic& x : diag) {
      INFO(x.name << " = " << x.value);
      CHECK(std::isfinite(x.value));
      names.insert(x.name);
    }
    CHECK(names.size() == diag.size());
    CHECK(std::string(diag[0].name) == "block_q");
    CHECK(std::string(diag[1].name) == "block_k");
    CHECK(std::string(diag[2].name) == "kv_splits");
    CHECK(diag[0].value == static_cast<double>(r.block_q));
    CHECK(diag[1].value == static_cast<double>(r.block_k));
    CHECK(diag[2].value == static_cast<double>(r.kv_splits));
  }
  CHECK(tiled.block_q == 16);
  CHECK(tiled.block_k == 32);
  CHECK(naive.block_q == 0);  // Naive has no tiles
  CHECK(naive.kv_splits == 1);
}

TEMPLATE_TEST_CASE("Tiled and Naive match a long-double loop oracle", "[exact]", float, double) {
  using Scalar = TestType;
  // (n, m, d, dv, block_q, block_k): odd sizes, n != m, dv != d, blocks not dividing n or m.
  const std::vector<std::tuple<Index, Index, Index, Index, Index, Index>> shapes = {
      {1, 1, 1, 1, 0, 0},       {1, 7, 3, 2, 0, 0},         {7, 7, 5, 3, 0, 0},
      {7, 7, 5, 3, 3, 2},       {513, 513, 16, 16, 0, 0},   {513, 513, 16, 8, 100, 77},
      {100, 300, 12, 20, 0, 0}, {300, 100, 12, 20, 64, 33}, {2, 2000, 8, 4, 0, 64},
      {37, 1100, 8, 5, 16, 50}};
  for (const bool causal : {false, true}) {
    for (const auto& [n, m, d, dv, bq, bk] : shapes) {
      if (causal && m < n) continue;  // rejected, tested below
      const Matrix<Scalar> Q = randn<Scalar>(n, d, 1 + static_cast<std::uint64_t>(n));
      const Matrix<Scalar> K = randn<Scalar>(m, d, 2 + static_cast<std::uint64_t>(m));
      const Matrix<Scalar> V = randn<Scalar>(m, dv, 3);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      std::vector<double> lse_ref;
      const Matrix<double> ref = loop_attention(Q, K, V, scale, causal, {}, &lse_ref);

      ExactOptions o;
      o.causal = causal;
      o.block_q = bq;
      o.block_k = bk;
      const auto tiled = ExactAttention<Scalar>(o).compute(Q, K, V);
      const auto naive = ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, V);
      INFO("n=" << n << " m=" << m << " d=" << d << " dv=" << dv << " bq=" << bq << " bk=" << bk
                << " causal=" << causal << " splits=" << tiled.kv_splits);
      REQUIRE(tiled.info == Info::Success);
      REQUIRE(naive.info == Info::Success);
      REQUIRE(tiled.output.rows() == n);
      REQUIRE(tiled.output.cols() == dv);
      REQUIRE(tiled.lse.size() == n);
      const double vmax = static_cast<double>(V.cwiseAbs().maxCoeff());
      CHECK(max_abs_error(tiled.output, ref) <= out_tol<Scalar>() * vmax);
      // Naive computes in double whatever the scalar: only the final cast to Scalar remains.
      CHECK(max_abs_error(naive.output, ref) <=
            (std::is_same<Scalar, float>::value ? 1e-6 : 1e-12) * vmax);
      double lse_err = 0, lse_scale = 0;
      for (Index i = 0; i < n; ++i) {
        lse_err = std::max(lse_err, std::abs(static_cast<double>(tiled.lse(i)) -
                                             lse_ref[static_cast<std::size_t>(i)]));
        lse_scale = std::max(lse_scale, std::abs(lse_ref[static_cast<std::size_t>(i)]));
      }
      CHECK(lse_err <= lse_tol<Scalar>(lse_scale));
      CHECK(max_abs_error(naive.lse, tiled.lse) <= lse_tol<Scalar>(lse_scale));
    }
  }
}

TEMPLATE_TEST_CASE("Split-KV path (few query blocks) equals the single-pass result", "[exact]",
                   float, double) {
  using Scalar = TestType;
  for (const bool causal : {false, true}) {
    const Index n = 3, m = 4096, d = 32;
    const Matrix<Scalar> Q = randn<Scalar>(n, d, 11), K = randn<Scalar>(m, d, 12),
                         V = randn<Scalar>(m, d, 13);
    ExactOptions o;
    o.causal = causal;
    const auto r = ExactAttention<Scalar>(o).compute(Q, K, V);
    REQUIRE(r.kv_splits > 1);  // the path under test is actually taken
    const Matrix<double> ref = loop_attention(Q, K, V, 1.0 / std::sqrt(32.0), causal);
    CHECK(max_abs_error(r.output, ref) <= out_tol<Scalar>());
  }
}

TEMPLATE_TEST_CASE("Output is invariant to adding a constant vector to every key", "[exact]", float,
                   double) {
  using Scalar = TestType;
  // q . (k + c) = q . k + q . c: a per-row constant, which softmax removes.
  auto w = workloads::make<Scalar>(workloads::Kind::Gaussian, 200, 16, 5);
  Matrix<Scalar> K2 = w.K;
  K2.rowwise() += RowVector<Scalar>::LinSpaced(16, Scalar(-3), Scalar(3));
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    o.block_k = 64;
    const ExactAttention<Scalar> f(o);
    const Matrix<Scalar> a = f(w.Q, w.K, w.V), b = f(w.Q, K2, w.V);
    // Shifts of |q . c| up to ~30 change the logits' rounding, hence the float tolerance.
    CHECK(max_abs_error(a, b) <= (std::is_same<Scalar, float>::value ? 5e-5 : 1e-12));
  }
}

TEMPLATE_TEST_CASE("Causal rows never depend on future keys or values", "[exact]", float, double) {
  using Scalar = TestType;
  const Index n = 150, m = 170, d = 8;
  const Matrix<Scalar> Q = randn<Scalar>(n, d, 1);
  Matrix<Scalar> K = randn<Scalar>(m, d, 2), V = randn<Scalar>(m, d, 3);
  ExactOptions o;
  o.causal = true;
  o.block_q = 32;
  o.block_k = 16;
  const ExactAttention<Scalar> f(o);
  const Matrix<Scalar> before = f(Q, K, V);
  // Perturb every key/value after position t; rows i with i + (m - n) < t must be bit-identical.
  const Index t = 100;
  K.bottomRows(m - t).array() += Scalar(5);
  V.bottomRows(m - t).array() -= Scalar(7);
  const Matrix<Scalar> after = f(Q, K, V);
  const Index unaffected = t - (m - n);
  CHECK(bitwise_equal(before.topRows(unaffected), after.topRows(unaffected)));
  CHECK_FALSE(bitwise_equal(before.bottomRows(n - unaffected), after.bottomRows(n - unaffected)));
}

TEMPLATE_TEST_CASE("Key bias log(c) equals duplicating the key c times", "[exact]", float, double) {
  using Scalar = TestType;
  const Index n = 40, m = 30, d = 8;
  const Matrix<Scalar> Q = randn<Scalar>(n, d, 7), K = randn<Scalar>(m, d, 8),
                       V = randn<Scalar>(m, d, 9);
  std::vector<Index> counts(static_cast<std::size_t>(m));
  Vector<Scalar> bias(m);
  Index total = 0;
  for (Index j = 0; j < m; ++j) {
    counts[static_cast<std::size_t>(j)] = 1 + j % 4;
    bias(j) = static_cast<Scalar>(std::log(static_cast<double>(1 + j % 4)));
    total += 1 + j % 4;
  }
  Matrix<Scalar> Kx(total, d), Vx(total, d);
  for (Index j = 0, r = 0; j < m; ++j)
    for (Index c = 0; c < counts[static_cast<std::size_t>(j)]; ++c, ++r) {
      Kx.row(r) = K.row(j);
      Vx.row(r) = V.row(j);
    }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Matrix<double> ref = loop_attention(Q, Kx, Vx, scale, false);
  for (const bool naive : {false, true}) {
    ExactOptions o;
    o.block_k = 7;
    const Matrix<Scalar> out =
        naive ? ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, V, bias).output
              : ExactAttention<Scalar>(o).compute(Q, K, V, bias).output;
    CHECK(max_abs_error(out, ref) <= out_tol<Scalar>());
  }
}

TEMPLATE_TEST_CASE("A -inf key bias masks the key (padding)", "[exact]", float, double) {
  using Scalar = TestType;
  const Index n = 20, m = 50, d = 8;
  const Matrix<Scalar> Q = randn<Scalar>(n, d, 1), K = randn<Scalar>(m, d, 2),
                       V = randn<Scalar>(m, 3, 3);
  Vector<Scalar> bias = Vector<Scalar>::Zero(m);
  bias.tail(15).setConstant(-std::numeric_limits<Scalar>::infinity());
  ExactOptions o;
  o.block_k = 16;
  const auto r = ExactAttention<Scalar>(o).compute(Q, K, V, bias);
  const auto ref = ExactAttention<Scalar, policy::Naive>().compute(Q, K.topRows(35), V.topRows(35));
  REQUIRE(r.info == Info::Success);
  CHECK(max_abs_error(r.output, ref.output) <= out_tol<Scalar>());
  CHECK(max_abs_error(r.lse, ref.lse) <= lse_tol<Scalar>(10));
}

TEMPLATE_TEST_CASE("Map, strided column blocks and expressions are accepted", "[exact]", float,
                   double) {
  using Scalar = TestType;
  const Index n = 64, m = 80, d = 16, heads = 3;
  // One head of packed n x (H d) matrices: a column block with outer stride n.
  const Matrix<Scalar> Qp = randn<Scalar>(n, heads * d, 1), Kp = randn<Scalar>(m, heads * d, 2),
                       Vp = randn<Scalar>(m, heads * d, 3);
  const ExactAttention<Scalar> f;
  for (Index h = 0; h < heads; ++h) {
    const Matrix<Scalar> Qh = Qp.middleCols(h * d, d), Kh = Kp.middleCols(h * d, d),
                         Vh = Vp.middleCols(h * d, d);
    const Matrix<Scalar> a =
        f(Qp.middleCols(h * d, d), Kp.middleCols(h * d, d), Vp.middleCols(h * d, d));
    CHECK(bitwise_equal(a, f(Qh, Kh, Vh)));
  }
  // A Map of a buffer with a larger leading dimension (outer stride 100 > n).
  std::vector<Scalar> buf(static_cast<std::size_t>(100 * d), Scalar(0));
  Eigen::Map<Matrix<Scalar>, 0, Eigen::OuterStride<>> Qm(buf.data(), n, d,
                                                         Eigen::OuterStride<>(100));
  Qm = Qp.leftCols(d);
  CHECK(bitwise_equal(f(Qm, Kp.leftCols(d), Vp.leftCols(d)),
                      f(Matrix<Scalar>(Qp.leftCols(d)), Matrix<Scalar>(Kp.leftCols(d)),
                        Matrix<Scalar>(Vp.leftCols(d)))));
  // Row-major input is evaluated into a temporary and gives the same answer.
  const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> Qr = Qp.leftCols(d);
  CHECK(
      bitwise_equal(f(Qr, Kp.leftCols(d), Vp.leftCols(d)), f(Qm, Kp.leftCols(d), Vp.leftCols(d))));
}

TEMPLATE_TEST_CASE("Large logits stay finite and exact", "[exact]", float, double) {
  using Scalar = TestType;
  // Logits of magnitude ~80 (float) / ~700 (double) would overflow exp without max subtraction.
  const double mag = std::is_same<Scalar, float>::value ? 80.0 : 700.0;
  const Index n = 30, m = 40, d = 4;
  Matrix<Scalar> Q = randn<Scalar>(n, d, 1), K = randn<Scalar>(m, d, 2);
  const Matrix<Scalar> V = randn<Scalar>(m, d, 3);
  Q.rowwise().normalize();
  K.rowwise().normalize();
  ExactOptions o;
  o.scale = mag;
  for (const bool causal : {false, true}) {
    o.causal = causal;
    const auto r = ExactAttention<Scalar>(o).compute(Q, K, V);
    REQUIRE(r.info == Info::Success);
    const Matrix<double> ref = loop_attention(Q, K, V, mag, causal);
    // Float inputs of size 1 give logits with absolute error ~ mag * eps; exp amplifies that.
    CHECK(max_abs_error(r.output, ref) <= (std::is_same<Scalar, float>::value ? 2e-4 : 1e-9));
  }
}

TEMPLATE_TEST_CASE("Overflowing logits are reported, not returned silently", "[exact]", float,
                   double) {
  using Scalar = TestType;
  const Scalar big = std::sqrt(std::numeric_limits<Scalar>::max()) * Scalar(4);
  Matrix<Scalar> Q = Matrix<Scalar>::Constant(2, 2, big), K = Matrix<Scalar>::Constant(3, 2, big);
  const Matrix<Scalar> V = Matrix<Scalar>::Ones(3, 2);
  ExactOptions o;
  o.scale = 1;
  const auto r = ExactAttention<Scalar>(o).compute(Q, K, V);
  CHECK(r.info == Info::NumericalIssue);
  CHECK_THROWS_AS(ExactAttention<Scalar>(o)(Q, K, V), effattn::numerical_error);
}

TEMPLATE_TEST_CASE("Scale 0 means 1/sqrt(d)", "[exact]", float, double) {
  using Scalar = TestType;
  const Matrix<Scalar> Q = randn<Scalar>(20, 9, 1), K = randn<Scalar>(30, 9, 2),
                       V = randn<Scalar>(30, 2, 3);
  ExactOptions a, b;
  b.scale = 1.0 / 3.0;
  CHECK(bitwise_equal(ExactAttention<Scalar>(a)(Q, K, V), ExactAttention<Scalar>(b)(Q, K, V)));
}

TEMPLATE_TEST_CASE("Results are bit-identical across thread counts and repeated calls", "[exact]",
                   float, double) {
  using Scalar = TestType;
  const auto w = workloads::make<Scalar>(workloads::Kind::Clustered, 700, 32, 3);
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    o.block_q = 64;
    const ExactAttention<Scalar> f(o);
    const auto one = effattn::testing::with_threads(1, [&] { return f.compute(w.Q, w.K, w.V); });
    const auto two = effattn::testing::with_threads(2, [&] { return f.compute(w.Q, w.K, w.V); });
    const auto again = f.compute(w.Q, w.K, w.V);
    CHECK(bitwise_equal(one.output, two.output));
    CHECK(bitwise_equal(one.lse, two.lse));
    CHECK(bitwise_equal(one.output, again.output));
    // Split-KV too (3 query rows against 5000 keys).
    const Matrix<Scalar> Qs = w.Q.topRows(3);
    const Matrix<Scalar> Kl = randn<Scalar>(5000, 32, 9), Vl = randn<Scalar>(5000, 32, 10);
    const auto s1 = effattn::testing::with_threads(1, [&] { return f.compute(Qs, Kl, Vl); });
    const auto s2 = effattn::testing::with_threads(2, [&] { return f.compute(Qs, Kl, Vl); });
    REQUIRE(s1.kv_splits > 1);
    CHECK(bitwise_equal(s1.output, s2.output));
  }
}

TEMPLATE_TEST_CASE("Bad inputs throw invalid_argument naming the argument", "[exact][errors]",
                   float, double) {
  using Scalar = TestType;
  using M = Matrix<Scalar>;
  const M Q = M::Ones(4, 3), K = M::Ones(5, 3), V = M::Ones(5, 2);
  const ExactAttention<Scalar> f;
  const ExactAttention<Scalar, policy::Naive> g;
  auto throws_with = [](auto&& call, const std::string& needle) {
    testing::require_invalid_argument(call, needle);
  };
  for (int pass = 0; pass < 2; ++pass) {
    auto run = [&](const M& q, const M& k, const M& v) {
      return pass == 0 ? f.compute(q, k, v) : g.compute(q, k, v);
    };
    throws_with([&] { (void)run(M(0, 3), K, V); }, "Q must be n x d");
    throws_with([&] { (void)run(M(4, 0), K, V); }, "Q must be n x d");
    throws_with([&] { (void)run(Q, M(0, 3), M(0, 2)); }, "K must be m x d");
    throws_with([&] { (void)run(Q, K, M(5, 0)); }, "V must be m x dv");
    throws_with([&] { (void)run(Q, M::Ones(5, 4), V); }, "K must be m x d with d = Q.cols() = 3");
    throws_with([&] { (void)run(Q, K, M::Ones(6, 2)); }, "V must be m x dv with m = K.rows() = 5");
    for (const Scalar bad :
         {std::numeric_limits<Scalar>::quiet_NaN(), std::numeric_limits<Scalar>::infinity(),
          -std::numeric_limits<Scalar>::infinity()}) {
      M q = Q, k = K, v = V;
      q(2, 1) = bad;
      throws_with([&] { (void)run(q, K, V); }, "Q (4 x 3) contains a non-finite value");
      k(4, 0) = bad;
      throws_with([&] { (void)run(Q, k, V); }, "K (5 x 3) contains a non-finite value");
      v(0, 1) = bad;
      throws_with([&] { (void)run(Q, K, v); }, "V (5 x 2) contains a non-finite value");
    }
  }
  ExactOptions causal;
  causal.causal = true;
  throws_with([&] { (void)ExactAttention<Scalar>(causal).compute(M::Ones(6, 3), K, V); },
              "causal attention needs m >= n");
  // Options.
  auto bad_opts = [&](ExactOptions o, const std::string& needle) {
    throws_with([&] { ExactAttention<Scalar> x(o); }, needle);
  };
  ExactOptions o;
  o.block_q = -1;
  bad_opts(o, "block_q");
  o = {};
  o.block_k = -2;
  bad_opts(o, "block_k");
  o = {};
  o.scale = -1;
  bad_opts(o, "scale");
  o.scale = std::numeric_limits<double>::quiet_NaN();
  bad_opts(o, "scale");
  // Bias.
  Vector<Scalar> b = Vector<Scalar>::Zero(4);
  throws_with([&] { (void)f.compute(Q, K, V, b); }, "key_bias must have m = K.rows() = 5");
  b = Vector<Scalar>::Zero(5);
  b(1) = std::numeric_limits<Scalar>::quiet_NaN();
  throws_with([&] { (void)f.compute(Q, K, V, b); }, "key_bias must be finite or -inf");
  b(1) = std::numeric_limits<Scalar>::infinity();
  throws_with([&] { (void)f.compute(Q, K, V, b); }, "key_bias must be finite or -inf");
  b.setConstant(-std::numeric_limits<Scalar>::infinity());
  throws_with([&] { (void)f.compute(Q, K, V, b); }, "masks every key");
  // Causal: query 0 sees keys 0..m-n = 0..1; masking them leaves it with none.
  b.setZero();
  b.head(2).setConstant(-std::numeric_limits<Scalar>::infinity());
  throws_with([&] { (void)ExactAttention<Scalar>(causal).compute(Q, K, V, b); }, "masks every key");
}

TEST_CASE("fp32 decoding (the fused AVX-512 kernel): 1-16 rows, tails, rescales, bias, causal",
          "[exact][decode]") {
  const bool fused =
      static_cast<int>(detail::selected_isa()) >= static_cast<int>(detail::Isa::Avx512Bf16);
  if (!fused)
    WARN("fused decoding kernel not available (active ISA '"
         << active_isa() << "'): these cases test the Tiled kernel only");
  // 3, 5, 9: zero query rows padding the 4-, 8- and 16-row forms.
  for (const Index n : {1, 2, 3, 4, 5, 8, 9, 16})
    // 17, 18: a key-column pass of one column after passes of two (8, 16 rows) or four.
    for (const Index d : {16, 17, 18, 128})
      for (const Index m : {5, 531, 4099}) {  // one chunk, a block tail, splits with tails
        const auto w = workloads::make<float>(workloads::Kind::Gaussian,
                                              workloads::Params::shape(n, m, d, d + 2));
        // A bias rising by 100 along the cache: each 512-key block exceeds the running maximum
        // by more than the kernel's lazy threshold (8), so its accumulator is rescaled.
        Vector<float> bias = Vector<float>::LinSpaced(m, 0.0f, 100.0f);
        for (Index j = 3; j < m; j += 11) bias(j) = -std::numeric_limits<float>::infinity();
        for (const bool causal : {false, true})
          for (const bool with_bias : {false, true}) {
            if (causal && m < n) continue;  // causal needs a key for every query
            INFO("n = " << n << ", d = " << d << ", m = " << m << ", causal = " << causal
                        << ", bias = " << with_bias);
            ExactOptions o;
            o.causal = causal;
            const Matrix<double> Qd = w.Q.cast<double>(), Kd = w.K.cast<double>(),
                                 Vd = w.V.cast<double>();
            const ExactAttention<double, policy::Naive> naive(o);
            const auto ref = with_bias ? naive.compute(Qd, Kd, Vd, bias.cast<double>())
                                       : naive.compute(Qd, Kd, Vd);
            ExactResult<float> r;
            const double scale = detail::resolve_scale(0, d);
            const bool ran = detail::exact_fp32_decode(
                w.Q, w.K, w.V, with_bias ? bias.data() : nullptr, scale, o, "test", r);
            CHECK(ran == fused);
            if (!ran)
              r = with_bias ? ExactAttentionf(o).compute(w.Q, w.K, w.V, bias)
                            : ExactAttentionf(o).compute(w.Q, w.K, w.V);
            REQUIRE(r.info == Info::Success);
            CHECK(max_abs_error(r.output, ref.output) <=
                  out_tol<float>() * Vd.cwiseAbs().maxCoeff());
            CHECK(max_abs_error(r.lse, ref.lse) <= lse_tol<float>(ref.lse.cwiseAbs().maxCoeff()));
            // The public functor takes the same kernel.
            const auto pub = with_bias ? ExactAttentionf(o).compute(w.Q, w.K, w.V, bias)
                                       : ExactAttentionf(o).compute(w.Q, w.K, w.V);
            CHECK(bitwise_equal(pub.output, r.output));
          }
      }
}

TEST_CASE("fp32 decoding: a non-finite key or value anywhere throws (K and V not pre-scanned)",
          "[exact][decode][errors]") {
  const ExactAttentionf f;
  for (const Index n : {2, 11}) {  // the 2-row form; the 16-row form with zero query rows
    const auto w = workloads::make<float>(workloads::Kind::Gaussian,
                                          workloads::Params::shape(n, 3000, 64, 64));
    REQUIRE(f.compute(w.Q, w.K, w.V).info == Info::Success);
    INFO("n = " << n);
    for_each_nonfinite_entry(w.K.rows(), w.K.cols(), [&](float bad, Index row, Index col) {
      Matrix<float> K = w.K, V = w.V, Q = w.Q;
      K(row, col) = bad;
      CHECK_THROWS_WITH(f.compute(w.Q, K, w.V), Catch::Contains("K ("));
      V(row, col) = bad;
      CHECK_THROWS_WITH(f.compute(w.Q, w.K, V), Catch::Contains("V ("));
      Q(row % n, col) = bad;
      CHECK_THROWS_WITH(f.compute(Q, w.K, w.V), Catch::Contains("Q ("));
    });
  }
}

TEMPLATE_TEST_CASE("Masked keys contribute exactly nothing, even with huge values", "[exact]",
                   float, double) {
  using Scalar = TestType;
  // Regression: Eigen's vectorised exp clamps its argument, so exp(-inf) is ~1e-38 (float) rather
  // than 0; with values ~1e37 a masked key would then shift outputs by O(0.1).
  const Index n = 64, m = 64, d = 8;
  const Matrix<Scalar> Q = randn<Scalar>(n, d, 1), K = randn<Scalar>(m, d, 2);
  Matrix<Scalar> V = randn<Scalar>(m, d, 3), Vhuge = V;
  const Scalar huge = std::is_same<Scalar, float>::value ? Scalar(1e37) : Scalar(1e300);
  // Keys >= 24 are huge. With 16 x 16 tiles, the diagonal tile of rows 16..31 holds keys 16..31,
  // so keys 24..31 are masked *inside* a computed tile for rows 16..23 (not just skipped).
  const Index t = 24;
  Vhuge.bottomRows(m - t).setConstant(huge);
  for (const bool naive : {false, true}) {
    ExactOptions o;
    o.causal = true;
    o.block_q = 16;
    o.block_k = 16;
    auto run = [&](const Matrix<Scalar>& v) {
      return naive ? ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, v).output
                   : ExactAttention<Scalar>(o).compute(Q, K, v).output;
    };
    // Causal rows i < t never see the huge values.
    CHECK(bitwise_equal(run(V).topRows(t), run(Vhuge).topRows(t)));
    // Bias mask: the same keys hidden by -inf for every row.
    Vector<Scalar> bias = Vector<Scalar>::Zero(m);
    bias.tail(m - t).setConstant(-std::numeric_limits<Scalar>::infinity());
    o.causal = false;
    const Matrix<Scalar> a =
        naive ? ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, V, bias).output
              : ExactAttention<Scalar>(o).compute(Q, K, V, bias).output;
    const Matrix<Scalar> b =
        naive ? ExactAttention<Scalar, policy::Naive>(o).compute(Q, K, Vhuge, bias).output
              : ExactAttention<Scalar>(o).compute(Q, K, Vhuge, bias).output;
    CHECK(bitwise_equal(a, b));
  }
}

TEST_CASE("choose_exact_kernel: the decision table of the single-head exact kernels",
          "[exact][dispatch]") {
  using detail::ExactFamily;
  using detail::ExactKernel;
  using detail::Isa;
  const Isa paths[] = {Isa::Generic, Isa::Avx512Bf16, Isa::Amx};
  for (const Isa isa : paths) {
    INFO("path " << detail::isa_name(isa));
    const bool x86 = EFFATTN_BF16_X86 && isa != Isa::Generic;
    for (const Index n : {Index(1), Index(16), Index(17), Index(1024)}) {
      INFO("n = " << n);
      const detail::TilePlan plan = detail::plan_bf16_tiles(n, 4096, 64, 64, 0, 0);
      const bool decoding = n <= 16 && plan.q_blocks == 1;  // the decoding kernels' bound
      CHECK(decoding == (n <= 16));
      for (const bool fp32 : {true, false}) {
        // Naive is always the materialised reference.
        CHECK(detail::choose_exact_kernel(ExactFamily::Naive, fp32, false, n, plan, isa) ==
              ExactKernel::Naive);
        // Tiled: the fused kernel only for float decoding on an x86 path.
        CHECK(detail::choose_exact_kernel(ExactFamily::Tiled, fp32, false, n, plan, isa) ==
              (fp32 && x86 && decoding ? ExactKernel::FusedDecodeFp32 : ExactKernel::Tiled));
      }
      for (const bool split : {false, true}) {
        const ExactKernel k =
            detail::choose_exact_kernel(ExactFamily::TiledBf16, true, split, n, plan, isa);
        const ExactKernel expected =
            x86 && decoding ? (split ? ExactKernel::FusedDecodeFp32 : ExactKernel::FusedDecodeBf16)
            : decoding      ? ExactKernel::StreamingBf16
            : x86           ? ExactKernel::Bf16Panels
                            : ExactKernel::GenericBf16;
        CHECK(k == expected);
        // The caller skips the up-front scan of K and V exactly when the fused kernel runs.
        CHECK(detail::reads_kv_checked(k) == (x86 && decoding));
        CHECK(detail::fused_decode_applies(n, plan, isa) == (x86 && decoding));
      }
    }
  }
}
