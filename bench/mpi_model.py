#!/usr/bin/python3
"""Alpha-beta model of ring attention (effattn::mpi::RingAttention): strong and weak scaling.

A ring step of rank p computes its T = N / P queries against one block of T keys (4 T^2 H d
flops at the per-rank kernel rate F; half of that when causal and striped) while the next
key/value block (2 T G d b bytes) travels over the link (latency alpha, bandwidth B):

    t_comp = c 4 T^2 H d / F          (c = 1, or 1/2 causal)
    t_comm = alpha + 2 T G d b / B
    t_ring = (P - 1) max(t_comp, t_comm) + t_comp

Communication hides behind computation while t_comp >= t_comm, i.e. for blocks of at least
T* tokens, the positive root of c 4 H d T^2 / F - 2 G d b T / B - alpha = 0
(~ G b F / (2 c H B) when alpha is negligible).

Usage:
    /usr/bin/python3 bench/mpi_model.py [--bench-json bench/results/bench_mpi.json]
        [--rate GFLOPS] [--bandwidth GBps] [--latency us] [--out bench/results/mpi_model.png]

--rate defaults to the per-rank kernel rate measured by bench_mpi (one thread); the links are
(name, GB/s, latency us) pairs, by default 100 Gb/s InfiniBand, 25 GbE and 10 GbE.
"""
import argparse
import json
import math

LINKS = [("InfiniBand 100 Gb/s", 12.5, 2.0), ("Ethernet 25 Gb/s", 3.1, 10.0),
         ("Ethernet 10 Gb/s", 1.25, 20.0)]


def ring_time(N, P, rate, bw, alpha, d=64, H=1, G=1, b=4, causal=False):
    """Seconds of one ring attention call (per rank, the critical path) and its parts."""
    T = N / P
    c = 0.5 if causal else 1.0
    comp = c * 4.0 * T * T * H * d / rate
    comm = alpha + 2.0 * T * G * d * b / bw
    total = (P - 1) * max(comp, comm) + comp
    exposed = (P - 1) * max(0.0, comm - comp)
    return total, comp * P, exposed


def crossover(rate, bw, alpha, d=64, H=1, G=1, b=4, causal=False):
    """Smallest block T (tokens per rank) with t_comp >= t_comm."""
    c = 0.5 if causal else 1.0
    A = c * 4.0 * H * d / rate
    Bc = 2.0 * G * d * b / bw
    return (Bc + math.sqrt(Bc * Bc + 4 * A * alpha)) / (2 * A)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench-json", default="bench/results/bench_mpi.json")
    ap.add_argument("--rate", type=float, help="per-rank kernel rate, GFLOP/s")
    ap.add_argument("--bandwidth", type=float, help="one link: bandwidth, GB/s")
    ap.add_argument("--latency", type=float, default=5.0, help="one link: latency, us")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--node-threads", type=int, default=64,
                    help="cores of the node scenario (F times this)")
    ap.add_argument("--out", default="bench/results/mpi_model.png")
    a = ap.parse_args()
    G = a.kv_heads or a.heads

    rate = a.rate
    measured = None
    try:
        with open(a.bench_json) as f:
            measured = json.loads(f.readline())
    except OSError:
        pass
    if rate is None:
        rate = measured["kernel_GFLOPs_per_rank"] if measured else 70.0
    F = rate * 1e9
    links = [("link", a.bandwidth, a.latency)] if a.bandwidth else list(LINKS)
    if measured and not a.bandwidth:
        links.append(("loopback (measured)", measured["comm_GBps"], 5.0))

    kw = dict(d=a.d, H=a.heads, G=G)
    # Two compute scenarios: the measured rank (one thread) and a node running the same kernel
    # on `--node-threads` cores (perfect intra-node scaling assumed: an upper bound on F, hence
    # the harder case for hiding communication).
    rates = [(f"1 thread, {rate:.0f} GFLOP/s (measured)", F),
             (f"{a.node_threads}-core node, {a.node_threads * rate / 1000:.1f} TFLOP/s",
              a.node_threads * F)]
    print(f"per-rank kernel rate F = {rate:.1f} GFLOP/s (one thread), d = {a.d}, "
          f"heads = {a.heads}, kv_heads = {G}, float")
    for rname, FF in rates:
        print(f"\n{rname}")
        for name, bw, lat in links:
            t_star = crossover(FF, bw * 1e9, lat * 1e-6, **kw)
            t_star_c = crossover(FF, bw * 1e9, lat * 1e-6, causal=True, **kw)
            print(f"{name:>22}: communication hides while T >= {t_star:8.0f} tokens per rank "
                  f"(causal striped: {t_star_c:8.0f})")

    Ps = [8, 16, 32, 64, 128, 256]
    Ns = [1e5, 1e6, 1e7]
    for rname, FF in rates:
        print(f"\nstrong scaling, {rname}: time per call (parallel efficiency t_1 / (P t_P))")
        for name, bw, lat in links:
            for N in Ns:
                row = []
                for P in Ps:
                    t, _, _ = ring_time(N, P, FF, bw * 1e9, lat * 1e-6, **kw)
                    t1 = 4.0 * N * N * a.heads * a.d / FF
                    row.append(f"{P}: {t:8.3g} s ({t1 / (P * t):4.2f})")
                print(f"{name:>22} N={N:.0e}: " + " ".join(row))
        print(f"weak scaling, {rname}: efficiency at T tokens per rank (the same for every P)")
        for name, bw, lat in links:
            row = []
            for T in [1e2, 1e3, 1e4, 1e5]:
                t, _, _ = ring_time(8 * T, 8, FF, bw * 1e9, lat * 1e-6, **kw)
                row.append(f"T={T:.0e}: {8 * 4.0 * T * T * a.heads * a.d / FF / t:4.2f}")
            print(f"{name:>22}: " + "  ".join(row))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: apt-get install -y python3-matplotlib; no plot written")
        return
    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    styles = ["-", "--", ":", "-."]
    FF = rates[1][1]
    for li, (name, bw, lat) in enumerate(links):
        for N, col in zip(Ns, ["tab:blue", "tab:orange", "tab:green"]):
            ts, eff = [], []
            for P in Ps:
                t, _, _ = ring_time(N, P, FF, bw * 1e9, lat * 1e-6, **kw)
                ts.append(t)
                eff.append(4.0 * N * N * a.heads * a.d / FF / (P * t))
            lab = f"N={N:.0e}, {name}"
            ax[0].loglog(Ps, ts, styles[li % 4], color=col, marker="o", ms=3, label=lab)
            ax[1].semilogx(Ps, eff, styles[li % 4], color=col, marker="o", ms=3, label=lab)
    Ts = [10 ** (x / 8) for x in range(8, 41)]
    for ri, (rname, FR) in enumerate(rates):
        for li, (name, bw, lat) in enumerate(links):
            eff = []
            for T in Ts:
                t, _, _ = ring_time(64 * T, 64, FR, bw * 1e9, lat * 1e-6, **kw)
                eff.append(64 * 4.0 * T * T * a.heads * a.d / FR / t)
            ax[2].semilogx(Ts, eff, styles[li % 4], color=["tab:gray", "tab:red"][ri],
                           label=f"{rname.split(',')[0]}, {name}")
    ax[0].set(title=f"strong scaling, {rates[1][0]}: time per call", xlabel="ranks P",
              ylabel="seconds")
    ax[1].set(title="strong scaling: efficiency t1 / (P tP)", xlabel="ranks P", ylim=(0, 1.05))
    ax[2].set(title="weak scaling (N = P T): efficiency vs tokens per rank T",
              xlabel="tokens per rank T", ylim=(0, 1.05))
    for x in ax[:2]:
        x.set_xticks(Ps)
        x.set_xticklabels([str(p) for p in Ps])
    for x in ax:
        x.grid(True, which="both", alpha=0.3)
    ax[1].legend(fontsize=6, ncol=2)
    ax[2].legend(fontsize=6)
    fig.suptitle(f"ring attention, alpha-beta model (d = {a.d}, heads = {a.heads}, kv_heads = {G}, "
                 f"float; measured F = {rate:.0f} GFLOP/s per thread)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
