// MultiHead<F>: every method of the method list over packed, ragged, GQA / MQA batches equals its
// per-(sequence, head) single calls; decoding equals the double-precision reference; bad input
// throws invalid_argument naming the argument; results do not depend on the thread count.
#include "method_configs.hpp"
#include "per_head.hpp"
#include "test_utils.hpp"

#include <effattn/multi_head.hpp>
#include <effattn/workloads.hpp>

#include <array>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if EFFATTN_HAS_OPENMP
#include <omp.h>
#endif

using namespace effattn;

namespace {

template <typename S>
using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

SeqOffsets offsets_of(const std::vector<Index>& lengths) {
  SeqOffsets cu{0};
  for (const Index l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

/// Random packed Q, K, V (row-major, as a model's projections produce) with clustered-ish
/// logits: N(0, 1) entries, scaled so that softmax is neither flat nor one-hot.
template <typename S>
struct Packed {
  RowMat<S> Q, K, V;
  Packed(Index tq, Index tk, Index H, Index G, Index d, Index dv, unsigned seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    auto fill = [&](RowMat<S>& X, Index r, Index c, double s) {
      X.resize(r, c);
      for (Index i = 0; i < r; ++i)
        for (Index j = 0; j < c; ++j) X(i, j) = static_cast<S>(s * nd(gen));
    };
    fill(Q, tq, H * d, 1.5);
    fill(K, tk, G * d, 1.5);
    fill(V, tk, G * dv, 1.0);
  }
};

/// The per-(sequence, head) calls of F, in one serial region (Eigen's GEMMs serial, as inside
/// MultiHead's tasks), written into a packed T_q x (H dv) matrix.
template <typename F, typename S>
Matrix<S> per_head_reference(const F& f, const HeadLayout& L, const Matrix<S>& Q,
                             const Matrix<S>& K, const Matrix<S>& V, const SeqOffsets& cq,
                             const SeqOffsets& ck) {
  const Index H = L.heads, G = L.kv_heads == 0 ? H : L.kv_heads, d = Q.cols() / H,
              dv = V.cols() / G;
  Matrix<S> out = Matrix<S>::Zero(Q.rows(), H * dv);
  detail::run_serial([&] {
    for (std::size_t b = 0; b + 1 < cq.size(); ++b) {
      const Index q0 = cq[b], nq = cq[b + 1] - q0, k0 = ck[b], nk = ck[b + 1] - k0;
      if (nq == 0) continue;
      for (Index h = 0; h < H; ++h) {
        const Index g = h / (H / G);
        const auto r = f.compute(Q.block(q0, h * d, nq, d), K.block(k0, g * d, nk, d),
                                 V.block(k0, g * dv, nk, dv));
        REQUIRE(r.info == Info::Success);
        out.block(q0, h * dv, nq, dv) = r.output;
      }
    }
  });
  return out;
}

template <typename S>
double rel_err(const Matrix<S>& a, const Matrix<S>& b) {
  return static_cast<double>((a - b).norm()) / std::max(1e-300, static_cast<double>(b.norm()));
}

/// Small-budget options of F (the method's `approx` configuration; for exact attention small
/// tiles, so that sequences span several blocks).
template <typename F>
typename F::Options test_options(Index n) {
  return testing::MethodTestConfig<F>::approx(n, n);
}

}  // namespace

TEMPLATE_TEST_CASE("MultiHead equals the per-head calls for every method", "[multi_head]", float,
                   double) {
  using S = TestType;
  for_each_method<S>([](auto tag) {
    using F = typename decltype(tag)::type;
    constexpr bool exact_tiled = std::is_same_v<F, ExactAttention<S>>;
    // Ragged lengths (a zero-length sequence too); the approximate methods get shorter ones.
    const std::vector<Index> lengths =
        exact_tiled || std::is_same_v<F, ExactAttention<S, policy::Naive>>
            ? std::vector<Index>{1, 7, 0, 128, 1000}
            : std::vector<Index>{1, 7, 60, 130};
    const SeqOffsets cu = offsets_of(lengths);
    const Index T = cu.back();
    for (const HeadLayout L : {HeadLayout{2, 0}, HeadLayout{8, 2}, HeadLayout{8, 1}}) {
      for (const bool causal : {false, true}) {
        auto opts = test_options<F>(7);
        if constexpr (functor_traits<F>::supports_causal) {
          opts.causal = causal;
        } else if (causal) {
          continue;
        }
        const Index d = 8, dv = 6;
        const Packed<S> p(T, T, L.heads, L.kv_heads == 0 ? L.heads : L.kv_heads, d, dv,
                          17u + static_cast<unsigned>(L.heads * 3 + L.kv_heads));
        const MultiHead<F> mh(opts, L);
        const auto rr = mh.compute(p.Q, p.K, p.V, cu, cu);  // row-major
        const Matrix<S> Qc = p.Q, Kc = p.K, Vc = p.V;
        const auto rc = mh.compute(Qc, Kc, Vc, cu, cu);  // column-major
        INFO(functor_traits<F>::name << " heads " << L.heads << " kv_heads " << L.kv_heads
                                     << " causal " << causal);
        REQUIRE(rr.info == Info::Success);
        REQUIRE(rc.info == Info::Success);
        STATIC_REQUIRE(decltype(rr.output)::IsRowMajor);
        STATIC_REQUIRE(!decltype(rc.output)::IsRowMajor);
        REQUIRE(rr.output.rows() == T);
        REQUIRE(rr.output.cols() == L.heads * dv);
        REQUIRE(rr.head_results.size() == (cu.size() - 1) * static_cast<std::size_t>(L.heads));
        // For the other methods, storage order changes nothing but the alignment of the per-head
        // slices (a row-major slice is copied into an aligned buffer, a column-major one is a
        // view at an arbitrary offset), which changes how Eigen splits its vectorised
        // reductions: round-off only (WildCat float measured 2e-7 relative). The exact kernel
        // reads both in place (see below).
        const double order_err = rel_err<S>(Matrix<S>(rr.output), rc.output);
        INFO("row- vs column-major relative difference " << order_err);
        if constexpr (exact_tiled) {
          // Stacked (decoding) blocks of row-major K and V run the GEMM-free decoding kernel,
          // column-major ones the GEMM kernel; prefill blocks of a row-major V accumulate
          // acc^T += V_t^T P^T in a row-major accumulator (V read along its rows) where a
          // column-major V gives acc += P V_t: another GEMM summation order. Round-off apart
          // (measured 5e-8 to 7e-8 relative in float, under one epsilon); the column-major
          // result is bit-identical to the per-head calls below.
          CHECK(order_err < 50 * std::numeric_limits<S>::epsilon());
        } else
          CHECK(order_err < 1e3 * std::numeric_limits<S>::epsilon());
        const Matrix<S> ref = per_head_reference(mh.functor(), L, Qc, Kc, Vc, cu, cu);
        if constexpr (exact_tiled) {
          // Stacked heads (the 1- and 7-token sequences: decoding blocks) change the GEMM's row
          // count, which may round differently; every other block is the single-head kernel's.
          CHECK(rel_err<S>(rc.output, ref) < 50 * std::numeric_limits<S>::epsilon());
          const Index long0 = cu[3], nlong = cu[5] - cu[3];
          CHECK(rc.output.middleRows(long0, nlong) == ref.middleRows(long0, nlong));
        } else {
          CHECK(rc.output == ref);
        }
        // Per-(sequence, head) diagnostics are reachable.
        for (Index b = 0; b + 1 < static_cast<Index>(cu.size()); ++b)
          for (Index h = 0; h < L.heads; ++h) {
            const auto& hr = rc.head(b, h);
            CHECK(hr.info == Info::Success);
            CHECK(hr.output.size() == 0);
            for (const Diagnostic& dg : hr.diagnostics()) CHECK(std::isfinite(dg.value));
          }
      }
    }
  });
}

TEMPLATE_TEST_CASE("MultiHead exact: lse per head, GQA 4 and 8, against the double reference",
                   "[multi_head][exact]", float, double) {
  using S = TestType;
  const SeqOffsets cu = offsets_of({1, 7, 128, 1000});
  const Index T = cu.back(), d = 16;
  for (const HeadLayout L : {HeadLayout{4, 1}, HeadLayout{8, 2}, HeadLayout{8, 1}}) {
    const Packed<S> p(T, T, L.heads, L.kv_heads, d, d, 5u);
    for (const bool causal : {false, true}) {
      ExactOptions o;
      o.causal = causal;
      const auto r = MultiHead<ExactAttention<S>>(o, L).compute(p.Q, p.K, p.V, cu);
      const auto n = MultiHead<ExactAttention<S, policy::Naive>>(o, L).compute(p.Q, p.K, p.V, cu);
      const double tol = std::is_same_v<S, float> ? 2e-6 : 1e-13;
      CHECK(rel_err<S>(Matrix<S>(r.output), Matrix<S>(n.output)) < tol);
      for (Index b = 0; b < 4; ++b)
        for (Index h = 0; h < L.heads; ++h)
          CHECK((r.head(b, h).lse - n.head(b, h).lse).cwiseAbs().maxCoeff() <
                100 * std::numeric_limits<S>::epsilon() *
                    (1 + n.head(b, h).lse.cwiseAbs().maxCoeff()));
    }
  }
}

TEMPLATE_TEST_CASE("MultiHead decoding against long caches equals exact attention",
                   "[multi_head][decode]", float, double) {
  using S = TestType;
  // B = 3 sequences with caches of 3000, 517 and 64 tokens; 1, 4 and 16 new queries per
  // sequence (the last positions: causal, bottom-right aligned); GQA 4 and MQA: the heads of a
  // group are stacked and the long caches split (split-KV).
  const SeqOffsets ck = offsets_of({3000, 517, 64});
  const Index d = 32;
  for (const Index nq : {1, 4, 16}) {
    const SeqOffsets cq = offsets_of({nq, nq, nq});
    for (const HeadLayout L : {HeadLayout{8, 2}, HeadLayout{4, 1}}) {
      const Packed<S> p(cq.back(), ck.back(), L.heads, L.kv_heads, d, d, 11u);
      ExactOptions o;
      o.causal = true;
      const auto r = MultiHead<ExactAttention<S>>(o, L).compute(p.Q, p.K, p.V, cq, ck);
      const auto n =
          MultiHead<ExactAttention<S, policy::Naive>>(o, L).compute(p.Q, p.K, p.V, cq, ck);
      INFO("queries " << nq << " heads " << L.heads << " kv_heads " << L.kv_heads);
      REQUIRE(r.info == Info::Success);
      CHECK(r.head(0, 0).kv_splits > 1);  // the 3000-token cache is split
      const double tol = std::is_same_v<S, float> ? 2e-6 : 1e-13;
      CHECK(rel_err<S>(Matrix<S>(r.output), Matrix<S>(n.output)) < tol);
    }
  }
}

TEST_CASE("MultiHead decoding: every shape of the fp32 kernel, against the double reference",
          "[multi_head][decode]") {
  // The fp32 decoding kernel (detail/x86/decode_avx512.hpp; the Eigen path when the CPU lacks
  // AVX-512 or EFFATTN_ISA=generic, which ctest also runs: test_multi_head_generic) works on
  // 1-4 rows of a group (GQA 4, group 3, MHA), 16-key sub-tiles (caches that are not multiples of
  // 16), 64- and 16-column value chunks (dv 16, 48, 80, 128) and a lazy running maximum: keys
  // grow along the cache, so the tiles' maxima rise by far more than its threshold (8) and the
  // accumulator is rescaled many times. A non-finite key is reported.
  struct Shape {
    HeadLayout layout;
    Index d, dv;
  };
  const SeqOffsets ck = offsets_of({1000 + 7, 33, 16});
  for (const Shape sh : {Shape{{8, 2}, 128, 128}, Shape{{6, 2}, 64, 80}, Shape{{5, 5}, 16, 48},
                         Shape{{3, 1}, 48, 16}}) {
    for (const Index nq : {1, 2}) {
      const SeqOffsets cq = offsets_of({nq, nq, nq});
      const Index H = sh.layout.heads, G = sh.layout.kv_heads;
      Packed<float> p(cq.back(), ck.back(), H, G, sh.d, sh.dv, 41u);
      for (Index j = 0; j < p.K.rows(); ++j)  // scores grow 16-fold along the cache
        p.K.row(j) *= 0.2f + 3.0f * static_cast<float>(j) / static_cast<float>(p.K.rows());
      ExactOptions o;
      o.causal = true;
      const auto r = MultiHead<ExactAttentionf>(o, sh.layout).compute(p.Q, p.K, p.V, cq, ck);
      const auto n =
          MultiHead<ExactAttention<double, policy::Naive>>(o, sh.layout)
              .compute(RowMat<double>(p.Q.cast<double>()), RowMat<double>(p.K.cast<double>()),
                       RowMat<double>(p.V.cast<double>()), cq, ck);
      REQUIRE(r.info == Info::Success);
      const double err =
          rel_err<double>(Matrix<double>(r.output.cast<double>()), Matrix<double>(n.output));
      double lse_err = 0;
      for (Index b = 0; b < 3; ++b)
        for (Index h = 0; h < H; ++h)
          lse_err = std::max(
              lse_err, (r.head(b, h).lse.cast<double>() - n.head(b, h).lse).cwiseAbs().maxCoeff() /
                           (1 + n.head(b, h).lse.cwiseAbs().maxCoeff()));
      INFO("heads " << H << " kv_heads " << G << " d " << sh.d << " dv " << sh.dv << " queries "
                    << nq << ": rel. error " << err << ", lse " << lse_err);
      if (testing::verbose())
        std::printf("decode fp32 H %td G %td d %td dv %td nq %td: rel. error %.2e, lse %.2e\n", H,
                    G, sh.d, sh.dv, nq, err, lse_err);
      // float round-off (measured 2.2e-7 to 3.5e-7, lse 5e-8 to 1.5e-7, on both paths)
      CHECK(err < 2e-6);
      CHECK(lse_err < 2e-6);
      p.K(500, 1) = std::numeric_limits<float>::quiet_NaN();  // inside the long cache
      CHECK_THROWS_AS(MultiHead<ExactAttentionf>(o, sh.layout).compute(p.Q, p.K, p.V, cq, ck),
                      effattn::invalid_argument);
    }
  }
}

TEST_CASE("MultiHead reads strided maps and evaluates expressions", "[multi_head]") {
  const Index H = 4, G = 2, d = 8, T = 50;
  const Packed<float> p(T, T, H, G, d, d, 3u);
  // A row-major buffer with padding between rows (outer stride > width), as a framework's
  // strided view.
  RowMat<float> padded = RowMat<float>::Zero(T, H * d + 5);
  padded.leftCols(H * d) = p.Q;
  const Eigen::Map<const RowMat<float>, 0, Eigen::OuterStride<>> qmap(
      padded.data(), T, H * d, Eigen::OuterStride<>(H * d + 5));
  const MultiHead<ExactAttentionf> mh({}, {H, G});
  const auto a = mh.compute(p.Q, p.K, p.V);
  const auto b = mh.compute(qmap, p.K, p.V);
  CHECK(a.output == b.output);
  const auto c = mh.compute(p.Q * 1.0f, p.K, p.V);  // an expression: evaluated once
  CHECK(a.output == c.output);
}

TEST_CASE("MultiHead compute_into writes compute's output into the caller's buffer",
          "[multi_head]") {
  // GQA 2, ragged: a decoding sequence (stacked heads), a short one and a 300-token prefill
  // (several query blocks), causal, for the exact kernel and a per-head method (Conv-Basis).
  const Index H = 4, G = 2, d = 16, dv = 8;
  const SeqOffsets cu = offsets_of({1, 7, 300});
  const Index T = cu.back();
  const Packed<float> p(T, T, H, G, d, dv, 11u);
  ExactOptions causal;
  causal.causal = true;
  auto check_method = [&](const auto& mh) {
    const auto ref = mh.compute(p.Q, p.K, p.V, cu, cu);
    REQUIRE(ref.info == Info::Success);
    // Row-major (Q's order), column-major, and a block of a larger row-major buffer whose
    // padding must stay untouched.
    RowMat<float> row = RowMat<float>::Constant(T, H * dv, 7.0f);
    Matrix<float> col = Matrix<float>::Constant(T, H * dv, 7.0f);
    RowMat<float> big = RowMat<float>::Constant(T + 3, H * dv + 5, -3.0f);
    const auto rr = mh.compute_into(p.Q, p.K, p.V, row, cu, cu);
    const auto rc = mh.compute_into(p.Q, p.K, p.V, col, cu, cu);
    const auto rb = mh.compute_into(p.Q, p.K, p.V, big.block(2, 1, T, H * dv), cu, cu);
    for (const auto* r : {&rr, &rc, &rb}) {
      CHECK(r->info == Info::Success);
      CHECK(r->output.size() == 0);
      REQUIRE(r->head_results.size() == ref.head_results.size());
      CHECK(r->batch == ref.batch);
      CHECK(r->tasks == ref.tasks);
    }
    CHECK(row == ref.output);
    CHECK(col == Matrix<float>(ref.output));
    CHECK(RowMat<float>(big.block(2, 1, T, H * dv)) == ref.output);
    CHECK((big.topRows(2).array() == -3.0f).all());
    CHECK((big.bottomRows(1).array() == -3.0f).all());
    CHECK((big.col(0).array() == -3.0f).all());
    CHECK((big.rightCols(4).array() == -3.0f).all());
  };
  check_method(MultiHead<ExactAttentionf>(causal, {H, G}));
  check_method(MultiHead<ConvBasisAttention<float>>({}, {H, G}));
  // The exact kernel's lse per head is the same as compute's.
  const MultiHead<ExactAttentionf> mh(causal, {H, G});
  const auto ref = mh.compute(p.Q, p.K, p.V, cu, cu);
  RowMat<float> out(T, H * dv);
  const auto r = mh.compute_into(p.Q, p.K, p.V, out, cu, cu);
  for (Index b = 0; b < 3; ++b)
    for (Index h = 0; h < H; ++h) CHECK(r.head(b, h).lse == ref.head(b, h).lse);

  // Bad output buffers.
  auto throws_with = [](auto&& call, const std::string& needle) {
    testing::require_invalid_argument(call, needle);
  };
  RowMat<float> small(T - 1, H * dv), narrow(T, H * dv - 1);
  throws_with([&] { (void)mh.compute_into(p.Q, p.K, p.V, small, cu, cu); }, "out must be");
  throws_with([&] { (void)mh.compute_into(p.Q, p.K, p.V, narrow, cu, cu); }, "T_q x heads dv");
  Matrix<float> wide(T, 2 * H * dv);
  const Eigen::Map<Matrix<float>, 0, Eigen::InnerStride<2>> strided(wide.data(), T, H * dv,
                                                                    Eigen::InnerStride<2>());
  throws_with([&] { (void)mh.compute_into(p.Q, p.K, p.V, strided, cu, cu); }, "inner stride 1");
  // Writing over an input (dv = d here, so V itself has the output's shape per kv head: use a
  // layout whose output is V's shape).
  const Packed<float> sq(T, T, 2, 2, d, d, 12u);
  const MultiHead<ExactAttentionf> mh2(causal, {2, 2});
  RowMat<float> v2 = sq.V, q2 = sq.Q;
  throws_with([&] { (void)mh2.compute_into(sq.Q, sq.K, v2, v2, cu, cu); }, "out overlaps V");
  throws_with([&] { (void)mh2.compute_into(q2, sq.K, sq.V, q2, cu, cu); }, "out overlaps Q");
}

TEMPLATE_TEST_CASE("MultiHead does not depend on the thread count", "[multi_head][threads]", float,
                   double) {
#if EFFATTN_HAS_OPENMP
  using S = TestType;
  const SeqOffsets cq = offsets_of({3, 200, 1});
  const SeqOffsets ck = offsets_of({900, 200, 2000});
  const Packed<S> p(cq.back(), ck.back(), 8, 2, 16, 16, 9u);
  ExactOptions eo;
  eo.causal = true;
  WildcatOptions wo;
  wo.rank = 24;
  wo.bins = 2;
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    const auto e = MultiHead<ExactAttention<S>>(eo, {8, 2}).compute(p.Q, p.K, p.V, cq, ck);
    const auto w = MultiHead<WildcatAttention<S>>(wo, {8, 2}).compute(p.Q, p.K, p.V, cq, ck);
    return std::make_pair(Matrix<S>(e.output), Matrix<S>(w.output));
  };
  const int before = omp_get_max_threads();
  const auto one = run(1);
  const auto two = run(2);
  const auto three = run(3);
  omp_set_num_threads(before);
  CHECK(one.first == two.first);
  CHECK(one.first == three.first);
  CHECK(one.second == two.second);
  CHECK(one.second == three.second);
#else
  WARN("SKIPPED: built without OpenMP, one thread only, nothing to compare");
#endif
}

TEST_CASE("MultiHead WildCat: compressed caches per head, append, weighted attention",
          "[multi_head][wildcat]") {
  const Index H = 8, G = 2, d = 8;
  const SeqOffsets ck = offsets_of({300, 120});
  const Packed<double> p(2, ck.back(), H, G, d, d, 21u);
  WildcatOptions wo;
  wo.rank = 32;
  const MultiHead<WildcatAttention<double>> mh(wo, {H, G});
  auto cache = mh.compress_kv(p.K, p.V, ck);
  REQUIRE(cache.caches.size() == 4);
  const Packed<double> fresh(2, 2, H, G, d, d, 22u);  // one new token per sequence
  mh.append(cache, fresh.K, fresh.V, offsets_of({1, 1}));
  CHECK(cache.at(0, 1).tail_size() == 1);
  const auto r = mh.weighted_attention(p.Q, cache, offsets_of({1, 1}));
  REQUIRE(r.info == Info::Success);
  // Per head: the same compression and attention called directly.
  const WildcatAttention<double> w(wo);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / G), k0 = ck[static_cast<std::size_t>(b)],
                  nk = ck[static_cast<std::size_t>(b) + 1] - k0;
      Matrix<double> out;
      detail::run_serial([&] {
        auto c = w.compress_kv(p.K.block(k0, g * d, nk, d), p.V.block(k0, g * d, nk, d), 0);
        c.append(fresh.K.block(b, g * d, 1, d), fresh.V.block(b, g * d, 1, d));
        out = w.weighted_attention(p.Q.block(b, h * d, 1, d), c).output;
      });
      CHECK(Matrix<double>(r.output.block(b, h * d, 1, d)) == out);
    }
}

TEST_CASE("MultiHead rejects bad input, naming the argument", "[multi_head][errors]") {
  const Packed<float> p(20, 20, 4, 2, 8, 8, 1u);
  const MultiHead<ExactAttentionf> mh({}, {4, 2});
  auto throws_with = [](auto&& call, const std::string& needle) {
    testing::require_invalid_argument(call, needle);
  };

  throws_with([&] { (void)MultiHead<ExactAttentionf>({}, {6, 4}); }, "kv_heads");
  throws_with([&] { (void)MultiHead<ExactAttentionf>({}, {0, 0}); }, "heads");
  throws_with([&] { (void)MultiHead<ExactAttentionf>({}, {4, -1}); }, "kv_heads");
  throws_with([&] { (void)mh.compute(p.Q.leftCols(30), p.K, p.V); }, "Q has 30 columns");
  throws_with([&] { (void)mh.compute(p.Q, p.K.leftCols(15), p.V); }, "K");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V.leftCols(15)); }, "V");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {1, 20}); }, "cu_seqlens_q[0]");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0, 12, 8, 20}); }, "non-decreasing");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0, 5, 19}); }, "cu_seqlens_q must end");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0, 10, 20}, {0, 21}); }, "cu_seqlens_k");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0, 10, 20}, {0, 20}); }, "same batch");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0, 10, 20}, {0, 20, 20}); }, "no keys");
  throws_with([&] { (void)mh.compute(p.Q, p.K, p.V, {0}); }, "B + 1");
  ExactOptions causal;
  causal.causal = true;
  throws_with(
      [&] {
        (void)MultiHead<ExactAttentionf>(causal, {4, 2})
            .compute(p.Q, p.K, p.V, {0, 10, 20}, {0, 15, 20});
      },
      "sequence 1");
  RowMat<float> bad = p.Q;
  bad(3, 17) = std::numeric_limits<float>::quiet_NaN();
  throws_with([&] { (void)mh.compute(bad, p.K, p.V); }, "row 3, column 17");
  {
    // The same in a prefill block (400 queries: not stacked), whose row-major query buffer is
    // checked row by row; in the second block of the sequence and in the last head.
    const Packed<float> lp(400, 400, 4, 2, 16, 16, 5u);
    RowMat<float> lbad = lp.Q;
    lbad(300, 4 * 16 - 1) = std::numeric_limits<float>::infinity();
    for (const bool causal_mask : {false, true}) {
      ExactOptions o;
      o.causal = causal_mask;
      const MultiHead<ExactAttentionf> lmh(o, {4, 2});
      REQUIRE(lmh.compute(lp.Q, lp.K, lp.V).info == Info::Success);
      throws_with([&] { (void)lmh.compute(lbad, lp.K, lp.V); }, "row 300, column 63");
    }
  }
  // A method's own check, reported with the (sequence, head) it failed in.
  VccOptions vo;
  vo.vip = {0, 12};
  throws_with(
      [&] {
        (void)MultiHead<VccAttention<float>>(vo, {4, 2}).compute(p.Q, p.K, p.V, {0, 15, 20});
      },
      "sequence 1, head 0");
  // Self-attention-only methods need as many keys as queries per sequence.
  throws_with(
      [&] {
        (void)MultiHead<ConvBasisAttention<float>>({}, {4, 2})
            .compute(p.Q, p.K, p.V, {0, 10, 20}, {0, 8, 20});
      },
      "sequence 0");
}

TEMPLATE_TEST_CASE("MultiHead decoding from a preallocated cache (seqused_k)",
                   "[multi_head][decode]", float, double) {
  using S = TestType;
  // Three sequences with cache regions of 600 rows each, filled to 517, 64 and 599 tokens; a
  // decoding step writes one row per sequence and attends with seqused_k = filled + 1. Equal to
  // the same keys packed contiguously.
  const Index H = 8, G = 2, d = 16, cap = 600;
  const std::vector<Index> used = {518, 65, 600};
  const Packed<S> p(3, 3 * cap, H, G, d, d, 31u);
  const SeqOffsets regions = {0, cap, 2 * cap, 3 * cap};
  RowMat<S> Kp(518 + 65 + 600, G * d), Vp(Kp.rows(), G * d);
  Index row = 0;
  for (std::size_t b = 0; b < 3; ++b) {
    Kp.middleRows(row, used[b]) = p.K.middleRows(regions[b], used[b]);
    Vp.middleRows(row, used[b]) = p.V.middleRows(regions[b], used[b]);
    row += used[b];
  }
  ExactOptions o;
  o.causal = true;
  const MultiHead<ExactAttention<S>> mh(o, {H, G});
  const auto a = mh.compute(p.Q, p.K, p.V, {0, 1, 2, 3}, regions, used);
  const auto b = mh.compute(p.Q, Kp, Vp, {0, 1, 2, 3}, offsets_of(used));
  REQUIRE(a.info == Info::Success);
  CHECK(a.output == b.output);
  auto throws = [&](const std::vector<Index>& u) {
    CHECK_THROWS_AS(mh.compute(p.Q, p.K, p.V, {0, 1, 2, 3}, regions, u), effattn::invalid_argument);
  };
  throws({518, 65});       // one value per sequence
  throws({518, 65, 601});  // beyond the region
  throws({518, -1, 600});  // negative
  throws({518, 0, 600});   // a query without keys
}

namespace {

using effattn::testing::per_head_backward;

template <typename F>
void check_backward_against_per_head(double tol) {
  using S = typename F::Scalar;
  const SeqOffsets cu = offsets_of({1, 7, 0, 40, 130});
  const Index T = cu.back(), d = 8, dv = 6;
  for (const HeadLayout L : {HeadLayout{4, 4}, HeadLayout{8, 2}, HeadLayout{4, 1}}) {
    for (const bool causal : {false, true}) {
      auto opts = test_options<F>(3);
      if constexpr (functor_traits<F>::supports_causal && !functor_traits<F>::causal_only) {
        opts.causal = causal;
      } else if (!causal) {
        continue;
      }
      const Packed<S> p(T, T, L.heads, L.kv_heads, d, dv, 41u + static_cast<unsigned>(L.heads));
      const RowMat<S> dO = Packed<S>(T, T, L.heads, L.kv_heads, dv, dv, 7u).Q;
      const MultiHead<F> mh(opts, L);
      const auto fwd = mh.compute(p.Q, p.K, p.V, cu, cu);
      REQUIRE(fwd.info == Info::Success);
      const auto g = mh.backward(p.Q, p.K, p.V, fwd, dO, cu, cu);
      STATIC_REQUIRE(decltype(g.dQ)::IsRowMajor);
      const auto ref = per_head_backward(mh.functor(), L, Matrix<S>(p.Q), Matrix<S>(p.K),
                                         Matrix<S>(p.V), Matrix<S>(dO), cu);
      INFO(functor_traits<F>::name << " heads " << L.heads << " kv_heads " << L.kv_heads
                                   << " causal " << causal);
      CHECK(rel_err<S>(Matrix<S>(g.dQ), ref[0]) <= tol);
      CHECK(rel_err<S>(Matrix<S>(g.dK), ref[1]) <= tol);
      CHECK(rel_err<S>(Matrix<S>(g.dV), ref[2]) <= tol);
      // The gradient is not trivially zero (the rows of the empty sequence are).
      CHECK(ref[1].norm() > 0);
    }
  }
}

}  // namespace

TEST_CASE("MultiHead backward equals per-head backward calls, GQA sums over the group",
          "[multi_head][gradients]") {
  // Naive and Conv-Basis run the per-head calls themselves: the same arithmetic.
  check_backward_against_per_head<ExactAttention<double, policy::Naive>>(0.0);
  check_backward_against_per_head<ConvBasisAttention<double>>(0.0);
  // Tiled: the multi-head forward stacks heads of short sequences (round-off in O and lse).
  check_backward_against_per_head<ExactAttention<double>>(1e-12);
  check_backward_against_per_head<ExactAttention<float>>(2e-5);
}

TEST_CASE("MultiHead backward matches central finite differences (GQA, ragged, causal)",
          "[multi_head][gradients]") {
  // Loss L = sum(W o O) for a fixed W, so dL/dO = W; every input entry of a small GQA batch is
  // perturbed by +-h. An independent oracle for the group sums and the packed layout.
  const SeqOffsets cu = offsets_of({3, 5});
  const Index H = 4, G = 2, d = 3, dv = 2, T = cu.back();
  const Packed<double> p(T, T, H, G, d, dv, 5u);
  const RowMat<double> W = Packed<double>(T, T, H, G, dv, dv, 9u).Q;
  ExactOptions o;
  o.causal = true;
  const MultiHead<ExactAttention<double, policy::Naive>> mh(o, {H, G});
  const auto fwd = mh.compute(p.Q, p.K, p.V, cu, cu);
  const auto g = mh.backward(p.Q, p.K, p.V, fwd, W, cu, cu);
  auto loss = [&](const RowMat<double>& Q, const RowMat<double>& K, const RowMat<double>& V) {
    return mh.compute(Q, K, V, cu, cu).output.cwiseProduct(W).sum();
  };
  const double h = 1e-6;
  auto fd = [&](int which, Index i, Index j) {
    RowMat<double> X[3] = {p.Q, p.K, p.V};
    X[which](i, j) += h;
    const double up = loss(X[0], X[1], X[2]);
    X[which](i, j) -= 2 * h;
    return (up - loss(X[0], X[1], X[2])) / (2 * h);
  };
  double worst = 0;
  const RowMat<double>* grads[3] = {&g.dQ, &g.dK, &g.dV};
  for (int w = 0; w < 3; ++w)
    for (Index i = 0; i < grads[w]->rows(); ++i)
      for (Index j = 0; j < grads[w]->cols(); ++j)
        worst = std::max(worst, std::abs(fd(w, i, j) - (*grads[w])(i, j)));
  INFO("largest |finite difference - gradient| " << worst);
  CHECK(worst < 1e-7);
  CHECK(g.dK.norm() > 1e-2);
}

TEST_CASE("MultiHead backward rejects a foreign result and a bad dO", "[multi_head][errors]") {
  const SeqOffsets cu = offsets_of({4, 6});
  const Packed<double> p(10, 10, 4, 2, 3, 3, 2u);
  const MultiHead<ExactAttention<double>> mh({}, {4, 2});
  const auto fwd = mh.compute(p.Q, p.K, p.V, cu, cu);
  const RowMat<double> dO = RowMat<double>::Ones(10, 12);
  testing::require_invalid_argument(
      [&] { (void)mh.backward(p.Q, p.K, p.V, fwd, RowMat<double>::Ones(10, 9), cu, cu); }, "dO");
  RowMat<double> bad = dO;
  bad(3, 4) = std::numeric_limits<double>::quiet_NaN();
  testing::require_invalid_argument([&] { (void)mh.backward(p.Q, p.K, p.V, fwd, bad, cu, cu); },
                                    "dO");
  const MultiHead<ExactAttention<double>> other({}, {2, 2});
  const Packed<double> p2(10, 10, 2, 2, 6, 6, 2u);
  const auto fwd2 = other.compute(p2.Q, p2.K, p2.V, cu, cu);
  testing::require_invalid_argument([&] { (void)mh.backward(p.Q, p.K, p.V, fwd2, dO, cu, cu); },
                                    "result");
  // The offsets of the forward call are needed (here: one sequence instead of two).
  testing::require_invalid_argument([&] { (void)mh.backward(p.Q, p.K, p.V, fwd, dO); }, "result");
}
