"""effattn.sdpa: (B, H, L, d) batches, GQA, variable length, layouts and copies, against a loop of
per-head NumPy float64 references and of per-head effattn.attention calls."""

import tracemalloc

import numpy as np
import pytest

import effattn
from conftest import rel_err, softmax_attention


def bhld(rng, B, H, L, d, dtype=np.float32):
    return rng.standard_normal((B, H, L, d)).astype(dtype)


def loop_reference(q, k, v, causal):
    B, H = q.shape[:2]
    G = k.shape[1]
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    lse = np.zeros(q.shape[:3])
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            out[b, h], lse[b, h] = softmax_attention(q[b, h], k[b, g], v[b, g], causal=causal)
    return out, lse


@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhld", "blhd_view"])
def test_exact_sdpa_gqa_against_numpy(rng, G, causal, layout):
    B, H, L, S, d, dv = 2, 4, 33, 47, 16, 24
    if layout == "bhld":
        q, k, v = bhld(rng, B, H, L, d), bhld(rng, B, G, S, d), bhld(rng, B, G, S, dv)
    else:  # a contiguous (B, L, H, d) buffer seen as (B, H, L, d), as torch's x.transpose(1, 2)
        q = rng.standard_normal((B, L, H, d)).astype(np.float32).transpose(0, 2, 1, 3)
        k = rng.standard_normal((B, S, G, d)).astype(np.float32).transpose(0, 2, 1, 3)
        v = rng.standard_normal((B, S, G, dv)).astype(np.float32).transpose(0, 2, 1, 3)
    r = effattn.sdpa(q, k, v, is_causal=causal)
    ref, lse = loop_reference(q, k, v, causal)
    assert r.output.shape == (B, H, L, dv) and r.info == "Success"
    assert rel_err(r.output, ref) < 2e-6
    np.testing.assert_allclose(r.lse, lse, atol=1e-4)
    # Read in place except GQA + causal on (B, H, L, d) blocks (one copy into (B, L, H, d)).
    copied = layout == "bhld" and G != H and causal
    assert any(r.copies.values()) == copied, r.copies
    if layout == "blhd_view":  # the output keeps the (B, L, H, dv) memory order
        assert r.output.strides[2] > r.output.strides[1]
    assert r.diagnostics["heads"] in (1, H)


@pytest.mark.parametrize(
    "method,causal,opts",
    [
        ("wildcat", False, dict(rank=12)),
        ("kep_svgp", False, dict(rank=5)),
        ("conv_basis", True, dict(num_bases=4)),
        ("eva", True, dict(window=8, chunk_size=4)),
        ("performer", False, dict(features=16)),
        ("vcc", False, dict(budget=12, vip=[0, 1])),
        ("exact", True, dict(policy="naive")),
    ],
)
@pytest.mark.parametrize("G", [4, 2])
def test_every_method_sdpa_equals_the_per_head_loop(rng, method, causal, opts, G):
    B, H, L, d = 2, 4, 40, 8
    q, k, v = bhld(rng, B, H, L, d), bhld(rng, B, G, L, d), bhld(rng, B, G, L, d)
    r = effattn.sdpa(q, k, v, is_causal=causal, method=method, **opts)
    assert r.output.shape == (B, H, L, d)
    for b in range(B):
        for h in range(H):
            one = effattn.attention(q[b, h], k[b, h // (H // G)], v[b, h // (H // G)],
                                    method=method, causal=causal, **opts)
            np.testing.assert_allclose(r.output[b, h], one.output, rtol=1e-5, atol=1e-6)
            if method != "exact":
                assert r.heads[b * H + h].diagnostics == one.diagnostics
    if method != "exact":
        assert len(r.heads) == B * H and r.heads[0].output is None


@pytest.mark.parametrize("method,opts", [("exact", {}), ("wildcat", dict(rank=8)),
                                         ("conv_basis", dict(num_bases=3))])
def test_varlen_equals_per_sequence_loop(rng, method, opts):
    cu = np.array([0, 5, 17, 17, 40], dtype=np.int32)  # flash-attention's int32 offsets
    H, G, d = 4, 2, 16
    T = cu[-1]
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    k = rng.standard_normal((T, G, d)).astype(np.float32)
    v = rng.standard_normal((T, G, d)).astype(np.float32)
    causal = method != "wildcat"
    r = effattn.sdpa(q, k, v, is_causal=causal, method=method, cu_seqlens_q=cu,
                     cu_seqlens_k=cu.tolist(), **opts)
    assert r.output.shape == (T, H, d) and not any(r.copies.values())
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        if cu[b] == cu[b + 1]:
            continue
        for h in range(H):
            g = h // (H // G)
            one = effattn.attention(q[s, h], k[s, g], v[s, g], method=method, causal=causal, **opts)
            np.testing.assert_allclose(r.output[s, h], one.output, rtol=1e-5, atol=1e-6)
            if method == "exact":
                ref, lse = softmax_attention(q[s, h], k[s, g], v[s, g], causal=True)
                assert rel_err(one.output, ref) < 2e-6
                np.testing.assert_allclose(r.lse[h, s], lse, atol=1e-4)


def test_varlen_decoding_against_a_cache(rng):
    # two sequences, one new query each, against 30 and 50 cached keys (bottom-right causal)
    H, d = 2, 8
    cu_k = [0, 30, 80]
    q = rng.standard_normal((2, H, d))
    k = rng.standard_normal((80, H, d))
    v = rng.standard_normal((80, H, d))
    r = effattn.sdpa(q, k, v, is_causal=True, cu_seqlens_q=[0, 1, 2], cu_seqlens_k=cu_k)
    for b in range(2):
        for h in range(H):
            ref = softmax_attention(q[b:b + 1, h], k[cu_k[b]:cu_k[b + 1], h],
                                    v[cu_k[b]:cu_k[b + 1], h])[0]
            assert rel_err(r.output[b, h], ref[0]) < 1e-12


def test_decoding_step_reads_a_gqa_cache_in_place(rng):
    # one query per sequence against a (B, G, S, d) cache: the causal mask shows every key
    q, k, v = bhld(rng, 2, 8, 1, 32), bhld(rng, 2, 2, 300, 32), bhld(rng, 2, 2, 300, 32)
    r = effattn.sdpa(q, k, v, is_causal=True)
    assert not any(r.copies.values())
    assert rel_err(r.output, loop_reference(q, k, v, True)[0]) < 2e-6


def test_sdpa_bad_input(rng):
    q, k = bhld(rng, 2, 4, 8, 16), bhld(rng, 2, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple"):
        effattn.sdpa(q, k, k)
    with pytest.raises(ValueError, match="batch"):
        effattn.sdpa(q, q[:1], q[:1])
    with pytest.raises(ValueError, match=r"\(B, H, L, d\)"):
        effattn.sdpa(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="head dimension"):
        effattn.sdpa(q, q[..., :8], q)
    with pytest.raises(ValueError, match="cu_seqlens"):
        effattn.sdpa(q[0], q[0], q[0], cu_seqlens_q=[0, 3, 9])
    with pytest.raises(ValueError, match="non-decreasing"):
        effattn.sdpa(q[0], q[0], q[0], cu_seqlens_q=[0, 5, 3, 4], cu_seqlens_k=[0, 1, 2, 4])
    with pytest.raises(ValueError, match="integers"):
        effattn.sdpa(q[0], q[0], q[0], cu_seqlens_q=[0.0, 4.0])
    with pytest.raises(ValueError, match="no causal form"):
        effattn.sdpa(q, q, q, is_causal=True, method="wildcat")
    with pytest.raises(ValueError, match="unknown option 'ranks'"):
        effattn.sdpa(q, q, q, method="wildcat", ranks=4)


def test_zero_copy_inputs_and_output(rng):
    B, H, L, d = 1, 8, 512, 64
    q, k, v = bhld(rng, B, H, L, d), bhld(rng, B, H, L, d), bhld(rng, B, H, L, d)
    r = effattn.sdpa(q, k, v)  # warm up
    tracemalloc.start()
    r = effattn.sdpa(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # No input-sized allocation on the Python / NumPy side (q is 1 MiB) ...
    assert peak < q.nbytes // 8, peak
    # ... and the kernel read the callers' buffers.
    assert r.data_ptrs == (q.ctypes.data, k.ctypes.data, v.ctypes.data)
    assert not any(r.copies.values())
    # The output is the C++ buffer itself (owned by the array, not copied).
    assert r.output.flags.c_contiguous and not r.output.flags.owndata
    # The measurement can fail: a float16 q is converted to float32 once, and tracemalloc sees
    # that copy (q.nbytes bytes).
    tracemalloc.start()
    r = effattn.sdpa(q.astype(np.float16), k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.copies["q"] and peak >= q.nbytes


def test_sdpa_bf16_policy(rng):
    q, k = bhld(rng, 1, 4, 64, 32), bhld(rng, 1, 2, 64, 32)
    r = effattn.sdpa(q, k, k, policy="tiled_bf16")
    ref, _ = loop_reference(q, k, k, False)
    assert r.output.dtype == np.float32 and 1e-6 < rel_err(r.output, ref) < 1e-2
    with pytest.raises(ValueError, match="attention only"):
        effattn.sdpa(q.view(np.uint16)[..., ::2].copy(), k, k)
