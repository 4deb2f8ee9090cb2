"""effattn: fast exact and approximate softmax attention on the CPU (C++17 / Eigen).

The functions and classes below come from the compiled extension ``effattn._effattn``;
``help(effattn.sdpa)`` and friends show their documentation. ``effattn.torch`` (imported on
first use) makes the methods differentiable PyTorch operations.
"""

from . import _effattn
from ._effattn import (  # noqa: F401
    CompressedKV,
    GradState,
    Result,
    __version__,
    active_isa,
    attention,
    attention_backward,
    compress_kv,
    kep_svgp_kl,
    kep_svgp_ksvd_loss,
    kep_svgp_layer,
    kv_press,
    methods,
    sdpa,
    sdpa_backward,
    weighted_attention,
    workload,
)

__all__ = [
    "CompressedKV",
    "GradState",
    "Result",
    "active_isa",
    "attention",
    "attention_backward",
    "compress_kv",
    "kep_svgp_kl",
    "kep_svgp_ksvd_loss",
    "kep_svgp_layer",
    "kv_press",
    "methods",
    "sdpa",
    "sdpa_backward",
    "weighted_attention",
    "workload",
]

if _effattn.__doc__:
    __doc__ = _effattn.__doc__ + "\n\neffattn.torch: differentiable attention on torch tensors."


def __getattr__(name):
    # effattn.torch without an explicit import (it imports torch, which takes a second).
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'effattn' has no attribute '{name}'")
