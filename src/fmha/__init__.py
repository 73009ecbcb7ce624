"""fmha: fused multi-head attention kernels (Triton) with a kernel dispatcher.

    import fmha
    o = fmha.attention(q, k, v, causal=True)          # q, k, v: (B, H, S, D) tensors

CUDA tensors run compiled kernels; CPU tensors run the same kernels through Triton's
interpreter. Float8 q/k/v run the forward with descales (`fmha.quantize_fp8`, see fmha.fp8).
`fmha.explain(q, k, v, ...)` says which kernels a call would launch and why (with
`cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...`: an `attention_varlen`
call; `fmha.explain_kvcache(q, k_cache, v_cache, ...)` for `attention_with_kvcache`).
"""

from . import fp8
from .api import (
    attention,
    attention_varlen,
    explain,
    get_dispatcher,
    problem_of,
    set_dispatcher,
)
from .dispatch.configs import Algorithm, ConfigError, Family, KernelConfig, Pipeline, Signature
from .dispatch.dispatcher import Dispatcher, NoKernelError, Plan, SplitPolicy
from .dispatch.registry import Registry, default_registry
from .fp8 import dequantize_fp8, quantize_fp8
from .kvcache import attention_with_kvcache, explain_kvcache, merge_states
from .problem import DType, Feature, MaskAlign, Problem
from .validation import set_debug

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_varlen", "attention_with_kvcache", "merge_states", "explain", "explain_kvcache",
    "problem_of",
    "get_dispatcher", "set_dispatcher",
    "set_debug", "Algorithm", "ConfigError", "Family", "KernelConfig", "Pipeline", "Signature",
    "Dispatcher", "NoKernelError", "Plan", "SplitPolicy", "DType", "Feature", "MaskAlign", "Problem", "Registry",
    "default_registry", "__version__", "fp8", "quantize_fp8", "dequantize_fp8",
]


def __getattr__(name: str):
    # `fmha.distributed` (ring attention over torch.distributed) is imported on first use.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
