#!/usr/bin/env python3
"""Plots of an effattn scaling sweep (the JSON files written by bench/sweep.sh).

    python3 bench/plot.py bench/results            # reads bench/results/*.json, writes PNGs there

Writes
  time_vs_n.png     log-log time against n, one line per benchmark family (exact included),
                    the fitted exponent (least squares on log t = a + b log n) in the legend;
  error_vs_time.png relative error against time, one panel per n (largest n with errors), one
                    point per family, the Pareto front drawn as a step line.
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

ERROR_COUNTERS = ("rel_err", "vip_err", "err", "rel_err_mean")


def family_and_n(name):
    """'eva/float/d64/full/w64/L16/4096/real_time' -> ('eva/float/d64/full/w64/L16', 4096)."""
    parts = [p for p in name.split("/") if p and not p.startswith("iterations:")
             and p not in ("real_time", "process_time", "manual_time")]
    for i in range(len(parts) - 1, -1, -1):
        if re.fullmatch(r"\d+", parts[i]):
            return "/".join(parts[:i] + parts[i + 1:]), int(parts[i])
    return None, None


def load(folder):
    data = defaultdict(dict)  # family -> n -> (seconds, error or None)
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        for b in doc.get("benchmarks", []):
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
                continue
            if "error_occurred" in b and b["error_occurred"]:
                continue
            fam, n = family_and_n(b.get("run_name", b["name"]))
            if fam is None or "smoke" in fam or "BigO" in b["name"] or "RMS" in b["name"]:
                continue
            unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
            t = b["real_time"] * unit
            err = next((b[c] for c in ERROR_COUNTERS if c in b and b[c] >= 0), None)
            data[fam][n] = (t, err)
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

    data = {k: v for k, v in load(args.folder).items() if args.match in k}
    if not data:
        sys.exit("no benchmark results in %s" % args.folder)

    # Time vs n.
    fig, ax = plt.subplots(figsize=(11, 7))
    for fam in sorted(data):
        pts = sorted((n, t) for n, (t, _) in data[fam].items())
        if len(pts) < 3:
            continue
        b = fit_exponent(pts)
        style = ("k--" if "causal" in fam else "k-") if fam.startswith("exact") else "-"
        ax.plot([n for n, _ in pts], [t for _, t in pts], style, marker="o", ms=3,
                label="%s (n^%.2f)" % (fam, b))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n (= m)")
    ax.set_ylabel("time per call [s]")
    ax.set_title("effattn: time vs n (log-log; fitted exponent in the legend)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(args.folder, "time_vs_n.png"), dpi=110)

    # Error vs time at the largest n that has several families with errors.
    by_n = defaultdict(list)
    for fam, d in data.items():
        for n, (t, e) in d.items():
            if e is not None and e > 0:
                by_n[n].append((t, e, fam))
    ns = sorted((n for n in by_n if len(by_n[n]) >= 3), reverse=True)[:2]
    if ns:
        fig, axes = plt.subplots(1, len(ns), figsize=(7 * len(ns), 6), squeeze=False)
        for ax, n in zip(axes[0], ns):
            pts = sorted(by_n[n])
            for t, e, fam in pts:
                ax.scatter(t, e, s=14)
                ax.annotate(fam, (t, e), fontsize=5)
            front, best = [], float("inf")
            for t, e, _ in pts:
                if e < best:
                    best = e
                    front.append((t, e))
            ax.step([t for t, _ in front], [e for _, e in front], "r-", where="post",
                    label="Pareto front")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("time per call [s]")
            ax.set_ylabel("relative error vs exact")
            ax.set_title("error vs time, n = %d" % n)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.folder, "error_vs_time.png"), dpi=110)

    for fam in sorted(data):
        pts = sorted((n, t) for n, (t, _) in data[fam].items())
        if len(pts) >= 3:
            print("%-50s n^%.2f  (%d sizes)" % (fam, fit_exponent(pts), len(pts)))


if __name__ == "__main__":
    main()
