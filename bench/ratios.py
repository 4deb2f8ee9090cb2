#!/usr/bin/env python3
"""Ratios from one bench_exact JSON run (google-benchmark --benchmark_out=FILE).

Usage: python3 bench/ratios.py out.json [--n 4096] [--d 64] [--scalar float]
       python3 bench/ratios.py out.json --table      (markdown table of every exact family)

Prints, for the chosen n, d and scalar (times are per-iteration real times of the same run):
  * Tiled effective GFLOP/s as a fraction of the Eigen GEMM rate (gemm/<scalar>/2048),
  * Tiled speed-up over Naive and over the "afternoon" baseline,
  * causal / non-causal time of Tiled,
for every thread setting present. With --benchmark_repetitions, the best (max rate / min time)
repetition is used. Only the Python standard library is needed.
"""
import argparse
import json
import re
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    best = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" or "error_occurred" in b and b["error_occurred"]:
            continue
        name = re.sub(r"/real_time$", "", b["name"])
        t = b["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
        rate = b.get("GFLOP/s")
        prev = best.get(name)
        if prev is None or t < prev["time"]:
            best[name] = {"time": t, "rate": rate, "rel_err": b.get("rel_err")}
    return data.get("context", {}), best


def table(best):
    """Markdown table: one row per exact family, effective GFLOP/s per n (time in ms below)."""
    fams, sizes = {}, set()
    for name, v in best.items():
        m = re.match(r"^(exact/[^/]+/[^/]+/d\d+/[^/]+/[^/]+|afternoon/[^/]+/d\d+/[^/]+/[^/]+)/(\d+)$", name)
        if m:
            fams.setdefault(m.group(1), {})[int(m.group(2))] = v
            sizes.add(int(m.group(2)))
    sizes = sorted(sizes)
    print("| family | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for fam in sorted(fams):
        cells = []
        for n in sizes:
            v = fams[fam].get(n)
            cells.append(f"{v['rate']:.0f} ({v['time'] * 1e3:.1f} ms)" if v else "")
        print(f"| {fam} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--scalar", default="float")
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    ctx, best = load(a.json)
    if a.table:
        table(best)
        return
    print(f"host: {ctx.get('host_name', '?')}, cpus: {ctx.get('num_cpus', '?')}, "
          f"date: {ctx.get('date', '?')}, load avg: {ctx.get('load_avg', '?')}")
    found = False
    for threads in ("tall", "t1"):
        gemm = best.get(f"gemm/{a.scalar}/{threads}/2048")
        key = lambda pol, mask: f"exact/{pol}/{a.scalar}/d{a.d}/{mask}/{threads}/{a.n}"
        tiled, naive = best.get(key("tiled", "full")), best.get(key("naive", "full"))
        causal = best.get(key("tiled", "causal"))
        afternoon = best.get(f"afternoon/{a.scalar}/d{a.d}/full/{threads}/{a.n}")
        if not tiled:
            continue
        found = True
        print(f"-- n = m = {a.n}, d = {a.d}, {a.scalar}, threads = {threads[1:]}")
        if gemm:
            print(f"   Eigen GEMM 2048^3, same threads: {gemm['rate']:.1f} GFLOP/s")
        print(f"   Tiled: {tiled['time'] * 1e3:.1f} ms, {tiled['rate']:.1f} GFLOP/s, "
              f"rel_err {tiled['rel_err']:.2e}")
        if gemm:
            print(f"   Tiled rate / GEMM rate            = {tiled['rate'] / gemm['rate']:.2f}")
        if naive:
            print(f"   Naive time / Tiled time           = {naive['time'] / tiled['time']:.2f}")
        if afternoon:
            print(f"   afternoon time / Tiled time       = {afternoon['time'] / tiled['time']:.2f}")
        if causal:
            print(f"   Tiled causal time / non-causal    = {causal['time'] / tiled['time']:.2f}")
    if not found:
        sys.exit(f"no exact/tiled/{a.scalar}/d{a.d}/full/*/{a.n} entry in {a.json}")


if __name__ == "__main__":
    main()
