"""effattn.torch: effattn's attention methods as differentiable PyTorch operations.

``attention(q, k, v, method="exact", causal=False, **options)`` computes scaled dot-product
attention of (B, H, L, d) query and (B, G, S, d) key / value tensors (G divides H: grouped-query
attention) with one of effattn's C++ kernels, and ``Attention`` is the same as a
``torch.nn.Module``. Gradients flow through ``torch.autograd.Function``s whose forward and
backward are effattn's own C++ passes (``MultiHead<F>::compute`` and ``::backward``); nothing of
a method is re-implemented in torch.

Methods with a backward: ``exact`` (policies ``tiled`` and ``naive``), ``conv_basis`` (causal;
the basis starts chosen by the forward are held fixed, as in its paper's gradient), ``eva`` and
``performer`` (their random draws are made once, in the forward, and the backward uses the same
ones). The other methods run forward only; asking one of them for a gradient raises
``ValueError`` naming it.

Copies: float32 / float64 CPU tensors that are contiguous per (b, h) -- the usual (B, H, L, d)
layout -- or transposed views of contiguous (B, L, H, d) tensors (``x.transpose(1, 2)``) are read
in place; the output and the gradients are new tensors that own effattn's buffers (no copy on the
way back). Other layouts, and grouped-query inputs of the methods other than non-causal exact
attention, are converted once per call. The forward keeps its inputs (by reference, as torch
does) and its per-head results (exact: the row log-sum-exps) until the backward.

Example::

    import torch, effattn.torch as et
    q = torch.randn(2, 8, 512, 64, requires_grad=True)
    k = torch.randn(2, 2, 512, 64, requires_grad=True)   # 2 key / value heads: GQA
    v = torch.randn(2, 2, 512, 64, requires_grad=True)
    out = et.attention(q, k, v, causal=True)               # (2, 8, 512, 64)
    out.square().sum().backward()                          # q.grad, k.grad, v.grad
    eva = et.Attention("eva", causal=True, window=64, chunk_size=64)
    y = eva(q, k, v)
"""

from typing import Any, Dict, Tuple

import torch

from . import _effattn

__all__ = [
    "attention",
    "Attention",
    "methods_with_backward",
    "kep_svgp_layer",
    "kep_svgp_kl",
    "kep_svgp_ksvd_loss",
]

#: Methods whose gradient effattn computes (the others raise ValueError when asked for one).
methods_with_backward: Tuple[str, ...] = ("exact", "conv_basis", "eva", "performer")

_FN = "effattn.torch.attention"
_HALF = {torch.bfloat16, torch.float16}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{_FN}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{_FN}: {name} must be a 4-D (B, H, L, d) tensor (k and v: (B, G, S, d)); "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{_FN}: {name} must be float32 or float64 (bfloat16 / float16: computed in "
                f"float32); got {t.dtype}"
            )
        if t.device.type != "cpu":
            raise ValueError(f"{_FN}: {name} must be on the CPU; got device {t.device}")
    wide = {t.dtype for t in (q, k, v)} - _HALF
    if len(wide) > 1:
        raise ValueError(
            f"{_FN}: q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )


def _array(t: torch.Tensor):
    # A NumPy view of the tensor's memory (no copy); effattn reads it in place when it can.
    return t.detach().numpy()


class _AttentionFunction(torch.autograd.Function):
    """effattn's sdpa forward, keeping its state, and that state's backward."""

    @staticmethod
    def forward(ctx, q, k, v, method: str, causal: bool, options: Dict[str, Any]):  # type: ignore[override]
        r = _effattn.sdpa(
            _array(q), _array(k), _array(v), is_causal=causal, method=method,
            keep_state=True, **options,
        )
        out = torch.from_numpy(r.output)
        ctx.state = r.state
        ctx.method = method
        # Saved so that torch detects an in-place change of an input or of the output before
        # the backward (the state reads the same memory).
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.saved_tensors  # raises if q, k, v or the output was modified in place
        state = ctx.state
        if state is None or not state.has_backward:
            raise ValueError(
                f"{_FN}: method '{ctx.method}' has no backward; gradients exist for "
                + ", ".join(f"'{m}'" for m in methods_with_backward)
                + " (or call it under torch.no_grad())"
            )
        dq, dk, dv = state.backward(_array(grad_out))
        need = ctx.needs_input_grad
        grads = tuple(
            torch.from_numpy(g) if need[i] else None for i, g in enumerate((dq, dk, dv))
        )
        return grads + (None, None, None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    method: str = "exact",
    causal: bool = False,
    **options: Any,
) -> torch.Tensor:
    """softmax(scale q k^T [+ causal mask]) v with effattn's ``method``, differentiable.

    q: (B, H, L, d); k: (B, G, S, d); v: (B, G, S, dv), with G dividing H (query head h reads
    key / value head h // (H // G)); float32 or float64 CPU tensors of one dtype (bfloat16 and
    float16 ones, e.g. under ``torch.autocast``, are converted to the float dtype of the others,
    float32 when all are half). Returns the
    (B, H, L, dv) output in q's dtype (float32 for half-precision inputs). ``causal`` is the bottom-right aligned mask (query i sees
    keys j <= i + S - L; torch's ``is_causal`` when L == S). ``options`` are the method's C++
    Options fields as keyword arguments (``effattn.sdpa``'s), e.g. ``window=64`` for ``eva``,
    ``features=128, seed=1`` for ``performer``, ``policy="naive"`` for ``exact``; unknown options
    and bad shapes raise ``ValueError``, a numerical failure ``FloatingPointError``.

    Gradients: for ``methods_with_backward``, with respect to every input that requires grad
    (torch.autograd; not twice differentiable). Under ``torch.no_grad()``, or when no input
    requires grad, only the forward runs and nothing is kept.
    """
    _check(q, k, v)
    if {q.dtype, k.dtype, v.dtype} & _HALF:
        # Half-precision activations (torch.autocast, where some projections come out bf16 and
        # others float32): computed in the widest dtype given (float32 when all are half), one
        # conversion each way through autograd (gradients come back in the inputs' dtypes).
        wide = ({q.dtype, k.dtype, v.dtype} - _HALF or {torch.float32}).pop()
        q, k, v = (t if t.dtype == wide else t.to(wide) for t in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, method, causal, options)
    r = _effattn.sdpa(_array(q), _array(k), _array(v), is_causal=causal, method=method, **options)
    return torch.from_numpy(r.output)


class Attention(torch.nn.Module):
    """``attention(q, k, v, method, causal, **options)`` as a module (no parameters).

    ``Attention("eva", causal=True, window=64)(q, k, v)``. The method and options are checked on
    the first call (``ValueError`` for unknown ones).
    """

    def __init__(self, method: str = "exact", causal: bool = False, **options: Any) -> None:
        super().__init__()
        if method not in _effattn.methods:
            raise ValueError(
                f"effattn.torch.Attention: unknown method '{method}' (one of "
                + ", ".join(_effattn.methods) + ")"
            )
        self.method = method
        self.causal = bool(causal)
        self.options: Dict[str, Any] = dict(options)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, self.method, self.causal, **self.options)

    def extra_repr(self) -> str:
        opts = "".join(f", {key}={val!r}" for key, val in self.options.items())
        return f"method={self.method!r}, causal={self.causal}{opts}"

    @property
    def has_backward(self) -> bool:
        """Whether gradients flow through this method."""
        return self.method in methods_with_backward


# ----------------------------------------------------------------------------------------------
# KEP-SVGP's learned layer: torch references of effattn.kep_svgp_layer / kep_svgp_kl /
# kep_svgp_ksvd_loss, for training (effattn computes these forwards in C++ but has no backward
# for them; python/tests/test_kep_svgp_layer.py pins each reference to effattn's forward).
# ----------------------------------------------------------------------------------------------


def kep_svgp_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    w_e: torch.Tensor,
    w_r: torch.Tensor,
    lam: torch.Tensor,
    m_u: torch.Tensor,
    l_u: torch.Tensor,
    merge: str = "addition",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KEP-SVGP's learned attention layer (primal form, cosine kernel), differentiable.

    With phi(x) = x / max(||x||, 1e-12), E = phi(Q) W_e and R = phi(K) W_r (the primal
    projections), F = E + R (``merge="addition"``, needs n = m) or E (``"e_only"``) and
    G = F Lambda^-1: the posterior of value column c is mean G m_c and variance
    ||(G L_c)_i||^2 per token i (eq. 16-19 of the KEP-SVGP paper, covariance order of its App. B.2).

    Shapes (any leading batch dimensions ``...``): q (..., n, d), k (..., m, d), w_e and w_r
    (..., d, s), lam (..., s) > 0, m_u (..., s, dv), l_u (..., dv, s, s) lower triangular.
    Returns (mean (..., n, dv), variance (..., n, dv), E, R). The same function as
    ``effattn.kep_svgp_layer`` (C++), which inference uses.
    """
    if merge not in ("addition", "e_only"):
        raise ValueError(f"kep_svgp_layer: merge must be 'addition' or 'e_only', got {merge!r}")
    qh = torch.nn.functional.normalize(q, dim=-1, eps=1e-12)
    kh = torch.nn.functional.normalize(k, dim=-1, eps=1e-12)
    e = qh @ w_e
    r = kh @ w_r
    f = e + r if merge == "addition" else e
    g = f / lam.unsqueeze(-2)
    mean = g @ m_u
    var = torch.einsum("...ns,...cst->...nct", g, l_u).square().sum(-1)
    return mean, var, e, r


def kep_svgp_kl(lam: torch.Tensor, m_u: torch.Tensor, l_u: torch.Tensor) -> torch.Tensor:
    """KL(q(u) || p(u)) of KEP-SVGP (eq. 21), p(u_c) = N(0, Lambda^2), q(u_c) = N(m_c, L_c L_c^T),
    summed over the value columns and any leading dimensions: the torch reference of
    ``effattn.kep_svgp_kl``. lam (..., s), m_u (..., s, dv), l_u (..., dv, s, s)."""
    s = lam.shape[-1]
    il = 1.0 / lam
    tr = (il[..., None, :, None] * l_u).square().sum((-1, -2))  # (..., dv)
    quad = (il[..., :, None] * m_u).square().sum(-2)  # (..., dv)
    logdet_p = 2.0 * lam.log().sum(-1, keepdim=True)  # (..., 1)
    logdet_s = 2.0 * torch.diagonal(l_u, dim1=-2, dim2=-1).log().sum(-1)  # (..., dv)
    return 0.5 * (tr + quad + logdet_p - logdet_s - s).sum()


def kep_svgp_ksvd_loss(
    e: torch.Tensor,
    r: torch.Tensor,
    lam: torch.Tensor,
    w_e: torch.Tensor,
    w_r: torch.Tensor,
    reduction: str = "sum",
) -> torch.Tensor:
    """KEP-SVGP's KSVD regulariser (eq. 11), J^2 with J = -1/2 sum_i e_i^T Lambda^-1 e_i
    - 1/2 sum_j r_j^T Lambda^-1 r_j + Tr(W_e^T W_r), the sums divided by the token counts for
    ``reduction="mean"``; one value per leading index (..., ): the torch reference of
    ``effattn.kep_svgp_ksvd_loss``. e (..., n, s), r (..., m, s), lam (..., s), w_e, w_r
    (..., p, s)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"kep_svgp_ksvd_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    il = (1.0 / lam).unsqueeze(-2)
    se = (e.square() * il).sum((-1, -2))
    sr = (r.square() * il).sum((-1, -2))
    if reduction == "mean":
        se = se / e.shape[-2]
        sr = sr / r.shape[-2]
    j = -0.5 * se - 0.5 * sr + (w_e * w_r).sum((-1, -2))
    return j.square()
