/// \file mpi_coreset.hpp
/// \brief Internal: distributed WildCat over MPI: the serialisation of WildCat coresets
/// (`coreset_bytes`, `detail::serialise`, `detail::append_serialised`) and `mpi::compress_kv` /
/// `mpi::wildcat_attention`, which gather them. Include <effattn/distributed/mpi.hpp> instead.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../wildcat.hpp"
#include "../mpi.hpp"
#include "mpi_impl.hpp"

namespace effattn {
namespace mpi {

inline std::int64_t coreset_bytes(Index r, Index blocks, Index d, Index dv, Index scalar_bytes) {
  return 64 + scalar_bytes * (r * (d + dv + 2) + 2 * dv) + 8 * r + 8 * blocks * (d + 8);
}

namespace detail {

/// Appends the bytes of `x` to `out`.
template <typename T>
void put(std::vector<char>& out, const T* x, std::size_t count) {
  const std::size_t at = out.size();
  out.resize(at + count * sizeof(T));
  if (count > 0) std::memcpy(out.data() + at, x, count * sizeof(T));
}

/// Reads `count` values of T at `pos` (advancing it).
template <typename T>
void get(const char* data, std::size_t& pos, T* x, std::size_t count) {
  if (count > 0) std::memcpy(x, data + pos, count * sizeof(T));
  pos += count * sizeof(T);
}

/// Serialises a coreset (header, scalars, pivots, blocks): `coreset_bytes` bytes.
template <typename Scalar>
std::vector<char> serialise(const CompressedKV<Scalar>& c, bool ok, Index d, Index dv) {
  const Index r = c.size(), nb = static_cast<Index>(c.blocks.size());
  std::vector<char> out;
  out.reserve(static_cast<std::size_t>(coreset_bytes(r, nb, d, dv, sizeof(Scalar))));
  const std::int64_t head[8] = {ok ? 1 : 0, r, d, dv, nb, c.tokens, 0, 0};
  put(out, head, 8);
  put(out, c.keys.data(), static_cast<std::size_t>(r * d));
  put(out, c.values.data(), static_cast<std::size_t>(r * dv));
  put(out, c.weights.data(), static_cast<std::size_t>(r));
  put(out, c.log_scale.data(), static_cast<std::size_t>(r));
  RowVector<Scalar> lo = RowVector<Scalar>::Constant(dv, std::numeric_limits<Scalar>::infinity());
  RowVector<Scalar> hi = -lo;
  if (c.tokens > 0 && c.vmin.size() == dv) {
    lo = c.vmin;
    hi = c.vmax;
  }
  put(out, lo.data(), static_cast<std::size_t>(dv));
  put(out, hi.data(), static_cast<std::size_t>(dv));
  std::vector<std::int64_t> piv(c.pivots.begin(), c.pivots.end());
  put(out, piv.data(), piv.size());
  for (const WildcatBlock& b : c.blocks) {
    const double meta[8] = {static_cast<double>(b.row_begin),
                            static_cast<double>(b.rows),
                            static_cast<double>(b.first_token),
                            static_cast<double>(b.tokens),
                            b.exact ? 1.0 : 0.0,
                            b.key_radius,
                            b.tau2,
                            b.log_residual_trace};
    put(out, meta, 8);
    put(out, b.centre.data(), static_cast<std::size_t>(d));
  }
  return out;
}

/// Appends a serialised coreset to the union `u` (rows, pivots and blocks shifted by the rows
/// and tokens already in it). \returns the part's `ok` flag.
template <typename Scalar>
bool append_serialised(const char* data, CompressedKV<Scalar>& u) {
  std::size_t pos = 0;
  std::int64_t head[8];
  get(data, pos, head, 8);
  const Index r = head[1], d = head[2], dv = head[3], nb = head[4], tokens = head[5];
  const Index row = u.size(), tok = u.tokens;
  u.keys.conservativeResize(row + r, d);
  u.values.conservativeResize(row + r, dv);
  u.weights.conservativeResize(row + r);
  u.log_scale.conservativeResize(row + r);
  Matrix<Scalar> keys(r, d), values(r, dv);
  Vector<Scalar> w(r), ls(r);
  get(data, pos, keys.data(), static_cast<std::size_t>(r * d));
  get(data, pos, values.data(), static_cast<std::size_t>(r * dv));
  get(data, pos, w.data(), static_cast<std::size_t>(r));
  get(data, pos, ls.data(), static_cast<std::size_t>(r));
  u.keys.bottomRows(r) = keys;
  u.values.bottomRows(r) = values;
  u.weights.tail(r) = w;
  u.log_scale.tail(r) = ls;
  RowVector<Scalar> lo(dv), hi(dv);
  get(data, pos, lo.data(), static_cast<std::size_t>(dv));
  get(data, pos, hi.data(), static_cast<std::size_t>(dv));
  u.vmin = u.vmin.cwiseMin(lo);
  u.vmax = u.vmax.cwiseMax(hi);
  std::vector<std::int64_t> piv(static_cast<std::size_t>(r));
  get(data, pos, piv.data(), piv.size());
  for (const std::int64_t p : piv) u.pivots.push_back(static_cast<Index>(p) + tok);
  for (Index b = 0; b < nb; ++b) {
    double meta[8];
    get(data, pos, meta, 8);
    WildcatBlock blk;
    blk.row_begin = static_cast<Index>(meta[0]) + row;
    blk.rows = static_cast<Index>(meta[1]);
    blk.first_token = static_cast<Index>(meta[2]) + tok;
    blk.tokens = static_cast<Index>(meta[3]);
    blk.exact = meta[4] != 0;
    blk.key_radius = meta[5];
    blk.tau2 = meta[6];
    blk.log_residual_trace = meta[7];
    blk.centre.resize(d);
    get(data, pos, blk.centre.data(), static_cast<std::size_t>(d));
    u.blocks.push_back(std::move(blk));
  }
  u.tokens = tok + tokens;
  u.tail_begin = u.size();
  return head[0] != 0;
}

}  // namespace detail

template <typename PivotRule, typename DK, typename DV>
CompressedKV<typename DK::Scalar> compress_kv(MPI_Comm comm, const Eigen::MatrixBase<DK>& K_local,
                                              const Eigen::MatrixBase<DV>& V_local, double q_radius,
                                              const WildcatOptions& opts, GatherStats* stats) {
  using Scalar = typename DK::Scalar;
  static_assert(
      effattn::detail::is_supported_scalar_v<Scalar> && std::is_same_v<Scalar, typename DV::Scalar>,
      "effattn: mpi::compress_kv needs K and V of the same scalar, float or double");
  using detail::global_check;
  using effattn::detail::cat;
  constexpr const char* who = "mpi::compress_kv";
  const double t0 = detail::now();
  int P = 1, me = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &me);
  const ConstRef<Scalar> K(K_local), V(V_local);
  // The options with a deprecated spelling folded in; a disagreement of the two spellings is
  // reported below, collectively, by check_wildcat_options.
  WildcatOptions resolved = opts;
  try {
    resolved = effattn::detail::resolve_renamed(opts, who);
  } catch (const effattn::invalid_argument&) {
  }
  const std::vector<std::int64_t> mine = {K.rows(),
                                          K.cols(),
                                          V.rows(),
                                          V.cols(),
                                          opts.rank,
                                          opts.bins,
                                          static_cast<std::int64_t>(opts.seed),
                                          opts.clip ? 1 : 0,
                                          opts.temperature ? 1 : 0,
                                          resolved.proposal_block,
                                          static_cast<std::int64_t>(opts.fallback),
                                          detail::bits_of(opts.scale),
                                          detail::bits_of(opts.rel_tol),
                                          detail::bits_of(opts.q_radius),
                                          detail::bits_of(opts.denominator_tol),
                                          detail::bits_of(q_radius)};
  const std::size_t f = mine.size();
  const std::vector<std::int64_t> all = detail::allgather(comm, mine);
  Index N = 0;
  for (int p = 0; p < P; ++p) {
    for (std::size_t i = 4; i < f; ++i)
      global_check(
          all[p * f + i] == all[i], who,
          cat("rank ", p, " passed different options or q_radius than rank 0 (they must agree)"));
    global_check(all[p * f + 1] == all[1] && all[p * f + 3] == all[3], who,
                 cat("rank ", p, " has K_local, V_local widths ", all[p * f + 1], ", ",
                     all[p * f + 3], " but rank 0 has ", all[1], ", ", all[3]));
    global_check(all[p * f + 0] == all[p * f + 2], who,
                 cat("rank ", p, ": V_local must have K_local's rows; got K ", all[p * f], " x ",
                     all[p * f + 1], ", V ", all[p * f + 2], " x ", all[p * f + 3]));
    N += static_cast<Index>(all[p * f]);
  }
  global_check(N >= 1 && all[1] >= 1 && all[3] >= 1, who,
               cat("need N >= 1 tokens over all ranks and widths d, dv >= 1; got N = ", N,
                   ", d = ", all[1], ", dv = ", all[3]));
  const Index d = K.cols(), dv = V.cols();
  detail::collective_check(comm, who, [&] {
    effattn::detail::check_wildcat_options(opts, who);
    EFFATTN_CHECK(std::isfinite(q_radius) && q_radius >= 0,
                  cat(who, ": q_radius must be finite and >= 0; got ", q_radius));
    effattn::detail::check_finite(K, "K_local");
    effattn::detail::check_finite(V, "V_local");
  });

  // This rank's coreset, serialised.
  CompressedKV<Scalar> local;
  bool ok = true;
  if (K.rows() > 0) {
    WildcatOptions o = opts;
    o.seed = derive_seed(opts.seed, static_cast<std::uint64_t>(me));
    local = effattn::compress_kv<PivotRule>(K, V, q_radius, o);
    ok = local.size() > 0;
  } else {
    local.keys.resize(0, d);
    local.values.resize(0, dv);
  }
  const std::vector<char> bytes = detail::serialise(local, ok, d, dv);

  // All-gather: the sizes, then the coresets.
  std::vector<std::int64_t> sizes =
      detail::allgather(comm, {static_cast<std::int64_t>(bytes.size())});
  std::vector<int> counts(static_cast<std::size_t>(P)), displs(static_cast<std::size_t>(P));
  std::int64_t total = 0;
  for (int p = 0; p < P; ++p) {
    displs[static_cast<std::size_t>(p)] = static_cast<int>(total);
    counts[static_cast<std::size_t>(p)] = static_cast<int>(sizes[static_cast<std::size_t>(p)]);
    total += sizes[static_cast<std::size_t>(p)];
  }
  global_check(total <= INT_MAX, who, "the gathered coresets exceed 2^31 - 1 bytes");
  std::vector<char> gathered(static_cast<std::size_t>(total));
  MPI_Allgatherv(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, gathered.data(),
                 counts.data(), displs.data(), MPI_BYTE, comm);

  CompressedKV<Scalar> u;
  u.keys.resize(0, d);
  u.values.resize(0, dv);
  u.vmin = RowVector<Scalar>::Constant(dv, std::numeric_limits<Scalar>::infinity());
  u.vmax = -u.vmin;
  bool all_ok = true;
  for (int p = 0; p < P; ++p)
    all_ok = detail::append_serialised(gathered.data() + displs[static_cast<std::size_t>(p)], u) &&
             all_ok;
  if (!all_ok) u = CompressedKV<Scalar>();
  if (stats != nullptr) {
    stats->bytes_local = static_cast<std::int64_t>(bytes.size());
    stats->bytes_gathered = total;
    stats->bytes_received = total - stats->bytes_local + 8 * (P - 1);
    stats->seconds = detail::now() - t0;
  }
  return u;
}

template <typename PivotRule, typename DQ, typename DK, typename DV>
WildcatShardResult<typename DQ::Scalar> wildcat_attention(MPI_Comm comm,
                                                          const Eigen::MatrixBase<DQ>& Q_local,
                                                          const Eigen::MatrixBase<DK>& K_local,
                                                          const Eigen::MatrixBase<DV>& V_local,
                                                          const WildcatOptions& opts) {
  using Scalar = typename DQ::Scalar;
  using effattn::detail::cat;
  constexpr const char* who = "mpi::wildcat_attention";
  const ConstRef<Scalar> Q(Q_local);
  // Query widths must agree with the key width on every rank (checked collectively).
  detail::collective_check(comm, who, [&] {
    EFFATTN_CHECK(Q.cols() == K_local.cols(),
                  cat(who, ": Q_local must be n x d with d = K_local.cols() = ", K_local.cols(),
                      "; got Q_local ", effattn::detail::shape(Q)));
    effattn::detail::check_finite(Q, "Q_local");
  });
  double rq = opts.q_radius;
  if (!(rq > 0)) {
    rq = Q.rows() > 0 ? std::sqrt(Q.template cast<double>().rowwise().squaredNorm().maxCoeff())
                      : 0.0;
    MPI_Allreduce(MPI_IN_PLACE, &rq, 1, MPI_DOUBLE, MPI_MAX, comm);
  }
  WildcatShardResult<Scalar> res;
  const CompressedKV<Scalar> u =
      mpi::compress_kv<PivotRule>(comm, K_local, V_local, rq, opts, &res.gather);
  if (u.size() == 0) {
    res.output = Matrix<Scalar>::Constant(Q.rows(), V_local.cols(),
                                          std::numeric_limits<Scalar>::quiet_NaN());
    res.info = Info::NumericalIssue;
  } else if (Q.rows() > 0) {
    static_cast<WildcatResult<Scalar>&>(res) = effattn::weighted_attention(Q, u, opts);
  } else {
    res.output.resize(0, V_local.cols());
    res.info = Info::Success;
    res.pivots = u.pivots;
    res.rank = u.size();
    res.bins = static_cast<Index>(u.blocks.size());
    res.blocks = u.blocks;
  }
  double b = res.error_bound;
  MPI_Allreduce(MPI_IN_PLACE, &b, 1, MPI_DOUBLE, MPI_MAX, comm);
  res.global_error_bound = b;
  return res;
}

}  // namespace mpi
}  // namespace effattn
