"""NumPy interface to `fmha.attention`, in the spirit of CK's Python runner.

    from fmha.numpy_api import attention
    r = attention(q, k, v, causal=True)     # q, k, v: numpy (B, H, S, D) arrays
    r.out, r.lse, r.time_ms, r.tflops, r.kernel

The arrays are copied to torch tensors on the chosen device (CUDA when available, else
the CPU, where the kernels run through Triton's interpreter), the call is timed, and the
results come back as numpy arrays. bfloat16 arrays are `ml_dtypes.bfloat16`; they travel
to torch by reinterpreting their bits (uint16 -> int16 -> bfloat16), never by rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from .api import attention as _attention
from .api import get_dispatcher, problem_of
from .bench.suite import time_ms
from .dispatch.configs import Family
from .problem import Problem

# numpy dtype -> torch dtype, for q, k and v.
NUMPY_DTYPES: dict[np.dtype, torch.dtype] = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
}


@dataclass
class NumpyResult:
    """What `attention` returns.

    out: the attention output in the inputs' layout and dtype, (B, Hq, Sq, Dv) for bhsd.
    lse: float32 (B, Hq, Sq), natural log.
    time_ms: median wall time of one call in milliseconds (CUDA events on the GPU,
        `time.perf_counter` on the CPU, where it measures the Triton interpreter).
    tflops: `problem.flops_fwd() / time`, in TFLOP/s.
    kernel: name of the forward kernel config the dispatcher chose.
    problem: the `Problem` the call was dispatched as.
    dropout_mask: the boolean keep mask (B, Hq, Sq, Sk) when `return_dropout_mask=True`.
    """

    out: np.ndarray
    lse: np.ndarray
    time_ms: float
    tflops: float
    kernel: str
    problem: Problem
    dropout_mask: np.ndarray | None = None


def to_torch(name: str, a: np.ndarray, device: str | torch.device,
             dtypes: dict[np.dtype, torch.dtype] | None = None) -> torch.Tensor:
    """Copy numpy array `a` to a torch tensor on `device`, keeping its dtype.

    `dtypes` restricts the accepted dtypes (TypeError naming `name` otherwise); None
    accepts anything torch.from_numpy accepts, plus ml_dtypes.bfloat16.
    """
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if dtypes is not None and a.dtype not in dtypes:
        accepted = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}.dtype={_dtype_name(a.dtype)} is not supported; accepted: {accepted}")
    a = np.ascontiguousarray(a)  # torch.from_numpy refuses negative strides
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        t = torch.from_numpy(a.view(np.uint16)).view(torch.int16).view(torch.bfloat16)
    else:
        try:
            t = torch.from_numpy(a)
        except TypeError as e:
            raise TypeError(f"{name}.dtype={_dtype_name(a.dtype)} cannot be converted to torch: "
                            f"{e}") from None
    return t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Copy tensor `t` to a numpy array of the same dtype (bf16 -> ml_dtypes.bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(ml_dtypes.bfloat16)
    return t.numpy()


def _dtype_name(d: np.dtype) -> str:
    return "bfloat16 (ml_dtypes)" if d == np.dtype(ml_dtypes.bfloat16) else str(d)


def default_device() -> str:
    """"cuda" when a CUDA GPU is visible, else "cpu" (the Triton interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, device: str | torch.device | None = None,
              warmup: int = 1, repeat: int = 3, **kwargs: Any) -> NumpyResult:
    """Run and time `fmha.attention` on numpy arrays.

    Args:
        q, k, v: float16, float32 or ml_dtypes.bfloat16 arrays, one dtype for all three;
            (B, H, S, D) for the default layout "bhsd", (B, S, H, D) with layout="bshd".
        device: "cuda", "cpu" or a torch.device; None picks CUDA when available.
        warmup: untimed calls before timing (the first one compiles the kernel on CUDA).
        repeat: timed calls; the median is reported.
        **kwargs: passed to `fmha.attention` (layout, causal, window, softcap, ...).
            numpy arrays among them (bias, alibi_slopes, sinks) are copied to the device
            with their dtype unchanged. `return_lse` is always on and may not be passed.

    Returns: a `NumpyResult` with the output of the last timed call.
    """
    if "return_lse" in kwargs:
        raise TypeError("return_lse is not accepted: numpy_api.attention always returns lse")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be an int >= 1")
    device = torch.device(default_device() if device is None else device)
    tq, tk, tv = (to_torch(name, a, device, NUMPY_DTYPES) for name, a in (("q", q), ("k", k), ("v", v)))
    call_kwargs = {key: to_torch(key, value, device) if isinstance(value, np.ndarray) else value
                   for key, value in kwargs.items()}
    want_mask = bool(call_kwargs.get("return_dropout_mask", False))
    problem_kwargs = {key: value for key, value in call_kwargs.items() if key != "return_dropout_mask"}
    problem = problem_of(tq, tk, tv, **problem_kwargs)
    plan = get_dispatcher().plan_forward(problem, return_dropout_mask=want_mask)

    results: list = []

    def call() -> None:
        results[:] = [_attention(tq, tk, tv, return_lse=True, **call_kwargs)]

    with torch.no_grad():
        elapsed = time_ms(call, device=device, warmup=warmup, repeat=repeat)
    out, lse, *rest = results[0]
    return NumpyResult(
        out=to_numpy(out), lse=to_numpy(lse), time_ms=elapsed,
        tflops=problem.flops_fwd() / (elapsed * 1e-3) / 1e12 if elapsed > 0 else float("inf"),
        kernel=plan.config(Family.FWD).name, problem=problem,
        dropout_mask=to_numpy(rest[0]) if want_mask else None,
    )


__all__ = ["NumpyResult", "attention", "to_torch", "to_numpy", "default_device", "NUMPY_DTYPES"]
