#!/usr/bin/env python3
"""Every effattn method inside the two trained models: the table and the Pareto plot of docs/real_models.md.

    /usr/bin/python3 examples/lm/sweep.py --lm build/release/examples/effattn-lm \\
        [--windows 16] [--contexts 1024,2048] [--out examples/lm/results]

Runs `effattn-lm eval --json` for every (model, method, budget, context) of GRID below (every
method on the model whose mask it supports, two budgets each), keeps the JSON files in --out,
and writes there
  table.md     model x method x budget -> bits per byte (delta vs exact), worst per-layer error,
               attention speed-up and whole-forward speed-up, per context;
  pareto.png   held-out bits per byte above exact (log) against attention time, one panel per
               (model, context), the Pareto front drawn as a step line (needs matplotlib:
               python3-matplotlib).
Both speed-ups are ratios measured in one process: effattn-lm times exact attention on the
method layers' own inputs next to the method (attention speed-up = exact / method); the
whole-forward speed-up replaces the method's attention time by exact's in the forward time.
An existing JSON file is reused unless --force is given.
"""
import argparse
import json
import os
import subprocess
import sys

# (model, method, budgets). Budget units: Conv-Basis bases k, EVA chunk size, WildCat / VCC
# (decoder) compressed prompt rows, VCC (encoder) compressed length incl. the masked (VIP) rows,
# Performer features, KEP-SVGP rank.
GRID = [
    ("decoder", "exact", [0]),
    ("decoder", "conv_basis", [16, 64]),
    ("decoder", "eva", [64, 16]),
    ("decoder", "wildcat", [64, 256]),
    ("decoder", "vcc", [128, 256]),
    ("encoder", "exact", [0]),
    ("encoder", "wildcat", [64, 256]),
    ("encoder", "vcc", [512, 768]),
    ("encoder", "eva", [64, 16]),
    ("encoder", "performer", [64, 256]),
    ("encoder", "kep_svgp", [32, 128]),
]


def run(lm, model, method, budget, context, windows, out, force):
    path = os.path.join(out, f"{model}_{method}_{budget}_{context}.json")
    if force or not os.path.exists(path):
        cmd = [lm, "eval", "--model", model, "--method", method, "--budget", str(budget),
               "--context", str(context), "--windows", str(windows), "--json", path,
               "--no-progress"]
        print(" ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


# Longest context per model: the decoder (trained at 2048) extrapolates to 4096 (held-out 2.114
# bits/byte at 4096 vs 2.100 at 2048 on the same bytes); the encoder (trained at 1024) does not
# beyond 2048 (2.42 at 4096 vs 1.92).
MAX_CONTEXT = {"decoder": 4096, "encoder": 2048}


def fmt_err(errs, layers):
    e = [f"{x:.2f}" if used and x is not None else "-" for x, used in zip(errs, layers)]
    return " / ".join(e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm", required=True, help="the effattn-lm binary")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--models", default="decoder,encoder")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    rows = []
    for context in contexts:
        for model, method, budgets in GRID:
            if model not in a.models.split(",") or context > MAX_CONTEXT[model]:
                continue
            for b in budgets:
                rows.append(run(a.lm, model, method, b, context, a.windows, a.out, a.force))

    exact = {(r["model"], r["context"]): r for r in rows if r["method"] == "exact"}
    lines = []
    for context in contexts:
        lines.append(f"\n**Context {context}** ({a.windows} held-out windows per model)\n")
        lines.append("| model | method | budget | bits/byte | delta | tail bits/byte (delta) | "
                     "layer error L0 / L1 / L2 / L3 | attention speed-up | forward speed-up |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["context"] != context:
                continue
            ex = exact[(r["model"], context)]
            d = r["bits_per_byte"] - ex["bits_per_byte"]
            if r["method"] == "exact":
                tail = (f"{r['bits_per_byte_tail']:.3f}" if r["model"] == "decoder" else "")
                lines.append(f"| {r['model']} | exact | - | {r['bits_per_byte']:.3f} | - | {tail} "
                             f"| - | 1 | 1 |")
                continue
            tail = ""
            if r["model"] == "decoder":
                dt = r["bits_per_byte_tail"] - ex["bits_per_byte_tail"]
                tail = f"{r['bits_per_byte_tail']:.3f} ({dt:+.3f})"
            ms, es = r["method_attention_seconds"], r["exact_attention_seconds"]
            att = es / ms if ms else float("nan")
            fwd = r["forward_seconds"]
            fwd_sp = (fwd - ms + es) / fwd if fwd else float("nan")
            extra = ""
            if r.get("variance_loss_spearman") is not None:
                extra = f" (Spearman var/loss {r['variance_loss_spearman']:.2f})"
            lines.append(f"| {r['model']} | {r['method']}{extra} | {r['budget']} | "
                         f"{r['bits_per_byte']:.3f} | {d:+.3f} | {tail} | "
                         f"{fmt_err(r['layer_error'], r['layers'])} | {att:.2f} | {fwd_sp:.2f} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    print(table)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: no plot (Debian: python3-matplotlib)", file=sys.stderr)
        return
    panels = [(m, c) for c in contexts for m in ("decoder", "encoder")
              if m in a.models and c <= MAX_CONTEXT[m]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    floor = 1e-4  # exact (delta 0) and methods within 1e-4 bits of it are drawn here
    for ax, (model, context) in zip(axes[0], panels):
        ex = exact[(model, context)]["bits_per_byte"]
        pts = []
        for r in rows:
            if r["model"] != model or r["context"] != context:
                continue
            # Attention time of the pass with this method: the method layers' time (every layer
            # here), exact's own time for exact; per window.
            t = (r["attention_seconds"] if r["method"] == "exact" else r["method_attention_seconds"])
            t = t / max(1, r["windows"]) * 1e3
            d = max(r["bits_per_byte"] - ex, floor)
            label = "exact" if r["method"] == "exact" else f"{r['method']} {r['budget']}"
            pts.append((t, d, label))
            ax.scatter([t], [d], s=18)
            ax.annotate(label, (t, d), fontsize=6, xytext=(3, 2), textcoords="offset points")
        pts.sort()
        front, best = [], float("inf")
        for t, d, _ in pts:
            if d < best:
                front.append((t, d))
                best = d
        if front:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", lw=0.8,
                    color="grey")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}, context {context} (exact {ex:.3f} bits/byte)", fontsize=8)
        ax.set_xlabel("attention ms per window (all layers)", fontsize=8)
        ax.set_ylabel("bits per byte above exact", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "pareto.png"), dpi=130)


if __name__ == "__main__":
    main()
