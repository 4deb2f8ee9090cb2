// Tests of effattn/wildcat.hpp. Oracles: exact softmax attention
// (loop_attention in long double, ExactAttention Naive in double), dense kernel matrices with a
// direct LDLT solve and the paper's inverse-update Alg. 1 written here, and a dense eigensolver
// for the operator norm of the Nystrom residual (Lemma 2). Tolerances carry the measured error.
#include "conformance.hpp"
#include "test_utils.hpp"

#include <effattn/exact.hpp>
#include <effattn/wildcat.hpp>
#include <effattn/workloads.hpp>

#include <Eigen/Eigenvalues>
#include <Eigen/LU>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::is_float;
using effattn::testing::loop_attention;
using effattn::testing::max_abs_error;
using effattn::testing::randn;
using effattn::testing::rel_fro_error;
using effattn::testing::verbose;
using effattn::testing::with_threads;

namespace {

// Rows uniform on the sphere of radius R.
Matrix<double> sphere(Index r, Index d, double R, std::uint64_t seed) {
  Matrix<double> m = randn<double>(r, d, seed);
  for (Index i = 0; i < r; ++i) m.row(i) *= R / m.row(i).norm();
  return m;
}

// max |A - B| / max |V| (round-off relative to the value scale).
template <typename DA, typename DB, typename DV>
double vrel_err(const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DB>& B,
                const Eigen::MatrixBase<DV>& V) {
  return max_abs_error(A, B) / std::max(1e-30, V.template cast<double>().cwiseAbs().maxCoeff());
}

template <typename Scalar>
Matrix<double> exact_of(const Matrix<Scalar>& Q, const Matrix<Scalar>& K, const Matrix<Scalar>& V,
                        double scale = 0) {
  ExactOptions o;
  o.scale = scale;
  return ExactAttention<double, policy::Naive>(o)(
      Q.template cast<double>(), K.template cast<double>(), V.template cast<double>());
}

// Dense Nystrom weights of h_tau on the centred keys Kc for landmarks S, by a direct LDLT solve:
// W = H(S, S)^{-1} H(S, :), H = exp(s Kc Kc^T), s = beta / tau^2.
Matrix<double> direct_weights(const Matrix<double>& Kc, const std::vector<Index>& S, double s) {
  const Matrix<double> H = (s * Kc * Kc.transpose()).array().exp().matrix();
  const auto r = static_cast<Index>(S.size());
  Matrix<double> Hss(r, r), Hs(r, Kc.rows());
  for (Index i = 0; i < r; ++i) {
    Hs.row(i) = H.row(S[static_cast<std::size_t>(i)]);
    for (Index j = 0; j < r; ++j)
      Hss(i, j) = H(S[static_cast<std::size_t>(i)], S[static_cast<std::size_t>(j)]);
  }
  return Hss.ldlt().solve(Hs);
}

// The paper's Alg. 1 (with the corrected i > 1 guard) for a *given* pivot sequence: inverse
// update M = H(S, S)^{-1} by rank-one g g^T terms, W = M R.
Matrix<double> alg1_weights(const Matrix<double>& Kc, const std::vector<Index>& S, double s) {
  const Matrix<double> H = (s * Kc * Kc.transpose()).array().exp().matrix();
  const Index m = Kc.rows(), r = static_cast<Index>(S.size());
  Vector<double> p = H.diagonal();
  Matrix<double> M = Matrix<double>::Zero(r, r), R = Matrix<double>::Zero(r, m);
  for (Index i = 0; i < r; ++i) {
    const Index sp = S[static_cast<std::size_t>(i)];
    Vector<double> g = Vector<double>::Zero(i + 1);
    if (i > 0) g.head(i) = M.topLeftCorner(i, i) * R.topRows(i).col(sp);
    g(i) = -1;
    g /= std::sqrt(p(sp));
    M.topLeftCorner(i + 1, i + 1) += g * g.transpose();
    R.row(i) = H.row(sp);
    const RowVector<double> delta = g.transpose() * R.topRows(i + 1);
    p -= delta.transpose().cwiseAbs2();
    p(sp) = 0;
  }
  return M * R;
}

// The true Nystrom weights W (k x m, original units) recovered from a cache compressed with
// V = I_m: values = Wt, W = diag(exp(log_scale)) Wt.
Matrix<double> weights_from_identity_cache(const CompressedKV<double>& ckv) {
  return ckv.log_scale.array().exp().matrix().asDiagonal() * ckv.values;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
TEST_CASE("WildcatAttention models the functor concept; diagnostics are named and finite",
          "[wildcat]") {
  STATIC_REQUIRE(is_attention_functor_v<WildcatAttention<float>>);
  STATIC_REQUIRE(is_attention_functor_v<WildcatAttention<double>>);
  STATIC_REQUIRE(is_attention_functor_v<WildcatAttention<double, policy::GreedyPivoted>>);
  STATIC_REQUIRE(std::string_view(functor_traits<WildcatAttentionf>::name) == "WildcatAttention");
  STATIC_REQUIRE(!functor_traits<WildcatAttentionf>::supports_causal);
  STATIC_REQUIRE(!functor_traits<WildcatAttentionf>::causal_only);
  STATIC_REQUIRE(functor_traits<WildcatAttentionf>::randomized);
  STATIC_REQUIRE(!functor_traits<WildcatAttentionf>::self_attention_only);
  STATIC_REQUIRE(!functor_traits<WildcatAttentionf>::exact);
  const auto w = workloads::make<double>(workloads::Kind::Clustered,
                                         workloads::Params::shape(50, 300, 8, 4, 3));
  WildcatOptions o;
  o.rank = 24;
  o.bins = 4;  // 4 bins of 75 keys, 6 pivots each
  const auto r = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
  REQUIRE(r.info == Info::Success);
  const Diagnostics diag = r.diagnostics();
  REQUIRE(diag.size() == 5);
  std::set<std::string> names;
  for (const Diagnostic& x : diag) {
    names.insert(x.name);
    CHECK(std::isfinite(x.value));
  }
  CHECK(names.size() == diag.size());
  CHECK(diag[0].value == static_cast<double>(r.rank));
  CHECK(diag[1].value == 4);
  CHECK(diag[2].value == 0);  // no bin kept exactly
  CHECK(diag[4].value == r.error_bound);
}

TEMPLATE_TEST_CASE("The KV-cache members equal the free functions", "[wildcat]", float, double) {
  const Matrix<TestType> K = randn<TestType>(300, 8, 5), V = randn<TestType>(300, 3, 6),
                         Q = randn<TestType>(20, 8, 7);
  WildcatOptions o;
  o.rank = 16;
  o.bins = 2;
  const WildcatAttention<TestType> f(o);
  const CompressedKV<TestType> a = f.compress_kv(K, V, 1.5), b = compress_kv(K, V, 1.5, o);
  CHECK(bitwise_equal(a.keys, b.keys));
  CHECK(bitwise_equal(a.values, b.values));
  CHECK(a.pivots == b.pivots);
  CHECK(bitwise_equal(f.weighted_attention(Q, a).output, weighted_attention(Q, b, o).output));
  CompressedKV<TestType> c = a, e = b;
  c.append(K.topRows(40), V.topRows(40));
  e.append(K.topRows(40), V.topRows(40));
  REQUIRE(f.recompress_tail(c, 0.0));
  REQUIRE(recompress_tail(e, 0.0, o));
  CHECK(bitwise_equal(c.values, e.values));
  CHECK(c.pivots == e.pivots);
  CHECK_THROWS_AS(f.compress_kv(K, V, -1.0), effattn::invalid_argument);
  CHECK_THROWS_AS(f.recompress_tail(c, NAN), effattn::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
TEMPLATE_TEST_CASE("WildCat conforms: rank >= m is exact on every workload", "[wildcat]", float,
                   double) {
  effattn::testing::ConformanceConfig cfg;
  cfg.name = "WildCat exact path";
  // Exact path (w = 1, every key kept): measured <= 3e-16 (double), 4e-7 (float).
  cfg.tolerance = [](workloads::Kind) { return is_float<TestType>() ? 1e-5 : 1e-12; };
  effattn::testing::check_conformance<TestType>(
      cfg, [](const auto& Q, const auto& K, const auto& V) {
        WildcatOptions o;
        o.rank = 512;
        o.bins = 3;
        return WildcatAttention<TestType>(o).compute(Q, K, V);
      });
}

TEMPLATE_TEST_CASE("WildCat conforms: rank 64 with bins", "[wildcat]", float, double) {
  effattn::testing::ConformanceConfig cfg;
  cfg.name = "WildCat r64";
  // Measured relative Frobenius errors (r = 64, B = 2, worst shape; float = double to 1e-6):
  // gaussian 0.55, sphere 0.060, clustered 0.074, positional 0.154, needles 0.78. Bounds ~1.4x
  // above: they catch a broken selection, weighting or clip (errors jump to >= 1).
  // The check is a fraction of the uniform-attention baseline's error (so a mean-of-V output
  // fails), min(1.5 f, (1 + f) / 2) of the measured max fraction f over both shapes and scalars:
  // clustered 0.078, gaussian 0.758, needles 0.875, positional 0.198, sphere 0.411; the absolute
  // bounds above stay as a cap.
  cfg.baseline_fraction = [](workloads::Kind k) {
    switch (k) {
      case workloads::Kind::Clustered:
        return 0.117;
      case workloads::Kind::Gaussian:
        return 0.879;
      case workloads::Kind::Needles:
        return 0.938;
      case workloads::Kind::Positional:
        return 0.297;
      case workloads::Kind::Sphere:
        return 0.616;
    }
    return -1.0;
  };
  cfg.tolerance_cap = [](workloads::Kind k) {
    switch (k) {
      case workloads::Kind::Gaussian:
        return 0.75;
      case workloads::Kind::Sphere:
        return 0.09;
      case workloads::Kind::Clustered:
        return 0.11;
      case workloads::Kind::Positional:
        return 0.22;
      default:
        return 1.0;
    }
  };
  effattn::testing::check_conformance<TestType>(
      cfg, [](const auto& Q, const auto& K, const auto& V) {
        WildcatOptions o;
        o.rank = 64;
        o.bins = 2;
        return WildcatAttention<TestType>(o).compute(Q, K, V);
      });
}

TEMPLATE_TEST_CASE("Exact paths: rank >= keys, m = 1, float with double selection", "[wildcat]",
                   float, double) {
  const double tol = is_float<TestType>() ? 1e-5 : 1e-12;  // measured 2e-7 / 4e-16
  for (const Index m : {Index(1), Index(7), Index(100)}) {
    const Matrix<TestType> Q = randn<TestType>(33, 8, 1), K = randn<TestType>(m, 8, 2),
                           V = randn<TestType>(m, 5, 3);
    WildcatOptions o;
    o.rank = m;
    const auto r = WildcatAttention<TestType>(o).compute(Q, K, V);
    REQUIRE(r.info == Info::Success);
    CHECK(r.rank == m);
    const Matrix<double> ref = loop_attention(Q, K, V, 1.0 / std::sqrt(8.0), false);
    CHECK(vrel_err(r.output, ref, V) <= tol);
    if (m == 1)
      for (Index i = 0; i < Q.rows(); ++i) CHECK(max_abs_error(r.output.row(i), V.row(0)) == 0);
  }
}

TEST_CASE("Interpolation and weight equivalence with a direct solve and Alg. 1", "[wildcat]") {
  // m = 300, r = 40, d = 6. Compressing V = I_m exposes W itself.
  const Index m = 300, d = 6;
  const Matrix<double> K = randn<double>(m, d, 11), V = Matrix<double>::Identity(m, m);
  WildcatOptions o;
  o.rank = 40;
  const double beta = 1 / std::sqrt(6.0);
  const CompressedKV<double> ckv = compress_kv(K, V, 0.0, o);
  REQUIRE(ckv.size() == 40);
  REQUIRE(ckv.blocks.size() == 1);
  const Matrix<double> W = weights_from_identity_cache(ckv);
  // Interpolation: W(:, S) = I (measured 3e-14).
  Matrix<double> WS(40, 40);
  for (Index j = 0; j < 40; ++j) WS.col(j) = W.col(ckv.pivots[static_cast<std::size_t>(j)]);
  CHECK((WS - Matrix<double>::Identity(40, 40)).cwiseAbs().maxCoeff() <= 1e-10);
  // Equivalence with the direct LDLT solve and with Alg. 1 on the centred keys (measured 4e-15
  // and 2e-13 relative).
  const Matrix<double> Kc = K.rowwise() - K.colwise().mean();
  const double s = beta / ckv.blocks[0].tau2;
  const Matrix<double> Wd = direct_weights(Kc, ckv.pivots, s);
  const Matrix<double> Wa = alg1_weights(Kc, ckv.pivots, s);
  if (verbose())
    std::cout << "[wildcat] weights vs direct " << rel_fro_error(W, Wd) << " vs alg1 "
              << rel_fro_error(W, Wa) << "\n";
  CHECK(rel_fro_error(W, Wd) <= 1e-10);
  CHECK(rel_fro_error(W, Wa) <= 1e-10);
  // Ahat(:, S) = A(:, S) for random queries (through weighted attention's numerator with
  // V = I: the unnormalised row is proportional to Ahat).
  const Matrix<double> Q = randn<double>(20, d, 12);
  const Matrix<double> Ahat =
      ((beta * Q * ckv.keys.transpose()).rowwise() + ckv.log_scale.transpose())
          .array()
          .exp()
          .matrix() *
      ckv.values;
  const Matrix<double> A = (beta * Q * K.transpose()).array().exp().matrix();
  for (Index j = 0; j < 40; ++j) {
    const Index l = ckv.pivots[static_cast<std::size_t>(j)];
    CHECK(rel_fro_error(Ahat.col(l), A.col(l)) <= 1e-10);
  }
}

TEST_CASE("Temperature: golden values, rho0, and the effect of eq. 12", "[wildcat]") {
  // Golden tau^2 values, computed independently with a Halley-iteration W0.
  CHECK(std::abs(wildcat::rho0() - 3.191601025323704) <= 1e-13);
  CHECK(std::abs(wildcat::temperature_squared(1.0 / 8, 11, 11, 1024) - 4.259285737487) <= 1e-10);
  CHECK(std::abs(wildcat::temperature_squared(1.0 / 8, 10, 5, 4096) - 2.294123761685) <= 1e-10);
  CHECK(std::abs(wildcat::temperature_squared(1, 1, 1, 1024) - 6.407530175895) <= 1e-10);
  CHECK(std::abs(wildcat::temperature_squared(1.0 / 8, 20, 20, 128) - 4.117257931079) <= 1e-10);
  CHECK(std::abs(wildcat::temperature_squared(1.0 / 4, 2, 2, 1) - 4.078439693319) <= 1e-10);
  CHECK(wildcat::temperature_squared(0.5, 0, 3, 100) == 1.0);
  CHECK(wildcat::temperature_squared(0.5, 3, 0, 100) == 1.0);
  // Setting (a) at r = 8 (n = m = 512 here): mean max error with tau = 1 is several times that
  // with eq. (12) (measured here 1.9 vs 0.24).
  double e_temp = 0, e_one = 0;
  for (std::uint64_t seed = 0; seed < 3; ++seed) {
    const auto w = workloads::make<double>(workloads::Kind::Gaussian,
                                           workloads::Params::shape(512, 512, 64, 64, 100 + seed));
    const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
    WildcatOptions o;
    o.rank = 8;
    o.seed = seed;
    e_temp += max_abs_error(WildcatAttentiond(o)(w.Q, w.K, w.V), ref);
    o.temperature = false;
    e_one += max_abs_error(WildcatAttentiond(o)(w.Q, w.K, w.V), ref);
  }
  if (verbose())
    std::cout << "[wildcat] r=8 max err eq12 " << e_temp / 3 << " tau=1 " << e_one / 3 << "\n";
  CHECK(e_one >= 2 * e_temp);
}

TEST_CASE("Error decreases with rank (mean over seeds) on sphere, gaussian and clustered",
          "[wildcat]") {
  // Settings (b): sphere d = 16, beta R^2 = 1, (c): gaussian d = 8, and (f): the `clustered`
  // workload (16 centres, noise 0.1, d = 16); n = m = 1024, 5 seeds.
  const std::vector<Index> ranks = {8, 32, 128, 512};
  for (const int setting : {0, 1, 2}) {
    std::vector<double> fro(ranks.size(), 0), mx(ranks.size(), 0);
    for (std::uint64_t seed = 0; seed < 5; ++seed) {
      const Index d = setting == 1 ? 8 : 16;
      Matrix<double> Q, K, V;
      if (setting == 0) {
        Q = sphere(1024, d, 2.0, 300 + seed);  // R = d^(1/4) = 2: beta R^2 = 1
        K = sphere(1024, d, 2.0, 400 + seed);
      } else if (setting == 1) {
        Q = randn<double>(1024, d, 300 + seed);
        K = randn<double>(1024, d, 400 + seed);
      } else {
        auto w = workloads::make<double>(workloads::Kind::Clustered, 1024, d, 300 + seed);
        Q = std::move(w.Q);
        K = std::move(w.K);
      }
      V = randn<double>(1024, d, 500 + seed);
      const Matrix<double> ref = exact_of(Q, K, V);
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        WildcatOptions o;
        o.rank = ranks[i];
        o.seed = seed;
        const Matrix<double> out = WildcatAttentiond(o)(Q, K, V);
        fro[i] += rel_fro_error(out, ref) / 5;
        mx[i] += max_abs_error(out, ref) / 5;
      }
    }
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (verbose())
        std::cout << "[wildcat] setting " << setting << " r=" << ranks[i] << " relF " << fro[i]
                  << " max " << mx[i] << "\n";
      if (i > 0) CHECK(fro[i] < fro[i - 1]);
    }
    if (setting == 0) {
      // Accuracy targets with a ~4x margin: mean max error <= 2e-2 at r = 64 (measured at r = 32
      // here: 6e-3) and <= 3e-3 at r = 256 (measured at r = 128: 1.5e-3).
      CHECK(mx[1] <= 2e-2);
      CHECK(mx[2] <= 3e-3);
    }
  }
}

TEST_CASE("Invariances: key shift, (aQ, K/a), affine values, query permutation", "[wildcat]") {
  const Index n = 120, m = 200, d = 8;
  const Matrix<double> Q = randn<double>(n, d, 21), K = randn<double>(m, d, 22),
                       V = randn<double>(m, 6, 23);
  WildcatOptions o;
  o.rank = 24;
  o.bins = 2;
  o.fallback = wildcat::Fallback::Midpoint;
  const WildcatAttentiond f(o);
  const Matrix<double> base = f(Q, K, V);
  // (i) K + 1 c^T with |c| ~ 3 (measured 1e-15).
  RowVector<double> c = randn<double>(1, d, 24);
  c *= 3 / c.norm();
  CHECK(max_abs_error(f(Q, K.rowwise() + c, V), base) <= 1e-9);
  // (ii) (aQ, K/a): gamma, b0, rho invariant, tau^2 -> tau^2 / a^2 (measured 4e-15).
  for (const double a : {0.5, 3.0}) CHECK(max_abs_error(f(a * Q, K / a, V), base) <= 1e-9);
  // (iii) V -> a V + 1 c^T gives a Ohat + 1 c^T (Midpoint fallback is affine too; 2e-15).
  RowVector<double> cv = randn<double>(1, 6, 25);
  const Matrix<double> aff = f(Q, K, (-2.0 * V).rowwise() + cv);
  CHECK(max_abs_error(aff, (-2.0 * base).rowwise() + cv) <= 1e-10);
  // (iv) permuting the queries (R_Q unchanged) permutes the output rows (measured 0).
  Eigen::PermutationMatrix<Eigen::Dynamic> P(n);
  P.setIdentity();
  Rng rng = make_rng(26);
  for (Index i = n - 1; i > 0; --i)
    std::swap(P.indices()(i), P.indices()(uniform_index(rng, i + 1)));
  CHECK(max_abs_error(f(P * Q, K, V), P * base) <= 1e-14);
}

TEMPLATE_TEST_CASE("Determinism: threads, repeats, seeds", "[wildcat]", float, double) {
  const auto w = workloads::make<TestType>(workloads::Kind::Clustered,
                                           workloads::Params::shape(300, 700, 16, 8, 5));
  for (const Index bins : {Index(1), Index(5)}) {
    WildcatOptions o;
    o.rank = 60;
    o.bins = bins;
    const WildcatAttention<TestType> f(o);
    const auto r1 = with_threads(1, [&] { return f.compute(w.Q, w.K, w.V); });
    const auto r2 = with_threads(2, [&] { return f.compute(w.Q, w.K, w.V); });
    CHECK(bitwise_equal(r1.output, r2.output));
    CHECK(bitwise_equal(r1.output, f.compute(w.Q, w.K, w.V).output));
    CHECK(r1.pivots == r2.pivots);
    o.seed = 99;
    const auto r3 = WildcatAttention<TestType>(o).compute(w.Q, w.K, w.V);
    CHECK(r3.pivots != r1.pivots);
  }
}

TEMPLATE_TEST_CASE("The certified error bound holds on every input", "[wildcat]", float, double) {
  // Inputs where the bound is informative (small d and logits) and where it is not.
  int informative = 0, cases = 0;
  const double slack = is_float<TestType>() ? 1e-5 : 1e-12;  // round-off of the computed output
  for (const double R : {0.5, 0.7, 1.5, 3.0}) {
    for (const Index r : {Index(8), Index(24), Index(60)}) {
      for (const Index bins : {Index(1), Index(3)}) {
        const Index d = 4, m = 150;
        const Matrix<TestType> Q = sphere(40, d, R, 31).cast<TestType>();
        const Matrix<TestType> K =
            (sphere(m, d, R, 32).rowwise() + RowVector<double>::Constant(d, 0.4)).cast<TestType>();
        const Matrix<TestType> V = randn<TestType>(m, 3, 33);
        WildcatOptions o;
        o.rank = r;
        o.bins = bins;
        o.scale = 1.0;
        const auto res = WildcatAttention<TestType>(o).compute(Q, K, V);
        REQUIRE(res.info == Info::Success);
        const Matrix<double> ref = exact_of(Q, K, V, 1.0);
        const double range = (V.colwise().maxCoeff() - V.colwise().minCoeff()).maxCoeff();
        for (Index i = 0; i < Q.rows(); ++i) {
          const double e = max_abs_error(res.output.row(i), ref.row(i));
          CHECK(e <= res.row_error_bound(i) + slack);
          CHECK(e <= range + slack);  // the clip bound (Lemma 1's second term)
        }
        ++cases;
        if (res.error_bound < 0.1 * range) ++informative;
        if (verbose())
          std::cout << "[wildcat] R=" << R << " r=" << r << " B=" << bins
                    << " max err=" << max_abs_error(res.output, ref) << " bound=" << res.error_bound
                    << " range=" << range << "\n";
      }
    }
  }
  // The test must be able to fail: at small logit ranges (R <= 0.7) the bound is far below the
  // trivial clip bound (measured: 7 of the 12 cases with R <= 0.7; none for R >= 1.5, where
  // the e^{beta tau^2 R_Q^2} factor of Lemma 2 dominates).
  CHECK(informative >= 6);
  CHECK(cases == 24);
}

TEST_CASE("Lemma 2 holds for the computed coreset", "[wildcat]") {
  // ||A - Ahat||_{2,inf}^2 <= exp(beta tau^2 R_Q^2) ||H_tau - Hhat_tau||_op, with A, Ahat in the
  // centred frame; Ahat and the Nystrom residual are formed densely from the exposed weights.
  const Index m = 120, d = 3;
  const Matrix<double> Q = randn<double>(30, d, 41), K = randn<double>(m, d, 42);
  const Matrix<double> Kc = K.rowwise() - K.colwise().mean();
  for (const Index r : {Index(3), Index(6), Index(12)}) {
    WildcatOptions o;
    o.rank = r;
    const CompressedKV<double> ckv = compress_kv(Kc, Matrix<double>::Identity(m, m), 0.0, o);
    const double beta = 1 / std::sqrt(3.0), tau2 = ckv.blocks[0].tau2;
    const Matrix<double> W = weights_from_identity_cache(ckv);
    Matrix<double> Ks(r, d);
    for (Index j = 0; j < r; ++j) Ks.row(j) = Kc.row(ckv.pivots[static_cast<std::size_t>(j)]);
    const Matrix<double> A = (beta * Q * Kc.transpose()).array().exp().matrix();
    const Matrix<double> Ahat = (beta * Q * Ks.transpose()).array().exp().matrix() * W;
    const double lhs = (A - Ahat).rowwise().squaredNorm().maxCoeff();
    const Matrix<double> H = (beta / tau2 * Kc * Kc.transpose()).array().exp().matrix();
    const Matrix<double> Hks = (beta / tau2 * Ks * Kc.transpose()).array().exp().matrix();
    const Matrix<double> Hres = H - Hks.transpose() * W;
    const double op = Eigen::SelfAdjointEigenSolver<Matrix<double>>((Hres + Hres.transpose()) / 2)
                          .eigenvalues()
                          .cwiseAbs()
                          .maxCoeff();
    const double RQ = Q.rowwise().norm().maxCoeff();
    CHECK(lhs <= std::exp(beta * tau2 * RQ * RQ) * op * (1 + 1e-9));
    // The block's logged residual trace bounds ||Hres||_op (trace >= op for PSD residuals).
    CHECK(op <= std::exp(ckv.blocks[0].log_residual_trace) * (1 + 1e-9));
  }
}

TEMPLATE_TEST_CASE("Degenerate inputs: equal keys, zero keys, duplicated keys, huge logits",
                   "[wildcat]", float, double) {
  const double tol = is_float<TestType>() ? 1e-6 : 1e-12;
  const Matrix<TestType> Q = randn<TestType>(20, 6, 51), V = randn<TestType>(64, 4, 52);
  WildcatOptions o;
  o.rank = 32;
  // All keys equal: rank 1 after the early stop, exact (measured 2e-16 / 1e-7).
  {
    const Matrix<TestType> K = randn<TestType>(1, 6, 53).replicate(64, 1);
    const auto r = WildcatAttention<TestType>(o).compute(Q, K, V);
    CHECK(r.rank == 1);
    CHECK(vrel_err(r.output, exact_of(Q, K, V), V) <= tol);
    // K = 0: the output is mean(V).
    const auto z = WildcatAttention<TestType>(o).compute(Q, Matrix<TestType>::Zero(64, 6), V);
    const RowVector<double> mean = V.template cast<double>().colwise().mean();
    for (Index i = 0; i < Q.rows(); ++i) CHECK(max_abs_error(z.output.row(i), mean) <= tol);
  }
  // 8 distinct keys x 8 copies: 8 pivots and exact (measured 4e-16 / 2e-7).
  {
    const Matrix<TestType> K = randn<TestType>(8, 6, 54).replicate(8, 1);
    const auto r = WildcatAttention<TestType>(o).compute(Q, K, V);
    CHECK(r.rank == 8);
    CHECK(vrel_err(r.output, exact_of(Q, K, V), V) <= tol);
  }
  // Huge logits (Q, K ~ 10 N(0, 1), d = 16, beta = 1/4, m = 64): r = m is exact; no NaN/Inf
  // and the clip bound for any r (measured 3e-15 / 2e-7 at r = m).
  {
    const Matrix<TestType> Qh = randn<TestType>(30, 16, 55, 10.0),
                           Kh = randn<TestType>(64, 16, 56, 10.0);
    WildcatOptions h;
    h.scale = 0.25;
    h.rank = 64;
    const Matrix<double> ref = exact_of(Qh, Kh, V, 0.25);
    // float: logits of size ~400 carry absolute round-off ~400 * 6e-8 (measured error 3e-6).
    CHECK(vrel_err(WildcatAttention<TestType>(h)(Qh, Kh, V), ref, V) <=
          (is_float<TestType>() ? 1e-4 : 1e-10));
    for (const Index r : {Index(4), Index(16), Index(40)}) {
      h.rank = r;
      const auto res = WildcatAttention<TestType>(h).compute(Qh, Kh, V);
      CHECK(res.info == Info::Success);
      CHECK(res.output.allFinite());
      const double range = (V.colwise().maxCoeff() - V.colwise().minCoeff()).maxCoeff();
      CHECK(max_abs_error(res.output, ref) <= range * (1 + 1e-6));
    }
  }
}

TEST_CASE("Zero-weight padding rows do not change the weighted attention", "[wildcat]") {
  const Matrix<double> K = randn<double>(200, 8, 61), V = randn<double>(200, 5, 62),
                       Q = randn<double>(50, 8, 63);
  WildcatOptions o;
  o.rank = 20;
  CompressedKV<double> ckv = compress_kv(K, V, 0.0, o);
  const Matrix<double> base = weighted_attention(Q, ckv, o).output;
  const Index r = ckv.size();
  ckv.keys.conservativeResize(r + 3, Eigen::NoChange);
  ckv.keys.bottomRows(3) = randn<double>(3, 8, 64);
  ckv.values.conservativeResize(r + 3, Eigen::NoChange);
  ckv.values.bottomRows(3).setZero();
  ckv.weights.conservativeResize(r + 3);
  ckv.weights.tail(3).setZero();
  ckv.log_scale.conservativeResize(r + 3);
  ckv.log_scale.tail(3).setZero();
  ckv.tail_begin = r + 3;
  // The padding only adds zero terms; the row max may move (measured 4e-16).
  CHECK(max_abs_error(weighted_attention(Q, ckv, o).output, base) <= 1e-13);
}

TEMPLATE_TEST_CASE("Binning: bins = 1 and bins = B, remainder bins, B > m", "[wildcat]", float,
                   double) {
  const auto w = workloads::make<TestType>(workloads::Kind::Sphere,
                                           workloads::Params::shape(128, 1000, 16, 16, 7));
  const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
  for (const Index bins : {Index(1), Index(4), Index(7), Index(64)}) {
    WildcatOptions o;
    o.rank = 128;
    o.bins = bins;
    const auto r = WildcatAttention<TestType>(o).compute(w.Q, w.K, w.V);
    REQUIRE(r.info == Info::Success);
    const Index per = (128 + bins - 1) / bins;
    const Index rem = 1000 % bins;
    CHECK(r.bins == bins + (rem > 0 ? 1 : 0));
    CHECK(r.rank <= per * r.bins);
    // Contiguous bins: the pivots of bin b lie in its key range.
    for (const WildcatBlock& b : r.blocks)
      for (Index j = b.row_begin; j < b.row_begin + b.rows; ++j) {
        const Index p = r.pivots[static_cast<std::size_t>(j)];
        CHECK((p >= b.first_token && p < b.first_token + b.tokens));
      }
    // Valid approximations, worse with fewer pivots per bin (measured relF: B=1 0.023,
    // B=4 0.058, B=7 0.096, B=64 0.34 with 2 pivots per 15 keys); bounds ~1.5x above.
    const double e = rel_fro_error(r.output, ref);
    if (verbose()) std::cout << "[wildcat] bins=" << bins << " relF=" << e << "\n";
    CHECK(e <= (bins == 1 ? 0.035 : bins == 4 ? 0.09 : bins == 7 ? 0.15 : 0.5));
  }
  // Every bin on the exact path (per-bin budget >= bin size, remainder too): exact.
  WildcatOptions o;
  o.bins = 7;  // 7 bins of 142 keys + a remainder bin of 6 keys, 143 pivots per bin
  o.rank = 7 * 143;
  const auto r = WildcatAttention<TestType>(o).compute(w.Q, w.K, w.V);
  CHECK(r.rank == 1000);
  CHECK(vrel_err(r.output, ref, w.V) <= (is_float<TestType>() ? 1e-5 : 1e-12));
  // More bins than keys: one key per bin, exact.
  o.bins = 5000;
  o.rank = 5000;
  CHECK(vrel_err(WildcatAttention<TestType>(o)(w.Q, w.K, w.V), ref, w.V) <=
        (is_float<TestType>() ? 1e-5 : 1e-12));
}

TEST_CASE("Adaptive rank: rel_tol stops each bin at the requested residual trace", "[wildcat]") {
  const auto w = workloads::make<double>(workloads::Kind::Clustered,
                                         workloads::Params::shape(64, 800, 16, 8, 9));
  WildcatOptions o;
  o.rank = 400;
  o.bins = 2;
  o.rel_tol = 1e-3;
  const auto r = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
  CHECK(r.rank < 400);
  const double beta = 0.25;
  const Matrix<double> Kc = w.K.rowwise() - w.K.colwise().mean();
  for (const WildcatBlock& b : r.blocks) {
    // tr(H_tau) of the bin from the definition; the logged residual (which adds the round-off
    // allowance m_b * 100 eps * e^{max sq}) must be below rel_tol of it.
    const auto Kb = Kc.middleRows(b.first_token, b.tokens);
    const double tr = (beta / b.tau2 * Kb.rowwise().squaredNorm()).array().exp().sum();
    CHECK(std::exp(b.log_residual_trace) <= 1.001e-3 * tr);
  }
  o.rel_tol = 0;
  CHECK(WildcatAttentiond(o).compute(w.Q, w.K, w.V).rank == 400);
}

TEMPLATE_TEST_CASE("KV cache: compress once, attend, append exactly, re-compress", "[wildcat]",
                   float, double) {
  const Index m = 600, d = 16, dv = 8;
  const Matrix<TestType> K = randn<TestType>(m, d, 71), V = randn<TestType>(m, dv, 72),
                         Q = randn<TestType>(40, d, 73);
  WildcatOptions o;
  o.rank = 48;
  o.bins = 3;
  // compress_kv + weighted_attention with explicit R_Q equals the forward pass (not bitwise:
  // the cache adds kbar back). Measured 2e-15 (double), 2e-6 relative (float).
  const double RQ = Q.template cast<double>().rowwise().norm().maxCoeff();
  const CompressedKV<TestType> ckv = compress_kv(K, V, RQ, o);
  const auto fwd = WildcatAttention<TestType>(o).compute(Q, K, V);
  const auto wa = weighted_attention(Q, ckv, o);
  CHECK(ckv.pivots == fwd.pivots);
  CHECK(rel_fro_error(wa.output, fwd.output) <= (is_float<TestType>() ? 1e-4 : 1e-12));
  // Prefix compressed, rest appended exactly: equals the direct formula over concat(coreset,
  // tail with weight 1) evaluated here in long double, and vmin/vmax are the running extrema.
  CompressedKV<TestType> c2 = compress_kv(K.topRows(400), V.topRows(400), RQ, o);
  const Matrix<TestType> Vt = 5 * V.bottomRows(200);  // widens the value range
  c2.append(K.bottomRows(200), Vt);
  CHECK(c2.tokens == m);
  CHECK(c2.tail_size() == 200);
  Matrix<TestType> Vall(m, dv);
  Vall << V.topRows(400), Vt;
  CHECK(max_abs_error(c2.vmax, Vall.colwise().maxCoeff()) == 0);
  CHECK(max_abs_error(c2.vmin, Vall.colwise().minCoeff()) == 0);
  WildcatOptions noclip = o;
  noclip.clip = false;
  const auto wt = weighted_attention(Q, c2, noclip);
  const double beta = 0.25;
  Matrix<double> direct(Q.rows(), dv);
  for (Index i = 0; i < Q.rows(); ++i) {
    long double den = 0;
    std::vector<long double> num(static_cast<std::size_t>(dv), 0);
    for (Index s = 0; s < c2.size(); ++s) {
      long double z = 0;
      for (Index k = 0; k < d; ++k) z += static_cast<long double>(Q(i, k)) * c2.keys(s, k);
      const long double e = std::exp(beta * z + c2.log_scale(s));
      den += e * c2.weights(s);
      for (Index j = 0; j < dv; ++j) num[static_cast<std::size_t>(j)] += e * c2.values(s, j);
    }
    for (Index j = 0; j < dv; ++j)
      direct(i, j) = static_cast<double>(num[static_cast<std::size_t>(j)] / den);
  }
  CHECK(rel_fro_error(wt.output, direct) <= (is_float<TestType>() ? 1e-4 : 1e-12));
  // A cache kept exactly (rank >= prefix) plus an exact tail is exact attention.
  WildcatOptions big = o;
  big.rank = 1000;
  CompressedKV<TestType> c3 = compress_kv(K.topRows(400), V.topRows(400), 0.0, big);
  c3.append(K.bottomRows(200), V.bottomRows(200));
  const Matrix<double> ref = exact_of(Q, K, V);
  const double tol = is_float<TestType>() ? 1e-5 : 1e-12;
  CHECK(vrel_err(weighted_attention(Q, c3, big).output, ref, V) <= tol);
  // Re-compressing the tail with a budget >= its size keeps it exact; a small budget shrinks it.
  REQUIRE(recompress_tail(c3, 0.0, big));
  CHECK(c3.tail_size() == 0);
  CHECK(c3.size() == m);
  CHECK(vrel_err(weighted_attention(Q, c3, big).output, ref, V) <= tol);
  c3.append(K.bottomRows(100), V.bottomRows(100));
  WildcatOptions small = o;
  small.rank = 10;
  small.bins = 1;
  REQUIRE(recompress_tail(c3, 0.0, small));
  CHECK(c3.size() == m + 10);
  CHECK(c3.tokens == m + 100);
  const auto after = weighted_attention(Q, c3, small);
  CHECK(after.info == Info::Success);
  // blocks: 4 (400 keys in 3 bins + remainder) + 4 (tail of 200, same) + 1 (tail of 100)
  CHECK(after.blocks.size() == 9);
}

TEST_CASE("WildCat reports a failed compression as NaN", "[wildcat]") {
  // Regression for tests/fuzz/regressions/wildcat_failed_compression.bin (a 600 s fuzz_wildcat
  // run): when the compression breaks down, compute() returned NumericalIssue with an all-zero
  // output, finite and outside V's range. Such outputs are now NaN and operator() throws. The
  // fuzz input (a query of norm 1e19, rel_tol 1e-3) breaks RPCholesky only without FMA
  // (-march=native rounds its way through), so this test reaches the same path deterministically:
  // values of 1.7e308 overflow the Nystrom weights [W V | W 1] on every build.
  Rng rng = make_rng(5);
  const Matrix<double> Q = random_normal<double>(11, 7, rng), K = random_normal<double>(40, 7, rng);
  Matrix<double> V = random_normal<double>(40, 3, rng);
  V *= 1.7e308 / V.cwiseAbs().maxCoeff();
  WildcatOptions o;
  o.rank = 8;
  const auto r = WildcatAttention<double>(o).compute(Q, K, V);
  REQUIRE(r.info == Info::NumericalIssue);
  REQUIRE(r.output.rows() == 11);
  REQUIRE(r.output.cols() == 3);
  CHECK(r.output.array().isNaN().all());
  CHECK_THROWS_AS(WildcatAttention<double>(o)(Q, K, V), numerical_error);
  // A tenth of that range compresses fine and stays inside V's range (clipping).
  const Matrix<double> V2 = V * 0.1;
  const auto r2 = WildcatAttention<double>(o).compute(Q, K, V2);
  REQUIRE(r2.info == Info::Success);
  for (Index c = 0; c < 3; ++c) {
    CHECK(r2.output.col(c).maxCoeff() <= V2.col(c).maxCoeff());
    CHECK(r2.output.col(c).minCoeff() >= V2.col(c).minCoeff());
  }
}

TEST_CASE("Bad inputs and options throw", "[wildcat]") {
  const Matrix<double> Q = randn<double>(5, 4, 1), K = randn<double>(9, 4, 2),
                       V = randn<double>(9, 3, 3);
  auto with = [](auto set) {
    WildcatOptions o;
    set(o);
    return o;
  };
  // No causal form: the capability constant says so (there is no Options::causal to set).
  STATIC_REQUIRE(!functor_traits<WildcatAttentiond>::supports_causal);
  STATIC_REQUIRE(!functor_traits<WildcatAttentionf>::causal_only);
  CHECK_THROWS_AS(WildcatAttentiond(with(
                      [](WildcatOptions& o) { o.fallback = static_cast<wildcat::Fallback>(7); })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.rank = 0; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.bins = 0; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.rel_tol = 1; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.scale = -1; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.q_radius = NAN; })),
                  effattn::invalid_argument);
  const WildcatAttentiond f;
  Matrix<double> Qn = Q;
  Qn(2, 1) = NAN;
  CHECK_THROWS_AS(f(Qn, K, V), effattn::invalid_argument);
  CHECK_THROWS_AS(f(Q, K.leftCols(3), V), effattn::invalid_argument);
  CHECK_THROWS_AS(f(Q, K, V.topRows(8)), effattn::invalid_argument);
  CHECK_THROWS_AS(f(Q.topRows(0), K, V), effattn::invalid_argument);
  CHECK_THROWS_AS(compress_kv(K, V, -1.0), effattn::invalid_argument);
  const CompressedKV<double> ckv = compress_kv(K, V, 0.0);
  CHECK_THROWS_AS(weighted_attention(Q.leftCols(3), ckv), effattn::invalid_argument);
  CHECK_THROWS_AS(weighted_attention(Q, CompressedKV<double>()), effattn::invalid_argument);
  CompressedKV<double> c2 = ckv;
  CHECK_THROWS_AS(c2.append(K.leftCols(2), V), effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.target_error = -1e-3; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.target_error = NAN; })),
                  effattn::invalid_argument);
  CHECK_THROWS_AS(WildcatAttentiond(with([](WildcatOptions& o) { o.error_sample_rows = 0; })),
                  effattn::invalid_argument);
}

namespace {
EFFATTN_DEPRECATED_FIELDS_BEGIN
WildcatOptions with_old_block_size(Index b) {
  WildcatOptions o;
  o.block_size = b;
  return o;
}
EFFATTN_DEPRECATED_FIELDS_END
}  // namespace

TEST_CASE("WildcatOptions::block_size (deprecated) gives the output of proposal_block",
          "[wildcat][deprecated]") {
  const Matrix<float> Q = randn<float>(48, 8, 61), K = randn<float>(300, 8, 62),
                      V = randn<float>(300, 6, 63);
  WildcatOptions now;
  now.proposal_block = 6;
  now.rank = 40;
  const auto a = WildcatAttentionf(now).compute(Q, K, V);
  REQUIRE(a.info == Info::Success);
  WildcatOptions old = with_old_block_size(6);
  old.rank = 40;
  const WildcatAttentionf f(old);
  const auto b = f.compute(Q, K, V);
  CHECK(bitwise_equal(b.output, a.output));
  CHECK(b.pivots == a.pivots);
  CHECK(f.options().proposal_block == 6);
  // The free functions take the old spelling too.
  const CompressedKV<float> ca = compress_kv(K, V, 0.0, now), cb = compress_kv(K, V, 0.0, old);
  CHECK(cb.pivots == ca.pivots);
  CHECK(
      bitwise_equal(weighted_attention(Q, cb, old).output, weighted_attention(Q, ca, now).output));
  WildcatOptions clash = old;
  clash.proposal_block = 8;
  CHECK_THROWS_WITH(WildcatAttentionf(clash),
                    Catch::Contains("proposal_block = 8") && Catch::Contains("block_size = 6"));
  CHECK_THROWS_AS(compress_kv(K, V, 0.0, clash), effattn::invalid_argument);
}

TEST_CASE("target_error: the estimate tracks the exact error and the target is met or reported",
          "[wildcat]") {
  // Oracle: exact attention in double (Naive) on every query row. Needles is left out on
  // purpose: its error sits in the few needle rows, which 64 sampled rows mostly miss (measured:
  // estimate 2.4-2.9x below the true error there; documented at Options::target_error).
  for (const auto kind : {workloads::Kind::Sphere, workloads::Kind::Clustered,
                          workloads::Kind::Positional, workloads::Kind::Gaussian}) {
    const auto w = workloads::make<double>(kind, workloads::Params::shape(512, 1024, 32, 16, 5));
    const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
    for (const double target : {3e-2, 1e-2}) {
      for (const std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}}) {
        WildcatOptions o;
        o.rank = 512;
        o.target_error = target;
        o.seed = seed;
        const auto r = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
        REQUIRE(r.info == Info::Success);
        const double err = (r.output - ref).norm() / ref.norm();
        INFO(workloads::name(kind)
             << " target " << target << " seed " << seed << ": estimate " << r.estimated_error
             << ", exact error " << err << ", rank " << r.rank << ", rounds " << r.target_rounds);
        if (verbose())
          std::printf("%s target %g seed %lu: est %.4f err %.4f rank %ld rounds %ld\n",
                      workloads::name(kind), target, static_cast<unsigned long>(seed),
                      r.estimated_error, err, static_cast<long>(r.rank),
                      static_cast<long>(r.target_rounds));
        CHECK(r.target_rounds >= 1);
        CHECK(r.target_rounds <= 4);
        CHECK(r.rank <= 512);
        // A 64-row sample estimate of the relative Frobenius error: measured ratios exact /
        // estimate 0.91-1.12 on these workloads and seeds; 0.7-1.35 leaves room for the spread.
        CHECK(err <= 1.35 * r.estimated_error);
        CHECK(err >= 0.7 * r.estimated_error);
        // Met (as estimated) => met up to the estimate's spread; missed => the whole budget
        // was used (the result says so through estimated_error > target).
        if (r.estimated_error <= target)
          CHECK(err <= 1.35 * target);
        else
          CHECK(r.rank >= 500);
        const Diagnostics diag = r.diagnostics();
        REQUIRE(diag.size() == 8);
        CHECK(diag[5].name == std::string("estimated_error"));
        CHECK(diag[5].value == r.estimated_error);
        CHECK(diag[7].value == static_cast<double>(r.target_rounds));
      }
    }
  }
}

TEST_CASE("fit_temperature: the smallest Lemma 2 term among the candidates; wins on clustered",
          "[wildcat]") {
  const auto w = workloads::make<double>(workloads::Kind::Clustered,
                                         workloads::Params::shape(256, 1024, 16, 8, 4));
  const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
  const double beta = 0.25, rq = std::sqrt(w.Q.rowwise().squaredNorm().maxCoeff());
  double err12 = 0, errfit = 0;
  for (const std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}}) {
    WildcatOptions o;
    o.rank = 64;
    o.seed = seed;
    const auto r12 = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
    o.fit_temperature = true;
    const auto rfit = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
    REQUIRE(rfit.info == Info::Success);
    const WildcatBlock &b12 = r12.blocks[0], &bfit = rfit.blocks[0];
    // eq. (12) is one of the candidates (same seed, same factorisation): the kept one's term
    // beta tau^2 R_Q^2 + log tr(H_tau - Hhat_tau) is no larger.
    CHECK(beta * bfit.tau2 * rq * rq + bfit.log_residual_trace <=
          beta * b12.tau2 * rq * rq + b12.log_residual_trace + 1e-12);
    CHECK(max_abs_error(rfit.output, ref) <= rfit.error_bound * (1 + 1e-9));
    err12 += (r12.output - ref).norm() / ref.norm();
    errfit += (rfit.output - ref).norm() / ref.norm();
  }
  // Measured: mean relative error 0.035 (fitted, tau^2 = 1) against 0.089 (eq. 12).
  CHECK(errfit < 0.6 * err12);
}

TEST_CASE("target_error: a tighter target gives a lower error at a larger rank", "[wildcat]") {
  const auto w = workloads::make<double>(workloads::Kind::Sphere,
                                         workloads::Params::shape(512, 1024, 32, 16, 6));
  const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
  double err_loose = 0, err_tight = 0;
  for (const std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}}) {
    WildcatOptions o;
    o.rank = 600;
    o.seed = seed;
    o.target_error = 4e-2;
    const auto loose = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
    o.target_error = 8e-3;
    const auto tight = WildcatAttentiond(o).compute(w.Q, w.K, w.V);
    // Same seed: the tighter trace tolerance extends the looser run's pivot sequence.
    CHECK(tight.rank >= loose.rank);
    CHECK(tight.estimated_error <= loose.estimated_error);
    err_loose += (loose.output - ref).norm() / ref.norm();
    err_tight += (tight.output - ref).norm() / ref.norm();
  }
  CHECK(err_tight < 0.7 * err_loose);
  // Without a target nothing is estimated and the diagnostics keep their five entries.
  const auto plain = WildcatAttentiond().compute(w.Q, w.K, w.V);
  CHECK(plain.estimated_error == -1);
  CHECK(plain.target_rounds == 0);
  CHECK(plain.diagnostics().size() == 5);
}

TEST_CASE("RPNys residual expectations: mean(H - Hhat) below Phi^r(H)", "[wildcat][statistical]") {
  // The RPCholesky expectation bound (its valid forms): with Phi(A) = A - A^2 / tr(A),
  // E[H - Hhat_r] <= Phi^r(H) in the Loewner order, hence ||mean(H - Hhat)||_op <=
  // lambda_1(Phi^r(H)) and mean tr(H - Hhat) <= tr(Phi^r(H)). 400 runs, 10% slack. H is the
  // tempered key kernel of the (single) bin, Hhat = H(:, S) W from the exposed weights.
  const Index m = 60, d = 3;
  const Matrix<double> K = randn<double>(m, d, 81);
  const Matrix<double> Kc = K.rowwise() - K.colwise().mean();
  for (const Index r : {Index(3), Index(6)}) {
    WildcatOptions o;
    o.rank = r;
    o.q_radius = 0;
    Matrix<double> mean_res = Matrix<double>::Zero(m, m);
    double tau2 = 0;
    const int runs = 400;
    for (int run = 0; run < runs; ++run) {
      o.seed = static_cast<std::uint64_t>(run);
      const CompressedKV<double> ckv = compress_kv(Kc, Matrix<double>::Identity(m, m), 1.0, o);
      tau2 = ckv.blocks[0].tau2;  // depends on the keys only: the same in every run
      const double s = 1 / std::sqrt(3.0) / tau2;
      const Matrix<double> H = (s * Kc * Kc.transpose()).array().exp().matrix();
      const Matrix<double> W = weights_from_identity_cache(ckv);
      Matrix<double> HS(m, ckv.size());
      for (Index j = 0; j < ckv.size(); ++j)
        HS.col(j) = H.col(ckv.pivots[static_cast<std::size_t>(j)]);
      mean_res += (H - HS * W) / runs;
    }
    const double s = 1 / std::sqrt(3.0) / tau2;
    Matrix<double> phi = (s * Kc * Kc.transpose()).array().exp().matrix();
    for (Index i = 0; i < r; ++i) phi -= phi * phi / phi.trace();
    const Matrix<double> sym = (mean_res + mean_res.transpose()) / 2;
    const double lhs_op =
        Eigen::SelfAdjointEigenSolver<Matrix<double>>(sym).eigenvalues().cwiseAbs().maxCoeff();
    const double rhs_op =
        Eigen::SelfAdjointEigenSolver<Matrix<double>>(phi).eigenvalues().maxCoeff();
    if (verbose())
      std::cout << "[wildcat] r=" << r << " ||mean res||_op " << lhs_op << " lambda1(Phi^r) "
                << rhs_op << " mean tr " << mean_res.trace() << " tr(Phi^r) " << phi.trace()
                << "\n";
    CHECK(lhs_op <= 1.1 * rhs_op);
    CHECK(mean_res.trace() <= 1.1 * phi.trace());
  }
}

TEST_CASE("Q = 0: not exact at low rank, but within the certified bound; exact at r >= m",
          "[wildcat]") {
  const Matrix<double> Q = Matrix<double>::Zero(10, 4), K = randn<double>(80, 4, 91),
                       V = randn<double>(80, 3, 92);
  const Matrix<double> ref = exact_of(Q, K, V);  // = mean(V) in every row
  WildcatOptions o;
  o.rank = 10;
  const auto r = WildcatAttentiond(o).compute(Q, K, V);
  CHECK(max_abs_error(r.output, ref) <= r.error_bound + 1e-12);
  o.rank = 80;
  CHECK(max_abs_error(WildcatAttentiond(o)(Q, K, V), ref) <= 1e-12);
}

TEST_CASE("Clipping keeps every entry in the value range, also on adversarial values",
          "[wildcat]") {
  // V = indicator columns of single keys: the outputs are single attention probabilities, which
  // negative Nystrom weights push below 0 when unclipped (d = 8, m = 256, r = 4..16: 11-30
  // entries out of range measured), so the check below can fail.
  const Matrix<double> Q = randn<double>(100, 8, 55), K = randn<double>(256, 8, 56);
  const Matrix<double> V = Matrix<double>::Identity(256, 4);
  int outside_unclipped = 0;
  for (const Index r : {Index(4), Index(8), Index(16)}) {
    WildcatOptions o;
    o.rank = r;
    const Matrix<double> clipped = WildcatAttentiond(o)(Q, K, V);
    CHECK(clipped.minCoeff() >= 0.0);
    CHECK(clipped.maxCoeff() <= 1.0);
    o.clip = false;
    const Matrix<double> raw = WildcatAttentiond(o)(Q, K, V);
    outside_unclipped +=
        static_cast<int>((raw.array() < 0.0).count() + (raw.array() > 1.0).count());
    // Clipping only moves entries towards the true value (which lies in the range).
    const Matrix<double> ref = exact_of(Q, K, V);
    CHECK(((clipped - ref).cwiseAbs().array() <= (raw - ref).cwiseAbs().array() + 1e-15).all());
  }
  CHECK(outside_unclipped > 0);
}

TEST_CASE("The error bound equals its formula recomputed from dense matrices", "[wildcat]") {
  // Single bin, double: the residual trace from the dense H_tau - H_tau(:, S) W, R_K and tau^2,
  // then x_i and the row bound exactly as documented in WildcatResult::error_bound.
  const Index m = 150, d = 4;
  const Matrix<double> Q = sphere(40, d, 0.7, 31), K = sphere(m, d, 0.7, 32),
                       V = randn<double>(m, 3, 33);
  WildcatOptions o;
  o.rank = 24;
  o.scale = 1.0;
  const auto res = WildcatAttentiond(o).compute(Q, K, V);
  const double RQ = Q.rowwise().norm().maxCoeff();
  const CompressedKV<double> ckv = compress_kv(K, Matrix<double>::Identity(m, m), RQ, o);
  REQUIRE(ckv.pivots == res.pivots);
  const Matrix<double> Kc = K.rowwise() - K.colwise().mean();
  const double tau2 = ckv.blocks[0].tau2, RK = Kc.rowwise().norm().maxCoeff();
  const Matrix<double> H = (Kc * Kc.transpose() / tau2).array().exp().matrix();
  Matrix<double> HS(m, ckv.size());
  for (Index j = 0; j < ckv.size(); ++j) HS.col(j) = H.col(ckv.pivots[static_cast<std::size_t>(j)]);
  const double tr = (H - HS * weights_from_identity_cache(ckv)).trace();
  const double range = (V.colwise().maxCoeff() - V.colwise().minCoeff()).maxCoeff();
  const double vmax = V.cwiseAbs().maxCoeff();
  for (Index i = 0; i < Q.rows(); ++i) {
    const double q = Q.row(i).norm();
    const double x =
        std::sqrt(std::exp(tau2 * q * q) * tr) / (std::sqrt(double(m)) * std::exp(-q * RK));
    const double bound = std::min({x < 1 ? range * x / (1 - x) : 1e300, range, 3 * vmax * x});
    // Measured agreement 1e-9 relative (the logged trace adds m * 100 eps e^{max sq}).
    CHECK(std::abs(res.row_error_bound(i) - bound) <= 1e-6 * bound);
  }
}

TEST_CASE("bf16 coreset attention: bf16 error model against exact and the fp32 path",
          "[wildcat][bf16]") {
  // Shapes off every kernel multiple (n = 1000 queries: 7 full 128-query tiles and a 104-row
  // one; d = 40, dv = 24 pad to 64 / 32 columns; r = 200 keys pad to 224).
  const auto w = workloads::make<float>(workloads::Kind::Sphere,
                                        workloads::Params::shape(1000, 1200, 40, 24, 5));
  const Matrix<double> ref = exact_of(w.Q, w.K, w.V);
  WildcatOptions o;
  o.rank = 200;
  WildcatOptions ob = o;
  ob.bf16_attention = true;
  const auto fp = WildcatAttentionf(o).compute(w.Q, w.K, w.V);
  const auto bf = WildcatAttentionf(ob).compute(w.Q, w.K, w.V);
  CHECK_FALSE(fp.bf16);
  REQUIRE(bf.bf16);
  REQUIRE(bf.info == Info::Success);
  CHECK(bf.pivots == fp.pivots);  // the selection does not see the option
  bool listed = false;
  for (const auto& [name, value] : bf.diagnostics())
    listed = listed || (std::string_view(name) == "bf16" && value == 1);
  CHECK(listed);
  // bf16 keeps 8 significand bits: S and P V each carry ~2^-9 relative rounding per entry, the
  // same error model as TiledBf16 (measured ~3e-3 relative Frobenius there). Measured here: bf16
  // vs fp32 path 2.1e-3 (WildCat 0.0165 vs 0.0163 against exact), so 1e-2 catches a wrong
  // tile, padding or denominator.
  const double e_fp = rel_fro_error(fp.output, ref), e_bf = rel_fro_error(bf.output, ref);
  CHECK(rel_fro_error(bf.output, fp.output.cast<double>()) <= 1e-2);
  CHECK(e_bf <= e_fp + 1e-2);
  CHECK(e_bf < 0.5 * rel_fro_error(Matrix<double>::Zero(ref.rows(), ref.cols()), ref));
  // rank >= m keeps every key with weight 1: exact attention with bf16 products.
  WildcatOptions all = ob;
  all.rank = 2000;
  const auto ex = WildcatAttentionf(all).compute(w.Q, w.K, w.V);
  CHECK(ex.bf16);
  CHECK(rel_fro_error(ex.output, ref) <= 1e-2);
  CHECK(rel_fro_error(ex.output, ref) > 0);  // the products really were rounded
  // The portable path multiplies the same bf16 values: it differs from the AVX512-BF16 one only
  // in the fp32 summation order (and is the same code when the CPU has no AVX512-BF16).
  const double RQ = w.Q.cast<double>().rowwise().norm().maxCoeff();
  const CompressedKV<float> ckv = compress_kv(w.K, w.V, RQ, o);
  WildcatResult<float> gen, nat;
  detail::wildcat_attend<float>(w.Q, ckv, 1 / std::sqrt(40.0), ob, gen, detail::Isa::Generic);
  detail::wildcat_attend<float>(w.Q, ckv, 1 / std::sqrt(40.0), ob, nat);
  REQUIRE(gen.bf16);
  CHECK(rel_fro_error(gen.output, nat.output.cast<double>()) <= 1e-5);
  CHECK(rel_fro_error(nat.output, fp.output.cast<double>()) <= 1e-2);
  // Error bound, fallback and clipping are the fp32 path's (the bound is computed in double).
  CHECK(nat.row_error_bound.size() == 1000);
  CHECK(nat.fallback_rows == fp.fallback_rows);
}

TEST_CASE("bf16 coreset attention: KV cache with an exact tail, fallback rows, double ignores it",
          "[wildcat][bf16]") {
  const Index m = 600, d = 16, dv = 8;
  const Matrix<float> K = randn<float>(m, d, 81), V = randn<float>(m, dv, 82),
                      Q = randn<float>(70, d, 83);
  WildcatOptions o;
  o.rank = 48;
  o.bins = 3;
  o.fallback = wildcat::Fallback::Midpoint;
  WildcatOptions ob = o;
  ob.bf16_attention = true;
  CompressedKV<float> c = compress_kv(K.topRows(400), V.topRows(400), 0.0, o);
  c.append(K.bottomRows(200), V.bottomRows(200));
  const auto fp = weighted_attention(Q, c, o);
  const auto bf = weighted_attention(Q, c, ob);
  REQUIRE(bf.bf16);
  CHECK(rel_fro_error(bf.output, fp.output.cast<double>()) <= 1e-2);  // measured 3.9e-3
  CHECK(bf.fallback_rows == fp.fallback_rows);
  // The tail enters the bound through its smallest logit, which bf16 rounds: bounds agree to the
  // rounding of a logit (relative 2^-8 of |logit|, exponentiated).
  CHECK(max_abs_error(bf.row_error_bound, fp.row_error_bound) <=
        0.05 * fp.row_error_bound.cwiseAbs().maxCoeff() + 1e-12);
  // A single failed row (denominator forced negative by a huge negative weight) gets the
  // midpoint on both paths.
  CompressedKV<float> bad = c;
  bad.weights(0) = -1e30f;
  bad.values.row(0).setZero();
  const auto fb = weighted_attention(Q, bad, ob);
  const auto ff = weighted_attention(Q, bad, o);
  CHECK(ff.fallback_rows > 0);
  CHECK(fb.fallback_rows == ff.fallback_rows);
  if (ff.fallback_rows == Q.rows()) CHECK(max_abs_error(fb.output, ff.output) == 0);
  // double: the option is ignored (bf16 products are a float feature).
  const Matrix<double> Kd = K.cast<double>(), Vd = V.cast<double>(), Qd = Q.cast<double>();
  const auto dres = WildcatAttentiond(ob).compute(Qd, Kd, Vd);
  CHECK_FALSE(dres.bf16);
  CHECK(max_abs_error(dres.output, WildcatAttentiond(o).compute(Qd, Kd, Vd).output) == 0);
}
