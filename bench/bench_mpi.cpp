// bench_mpi: time split of ring attention (effattn::mpi::RingAttention) into computation,
// communication and exposed (not overlapped) communication. A plain MPI program printing JSON
// (Google Benchmark's loop does not fit a collective call), run e.g. as
//
//   OMP_NUM_THREADS=1 mpirun -np 2 ./build/mpi/bench/bench_mpi --n 65536 --d 64
//
// Per repetition every rank runs one ring call and reports its compute and exposed seconds
// (RingStats); the communication alone is the same ring exchange (the same bytes, Isend/Irecv,
// P - 1 steps) without computation, timed separately. hidden = 1 - exposed / communication.
// The JSON (rank 0, stdout or --json FILE) holds the medians over repetitions of the max over
// ranks.
#include <effattn/distributed/mpi.hpp>
#include <effattn/exact.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using effattn::Index;

struct Args {
  Index n = 65536, d = 64, heads = 1, kv_heads = 0;
  bool causal = false, dbl = false;
  std::string sharding = "contiguous", progress = "auto", json;
  int repeat = 3;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_mpi: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--n")
      a.n = std::stol(next());
    else if (k == "--d")
      a.d = std::stol(next());
    else if (k == "--heads")
      a.heads = std::stol(next());
    else if (k == "--kv-heads")
      a.kv_heads = std::stol(next());
    else if (k == "--causal")
      a.causal = true;
    else if (k == "--double")
      a.dbl = true;
    else if (k == "--sharding")
      a.sharding = next();
    else if (k == "--progress")
      a.progress = next();
    else if (k == "--repeat")
      a.repeat = std::stoi(next());
    else if (k == "--json")
      a.json = next();
    else {
      std::fprintf(stderr,
                   "usage: bench_mpi [--n N] [--d D] [--heads H] [--kv-heads G] [--causal] "
                   "[--double] [--sharding contiguous|striped] [--progress auto|thread|poll] "
                   "[--repeat R] [--json FILE]\n");
      std::exit(2);
    }
  }
  return a;
}

double max_over_ranks(double x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return x;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename S>
int run(const Args& a) {
  int P = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  namespace mpi = effattn::mpi;
  const Index G = a.kv_heads > 0 ? a.kv_heads : a.heads;
  mpi::RingOptions o;
  o.causal = a.causal;
  o.sharding = a.sharding == "striped" ? mpi::Sharding::Striped : mpi::Sharding::Contiguous;
  o.layout = {a.heads, G};
  o.progress = a.progress == "thread" ? mpi::Progress::Thread
               : a.progress == "poll" ? mpi::Progress::Poll
                                      : mpi::Progress::Auto;
  const Index T = static_cast<Index>(mpi::shard_positions(a.n, P, me, o.sharding).size());
  std::mt19937_64 g(1234 + static_cast<std::uint64_t>(me));
  std::normal_distribution<double> nd;
  auto fill = [&](Index rows, Index cols) {
    effattn::Matrix<S> x(rows, cols);
    for (Index j = 0; j < cols; ++j)
      for (Index i = 0; i < rows; ++i) x(i, j) = static_cast<S>(nd(g));
    return x;
  };
  const effattn::Matrix<S> Q = fill(T, a.heads * a.d), K = fill(T, G * a.d), V = fill(T, G * a.d);
  const mpi::RingAttention<S> ring(MPI_COMM_WORLD, o);

  // Communication alone: the ring's exchange (same sizes, same calls), no computation.
  std::vector<Index> rows(static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p)
    rows[static_cast<std::size_t>(p)] =
        static_cast<Index>(mpi::shard_positions(a.n, P, p, o.sharding).size());
  const Index W = G * 2 * a.d;
  const Index max_rows = *std::max_element(rows.begin(), rows.end());
  std::vector<S> buf0(static_cast<std::size_t>(max_rows * W), S(1)), buf1(buf0.size());
  const MPI_Datatype type = std::is_same_v<S, float> ? MPI_FLOAT : MPI_DOUBLE;
  auto comm_only = [&] {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    std::vector<S>* cur = &buf0;
    std::vector<S>* nxt = &buf1;
    for (int s = 0; s + 1 < P; ++s) {
      const int src = (me - s + P) % P, next = (me - s - 1 + 2 * P) % P;
      MPI_Request req[2];
      MPI_Irecv(nxt->data(), static_cast<int>(rows[static_cast<std::size_t>(next)] * W), type,
                (me + P - 1) % P, 1, MPI_COMM_WORLD, &req[0]);
      MPI_Isend(cur->data(), static_cast<int>(rows[static_cast<std::size_t>(src)] * W), type,
                (me + 1) % P, 1, MPI_COMM_WORLD, &req[1]);
      MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
      std::swap(cur, nxt);
    }
    return max_over_ranks(MPI_Wtime() - t0);
  };

  std::vector<double> total, compute, exposed, comm, validate;
  std::int64_t bytes = 0;
  bool thread = false;
  (void)comm_only();  // warm-up: connections, registration
  for (int rep = 0; rep < a.repeat; ++rep) {
    comm.push_back(comm_only());
    MPI_Barrier(MPI_COMM_WORLD);
    const auto r = ring.compute(Q, K, V);
    total.push_back(max_over_ranks(r.stats.total_seconds));
    compute.push_back(max_over_ranks(r.stats.compute_seconds));
    exposed.push_back(max_over_ranks(r.stats.exposed_seconds));
    validate.push_back(max_over_ranks(r.stats.validate_seconds));
    bytes = r.stats.bytes_sent;
    thread = r.stats.progress_thread;
  }
  // The same kernel work without any communication (non-causal: P local T x T calls of the
  // exact Tiled kernel per head), to see whether the transfers slowed the computation down.
  double alone = 0;
  if (!a.causal) {
    effattn::ExactAttention<S> exact;
    std::vector<double> t;
    for (int rep = 0; rep < std::max(1, a.repeat / 2); ++rep) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      for (int p = 0; p < P; ++p)
        for (Index h = 0; h < a.heads; ++h) {
          const Index gh = h / (a.heads / G);
          const auto r = exact.compute(Q.middleCols(h * a.d, a.d), K.middleCols(gh * a.d, a.d),
                                       V.middleCols(gh * a.d, a.d));
          if (r.info != effattn::Info::Success) std::fprintf(stderr, "bench_mpi: kernel failed\n");
        }
      t.push_back(max_over_ranks(MPI_Wtime() - t0));
    }
    alone = median(t);
  }
  const double c = median(comm), e = median(exposed), cp = median(compute);
  // Flops of one rank: 4 T^2 d per block pair and head (d = dv), halved when causal.
  const double pairs = a.causal ? 0.5 * P : P;
  const double flops = 4.0 * static_cast<double>(a.n / P) * static_cast<double>(a.n / P) *
                       static_cast<double>(a.d * a.heads) * pairs;
  const double hidden = c > 0 ? std::max(0.0, 1.0 - e / c) : 1.0;
  if (me == 0) {
    char out[2048];
    std::snprintf(
        out, sizeof out,
        "{\"ranks\": %d, \"n\": %ld, \"d\": %ld, \"heads\": %ld, \"kv_heads\": %ld, "
        "\"scalar\": \"%s\", \"causal\": %s, \"sharding\": \"%s\", \"progress_thread\": %s, "
        "\"repeat\": %d, \"total_s\": %.6f, \"compute_s\": %.6f, \"exposed_comm_s\": %.6f, "
        "\"comm_alone_s\": %.6f, \"compute_alone_s\": %.6f, \"validate_s\": %.6f, "
        "\"hidden_fraction\": %.4f, "
        "\"bytes_sent_per_rank\": %lld, \"comm_GBps\": %.3f, \"kernel_GFLOPs_per_rank\": "
        "%.2f}\n",
        P, static_cast<long>(a.n), static_cast<long>(a.d), static_cast<long>(a.heads),
        static_cast<long>(G), a.dbl ? "double" : "float", a.causal ? "true" : "false",
        a.sharding.c_str(), thread ? "true" : "false", a.repeat, median(total), cp, e, c, alone,
        median(validate), hidden, static_cast<long long>(bytes),
        c > 0 ? static_cast<double>(bytes) / c * 1e-9 : 0.0, flops / cp * 1e-9);
    std::fputs(out, stdout);
    if (!a.json.empty()) {
      FILE* f = std::fopen(a.json.c_str(), "w");
      if (f != nullptr) {
        std::fputs(out, f);
        std::fclose(f);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  const Args a = parse(argc, argv);
  const int rc = a.dbl ? run<double>(a) : run<float>(a);
  MPI_Finalize();
  return rc;
}
