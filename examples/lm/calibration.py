#!/usr/bin/env python3
"""Calibration of the byte-level encoder's masked-byte predictions, in the metrics of the
KEP-SVGP paper: accuracy, expected calibration error (15 equal-width confidence bins), negative
log-likelihood, Brier score, and the AUROC of telling wrong predictions from right ones by the
model's confidence.

Data: every full 1024-byte window of the held-out split (data/heldout.txt), masked as the
encoder's evaluation masks them (lm_format.encoder_eval_mask); the first half of the windows
fits the temperature of the temperature-scaled row, and every row is scored on the second half.

Rows (each one a weight file and how its attention runs):
  softmax                       the shipped encoder, confidence = max softmax probability
  softmax + temperature         the same logits divided by T (T fitted by NLL on the first half)
  softmax, KEP-SVGP post hoc    the shipped encoder with effattn's KEP-SVGP in its last layer:
                                predictive = the mean of `samples` softmaxes, the last layer's
                                attention output drawn as mean + sqrt(variance) * eps per token
                                and value column (effattn's posterior variance); confidence =
                                the predictive's maximum; AUROC also by the negative variance
  softmax (seed 2)              the second softmax encoder (train.py --seed-offset 1,
                                weights/encoder-seed2.eflm): the seed-to-seed yardstick
  <model>-<method>              an encoder trained with an effattn method (train.py
                                --attention), run with it
  trained with kep_svgp         the encoder trained with KEP-SVGP's learned layer in its last
                                layer (train.py --attention kep_svgp), that layer run by
                                effattn.kep_svgp_layer (C++): predictive = the mean of `samples`
                                softmaxes, each with one posterior draw per token and column (as
                                the paper's 10 stochastic passes); AUROC also by the variance

    PYTHONPATH=build/python/python python3 examples/lm/calibration.py \\
        --out examples/lm/results/calibration.json --render docs/real_models.md
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import effattn  # noqa: E402
from doc_markers import write_between_markers  # noqa: E402
import lm_format  # noqa: E402
import train  # noqa: E402

CONTEXT = 1024
BINS = 15
KEP_OPTIONS = {"rank": 64, "seed": 42}  # effattn-lm's KEP-SVGP at its default budget


def load(path, attention="softmax"):
    header, tensors, _ = lm_format.read_eflm(path)
    cfg = dict(train.CONFIGS["encoder"], **{k: header[k] for k in lm_format.HEADER_U32})
    cfg["rope_base"], cfg["norm_eps"] = header["rope_base"], header["norm_eps"]
    if attention == "kep_svgp":
        cfg["kep_svgp"] = dict(train.KEP_SVGP)
    model = train.LM(cfg)
    train.load_format_tensors(model, tensors)
    if attention == "kep_svgp":
        train.load_kep(model, train.kep_path(path))
    train.use_attention(model, attention)
    return model


def windows(heldout):
    n = len(heldout) // CONTEXT
    out = []
    for w in range(n):
        raw = list(heldout[w * CONTEXT:(w + 1) * CONTEXT])
        inp, mask = train.encoder_masked_window(raw, w, train.MASK_TOKEN)
        out.append((inp, raw, mask))
    return out


def posthoc_last_layer(model, q, k, v):
    """effattn's training-free KEP-SVGP (sdpa) on the last layer's q, k, v (B x T x heads x hd):
    (mean, variance) B x T x H x hd and the map from a draw to the attention output (identity)."""
    B, T, H, hd = q.shape
    r = effattn.sdpa(q.transpose(1, 2).numpy(), k.transpose(1, 2).numpy(),
                     v.transpose(1, 2).numpy(), method="kep_svgp", **KEP_OPTIONS)
    mean = torch.from_numpy(np.ascontiguousarray(r.output)).transpose(1, 2)  # B T H hd
    var = torch.stack([torch.stack([torch.from_numpy(r.heads[b * H + j].variance)
                                    for j in range(H)], 1) for b in range(B)])  # B T H hd
    return mean, var.clamp_min(0).to(mean.dtype), lambda a: a, var.sum(dim=(2, 3)).double()


def learned_last_layer(model, q, k, v):
    """The trained KEP-SVGP layer run by effattn.kep_svgp_layer (C++), head by head:
    (mean, variance) B x T x H x s of the GP output F, the map F -> F W_add^T per head, and the
    variance of the layer's output (F W_add^T, entries of F independent) summed over heads and
    columns, B x T."""
    B, T, H, hd = q.shape
    w_e, w_r, lam, m_u, l_u = (x.detach().numpy() for x in model.kep_params())
    merge = model.cfg["kep_svgp"]["merge"]
    means, vars_ = [], []
    for b in range(B):
        mb, vb = [], []
        for h in range(H):
            mean, var, _, _ = effattn.kep_svgp_layer(q[b, :, h].numpy(), k[b, :, h].numpy(),
                                                     w_e[h], w_r[h], lam[h], m_u[h], l_u[h],
                                                     merge=merge)
            mb.append(torch.from_numpy(mean))
            vb.append(torch.from_numpy(var))
        means.append(torch.stack(mb, 1))
        vars_.append(torch.stack(vb, 1))
    mean, var = torch.stack(means), torch.stack(vars_)  # B T H s
    w_add = model.kep["w_add"].detach()  # H x hd x s

    def project(f):
        return torch.einsum("bths,hcs->bthc", f, w_add)

    out_var = torch.einsum("bths,hcs->bthc", var, w_add.square())
    return mean, var, project, out_var.sum(dim=(2, 3)).double()


@torch.no_grad()
def hidden_sampled(model, tokens, samples, gen):
    """LM.hidden with KEP-SVGP in the last layer (effattn's training-free form, or the trained
    layer when the model has one); returns (list of `samples` hidden states, B x T variance of
    the last layer's attention output summed over heads and value columns)."""
    c = model.cfg
    B, T = tokens.shape
    H, G, hd, eps = c["heads"], c["kv_heads"], c["head_dim"], c["norm_eps"]
    cos, sin = model.rope(T)
    x = F.embedding(tokens, model.p("embed"))
    last = c["layers"] - 1
    p = model.p
    for layer in range(c["layers"]):
        pre = f"layers.{layer}."
        h = train.rmsnorm(x, p(pre + "attn_norm"), eps)
        q = train.apply_rope(F.linear(h, p(pre + "wq")).view(B, T, H, hd), cos, sin)
        k = train.apply_rope(F.linear(h, p(pre + "wk")).view(B, T, G, hd), cos, sin)
        v = F.linear(h, p(pre + "wv")).view(B, T, G, hd)
        if layer < last:
            x = x + F.linear(model.attention(q, k, v, False, 1), p(pre + "wo"))
            h = train.rmsnorm(x, p(pre + "mlp_norm"), eps)
            x = x + F.linear(F.gelu(F.linear(h, p(pre + "w1"))), p(pre + "w2"))
            continue
        last_layer = learned_last_layer if model.kep is not None else posthoc_last_layer
        mean, var, project, total_var = last_layer(model, q, k, v)
        outs = []
        for _ in range(samples):
            f = mean + var.sqrt() * torch.randn(mean.shape, generator=gen, dtype=mean.dtype)
            a = project(f).to(x.dtype)
            y = x + F.linear(a.reshape(B, T, H * hd), p(pre + "wo"))
            h2 = train.rmsnorm(y, p(pre + "mlp_norm"), eps)
            y = y + F.linear(F.gelu(F.linear(h2, p(pre + "w1"))), p(pre + "w2"))
            outs.append(train.rmsnorm(y, p("final_norm"), eps))
        return outs, total_var
    raise AssertionError("unreachable")


@torch.no_grad()
def predictions(model, wins, kep_samples=0, batch=4, seed=7):
    """Per masked byte: (probability vectors N x V float64, targets N, extra uncertainty N)."""
    probs, targets, unc = [], [], []
    gen = torch.Generator().manual_seed(seed)
    for b0 in range(0, len(wins), batch):
        chunk = wins[b0:b0 + batch]
        tokens = torch.tensor([w[0] for w in chunk])
        raw = torch.tensor([w[1] for w in chunk])
        mask = torch.tensor([w[2] for w in chunk], dtype=torch.bool)
        if kep_samples:
            hs, var = hidden_sampled(model, tokens, kep_samples, gen)
            p = sum(model.logits(h).double().softmax(-1) for h in hs) / len(hs)
            unc.append(var[mask])
        else:
            p = model(tokens).double().softmax(-1)
        probs.append(p[mask])
        targets.append(raw[mask])
    return (torch.cat(probs).numpy(), torch.cat(targets).numpy(),
            torch.cat(unc).numpy() if unc else None)


def auroc(score, positive):
    """P(score of a random positive > score of a random negative), ties counted half."""
    score = np.asarray(score, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    npos, nneg = positive.sum(), (~positive).sum()
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    s = score[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
        i = j + 1
    return float((ranks[positive].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def metrics(probs, targets, extra_uncertainty=None):
    conf = probs.max(axis=1)
    pred = probs.argmax(axis=1)
    right = pred == targets
    n = len(targets)
    ece = 0.0
    edges = np.linspace(0.0, 1.0, BINS + 1)
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        if sel.any():
            ece += sel.sum() / n * abs(right[sel].mean() - conf[sel].mean())
    p_true = np.clip(probs[np.arange(n), targets], 1e-300, 1.0)
    onehot = np.zeros_like(probs)
    onehot[np.arange(n), targets] = 1.0
    out = {"bytes": int(n), "accuracy": float(right.mean()), "ece": float(ece),
           "nll": float(-np.log(p_true).mean()),
           "brier": float(((probs - onehot) ** 2).sum(axis=1).mean()),
           "auroc": auroc(conf, right)}
    if extra_uncertainty is not None:
        out["auroc_variance"] = auroc(-extra_uncertainty, right)
    return out


def fit_temperature(logp, targets):
    """T minimising the NLL of softmax(log p / T) (golden-section search on log T)."""
    z = torch.from_numpy(np.log(np.clip(logp, 1e-300, 1.0)))
    t = torch.from_numpy(targets).long()

    def nll(log_t):
        return F.cross_entropy(z / math.exp(log_t), t).item()

    a, b = math.log(0.25), math.log(4.0)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(60):
        if nll(c) < nll(d):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return math.exp((a + b) / 2)


def render(result, doc):
    lines = [f"Encoder masked-byte predictions on the held-out split: {result['fit_bytes']} bytes "
             f"fit the temperature (first half of the windows), every row is scored on the other "
             f"{result['score_bytes']} (second half). ECE: {BINS} equal-width bins; NLL in nats "
             "per masked byte; AUROC: wrong vs right predictions by confidence (KEP-SVGP: also "
             "by the negative posterior variance of the last layer's attention).", "",
             "| encoder | accuracy | ECE | NLL | Brier | AUROC (confidence) | AUROC (variance) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = r["metrics"]
        av = f"{m['auroc_variance']:.3f}" if "auroc_variance" in m else ""
        lines.append(f"| {r['name']} | {m['accuracy']:.4f} | {m['ece']:.4f} | {m['nll']:.4f} | "
                     f"{m['brier']:.4f} | {m['auroc']:.3f} | {av} |")
    write_between_markers(doc, "calibration", lines)


SEED2 = "seed2"  # --trained entry for the second softmax seed (weights/encoder-seed2.eflm)


def row_name(method):
    """The table row of an encoder in --trained (its name starts with this)."""
    return "softmax (seed 2)" if method == SEED2 else f"trained with {method}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=os.path.join(HERE, "weights"))
    ap.add_argument("--trained", default="seed2,performer,eva,kep_svgp",
                    help="encoders trained with these methods (seed2: the second softmax "
                    "seed), when their weights exist")
    ap.add_argument("--samples", type=int, default=8, help="KEP-SVGP predictive samples")
    ap.add_argument("--out")
    ap.add_argument("--render", metavar="DOC")
    ap.add_argument("--from-json", metavar="JSON")
    ap.add_argument("--update", action="store_true",
                    help="keep the softmax rows of --out and (re)compute only the --trained rows")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            render(json.load(f), args.render)
        return
    torch.set_num_threads(train.THREADS)
    with open(os.path.join(HERE, "data", "heldout.txt"), "rb") as f:
        heldout = f.read()
    wins = windows(heldout)
    fit, score = wins[:len(wins) // 2], wins[len(wins) // 2:]
    rows = []
    t0 = time.time()
    if args.update:
        with open(args.out) as f:
            old = json.load(f)
        redo = tuple(row_name(m) for m in args.trained.split(",") if m)
        rows = [r for r in old["rows"] if not r["name"].startswith(redo)]
        tf = np.zeros(old["fit_bytes"])
        ts = np.zeros(old["score_bytes"])
    else:
        base = load(os.path.join(args.weights, "encoder.eflm"))
        pf, tf, _ = predictions(base, fit)
        ps, ts, _ = predictions(base, score)
        rows.append({"name": "softmax", "metrics": metrics(ps, ts)})
        temp = fit_temperature(pf, tf)
        pt = torch.from_numpy(np.log(np.clip(ps, 1e-300, 1.0)) / temp).softmax(-1).numpy()
        rows.append({"name": f"softmax + temperature (T = {temp:.3f})", "temperature": temp,
                     "metrics": metrics(pt, ts)})
        pk, tk, uk = predictions(base, score, kep_samples=args.samples)
        rows.append({"name": f"softmax, KEP-SVGP post hoc (last layer, rank "
                             f"{KEP_OPTIONS['rank']}, {args.samples} samples)",
                     "metrics": metrics(pk, tk, uk)})
    for method in filter(None, args.trained.split(",")):
        path = os.path.join(args.weights, f"encoder-{method}.eflm")
        if not os.path.exists(path):
            print(f"calibration: {path} not found; row skipped", flush=True)
            continue
        model = load(path, "softmax" if method == SEED2 else method)
        if method == "kep_svgp":  # the paper's predictive: stochastic passes, averaged
            pm, tm, um = predictions(model, score, kep_samples=args.samples)
            rows.append({"name": f"trained with kep_svgp (last layer, rank "
                                 f"{model.cfg['kep_svgp']['rank']}, {args.samples} samples)",
                         "metrics": metrics(pm, tm, um)})
            continue
        pm, tm, _ = predictions(model, score)
        rows.append({"name": row_name(method), "metrics": metrics(pm, tm)})
    rows.sort(key=lambda r: not r["name"].startswith("softmax"))  # the softmax models first
    for r in rows:
        print(r["name"], json.dumps(r["metrics"]), flush=True)
    result = {"what": "encoder masked-byte calibration", "context": CONTEXT, "bins": BINS,
              "fit_bytes": int(len(tf)), "score_bytes": int(len(ts)), "rows": rows,
              "seconds": round(time.time() - t0, 1), "date": time.strftime("%Y-%m-%d")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if args.render:
        render(result, args.render)


if __name__ == "__main__":
    main()
