#!/usr/bin/env python3
"""effattn from Python against PyTorch on the same tensors: exact attention and a Performer.

    OMP_NUM_THREADS=2 PYTHONPATH=build/python/python /usr/bin/python3 examples/python/bench.py

Runs, on (B, H, L, d) float32 tensors (--workload: `gaussian` = torch.randn with a fixed seed,
or one of effattn.workload's kinds, head (b, h) from seed b H + h), every entry below, interleaved, `--repeat` times after one warm-up call, and prints the median time,
the ratio to torch's exact attention measured in the same process, and the relative Frobenius
error on sampled query rows against a float64 reference:

  effattn exact             effattn.sdpa(q, k, v)                 (Tiled, multi-head kernel)
  effattn performer         effattn.sdpa(..., method="performer", features=S)
  effattn wildcat           effattn.sdpa(..., method="wildcat", rank=R)
  torch exact               torch.softmax(q @ k.transpose(-1, -2) * s, -1) @ v
  torch sdpa                torch.nn.functional.scaled_dot_product_attention (torch >= 2.0;
                            reported as missing on torch 1.13)
  torch performer           positive random features (Choromanski et al. 2021) in torch, S
                            Gaussian features, the same estimator as effattn's Performer

It also measures the Python overhead of an effattn call: the wall time of the Python call
against `Result.seconds`, the time of the same C++ computation taken inside the extension with
the GIL released. Saves the table (--json) and a bar plot (--plot, matplotlib, Agg backend).
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import effattn  # noqa: E402


def torch_exact(q, k, v):
    s = 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1) @ v


def torch_performer(q, k, v, omega):
    """Positive random features: phi(x) = exp(w x~ - |x~|^2 / 2) / sqrt(S), x~ = x / d^(1/4)."""
    s = q.shape[-1] ** -0.25
    qs, ks = q * s, k * s

    def phi(x):
        proj = x @ omega.T  # (..., L, S)
        sq = 0.5 * (x * x).sum(-1, keepdim=True)
        return torch.exp(proj - sq - proj.amax(dim=(-1, -2), keepdim=True))

    fq, fk = phi(qs), phi(ks)
    kv = fk.transpose(-1, -2) @ v  # (..., S, dv)
    z = fk.sum(dim=-2)  # (..., S)
    num = fq @ kv
    den = (fq * z.unsqueeze(-2)).sum(-1, keepdim=True)
    return num / den


def reference_rows(q, k, v, rows):
    """float64 exact attention of the sampled query rows, per (b, h)."""
    qd, kd, vd = q[:, :, rows].double(), k.double(), v.double()
    return torch_exact(qd, kd, vd)


def rel_err(out, ref, rows):
    o = torch.as_tensor(np.asarray(out))[:, :, rows].double()
    return float(torch.linalg.norm(o - ref) / torch.linalg.norm(ref))


def median_times(fns, repeat):
    """Runs every fn once (warm-up), then `repeat` rounds in a rotating order; median wall and
    process CPU seconds (CPU time: the load-independent measure for one thread)."""
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    results = {name: fn() for name, fn in fns.items()}
    names = list(fns)
    for r in range(repeat):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            results[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = lambda d: {n: statistics.median(t) for n, t in d.items()}  # noqa: E731
    return med(times), med(cpu), results


def make_qkv(kind, B, H, L, d):
    g = torch.Generator().manual_seed(0)
    if kind == "gaussian":
        return tuple(torch.randn(B, H, L, d, generator=g) for _ in range(3))
    heads = [effattn.workload(kind, L, d, seed=i) for i in range(B * H)]
    return tuple(torch.from_numpy(np.stack([h[j] for h in heads]).reshape(B, H, L, d))
                 for j in range(3))


def bench_shape(kind, B, H, L, d, repeat, samples, rank):
    q, k, v = make_qkv(kind, B, H, L, d)
    omega = torch.randn(samples, d, generator=torch.Generator().manual_seed(1))
    fns = {
        "effattn exact": lambda: effattn.sdpa(q, k, v),
        f"effattn performer (S={samples})": lambda: effattn.sdpa(q, k, v, method="performer",
                                                                 features=samples),
        f"effattn wildcat (r={rank})": lambda: effattn.sdpa(q, k, v, method="wildcat", rank=rank),
        "torch exact (matmul+softmax)": lambda: torch_exact(q, k, v),
        f"torch performer (S={samples})": lambda: torch_performer(q, k, v, omega),
    }
    has_sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    if has_sdpa:
        fns["torch sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with torch.no_grad():
        times, cpu, results = median_times(fns, repeat)
        rows = torch.arange(0, L, max(1, L // 128))
        ref = reference_rows(q, k, v, rows)
        errors = {}
        for name, res in results.items():
            out = res.output if isinstance(res, effattn.Result) else res
            errors[name] = rel_err(out, ref, rows)
    base = times["torch exact (matmul+softmax)"]
    cpu_base = cpu["torch exact (matmul+softmax)"]
    table = []
    for name in fns:
        table.append(dict(shape=[B, H, L, d], workload=kind, name=name, ms=1e3 * times[name],
                          speedup_vs_torch_exact=base / times[name], rel_err=errors[name],
                          cpu_ms=1e3 * cpu[name], cpu_speedup_vs_torch_exact=cpu_base / cpu[name]))
    if not has_sdpa:
        table.append(dict(shape=[B, H, L, d], name="torch sdpa", ms=None,
                          speedup_vs_torch_exact=None, rel_err=None,
                          note=f"missing in torch {torch.__version__}"))
    return table


def overhead(B, H, L, d, repeat):
    """Python wall time of effattn.sdpa against the C++ time measured inside the call."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, d, generator=g).numpy() for _ in range(3))
    effattn.sdpa(q, k, v)
    wall, inner = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = effattn.sdpa(q, k, v)
        wall.append(time.perf_counter() - t0)
        inner.append(r.seconds)
    w, c = statistics.median(wall), statistics.median(inner)
    diffs = [a - b for a, b in zip(wall, inner)]
    return dict(shape=[B, H, L, d], wall_ms=1e3 * w, cpp_ms=1e3 * c,
                overhead_us=1e6 * statistics.median(diffs),
                overhead_pct=100 * statistics.median(diffs) / w)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096", help="sequence lengths L (comma separated)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--workload", default="gaussian",
                    help="gaussian (torch.randn) or an effattn.workload kind: clustered, ...")
    ap.add_argument("--samples", type=int, default=256, help="Performer random features")
    ap.add_argument("--rank", type=int, default=256, help="WildCat coreset size")
    ap.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    ap.add_argument("--json", default="", help="write the table to this JSON file")
    ap.add_argument("--plot", default="python_bench.png", help="bar plot ('' = none)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"effattn {effattn.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
          f"Python {platform.python_version()}, {a.threads} threads "
          f"(torch.get_num_threads() = {torch.get_num_threads()}, OMP_NUM_THREADS = "
          f"{os.environ['OMP_NUM_THREADS']}), workload {a.workload}, load average "
          f"{os.getloadavg()[0]:.1f}")
    table, over = [], []
    for L in (int(x) for x in a.sizes.split(",")):
        table += bench_shape(a.workload, a.batch, a.heads, L, a.d, a.repeat, a.samples, a.rank)
        over.append(overhead(a.batch, a.heads, L, a.d, max(a.repeat, 21)))
    print(f"\n{'shape (B, H, L, d)':<20} {'method':<30} {'ms':>9} {'vs torch exact':>15} "
          f"{'rel. error':>11} {'CPU ms':>9} {'CPU vs torch':>13}")
    for row in table:
        if row["ms"] is None:
            print(f"{str(tuple(row['shape'])):<20} {row['name']:<30} {row['note']:>37}")
            continue
        print(f"{str(tuple(row['shape'])):<20} {row['name']:<30} {row['ms']:>9.2f} "
              f"{row['speedup_vs_torch_exact']:>14.2f}x {row['rel_err']:>11.2e} "
              f"{row['cpu_ms']:>9.2f} {row['cpu_speedup_vs_torch_exact']:>12.2f}x")
    print(f"\n{'shape (B, H, L, d)':<20} {'Python call ms':>15} {'C++ ms':>9} {'overhead us':>12} "
          f"{'overhead %':>11}")
    for o in over:
        print(f"{str(tuple(o['shape'])):<20} {o['wall_ms']:>15.3f} {o['cpp_ms']:>9.3f} "
              f"{o['overhead_us']:>12.1f} {o['overhead_pct']:>10.2f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(table=table, overhead=over, torch=torch.__version__,
                           threads=a.threads), f, indent=1)
    if a.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (apt-get install python3-matplotlib): no plot",
                  file=sys.stderr)
            return
        shapes = sorted({tuple(r["shape"]) for r in table}, key=lambda s: s[2])
        names = [r["name"] for r in table if tuple(r["shape"]) == shapes[0] and r["ms"]]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [next(r["ms"] for r in table if tuple(r["shape"]) == s and r["name"] == name)
                  for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"L = {s[2]}\n(B, H, d) = ({s[0]}, {s[1]}, {s[3]})" for s in shapes])
        ax.set_yscale("log")
        ax.set_ylabel("median time per call [ms] (log)")
        ax.set_title(f"effattn vs torch {torch.__version__}, float32, {a.threads} threads, "
                     f"{a.workload}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"\nplot: {a.plot}")


if __name__ == "__main__":
    main()
