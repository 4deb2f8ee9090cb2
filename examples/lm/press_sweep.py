#!/usr/bin/env python3
"""KV-cache presses on the trained decoder: the measurements of docs/kv_cache.md, and its tables.

    python3 examples/lm/press_sweep.py --lm build/release/examples/effattn-lm \\
        [--out bench/results/kv_press] [--doc docs/kv_cache.md] [--render-only] [--force]

Runs, unless their JSON is already in --out (or with --force):
  spans-C.json    `effattn-lm eval --press ALL --keep 0.05,0.1,0.25,0.5 --spans ...` on the
                  held-out split with repeated passages (data/heldout_repeats.txt, made by
                  make_repeats.py from data/heldout.txt), context C = the training context and 2x;
  windows-C.json  the same without spans: the first 16 windows of C bytes of data/heldout.txt,
                  the last C / 8 bytes of each scored;
  decode-C-P.json `effattn-lm generate` from the last C - 128 bytes of the held-out text, 128
                  tokens, greedy, exact (P = exact) and every press at keep 0.1, C = 1, 2 and 4
                  times the training context, one after the other (decode-C-b8-P.json: 8
                  sequences at 4 times);
and machine.txt (what they ran on). Then renders the tables between the markers
<!-- kv-press-results:begin --> and <!-- kv-press-results:end --> of --doc, and the plot
kv_press.png beside the JSON (needs python3-matplotlib; skipped without it).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PRESSES = ["drop", "streaming", "uniform", "knorm", "snapkv", "observed", "wildcat", "vcc"]
KEEPS = [0.05, 0.1, 0.25, 0.5]
BEGIN, END = "<!-- kv-press-results:begin -->", "<!-- kv-press-results:end -->"


def training_context():
    with open(os.path.join(HERE, "reference.json")) as f:
        return json.load(f)["decoder"]["config"]["context"]


def run(cmd, path, force):
    if os.path.exists(path) and not force:
        return
    print(" ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def compiler():
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True,
                              check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        return "unknown compiler"


def machine(out, lm):
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open(os.path.join(out, "machine.txt"), "w") as f:
        f.write(f"date: {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}\n"
                f"cpu: {cpu}\ncores: {os.cpu_count()}\nsystem: {platform.platform()}\n"
                f"binary: {os.path.basename(lm)} ({compiler()})\n"
                "note: shared virtual machine; compare ratios within one run, not absolute times\n")


def measure(a):
    os.makedirs(a.out, exist_ok=True)
    T = training_context()
    rep_text = os.path.join(HERE, "data", "heldout_repeats.txt")
    rep_spans = os.path.join(HERE, "data", "heldout_repeats.spans")
    heldout = os.path.join(HERE, "data", "heldout.txt")
    presses, keeps = ",".join(PRESSES), ",".join(str(k) for k in KEEPS)
    for C in (T, 2 * T):
        base = [a.lm, "eval", "--model", "decoder", "--method", "exact", "--context", str(C),
                "--press", presses, "--keep", keeps, "--no-progress"]
        p = os.path.join(a.out, f"spans-{C}.json")
        run(base + ["--text", rep_text, "--spans", rep_spans, "--json", p], p, a.force)
        p = os.path.join(a.out, f"windows-{C}.json")
        run(base + ["--text", heldout, "--recent", str(C // 8), "--windows", "16", "--json", p],
            p, a.force)
    for C, B in decode_settings(T):
        for press in ["exact"] + PRESSES:
            p = os.path.join(a.out, decode_name(C, B, press))
            cmd = [a.lm, "generate", "--prompt-file", heldout, "--prompt-bytes", str(C - 128),
                   "--tokens", "128", "--batch", str(B), "--temperature", "0", "--json", p]
            if press != "exact":
                cmd += ["--press", press, "--keep", "0.1"]
            run(cmd, p, a.force)
    machine(a.out, a.lm)


def decode_settings(T):
    """(context, sequences) of the decoding runs."""
    return [(T, 1), (2 * T, 1), (4 * T, 1), (4 * T, 8)]


def decode_name(C, B, press):
    return f"decode-{C}-{press}.json" if B == 1 else f"decode-{C}-b{B}-{press}.json"


def load(path):
    with open(path) as f:
        return json.load(f)


def ci(r):
    return f"{r['delta']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]"


def eval_table(res, title):
    rows = {(r["press"], r["keep"]): r for r in res["presses"]}
    head = "| press | " + " | ".join(f"keep {int(k * 100)}%" for k in KEEPS) + " |"
    lines = [f"**{title}**: {res['units']} {'spans' if res['spans'] else 'windows'}, "
             f"{res['span_bytes']} scored bytes; exact attention "
             f"{res['exact']['span_bits_per_byte']:.3f} bits per byte. Each cell: the press's "
             "bits per byte minus exact's on the same bytes [95% paired-bootstrap interval].", "",
             head, "|---|" + "---|" * len(KEEPS)]
    for p in PRESSES:
        cells = [ci(rows[(p, k)]) if (p, k) in rows else "-" for k in KEEPS]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    # Compression time relative to the span forward of exact attention (same run).
    lines += ["", "Time to press the prompt (all layers and kv heads, summed over the units), "
              "relative to exact attention's forward of the scored bytes in the same run: " +
              ", ".join(f"{p} {sum(rows[(p, k)]['compress_seconds'] for k in KEEPS) / len(KEEPS) / max(res['exact']['span_seconds'], 1e-9):.2f}x"
                        for p in PRESSES if (p, KEEPS[0]) in rows) + "."]
    return "\n".join(lines)


def decode_table(out, T):
    S = decode_settings(T)
    lines = ["| press (keep 10%) | " +
             " | ".join(f"context {C}" + (f", {B} sequences" if B > 1 else "") for C, B in S) +
             " |", "|---|" + "---|" * len(S)]
    base = {(C, B): load(os.path.join(out, decode_name(C, B, "exact"))) for C, B in S}
    for p in ["exact"] + PRESSES:
        cells = []
        for C, B in S:
            r = load(os.path.join(out, decode_name(C, B, p)))
            rate = r["tokens_per_second"]
            cells.append(f"{rate:.0f} ({rate / base[(C, B)]['tokens_per_second']:.2f}x)"
                         + (f", press {r['compress_seconds']:.2f} s" if p != "exact" else ""))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out, T):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("press_sweep: no matplotlib, no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, C in zip(axes, (T, 2 * T)):
        res = load(os.path.join(out, f"spans-{C}.json"))
        for p in PRESSES:
            rs = sorted((r for r in res["presses"] if r["press"] == p), key=lambda r: r["keep"])
            x = [r["keep"] * 100 for r in rs]
            y = [r["delta"] for r in rs]
            lo = [r["delta"] - r["ci95"][0] for r in rs]
            hi = [r["ci95"][1] - r["delta"] for r in rs]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=p)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_xticks([5, 10, 25, 50])
        ax.set_xticklabels(["5%", "10%", "25%", "50%"])
        ax.set_xlabel("prompt rows kept")
        ax.set_ylabel("bits per byte above exact (repeated spans)")
        ax.set_title(f"context {C}")
        ax.axhline(0, color="black", lw=0.5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kv_press.png"), dpi=110)


def render(a):
    T = training_context()
    parts = []
    for C in (T, 2 * T):
        parts.append(eval_table(load(os.path.join(a.out, f"spans-{C}.json")),
                                f"Repeated passages, context {C}"))
        parts.append(eval_table(load(os.path.join(a.out, f"windows-{C}.json")),
                                f"Held-out windows, context {C}, last {C // 8} bytes scored"))
    parts.append("**Decoding** 128 tokens after a prompt of context - 128 held-out bytes (greedy), "
                 "tokens per second (all sequences together) and speed-up over exact attention "
                 "over the full cache, one run after the other; the press's own time (once per "
                 "prompt) is not in the rate. The selection presses decode with exact attention's "
                 "decoding kernel over their kept rows; `wildcat` and `vcc` through "
                 "`weighted_attention`:\n\n" +
                 decode_table(a.out, T))
    with open(os.path.join(a.out, "machine.txt")) as f:
        # The machine, not the date (the result files carry that).
        parts.append("Measured on: " + "; ".join(
            l.strip() for l in f if l.strip() and not l.startswith("date:")) + ".")
    text = "\n\n".join(parts)
    with open(a.doc) as f:
        doc = f.read()
    i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    with open(a.doc, "w") as f:
        f.write(doc[:i] + "\n" + text + "\n" + doc[j:])
    plot(a.out, T)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm", default=os.path.join(REPO, "build", "release", "examples",
                                                  "effattn-lm"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "kv_press"))
    ap.add_argument("--doc", default=os.path.join(REPO, "docs", "kv_cache.md"))
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    if not a.render_only:
        measure(a)
    render(a)


if __name__ == "__main__":
    main()
