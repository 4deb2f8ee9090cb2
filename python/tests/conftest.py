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
