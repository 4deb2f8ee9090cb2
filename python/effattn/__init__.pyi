"""Type stubs of the effattn package: the extension module effattn._effattn (python/src/*.cpp),
whose names effattn re-exports. effattn.torch (python/effattn/torch.py) carries its own types.

Arrays are NumPy arrays or anything NumPy converts without a copy (CPU torch tensors that do not
require grad). See docs/python.md for layouts, copies and threads.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

ArrayLike = Union[npt.ArrayLike, Any]  # numpy arrays, CPU torch tensors, nested sequences
Offsets = Union[Sequence[int], npt.NDArray[np.integer], Any]

__version__: str
methods: Tuple[str, ...]  # ('exact', 'conv_basis', 'vcc', 'eva', 'performer', 'wildcat', 'kep_svgp', 'auto')

class Result:
    """The result of attention / sdpa / weighted_attention."""

    output: npt.NDArray[np.floating]
    """(n, dv) for attention; (B, H, L, dv) or (T, H, dv) for sdpa."""
    info: str
    """'Success', 'NumericalIssue', 'NoConvergence' or 'NotComputed'."""
    method: str
    diagnostics: Dict[str, float]
    """The method's scalar diagnostics (C++ Result::diagnostics()), e.g. rank, error_bound."""
    seconds: float
    """Wall time of the C++ computation (the GIL was released meanwhile)."""
    heads: List["Result"]
    """sdpa with a non-exact method: the per-(b, h) Results (output None), index b * H + h."""
    extras: Dict[str, Any]
    """Method arrays: lse, offsets, segments, vip, pivots, row_error_bound, variance,
    prior_variance, singular_values; and copies, data_ptrs, dtype."""
    # Every key of extras and diagnostics is also an attribute (result.lse, result.error_bound).
    def __getattr__(self, name: str) -> Any: ...

class CompressedKV:
    """A WildCat compressed KV cache of one head (compress_kv)."""

    size: int
    tokens: int
    tail_size: int
    dtype: str
    keys: npt.NDArray[np.floating]
    values: npt.NDArray[np.floating]
    weights: npt.NDArray[np.floating]
    log_scale: npt.NDArray[np.floating]
    pivots: npt.NDArray[np.int64]
    def append(self, k: ArrayLike, v: ArrayLike) -> None:
        """Appends newly decoded tokens (t, d), (t, dv) exactly (weight 1)."""

class GradState:
    """The forward state sdpa(..., keep_state=True) keeps for one backward (effattn.torch)."""

    method: str
    has_backward: bool
    def backward(
        self, grad_output: ArrayLike
    ) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """(dq, dk, dv) of the kept forward given dL/d output; ValueError without a backward."""

def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    method: str = "exact",
    causal: bool = False,
    check: bool = True,
    **options: Any,
) -> Result:
    """One head: softmax(scale q k^T [+ causal mask]) v, exact or approximated.

    q (n, d), k (m, d), v (m, dv). Options are the method's C++ Options fields (e.g. rank=64,
    seed=3, policy='naive'); unknown options raise ValueError. The old keyword of a renamed
    option (CHANGELOG.md) still works, with a DeprecationWarning. uint16 arrays are bf16 bits.
    """

def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    is_causal: bool = False,
    method: str = "exact",
    cu_seqlens_q: Optional[Offsets] = None,
    cu_seqlens_k: Optional[Offsets] = None,
    check: bool = True,
    keep_state: bool = False,
    **options: Any,
) -> Result:
    """Scaled dot-product attention on (B, H, L, d) arrays (k, v: (B, G, S, d), G | H: GQA),
    or packed (T, H, d) arrays with cu_seqlens_q / cu_seqlens_k (variable length).
    keep_state=True: result.state is a GradState for one backward."""

def attention_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    grad_output: ArrayLike,
    method: str = "exact",
    causal: bool = False,
    result: Optional[Result] = None,
    **options: Any,
) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    """(dq, dk, dv) of exact, conv_basis, eva or performer attention for one head, given
    grad_output (the others raise ValueError)."""

def sdpa_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    grad_output: ArrayLike,
    is_causal: bool = False,
    method: str = "exact",
    cu_seqlens_q: Optional[Offsets] = None,
    cu_seqlens_k: Optional[Offsets] = None,
    **options: Any,
) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    """(dq, dk, dv) of sdpa (exact, conv_basis, eva or performer) in q's, k's, v's shapes; GQA
    key / value gradients summed over each group's query heads. Runs the forward first."""

def compress_kv(k: ArrayLike, v: ArrayLike, q_radius: float = 0.0, **options: Any) -> CompressedKV:
    """WildCat CompressKV of one head (options as for method 'wildcat')."""

def kv_press(
    k: ArrayLike,
    v: ArrayLike,
    press: str,
    keep: float = 0.0,
    rows: int = 0,
    q: Optional[ArrayLike] = None,
    **options: Any,
) -> CompressedKV:
    """A KV-cache press of one head: 'drop', 'streaming', 'uniform', 'knorm', 'snapkv',
    'observed', 'wildcat' or 'vcc', to round(keep m) rows (or `rows`)."""

def weighted_attention(q: ArrayLike, cache: CompressedKV, check: bool = True, **options: Any) -> Result:
    """Attention of q over a CompressedKV (WildCat WtdAttn)."""

def kep_svgp_layer(
    q: ArrayLike,
    k: ArrayLike,
    w_e: ArrayLike,
    w_r: ArrayLike,
    lam: ArrayLike,
    m_u: ArrayLike,
    l_u: ArrayLike,
    merge: str = "addition",
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
def kep_svgp_kl(lam: ArrayLike, m_u: ArrayLike, l_u: ArrayLike) -> float: ...
def kep_svgp_ksvd_loss(
    e: ArrayLike, r: ArrayLike, lam: ArrayLike, w_e: ArrayLike, w_r: ArrayLike, reduction: str = "sum"
) -> float: ...
def workload(
    kind: str, n: int, d: int, seed: int = 42, dtype: str = "float32"
) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    """effattn's synthetic workloads: 'gaussian', 'sphere', 'clustered', 'positional', 'needles'."""

def active_isa() -> str:
    """'amx', 'avx512bf16' or 'generic': the bf16 kernel path of this machine."""
