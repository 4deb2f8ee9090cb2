"""Shared oracles of the effattn Python tests: attention in float64 with NumPy, independent of
effattn (no code of the module is reused)."""

import numpy as np
import pytest


def softmax_attention(q, k, v, causal=False, scale=None):
    """softmax(scale q k^T [+ bottom-right causal mask]) v in float64; returns (output, lse)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, d = q.shape
    m = k.shape[0]
    s = 1.0 / np.sqrt(d) if scale is None else scale
    logits = s * (q @ k.T)
    if causal:
        i = np.arange(n)[:, None]
        j = np.arange(m)[None, :]
        logits = np.where(j <= i + (m - n), logits, -np.inf)
    mx = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - mx)
    z = p.sum(axis=1, keepdims=True)
    return (p / z) @ v, (mx + np.log(z))[:, 0]


def torch_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d) [+ bottom-right causal mask]) v with torch in float64 (the
    oracle of the torch tests; differentiable). q (..., L, d); k, v (..., S, d) with fewer heads
    than q in dim -3 are repeated (GQA: query head h reads key / value head h // (H / G))."""
    import torch  # only the torch tests call this; they skip without torch

    q, k, v = (x.double() for x in (q, k, v))
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        L, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def mean_baseline(v, n, causal=False):
    """The uniform-attention baseline: every query returns the mean of the values it sees."""
    v = np.asarray(v, dtype=np.float64)
    m = v.shape[0]
    if not causal:
        return np.repeat(v.mean(axis=0, keepdims=True), n, axis=0)
    c = np.cumsum(v, axis=0)
    rows = np.arange(n) + (m - n)
    return c[rows] / (rows + 1)[:, None]


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
