"""effattn.torch: gradients through torch.autograd against finite differences (gradcheck) and
against torch's own autograd of softmax attention written in torch (the oracle); layouts,
subsets of requires_grad, no_grad, bad input. Skipped with the reason printed without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (apt-get install python3-torch)")
import effattn.torch as et  # noqa: E402
from conftest import torch_attention  # noqa: E402


def inputs(B, H, G, L, S, d, dv=None, dtype=torch.float64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, d, generator=g, dtype=dtype)
    k = torch.randn(B, G, S, d, generator=g, dtype=dtype)
    v = torch.randn(B, G, S, dv or d, generator=g, dtype=dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


# Settings of every method with a backward; gradcheck (central differences, eps 1e-6, float64)
# compares the C++ backward with the C++ forward's own finite differences.
GRADCHECK = [
    ("exact", False, 2, {}),
    ("exact", True, 2, {}),
    ("exact", True, 1, {"policy": "naive"}),
    ("exact", False, 1, {}),
    ("conv_basis", True, 2, {"num_bases": 3, "probe": 2}),
    ("conv_basis", True, 1, {}),
    ("performer", False, 2, {"features": 16, "seed": 3}),
    ("eva", False, 2, {"window": 4, "chunk_size": 2}),
    ("eva", True, 2, {"window": 4, "chunk_size": 2}),
    ("eva", True, 1, {"window": 4, "chunk_size": 4, "samples": 2, "seed": 5}),
]


@pytest.mark.parametrize("method,causal,G,opts", GRADCHECK)
def test_gradcheck_float64(method, causal, G, opts):
    q, k, v = inputs(1, 4, G, 10, 10, 4, dv=3, seed=1)
    assert torch.autograd.gradcheck(
        lambda a, b, c: et.attention(a, b, c, method, causal, **opts), (q, k, v),
        eps=1e-6, atol=1e-7, rtol=1e-5,
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_exact_gradients_match_torch_autograd(causal, G):
    q, k, v = inputs(2, 4, G, 33, 40, 8, dv=5, seed=2)
    w = torch.randn(2, 4, 33, 5, dtype=torch.float64)
    grads = torch.autograd.grad((et.attention(q, k, v, causal=causal) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((torch_attention(q, k, v, causal) * w).sum(), (q, k, v))
    for a, b in zip(grads, ref):
        assert a.shape == b.shape and a.dtype == torch.float64
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_eva_equals_exact_when_the_window_covers_every_key():
    q, k, v = inputs(1, 2, 2, 16, 16, 4, seed=3)
    w = torch.randn(1, 2, 16, 4, dtype=torch.float64)
    for causal in (False, True):
        ge = torch.autograd.grad(
            (et.attention(q, k, v, "eva", causal, window=16) * w).sum(), (q, k, v))
        gx = torch.autograd.grad((torch_attention(q, k, v, causal) * w).sum(), (q, k, v))
        for a, b in zip(ge, gx):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method,causal,opts", [
    ("exact", True, {}),
    ("conv_basis", True, {"num_bases": 4}),
    ("performer", False, {"features": 32}),
    ("eva", True, {"window": 8, "chunk_size": 4}),
])
def test_float32_gradients_follow_float64(method, causal, opts):
    q, k, v = inputs(2, 2, 1, 48, 48, 8, seed=4)
    w = torch.randn(2, 2, 48, 8, dtype=torch.float64)

    def grads(dtype):
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = et.attention(*x, method=method, causal=causal, **opts)
        assert out.dtype == dtype
        return [g.double() for g in torch.autograd.grad((out * w.to(dtype)).sum(), x)]

    for a, b in zip(grads(torch.float32), grads(torch.float64)):
        assert a.dtype == torch.float64
        # float32 rounding of the inputs, logits and sums: measured relative errors 1e-7..1e-6
        assert (a - b).norm() <= 1e-4 * b.norm()


def test_requires_grad_on_a_subset_and_no_grad():
    q, k, v = inputs(1, 2, 2, 10, 10, 4, seed=5, requires_grad=False)
    v.requires_grad_()
    out = et.attention(q, k, v, causal=True)
    (dv,) = torch.autograd.grad(out.sum(), (v,))
    ref = torch.autograd.grad(torch_attention(q, k, v, True).sum(), (v,))[0]
    assert torch.allclose(dv, ref, rtol=1e-10, atol=1e-12)
    q.requires_grad_()
    out = et.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None
    with torch.no_grad():
        y = et.attention(q, k, v)
    assert not y.requires_grad and torch.allclose(y, torch_attention(q, k, v).detach())


def test_layouts_transposed_and_sliced_inputs():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)  # (B, L, H, d)
    big = torch.randn(2, 4, 30, 16, generator=g, dtype=torch.float64, requires_grad=True)
    q = x.transpose(1, 2)                # read in place (packed layout)
    k = big[:, :, 3:27, ::2]             # strided: converted once
    v = big[:, :, 2:26, 8:]
    out = et.attention(q, k, v, causal=True)
    ref = torch_attention(q, k, v, True)
    assert torch.allclose(out, ref, rtol=1e-11, atol=1e-12)
    w = torch.randn_like(ref)
    ga = torch.autograd.grad((out * w).sum(), (x, big))
    gb = torch.autograd.grad((ref * w).sum(), (x, big))
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_in_place_reads_and_no_copy_of_the_output():
    q, k, v = inputs(1, 4, 4, 64, 64, 16, dtype=torch.float32, requires_grad=False)
    r = et._effattn.sdpa(q.numpy(), k.numpy(), v.numpy(), keep_state=True)
    assert r.data_ptrs == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert not any(r.copies.values()) and r.state.method == "exact" and r.state.has_backward
    out = torch.from_numpy(r.output)
    dq, dk, dv = r.state.backward(np.ones((1, 4, 64, 16), dtype=np.float32))
    assert dq.shape == (1, 4, 64, 16) and dv.shape == (1, 4, 64, 16)
    assert torch.allclose(out.double(), torch_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_method_without_backward_raises_naming_it():
    q, k, v = inputs(1, 2, 2, 32, 32, 8, seed=7)
    for method, opts in [("wildcat", {"rank": 8}), ("vcc", {"budget": 8}),
                         ("kep_svgp", {"rank": 8})]:
        out = et.attention(q, k, v, method=method, **opts)  # the forward runs
        assert out.shape == (1, 2, 32, 8) and out.requires_grad
        with pytest.raises(ValueError, match=f"method '{method}' has no backward"):
            out.sum().backward()
        with torch.no_grad():
            assert et.attention(q, k, v, method=method, **opts).shape == (1, 2, 32, 8)


def test_bad_input_raises():
    q, k, v = inputs(1, 3, 3, 8, 8, 4)
    with pytest.raises(ValueError, match="4-D"):
        et.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="multiple"):
        et.attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="one dtype"):
        et.attention(q, k.float(), v)
    with pytest.raises(ValueError, match="float32 or float64"):
        et.attention(q.int(), k.int(), v.int())
    bad = q.detach().clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError):
        et.attention(bad.requires_grad_(), k, v)
    with pytest.raises(ValueError, match="unknown option"):
        et.attention(q, k, v, method="eva", windw=4)
    with pytest.raises(ValueError, match="causal"):
        et.attention(q, k, v, method="performer", causal=True)
    out = et.attention(q, k, v)
    g = torch.ones_like(out)
    g[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="dO"):
        out.backward(g)
    with pytest.raises(ValueError, match="unknown method"):
        et.Attention("softmax")


def test_in_place_change_before_backward_is_detected():
    q, k, v = inputs(1, 2, 2, 8, 8, 4)
    out = et.attention(q, k, v)
    with torch.no_grad():
        v.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_module():
    m = et.Attention("exact", causal=True)
    assert "method='exact'" in repr(m) and m.has_backward and not list(m.parameters())
    q, k, v = inputs(2, 4, 2, 16, 16, 8)
    assert torch.allclose(m(q, k, v), torch_attention(q, k, v, True), rtol=1e-11, atol=1e-12)
    eva = et.Attention("eva", causal=True, window=4, chunk_size=4)
    y = eva(q, k, v)
    y.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_half_precision_inputs_compute_in_float32():
    q, k, v = inputs(1, 4, 2, 32, 32, 8, seed=8)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out = et.attention(qb, kb, vb, causal=True)
    assert out.dtype == torch.float32
    ref = torch_attention(*(t.detach().float() for t in (qb, kb, vb)), causal=True)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and torch.isfinite(qb.grad.float()).all()


def test_numpy_level_backward_of_eva_and_performer_matches_effattn_torch():
    import effattn
    q, k, v = inputs(1, 4, 2, 24, 24, 8, seed=9)
    w = torch.randn(1, 4, 24, 8, dtype=torch.float64)
    for method, causal, opts in [("eva", True, {"window": 8, "chunk_size": 4}),
                                 ("performer", False, {"features": 32, "seed": 4})]:
        ref = torch.autograd.grad((et.attention(q, k, v, method, causal, **opts) * w).sum(),
                                  (q, k, v))
        got = effattn.sdpa_backward(q.detach(), k.detach(), v.detach(), w, is_causal=causal,
                                    method=method, **opts)
        for a, b in zip(got, ref):
            assert np.allclose(a, b.numpy(), rtol=1e-12, atol=1e-14)
        # one head through attention_backward: the same as the (1, 1, L, d) sdpa call
        one = effattn.attention_backward(q[0, 0].detach(), k[0, 0].detach(), v[0, 0].detach(),
                                         w[0, 0], method=method, causal=causal, **opts)
        sd = effattn.sdpa_backward(q[:, :1].detach(), k[:, :1].detach(), v[:, :1].detach(),
                                   w[:, :1], is_causal=causal, method=method, **opts)
        for a, b in zip(one, sd):
            assert np.allclose(a, b[0, 0], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="method 'wildcat' has no backward"):
        effattn.sdpa_backward(q.detach(), k.detach(), v.detach(), w, method="wildcat", rank=8)
