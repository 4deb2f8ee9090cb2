// Gradients (issue 19): every backward against central finite differences of its own forward in
// double, and the tiled / structured backwards against the materialised Naive backward.
#include "test_utils.hpp"

#include <effattn/conv_basis.hpp>
#include <effattn/eva.hpp>
#include <effattn/exact.hpp>

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::rel_fro_error;
using effattn::testing::with_threads;

namespace {

using testing::gaussian;

/// The inputs of one gradient check: Q (n x d), K (m x d), V (m x dv), an optional key bias and
/// the upstream gradient G = dL/dO of the loss L = sum(G o O).
struct Problem {
  Matrix<double> Q, K, V, G;
  Vector<double> bias;  // empty: no bias
};

Problem make_problem(Index n, Index m, Index d, Index dv, bool with_bias, std::uint64_t seed) {
  Problem p;
  p.Q = gaussian<double>(n, d, seed);
  p.K = gaussian<double>(m, d, seed + 1);
  p.V = gaussian<double>(m, dv, seed + 2);
  p.G = gaussian<double>(n, dv, seed + 3);
  if (with_bias) p.bias = gaussian<double>(m, 1, seed + 4, 0.5);
  return p;
}

/// Central finite differences (step h) of L = sum(G o forward(Q, K, V, bias)) with respect to
/// every entry of Q, K, V and the bias.
using Forward = std::function<Matrix<double>(const Matrix<double>&, const Matrix<double>&,
                                             const Matrix<double>&, const Vector<double>&)>;
struct FdGradients {
  Matrix<double> dQ, dK, dV;
  Vector<double> dbias;
};

FdGradients finite_differences(const Problem& p, const Forward& forward, double h = 1e-6) {
  auto loss = [&](const Matrix<double>& Q, const Matrix<double>& K, const Matrix<double>& V,
                  const Vector<double>& b) { return p.G.cwiseProduct(forward(Q, K, V, b)).sum(); };
  FdGradients g;
  auto diff = [&](auto& X, auto& out, auto eval) {
    out.resize(X.rows(), X.cols());
    for (Index j = 0; j < X.cols(); ++j)
      for (Index i = 0; i < X.rows(); ++i) {
        const double x = X(i, j);
        X(i, j) = x + h;
        const double up = eval();
        X(i, j) = x - h;
        const double down = eval();
        X(i, j) = x;
        out(i, j) = (up - down) / (2 * h);
      }
  };
  Matrix<double> Q = p.Q, K = p.K, V = p.V;
  Vector<double> b = p.bias;
  auto eval = [&] { return loss(Q, K, V, b); };
  diff(Q, g.dQ, eval);
  diff(K, g.dK, eval);
  diff(V, g.dV, eval);
  if (b.size() > 0) diff(b, g.dbias, eval);
  return g;
}

/// Forward and backward of an ExactAttention functor in double, as closures.
template <typename Policy>
Forward exact_forward(const ExactOptions& o) {
  return [o](const Matrix<double>& Q, const Matrix<double>& K, const Matrix<double>& V,
             const Vector<double>& b) {
    const ExactAttention<double, Policy> f(o);
    auto r = b.size() > 0 ? f.compute(Q, K, V, b) : f.compute(Q, K, V);
    REQUIRE(r.info == Info::Success);
    return r.output;
  };
}

template <typename Scalar, typename Policy>
AttentionGradients<Scalar> exact_backward(const ExactOptions& o, const Matrix<Scalar>& Q,
                                          const Matrix<Scalar>& K, const Matrix<Scalar>& V,
                                          const Vector<Scalar>& b, const Matrix<Scalar>& G) {
  const ExactAttention<Scalar, Policy> f(o);
  if (b.size() > 0) return f.backward(Q, K, V, b, f.compute(Q, K, V, b), G);
  return f.backward(Q, K, V, f.compute(Q, K, V), G);
}

template <typename A, typename B>
void check_close(const A& got, const B& want, double tol, const char* what) {
  const double err = rel_fro_error(got, want);
  INFO(what << ": relative error " << err << " (tolerance " << tol << ")");
  CHECK(err <= tol);
}

}  // namespace

TEMPLATE_TEST_CASE("Exact backward matches central finite differences in double",
                   "[gradients][exact]", policy::Naive, policy::Tiled) {
  // n = 32, d = 4, h = 1e-6: the issue's bar is 1e-6 relative (measured ~1e-10).
  for (const bool causal : {false, true})
    for (const Index m : {32, 45})
      for (const bool with_bias : {false, true}) {
        ExactOptions o;
        o.causal = causal;
        o.block_q = 5;  // Tiled: tiles that do not divide n or m
        o.block_k = 7;
        const Problem p = make_problem(32, m, 4, 3, with_bias, 100 + static_cast<unsigned>(m));
        const FdGradients fd = finite_differences(p, exact_forward<TestType>(o));
        const auto g = exact_backward<double, TestType>(o, p.Q, p.K, p.V, p.bias, p.G);
        INFO("causal " << causal << ", m " << m << ", bias " << with_bias);
        check_close(g.dQ, fd.dQ, 1e-6, "dQ");
        check_close(g.dK, fd.dK, 1e-6, "dK");
        check_close(g.dV, fd.dV, 1e-6, "dV");
        if (with_bias) {
          check_close(g.dbias, fd.dbias, 1e-6, "dbias");
        } else {
          CHECK(g.dbias.size() == 0);
        }
      }
}

TEMPLATE_TEST_CASE("Tiled backward matches the Naive backward", "[gradients][exact]", float,
                   double) {
  // Float: 1e-4 relative (the issue's bar); double: 1e-12.
  const double tol = std::is_same<TestType, float>::value ? 1e-4 : 1e-12;
  struct Shape {
    Index n, m, d, dv, bq, bk;
  };
  for (const Shape s : {Shape{300, 517, 64, 48, 0, 0}, Shape{257, 257, 32, 32, 0, 0},
                        Shape{130, 260, 16, 24, 33, 50}, Shape{1, 40, 8, 8, 0, 0}})
    for (const bool causal : {false, true})
      for (const bool with_bias : {false, true}) {
        ExactOptions o;
        o.causal = causal;
        o.block_q = s.bq;
        o.block_k = s.bk;
        const Problem p =
            make_problem(s.n, s.m, s.d, s.dv, with_bias, 7 + static_cast<unsigned>(s.n));
        const Matrix<TestType> Q = p.Q.cast<TestType>(), K = p.K.cast<TestType>(),
                               V = p.V.cast<TestType>(), G = p.G.cast<TestType>();
        const Vector<TestType> b = p.bias.cast<TestType>();
        const auto ref = exact_backward<TestType, policy::Naive>(o, Q, K, V, b, G);
        const auto got = exact_backward<TestType, policy::Tiled>(o, Q, K, V, b, G);
        INFO("n " << s.n << ", m " << s.m << ", d " << s.d << ", dv " << s.dv << ", causal "
                  << causal << ", bias " << with_bias);
        check_close(got.dQ, ref.dQ, tol, "dQ");
        check_close(got.dK, ref.dK, tol, "dK");
        check_close(got.dV, ref.dV, tol, "dV");
        if (with_bias) check_close(got.dbias, ref.dbias, tol, "dbias");
      }
}

TEST_CASE("Exact backward with masked keys: dbias and dK, dV of a masked key are 0",
          "[gradients][exact]") {
  const Problem p = make_problem(40, 60, 8, 8, true, 55);
  Vector<double> b = p.bias;
  b(3) = -std::numeric_limits<double>::infinity();
  b(41) = -std::numeric_limits<double>::infinity();
  ExactOptions o;
  o.block_q = 16;
  o.block_k = 16;
  const auto ref = exact_backward<double, policy::Naive>(o, p.Q, p.K, p.V, b, p.G);
  const auto got = exact_backward<double, policy::Tiled>(o, p.Q, p.K, p.V, b, p.G);
  for (const Index j : {3, 41}) {
    CHECK(got.dbias(j) == 0.0);
    CHECK(got.dK.row(j).isZero(0.0));
    CHECK(got.dV.row(j).isZero(0.0));
  }
  check_close(got.dQ, ref.dQ, 1e-12, "dQ");
  check_close(got.dK, ref.dK, 1e-12, "dK");
  check_close(got.dbias, ref.dbias, 1e-12, "dbias");
}

TEST_CASE("Tiled backward is bit-identical for 1 and 2 threads", "[gradients][exact][threads]") {
  if (!effattn::testing::has_openmp()) {
    WARN("SKIPPED: built without OpenMP, the thread count cannot change");
    return;
  }
  for (const bool causal : {false, true}) {
    ExactOptions o;
    o.causal = causal;
    o.block_q = 48;
    o.block_k = 64;
    const Problem p = make_problem(700, 900, 32, 32, true, 9);
    const Matrix<float> Q = p.Q.cast<float>(), K = p.K.cast<float>(), V = p.V.cast<float>(),
                        G = p.G.cast<float>();
    const Vector<float> b = p.bias.cast<float>();
    auto run = [&] { return exact_backward<float, policy::Tiled>(o, Q, K, V, b, G); };
    const auto one = with_threads(1, run);
    const auto two = with_threads(2, run);
    CHECK(bitwise_equal(one.dQ, two.dQ));
    CHECK(bitwise_equal(one.dK, two.dK));
    CHECK(bitwise_equal(one.dV, two.dV));
    CHECK(bitwise_equal(one.dbias, two.dbias));
  }
}

TEMPLATE_TEST_CASE("Exact backward rejects bad dO and mismatched results", "[gradients][exact]",
                   policy::Naive, policy::Tiled) {
  const Problem p = make_problem(20, 30, 4, 5, false, 3);
  const ExactAttention<double, TestType> f;
  const auto r = f.compute(p.Q, p.K, p.V);
  REQUIRE_NOTHROW(f.backward(p.Q, p.K, p.V, r, p.G));
  auto throws_naming = [&](auto call, const std::string& word) {
    try {
      (void)call();
      FAIL("no exception; expected one naming " << word);
    } catch (const effattn::invalid_argument& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(word) != std::string::npos);
    }
  };
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, p.G.topRows(19)); }, "dO");
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, p.G.leftCols(4)); }, "dO");
  Matrix<double> bad = p.G;
  bad(2, 2) = std::numeric_limits<double>::quiet_NaN();
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, bad); }, "dO");
  // A result of other inputs.
  const auto other = f.compute(p.Q.topRows(10), p.K, p.V);
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, other, p.G); }, "result");
  auto short_lse = r;
  short_lse.lse.conservativeResize(19);
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, short_lse, p.G); }, "lse");
  auto failed = r;
  failed.info = Info::NumericalIssue;
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, failed, p.G); }, "result");
  // Bias of the wrong length.
  const Vector<double> b = Vector<double>::Zero(29);
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, b, r, p.G); }, "key_bias");
}

// ---------------------------------------------------------------------------------------------
// Conv-Basis.

namespace {

using GridConvBasisd = ConvBasisAttention<double, fft::Default, policy::Grid>;

Forward conv_basis_forward(const ConvBasisOptions& o) {
  return [o](const Matrix<double>& Q, const Matrix<double>& K, const Matrix<double>& V,
             const Vector<double>&) {
    auto r = GridConvBasisd(o).compute(Q, K, V);
    REQUIRE(r.info == Info::Success);
    return r.output;
  };
}

template <typename F>
AttentionGradients<typename F::Scalar> conv_basis_backward(const F& f,
                                                           const Matrix<typename F::Scalar>& Q,
                                                           const Matrix<typename F::Scalar>& K,
                                                           const Matrix<typename F::Scalar>& V,
                                                           const Matrix<typename F::Scalar>& G) {
  const auto r = f.compute(Q, K, V);
  REQUIRE(r.info == Info::Success);
  return f.backward(Q, K, V, r, G);
}

}  // namespace

TEST_CASE("Conv-Basis backward matches central finite differences of its forward",
          "[gradients][conv_basis]") {
  // The gradient with the starts frozen is the exact gradient of the Grid forward: 1e-6 relative
  // (measured <= 2.1e-8), at every k, with a window and with blocks.
  struct Case {
    Index k, window, block;
  };
  for (const Case c : {Case{1, 0, 0}, Case{5, 0, 0}, Case{8, 0, 0}, Case{32, 0, 0}, Case{6, 7, 0},
                       Case{3, 0, 12}, Case{4, 9, 10}}) {
    ConvBasisOptions o;
    o.num_bases = c.k;
    o.window = c.window;
    o.block_size = c.block;
    const Problem p = make_problem(32, 32, 4, 3, false, 300 + static_cast<unsigned>(c.k));
    const FdGradients fd = finite_differences(p, conv_basis_forward(o));
    const auto g = conv_basis_backward(GridConvBasisd(o), p.Q, p.K, p.V, p.G);
    INFO("k " << c.k << ", window " << c.window << ", block " << c.block);
    check_close(g.dQ, fd.dQ, 1e-6, "dQ");
    check_close(g.dK, fd.dK, 1e-6, "dK");
    check_close(g.dV, fd.dV, 1e-6, "dV");
    CHECK(g.dbias.size() == 0);
  }
}

TEST_CASE("Conv-Basis backward at k = n equals the exact causal gradient",
          "[gradients][conv_basis]") {
  for (const Index n : {32, 100}) {
    const Problem p = make_problem(n, n, 8, 5, false, 17 + static_cast<unsigned>(n));
    ConvBasisOptions o;
    o.num_bases = n;
    ExactOptions eo;
    eo.causal = true;
    const auto ref = exact_backward<double, policy::Naive>(eo, p.Q, p.K, p.V, {}, p.G);
    const auto g = conv_basis_backward(GridConvBasisd(o), p.Q, p.K, p.V, p.G);
    INFO("n " << n);
    // 1e-10 (the issue's bar; measured <= 2.5e-13).
    check_close(g.dQ, ref.dQ, 1e-10, "dQ");
    check_close(g.dK, ref.dK, 1e-10, "dK");
    check_close(g.dV, ref.dV, 1e-10, "dV");
    // Float data (double FFTs inside): the float rounding of the inputs and outputs only.
    const ConvBasisAttention<float, fft::Default, policy::Grid> ff(o);
    const auto gf =
        conv_basis_backward(ff, Matrix<float>(p.Q.cast<float>()), Matrix<float>(p.K.cast<float>()),
                            Matrix<float>(p.V.cast<float>()), Matrix<float>(p.G.cast<float>()));
    check_close(gf.dQ, ref.dQ, 1e-4, "float dQ");
    check_close(gf.dK, ref.dK, 1e-4, "float dK");
    check_close(gf.dV, ref.dV, 1e-4, "float dV");
  }
}

TEST_CASE("Conv-Basis backward uses the recovered starts; bit-identical across threads",
          "[gradients][conv_basis][threads]") {
  // The default Scan recovery: the backward is the Grid backward at the recovered starts.
  const Problem p = make_problem(600, 600, 16, 8, false, 5);
  ConvBasisOptions o;
  o.num_bases = 12;
  const ConvBasisAttentiond f(o);
  const auto r = f.compute(p.Q, p.K, p.V);
  REQUIRE(r.info == Info::Success);
  const auto g = f.backward(p.Q, p.K, p.V, r, p.G);
  ConvBasisOptions og = o;
  og.grid_starts = r.offsets;
  const auto gg = conv_basis_backward(GridConvBasisd(og), p.Q, p.K, p.V, p.G);
  CHECK(bitwise_equal(g.dQ, gg.dQ));
  CHECK(bitwise_equal(g.dK, gg.dK));
  CHECK(bitwise_equal(g.dV, gg.dV));
  if (!effattn::testing::has_openmp()) {
    WARN("SKIPPED the thread comparison: built without OpenMP");
    return;
  }
  const auto one = with_threads(1, [&] { return f.backward(p.Q, p.K, p.V, r, p.G); });
  const auto two = with_threads(2, [&] { return f.backward(p.Q, p.K, p.V, r, p.G); });
  CHECK(bitwise_equal(one.dQ, two.dQ));
  CHECK(bitwise_equal(one.dK, two.dK));
  CHECK(bitwise_equal(one.dV, two.dV));
}

TEST_CASE("Conv-Basis backward rejects bad dO and mismatched results", "[gradients][conv_basis]") {
  const Problem p = make_problem(40, 40, 4, 3, false, 8);
  ConvBasisOptions o;
  o.num_bases = 4;
  const ConvBasisAttentiond f(o);
  const auto r = f.compute(p.Q, p.K, p.V);
  REQUIRE_NOTHROW(f.backward(p.Q, p.K, p.V, r, p.G));
  CHECK_THROWS_AS(f.backward(p.Q, p.K, p.V, r, p.G.topRows(39)), effattn::invalid_argument);
  CHECK_THROWS_AS(f.backward(p.Q, p.K, p.V, r, p.G.leftCols(2)), effattn::invalid_argument);
  auto bad = r;
  bad.offsets[0] = 1;
  CHECK_THROWS_AS(f.backward(p.Q, p.K, p.V, bad, p.G), effattn::invalid_argument);
  bad = r;
  bad.offsets.push_back(40);
  bad.bases_used += 1;
  CHECK_THROWS_AS(f.backward(p.Q, p.K, p.V, bad, p.G), effattn::invalid_argument);
  const auto other = f.compute(p.Q.topRows(20), p.K.topRows(20), p.V.topRows(20));
  CHECK_THROWS_AS(f.backward(p.Q, p.K, p.V, other, p.G), effattn::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Performer.

TEST_CASE("Performer backward matches central finite differences of its forward",
          "[gradients][performer]") {
  // The features are fixed by the seed, so the forward is a smooth function of Q, K, V: 1e-6
  // relative (the issue's bar).
  for (const Index m : {32, 45}) {
    PerformerOptions o;
    o.samples = 16;
    const Problem p = make_problem(32, m, 4, 3, false, 900 + static_cast<unsigned>(m));
    const Forward fwd = [o](const Matrix<double>& Q, const Matrix<double>& K,
                            const Matrix<double>& V, const Vector<double>&) {
      auto r = PerformerAttentiond(o).compute(Q, K, V);
      REQUIRE(r.info == Info::Success);
      return r.output;
    };
    const FdGradients fd = finite_differences(p, fwd);
    const PerformerAttentiond f(o);
    const auto g = f.backward(p.Q, p.K, p.V, f.compute(p.Q, p.K, p.V), p.G);
    INFO("m " << m);
    check_close(g.dQ, fd.dQ, 1e-6, "dQ");
    check_close(g.dK, fd.dK, 1e-6, "dK");
    check_close(g.dV, fd.dV, 1e-6, "dV");
  }
}

TEST_CASE("Performer backward: float agrees with double; bad dO throws", "[gradients][performer]") {
  const Problem p = make_problem(200, 300, 16, 8, false, 4);
  PerformerOptions o;
  o.samples = 64;
  const PerformerAttentiond fd(o);
  const PerformerAttentionf ff(o);
  const auto gd = fd.backward(p.Q, p.K, p.V, fd.compute(p.Q, p.K, p.V), p.G);
  const Matrix<float> Q = p.Q.cast<float>(), K = p.K.cast<float>(), V = p.V.cast<float>(),
                      G = p.G.cast<float>();
  const auto rf = ff.compute(Q, K, V);
  const auto gf = ff.backward(Q, K, V, rf, G);
  // Float inputs and features, double arithmetic inside: measured ~1e-6.
  check_close(gf.dQ, gd.dQ, 1e-4, "dQ");
  check_close(gf.dK, gd.dK, 1e-4, "dK");
  check_close(gf.dV, gd.dV, 1e-4, "dV");
  CHECK_THROWS_AS(ff.backward(Q, K, V, rf, G.topRows(199)), effattn::invalid_argument);
  CHECK_THROWS_AS(ff.backward(Q, K, V, rf, G.leftCols(7)), effattn::invalid_argument);
}
