// Gradients: every backward against central finite differences of its own forward in
// double, and the tiled / structured backwards against the materialised Naive backward.
#include "per_head.hpp"
#include "test_utils.hpp"

#include <effattn/conv_basis.hpp>
#include <effattn/eva.hpp>
#include <effattn/exact.hpp>
#include <effattn/multi_head.hpp>

#include <array>
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
  // n = 32, d = 4, h = 1e-6: tolerance 1e-6 relative (measured ~1e-10).
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
  // Float: 1e-4 relative; double: 1e-12.
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

/// Checks that `call()` throws effattn::invalid_argument with `word` in its message.
template <typename Call>
void throws_naming(Call call, const std::string& word) {
  try {
    (void)call();
    FAIL("no exception; expected one naming " << word);
  } catch (const effattn::invalid_argument& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(word) != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("Exact backward rejects bad dO and mismatched results", "[gradients][exact]",
                   policy::Naive, policy::Tiled) {
  const Problem p = make_problem(20, 30, 4, 5, false, 3);
  const ExactAttention<double, TestType> f;
  const auto r = f.compute(p.Q, p.K, p.V);
  REQUIRE_NOTHROW(f.backward(p.Q, p.K, p.V, r, p.G));
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
    o.sliding_window = c.window;
    o.mask_block = c.block;
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
    // 1e-10 (measured <= 2.5e-13).
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
  // relative.
  for (const Index m : {32, 45}) {
    PerformerOptions o;
    o.features = 16;
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
  o.features = 64;
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

// ---------------------------------------------------------------------------------------------
// EVA.

namespace {

Forward eva_forward(const EvaOptions& o) {
  return [o](const Matrix<double>& Q, const Matrix<double>& K, const Matrix<double>& V,
             const Vector<double>&) {
    auto r = EvaAttentiond(o).compute(Q, K, V);
    REQUIRE(r.info == Info::Success);
    return r.output;
  };
}

template <typename Scalar>
EvaGradients<Scalar> eva_backward(const EvaOptions& o, const Matrix<Scalar>& Q,
                                  const Matrix<Scalar>& K, const Matrix<Scalar>& V,
                                  const Matrix<Scalar>& G) {
  const EvaAttention<Scalar> f(o);
  const auto r = f.compute(Q, K, V);
  REQUIRE(r.info == Info::Success);
  return f.backward(Q, K, V, r, G);
}

/// Checks dQ, dK, dV of EVA with options o against central finite differences of its forward;
/// returns the largest relative error.
double check_eva_fd(const EvaOptions& o, const Problem& p, double tol) {
  const FdGradients fd = finite_differences(p, eva_forward(o));
  const auto g = eva_backward<double>(o, p.Q, p.K, p.V, p.G);
  check_close(g.dQ, fd.dQ, tol, "dQ");
  check_close(g.dK, fd.dK, tol, "dK");
  check_close(g.dV, fd.dV, tol, "dV");
  // The loss depends on every input: a vanishing gradient fails the relative checks above.
  CHECK(fd.dQ.norm() > 1e-2);
  CHECK(fd.dK.norm() > 1e-2);
  CHECK(fd.dV.norm() > 1e-2);
  return std::max(
      {rel_fro_error(g.dQ, fd.dQ), rel_fro_error(g.dK, fd.dK), rel_fro_error(g.dV, fd.dV)});
}

/// Central finite differences of the loss sum(G o O) with respect to the summary-map parameter
/// that get(options) refers to (a matrix or a vector).
template <typename Get>
Matrix<double> eva_param_fd(const EvaOptions& o, const Problem& p, Get get, double h = 1e-6) {
  EvaOptions x = o;
  auto& X = get(x);
  auto loss = [&] {
    auto r = EvaAttentiond(x).compute(p.Q, p.K, p.V);
    REQUIRE(r.info == Info::Success);
    return p.G.cwiseProduct(r.output).sum();
  };
  Matrix<double> out(X.rows(), X.cols());
  for (Index j = 0; j < X.cols(); ++j)
    for (Index i = 0; i < X.rows(); ++i) {
      const double v = X(i, j);
      X(i, j) = v + h;
      const double up = loss();
      X(i, j) = v - h;
      const double down = loss();
      X(i, j) = v;
      out(i, j) = (up - down) / (2 * h);
    }
  return out;
}

/// A parameter gradient against its finite differences, or empty when the map lacks the
/// parameter. The error is relative to max(|fd|, 1e-2): a parameter the loss does not depend on
/// (a key bias that shifts every chunk logit equally) has a finite difference of pure round-off.
template <typename Got, typename Get>
double check_eva_param(const EvaOptions& o, const Problem& p, const Got& got, Get get, bool present,
                       double tol, const char* what) {
  INFO(what);
  if (!present) {
    CHECK(got.size() == 0);
    return 0;
  }
  const Matrix<double> fd = eva_param_fd(o, p, get);
  REQUIRE(got.rows() == fd.rows());
  REQUIRE(got.cols() == fd.cols());
  const double err = (Matrix<double>(got) - fd).norm() / std::max(fd.norm(), 1e-2);
  INFO("relative error " << err << " (tolerance " << tol << "), |fd| " << fd.norm());
  CHECK(err <= tol);
  return err;
}

constexpr eva::Mass kMasses[] = {eva::Mass::Literal, eva::Mass::LogCount, eva::Mass::GaussianDiag};
constexpr eva::Proposal kProposals[] = {eva::Proposal::SumMeans, eva::Proposal::HalfSum,
                                        eva::Proposal::QueryMean, eva::Proposal::Zero};

}  // namespace

TEST_CASE("EVA backward matches central finite differences over the option grid",
          "[gradients][eva]") {
  // Every shape regime x samples {0, 1, 3} x both partitions, with the mass and the proposal
  // cycling so that each of their 12 pairs meets several shapes. h = 1e-6: the largest relative
  // error measured over the grid is 5.4e-9 (round-off of the loss / h, ~1e-15 / 1e-6); 1e-6 is
  // the tolerance of the other methods' checks.
  struct Shape {
    Index n, m;
    bool causal;
    Index window, chunk;
  };
  const Shape shapes[] = {
      {32, 32, false, 8, 4},   // chunks inside the block skipped (L < K)
      {32, 32, false, 8, 8},   // L == K
      {38, 38, false, 4, 12},  // L > K: level-1 chunks; ragged last block and chunk
      {24, 37, false, 0, 5},   // no exact keys; cross-attention (query means over all queries)
      {40, 30, false, 8, 4},   // n > m: clamped query positions
      {32, 32, true, 8, 4},   {32, 32, true, 4, 8},
      {24, 40, true, 8, 8},   // n < m: bottom-right aligned
      {20, 37, true, 4, 12},  // level-1 chunks, ragged, bottom-right aligned
  };
  std::size_t idx = 0;
  double worst = 0;
  for (const Shape& s : shapes)
    for (const Index samples : {0, 1, 3})
      for (const eva::Partition part : {eva::Partition::Disjoint, eva::Partition::Overlapping}) {
        EvaOptions o;
        o.causal = s.causal;
        o.window = s.window;
        o.chunk_size = s.chunk;
        o.samples = samples;
        o.seed = 11 + idx;
        o.partition = part;
        o.mass = kMasses[idx % 3];
        o.proposal = kProposals[idx % 4];
        const Problem p = make_problem(s.n, s.m, 5, 3, false, 2000 + 10 * idx);
        ++idx;
        INFO("n " << s.n << ", m " << s.m << ", causal " << s.causal << ", window " << s.window
                  << ", chunk " << s.chunk << ", samples " << samples << ", partition "
                  << static_cast<int>(part) << ", mass " << static_cast<int>(o.mass)
                  << ", proposal " << static_cast<int>(o.proposal));
        worst = std::max(worst, check_eva_fd(o, p, 1e-6));
      }
  INFO("largest relative error " << worst);
  CHECK(worst < 1e-6);
}

TEST_CASE("EVA backward: summary-map gradients match finite differences", "[gradients][eva]") {
  // Linear maps with and without LayerNorm (with and without gain and offset) on the keys and
  // the queries, causal and not, deterministic and sampled. Measured: at most 3e-9 relative, and
  // 6e-8 (of the 1e-2 floor) for the key bias of configuration 5, whose true gradient is 0.
  const Index d = 5;
  double worst = 0;
  for (int cfg = 0; cfg < 6; ++cfg) {
    EvaOptions o;
    o.window = cfg < 2 ? 8 : (cfg < 4 ? 4 : 0);
    o.chunk_size = cfg < 2 ? 4 : (cfg < 4 ? 8 : 6);
    o.causal = o.window > 0 && cfg % 2 == 1;
    o.samples = cfg % 3 == 0 ? 0 : 3;
    o.mass = kMasses[cfg % 3];
    o.proposal = kProposals[cfg % 3];
    const auto ucfg = static_cast<std::uint64_t>(cfg);
    eva::SummaryMap& km = o.key_map;
    km.weight = Matrix<double>::Identity(d, d) + gaussian<double>(d, d, 10 * ucfg + 1, 0.3);
    km.bias = gaussian<double>(d, 1, 10 * ucfg + 2, 0.3);
    km.layer_norm = cfg % 2 == 0;
    if (cfg != 2) {
      km.ln_gamma = (gaussian<double>(d, 1, 10 * ucfg + 3, 0.2).array() + 1).matrix();
      km.ln_beta = gaussian<double>(d, 1, 10 * ucfg + 4, 0.2);
    }
    if (cfg != 4) {
      eva::SummaryMap& qm = o.query_map;
      if (cfg != 3)
        qm.weight = Matrix<double>::Identity(d, d) + gaussian<double>(d, d, 10 * ucfg + 5, 0.3);
      qm.layer_norm = cfg % 2 == 1;
      qm.ln_gamma = (gaussian<double>(d, 1, 10 * ucfg + 6, 0.2).array() + 1).matrix();
      qm.ln_beta = gaussian<double>(d, 1, 10 * ucfg + 7, 0.2);
    }
    const Problem p = make_problem(32, cfg == 5 ? 40 : 32, d, 3, false, 3000 + 10 * ucfg);
    INFO("configuration " << cfg);
    worst = std::max(worst, check_eva_fd(o, p, 1e-6));
    const auto g = eva_backward<double>(o, p.Q, p.K, p.V, p.G);
    using Opt = EvaOptions;
    const eva::SummaryMap &k = o.key_map, &q = o.query_map;
    const double tol = 1e-6;
    worst = std::max(
        {worst,
         check_eva_param(
             o, p, g.key_map.weight, [](Opt & x) -> auto& { return x.key_map.weight; },
             k.weight.size() > 0, tol, "key_map.weight"),
         check_eva_param(
             o, p, g.key_map.bias, [](Opt & x) -> auto& { return x.key_map.bias; },
             k.bias.size() > 0, tol, "key_map.bias"),
         check_eva_param(
             o, p, g.key_map.ln_gamma, [](Opt & x) -> auto& { return x.key_map.ln_gamma; },
             k.layer_norm&& k.ln_gamma.size() > 0, tol, "key_map.ln_gamma"),
         check_eva_param(
             o, p, g.key_map.ln_beta, [](Opt & x) -> auto& { return x.key_map.ln_beta; },
             k.layer_norm&& k.ln_beta.size() > 0, tol, "key_map.ln_beta"),
         check_eva_param(
             o, p, g.query_map.weight, [](Opt & x) -> auto& { return x.query_map.weight; },
             q.weight.size() > 0, tol, "query_map.weight"),
         check_eva_param(
             o, p, g.query_map.bias, [](Opt & x) -> auto& { return x.query_map.bias; },
             q.bias.size() > 0, tol, "query_map.bias"),
         check_eva_param(
             o, p, g.query_map.ln_gamma, [](Opt & x) -> auto& { return x.query_map.ln_gamma; },
             q.layer_norm&& q.ln_gamma.size() > 0, tol, "query_map.ln_gamma"),
         check_eva_param(
             o, p, g.query_map.ln_beta, [](Opt & x) -> auto& { return x.query_map.ln_beta; },
             q.layer_norm&& q.ln_beta.size() > 0, tol, "query_map.ln_beta")});
  }
  INFO("largest relative error " << worst);
  CHECK(worst < 1e-6);
}

TEST_CASE("EVA backward equals the exact gradient where EVA is exact", "[gradients][eva]") {
  // window >= m (every key local) and disjoint singleton chunks (k^_c = k~_j, u_c = 0, b = v_j
  // for any draw) make EVA softmax attention, hence its gradient the exact one. Measured: at
  // most 7.3e-16 relative.
  struct Case {
    Index n, m, window, chunk;
    bool causal;
  };
  const Case cases[] = {{40, 40, 64, 0, false}, {40, 40, 64, 0, true}, {24, 40, 40, 0, true},
                        {36, 36, 8, 1, false},  {36, 36, 4, 1, true},  {20, 37, 8, 1, true},
                        {30, 33, 0, 1, false}};
  std::size_t idx = 0;
  for (const Case& c : cases)
    for (const Index samples : {0, 1, 3}) {
      EvaOptions o;
      o.causal = c.causal;
      o.window = c.window;
      o.chunk_size = c.chunk;
      o.samples = samples;
      o.mass = kMasses[idx % 3];
      o.proposal = kProposals[idx % 4];
      const Problem p = make_problem(c.n, c.m, 6, 4, false, 4000 + 10 * idx);
      ++idx;
      ExactOptions eo;
      eo.causal = c.causal;
      const auto want = exact_backward<double, policy::Naive>(eo, p.Q, p.K, p.V, p.bias, p.G);
      const auto got = eva_backward<double>(o, p.Q, p.K, p.V, p.G);
      INFO("n " << c.n << ", m " << c.m << ", window " << c.window << ", chunk " << c.chunk
                << ", causal " << c.causal << ", samples " << samples);
      check_close(got.dQ, want.dQ, 1e-12, "dQ");
      check_close(got.dK, want.dK, 1e-12, "dK");
      check_close(got.dV, want.dV, 1e-12, "dV");
    }
}

TEST_CASE("EVA backward: float agrees with double; bit-identical for 1 and 2 threads",
          "[gradients][eva][threads]") {
  for (const bool causal : {false, true}) {
    EvaOptions o;
    o.causal = causal;
    o.window = 32;
    o.chunk_size = causal ? 8 : 64;  // L < K causal, L > K (level-1 chunks) otherwise
    o.samples = 3;
    o.mass = eva::Mass::GaussianDiag;
    o.key_map.weight = Matrix<double>::Identity(16, 16) + gaussian<double>(16, 16, 5, 0.2);
    o.key_map.layer_norm = true;
    o.query_map.weight = Matrix<double>::Identity(16, 16) + gaussian<double>(16, 16, 6, 0.2);
    const Problem p = make_problem(600, 650, 16, 8, false, causal ? 71 : 72);
    const auto gd = eva_backward<double>(o, p.Q, p.K, p.V, p.G);
    const Matrix<float> Q = p.Q.cast<float>(), K = p.K.cast<float>(), V = p.V.cast<float>(),
                        G = p.G.cast<float>();
    auto run = [&] { return eva_backward<float>(o, Q, K, V, G); };
    const auto one = with_threads(1, run);
    // Float inputs and chunk statistics, double arithmetic after: measured 3e-7 relative.
    INFO("causal " << causal);
    check_close(one.dQ, gd.dQ, 1e-4, "dQ");
    check_close(one.dK, gd.dK, 1e-4, "dK");
    check_close(one.dV, gd.dV, 1e-4, "dV");
    check_close(one.key_map.weight, gd.key_map.weight, 1e-4, "key_map.weight");
    if (!effattn::testing::has_openmp()) {
      WARN("SKIPPED thread-count check: built without OpenMP");
      continue;
    }
    const auto two = with_threads(2, run);
    CHECK(bitwise_equal(one.dQ, two.dQ));
    CHECK(bitwise_equal(one.dK, two.dK));
    CHECK(bitwise_equal(one.dV, two.dV));
    CHECK(bitwise_equal(one.key_map.weight, two.key_map.weight));
    CHECK(bitwise_equal(one.query_map.weight, two.query_map.weight));
    const auto dd1 = with_threads(1, [&] { return eva_backward<double>(o, p.Q, p.K, p.V, p.G); });
    const auto dd2 = with_threads(2, [&] { return eva_backward<double>(o, p.Q, p.K, p.V, p.G); });
    CHECK(bitwise_equal(dd1.dQ, dd2.dQ));
    CHECK(bitwise_equal(dd1.dK, dd2.dK));
    CHECK(bitwise_equal(dd1.dV, dd2.dV));
  }
}

TEST_CASE("EVA backward rejects bad dO and mismatched results", "[gradients][eva]") {
  const Problem p = make_problem(24, 32, 4, 3, false, 8);
  EvaOptions o;
  o.window = 8;
  o.chunk_size = 4;
  o.samples = 2;
  const EvaAttentiond f(o);
  const auto r = f.compute(p.Q, p.K, p.V);
  REQUIRE_NOTHROW(f.backward(p.Q, p.K, p.V, r, p.G));
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, p.G.topRows(23)); }, "dO");
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, p.G.leftCols(2)); }, "dO");
  Matrix<double> bad = p.G;
  bad(5, 1) = std::numeric_limits<double>::infinity();
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, r, bad); }, "dO");
  // Results of other shapes, options, seeds or inputs.
  throws_naming(
      [&] { return f.backward(p.Q, p.K, p.V, f.compute(p.Q.topRows(20), p.K, p.V), p.G); },
      "result");
  throws_naming(
      [&] {
        return f.backward(p.Q, p.K, p.V, f.compute(p.Q, p.K.topRows(28), p.V.topRows(28)), p.G);
      },
      "result");
  EvaOptions o2 = o;
  o2.chunk_size = 8;
  throws_naming(
      [&] { return f.backward(p.Q, p.K, p.V, EvaAttentiond(o2).compute(p.Q, p.K, p.V), p.G); },
      "result");
  o2 = o;
  o2.seed += 1;
  throws_naming(
      [&] { return f.backward(p.Q, p.K, p.V, EvaAttentiond(o2).compute(p.Q, p.K, p.V), p.G); },
      "result");
  const Matrix<double> K2 = p.K * 1.5;
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, f.compute(p.Q, K2, p.V), p.G); }, "result");
  auto failed = r;
  failed.info = Info::NumericalIssue;
  throws_naming([&] { return f.backward(p.Q, p.K, p.V, failed, p.G); }, "result");
  // Absent map parameters have empty gradients.
  const auto g = f.backward(p.Q, p.K, p.V, r, p.G);
  CHECK(g.key_map.weight.size() == 0);
  CHECK(g.key_map.bias.size() == 0);
  CHECK(g.query_map.ln_gamma.size() == 0);
  CHECK(g.dbias.size() == 0);
}

TEST_CASE("MultiHead<EVA> backward equals per-head backward calls",
          "[gradients][eva][multi_head]") {
  using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const SeqOffsets cu{0, 24, 24, 64};  // lengths 24, 0, 40
  const Index H = 4, G = 2, d = 5, dv = 3, T = cu.back();
  for (const bool causal : {false, true}) {
    EvaOptions o;
    o.causal = causal;
    o.window = 8;
    o.chunk_size = 4;
    o.samples = 3;
    const RowMat Q = gaussian<double>(T, H * d, 81), K = gaussian<double>(T, G * d, 82),
                 V = gaussian<double>(T, G * dv, 83), dO = gaussian<double>(T, H * dv, 84);
    const MultiHead<EvaAttentiond> mh(o, {H, G});
    const auto fwd = mh.compute(Q, K, V, cu, cu);
    REQUIRE(fwd.info == Info::Success);
    const auto g = mh.backward(Q, K, V, fwd, dO, cu, cu);
    const auto ref = testing::per_head_backward(EvaAttentiond(o), {H, G}, Q, K, V, dO, cu);
    const Matrix<double>&rq = ref[0], &rk = ref[1], &rv = ref[2];
    INFO("causal " << causal);
    // The same per-head arithmetic on the same values: measured 0 (1e-13 allows for the
    // packed slices' different strides).
    check_close(Matrix<double>(g.dQ), rq, 1e-13, "dQ");
    check_close(Matrix<double>(g.dK), rk, 1e-13, "dK");
    check_close(Matrix<double>(g.dV), rv, 1e-13, "dV");
    CHECK(rk.norm() > 1e-2);
  }
}
