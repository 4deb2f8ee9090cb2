#!/usr/bin/env python3
"""Trained with the method vs swapped in after training vs softmax (two seeds): held-out bits
per byte of effattn-lm on the same windows, and the training-time figures, from one JSON.

Every row is one `effattn-lm eval --json` run (cached under results/trained/, rerun with
--force): the softmax models (seed 1 shipped, seed 2 from `train.py --seed-offset 1`) with exact
attention; the softmax models with a method swapped into every layer (post hoc); the models
trained with that method (`train.py --attention NAME`) run with it. torch's own held-out figure
of each trained model (reference.json, every window) sits beside effattn-lm's.

    python3 examples/lm/trained_table.py --lm build/release/examples/lm/effattn-lm \\
        --seed2 .cache/lm-seed2 --render docs/real_models.md
"""

import argparse
import json
import os
import subprocess
import time

from doc_markers import write_between_markers

HERE = os.path.dirname(os.path.abspath(__file__))

# (model kind, method, effattn-lm budget = the options train.py's ATTENTION uses)
METHODS = [("decoder", "eva", 16), ("decoder", "conv_basis", 16), ("encoder", "performer", 256),
           ("encoder", "eva", 16)]


def eval_json(lm, weights, kind, method, budget, context, windows, path, force):
    if force or not os.path.exists(path):
        cmd = [lm, "eval", "--model", kind, "--weights", weights, "--method", method,
               "--context", str(context), "--windows", str(windows), "--no-layer-error",
               "--json", path]
        if budget:
            cmd += ["--budget", str(budget)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        r = json.load(f)
    r.pop("predicted", None)
    return r


def reference(path, name):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get(name)


def collect(a):
    out_dir = os.path.join(HERE, "results", "trained")
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    def add(kind, trained, method, budget, weights, ref):
        if not os.path.exists(weights):
            print(f"trained_table: {weights} not found; row skipped", flush=True)
            return
        tag = os.path.splitext(os.path.basename(weights))[0]
        row = {"model": kind, "trained_with": trained, "run_with": method, "budget": budget,
               "weights": os.path.relpath(weights, HERE), "bits_per_byte": {},
               "tokens_per_second": {}}
        for C in a.contexts:
            r = eval_json(a.lm, weights, kind, method, budget, C, a.windows,
                          os.path.join(out_dir, f"{tag}_{method}_{C}.json"), a.force)
            row["bits_per_byte"][str(C)] = r["bits_per_byte"]
            row["tokens_per_second"][str(C)] = r.get("tokens_per_second")
        if ref:
            row["torch_heldout_bpb"] = ref.get("heldout_bpb")
            row["train_seconds_per_step"] = ref["train_seconds"] / ref["steps"]
            row["train_threads"] = ref.get("threads")
        rows.append(row)

    wdir = os.path.join(HERE, "weights")
    for kind in ("decoder", "encoder"):
        add(kind, "softmax", "exact", 0, os.path.join(wdir, f"{kind}.eflm"),
            reference(os.path.join(HERE, "reference.json"), kind))
        add(kind, "softmax (seed 2)", "exact", 0,
            os.path.join(a.seed2, "weights", f"{kind}-seed2.eflm"),
            reference(os.path.join(a.seed2, "reference.json"), f"{kind}-seed2"))
        for k, method, budget in METHODS:
            if k != kind:
                continue
            add(kind, "softmax", method, budget, os.path.join(wdir, f"{kind}.eflm"), None)
            add(kind, method, method, budget, os.path.join(wdir, f"{kind}-{method}.eflm"),
                reference(os.path.join(HERE, "reference.json"), f"{kind}-{method}"))
    return {"what": "trained with the method vs post hoc vs softmax", "windows": a.windows,
            "contexts": a.contexts, "rows": rows, "date": time.strftime("%Y-%m-%d")}


def render(result, doc):
    C = [str(c) for c in result["contexts"]]
    lines = [f"effattn-lm on the first {result['windows']} held-out windows of each context "
             "(the same windows for every row); torch: the trainer's figure over every window. "
             "Speed: effattn-lm's tokens per second relative to the softmax model run exactly.",
             "", "| model | trained with | run with | " + " | ".join(f"bpb @ {c}" for c in C) +
             " | torch bpb @ " + C[0] + " | speed vs exact @ " + C[-1] + " |",
             "|---|---|---|" + "---|" * (len(C) + 2)]
    exact_tps = {}  # the softmax model of each kind run exactly (same architecture)
    for r in result["rows"]:
        if r["run_with"] == "exact" and r["trained_with"] == "softmax":
            exact_tps[r["model"]] = r["tokens_per_second"].get(C[-1])
    for r in result["rows"]:
        bpb = " | ".join(f"{r['bits_per_byte'][c]:.4f}" for c in C)
        torch_bpb = r.get("torch_heldout_bpb") or {}
        tb = f"{torch_bpb[C[0]]:.4f}" if C[0] in torch_bpb else ""
        base = exact_tps.get(r["model"])
        tps = r["tokens_per_second"].get(C[-1])
        speed = f"{tps / base:.2f}x" if base and tps and r["run_with"] != "exact" else ""
        name = r["run_with"] + (f" ({r['budget']})" if r["budget"] else "")
        lines.append(f"| {r['model']} | {r['trained_with']} | {name} | {bpb} | {tb} | {speed} |")
    write_between_markers(doc, "trained", lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm", help="the effattn-lm binary")
    ap.add_argument("--seed2", default=HERE, help="where <model>-seed2.eflm and its reference.json "
                    "entry are (train.py --seed-offset 1 --out DIR; the shipped ones: here)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--contexts", default="1024,2048")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "trained.json"))
    ap.add_argument("--render", metavar="DOC")
    ap.add_argument("--from-json", action="store_true", help="render --out without running")
    a = ap.parse_args()
    a.contexts = [int(c) for c in a.contexts.split(",")]
    if a.from_json:
        with open(a.out) as f:
            result = json.load(f)
    else:
        result = collect(a)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if a.render:
        render(result, a.render)


if __name__ == "__main__":
    main()
