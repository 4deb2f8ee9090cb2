// Tests of numerics/rp_cholesky.hpp and numerics/nystrom.hpp against independent dense oracles
// written here (dense kernels, a textbook partial Cholesky with a given pivot order, a dense greedy
// pivoted Cholesky, dense solves and the exact pivot probabilities of RPCholesky). Statistical
// tests use fixed seeds and chi-square bounds at significance 1e-4 (explained in place).
#include "test_utils.hpp"

#include <effattn/core/random.hpp>
#include <effattn/numerics/nystrom.hpp>
#include <effattn/numerics/rp_cholesky.hpp>

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <Eigen/LU>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

using effattn::Index;
using effattn::Matrix;
using effattn::RowMajorMatrix;
using effattn::Vector;
namespace et = effattn::testing;
namespace policy = effattn::policy;

namespace {

using MatD = Matrix<double>;

// ---- Dense oracles -------------------------------------------------------------------------

/// H = exp(s X X^T), entry by entry in long double.
template <typename S>
MatD dense_exp_dot(const Matrix<S>& X, double s) {
  const Index m = X.rows();
  MatD H(m, m);
  for (Index i = 0; i < m; ++i)
    for (Index j = 0; j < m; ++j) {
      long double dot = 0;
      for (Index c = 0; c < X.cols(); ++c)
        dot += static_cast<long double>(X(i, c)) * static_cast<long double>(X(j, c));
      H(i, j) = static_cast<double>(std::exp(static_cast<long double>(s) * dot));
    }
  return H;
}

/// K = exp(-||x_i - x_j||^2 / (2 sigma^2)), entry by entry in long double.
template <typename S>
MatD dense_rbf(const Matrix<S>& X, double sigma) {
  const Index m = X.rows();
  MatD K(m, m);
  for (Index i = 0; i < m; ++i)
    for (Index j = 0; j < m; ++j) {
      long double d2 = 0;
      for (Index c = 0; c < X.cols(); ++c) {
        const long double t = static_cast<long double>(X(i, c)) - static_cast<long double>(X(j, c));
        d2 += t * t;
      }
      K(i, j) = static_cast<double>(std::exp(-d2 / (2.0L * sigma * sigma)));
    }
  return K;
}

/// A kernel over an explicit dense PSD matrix: the minimal Kernel concept (no sampling weights,
/// no principal_submatrix, so the accelerated rule uses its row-based fallback).
struct DenseKernel {
  using Scalar = double;
  MatD H;
  Index size() const { return H.rows(); }
  void diagonal(Eigen::Ref<Vector<double>> out) const { out = H.diagonal(); }
  void rows(const std::vector<Index>& idx, effattn::RowsRef<double> out) const {
    for (std::size_t j = 0; j < idx.size(); ++j) out.row(static_cast<Index>(j)) = H.row(idx[j]);
  }
};

/// Textbook partial Cholesky of dense H with the given pivot order (k x m factor).
MatD dense_partial_cholesky(const MatD& H, const std::vector<Index>& piv) {
  const auto k = static_cast<Index>(piv.size());
  MatD F = MatD::Zero(k, H.rows());
  for (Index i = 0; i < k; ++i) {
    const Index s = piv[static_cast<std::size_t>(i)];
    Vector<double> row = H.row(s).transpose();
    for (Index t = 0; t < i; ++t) row -= F(t, s) * F.row(t).transpose();
    F.row(i) = row.transpose() / std::sqrt(row(s));
  }
  return F;
}

/// Dense greedy pivoted Cholesky: argmax of the Schur-complement diagonal (first on ties).
std::vector<Index> dense_greedy_pivots(MatD R, Index k) {
  std::vector<Index> piv;
  for (Index i = 0; i < k; ++i) {
    Index s = 0;
    R.diagonal().maxCoeff(&s);
    piv.push_back(s);
    const Vector<double> c = R.col(s) / std::sqrt(R(s, s));
    R -= c * c.transpose();
  }
  return piv;
}

/// Wilson-Hilferty upper quantile of chi-square(dof) at the standard-normal quantile z
/// (z = 3.719 <-> significance 1e-4). Accurate to < 1% for dof >= 5, which is all we need.
double chi2_quantile(int dof, double z) {
  const double k = dof, t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

double chi2_stat(const std::vector<double>& counts, const std::vector<double>& probs, double n) {
  double x2 = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const double e = n * probs[i];
    x2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  return x2;
}

/// Exact law of the first two pivots of RPCholesky on H (weights folded into H):
/// P(a, b) = H_aa / tr H * R_bb / tr R with R = H - H(:, a) H(a, :) / H_aa. Index a * m + b.
std::vector<double> exact_pair_law(const MatD& H) {
  const Index m = H.rows();
  std::vector<double> p(static_cast<std::size_t>(m * m), 0.0);
  for (Index a = 0; a < m; ++a) {
    const MatD R = H - H.col(a) * H.row(a) / H(a, a);
    Vector<double> rd = R.diagonal().cwiseMax(0.0);
    rd(a) = 0;
    for (Index b = 0; b < m; ++b)
      p[static_cast<std::size_t>(a * m + b)] = H(a, a) / H.trace() * rd(b) / rd.sum();
  }
  return p;
}

template <typename Rule, typename Kernel>
effattn::RpCholeskyResult<typename Kernel::Scalar> run(const Kernel& k, Index rank,
                                                       std::uint64_t seed = 7, double rel_tol = 0,
                                                       Index block = 0) {
  effattn::RpCholeskyOptions o;
  o.rank = rank;
  o.seed = seed;
  o.rel_tol = rel_tol;
  o.proposal_block = block;
  return effattn::rp_cholesky<Rule>(k, o);
}

template <typename S>
MatD to_dense(const RowMajorMatrix<S>& F) {
  return F.template cast<double>();
}

/// max_i |trace_i * scale - tr(H - F_i^T F_i)| / tr H over every prefix F_i of F.
double max_trace_mismatch(const MatD& H, const MatD& F, const std::vector<double>& trace,
                          double scale) {
  double worst = 0;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const MatD Fi = F.topRows(static_cast<Index>(i));
    const double dense = H.trace() - Fi.squaredNorm();
    worst = std::max(worst, std::abs(trace[i] * scale - dense) / H.trace());
  }
  return worst;
}

bool non_increasing(const std::vector<double>& v) {
  for (std::size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[i - 1]) return false;
  return true;
}

/// "1.234e-15": Catch prints doubles in fixed notation, useless for tolerances.
std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}

template <typename F>
void require_invalid(F&& f) {
  REQUIRE_THROWS_AS(f(), effattn::invalid_argument);
}

}  // namespace

// ---- RPCholesky -----------------------------------------------------------------------------

TEST_CASE("RPCholesky with r = m reproduces the kernel; traces match dense at every step",
          "[core][rp_cholesky]") {
  // 12 well-separated points (scale 2, d = 3): the kernels are well conditioned, so the full
  // factorisation is accurate to round-off (measured: worst 7.6e-15 relative Frobenius error,
  // trace mismatch <= 7.7e-15 of tr H).
  effattn::Rng rng = effattn::make_rng(11);
  const MatD X = 2.0 * effattn::random_normal<double>(12, 3, rng);
  const MatD Hexp = dense_exp_dot(X, 0.5), Hrbf = dense_rbf(X, 1.0);
  const effattn::ExpDotKernel<double> kexp(X, 0.5);
  const effattn::GaussianKernel<double> krbf(X, 1.0);
  // A generic SPD matrix through the minimal Kernel concept (row-based fallback paths).
  const MatD B = effattn::random_normal<double>(12, 12, rng);
  const MatD Hspd = B * B.transpose() + 0.5 * MatD::Identity(12, 12);
  const DenseKernel kdense{Hspd};

  auto check = [&](const auto& result, const MatD& H, const MatD& F, double scale) {
    CAPTURE(result.rank());
    REQUIRE(result.info == effattn::Info::Success);
    REQUIRE(result.rank() == 12);
    REQUIRE(result.stop == effattn::RpStopReason::RankReached);
    const double err = et::rel_fro_error(F.transpose() * F, H);
    const double mismatch = max_trace_mismatch(H, F, result.residual_trace, scale);
    CAPTURE(sci(err), sci(mismatch));
    CHECK(err <= 1e-10);
    CHECK(non_increasing(result.residual_trace));
    CHECK(mismatch <= 1e-10);
    std::set<Index> distinct(result.pivots.begin(), result.pivots.end());
    CHECK(distinct.size() == result.pivots.size());
  };
  auto all_rules = [&](auto rule) {
    using Rule = decltype(rule);
    const auto re = run<Rule>(kexp, 12);
    check(re, Hexp, to_dense(kexp.original_factor(re.factor)), std::exp(kexp.log_trace_scale()));
    const auto rr = run<Rule>(krbf, 12);
    check(rr, Hrbf, to_dense(rr.factor), 1.0);
    const auto rd = run<Rule>(kdense, 12);
    check(rd, Hspd, to_dense(rd.factor), 1.0);
  };
  SECTION("sequential") {
    all_rules(policy::RandomlyPivoted{});
  }
  SECTION("accelerated") {
    all_rules(policy::AcceleratedRandomlyPivoted{});
  }
  SECTION("greedy") {
    all_rules(policy::GreedyPivoted{});
  }
}

TEST_CASE("Accelerated RPCholesky: factor equals the dense partial Cholesky of its pivots",
          "[core][rp_cholesky]") {
  // Several blocks (m = 400, r = 120, block sizes auto / 7 / 64): every block update must give
  // the textbook factor for the chosen pivot order, exact zeros at earlier pivots, and traces
  // equal to tr(H - F_i^T F_i) at every i (measured: factor 1.2e-15 relative, trace mismatch
  // 1.1e-15 of tr H).
  effattn::Rng rng = effattn::make_rng(5);
  const MatD X = effattn::random_normal<double>(400, 5, rng);
  const double s = 1.0 / std::sqrt(5.0);
  const effattn::ExpDotKernel<double> k(X, s);
  const MatD H = dense_exp_dot(X, s);
  for (Index block : {Index(0), Index(7), Index(64)}) {
    CAPTURE(block);
    const auto r = run<policy::AcceleratedRandomlyPivoted>(k, 120, 3, 0, block);
    REQUIRE(r.rank() == 120);
    CHECK(r.blocks > 1);
    const MatD F = to_dense(k.original_factor(r.factor));
    const MatD Fref = dense_partial_cholesky(H, r.pivots);
    const double ef = et::rel_fro_error(F, Fref);
    const double mismatch =
        max_trace_mismatch(H, F, r.residual_trace, std::exp(k.log_trace_scale()));
    CAPTURE(sci(ef), sci(mismatch), r.blocks, r.proposals);
    CHECK(ef <= 1e-10);
    for (Index i = 0; i < r.rank(); ++i)
      for (Index j = 0; j < i; ++j)
        REQUIRE(r.factor(i, r.pivots[static_cast<std::size_t>(j)]) == 0);
    CHECK(non_increasing(r.residual_trace));
    CHECK(mismatch <= 1e-10);
    const MatD resid = (H - F.transpose() * F).diagonal().transpose();
    const MatD got = (r.residual_diagonal.array() * (2.0 * k.half_sq_norms().array()).exp())
                         .matrix()
                         .transpose();
    CHECK(et::max_abs_error(got, resid) <= 1e-10 * H.diagonal().maxCoeff());
  }
}

TEST_CASE("Pivot laws: sequential and accelerated match the exact RPCholesky distribution",
          "[core][rp_cholesky]") {
  // Exact law: P(s1 = a) = H_aa / tr H and P(s2 = b | s1 = a) = R_bb / tr R, R the Schur
  // complement after a (computed densely). N = 20000 independent seeds per variant; the ordered
  // pair (s1, s2) falls in m (m - 1) = 30 cells, all with expected count >= 50 (min 64 and 83),
  // so Pearson's X^2 is chi-square(29) to good accuracy under the null (and the first pivot's 6
  // cells chi-square(5)). Bound: the 1 - 1e-4 quantile (Wilson-Hilferty: 66.4 for 29 dof, 26.3
  // for 5); with fixed seeds the test is deterministic, and a correct sampler would fail it for
  // about 1 in 10^4 seed choices (measured X^2: 20-34 for the pairs, 1.4-4.5 for the first pivot).
  // A sampler that ignores rejection (accepts every candidate) draws s2 from the first-pivot law
  // and gives X^2 in the thousands here.
  effattn::Rng rng = effattn::make_rng(99);
  const MatD B = effattn::random_normal<double>(6, 3, rng);
  MatD Hd = B * B.transpose();
  Hd.diagonal().array() += Vector<double>::LinSpaced(6, 0.3, 1.8).array();
  // Exp-dot kernel on 6 points of a spiral (radii 0.8 ... 1.55): first-pivot probabilities
  // from 0.06 to 0.36, every ordered pair >= 3e-3 (expected count >= 64).
  MatD Xe(6, 2);
  for (Index l = 0; l < 6; ++l) {
    const double th = 2.0 * 3.14159265358979323846 * static_cast<double>(l) / 6.0;
    const double rad = 0.8 + 0.15 * static_cast<double>(l);
    Xe(l, 0) = rad * std::cos(th), Xe(l, 1) = rad * std::sin(th);
  }

  struct Case {
    std::string name;
    bool dense;  // DenseKernel of H; else the exp-dot kernel of Xe (whose dense form H is)
    MatD H;
  };
  const std::vector<Case> cases = {{"dense kernel", true, Hd},
                                   {"exp-dot kernel", false, dense_exp_dot(Xe, 1.0)}};
  const int N = 20000;
  const double bound29 = chi2_quantile(29, 3.719), bound5 = chi2_quantile(5, 3.719);
  for (const Case& c : cases) {
    const std::vector<double> law = exact_pair_law(c.H);
    std::vector<double> first(6);
    for (Index a = 0; a < 6; ++a) first[static_cast<std::size_t>(a)] = c.H(a, a) / c.H.trace();
    REQUIRE(*std::min_element(first.begin(), first.end()) * N >= 50);
    auto test_rule = [&](auto rule, Index block) {
      using Rule = decltype(rule);
      std::vector<double> pairs(36, 0.0), firsts(6, 0.0);
      for (int t = 0; t < N; ++t) {
        const auto seed = static_cast<std::uint64_t>(1000 + t);
        Index s1 = 0, s2 = 0;
        if (c.dense) {
          const auto r = run<Rule>(DenseKernel{c.H}, 2, seed, 0, block);
          s1 = r.pivots[0], s2 = r.pivots[1];
        } else {
          const auto r = run<Rule>(effattn::ExpDotKernel<double>(Xe, 1.0), 2, seed, 0, block);
          s1 = r.pivots[0], s2 = r.pivots[1];
        }
        pairs[static_cast<std::size_t>(s1 * 6 + s2)] += 1;
        firsts[static_cast<std::size_t>(s1)] += 1;
      }
      std::vector<double> pc, pp;  // drop the impossible diagonal cells (s2 == s1)
      for (std::size_t i = 0; i < 36; ++i)
        if (i % 7 != 0) pc.push_back(pairs[i]), pp.push_back(law[i]);
      REQUIRE(pc.size() == 30);
      for (std::size_t i = 0; i < 36; i += 7) CHECK(pairs[i] == 0);
      CHECK(*std::min_element(pp.begin(), pp.end()) * N >= 50);
      const double x2_pair = chi2_stat(pc, pp, N), x2_first = chi2_stat(firsts, first, N);
      CAPTURE(c.name, block, x2_pair, bound29, x2_first, bound5);
      CHECK(x2_pair >= 0);  // (always true: makes -s print the statistics)
      CHECK(x2_pair <= bound29);
      CHECK(x2_first <= bound5);
    };
    test_rule(policy::RandomlyPivoted{}, 0);
    test_rule(policy::AcceleratedRandomlyPivoted{}, 0);   // one block of 6 proposals
    test_rule(policy::AcceleratedRandomlyPivoted{}, 2);   // pivots from one or two blocks
    test_rule(policy::AcceleratedRandomlyPivoted{}, 16);  // many duplicate proposals
  }
}

TEST_CASE("Greedy pivoting matches a dense pivoted Cholesky", "[core][rp_cholesky]") {
  effattn::Rng rng = effattn::make_rng(21);
  const MatD X = effattn::random_normal<double>(40, 3, rng);
  const effattn::ExpDotKernel<double> kexp(X, 0.6);
  const effattn::GaussianKernel<double> krbf(X, 0.8);
  const MatD Hexp = dense_exp_dot(X, 0.6), Hrbf = dense_rbf(X, 0.8);
  const auto a = run<policy::GreedyPivoted>(kexp, 15);
  CHECK(a.pivots == dense_greedy_pivots(Hexp, 15));
  const auto b = run<policy::GreedyPivoted>(krbf, 15);
  CHECK(b.pivots == dense_greedy_pivots(Hrbf, 15));
  const auto c = run<policy::GreedyPivoted>(DenseKernel{Hexp}, 15);
  CHECK(c.pivots == dense_greedy_pivots(Hexp, 15));
  // The seed is irrelevant to the greedy rule.
  CHECK(run<policy::GreedyPivoted>(kexp, 15, 12345).pivots == a.pivots);
}

namespace {
template <typename In, typename Sel, typename Rule>
void check_duplicates(const Matrix<In>& X, double tol_rec) {
  const double s = 0.5, sigma = 1.5;
  const effattn::ExpDotKernel<In, Sel> kexp(X, s);
  const effattn::GaussianKernel<In, Sel> krbf(X, sigma);
  const auto re = run<Rule>(kexp, 32);
  const auto rr = run<Rule>(krbf, 32);
  for (const auto* r : {&re, &rr}) {
    REQUIRE(r->info == effattn::Info::Success);
    CHECK(r->rank() == 8);
    CHECK(r->stop == effattn::RpStopReason::Exhausted);
    CHECK(r->residual_trace.back() == 0);
    std::set<Index> groups;
    for (Index p : r->pivots) groups.insert(p % 8);
    CHECK(groups.size() == 8);  // one pivot per distinct key
  }
  const double ee = et::rel_fro_error(to_dense(kexp.original_factor(re.factor)).transpose() *
                                          to_dense(kexp.original_factor(re.factor)),
                                      dense_exp_dot(X, s));
  const double er =
      et::rel_fro_error(to_dense(rr.factor).transpose() * to_dense(rr.factor), dense_rbf(X, sigma));
  CAPTURE(sci(ee), sci(er));
  CHECK(ee <= tol_rec);
  CHECK(er <= tol_rec);
}
}  // namespace

TEST_CASE("8 distinct keys repeated 8 times: exactly 8 pivots and exact reconstruction",
          "[core][rp_cholesky]") {
  // Key l is distinct key l % 8 (d = 4, N(0, 1)). Without the round-off threshold the run would
  // continue on pure round-off residuals (reconstruction error 0.49). Measured reconstruction
  // error: <= 1.1e-15 with double selection (float or double input), <= 5.9e-8 with float
  // selection.
  effattn::Rng rng = effattn::make_rng(8);
  const MatD distinct = effattn::random_normal<double>(8, 4, rng);
  MatD X(64, 4);
  for (Index l = 0; l < 64; ++l) X.row(l) = distinct.row(l % 8);
  const Matrix<float> Xf = X.cast<float>();
  SECTION("sequential") {
    check_duplicates<double, double, policy::RandomlyPivoted>(X, 1e-12);
    check_duplicates<float, double, policy::RandomlyPivoted>(Xf, 1e-12);
    check_duplicates<float, float, policy::RandomlyPivoted>(Xf, 1e-5);
  }
  SECTION("accelerated") {
    check_duplicates<double, double, policy::AcceleratedRandomlyPivoted>(X, 1e-12);
    check_duplicates<float, double, policy::AcceleratedRandomlyPivoted>(Xf, 1e-12);
    check_duplicates<float, float, policy::AcceleratedRandomlyPivoted>(Xf, 1e-5);
  }
  SECTION("greedy") {
    check_duplicates<double, double, policy::GreedyPivoted>(X, 1e-12);
    check_duplicates<float, double, policy::GreedyPivoted>(Xf, 1e-12);
    check_duplicates<float, float, policy::GreedyPivoted>(Xf, 1e-5);
  }
}

TEST_CASE("RPCholesky is reproducible for a fixed seed and varies with the seed",
          "[core][rp_cholesky]") {
  effattn::Rng rng = effattn::make_rng(4);
  const Matrix<float> X = effattn::random_normal<float>(500, 8, rng);
  const effattn::ExpDotKernel<float> k(X, 1.0 / std::sqrt(8.0));
  auto check = [&](auto rule) {
    using Rule = decltype(rule);
    const auto a = run<Rule>(k, 40, 17), b = run<Rule>(k, 40, 17), c = run<Rule>(k, 40, 18);
    CHECK(a.pivots == b.pivots);
    CHECK(et::bitwise_equal(a.factor, b.factor));
    CHECK(et::bitwise_equal(a.residual_diagonal, b.residual_diagonal));
    CHECK(a.residual_trace == b.residual_trace);
    CHECK(a.pivots != c.pivots);
  };
  check(policy::RandomlyPivoted{});
  check(policy::AcceleratedRandomlyPivoted{});
  // The accelerated block update runs its column tiles in parallel: 1 and 2 threads must give
  // identical bits (m = 8192: 32 tiles of 256 columns).
  const Matrix<float> X2 = effattn::random_normal<float>(8192, 8, rng);
  const effattn::ExpDotKernel<float> k2(X2, 1.0 / std::sqrt(8.0));
  const auto t1 =
      et::with_threads(1, [&] { return run<policy::AcceleratedRandomlyPivoted>(k2, 96); });
  const auto t2 =
      et::with_threads(2, [&] { return run<policy::AcceleratedRandomlyPivoted>(k2, 96); });
  CHECK(t1.pivots == t2.pivots);
  CHECK(et::bitwise_equal(t1.factor, t2.factor));
}

namespace {
EFFATTN_DEPRECATED_FIELDS_BEGIN
effattn::RpCholeskyOptions with_old_block_size(Index b) {
  effattn::RpCholeskyOptions o;
  o.block_size = b;
  return o;
}
EFFATTN_DEPRECATED_FIELDS_END
}  // namespace

TEST_CASE("RpCholeskyOptions::block_size (deprecated) gives the factor of proposal_block",
          "[core][rp_cholesky][deprecated]") {
  effattn::Rng rng = effattn::make_rng(5);
  const Matrix<float> X = effattn::random_normal<float>(400, 8, rng);
  const effattn::ExpDotKernel<float> k(X, 1.0 / std::sqrt(8.0));
  using Rule = policy::AcceleratedRandomlyPivoted;
  const auto a = run<Rule>(k, 40, 17, 0, 5);
  effattn::RpCholeskyOptions old = with_old_block_size(5);
  old.rank = 40;
  old.seed = 17;
  const auto b = effattn::rp_cholesky<Rule>(k, old);
  CHECK(a.pivots == b.pivots);
  CHECK(et::bitwise_equal(a.factor, b.factor));
  CHECK(a.residual_trace == b.residual_trace);
  CHECK(effattn::RpCholesky<Rule>(old).options().proposal_block == 5);
  effattn::RpCholeskyOptions clash = old;
  clash.proposal_block = 4;
  CHECK_THROWS_WITH(effattn::RpCholesky<Rule>(clash),
                    Catch::Contains("proposal_block = 4") && Catch::Contains("block_size = 5"));
}

TEST_CASE("rel_tol stops at the first pivot that brings the trace below rel_tol * trace",
          "[core][rp_cholesky]") {
  effattn::Rng rng = effattn::make_rng(12);
  const MatD X = effattn::random_normal<double>(300, 2, rng);
  const effattn::GaussianKernel<double> k(X, 1.0);  // smooth kernel: fast trace decay
  const double rel_tol = 1e-3;
  auto check = [&](auto rule) {
    using Rule = decltype(rule);
    const auto r = run<Rule>(k, 300, 5, rel_tol);
    const auto& t = r.residual_trace;
    CAPTURE(r.rank());
    REQUIRE(r.stop == effattn::RpStopReason::RelTolReached);
    REQUIRE(r.rank() >= 2);
    REQUIRE(r.rank() < 300);
    CHECK(t.size() == static_cast<std::size_t>(r.rank() + 1));
    CHECK(t.back() <= rel_tol * t.front());
    CHECK(t[t.size() - 2] > rel_tol * t.front());
    CHECK(r.relative_residual_trace() <= rel_tol);
    CHECK(r.factor.rows() == r.rank());
  };
  check(policy::RandomlyPivoted{});
  check(policy::AcceleratedRandomlyPivoted{});
  check(policy::GreedyPivoted{});
}

TEST_CASE("RPCholesky rejects bad arguments", "[core][rp_cholesky]") {
  effattn::Rng rng = effattn::make_rng(2);
  const MatD X = effattn::random_normal<double>(10, 3, rng);
  effattn::RpCholeskyOptions o;
  o.rank = 0;
  require_invalid([&] { effattn::RpCholesky<>{o}; });
  o.rank = 4;
  o.rel_tol = -1e-3;
  require_invalid([&] { effattn::RpCholesky<>{o}; });
  o.rel_tol = 1.0;
  require_invalid([&] { effattn::RpCholesky<>{o}; });
  o.rel_tol = 0;
  o.proposal_block = -1;
  require_invalid([&] { effattn::RpCholesky<policy::AcceleratedRandomlyPivoted>{o}; });
  o.proposal_block = 0;
  o.roundoff_factor = -1;
  require_invalid([&] { effattn::RpCholesky<>{o}; });
  require_invalid([&] { effattn::ExpDotKernel<double>(MatD(0, 3), 1.0); });
  require_invalid([&] { effattn::GaussianKernel<double>(MatD(4, 0), 1.0); });
  MatD bad = X;
  bad(3, 1) = std::numeric_limits<double>::quiet_NaN();
  require_invalid([&] { effattn::ExpDotKernel<double>(bad, 1.0); });
  require_invalid([&] { effattn::GaussianKernel<double>(bad, 1.0); });
  require_invalid([&] { effattn::ExpDotKernel<double>(X, 0.0); });
  require_invalid([&] { effattn::ExpDotKernel<double>(X, -1.0); });
  require_invalid([&] { effattn::GaussianKernel<double>(X, 0.0); });
  require_invalid(
      [&] { effattn::GaussianKernel<double>(X, std::numeric_limits<double>::infinity()); });
  MatD notpsd = MatD::Identity(3, 3);
  notpsd(1, 1) = -1;
  require_invalid([&] { (void)effattn::rp_cholesky(DenseKernel{notpsd}); });
  STATIC_REQUIRE(effattn::is_rp_kernel_v<DenseKernel>);
  STATIC_REQUIRE(effattn::is_rp_kernel_v<effattn::ExpDotKernel<float>>);
  STATIC_REQUIRE(!effattn::is_rp_kernel_v<int>);
  STATIC_REQUIRE(!effattn::is_rp_kernel_v<MatD>);
}

TEST_CASE("rank > m takes at most m pivots; a zero kernel takes none", "[core][rp_cholesky]") {
  effattn::Rng rng = effattn::make_rng(6);
  const MatD X = 3.0 * effattn::random_normal<double>(5, 2, rng);
  const auto r =
      run<policy::AcceleratedRandomlyPivoted>(effattn::GaussianKernel<double>(X, 1.0), 50);
  CHECK(r.rank() == 5);
  CHECK(r.stop == effattn::RpStopReason::RankReached);
  const auto z = run<policy::RandomlyPivoted>(DenseKernel{MatD::Zero(4, 4)}, 3);
  CHECK(z.rank() == 0);
  CHECK(z.stop == effattn::RpStopReason::Exhausted);
  CHECK(z.factor.rows() == 0);
  CHECK(z.info == effattn::Info::Success);
}

// ---- Nystrom --------------------------------------------------------------------------------

TEST_CASE("Nystrom weights equal a direct solve and interpolate the landmarks", "[nystrom]") {
  // m = 300, r = 40, d = 6, N(0, 1) keys, s = 1/sqrt(6) (WildCat's weight-equivalence setting);
  // measured cond(H(S, S)) = 88 (greedy) to 2.1e3. Measured errors (worst over the three rules):
  // RPC path vs direct 9.7e-16, plain path 9.6e-16, interpolation 1.1e-16 (RPC) and 8.9e-16
  // (plain), exp-dot weights of H vs a direct solve on H 1.2e-15 (log-scaled form 1.2e-15).
  effattn::Rng rng = effattn::make_rng(3);
  const MatD X = effattn::random_normal<double>(300, 6, rng);
  const double s = 1.0 / std::sqrt(6.0);
  const effattn::ExpDotKernel<double> k(X, s);
  const MatD H = dense_exp_dot(X, s);
  // G in Gaussian coordinates, densely: G = D^{-1} H D^{-1}.
  const Vector<double> dinv = (-k.half_sq_norms().array()).exp();
  const MatD G = dinv.asDiagonal() * H * dinv.asDiagonal();

  auto direct = [](const MatD& K, const std::vector<Index>& S) {
    const auto r = static_cast<Index>(S.size());
    MatD Kss(r, r), Ks(r, K.cols());
    for (Index i = 0; i < r; ++i) {
      Ks.row(i) = K.row(S[static_cast<std::size_t>(i)]);
      for (Index j = 0; j < r; ++j)
        Kss(i, j) = K(S[static_cast<std::size_t>(i)], S[static_cast<std::size_t>(j)]);
    }
    return MatD(Kss.fullPivLu().solve(Ks));
  };
  auto interpolation_error = [](const RowMajorMatrix<double>& W, const std::vector<Index>& S) {
    const auto r = static_cast<Index>(S.size());
    MatD WS(r, r);
    for (Index j = 0; j < r; ++j) WS.col(j) = W.col(S[static_cast<std::size_t>(j)]);
    return et::max_abs_error(WS, MatD::Identity(r, r));
  };

  auto check_rule = [&](auto rule) {
    using Rule = decltype(rule);
    const auto rpc = run<Rule>(k, 40, 9);
    REQUIRE(rpc.rank() == 40);
    const auto nys = effattn::nystrom_weights(rpc);
    REQUIRE(nys.info == effattn::Info::Success);
    CHECK(nys.landmarks == rpc.pivots);
    const MatD Hss = [&] {
      MatD t(40, 40);
      for (Index i = 0; i < 40; ++i)
        for (Index j = 0; j < 40; ++j)
          t(i, j) = H(rpc.pivots[std::size_t(i)], rpc.pivots[std::size_t(j)]);
      return t;
    }();
    Eigen::SelfAdjointEigenSolver<MatD> eig(Hss);
    const double cond = eig.eigenvalues().maxCoeff() / eig.eigenvalues().minCoeff();
    CAPTURE(sci(cond));
    CHECK(cond < 1e4);
    const MatD WG = direct(G, rpc.pivots);
    const double e_rpc = et::rel_fro_error(nys.weights, WG);
    const double e_int = interpolation_error(nys.weights, rpc.pivots);
    // The plain solve path on the same landmarks.
    const auto plain = effattn::nystrom_weights(k, rpc.pivots);
    REQUIRE(plain.info == effattn::Info::Success);
    CHECK(plain.jitter == 0);
    const double e_plain = et::rel_fro_error(plain.weights, WG);
    const double e_plain_int = interpolation_error(plain.weights, rpc.pivots);
    // Weights of the original kernel H, against a direct solve on H itself.
    const MatD WH = direct(H, rpc.pivots);
    const double e_orig = et::rel_fro_error(k.original_weights(nys.weights, nys.landmarks), WH);
    const auto ls = effattn::exp_dot_log_scaled_weights(k, nys);
    const MatD from_log = ls.log_scale.array().exp().matrix().asDiagonal() * ls.weights;
    const double e_log = et::rel_fro_error(from_log, WH);
    CAPTURE(sci(e_rpc), sci(e_int), sci(e_plain), sci(e_plain_int), sci(e_orig), sci(e_log));
    CHECK(e_rpc <= 1e-10);
    CHECK(e_int <= 1e-10);
    CHECK(e_plain <= 1e-10);
    CHECK(e_plain_int <= 1e-10);
    CHECK(e_orig <= 1e-10);
    CHECK(e_log <= 1e-10);
    CHECK(ls.weights.cwiseAbs().maxCoeff() <= nys.weights.cwiseAbs().maxCoeff());
    CHECK(ls.log_scale.minCoeff() >= 0);
  };
  check_rule(policy::RandomlyPivoted{});
  check_rule(policy::AcceleratedRandomlyPivoted{});
  check_rule(policy::GreedyPivoted{});
}

TEST_CASE("Nystrom plain path: arbitrary landmarks, RBF kernel, jitter only when needed",
          "[nystrom]") {
  effattn::Rng rng = effattn::make_rng(14);
  const MatD X = effattn::random_normal<double>(120, 3, rng);
  const effattn::GaussianKernel<double> k(X, 2.0);
  const MatD K = dense_rbf(X, 2.0);
  const std::vector<Index> S = {7, 3, 99, 42, 0, 119, 60, 15};  // unsorted on purpose
  const auto nys = effattn::nystrom_weights(k, S);
  REQUIRE(nys.info == effattn::Info::Success);
  CHECK(nys.jitter == 0);
  MatD Kss(8, 8), Ks(8, 120);
  for (Index i = 0; i < 8; ++i) {
    Ks.row(i) = K.row(S[std::size_t(i)]);
    for (Index j = 0; j < 8; ++j) Kss(i, j) = K(S[std::size_t(i)], S[std::size_t(j)]);
  }
  CHECK(et::rel_fro_error(nys.weights, MatD(Kss.fullPivLu().solve(Ks))) <= 1e-10);
  // A singular landmark block (two identical points): LLT fails, a jitter is reported, and the
  // weights stay finite.
  MatD Xd = X;
  Xd.row(5) = Xd.row(9);
  const auto sing =
      effattn::nystrom_weights(DenseKernel{dense_rbf(Xd, 2.0)}, std::vector<Index>{5, 9, 20});
  REQUIRE(sing.info == effattn::Info::Success);
  CHECK(sing.jitter > 0);
  CHECK(sing.weights.allFinite());
  // Bad landmark sets.
  require_invalid([&] { (void)effattn::nystrom_weights(k, std::vector<Index>{}); });
  require_invalid([&] { (void)effattn::nystrom_weights(k, std::vector<Index>{1, 120}); });
  require_invalid([&] { (void)effattn::nystrom_weights(k, std::vector<Index>{-1, 3}); });
  require_invalid([&] { (void)effattn::nystrom_weights(k, std::vector<Index>{4, 8, 4}); });
}

TEST_CASE("Nystrom applied without forming W: nystrom_apply and the log-scaled product",
          "[nystrom]") {
  // W B = A^{-1} (F B) against W formed first, and the log-scaled product Wt [B | 1] against
  // exp_dot_log_scaled_weights times [B | 1] (measured agreement <= 3e-16 relative), for every
  // pivot rule; the GEMM runs by row chunks, so 1 and 2 threads give the same bits.
  effattn::Rng rng = effattn::make_rng(21);
  const MatD X = effattn::random_normal<double>(400, 5, rng);
  const MatD B = effattn::random_normal<double>(400, 3, rng);
  const effattn::ExpDotKernel<double> k(X, 0.4);
  auto check_rule = [&](auto rule) {
    using Rule = decltype(rule);
    const auto rpc = run<Rule>(k, 70, 4);  // 70 pivots: 3 chunks of 32 rows
    const auto nys = effattn::nystrom_weights(rpc);
    REQUIRE(nys.info == effattn::Info::Success);
    const MatD WB = effattn::nystrom_apply(rpc, B);
    CHECK(et::rel_fro_error(WB, MatD(nys.weights * B)) <= 1e-12);
    MatD B1(400, 4);
    B1 << B, MatD::Ones(400, 1);
    const auto ls = effattn::exp_dot_log_scaled_weights(k, nys);
    const auto lp = effattn::exp_dot_log_scaled_product(k, rpc, B);
    REQUIRE(lp.info == effattn::Info::Success);
    REQUIRE(lp.product.rows() == rpc.rank());
    REQUIRE(lp.product.cols() == 4);
    CHECK(et::rel_fro_error(lp.product, MatD(ls.weights * B1)) <= 1e-12);
    CHECK(et::max_abs_error(lp.log_scale, ls.log_scale) == 0);
    const MatD t1 = et::with_threads(1, [&] { return effattn::nystrom_apply(rpc, B); });
    const MatD t2 = et::with_threads(2, [&] { return effattn::nystrom_apply(rpc, B); });
    CHECK(et::bitwise_equal(t1, t2));
  };
  check_rule(policy::RandomlyPivoted{});
  check_rule(policy::AcceleratedRandomlyPivoted{});
  check_rule(policy::GreedyPivoted{});
  // Expressions bind to the ConstRef argument; shapes are checked.
  const auto rpc = run<policy::GreedyPivoted>(k, 10, 1);
  CHECK(effattn::nystrom_apply(rpc, 2.0 * B).rows() == 10);
  require_invalid([&] { (void)effattn::nystrom_apply(rpc, B.topRows(399)); });
  require_invalid([&] { (void)effattn::exp_dot_log_scaled_product(k, rpc, B.topRows(10)); });
}
