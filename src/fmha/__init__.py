"""fmha: fused multi-head attention kernels (Triton) with a kernel dispatcher.

    import fmha
    o = fmha.attention(q, k, v, causal=True)          # q, k, v: (B, H, S, D) tensors

CUDA tensors run compiled kernels; CPU tensors run the same kernels through Triton's
interpreter. `fmha.explain(q, k, v, ...)` says which kernels a call would launch and why.
"""

from .api import (
    attention,
    attention_varlen,
    explain,
    get_dispatcher,
    problem_of,
    set_dispatcher,
)
from .configs import Algorithm, ConfigError, Family, KernelConfig, Pipeline, Signature
from .dispatcher import Dispatcher, NoKernelError, Plan
from .kvcache import attention_with_kvcache, merge_states
from .problem import DType, Feature, MaskAlign, Problem
from .registry import Registry, default_registry
from .validation import set_debug

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_varlen", "attention_with_kvcache", "merge_states", "explain", "problem_of",
    "get_dispatcher", "set_dispatcher",
    "set_debug", "Algorithm", "ConfigError", "Family", "KernelConfig", "Pipeline", "Signature",
    "Dispatcher", "NoKernelError", "Plan", "DType", "Feature", "MaskAlign", "Problem", "Registry",
    "default_registry", "__version__",
]


def __getattr__(name: str):
    # `fmha.distributed` (ring attention over torch.distributed) is imported on first use.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
