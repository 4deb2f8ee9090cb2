#!/usr/bin/env python3
"""A notebook-style tour of effattn from Python (run it, or step through the cells in an editor
that understands `# %%`). Every number it prints is computed here; it takes a few seconds.

    OMP_NUM_THREADS=2 PYTHONPATH=build/python/python /usr/bin/python3 examples/python/tour.py
"""
# %% One head: exact attention and the approximations, each on a workload it is made for
# (low-rank methods on `clustered` topic-like heads, local / Toeplitz ones on `positional`).
import numpy as np

import effattn


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


problems = {w: effattn.workload(w, 2048, 64, seed=1) for w in ("clustered", "positional")}
refs = {(w, c): effattn.attention(*qkv, causal=c) for w, qkv in problems.items()
        for c in (False, True)}
print(f"exact, 2048 x 64: {refs['clustered', False].seconds * 1e3:.1f} ms, "
      f"lse[:3] = {refs['clustered', False].lse[:3]}")
runs = [
    ("wildcat", "clustered", False, dict(rank=128)),
    ("kep_svgp", "clustered", False, dict(rank=32)),
    ("performer", "clustered", False, dict(features=256)),
    ("eva", "positional", True, dict(window=64, chunk_size=16)),
    ("conv_basis", "positional", True, dict(num_bases=16)),
    ("vcc", "positional", False, dict(budget=256, vip=list(range(2000, 2048)))),
]
for method, w, is_causal, opts in runs:
    r = effattn.attention(*problems[w], method=method, causal=is_causal, **opts)
    ref = refs[w, is_causal].output
    rows = opts.get("vip", slice(None))  # VCC serves its VIP rows
    print(f"{method:<11} {w:<11} {str(opts)[:24]:<26} rel. error {rel(r.output[rows], ref[rows]):.2e}"
          f" {r.seconds * 1e3:6.1f} ms  {r.diagnostics}")
q, k, v = problems["clustered"]
exact, causal = refs["clustered", False], refs["clustered", True]

# %% What the methods report beyond the output.
w = effattn.attention(q, k, v, method="wildcat", rank=128)
print("WildCat: certified max-entry error bound", w.error_bound, "measured",
      float(np.abs(w.output - exact.output).max()), "first pivots", w.pivots[:5])
kp = effattn.attention(q, k, v, method="kep_svgp", rank=32)
err = ((kp.output - exact.output) ** 2).sum(axis=1)
print("KEP-SVGP: corr(predicted variance, squared error) over tokens",
      float(np.corrcoef(kp.variance.sum(axis=1), err)[0, 1]))

# %% A batch in PyTorch's layout, with grouped-query attention, and a packed varlen batch.
rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 8, 512, 64), dtype=np.float32)  # (B, H, L, d)
KV = rng.standard_normal((2, 2, 512, 64), dtype=np.float32)  # (B, G, S, d): GQA 8 / 2
r = effattn.sdpa(Q, KV, KV, is_causal=True)
print("sdpa:", r.output.shape, r.lse.shape, r.diagnostics, "copies:", r.copies)
cu = [0, 100, 1024]  # two sequences of 100 and 924 tokens, packed (T, H, d)
r = effattn.sdpa(Q.reshape(1024, 8, 64), KV.reshape(1024, 2, 64), KV.reshape(1024, 2, 64),
                 method="wildcat", rank=32, cu_seqlens_q=cu)
print("varlen wildcat:", r.output.shape, "head (1, 3):", r.heads[1 * 8 + 3].diagnostics)

# %% A compressed KV cache for decoding, and gradients.
cache = effattn.compress_kv(k, v, rank=256)
step = effattn.weighted_attention(q[-1:], cache)
print(cache, "decode step error", rel(step.output, exact.output[-1:]), "bound", step.error_bound)
dq, dk, dv = effattn.attention_backward(q, k, v, np.ones_like(v), causal=True, result=causal)
print("gradients:", dq.shape, dk.shape, dv.shape, "|dv| =", float(np.linalg.norm(dv)))
