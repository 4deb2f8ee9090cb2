#!/usr/bin/env python3
"""Plots of an effattn scaling sweep (the JSON files written by bench/sweep.sh).

    python3 bench/plot.py bench/results            # reads bench/results/*.json, writes PNGs there

Writes
  time_vs_n.png     log-log time against n, one line per benchmark family (exact included),
                    the fitted exponent (least squares on log t = a + b log n) in the legend;
  error_vs_time.png relative error against time, one panel per workload (n = 16384 where
                    measured), one point per family, the Pareto front drawn as a step line and
                    the exact kernel's time as a dashed line.
Needs matplotlib (Debian: python3-matplotlib). Only families with >= 3 sizes get a fit.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
from collections import defaultdict

# Error counters -> workload they were measured on, per benchmark file (bench_<name>.json).
# "rel_err" means the file's main workload. Families whose error is not against exact softmax
# attention (KEP-SVGP Factorized: cosine kernel) are left out of the error plot.
WORKLOAD_OF = {
    "bench_exact": {"rel_err": "gaussian"},
    "bench_eva": {"rel_err": "gaussian", "err_positional": "positional",
                  "err_clustered": "clustered"},
    "bench_vcc": {"vip_err": "smooth_vip (VIP rows)"},
    "bench_wildcat": {"err_sphere": "sphere", "err_clustered": "clustered"},
    "bench_conv_basis": {"rel_err": "positional (causal)", "err_clean": "positional, no noise (causal)"},
    "bench_kep_svgp": {"rel_err": "clustered"},
}
SKIP = ("smoke", "errsweep", "wildcat-headline", "shape/", "kep_svgp/factorized", "recover/")


def family_and_n(name):
    """'eva/float/d64/full/w64/L16/4096/real_time' -> ('eva/float/d64/full/w64/L16', 4096).

    n is the largest all-digit path component (benchmarks with two arguments, e.g.
    kep_svgp/randomized/s8/<n>/<s>, put n first)."""
    parts = [p for p in name.split("/") if p and not p.startswith("iterations:")
             and p not in ("real_time", "process_time", "manual_time")]
    nums = [i for i, p in enumerate(parts) if re.fullmatch(r"\d+", p)]
    if not nums:
        return None, None
    i = max(nums, key=lambda k: int(parts[k]))
    return "/".join(parts[:i] + parts[i + 1:]), int(parts[i])


def load(folder):
    """-> {bench: {family: {n: (seconds, {workload: error})}}}"""
    data = defaultdict(lambda: defaultdict(dict))
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        bench = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        counters = WORKLOAD_OF.get(bench, {"rel_err": "?"})
        for b in doc.get("benchmarks", []):
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
                continue
            if "error_occurred" in b and b["error_occurred"]:
                continue
            fam, n = family_and_n(b.get("run_name", b["name"]))
            if fam is None or any(k in fam for k in SKIP) or "BigO" in b["name"] or "RMS" in b["name"]:
                continue
            unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
            errs = {w: b[c] for c, w in counters.items() if c in b and b[c] > 0}
            data[bench][fam][n] = (b["real_time"] * unit, errs)
    return data


def fit_exponent(points):
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="folder with the sweep's JSON files (PNGs are written there)")
    ap.add_argument("--match", default="", help="only families whose name contains this")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib: apt-get install -y python3-matplotlib (and run it with /usr/bin/python3)")

    data = load(args.folder)
    for bench in list(data):
        data[bench] = {f: d for f, d in data[bench].items() if args.match in f}
    if not any(data.values()):
        sys.exit("no benchmark results in %s" % args.folder)

    # Time vs n: one panel per benchmark file, each with the exact baseline of the same run.
    benches = [b for b in sorted(data) if data[b]]
    cols = 3
    rows = (len(benches) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.6 * rows), squeeze=False)
    for ax, bench in zip(axes.flat, benches):
        for fam in sorted(data[bench]):
            pts = sorted((n, t) for n, (t, _) in data[bench][fam].items())
            if len(pts) < 3:
                continue
            b = fit_exponent(pts)
            exact = fam.startswith("exact")
            style = ("k--" if "causal" in fam else "k-") if exact else "-"
            ax.plot([n for n, _ in pts], [t for _, t in pts], style, marker="o", ms=3,
                    label="%s (n^%.2f)" % (fam, b), lw=2 if exact else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n (= m)")
        ax.set_ylabel("time per call [s]")
        ax.set_title(bench + ": time vs n (fitted exponent in the legend)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=5.5, loc="upper left")
    for ax in list(axes.flat)[len(benches):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(args.folder, "time_vs_n.png"), dpi=100)

    # Error vs time: one panel per workload at n = 16384 (or the largest n with >= 3 points);
    # Tiled exact attention (its float round-off error) is the anchor in every panel.
    by_w = defaultdict(lambda: defaultdict(list))  # workload -> n -> [(t, e, label)]
    exact_t = {}
    for bench, fams in data.items():
        for fam, d in fams.items():
            for n, (t, errs) in d.items():
                if fam.startswith("exact/tiled") and bench == "bench_exact":
                    key = ("causal" in fam, n)
                    exact_t[key] = min(t, exact_t.get(key, t))
                if fam.startswith("exact"):
                    continue
                for w, e in errs.items():
                    by_w[w][n].append((t, e, fam))
    panels = []
    for w in sorted(by_w):
        ns = [n for n in by_w[w] if len(by_w[w][n]) >= 3]
        if ns:
            panels.append((w, 16384 if 16384 in ns else max(ns)))
    if panels:
        cols = min(3, len(panels))
        rows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 5 * rows), squeeze=False)
        for ax, (w, n) in zip(axes.flat, panels):
            pts = sorted(by_w[w][n])
            groups = defaultdict(list)
            for t, e, fam in pts:
                groups[fam.split("/")[0]].append((t, e, fam))
            for g, gp in sorted(groups.items()):
                ax.scatter([t for t, _, _ in gp], [e for _, e, _ in gp], s=16, label=g)
                for t, e, fam in gp:
                    ax.annotate("/".join(fam.split("/")[1:]), (t, e), fontsize=4.5)
            key = ("causal" in w, n)
            if key in exact_t:
                ax.axvline(exact_t[key], color="k", ls="--", lw=1,
                           label="exact tiled time" + (" (causal)" if key[0] else ""))
            front, best = [], float("inf")
            for t, e, _ in pts:
                if e < best:
                    best = e
                    front.append((t, e))
            ax.step([t for t, _ in front], [e for _, e in front], "r-", where="post", lw=1,
                    label="Pareto front")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("time per call [s]")
            ax.set_ylabel("relative Frobenius error vs exact")
            ax.set_title("%s, n = %d" % (w, n), fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(os.path.join(args.folder, "error_vs_time.png"), dpi=100)

    for bench in benches:
        for fam in sorted(data[bench]):
            pts = sorted((n, t) for n, (t, _) in data[bench][fam].items())
            if len(pts) >= 3:
                print("%-50s n^%.2f  (%d sizes, n = %d..%d)" % (fam, fit_exponent(pts), len(pts),
                                                               pts[0][0], pts[-1][0]))


if __name__ == "__main__":
    main()
