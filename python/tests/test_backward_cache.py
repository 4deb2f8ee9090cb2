"""attention_backward (exact, conv_basis) against the analytic softmax-attention gradient in
NumPy float64; WildCat compressed caches (compress_kv, append, weighted_attention)."""

import numpy as np
import pytest

import effattn
from conftest import rel_err, softmax_attention


def numpy_gradients(q, k, v, do, causal):
    """dL/dq, dL/dk, dL/dv of softmax(s q k^T + mask) v for dL/dO = do, in float64."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    n, d = q.shape
    m = k.shape[0]
    s = 1.0 / np.sqrt(d)
    logits = s * q @ k.T
    if causal:
        logits = np.where(np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n), logits, -np.inf)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dv = p.T @ do
    dp = do @ v.T
    ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    return s * ds @ k, s * ds.T @ q, dv


@pytest.mark.parametrize("policy", ["tiled", "naive"])
@pytest.mark.parametrize("causal", [False, True])
def test_exact_backward(rng, policy, causal):
    q, k, v = (rng.standard_normal(s) for s in [(30, 8), (45, 8), (45, 12)])
    do = rng.standard_normal((30, 12))
    ref = numpy_gradients(q, k, v, do, causal)
    grads = effattn.attention_backward(q, k, v, do, causal=causal, policy=policy)
    for g, r, name in zip(grads, ref, "qkv"):
        assert g.shape == r.shape and rel_err(g, r) < 1e-12, name
    fwd = effattn.attention(q, k, v, causal=causal, policy=policy)
    again = effattn.attention_backward(q, k, v, do, causal=causal, policy=policy, result=fwd)
    for g, r in zip(again, ref):
        assert rel_err(g, r) < 1e-12


def test_conv_basis_backward_exact_at_full_rank(rng):
    n = 40
    q, k, v = (rng.standard_normal((n, 8)) for _ in range(3))
    do = rng.standard_normal((n, 8))
    ref = numpy_gradients(q, k, v, do, causal=True)
    fwd = effattn.attention(q, k, v, method="conv_basis", causal=True, num_bases=n, probe=1)
    grads = effattn.attention_backward(q, k, v, do, method="conv_basis", causal=True, result=fwd,
                                       num_bases=n, probe=1)
    for g, r in zip(grads, ref):
        assert rel_err(g, r) < 1e-9


def test_conv_basis_backward_matches_finite_differences(rng):
    n = 24
    q, k, v = (rng.standard_normal((n, 4)) for _ in range(3))
    do = rng.standard_normal((n, 4))
    opts = dict(method="conv_basis", causal=True, num_bases=3, probe=2)
    fwd = effattn.attention(q, k, v, **opts)
    dq, dk, dv = effattn.attention_backward(q, k, v, do, result=fwd, **opts)
    # dL/dv is linear in v with the offsets fixed: a finite difference in v is exact up to round-off
    e = np.zeros_like(v)
    e[5, 2] = 1e-6
    loss = lambda vv: (effattn.attention(q, k, vv, **opts).output * do).sum()
    fd = (loss(v + e) - loss(v - e)) / 2e-6
    assert abs(fd - dv[5, 2]) < 1e-6 * max(1.0, abs(fd))


def test_backward_bad_input(rng):
    q = rng.standard_normal((10, 4))
    with pytest.raises(ValueError, match="dO"):
        effattn.attention_backward(q, q, q, q[:, :2])
    with pytest.raises(ValueError, match="gradients exist"):
        effattn.attention_backward(q, q, q, q, method="wildcat")
    wrong = effattn.attention(q, q, q, method="wildcat", rank=4)
    with pytest.raises(ValueError, match="method 'wildcat'"):
        effattn.attention_backward(q, q, q, q, result=wrong)


def test_wildcat_cache(rng):
    m, d = 120, 16
    k, v = rng.standard_normal((m, d)), rng.standard_normal((m, d))
    q = rng.standard_normal((7, d))
    full = effattn.compress_kv(k, v, rank=m)  # rank >= m: every key kept exactly
    assert full.size == m and full.tokens == m and full.dtype == "float64"
    r = effattn.weighted_attention(q, full)
    assert rel_err(r.output, softmax_attention(q, k, v)[0]) < 1e-10
    # append decoded tokens: exact over the concatenation
    k2, v2 = rng.standard_normal((3, d)), rng.standard_normal((3, d))
    full.append(k2, v2)
    assert full.tail_size == 3 and full.tokens == m + 3
    r = effattn.weighted_attention(q, full)
    ref = softmax_attention(q, np.vstack([k, k2]), np.vstack([v, v2]))[0]
    assert rel_err(r.output, ref) < 1e-10
    # a real compression: the same as attention(method="wildcat") with the same options
    small = effattn.compress_kv(k.astype(np.float32), v.astype(np.float32), rank=24, seed=3)
    assert small.size == 24 and small.keys.shape == (24, d) and small.pivots.shape == (24,)
    r = effattn.weighted_attention(q.astype(np.float32), small)
    assert r.output.dtype == np.float32 and r.error_bound >= 0 and r.info == "Success"
    assert "CompressedKV" in repr(small)
    with pytest.raises(ValueError):
        small.append(k2[:, :3], v2)
    with pytest.raises(ValueError, match="unknown option"):
        effattn.compress_kv(k, v, rnak=3)


def loop_gradients(q, k, v, do, causal):
    """Per-head NumPy gradients of (B, H, L, d) attention with GQA (dk, dv summed per group)."""
    B, H = q.shape[:2]
    G = k.shape[1]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            a, c, e = numpy_gradients(q[b, h], k[b, g], v[b, g], do[b, h], causal)
            dq[b, h] += a
            dk[b, g] += c
            dv[b, g] += e
    return dq, dk, dv


@pytest.mark.parametrize("G", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhld", "blhd_view"])
def test_sdpa_backward_gqa(rng, G, causal, layout):
    B, H, L, S, d, dv = 2, 4, 13, 21, 8, 6
    shapes = [(B, H, L, d), (B, G, S, d), (B, G, S, dv), (B, H, L, dv)]
    if layout == "bhld":
        q, k, v, do = (rng.standard_normal(s) for s in shapes)
    else:
        q, k, v, do = (rng.standard_normal((s[0], s[2], s[1], s[3])).transpose(0, 2, 1, 3)
                       for s in shapes)
    grads = effattn.sdpa_backward(q, k, v, do, is_causal=causal)
    ref = loop_gradients(q, k, v, do, causal)
    for g, r, name in zip(grads, ref, "qkv"):
        assert g.shape == r.shape and rel_err(g, r) < 1e-12, name


def test_sdpa_backward_varlen_and_conv_basis(rng):
    cu = [0, 9, 25]
    H, G, d = 4, 2, 8
    q = rng.standard_normal((25, H, d))
    k, v = rng.standard_normal((25, G, d)), rng.standard_normal((25, G, d))
    do = rng.standard_normal((25, H, d))
    for method, opts in [("exact", {}), ("conv_basis", dict(num_bases=25, probe=1))]:
        dq, dk, dv = effattn.sdpa_backward(q, k, v, do, is_causal=True, method=method,
                                           cu_seqlens_q=cu, **opts)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for b in range(2):
            s = slice(cu[b], cu[b + 1])
            ref = loop_gradients(*(x[s].transpose(1, 0, 2)[None] for x in (q, k, v, do)), True)
            for got, r in zip((dq, dk, dv), ref):
                assert rel_err(got[s].transpose(1, 0, 2), r[0]) < 1e-9, method
    with pytest.raises(ValueError, match="grad_output"):
        effattn.sdpa_backward(q, k, v, do[:, :, :3], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="gradients exist"):
        effattn.sdpa_backward(q, k, v, do, method="wildcat", cu_seqlens_q=cu)
