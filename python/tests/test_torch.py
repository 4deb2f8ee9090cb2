"""effattn against PyTorch (the reference its users trust), on torch tensors. Skipped with the
reason printed (pytest -rs) when torch is not installed."""

import os

import numpy as np
import pytest

import effattn
from conftest import rel_err, torch_attention

torch = pytest.importorskip("torch", reason="torch is not installed (apt-get install python3-torch)")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_sdpa_matches_torch(causal, dtype, tol):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 65, 32, generator=g, dtype=dtype)
    k = torch.randn(2, 2, 65, 32, generator=g, dtype=dtype)
    v = torch.randn(2, 2, 65, 16, generator=g, dtype=dtype)
    r = effattn.sdpa(q, k, v, is_causal=causal)
    ref = torch_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), causal)
    out = torch.from_numpy(r.output)
    assert out.dtype == dtype and out.shape == (2, 8, 65, 16)
    assert rel_err(out.numpy(), ref.numpy()) < tol


def test_tensors_are_read_in_place():
    q = torch.randn(1, 4, 128, 64)
    r = effattn.sdpa(q, q, q)
    assert r.data_ptrs == (q.data_ptr(),) * 3 and not any(r.copies.values())
    # (B, L, H, d) activations, transposed as PyTorch code does before SDPA: still no copy
    x = torch.randn(1, 128, 4, 64)
    r = effattn.sdpa(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2))
    assert r.data_ptrs == (x.data_ptr(),) * 3 and not any(r.copies.values())
    ref = torch_attention(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2))
    assert rel_err(r.output, ref.numpy()) < 2e-6
    with pytest.raises(ValueError, match="detach"):
        effattn.sdpa(q.requires_grad_(), q, q)


def test_single_head_methods_against_torch():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(96, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch_attention(q, k, v).numpy()
    for method, opts in [("exact", {}), ("wildcat", dict(rank=96)), ("kep_svgp", dict(rank=96)),
                         ("eva", dict(window=96)), ("vcc", dict(budget=96, vip=[0]))]:
        r = effattn.attention(q, k, v, method=method, **opts)
        assert rel_err(r.output, ref) < 1e-10, method
    cref = torch_attention(q, k, v, causal=True).numpy()
    r = effattn.attention(q, k, v, method="conv_basis", causal=True, num_bases=96, probe=1)
    assert rel_err(r.output, cref) < 1e-10


def test_backward_matches_torch_autograd():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    do = torch.randn(40, 8, generator=g, dtype=torch.float64)
    for causal in (False, True):
        for x in (q, k, v):
            x.grad = None
        torch_attention(q, k, v, causal).backward(do)
        grads = effattn.attention_backward(q.detach(), k.detach(), v.detach(), do, causal=causal)
        for ours, x in zip(grads, (q, k, v)):
            assert rel_err(ours, x.grad.numpy()) < 1e-12


def test_bf16_tensor_through_a_uint16_view():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(64, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (q, k, v)]
    r = effattn.attention(*bits)
    ref = torch_attention(q.float(), k.float(), v.float()).numpy()
    assert r.dtype == "bfloat16" and rel_err(r.output, ref) < 1e-2


def test_readme_example_runs():
    """The ```python examples of docs/python.md (effattn.torch, the NumPy-level API) run as
    written, in order."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    text = open(doc).read()
    assert "## The NumPy-level API" in text
    env = {}
    blocks = text.split("```python")[1:]
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block[: block.index("```")], "docs/python.md", "exec"), env)
    assert env["out"].shape == (2, 32, 1024, 128)
    assert env["r"].output.shape == (1024, 32, 128) and env["dv"].shape == (4096, 64)
