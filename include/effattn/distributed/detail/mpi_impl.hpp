/// \file mpi_impl.hpp
/// \brief Internals of effattn/distributed/mpi.hpp: the collective error model and the ring loop
/// with its progress driver. The serialisation of WildCat coresets and distributed WildCat are in
/// `mpi_coreset.hpp`, included at the end. Not a public header.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/online_softmax.hpp"
#include "../../core/random.hpp"
#include "../../core/types.hpp"
#include "../../detail/methods/exact_impl.hpp"  // also with EFFATTN_COMPILED, which leaves it out of exact.hpp
#include "../../wildcat.hpp"
#include "../mpi.hpp"

namespace effattn {
namespace mpi {
namespace detail {

using effattn::detail::cat;

/// The MPI datatype of a float or double.
template <typename Scalar>
MPI_Datatype mpi_type() {
  return std::is_same_v<Scalar, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// Seconds on a monotonic clock. Not MPI_Wtime: with the progress thread running, the calling
/// thread must make no MPI call at all (MPI_THREAD_SERIALIZED).
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The bits of a double, to compare options exactly across ranks.
inline std::int64_t bits_of(double x) {
  std::int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// Every rank's `mine` (the same length on every rank), rank after rank.
inline std::vector<std::int64_t> allgather(MPI_Comm comm, const std::vector<std::int64_t>& mine) {
  int ranks = 1;
  MPI_Comm_size(comm, &ranks);
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(ranks));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_INT64_T, all.data(),
                static_cast<int>(mine.size()), MPI_INT64_T, comm);
  return all;
}

/// The collective error model: runs `fn` (local checks that may throw effattn::invalid_argument)
/// on every rank; if it threw anywhere, every rank throws the message of the lowest failing
/// rank, prefixed with `who` and that rank. One MPI_Allreduce when nothing failed, plus two
/// MPI_Bcast otherwise. Every rank must call it (it is a collective).
template <typename Fn>
void collective_check(MPI_Comm comm, const char* who, Fn&& fn) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::string msg;
  int first = INT_MAX;
  try {
    fn();
  } catch (const effattn::invalid_argument& e) {
    msg = e.what();
    first = rank;
  }
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == INT_MAX) return;
  long long len = static_cast<long long>(msg.size());
  MPI_Bcast(&len, 1, MPI_LONG_LONG, first, comm);
  msg.resize(static_cast<std::size_t>(len));
  MPI_Bcast(msg.data(), static_cast<int>(len), MPI_CHAR, first, comm);
  const std::string prefix = "effattn: ";
  if (msg.compare(0, prefix.size(), prefix) == 0) msg.erase(0, prefix.size());
  effattn::detail::throw_invalid_argument(cat(who, " (rank ", first, "): ", msg));
}

/// The same check on data every rank holds (exchanged shapes): throws the same message on every
/// rank without communication.
inline void global_check(bool ok, const char* who, const std::string& msg) {
  if (!ok) effattn::detail::throw_invalid_argument(cat(who, ": ", msg));
}

/// Drives the two requests of each ring step to completion while the caller computes.
///
/// Thread mode: one helper thread per `compute` call (started before the first step, so its
/// creation never lands inside a step) calls MPI_Testall every `poll_us` microseconds while a
/// step's requests are pending (every millisecond when idle) and never otherwise. The caller and
/// the helper are never in MPI at once (MPI_THREAD_SERIALIZED): the caller posts before raising
/// `active` and, to take MPI back, lowers `active` and waits until the helper is out of MPI; the
/// helper raises `in_mpi` before reading `active` (sequentially consistent atomics, so one of
/// the two always sees the other's flag). No locks and no wake-ups of the caller: on a loaded
/// machine a blocked caller can lose its core for a whole time slice. Poll mode: the caller
/// calls `poll()` between chunks. Accumulates the caller's MPI time (posting, polls, waiting)
/// in `exposed`.
class RingExchange {
 public:
  RingExchange(bool use_thread, int poll_us, double& exposed)
      : m_thread(use_thread), m_poll_us(poll_us), m_exposed(exposed) {
    if (m_thread) m_helper = std::thread([this] { helper(); });
  }
  RingExchange(const RingExchange&) = delete;
  RingExchange& operator=(const RingExchange&) = delete;
  ~RingExchange() {
    if (m_helper.joinable()) {
      m_active.store(false);
      m_quit.store(true);
      m_helper.join();
    }
  }

  /// Posts MPI_Irecv(recv) and MPI_Isend(send) and hands them to the helper thread.
  void post(void* recv, int recv_count, int from, const void* send, int send_count, int to,
            MPI_Datatype type, MPI_Comm comm) {
    const double t = now();
    constexpr int kTag = 0x7e11;
    MPI_Irecv(recv, recv_count, type, from, kTag, comm, &m_req[0]);
    MPI_Isend(send, send_count, type, to, kTag, comm, &m_req[1]);
    m_pending = true;
    if (m_thread) {
      m_done.store(false);
      m_active.store(true);
    }
    m_exposed += now() - t;
  }

  /// Poll mode: one MPI_Testall (no-op in thread mode or when nothing is pending).
  void poll() {
    if (m_thread || !m_pending) return;
    const double t = now();
    int flag = 0;
    MPI_Testall(2, m_req, &flag, MPI_STATUSES_IGNORE);
    if (flag != 0) m_pending = false;
    m_exposed += now() - t;
  }

  /// Waits for both requests (the exposed part of the communication).
  void finish() {
    if (!m_pending) return;
    const double t = now();
    if (m_thread) {
      m_active.store(false);
      while (m_in_mpi.load()) std::this_thread::yield();
    }
    if (!(m_thread && m_done.load())) MPI_Waitall(2, m_req, MPI_STATUSES_IGNORE);
    m_pending = false;
    m_exposed += now() - t;
  }

 private:
  void helper() {
    while (!m_quit.load()) {
      bool busy = false;
      m_in_mpi.store(true);
      if (m_active.load() && !m_done.load()) {
        busy = true;
        int flag = 0;
        MPI_Testall(2, m_req, &flag, MPI_STATUSES_IGNORE);
        if (flag != 0) {
          m_done.store(true);
          busy = false;
        }
      }
      m_in_mpi.store(false);
      std::this_thread::sleep_for(std::chrono::microseconds(busy ? m_poll_us : 1000));
    }
  }

  bool m_thread;
  int m_poll_us;
  double& m_exposed;
  MPI_Request m_req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool m_pending = false;
  std::atomic<bool> m_active{false}, m_done{false}, m_in_mpi{false}, m_quit{false};
  std::thread m_helper;
};

/// Merges a partial (o, lse) of rows into the running (O, L) of the same rows by log-sum-exp
/// (the split-KV merge of `core/online_softmax.hpp` with l = 1), or stores it when `first`.
template <typename Scalar, typename OutBlock, typename LseBlock>
void merge_into(bool first, Matrix<Scalar>&& o, const Vector<Scalar>& l, OutBlock&& O,
                LseBlock&& L) {
  if (first) {
    O = o;
    L = l;
    return;
  }
  const Index rows = o.rows();
  Matrix<Scalar> part_m(rows, 2);
  part_m.col(0) = L;
  part_m.col(1) = l;
  const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic> part_l =
      Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic>::Ones(rows, 2);
  std::vector<Matrix<Scalar>> part_acc(2);
  part_acc[0] = O;
  part_acc[1] = std::move(o);
  Matrix<Scalar> merged(rows, part_acc[0].cols());
  Vector<Scalar> lse(rows);
  effattn::detail::merge_split_states(part_m, part_l, part_acc, merged, lse);
  O = merged;
  L = lse;
}

/// Query rows per kernel call: the unit of polling and of the causal key range. A constant (16
/// automatic query blocks), so the arithmetic never depends on the thread count or progress mode.
constexpr Index kChunkRows = 2048;

}  // namespace detail

inline std::vector<Index> shard_positions(Index total, int ranks, int rank, Sharding sharding) {
  EFFATTN_CHECK(total >= 0 && ranks >= 1 && rank >= 0 && rank < ranks,
                effattn::detail::cat("mpi::shard_positions: need total >= 0 and 0 <= rank < ranks; "
                                     "got total = ",
                                     total, ", ranks = ", ranks, ", rank = ", rank));
  std::vector<Index> pos;
  if (sharding == Sharding::Striped) {
    for (Index t = rank; t < total; t += ranks) pos.push_back(t);
  } else {
    const Index base = total / ranks, extra = total % ranks;
    const Index begin = rank * base + std::min<Index>(rank, extra);
    const Index len = base + (rank < extra ? 1 : 0);
    for (Index t = 0; t < len; ++t) pos.push_back(begin + t);
  }
  return pos;
}

template <typename Scalar_>
RingAttention<Scalar_>::RingAttention(MPI_Comm comm, Options opts) : m_comm(comm), m_opts(opts) {
  detail::collective_check(m_comm, name, [&] {
    effattn::detail::check_scale_option(m_opts.scale, name);
    EFFATTN_CHECK(m_opts.block_q >= 0 && m_opts.block_k >= 0,
                  effattn::detail::cat(name, ": Options::block_q and block_k must be >= 0; got ",
                                       m_opts.block_q, ", ", m_opts.block_k));
    const HeadLayout& hl = m_opts.layout;
    EFFATTN_CHECK(
        hl.heads >= 1 && hl.kv_heads >= 0 && (hl.kv_heads == 0 || hl.heads % hl.kv_heads == 0),
        effattn::detail::cat(name,
                             ": Options::layout needs heads >= 1 and heads a multiple "
                             "of kv_heads (0 = heads); got heads = ",
                             hl.heads, ", kv_heads = ", hl.kv_heads));
    EFFATTN_CHECK((!m_opts.bf16 || std::is_same_v<Scalar, float>),
                  effattn::detail::cat(name, ": Options::bf16 needs Scalar = float"));
    EFFATTN_CHECK(m_opts.poll_interval_us >= 1,
                  effattn::detail::cat(name, ": Options::poll_interval_us must be >= 1; got ",
                                       m_opts.poll_interval_us));
    EFFATTN_CHECK(
        effattn::detail::is_one_of(m_opts.sharding, {Sharding::Contiguous, Sharding::Striped}) &&
            effattn::detail::is_one_of(m_opts.progress,
                                       {Progress::Auto, Progress::Thread, Progress::Poll}),
        effattn::detail::cat(name, ": Options::sharding or progress is not valid"));
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    EFFATTN_CHECK(m_opts.progress != Progress::Thread || level >= MPI_THREAD_SERIALIZED,
                  effattn::detail::cat(name,
                                       ": Progress::Thread needs MPI initialised with "
                                       "MPI_Init_thread(..., MPI_THREAD_SERIALIZED or higher)"));
  });
  if (m_opts.layout.kv_heads == 0) m_opts.layout.kv_heads = m_opts.layout.heads;
}

template <typename Scalar_>
typename RingAttention<Scalar_>::Result RingAttention<Scalar_>::compute(const Ref& Q, const Ref& K,
                                                                        const Ref& V) const {
  using detail::global_check;
  using effattn::detail::cat;
  const double t_start = detail::now();
  int P = 1, me = 0;
  MPI_Comm_size(m_comm, &P);
  MPI_Comm_rank(m_comm, &me);
  const Index H = m_opts.layout.heads, G = m_opts.layout.kv_heads;

  // ---- collective validation: shapes and options of every rank, then local checks ----
  const std::vector<std::int64_t> mine = {Q.rows(),
                                          Q.cols(),
                                          K.rows(),
                                          K.cols(),
                                          V.rows(),
                                          V.cols(),
                                          m_opts.causal ? 1 : 0,
                                          static_cast<std::int64_t>(m_opts.sharding),
                                          H,
                                          G,
                                          m_opts.block_q,
                                          m_opts.block_k,
                                          detail::bits_of(m_opts.scale)};
  const std::size_t f = mine.size();
  const std::vector<std::int64_t> all = detail::allgather(m_comm, mine);
  auto at = [&](int p, std::size_t i) { return static_cast<Index>(all[p * f + i]); };
  Index N = 0;
  std::vector<Index> rows(static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p) {
    for (std::size_t i = 6; i < f; ++i)
      global_check(all[p * f + i] == all[i], name,
                   cat("rank ", p,
                       " was built with different options than rank 0 (causal, "
                       "sharding, layout, block sizes and scale must agree)"));
    const Index qr = at(p, 0), qc = at(p, 1), kr = at(p, 2), kc = at(p, 3), vr = at(p, 4),
                vc = at(p, 5);
    global_check(qc == at(0, 1) && kc == at(0, 3) && vc == at(0, 5), name,
                 cat("rank ", p, " has Q_local, K_local, V_local widths ", qc, ", ", kc, ", ", vc,
                     " but rank 0 has ", at(0, 1), ", ", at(0, 3), ", ", at(0, 5),
                     " (widths must agree on every rank)"));
    global_check(
        qr == kr && kr == vr, name,
        cat("rank ", p, ": Q_local, K_local and V_local must have the same rows (the ",
            "rank's tokens); got Q ", qr, " x ", qc, ", K ", kr, " x ", kc, ", V ", vr, " x ", vc));
    rows[static_cast<std::size_t>(p)] = qr;
    N += qr;
  }
  const Index qc = at(0, 1), kc = at(0, 3), vc = at(0, 5);
  global_check(
      qc > 0 && qc % H == 0 && kc > 0 && kc % G == 0 && vc > 0 && vc % G == 0 && qc / H == kc / G,
      name,
      cat("need Q_local T x (heads d), K_local T x (kv_heads d), V_local T x (kv_heads "
          "dv) with heads = ",
          H, ", kv_heads = ", G, ", d, dv >= 1; got widths ", qc, ", ", kc, ", ", vc));
  global_check(N >= 1, name, "the sequence is empty on every rank (N = 0)");
  const Index d = qc / H, dv = vc / G, W = kc + vc;
  for (int p = 0; p < P; ++p) {
    const Index want = (N - p + P - 1) / P;
    global_check(m_opts.sharding != Sharding::Striped || rows[static_cast<std::size_t>(p)] == want,
                 name,
                 cat("striped sharding puts token t on rank t mod P, so rank ", p, " of ", P,
                     " must hold ceil((N - p) / P) = ", want, " of N = ", N, " tokens; it holds ",
                     rows[static_cast<std::size_t>(p)]));
    global_check(rows[static_cast<std::size_t>(p)] * W <= INT_MAX, name,
                 cat("rank ", p, "'s key/value block (", rows[static_cast<std::size_t>(p)], " x ",
                     W, ") exceeds the 2^31 - 1 elements of one MPI message"));
  }
  detail::collective_check(m_comm, name, [&] {
    effattn::detail::check_finite(Q, "Q_local");
    effattn::detail::check_finite(K, "K_local");
    effattn::detail::check_finite(V, "V_local");
  });

  Result res;
  res.global_tokens = N;
  res.stats.steps = P;
  res.stats.validate_seconds = detail::now() - t_start;
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  const bool use_thread =
      P > 1 && (m_opts.progress == Progress::Thread ||
                (m_opts.progress == Progress::Auto && level >= MPI_THREAD_SERIALIZED));
  res.stats.progress_thread = use_thread;

  // ---- the ring ----
  const Index T = rows[static_cast<std::size_t>(me)];
  const Index max_rows = *std::max_element(rows.begin(), rows.end());
  const Scalar scale = static_cast<Scalar>(effattn::detail::resolve_scale(m_opts.scale, d));
  // Options::bf16 (float only): the bf16 exact functor per mask (for double a placeholder type,
  // never called).
  using Bf16Functor =
      std::conditional_t<std::is_same_v<Scalar, float>, ExactAttention<float, policy::TiledBf16>,
                         ExactAttention<Scalar>>;
  auto bf16_functor = [&](bool causal) {
    ExactOptions eo;
    eo.scale = static_cast<double>(scale);
    eo.causal = causal;
    eo.block_q = m_opts.block_q;
    eo.block_k = m_opts.block_k;
    return Bf16Functor(eo);
  };
  [[maybe_unused]] const Bf16Functor bf16_full = bf16_functor(false),
                                     bf16_causal = bf16_functor(true);
  std::vector<Scalar> buf[2];
  buf[0].resize(static_cast<std::size_t>(max_rows * W));
  if (P > 1) buf[1].resize(buf[0].size());
  {
    Eigen::Map<Matrix<Scalar>> own(buf[0].data(), T, W);
    own.leftCols(kc) = K;
    own.rightCols(vc) = V;
  }
  res.output.setZero(T, H * dv);
  res.lse.setZero(T, H);
  const bool contiguous = m_opts.sharding == Sharding::Contiguous;
  const int right = (me + 1) % P, left = (me + P - 1) % P;
  bool initialized = false;
  double exposed = 0;
  const Index group = H / G;

  detail::RingExchange ex(use_thread, m_opts.poll_interval_us, exposed);
  for (int s = 0; s < P; ++s) {
    const int src = (me - s + P) % P, cur = s % 2;
    const Index src_rows = rows[static_cast<std::size_t>(src)];
    if (s + 1 < P) {
      const int next = (me - s - 1 + 2 * P) % P;
      const Index next_rows = rows[static_cast<std::size_t>(next)];
      ex.post(buf[1 - cur].data(), static_cast<int>(next_rows * W), left, buf[cur].data(),
              static_cast<int>(src_rows * W), right, detail::mpi_type<Scalar>(), m_comm);
      res.stats.bytes_sent += static_cast<std::int64_t>(src_rows * W * sizeof(Scalar));
      res.stats.bytes_received += static_cast<std::int64_t>(next_rows * W * sizeof(Scalar));
    }
    // Which rows and keys of the block are visible (global positions; see the class docs).
    Index row0 = 0, nrows = T, keys = src_rows;
    bool diagonal = false, skip = false;
    if (m_opts.causal) {
      if (contiguous) {
        skip = src > me;
        diagonal = src == me;
      } else if (src <= me) {  // key j of rank src is visible to query i iff j <= i
        keys = T;
        diagonal = true;
      } else {  // iff j < i: drop query 0 and the last key, then j <= i'
        row0 = 1;
        nrows = T - 1;
        keys = T - 1;
        diagonal = true;
      }
    }
    const double t_compute = detail::now();
    if (!skip && nrows > 0 && keys > 0) {
      const Eigen::Map<const Matrix<Scalar>> blk(buf[cur].data(), src_rows, W);
      for (Index c0 = 0; c0 < nrows; c0 += detail::kChunkRows) {
        const Index cr = std::min(detail::kChunkRows, nrows - c0);
        // Bottom-right aligned causal mask: the chunk sees keys [0, c0 + cr).
        const Index kr = diagonal ? std::min(keys, c0 + cr) : keys;
        const effattn::detail::TilePlan plan = effattn::detail::plan_tiles(
            cr, kr, d, dv, static_cast<Index>(sizeof(Scalar)), m_opts.block_q, m_opts.block_k);
        for (Index h = 0; h < H; ++h) {
          const Index g = h / group;
          const Ref Qh = Q.block(row0 + c0, h * d, cr, d);
          const Ref Kh = blk.block(0, g * d, kr, d);
          const Ref Vh = blk.block(0, kc + g * dv, kr, dv);
          Matrix<Scalar> o;
          Vector<Scalar> l;
          if constexpr (std::is_same_v<Scalar, float>) {
            if (m_opts.bf16) {
              auto r = (diagonal ? bf16_causal : bf16_full).compute(Qh, Kh, Vh);
              o = std::move(r.output);
              l = std::move(r.lse);
            }
          }
          if (!m_opts.bf16)
            effattn::detail::tiled_attention<Scalar>(Qh, Kh, Vh, nullptr, scale, diagonal, plan, o,
                                                     l);
          detail::merge_into<Scalar>(!initialized, std::move(o), l,
                                     res.output.block(row0 + c0, h * dv, cr, dv),
                                     res.lse.col(h).segment(row0 + c0, cr));
          ex.poll();
        }
      }
      initialized = true;  // the first computed block covers every row (own block or full)
    }
    res.stats.compute_seconds += detail::now() - t_compute;
    ex.finish();
  }
  res.stats.exposed_seconds = exposed;
  res.info = effattn::detail::all_finite(res.output) && effattn::detail::all_finite(res.lse)
                 ? Info::Success
                 : Info::NumericalIssue;
  res.stats.total_seconds = detail::now() - t_start;
  return res;
}

}  // namespace mpi
}  // namespace effattn

// Distributed WildCat (coreset serialisation, compress_kv, wildcat_attention), which uses the
// collectives above.
#include "mpi_coreset.hpp"
