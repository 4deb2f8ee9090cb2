// Tests of effattn/kv_press.hpp. Oracles: softmax attention by plain loops in long double
// (loop_attention) over the whole prompt or over the rows a press keeps, and the presses' scores
// recomputed here densely (every logit, every softmax) and ranked by a full sort.
#include "test_utils.hpp"

#include <effattn/kv_press.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

using namespace effattn;
using effattn::testing::bitwise_equal;
using effattn::testing::is_float;
using effattn::testing::loop_attention;
using effattn::testing::randn;
using effattn::testing::rel_fro_error;
using effattn::testing::require_invalid_argument;
using effattn::testing::with_threads;

namespace {

template <typename Scalar>
struct Prompt {
  Matrix<Scalar> K, V, Qobs, Qnew;
};

/// A prompt of m rows whose keys have varied norms and a few that the observation queries
/// attend to strongly (so that the query-guided presses have something to find).
template <typename Scalar>
Prompt<Scalar> make_prompt(Index m, Index d, Index w, Index heads, std::uint64_t seed) {
  Prompt<Scalar> p;
  p.K = randn<Scalar>(m, d, seed);
  for (Index i = 0; i < m; ++i)
    p.K.row(i) *= static_cast<Scalar>(0.5 + static_cast<double>(i % 7) * 0.25);
  p.V = randn<Scalar>(m, d, seed + 1);
  p.Qobs = randn<Scalar>(w * heads, d, seed + 2);
  for (Index h = 0; h < heads; ++h)
    for (Index j = 0; j < w; j += 3)
      p.Qobs.row(h * w + j) = p.K.row((j * 37 + h * 11) % (m - w)) * Scalar(2);
  p.Qnew = randn<Scalar>(24, d, seed + 3);
  return p;
}

template <typename Scalar>
KvPressOptions opts(kv_press::Kind k, double keep, Index heads = 1) {
  KvPressOptions o;
  o.press = k;
  o.keep = keep;
  o.query_heads = heads;
  return o;
}

/// Attention of Q over a cache by the oracle: every row s contributes
/// e^{beta <q, k_s> + log_scale_s} values_s to the numerator and ... weights_s to the
/// denominator (the CompressedKV contract), in long double.
template <typename Scalar>
Matrix<double> cache_attention(const Matrix<Scalar>& Q, const CompressedKV<Scalar>& c) {
  const Index n = Q.rows(), r = c.size(), dv = c.values.cols();
  const double beta = 1.0 / std::sqrt(static_cast<double>(Q.cols()));
  Matrix<double> out(n, dv);
  for (Index i = 0; i < n; ++i) {
    std::vector<long double> z(static_cast<std::size_t>(r));
    long double mx = -INFINITY;
    for (Index s = 0; s < r; ++s) {
      long double dot = 0;
      for (Index k = 0; k < Q.cols(); ++k) dot += static_cast<long double>(Q(i, k)) * c.keys(s, k);
      z[static_cast<std::size_t>(s)] = beta * dot + c.log_scale(s);
      mx = std::max(mx, z[static_cast<std::size_t>(s)]);
    }
    long double den = 0;
    std::vector<long double> num(static_cast<std::size_t>(dv), 0.0L);
    for (Index s = 0; s < r; ++s) {
      const long double e = std::exp(z[static_cast<std::size_t>(s)] - mx);
      den += e * c.weights(s);
      for (Index j = 0; j < dv; ++j) num[static_cast<std::size_t>(j)] += e * c.values(s, j);
    }
    for (Index j = 0; j < dv; ++j)
      out(i, j) = static_cast<double>(num[static_cast<std::size_t>(j)] / den);
  }
  return out;
}

/// Attention received by every key from the queries (heads blocks of w rows, causal as the
/// press), by dense long-double softmaxes; `counts` = queries that see each key.
template <typename Scalar>
std::vector<double> received(const Matrix<Scalar>& K, const Matrix<Scalar>& Q, Index heads,
                             std::vector<double>& counts) {
  const Index m = K.rows(), w = Q.rows() / heads;
  const double beta = 1.0 / std::sqrt(static_cast<double>(K.cols()));
  std::vector<double> sum(static_cast<std::size_t>(m), 0.0);
  counts.assign(static_cast<std::size_t>(m), 0.0);
  for (Index i = 0; i < Q.rows(); ++i) {
    const Index last = m - w + i % w;
    std::vector<long double> z(static_cast<std::size_t>(last + 1));
    long double mx = -INFINITY, tot = 0;
    for (Index j = 0; j <= last; ++j) {
      long double dot = 0;
      for (Index k = 0; k < K.cols(); ++k) dot += static_cast<long double>(Q(i, k)) * K(j, k);
      z[static_cast<std::size_t>(j)] = beta * dot;
      mx = std::max(mx, z[static_cast<std::size_t>(j)]);
    }
    for (auto& x : z) tot += (x = std::exp(x - mx));
    for (Index j = 0; j <= last; ++j) {
      sum[static_cast<std::size_t>(j)] += static_cast<double>(z[static_cast<std::size_t>(j)] / tot);
      counts[static_cast<std::size_t>(j)] += 1;
    }
  }
  return sum;
}

/// The rows whose scores are the b largest, by a full sort (ties: later position first).
std::vector<Index> top_by_sort(const std::vector<double>& score, Index b) {
  std::vector<Index> idx(score.size());
  std::iota(idx.begin(), idx.end(), Index(0));
  std::sort(idx.begin(), idx.end(), [&](Index x, Index y) {
    const double a = score[static_cast<std::size_t>(x)], c = score[static_cast<std::size_t>(y)];
    return a > c || (a == c && x > y);
  });
  idx.resize(static_cast<std::size_t>(b));
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// Whether two score vectors rank the same top b (the scores agree to round-off, so only a
/// near-tie at the cut may differ: then the chosen sets must differ only among near-tied rows).
bool same_top(const std::vector<Index>& got, const std::vector<Index>& want,
              const std::vector<double>& score, double tol) {
  if (got == want) return true;
  std::set<Index> a(got.begin(), got.end()), b(want.begin(), want.end());
  double cut = INFINITY;
  for (const Index i : want) cut = std::min(cut, score[static_cast<std::size_t>(i)]);
  for (const Index i : a)
    if (!b.count(i) && std::abs(score[static_cast<std::size_t>(i)] - cut) > tol) return false;
  return true;
}

}  // namespace

TEMPLATE_TEST_CASE("kv_press: names round-trip and unknown names are rejected", "[kv_press]", float,
                   double) {
  for (const auto k : kv_press::all()) CHECK(kv_press::from_name(kv_press::name(k)) == k);
  CHECK(kv_press::all().size() == 8);
  require_invalid_argument([] { (void)kv_press::from_name("h2o"); }, "unknown press 'h2o'");
}

TEMPLATE_TEST_CASE("kv_press: every press at keep = 1 is exact attention over the prompt",
                   "[kv_press]", float, double) {
  using S = TestType;
  const auto p = make_prompt<S>(200, 16, 32, 2, 11);
  const Matrix<double> ref = loop_attention(p.Qnew, p.K, p.V, 1.0 / 4.0, false);
  for (const auto k : kv_press::all()) {
    INFO(kv_press::name(k));
    const auto c = KvPress<S>(opts<S>(k, 1.0, 2)).compress(p.K, p.V, p.Qobs);
    REQUIRE(c.size() == 200);
    const auto r = weighted_attention(p.Qnew, c);
    REQUIRE(r.info == Info::Success);
    // Every row kept with weight 1: the softmax over the same logits, round-off only
    // (measured 2e-7 float, 4e-16 double).
    CHECK(rel_fro_error(r.output, ref) < (is_float<S>() ? 2e-6 : 1e-13));
    CHECK(r.error_bound == 0);  // the exact block: certified exact
  }
}

TEMPLATE_TEST_CASE("kv_press: budgets are respected", "[kv_press]", float, double) {
  using S = TestType;
  const auto p = make_prompt<S>(333, 16, 40, 2, 12);
  for (const double keep : {0.003, 0.05, 0.1, 0.25, 0.5, 0.999}) {
    const Index b = std::clamp<Index>(static_cast<Index>(std::llround(keep * 333)), 1, 333);
    for (const auto k : kv_press::all()) {
      INFO(kv_press::name(k) << " keep " << keep);
      const KvPress<S> press(opts<S>(k, keep, 2));
      CHECK(press.budget(333) == b);
      const auto c = press.compress(p.K, p.V, p.Qobs);
      if (b == 333) {
        CHECK(c.size() == 333);  // nothing to save: the prompt as it is, whatever the press
      } else if (k == kv_press::Kind::Drop) {
        CHECK(c.size() == 0);
      } else if (k == kv_press::Kind::Wildcat || k == kv_press::Kind::Vcc) {
        CHECK(c.size() <= b);
        CHECK(c.size() >= std::min<Index>(b, 1));
      } else {
        CHECK(c.size() == b);
      }
      CHECK(c.tokens == 333);
      CHECK(c.tail_begin == c.size());
      CHECK(c.pivots.size() == static_cast<std::size_t>(c.size()));
    }
  }
  // rows overrides keep, and is capped at m.
  KvPressOptions o = opts<S>(kv_press::Kind::Knorm, 0.5);
  o.rows = 17;
  CHECK(KvPress<S>(o).compress(p.K, p.V).size() == 17);
  o.rows = 1000;
  CHECK(KvPress<S>(o).compress(p.K, p.V).size() == 333);
}

TEMPLATE_TEST_CASE("kv_press: the selection presses keep the rows their rule names", "[kv_press]",
                   float, double) {
  using S = TestType;
  const Index m = 300, w = 30, heads = 2;
  const auto p = make_prompt<S>(m, 16, w, heads, 13);
  const Index b = 45;
  const auto sel = [&](kv_press::Kind k, KvPressOptions o = {}) {
    o.press = k;
    o.rows = b;
    o.query_heads = heads;
    return KvPress<S>(o).select(p.K, p.Qobs);
  };
  SECTION("streaming: sinks then the most recent rows") {
    const auto rows = sel(kv_press::Kind::Streaming);
    std::vector<Index> want = {0, 1, 2, 3};
    for (Index i = m - (b - 4); i < m; ++i) want.push_back(i);
    CHECK(rows == want);
  }
  SECTION("uniform: distinct, sorted, seeded") {
    const auto rows = sel(kv_press::Kind::Uniform);
    CHECK(std::set<Index>(rows.begin(), rows.end()).size() == static_cast<std::size_t>(b));
    CHECK(std::is_sorted(rows.begin(), rows.end()));
    CHECK(rows == sel(kv_press::Kind::Uniform));
    KvPressOptions o;
    o.seed = 99;
    CHECK(rows != sel(kv_press::Kind::Uniform, o));
    // Roughly uniform: as many kept rows in each half of the prompt (45 draws: within 3 sd).
    const auto first_half =
        std::count_if(rows.begin(), rows.end(), [&](Index i) { return i < m / 2; });
    CHECK(std::abs(static_cast<double>(first_half) - 22.5) < 3 * std::sqrt(45 * 0.25));
  }
  SECTION("knorm: every kept key is no longer than every dropped one") {
    const auto rows = sel(kv_press::Kind::Knorm);
    const std::set<Index> kept(rows.begin(), rows.end());
    double longest_kept = 0, shortest_dropped = INFINITY;
    for (Index i = 0; i < m; ++i) {
      const double nrm = p.K.row(i).template cast<double>().norm();
      if (kept.count(i))
        longest_kept = std::max(longest_kept, nrm);
      else
        shortest_dropped = std::min(shortest_dropped, nrm);
    }
    CHECK(longest_kept <= shortest_dropped * (1 + 1e-6));
  }
  SECTION("observed: the largest mean attention received, against dense softmaxes") {
    std::vector<double> counts;
    std::vector<double> score = received(p.K, p.Qobs, heads, counts);
    for (std::size_t j = 0; j < score.size(); ++j) score[j] /= std::max(1.0, counts[j]);
    const auto want = top_by_sort(score, b);
    CHECK(same_top(sel(kv_press::Kind::Observed), want, score, is_float<S>() ? 1e-5 : 1e-12));
  }
  SECTION("snapkv: the observation window plus the top pooled scores") {
    KvPressOptions o;
    o.observation = 8;
    o.pool = 5;
    // Oracle: the last 8 queries of each head block, dense softmaxes, pooled by a loop.
    Matrix<S> Qo(8 * heads, 16);
    for (Index h = 0; h < heads; ++h) Qo.middleRows(h * 8, 8) = p.Qobs.middleRows(h * w + w - 8, 8);
    std::vector<double> counts;
    const std::vector<double> raw = received(p.K, Qo, heads, counts);
    std::vector<double> score(static_cast<std::size_t>(m));
    for (Index i = 0; i < m; ++i) {
      double s = 0;
      Index c = 0;
      for (Index j = std::max<Index>(0, i - 2); j <= std::min(m - 1, i + 2); ++j, ++c)
        s += raw[static_cast<std::size_t>(j)];
      score[static_cast<std::size_t>(i)] = i >= m - 8 ? INFINITY : s / static_cast<double>(c);
    }
    const auto rows = sel(kv_press::Kind::SnapKv, o);
    for (Index i = m - 8; i < m; ++i) CHECK(std::count(rows.begin(), rows.end(), i) == 1);
    CHECK(same_top(rows, top_by_sort(score, b), score, is_float<S>() ? 1e-5 : 1e-12));
  }
}

TEMPLATE_TEST_CASE("kv_press: a selection cache is exact attention over its rows", "[kv_press]",
                   float, double) {
  using S = TestType;
  const auto p = make_prompt<S>(256, 16, 32, 1, 14);
  for (const auto k : {kv_press::Kind::Streaming, kv_press::Kind::Uniform, kv_press::Kind::Knorm,
                       kv_press::Kind::SnapKv, kv_press::Kind::Observed}) {
    INFO(kv_press::name(k));
    const KvPress<S> press(opts<S>(k, 0.2));
    const auto rows = press.select(p.K, p.Qobs);
    const auto c = press.compress(p.K, p.V, p.Qobs);
    REQUIRE(c.pivots == rows);
    Matrix<S> Ks(rows.size(), 16), Vs(rows.size(), 16);
    for (std::size_t s = 0; s < rows.size(); ++s) {
      Ks.row(static_cast<Index>(s)) = p.K.row(rows[s]);
      Vs.row(static_cast<Index>(s)) = p.V.row(rows[s]);
    }
    const auto r = weighted_attention(p.Qnew, c);
    const Matrix<double> ref = loop_attention(p.Qnew, Ks, Vs, 0.25, false);
    CHECK(rel_fro_error(r.output, ref) < (is_float<S>() ? 2e-6 : 1e-13));
    // No certificate for a dropped row: the bound is the clip bound, still a true bound.
    const Matrix<double> full = loop_attention(p.Qnew, p.K, p.V, 0.25, false);
    const double err = (r.output.template cast<double>() - full).cwiseAbs().maxCoeff();
    CHECK(r.error_bound >= err);
    CHECK(r.error_bound > 0);
  }
}

TEMPLATE_TEST_CASE("kv_press: vcc rows are segment means weighted by their counts", "[kv_press]",
                   float, double) {
  using S = TestType;
  const auto p = make_prompt<S>(300, 16, 20, 1, 15);
  for (const bool with_queries : {true, false}) {
    INFO("queries " << with_queries);
    const KvPress<S> press(opts<S>(kv_press::Kind::Vcc, 0.2));
    const auto c = with_queries ? press.compress(p.K, p.V, p.Qobs) : press.compress(p.K, p.V);
    // The segments partition the prompt: sorted starts, counts (e^log_scale) summing to m.
    double total = 0;
    for (Index s = 0; s < c.size(); ++s) {
      const Index begin = c.pivots[static_cast<std::size_t>(s)];
      const auto count =
          static_cast<Index>(std::llround(std::exp(static_cast<double>(c.log_scale(s)))));
      const Index end = s + 1 < c.size() ? c.pivots[static_cast<std::size_t>(s + 1)] : 300;
      REQUIRE(end - begin == count);
      total += static_cast<double>(count);
      const Eigen::RowVectorXd km =
          p.K.middleRows(begin, count).template cast<double>().colwise().mean();
      const Eigen::RowVectorXd vm =
          p.V.middleRows(begin, count).template cast<double>().colwise().mean();
      CHECK((c.keys.row(s).template cast<double>() - km).norm() < 1e-5 * (1 + km.norm()));
      CHECK((c.values.row(s).template cast<double>() - vm).norm() < 1e-5 * (1 + vm.norm()));
    }
    CHECK(total == 300);
    CHECK(c.size() >= 40);  // most of the budget of 60 is used
    // The library's weighted attention reads the rows as the contract says.
    const auto r = weighted_attention(p.Qnew, c);
    CHECK(rel_fro_error(r.output, cache_attention(p.Qnew, c)) < (is_float<S>() ? 2e-6 : 1e-13));
  }
}

TEMPLATE_TEST_CASE("kv_press: wildcat is compress_kv at the budget", "[kv_press]", float, double) {
  using S = TestType;
  const auto p = make_prompt<S>(400, 16, 20, 1, 16);
  KvPressOptions o = opts<S>(kv_press::Kind::Wildcat, 0.25);
  o.q_radius = 3.0;
  const auto c = KvPress<S>(o).compress(p.K, p.V, p.Qobs);
  WildcatOptions wo;
  wo.rank = 100;
  wo.seed = o.seed;
  const auto ref = compress_kv(p.K, p.V, 3.0, wo);
  CHECK(bitwise_equal(c.keys, ref.keys));
  CHECK(bitwise_equal(c.values, ref.values));
  // Its certificate holds: the bound covers the true error.
  const auto r = weighted_attention(p.Qnew, c);
  const Matrix<double> full = loop_attention(p.Qnew, p.K, p.V, 0.25, false);
  CHECK(r.error_bound >= (r.output.template cast<double>() - full).cwiseAbs().maxCoeff());
}

TEMPLATE_TEST_CASE("kv_press: caches are bit-identical across thread counts", "[kv_press]", float,
                   double) {
  using S = TestType;
  const auto p = make_prompt<S>(700, 32, 200, 2, 17);
  for (const auto k : kv_press::all()) {
    INFO(kv_press::name(k));
    const KvPress<S> press(opts<S>(k, 0.1, 2));
    const auto a = with_threads(1, [&] { return press.compress(p.K, p.V, p.Qobs); });
    const auto b = with_threads(2, [&] { return press.compress(p.K, p.V, p.Qobs); });
    CHECK(bitwise_equal(a.keys, b.keys));
    CHECK(bitwise_equal(a.values, b.values));
    CHECK(bitwise_equal(a.weights, b.weights));
    CHECK(a.pivots == b.pivots);
  }
}

TEMPLATE_TEST_CASE("kv_press: bad options and inputs name the argument", "[kv_press]", float,
                   double) {
  using S = TestType;
  const auto p = make_prompt<S>(50, 8, 10, 1, 18);
  const auto with = [](auto f) {
    KvPressOptions o;
    o.keep = 0.5;
    f(o);
    return o;
  };
  for (const double keep : {0.0, -0.1, 1.5, double(NAN)})
    require_invalid_argument([&] { KvPress<S>(with([&](KvPressOptions& o) { o.keep = keep; })); },
                             "keep must be in (0, 1]");
  require_invalid_argument([&] { KvPress<S>(with([](KvPressOptions& o) { o.rows = -1; })); },
                           "rows");
  require_invalid_argument([&] { KvPress<S>(with([](KvPressOptions& o) { o.pool = 4; })); },
                           "pool");
  require_invalid_argument([&] { KvPress<S>(with([](KvPressOptions& o) { o.observation = 0; })); },
                           "observation");
  require_invalid_argument([&] { KvPress<S>(with([](KvPressOptions& o) { o.query_heads = 0; })); },
                           "query_heads");
  require_invalid_argument([&] { KvPress<S>(with([](KvPressOptions& o) { o.block_size = 3; })); },
                           "block_size");
  const KvPress<S> snap(with([](KvPressOptions& o) { o.press = kv_press::Kind::SnapKv; }));
  require_invalid_argument([&] { (void)snap.compress(p.K, p.V); }, "pass Q");
  require_invalid_argument([&] { (void)snap.compress(p.K, p.V, Matrix<S>::Ones(3, 5)); },
                           "Q must be");
  require_invalid_argument([&] { (void)snap.compress(p.K, p.V.topRows(10), p.Qobs); }, "V must be");
  require_invalid_argument([&] { (void)snap.compress(p.K.topRows(0), p.V.topRows(0), p.Qobs); },
                           "K must be");
  Matrix<S> bad = p.K;
  bad(3, 2) = std::numeric_limits<S>::quiet_NaN();
  require_invalid_argument([&] { (void)snap.compress(bad, p.V, p.Qobs); }, "K");
  const KvPress<S> two(with([](KvPressOptions& o) { o.query_heads = 2; }));
  require_invalid_argument([&] { (void)two.compress(p.K, p.V, p.Qobs.topRows(9)); },
                           "multiple of query_heads");
  const KvPress<S> wild(with([](KvPressOptions& o) { o.press = kv_press::Kind::Wildcat; }));
  require_invalid_argument([&] { (void)wild.select(p.K, p.Qobs); }, "not a selection press");
}

TEMPLATE_TEST_CASE("kv_press: a pressed cache decodes with appended rows", "[kv_press]", float,
                   double) {
  using S = TestType;
  const auto p = make_prompt<S>(200, 16, 20, 1, 19);
  const Matrix<S> Kt = randn<S>(5, 16, 20), Vt = randn<S>(5, 16, 21);
  for (const auto k : {kv_press::Kind::Drop, kv_press::Kind::SnapKv, kv_press::Kind::Vcc}) {
    INFO(kv_press::name(k));
    auto c = KvPress<S>(opts<S>(k, 0.1)).compress(p.K, p.V, p.Qobs);
    const Index r = c.size();
    c.append(Kt, Vt);
    REQUIRE(c.size() == r + 5);
    const auto res = weighted_attention(p.Qnew, c);
    REQUIRE(res.info == Info::Success);
    // Oracle: the cache's rows by the CompressedKV contract (appended rows exact).
    CHECK(rel_fro_error(res.output, cache_attention(p.Qnew, c)) < (is_float<S>() ? 2e-6 : 1e-13));
    if (k == kv_press::Kind::Drop) {
      const Matrix<double> ref = loop_attention(p.Qnew, Kt, Vt, 0.25, false);
      CHECK(rel_fro_error(res.output, ref) < (is_float<S>() ? 2e-6 : 1e-13));
    }
  }
}
