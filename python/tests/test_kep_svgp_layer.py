"""KEP-SVGP's learned layer: the torch references that train it (effattn.torch.kep_svgp_layer,
kep_svgp_kl, kep_svgp_ksvd_loss) against effattn's C++ forwards, which inference runs, and the
C++ layer against an independent NumPy evaluation of its formula."""

import numpy as np
import pytest

import effattn

torch = pytest.importorskip("torch")
import effattn.torch as et  # noqa: E402


def random_layer(gen, d, s, dv, dtype):
    """A layer drawn as train.py initialises one: Lambda^-1/2 = exp(U(0, 1)), N(0, 1) m_u and
    factors with an exp(N(0, 1)) diagonal."""
    w_e = torch.linalg.qr(torch.randn(d, s, generator=gen, dtype=dtype))[0]
    w_r = torch.linalg.qr(torch.randn(d, s, generator=gen, dtype=dtype))[0]
    lam = torch.exp(-2.0 * torch.rand(s, generator=gen, dtype=dtype))
    m_u = torch.randn(s, dv, generator=gen, dtype=dtype)
    l_u = torch.randn(dv, s, s, generator=gen, dtype=dtype).tril(-1) + torch.diag_embed(
        torch.randn(dv, s, generator=gen, dtype=dtype).exp()
    )
    return w_e, w_r, lam, m_u, l_u


def numpy_layer(q, k, w_e, w_r, lam, m_u, l_u, merge):
    """The formula of kep_svgp::learned_layer in float64 NumPy, token by token."""
    q, k, w_e, w_r, lam, m_u, l_u = (np.asarray(x, dtype=np.float64)
                                     for x in (q, k, w_e, w_r, lam, m_u, l_u))
    mean = np.zeros((q.shape[0], m_u.shape[1]))
    var = np.zeros_like(mean)
    for i in range(q.shape[0]):
        e = q[i] / max(np.linalg.norm(q[i]), 1e-12) @ w_e
        f = e + (k[i] / max(np.linalg.norm(k[i]), 1e-12) @ w_r if merge == "addition" else 0)
        g = f / lam
        for c in range(m_u.shape[1]):
            mean[i, c] = g @ m_u[:, c]
            var[i, c] = g @ (l_u[c] @ l_u[c].T) @ g
    return mean, var


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("merge", ["addition", "e_only"])
def test_torch_layer_matches_effattn(dtype, merge):
    gen = torch.Generator().manual_seed(3)
    n, d, s, dv = 200, 64, 10, 10
    q = torch.randn(n, d, generator=gen, dtype=dtype)
    k = torch.randn(n, d, generator=gen, dtype=dtype)
    w_e, w_r, lam, m_u, l_u = random_layer(gen, d, s, dv, dtype)
    mean, var, e, r = et.kep_svgp_layer(q, k, w_e, w_r, lam, m_u, l_u, merge)
    cm, cv, ce, cr = effattn.kep_svgp_layer(*(x.numpy() for x in (q, k, w_e, w_r, lam, m_u, l_u)),
                                            merge=merge)
    assert cm.dtype == (np.float64 if dtype == torch.float64 else np.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # float32: measured <= 2.2e-7
    assert rel(mean.numpy(), cm) <= tol
    assert rel(var.numpy(), cv) <= tol
    assert rel(e.numpy(), ce) <= tol and rel(r.numpy(), cr) <= tol
    nm, nv = numpy_layer(q, k, w_e, w_r, lam, m_u, l_u, merge)
    assert rel(cm, nm) <= tol and rel(cv, nv) <= tol
    assert (cv >= 0).all()


def test_torch_layer_batched_matches_per_head():
    """train.py calls the reference on (B, H, T, d) with per-head parameters broadcast."""
    gen = torch.Generator().manual_seed(4)
    B, H, T, d, s = 2, 3, 50, 16, 4
    q = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64)
    heads = [random_layer(gen, d, s, s, torch.float64) for _ in range(H)]
    stacked = [torch.stack([h[i] for h in heads])[None] for i in range(5)]
    mean, var, e, r = et.kep_svgp_layer(q, k, *stacked)
    for b in range(B):
        for h in range(H):
            cm, cv, _, _ = effattn.kep_svgp_layer(q[b, h].numpy(), k[b, h].numpy(),
                                                  *(x.numpy() for x in heads[h]))
            assert rel(mean[b, h].numpy(), cm) <= 1e-12
            assert rel(var[b, h].numpy(), cv) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_kl_and_ksvd_loss_match_effattn(dtype):
    gen = torch.Generator().manual_seed(5)
    n, m, d, s, dv = 120, 90, 32, 6, 5
    w_e, w_r, lam, m_u, l_u = random_layer(gen, d, s, dv, dtype)
    kl = et.kep_svgp_kl(lam, m_u, l_u)
    want = effattn.kep_svgp_kl(lam.numpy(), m_u.numpy(), l_u.numpy())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(kl.item() - want) <= tol * abs(want)
    # Heads stacked in a leading dimension: the KL sums over them.
    kl2 = et.kep_svgp_kl(torch.stack([lam, lam]), torch.stack([m_u, m_u]),
                         torch.stack([l_u, l_u]))
    assert abs(kl2.item() - 2 * want) <= tol * abs(want)
    e = torch.randn(n, s, generator=gen, dtype=dtype)
    r = torch.randn(m, s, generator=gen, dtype=dtype)
    for reduction in ("mean", "sum"):
        j2 = et.kep_svgp_ksvd_loss(e, r, lam, w_e, w_r, reduction)
        want = effattn.kep_svgp_ksvd_loss(e.numpy(), r.numpy(), lam.numpy(), w_e.numpy(),
                                          w_r.numpy(), reduction)
        assert abs(j2.item() - want) <= tol * abs(want)


def test_torch_layer_gradients_are_finite_differences():
    """The reference is what training differentiates: its autograd gradient is checked against
    finite differences (torch.autograd.gradcheck, float64)."""
    gen = torch.Generator().manual_seed(6)
    T, d, s = 12, 8, 3
    q = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    params = [p.requires_grad_() for p in random_layer(gen, d, s, s, torch.float64)]

    def f(q, k, w_e, w_r, lam, m_u, l_u):
        mean, var, e, r = et.kep_svgp_layer(q, k, w_e, w_r, lam, m_u, l_u.tril())
        return (mean, var, et.kep_svgp_kl(lam, m_u, l_u.tril() + 0.0),
                et.kep_svgp_ksvd_loss(e, r, lam, w_e, w_r, "mean"))

    assert torch.autograd.gradcheck(f, (q, k, *params))


def test_bad_input_raises():
    q = np.zeros((4, 8))
    w = np.zeros((8, 2))
    lam = np.ones(2)
    m_u = np.zeros((2, 2))
    l_u = np.stack([np.eye(2)] * 2)
    with pytest.raises(ValueError, match="lambda"):
        effattn.kep_svgp_layer(q + 1, q + 1, w, w, -lam, m_u, l_u)
    with pytest.raises(ValueError, match="merge"):
        effattn.kep_svgp_layer(q, q, w, w, lam, m_u, l_u, merge="concat")
    with pytest.raises(ValueError, match="l_u"):
        effattn.kep_svgp_layer(q, q, w, w, lam, m_u, l_u[0])
    with pytest.raises(ValueError, match="n = m"):
        effattn.kep_svgp_layer(q, q[:3], w, w, lam, m_u, l_u)
    with pytest.raises(ValueError, match="merge"):
        et.kep_svgp_layer(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(8, 2),
                          torch.zeros(8, 2), torch.ones(2), torch.zeros(2, 2),
                          torch.stack([torch.eye(2)] * 2), merge="concat")
