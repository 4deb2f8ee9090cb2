// Edge-case matrix: every functor, float and double, on degenerate shapes and contents, and on
// inputs passed as strided Maps and as column blocks of a wider matrix.
//
// The subjects are the functors of effattn::MethodList (effattn/methods.hpp), configured in
// tests/method_configs.hpp. Each contributes up to two configurations:
//  - an *exact-limit* configuration (a budget that makes the method exact: EVA window >= m, VCC
//    budget >= n, ...), which must match the long-double loop oracle to round-off on every case;
//  - an *approximate* configuration (small budgets, often larger than m on the tiny cases), whose
//    output must be finite and inside the per-column range of V (every method here returns convex
//    combinations of value rows), with `info == Success`.
// Either may instead throw `effattn::invalid_argument` when the case is outside the method's
// documented domain (e.g. n != m for self-attention-only methods): then `domain` says so and
// the test checks that it throws.
#include <effattn/effattn.hpp>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "method_configs.hpp"
#include "test_utils.hpp"

using namespace effattn;
using effattn::testing::loop_attention;
using effattn::testing::rel_fro_error;

namespace {

template <typename Scalar>
using Mat = Matrix<Scalar>;

template <typename Scalar>
struct Case {
  std::string name;
  Mat<Scalar> Q, K, V;
  double max_logit = 1;  // max |scale q.k| (round-off of the logits grows with it)
};

template <typename Scalar>
Mat<Scalar> gaussian(Index r, Index c, std::uint64_t seed) {
  Rng rng = make_rng(seed, 1);
  Mat<double> x(r, c);
  fill_normal(x, rng);
  return x.cast<Scalar>();
}

template <typename Scalar>
double max_logit(const Case<Scalar>& c) {
  const double s = 1.0 / std::sqrt(static_cast<double>(c.Q.cols()));
  return s * (c.Q.template cast<double>() * c.K.template cast<double>().transpose())
                 .cwiseAbs()
                 .maxCoeff();
}

template <typename Scalar>
std::vector<Case<Scalar>> make_cases() {
  std::vector<Case<Scalar>> cs;
  auto add = [&](std::string name, Index n, Index m, Index d, Index dv, std::uint64_t seed) {
    Case<Scalar> c{std::move(name), gaussian<Scalar>(n, d, seed), gaussian<Scalar>(m, d, seed + 1),
                   gaussian<Scalar>(m, dv, seed + 2)};
    cs.push_back(std::move(c));
  };
  add("n = m = 1", 1, 1, 8, 8, 10);
  add("n = 1, m = 37", 1, 37, 8, 8, 20);
  add("n = 37, m = 1", 37, 1, 8, 8, 30);
  add("d = 1", 40, 40, 1, 3, 40);
  add("dv != d", 33, 45, 3, 7, 50);
  add("n = m = 70", 70, 70, 16, 16, 60);
  {
    Case<Scalar> c{"all-equal keys", gaussian<Scalar>(40, 8, 70), Mat<Scalar>(40, 8),
                   gaussian<Scalar>(40, 5, 72)};
    c.K.rowwise() = gaussian<Scalar>(1, 8, 71).row(0);
    cs.push_back(std::move(c));
  }
  {
    Case<Scalar> c{"all-zero queries", Mat<Scalar>::Zero(40, 8), gaussian<Scalar>(40, 8, 81),
                   gaussian<Scalar>(40, 6, 82)};
    cs.push_back(std::move(c));
  }
  {
    // Logits up to ~80 (float) / ~700 (double): rows of Q and K of norm sqrt(L) sqrt(d)^(1/2).
    const double target = std::is_same<Scalar, float>::value ? 80.0 : 700.0;
    Case<Scalar> c{"huge logits", gaussian<Scalar>(48, 8, 90), gaussian<Scalar>(48, 8, 91),
                   gaussian<Scalar>(48, 4, 92)};
    c.Q.rowwise().normalize();
    c.K.rowwise().normalize();
    const auto r = static_cast<Scalar>(std::sqrt(target * std::sqrt(8.0)));
    c.Q *= r;
    c.K *= r;
    cs.push_back(std::move(c));
  }
  for (auto& c : cs) c.max_logit = max_logit(c);
  return cs;
}

template <typename Scalar>
using Fn = std::function<std::pair<Mat<Scalar>, Info>(
    const ConstRef<Scalar>&, const ConstRef<Scalar>&, const ConstRef<Scalar>&)>;

template <typename Scalar>
struct Subject {
  std::string name;
  Fn<Scalar> exact_limit;  // may be empty
  Fn<Scalar> approx;       // may be empty
  /// Whether the method accepts this shape (false: it must throw invalid_argument).
  std::function<bool(Index n, Index m)> domain = [](Index, Index) { return true; };
  /// Compare with causal attention (methods that are causal by construction).
  bool causal = false;
  /// Exact-limit tolerance in units of eps<Scalar>() (see exact_tol), when a method's exact
  /// limit goes through a transform whose round-off is larger than a few ulps.
  double tol_eps = 32;
  /// The approximate output is a convex combination of value rows (checked against V's column
  /// ranges). KEP-SVGP's rank-s mean K H H^T V is not: it is checked against its own bound
  /// |o_ic| <= ||V_c||_2 instead (||row of K H H^T||_2 <= ||row of K||_2 <= 1, row-softmax K).
  bool convex = true;
};

template <typename Scalar, typename R>
std::pair<Mat<Scalar>, Info> out(R&& r) {
  return {std::move(r.output), r.info};
}

/// One subject per functor of effattn::MethodList, configured by tests/method_configs.hpp.
template <typename Scalar>
std::vector<Subject<Scalar>> subjects() {
  using Ref = ConstRef<Scalar>;
  std::vector<Subject<Scalar>> s;
  int index = 0;
  for_each_method<Scalar>([&](auto tag) {
    using F = typename decltype(tag)::type;
    using T = functor_traits<F>;
    using C = testing::MethodTestConfig<F>;
    Subject<Scalar> sub;
    sub.name = std::string(T::name) + " (list entry " + std::to_string(index++) + ")";
    if constexpr (C::has_exact_limit)
      sub.exact_limit = [](const Ref& Q, const Ref& K, const Ref& V) {
        return out<Scalar>(F(C::exact_limit(Q.rows(), K.rows())).compute(Q, K, V));
      };
    if constexpr (!T::exact)
      sub.approx = [](const Ref& Q, const Ref& K, const Ref& V) {
        using A = typename C::Approx;
        return out<Scalar>(A(C::approx(Q.rows(), K.rows())).compute(Q, K, V));
      };
    if (T::self_attention_only) sub.domain = [](Index n, Index m) { return n == m; };
    sub.causal = T::causal_only;
    sub.tol_eps = C::exact_tol_eps(sizeof(Scalar) == 8);
    sub.convex = C::convex;
    s.push_back(std::move(sub));
  });
  return s;
}

/// Relative Frobenius tolerance of an exact-limit configuration. In the worst case the error
/// grows like eps * max|logit| (the logits' absolute round-off, amplified where two logits almost
/// tie); on these fixed cases it is measured at <= 5.5 eps for every subject, float and double,
/// the huge-logit case (|logit| ~78 / ~680) included, so 32 eps (a 6x margin) still catches a
/// method that loses a digit.
template <typename Scalar>
double exact_tol(double /*max_logit*/, double tol_eps = 32) {
  return tol_eps * testing::eps<Scalar>();
}

template <typename Scalar>
void check_convex(const Mat<Scalar>& O, const Mat<Scalar>& V) {
  REQUIRE(detail::all_finite(O));
  for (Index c = 0; c < V.cols(); ++c) {
    const double lo = static_cast<double>(V.col(c).minCoeff());
    const double hi = static_cast<double>(V.col(c).maxCoeff());
    const double slack = 1e3 * testing::eps<Scalar>() * std::max(1.0, hi - lo);
    for (Index i = 0; i < O.rows(); ++i) {
      const double o = static_cast<double>(O(i, c));
      INFO("row " << i << ", column " << c << ": " << o << " not in [" << lo << ", " << hi << "]");
      CHECK((o >= lo - slack && o <= hi + slack));
    }
  }
}

/// |O_ic| <= ||V_c||_2 (+ round-off): the bound of a rank-s projection of a row-softmax kernel.
template <typename Scalar>
void check_norm_bound(const Mat<Scalar>& O, const Mat<Scalar>& V) {
  REQUIRE(detail::all_finite(O));
  for (Index c = 0; c < V.cols(); ++c) {
    const double bound = V.col(c).template cast<double>().norm();
    const double o = O.col(c).template cast<double>().cwiseAbs().maxCoeff();
    INFO("column " << c << ": max |o| = " << o << ", ||V_c|| = " << bound);
    CHECK(o <= bound * (1 + 1e3 * testing::eps<Scalar>()) + 1e3 * testing::eps<Scalar>());
  }
}

/// Runs one subject on Q, K, V (possibly Maps / blocks) and checks it.
template <typename Scalar>
void check_subject(const Subject<Scalar>& sub, const Case<Scalar>& c, const ConstRef<Scalar>& Q,
                   const ConstRef<Scalar>& K, const ConstRef<Scalar>& V) {
  const bool inside = sub.domain(Q.rows(), K.rows());
  const double scale = 1.0 / std::sqrt(static_cast<double>(Q.cols()));
  const Mat<double> ref = loop_attention(Q, K, V, scale, sub.causal);
  if (sub.exact_limit) {
    INFO(sub.name << " exact limit, case " << c.name);
    if (!inside) {
      CHECK_THROWS_AS(sub.exact_limit(Q, K, V), invalid_argument);
    } else {
      const auto r = sub.exact_limit(Q, K, V);
      REQUIRE(r.second == Info::Success);
      REQUIRE(r.first.rows() == Q.rows());
      REQUIRE(r.first.cols() == V.cols());
      const double err = rel_fro_error(r.first, ref);
      INFO("relative error " << err << ", max |logit| " << c.max_logit);
      if (effattn::testing::verbose())
        std::printf("[edge] %s %s, %s: err %.3g (max |logit| %.1f, tol %.3g)\n", sub.name.c_str(),
                    sizeof(Scalar) == 4 ? "float" : "double", c.name.c_str(), err, c.max_logit,
                    exact_tol<Scalar>(c.max_logit, sub.tol_eps));
      CHECK(err <= exact_tol<Scalar>(c.max_logit, sub.tol_eps));
    }
  }
  if (sub.approx) {
    INFO(sub.name << " approximate, case " << c.name);
    if (!inside) {
      CHECK_THROWS_AS(sub.approx(Q, K, V), invalid_argument);
    } else {
      const auto r = sub.approx(Q, K, V);
      REQUIRE(r.second == Info::Success);
      REQUIRE(r.first.rows() == Q.rows());
      REQUIRE(r.first.cols() == V.cols());
      if (sub.convex)
        check_convex<Scalar>(r.first, V);
      else
        check_norm_bound<Scalar>(r.first, V);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Edge cases: degenerate shapes and contents, every functor", "[edge]", float,
                   double) {
  using Scalar = TestType;
  for (const auto& c : make_cases<Scalar>())
    for (const auto& sub : subjects<Scalar>()) check_subject<Scalar>(sub, c, c.Q, c.K, c.V);
}

TEMPLATE_TEST_CASE("Edge cases: strided Maps and column blocks of wider matrices", "[edge]", float,
                   double) {
  using Scalar = TestType;
  const Index n = 45, m = 45, d = 8, dv = 6;
  const Mat<Scalar> Q = gaussian<Scalar>(n, d, 100), K = gaussian<Scalar>(m, d, 101),
                    V = gaussian<Scalar>(m, dv, 102);
  Case<Scalar> c{"views", Q, K, V};
  c.max_logit = max_logit(c);
  // Strided buffers: leading dimension larger than the row count (garbage in the padding).
  const Index ld = 64;
  auto padded = [&](const Mat<Scalar>& x) {
    std::vector<Scalar> buf(static_cast<std::size_t>(ld * x.cols()), Scalar(1e30));
    for (Index j = 0; j < x.cols(); ++j)
      for (Index i = 0; i < x.rows(); ++i) buf[static_cast<std::size_t>(j * ld + i)] = x(i, j);
    return buf;
  };
  const auto bq = padded(Q), bk = padded(K), bv = padded(V);
  using Map = Eigen::Map<const Mat<Scalar>, 0, Eigen::OuterStride<>>;
  const Map mq(bq.data(), n, d, Eigen::OuterStride<>(ld)),
      mk(bk.data(), m, d, Eigen::OuterStride<>(ld)), mv(bv.data(), m, dv, Eigen::OuterStride<>(ld));
  // Column blocks: one head of a packed n x (3 d) matrix (neighbouring heads hold garbage).
  Mat<Scalar> wq = Mat<Scalar>::Constant(n, 3 * d, Scalar(1e30)), wk = wq,
              wv = Mat<Scalar>::Constant(m, 3 * dv, Scalar(-1e30));
  wq.middleCols(d, d) = Q;
  wk.middleCols(d, d) = K;
  wv.middleCols(dv, dv) = V;
  for (const auto& sub : subjects<Scalar>()) {
    check_subject<Scalar>(sub, c, mq, mk, mv);
    check_subject<Scalar>(sub, c, wq.middleCols(d, d), wk.middleCols(d, d), wv.middleCols(dv, dv));
  }
}

TEMPLATE_TEST_CASE("Edge cases: NaN, Inf and empty inputs throw invalid_argument", "[edge]", float,
                   double) {
  using Scalar = TestType;
  const Mat<Scalar> Q = gaussian<Scalar>(20, 4, 1), K = gaussian<Scalar>(20, 4, 2),
                    V = gaussian<Scalar>(20, 3, 3);
  for (const auto& sub : subjects<Scalar>())
    for (const auto& fn : {sub.exact_limit, sub.approx}) {
      if (!fn) continue;
      INFO(sub.name);
      for (const double bad :
           {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
        Mat<Scalar> q = Q, k = K, v = V;
        q(3, 1) = static_cast<Scalar>(bad);
        CHECK_THROWS_AS(fn(q, K, V), invalid_argument);
        k(5, 2) = static_cast<Scalar>(-bad);
        CHECK_THROWS_AS(fn(Q, k, V), invalid_argument);
        v(7, 0) = static_cast<Scalar>(bad);
        CHECK_THROWS_AS(fn(Q, K, v), invalid_argument);
      }
      CHECK_THROWS_AS(fn(Mat<Scalar>(0, 4), K, V), invalid_argument);
      CHECK_THROWS_AS(fn(Q, Mat<Scalar>(0, 4), Mat<Scalar>(0, 3)), invalid_argument);
      CHECK_THROWS_AS(fn(Q, K, Mat<Scalar>(19, 3)), invalid_argument);          // m mismatch
      CHECK_THROWS_AS(fn(Q, gaussian<Scalar>(20, 5, 4), V), invalid_argument);  // d mismatch
    }
}
