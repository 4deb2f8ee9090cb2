// effattn::mpi under mpirun (1, 2 and 4 ranks): ring attention equals single-process
// ExactAttention on the same rows (causal or not, contiguous or striped, uneven and empty shards,
// GQA, float and double, both progress modes); a bad rank makes every rank throw the same
// invalid_argument; distributed WildCat equals single-process compress_kv on every shard stacked
// and weighted_attention over it, and its all-gather volume is O(P r d), counted in bytes.
//
// Every rank holds the whole problem (the same seeded data), runs the single-process oracle on
// it and compares its own rows. Collective calls must stay matched on every rank, so the checks
// are CHECKs (never REQUIRE), and main() returns the worst exit code of all ranks.
#define CATCH_CONFIG_RUNNER
#include "test_utils.hpp"

#include <effattn/distributed/mpi.hpp>
#include <effattn/exact.hpp>
#include <effattn/wildcat.hpp>

#include <mpi.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace effattn;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}
double max_over_ranks(double x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return x;
}

using testing::gaussian;

template <typename S>
Matrix<S> take_rows(const Matrix<S>& x, const std::vector<Index>& pos) {
  Matrix<S> y(static_cast<Index>(pos.size()), x.cols());
  for (std::size_t i = 0; i < pos.size(); ++i) y.row(static_cast<Index>(i)) = x.row(pos[i]);
  return y;
}

/// Contiguous shard of rank p for the lengths `len` (one per rank).
std::vector<Index> contiguous_positions(const std::vector<Index>& len, int p) {
  Index begin = 0;
  for (int q = 0; q < p; ++q) begin += len[static_cast<std::size_t>(q)];
  std::vector<Index> pos;
  for (Index t = 0; t < len[static_cast<std::size_t>(p)]; ++t) pos.push_back(begin + t);
  return pos;
}

/// Uneven contiguous lengths: rank p gets a share proportional to p + 1 (the last rank the rest).
std::vector<Index> uneven_lengths(Index N, int P) {
  std::vector<Index> len(static_cast<std::size_t>(P));
  const Index unit = 2 * N / (P * (P + 1));
  Index used = 0;
  for (int p = 0; p + 1 < P; ++p) used += len[static_cast<std::size_t>(p)] = unit * (p + 1);
  len.back() = N - used;
  return len;
}

struct RingCase {
  Index N = 0, heads = 1, kv_heads = 1, d = 16, dv = 16;
  bool causal = false;
  mpi::Sharding sharding = mpi::Sharding::Contiguous;
  std::vector<Index> lengths;  // contiguous lengths (empty: balanced)
  mpi::Progress progress = mpi::Progress::Auto;
  bool bf16 = false;
};

struct RingErrors {
  double rel = 0, lse = 0;
};

/// Runs the ring on this rank's rows and the single-process oracle (ExactAttention per head on
/// the whole sequence); returns the relative Frobenius error of this rank's rows and the max
/// lse difference.
template <typename S>
RingErrors ring_vs_oracle(const RingCase& c, std::uint64_t seed, Matrix<S>* out = nullptr) {
  const int P = world_size(), me = world_rank();
  const Matrix<S> Q = gaussian<S>(c.N, c.heads * c.d, seed, 1.5);
  const Matrix<S> K = gaussian<S>(c.N, c.kv_heads * c.d, seed + 1, 1.5);
  const Matrix<S> V = gaussian<S>(c.N, c.kv_heads * c.dv, seed + 2);
  const std::vector<Index> pos = c.sharding == mpi::Sharding::Striped || c.lengths.empty()
                                     ? mpi::shard_positions(c.N, P, me, c.sharding)
                                     : contiguous_positions(c.lengths, me);
  mpi::RingOptions o;
  o.causal = c.causal;
  o.sharding = c.sharding;
  o.layout = {c.heads, c.kv_heads};
  o.progress = c.progress;
  o.bf16 = c.bf16;
  const mpi::RingAttention<S> ring(MPI_COMM_WORLD, o);
  const auto r = ring.compute(take_rows(Q, pos), take_rows(K, pos), take_rows(V, pos));
  CHECK(r.info == Info::Success);
  CHECK(r.global_tokens == c.N);
  CHECK(r.output.rows() == static_cast<Index>(pos.size()));
  CHECK(r.output.cols() == c.heads * c.dv);
  CHECK(r.lse.cols() == c.heads);
  CHECK(r.stats.steps == P);
  // Traffic: every block but the one received last goes on to the next rank.
  std::int64_t sent = 0, received = 0;
  const auto block_bytes = [&](int p) {
    const Index rows = c.sharding == mpi::Sharding::Striped || c.lengths.empty()
                           ? static_cast<Index>(mpi::shard_positions(c.N, P, p, c.sharding).size())
                           : c.lengths[static_cast<std::size_t>(p)];
    return static_cast<std::int64_t>(rows * c.kv_heads * (c.d + c.dv) * sizeof(S));
  };
  for (int s = 0; s + 1 < P; ++s) {
    sent += block_bytes((me - s + P) % P);
    received += block_bytes((me - s - 1 + 2 * P) % P);
  }
  CHECK(r.stats.bytes_sent == sent);
  CHECK(r.stats.bytes_received == received);
  if (out != nullptr) *out = r.output;

  ExactOptions eo;
  eo.causal = c.causal;
  const ExactAttention<S> exact(eo);
  Matrix<S> ref(static_cast<Index>(pos.size()), c.heads * c.dv);
  Matrix<S> ref_lse(static_cast<Index>(pos.size()), c.heads);
  const Index group = c.heads / c.kv_heads;
  for (Index h = 0; h < c.heads; ++h) {
    const Index g = h / group;
    const auto e = exact.compute(Q.middleCols(h * c.d, c.d), K.middleCols(g * c.d, c.d),
                                 V.middleCols(g * c.dv, c.dv));
    for (std::size_t i = 0; i < pos.size(); ++i) {
      ref.block(static_cast<Index>(i), h * c.dv, 1, c.dv) = e.output.row(pos[i]);
      ref_lse(static_cast<Index>(i), h) = e.lse(pos[i]);
    }
  }
  RingErrors err;
  if (!pos.empty()) {
    err.rel = static_cast<double>((r.output - ref).norm() / ref.norm());
    err.lse = static_cast<double>((r.lse - ref_lse).cwiseAbs().maxCoeff());
  }
  return err;
}

const char* sharding_name(mpi::Sharding s) {
  return s == mpi::Sharding::Striped ? "striped" : "contiguous";
}

}  // namespace

TEST_CASE("ring attention equals single-process exact attention (float)", "[mpi]") {
  const int P = world_size();
  double worst = 0;
  for (const bool causal : {false, true})
    for (const auto sh : {mpi::Sharding::Contiguous, mpi::Sharding::Striped})
      for (const Index N : {Index(1), Index(7), Index(613)}) {
        if (N < P && sh == mpi::Sharding::Contiguous) continue;  // empty shards: own test
        RingCase c;
        c.N = N;
        c.causal = causal;
        c.sharding = sh;
        if (sh == mpi::Sharding::Contiguous && N >= 2 * P) c.lengths = uneven_lengths(N, P);
        const RingErrors e = ring_vs_oracle<float>(c, 11 + static_cast<std::uint64_t>(N));
        INFO("causal " << causal << ", " << sharding_name(sh) << ", N = " << N << ", rel " << e.rel
                       << ", lse " << e.lse);
        CHECK(e.rel <= 1e-5);
        CHECK(e.lse <= 1e-5);
        worst = std::max(worst, max_over_ranks(e.rel));
      }
  if (world_rank() == 0)
    std::printf("test_mpi: P = %d, float ring vs exact: max relative error %.3g\n", P, worst);
}

TEST_CASE("ring attention: chunks of more than 2048 query rows per rank (float)", "[mpi]") {
  const int P = world_size();
  for (const bool causal : {false, true})
    for (const auto sh : {mpi::Sharding::Contiguous, mpi::Sharding::Striped}) {
      RingCase c;
      c.N = 2100 * P + 3;
      c.d = 8;
      c.dv = 8;
      c.causal = causal;
      c.sharding = sh;
      const RingErrors e = ring_vs_oracle<float>(c, 5);
      INFO("causal " << causal << ", " << sharding_name(sh) << ", rel " << e.rel);
      CHECK(e.rel <= 1e-5);
      CHECK(e.lse <= 1e-5);
    }
}

TEST_CASE("ring attention with bf16 blocks (float) against fp32 exact attention", "[mpi][bf16]") {
  double worst = 0, least = 1, worst_lse = 0;
  for (const bool causal : {false, true})
    for (const auto sh : {mpi::Sharding::Contiguous, mpi::Sharding::Striped}) {
      RingCase c;
      c.N = 613;
      c.causal = causal;
      c.sharding = sh;
      c.bf16 = true;
      const RingErrors e = ring_vs_oracle<float>(c, 23);
      INFO("causal " << causal << ", " << sharding_name(sh) << ", rel " << e.rel << ", lse "
                     << e.lse);
      // bf16 keeps 8 significand bits (docs/bf16.md: 1.8e-3 to 4e-3 on the
      // shared workloads, target 1e-2); the fp32 ring is ~5e-7 here, so an error above 1e-5 also
      // shows that the bf16 kernel ran. Measured (avx512bf16 path, N = 613, d = 16, entries of
      // sd 1.5): 3.9e-3 to 6.2e-3 relative at 1, 2 and 4 ranks, lse within 0.0245 (logits up to
      // about 10, so 8-bit rounding of the scores moves lse by a few hundredths).
      CHECK(e.rel <= 1e-2);
      CHECK(e.rel >= 1e-5);
      CHECK(e.lse <= 5e-2);
      worst = std::max(worst, max_over_ranks(e.rel));
      least = std::min(least, e.rel);
      worst_lse = std::max(worst_lse, max_over_ranks(e.lse));
    }
  if (world_rank() == 0)
    std::printf(
        "test_mpi: P = %d, bf16 ring (%s) vs fp32 exact: relative error %.3g..%.3g, lse %.3g\n",
        world_size(), active_isa(), least, worst, worst_lse);
  mpi::RingOptions o;
  o.bf16 = true;
  CHECK_THROWS_AS(mpi::RingAttention<double>(MPI_COMM_WORLD, o), effattn::invalid_argument);
}

TEST_CASE("ring attention in double agrees to 1e-12", "[mpi]") {
  const int P = world_size();
  double worst = 0;
  for (const bool causal : {false, true})
    for (const auto sh : {mpi::Sharding::Contiguous, mpi::Sharding::Striped}) {
      RingCase c;
      c.N = 301;
      c.d = 24;
      c.dv = 12;
      c.causal = causal;
      c.sharding = sh;
      if (sh == mpi::Sharding::Contiguous) c.lengths = uneven_lengths(c.N, P);
      const RingErrors e = ring_vs_oracle<double>(c, 99);
      INFO("causal " << causal << ", " << sharding_name(sh) << ", rel " << e.rel);
      CHECK(e.rel <= 1e-12);
      CHECK(e.lse <= 1e-12);
      worst = std::max(worst, max_over_ranks(e.rel));
    }
  if (world_rank() == 0)
    std::printf("test_mpi: P = %d, double ring vs exact: max relative error %.3g\n", P, worst);
}

TEST_CASE("ring attention: GQA heads in the packed layout", "[mpi]") {
  for (const bool causal : {false, true})
    for (const auto sh : {mpi::Sharding::Contiguous, mpi::Sharding::Striped}) {
      RingCase c;
      c.N = 203;
      c.heads = 4;
      c.kv_heads = 2;
      c.d = 8;
      c.dv = 6;
      c.causal = causal;
      c.sharding = sh;
      const RingErrors e = ring_vs_oracle<float>(c, 3);
      INFO("causal " << causal << ", " << sharding_name(sh) << ", rel " << e.rel);
      CHECK(e.rel <= 1e-5);
      CHECK(e.lse <= 1e-5);
    }
}

TEST_CASE("ring attention: empty shards and both progress modes", "[mpi]") {
  const int P = world_size();
  // Rank 0 holds nothing, the last rank most of the sequence.
  RingCase c;
  c.N = 97;
  c.lengths.assign(static_cast<std::size_t>(P), 0);
  for (int p = 1; p < P; ++p) c.lengths[static_cast<std::size_t>(p)] = p;
  c.lengths.back() += c.N - (P - 1) * P / 2;
  for (const bool causal : {false, true}) {
    c.causal = causal;
    const RingErrors e = ring_vs_oracle<float>(c, 21);
    CHECK(e.rel <= 1e-5);
  }
  // The progress driver does not change the arithmetic.
  c.lengths.clear();
  c.N = 500;
  c.causal = true;
  c.sharding = mpi::Sharding::Striped;
  Matrix<float> a, b;
  c.progress = mpi::Progress::Poll;
  (void)ring_vs_oracle<float>(c, 8, &a);
  c.progress = mpi::Progress::Thread;
  (void)ring_vs_oracle<float>(c, 8, &b);
  CHECK(a == b);
}

TEST_CASE("ring attention: a bad rank makes every rank throw the same message", "[mpi]") {
  const int P = world_size(), me = world_rank(), bad = P - 1;
  const Index N = 40, d = 8;
  const std::vector<Index> pos = mpi::shard_positions(N, P, me, mpi::Sharding::Striped);
  Matrix<float> Q = take_rows(gaussian<float>(N, d, 1), pos);
  Matrix<float> K = take_rows(gaussian<float>(N, d, 2), pos);
  const Matrix<float> V = take_rows(gaussian<float>(N, d, 3), pos);
  mpi::RingOptions o;
  o.sharding = mpi::Sharding::Striped;
  o.causal = true;
  const mpi::RingAttention<float> ring(MPI_COMM_WORLD, o);
  auto message_of = [&](auto&& call) {
    try {
      call();
    } catch (const effattn::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  auto same_everywhere = [&](const std::string& msg) {
    // Every rank got the same message: compare lengths and a checksum.
    long long mine[2] = {static_cast<long long>(msg.size()), 0};
    for (const char ch : msg) mine[1] = mine[1] * 131 + static_cast<unsigned char>(ch);
    long long lo[2], hi[2];
    MPI_Allreduce(mine, lo, 2, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(mine, hi, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    return lo[0] == hi[0] && lo[1] == hi[1];
  };
  // A NaN on the last rank only.
  Matrix<float> Kbad = K;
  if (me == bad) Kbad(0, 0) = std::numeric_limits<float>::quiet_NaN();
  std::string msg = message_of([&] { (void)ring.compute(Q, Kbad, V); });
  INFO(msg);
  CHECK(msg.find("rank " + std::to_string(bad)) != std::string::npos);
  CHECK(msg.find("K_local") != std::string::npos);
  CHECK(same_everywhere(msg));
  // A width that differs on one rank.
  const Matrix<float> Qwide = me == bad ? Matrix<float>::Zero(Q.rows(), d + 1) : Q;
  msg = message_of([&] { (void)ring.compute(Qwide, K, V); });
  INFO(msg);
  CHECK(msg.find(P > 1 ? "rank " + std::to_string(bad) : std::string("widths")) !=
        std::string::npos);
  CHECK(same_everywhere(msg));
  // Striped shards of the wrong size (one more token on the last rank).
  if (P > 1) {
    const Matrix<float> Qx = me == bad ? gaussian<float>(Q.rows() + 1, d, 4) : Q;
    const Matrix<float> Kx = me == bad ? gaussian<float>(Q.rows() + 1, d, 5) : K;
    const Matrix<float> Vx = me == bad ? gaussian<float>(Q.rows() + 1, d, 6) : V;
    msg = message_of([&] { (void)ring.compute(Qx, Kx, Vx); });
    INFO(msg);
    CHECK(msg.find("striped") != std::string::npos);
    CHECK(same_everywhere(msg));
  }
  // Options that differ on one rank.
  if (P > 1) {
    mpi::RingOptions o2 = o;
    if (me == bad) o2.causal = false;
    const mpi::RingAttention<float> ring2(MPI_COMM_WORLD, o2);
    msg = message_of([&] { (void)ring2.compute(Q, K, V); });
    CHECK(msg.find("different options") != std::string::npos);
    CHECK(same_everywhere(msg));
  }
  // Invalid options on one rank: the (collective) constructor throws everywhere.
  mpi::RingOptions o3 = o;
  if (me == bad) o3.layout = {3, 2};
  msg = message_of([&] { mpi::RingAttention<float> r3(MPI_COMM_WORLD, o3); });
  CHECK(msg.find("kv_heads") != std::string::npos);
  CHECK(same_everywhere(msg));
  // The communicator is still usable afterwards.
  const auto r = ring.compute(Q, K, V);
  CHECK(r.info == Info::Success);
}

namespace {

/// The oracle union: single-process compress_kv of every shard with rank p's seed, stacked.
template <typename S>
CompressedKV<S> stacked_oracle(const Matrix<S>& K, const Matrix<S>& V, int P, double q_radius,
                               const WildcatOptions& opts, std::vector<Index>* part_rows,
                               std::vector<Index>* part_blocks) {
  CompressedKV<S> u;
  u.keys.resize(0, K.cols());
  u.values.resize(0, V.cols());
  u.vmin = V.colwise().minCoeff();
  u.vmax = V.colwise().maxCoeff();
  Index tok = 0;
  for (int p = 0; p < P; ++p) {
    const std::vector<Index> pos = mpi::shard_positions(K.rows(), P, p, mpi::Sharding::Contiguous);
    WildcatOptions o = opts;
    o.seed = derive_seed(opts.seed, static_cast<std::uint64_t>(p));
    const CompressedKV<S> c = compress_kv(take_rows(K, pos), take_rows(V, pos), q_radius, o);
    const Index r0 = u.size(), r = c.size();
    u.keys.conservativeResize(r0 + r, Eigen::NoChange);
    u.values.conservativeResize(r0 + r, Eigen::NoChange);
    u.weights.conservativeResize(r0 + r);
    u.log_scale.conservativeResize(r0 + r);
    u.keys.bottomRows(r) = c.keys;
    u.values.bottomRows(r) = c.values;
    u.weights.tail(r) = c.weights;
    u.log_scale.tail(r) = c.log_scale;
    for (const Index piv : c.pivots) u.pivots.push_back(piv + tok);
    for (WildcatBlock b : c.blocks) {
      b.row_begin += r0;
      b.first_token += tok;
      u.blocks.push_back(b);
    }
    tok += static_cast<Index>(pos.size());
    if (part_rows != nullptr) part_rows->push_back(r);
    if (part_blocks != nullptr) part_blocks->push_back(static_cast<Index>(c.blocks.size()));
  }
  u.tokens = tok;
  u.tail_begin = u.size();
  return u;
}

}  // namespace

TEST_CASE("distributed WildCat equals compress_kv per shard, stacked", "[mpi][wildcat]") {
  const int P = world_size(), me = world_rank();
  const Index N = 1200, d = 16, dv = 8;  // even shards: no remainder bin
  const Matrix<float> Q = gaussian<float>(N, d, 31, 0.5);
  const Matrix<float> K = gaussian<float>(N, d, 32, 0.5);
  const Matrix<float> V = gaussian<float>(N, dv, 33);
  const std::vector<Index> pos = mpi::shard_positions(N, P, me, mpi::Sharding::Contiguous);
  WildcatOptions o;
  o.rank = 32;
  o.bins = 2;

  mpi::GatherStats st;
  const CompressedKV<float> u =
      mpi::compress_kv(MPI_COMM_WORLD, take_rows(K, pos), take_rows(V, pos), 1.0, o, &st);
  std::vector<Index> rows, blocks;
  const CompressedKV<float> ref = stacked_oracle<float>(K, V, P, 1.0, o, &rows, &blocks);
  CHECK(u.size() == ref.size());
  CHECK(u.tokens == N);
  CHECK(u.keys == ref.keys);
  CHECK(u.values == ref.values);
  CHECK(u.weights == ref.weights);
  CHECK(u.log_scale == ref.log_scale);
  CHECK(u.vmin == ref.vmin);
  CHECK(u.vmax == ref.vmax);
  CHECK(u.pivots == ref.pivots);
  CHECK(u.blocks.size() == ref.blocks.size());

  // Bytes: exactly the serialised coresets, O(P r d), independent of N.
  std::int64_t expect = 0;
  for (int p = 0; p < P; ++p)
    expect += mpi::coreset_bytes(rows[static_cast<std::size_t>(p)],
                                 blocks[static_cast<std::size_t>(p)], d, dv, sizeof(float));
  CHECK(st.bytes_gathered == expect);
  CHECK(st.bytes_received == expect - st.bytes_local + 8 * (P - 1));
  const std::int64_t per_row = static_cast<std::int64_t>((d + dv + 2) * sizeof(float) + 8);
  const std::int64_t bound = P * (64 + 2 * dv * 4) + u.size() * per_row +
                             static_cast<std::int64_t>(u.blocks.size()) * 8 * (d + 8);
  CHECK(st.bytes_gathered <= bound);
  CHECK(u.size() <= P * (o.rank + o.rank / o.bins + 1));
  // Four times the tokens per rank, same budget: the same traffic.
  const Index N4 = 4 * N;
  const Matrix<float> K4 = gaussian<float>(N4, d, 42, 0.5), V4 = gaussian<float>(N4, dv, 43);
  const std::vector<Index> pos4 = mpi::shard_positions(N4, P, me, mpi::Sharding::Contiguous);
  mpi::GatherStats st4;
  const CompressedKV<float> u4 =
      mpi::compress_kv(MPI_COMM_WORLD, take_rows(K4, pos4), take_rows(V4, pos4), 1.0, o, &st4);
  CHECK(u4.size() == u.size());
  CHECK(st4.bytes_gathered == st.bytes_gathered);
  CHECK(st4.bytes_gathered * 20 < N4 * (d + dv) * static_cast<std::int64_t>(sizeof(float)));
  if (me == 0)
    std::printf(
        "test_mpi: P = %d, WildCat all-gather: r = %ld coreset rows, %ld bytes gathered at N = "
        "%ld and at N = %ld (raw K, V: %ld bytes)\n",
        P, static_cast<long>(u.size()), static_cast<long>(st.bytes_gathered), static_cast<long>(N),
        static_cast<long>(N4),
        static_cast<long>(N4 * (d + dv) * static_cast<Index>(sizeof(float))));

  // The forward: this rank's queries over the union, as weighted_attention over the oracle.
  const auto res = mpi::wildcat_attention(MPI_COMM_WORLD, take_rows(Q, pos), take_rows(K, pos),
                                          take_rows(V, pos), o);
  const double rq = std::sqrt(Q.cast<double>().rowwise().squaredNorm().maxCoeff());
  const CompressedKV<float> ref2 = stacked_oracle<float>(K, V, P, rq, o, nullptr, nullptr);
  const auto all = weighted_attention(Q, ref2, o);
  CHECK(res.info == Info::Success);
  if (!pos.empty()) CHECK((res.output - take_rows(all.output, pos)).cwiseAbs().maxCoeff() <= 1e-6f);
  CHECK(res.global_error_bound == Approx(all.error_bound).epsilon(1e-9));
  double local_max = 0;
  for (const Index p : pos) local_max = std::max(local_max, all.row_error_bound(p));
  CHECK(res.error_bound == Approx(local_max).epsilon(1e-9));
  // The bound holds against exact attention.
  const Matrix<float> exact = ExactAttention<float>()(Q, K, V);
  const double err =
      static_cast<double>((res.output - take_rows(exact, pos)).cwiseAbs().maxCoeff());
  CHECK(err <= res.error_bound + 1e-5);

  // Bad input on one rank: every rank throws.
  Matrix<float> Vbad = take_rows(V, pos);
  if (me == P - 1 && Vbad.rows() > 0) Vbad(0, 0) = std::numeric_limits<float>::infinity();
  bool threw = false;
  try {
    (void)mpi::compress_kv(MPI_COMM_WORLD, take_rows(K, pos), Vbad, 1.0, o);
  } catch (const effattn::invalid_argument& e) {
    threw = std::string(e.what()).find("V_local") != std::string::npos;
  }
  CHECK(threw);
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  Catch::Session session;
  int rc = session.applyCommandLine(argc, argv);
  if (rc == 0) rc = session.run();
  int worst = rc;
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
