#!/usr/bin/env python3
"""Training-step time of the shipped models' recipes with torch's own attention (matmul, softmax,
matmul, as train.py trains it) against effattn.torch's exact attention and the methods train.py
trains with (at its options), in one run.

One step = forward, cross-entropy, backward, gradient clipping and AdamW, on random bytes at the
model's batch and context (timing does not depend on the data). The attention variants run in
alternation, round after round, after one warm-up step each, so machine noise spreads over all
of them; the JSON holds every step time, the medians and each variant's median ratio to torch's.

    PYTHONPATH=build/python/python python3 examples/lm/bench_train_step.py \\
        --out bench/results/torch_train_step.json --render docs/python.md
    python3 examples/lm/bench_train_step.py --from-json bench/results/torch_train_step.json

Modes: ``autocast`` (bf16 matmuls under torch.autocast, float32 softmax: how train.py trains;
effattn computes attention in float32) and ``float32`` (everything in float32).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train  # noqa: E402
from doc_markers import write_between_markers  # noqa: E402

# torch's attention, effattn's exact attention, and the methods train.py trains each model
# with, at train.py's options (ATTENTION).
VARIANTS = {
    "decoder": [("torch", None, {}), ("effattn-exact", "exact", {}),
                ("effattn-eva", *train.ATTENTION["eva"]),
                ("effattn-conv_basis", *train.ATTENTION["conv_basis"])],
    "encoder": [("torch", None, {}), ("effattn-exact", "exact", {}),
                ("effattn-performer", *train.ATTENTION["performer"]),
                ("effattn-eva", *train.ATTENTION["eva"])],
}


def machine():
    cpu = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}


def step(model, opt, cfg, tokens, autocast):
    if cfg["kind"] == train.lm_format.KIND_DECODER:
        inp, target, masked = tokens[:, :-1], tokens[:, 1:], None
    else:  # masked-byte prediction: every 7th position masked (timing only)
        inp, target = tokens[:, :-1].clone(), tokens[:, :-1]
        masked = torch.zeros_like(inp, dtype=torch.bool)
        masked[:, ::7] = True
        inp[masked] = cfg["mask_token"]
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = model.hidden(inp, blocks=cfg["attn_blocks"])
    logits = model.logits(h.float())
    if masked is None:
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), target.reshape(-1))
    else:
        loss = F.cross_entropy(logits[masked], target[masked])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    opt.step()
    return time.perf_counter() - t0, loss.item()


def render(result, doc):
    """Writes the table of `result` between the train-step markers of `doc`."""
    m = result["machine"]
    lines = [f"Measured on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, "
             f"{m['torch_threads']} threads), {result['rounds']} alternating rounds; batch "
             f"{result['config']['batch']}, context {result['config']['context']}.", "",
             "| mode | attention | median step (s) | vs torch's attention |", "|---|---|---|---|"]
    for r in result["rows"]:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        name = r["attention"] + (f" ({opts})" if opts else "")
        lines.append(f"| {r['mode']} | {name} | {r['median_seconds']:.2f} | "
                     f"{r['ratio_to_torch']:.2f}x |")
    lines += ["", "`autocast`: bf16 matmuls under `torch.autocast` (how train.py trains; torch's "
              "attention products run in bf16, effattn's in float32); `float32`: everything in "
              "float32. Ratio < 1: the step is faster than with torch's attention."]
    encoder = result.get("model", "decoder") == "encoder"
    write_between_markers(doc, "train-step-encoder" if encoder else "train-step", lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per variant and mode")
    ap.add_argument("--model", choices=("decoder", "encoder"), default="decoder")
    ap.add_argument("--variants", help="comma-separated subset of the variant names")
    ap.add_argument("--modes", default="autocast,float32")
    ap.add_argument("--batch", type=int, help="default: the decoder's training batch")
    ap.add_argument("--context", type=int, help="default: the decoder's training context")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--render", metavar="DOC", help="render the table into DOC (docs/python.md)")
    ap.add_argument("--from-json", metavar="JSON", help="render this result instead of running")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            render(json.load(f), args.render or os.path.join(HERE, "..", "..", "docs", "python.md"))
        return

    cfg = dict(train.CONFIGS[args.model])
    cfg["batch"] = args.batch or cfg["batch"]
    cfg["context"] = args.context or cfg["context"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (cfg["batch"], cfg["context"] + 1), generator=gen)
    rows = []
    for mode in args.modes.split(","):
        autocast = mode == "autocast"
        runs = []
        chosen = VARIANTS[args.model]
        if args.variants:
            chosen = [v for v in chosen if v[0] in args.variants.split(",")]
        for name, method, opts in chosen:
            torch.manual_seed(cfg["seed"])
            model = train.LM(cfg)
            model.reset_parameters()
            model.effattn_method, model.effattn_options = method, dict(opts)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=tuple(cfg["betas"]),
                                    weight_decay=cfg["weight_decay"])
            step(model, opt, cfg, tokens, autocast)  # warm-up (allocations, plans, threads)
            runs.append((name, method, opts, model, opt, []))
        for _ in range(args.rounds):
            for name, method, opts, model, opt, times in runs:
                t, loss = step(model, opt, cfg, tokens, autocast)
                times.append(t)
                print(f"{mode:8s} {name:14s} {t:7.3f} s  loss {loss:.4f}", flush=True)
        base = statistics.median(runs[0][5])
        for name, method, opts, model, opt, times in runs:
            med = statistics.median(times)
            rows.append({"mode": mode, "attention": name, "method": method or "torch",
                         "options": opts, "median_seconds": med, "ratio_to_torch": med / base,
                         "seconds": times})
            print(f"{mode:8s} {name:14s} median {med:.3f} s, {med / base:.2f}x torch's step")
    result = {"what": f"{args.model} training step (forward, backward, AdamW)",
              "model": args.model,
              "config": {k: cfg[k] for k in ("batch", "context", "layers", "heads", "kv_heads",
                                             "head_dim", "d_model", "attn_blocks")},
              "rounds": args.rounds, "machine": machine(),
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if args.render:
        render(result, args.render)


if __name__ == "__main__":
    main()
