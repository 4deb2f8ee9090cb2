#!/usr/bin/python3
"""Independent float64 numpy check of the shipped models against FORMAT.md (no torch).

    /usr/bin/python3 examples/lm/check_reference.py [decoder] [encoder]     (~2 minutes)

Written from FORMAT.md alone (not from train.py's torch model): for each model it recomputes
the 128-token logit fixture and the held-out bits per byte of the first 4 windows at contexts
1024 and 2048, and compares them with fixtures/<model>.bin and reference.json
(`heldout_bpb_first4`). Exits non-zero on a mismatch (logits: max abs difference 1e-4;
bits per byte: relative 1e-5).
"""

import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import lm_format  # noqa: E402

_erf = np.vectorize(math.erf)


def forward(h, W, tokens):
    """float64 logits (T x vocab) of one window of token ids."""
    T = len(tokens)
    H, G, hd = h["heads"], h["kv_heads"], h["head_dim"]
    eps = float(np.float32(h["norm_eps"]))
    theta = np.arange(T)[:, None] * float(h["rope_base"]) ** (-2.0 * np.arange(hd // 2) / hd)
    cos, sin = np.cos(theta), np.sin(theta)

    def rope(x):
        a, b = x[:, :hd // 2], x[:, hd // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=1)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.reshape(-1)

    x = W["embed"][np.asarray(tokens)]
    for l in range(h["layers"]):
        p = f"layers.{l}."
        u = rms(x, W[p + "attn_norm"])
        q, k, v = u @ W[p + "wq"].T, u @ W[p + "wk"].T, u @ W[p + "wv"].T
        a = np.zeros((T, H * hd))
        for i in range(H):
            g = i // (H // G)
            s = rope(q[:, i * hd:(i + 1) * hd]) @ rope(k[:, g * hd:(g + 1) * hd]).T / math.sqrt(hd)
            if h["kind"] == lm_format.KIND_DECODER:
                s[np.triu(np.ones((T, T), bool), 1)] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            a[:, i * hd:(i + 1) * hd] = (s / s.sum(-1, keepdims=True)) @ v[:, g * hd:(g + 1) * hd]
        x = x + a @ W[p + "wo"].T
        u = rms(x, W[p + "mlp_norm"]) @ W[p + "w1"].T
        x = x + (u / 2 * (1 + _erf(u / math.sqrt(2)))) @ W[p + "w2"].T
    return rms(x, W["final_norm"]) @ W["embed"].T


def first4_bpb(h, W, heldout, C):
    bits, n = 0.0, 0
    for w in range(4):
        orig = np.frombuffer(heldout[w * C:(w + 1) * C], np.uint8).astype(np.int64)
        tokens = orig.copy()
        if h["kind"] == lm_format.KIND_ENCODER:
            mask = np.array(lm_format.encoder_eval_mask(w, C))
            tokens[mask] = h["mask_token"]
        lg = forward(h, W, tokens)
        m = lg.max(-1)
        lse = np.log(np.exp(lg - m[:, None]).sum(-1)) + m
        if h["kind"] == lm_format.KIND_DECODER:
            nll = lse[:-1] - lg[np.arange(C - 1), orig[1:]]
        else:
            nll = (lse - lg[np.arange(C), orig])[mask]
        bits += nll.sum() / math.log(2)
        n += len(nll)
    return bits / n


def main():
    ok = True
    with open(os.path.join(HERE, "data", "heldout.txt"), "rb") as f:
        heldout = f.read()
    with open(os.path.join(HERE, "reference.json")) as f:
        ref = json.load(f)
    for name in sys.argv[1:] or ("decoder", "encoder"):
        h, W, _ = lm_format.read_eflm(os.path.join(HERE, "weights", f"{name}.eflm"))
        W = {k: v.astype(np.float64) for k, v in W.items()}
        tokens, logits = lm_format.read_fixture(os.path.join(HERE, "fixtures", f"{name}.bin"))
        err = np.abs(forward(h, W, tokens.astype(np.int64)) - logits).max()
        good = err < 1e-4
        ok &= good
        print(f"{name}: fixture max |float64 - torch float32| = {err:.2e} "
              f"{'OK' if good else 'MISMATCH'}")
        for C in (1024, 2048):
            got = first4_bpb(h, W, heldout, C)
            want = ref[name]["heldout_bpb_first4"][str(C)]
            good = abs(got - want) <= 1e-5 * want
            ok &= good
            print(f"{name}: first 4 windows at {C}: {got:.7f} bpb, reference.json {want:.7f} "
                  f"{'OK' if good else 'MISMATCH'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
