"""Input checks for the public entry points (SPEC section 5).

Every check runs before any kernel and raises `ValueError` or `TypeError` naming the
argument, what was given and what is accepted. Checks of values inside index tensors
(cu_seqlens, seqused_k) read them on the host: always for CPU tensors, for CUDA tensors
only in debug mode (`FMHA_DEBUG=1` or `fmha.set_debug(True)`), since reading them
stalls the GPU and cannot happen during CUDA-graph capture.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from .problem import DType, MaskAlign

TORCH_DTYPES = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16, torch.float32: DType.FP32,
                torch.float64: DType.FP64}
FP8_DTYPES = {torch.float8_e4m3fn: DType.FP8_E4M3, torch.float8_e5m2: DType.FP8_E5M2}
LAYOUTS = ("bhsd", "bshd")

_debug = os.environ.get("FMHA_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug(enabled: bool) -> None:
    """Check index-tensor values of CUDA inputs too (slow: reads them on the host)."""
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    return _debug


def check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if ndim >= 3 and t.shape[-1] == 0:  # q, k, v: the last dimension is the head dim
        raise ValueError(f"{name} has head dim 0 (shape {tuple(t.shape)}); accepted: 1..256")
    if ndim <= 2 and not (t.is_floating_point() or t.is_complex()):
        check_unit_stride(name, t)  # index tensors: cu_seqlens, seqused_k, block_table, ...


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """Tensors the kernels index as `ptr + i` along their last dimension (index tensors,
    sinks) need stride 1 there; a strided view would be read wrongly (or out of bounds)."""
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension; got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}; pass {name}.contiguous()")


def check_dtype(name: str, t: torch.Tensor, *, allow_fp8: bool = False) -> DType:
    """The DType of t; float8 only where `allow_fp8` (the forward of attention/attention_varlen)."""
    if allow_fp8 and t.dtype in FP8_DTYPES:
        return FP8_DTYPES[t.dtype]
    if t.dtype not in TORCH_DTYPES:
        accepted = ", ".join(str(d) for d in (*TORCH_DTYPES, *(FP8_DTYPES if allow_fp8 else ())))
        raise TypeError(f"{name}.dtype={t.dtype} is not supported; accepted: {accepted}")
    return TORCH_DTYPES[t.dtype]


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    first, t0 = names[0], tensors[0]
    for name, t in zip(names[1:], tensors[1:], strict=True):
        if t.dtype != t0.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from {first}.dtype={t0.dtype}; "
                            f"q, k and v must share one dtype")
        if t.device != t0.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {t0.device}; "
                             f"all tensors must be on one device")


def check_last_dim_contiguous(name: str, t: torch.Tensor, *, allow_column_major: bool = False) -> bool:
    """True if `t` is column-major in its last two dims (allowed for v only)."""
    if t.shape[-1] == 1 or t.stride(-1) == 1:
        return False
    if allow_column_major and (t.stride(-2) == 1 or t.shape[-2] == 1):
        return True
    extra = " (or column-major: stride 1 along the sequence)" if allow_column_major else ""
    raise ValueError(f"{name} must have a contiguous last dimension{extra}; got strides "
                     f"{t.stride()} for shape {tuple(t.shape)}")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; accepted: {list(LAYOUTS)}")
    return layout


def check_mask_align(mask_align) -> MaskAlign:
    try:
        return MaskAlign(mask_align)
    except ValueError:
        raise ValueError(f"mask_align={mask_align!r} is not supported; accepted: "
                         f"{[m.value for m in MaskAlign]}") from None


def check_heads(nhead_q: int, nhead_k: int, nhead_v: int) -> None:
    if nhead_k != nhead_v:
        raise ValueError(f"k has {nhead_k} heads but v has {nhead_v}; they must match")
    if nhead_k == 0 or nhead_q % nhead_k != 0:
        raise ValueError(f"nhead_q={nhead_q} is not a multiple of nhead_k={nhead_k}")


def _is_real(x) -> bool:
    """A Python or numpy real number (not a bool, not a tensor)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_scalars(*, scale, softcap, window, sink_size, dropout_p, causal) -> tuple[int, int]:
    if scale is not None and (not _is_real(scale) or not math.isfinite(scale)):
        given = "" if _is_real(scale) else f" (got a {type(scale).__name__})"
        raise ValueError(f"scale={scale!r} must be a finite real number, or None for "
                         f"1/sqrt(head_dim){given}")
    if not _is_real(softcap) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap={softcap!r} must be a finite real number >= 0 (0 disables it)")
    if not _is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be a real number in [0, 1)")
    if not isinstance(sink_size, int) or isinstance(sink_size, bool) or sink_size < 0:
        raise ValueError(f"sink_size={sink_size!r} must be an int >= 0")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window={window!r} must be a pair (left, right) of ints >= -1") from None
    for side, value in (("left", left), ("right", right)):
        if not isinstance(value, int) or isinstance(value, bool) or value < -1:
            raise ValueError(f"window {side}={value!r} must be an int >= -1 (-1: unbounded)")
    if causal and right > 0:
        raise ValueError(f"causal=True fixes the window's right edge at 0 but window={tuple(window)!r} "
                         f"asks for {right}; pass window=({left}, 0), or causal=False with the window")
    return (left, 0) if causal else (left, right)


def check_bias(bias, shape: tuple[int, int, int, int], dtype: torch.dtype, device) -> torch.Tensor | None:
    """bias broadcastable to `shape` (B, Hq, Sq, Sk); returns a zero-stride 4-d view."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.dtype not in (torch.float32, dtype):
        raise TypeError(f"bias.dtype={bias.dtype} is not supported; accepted: torch.float32 "
                        f"or the inputs' dtype {dtype}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q is on {device}")
    if bias.dim() > 4:
        raise ValueError(f"bias must have at most 4 dimensions, got shape {tuple(bias.shape)}")
    try:
        return bias.expand(shape) if bias.dim() == 4 else bias[(None,) * (4 - bias.dim())].expand(shape)
    except RuntimeError:
        raise ValueError(f"bias of shape {tuple(bias.shape)} is not broadcastable to "
                         f"(batch, nhead_q, seqlen_q, seqlen_k)={shape}") from None


def check_alibi(alibi_slopes, batch: int, nhead_q: int, device) -> torch.Tensor | None:
    """ALiBi slopes (Hq,) or (B, Hq), fp32; returns a 2-d (1 or B, Hq) view."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes.dtype={alibi_slopes.dtype} must be torch.float32")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if tuple(alibi_slopes.shape) not in ((nhead_q,), (batch, nhead_q)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; accepted: "
                         f"({nhead_q},) or ({batch}, {nhead_q})")
    return alibi_rows(alibi_slopes)


def alibi_rows(alibi_slopes: torch.Tensor | None) -> torch.Tensor | None:
    """Checked ALiBi slopes as the kernels take them: a 2-d (1 or B, Hq) view of (Hq,) or (B, Hq)."""
    if alibi_slopes is None:
        return None
    return alibi_slopes[None] if alibi_slopes.dim() == 1 else alibi_slopes


def check_sinks(sinks, nhead_q: int, device, dtype: torch.dtype) -> torch.Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype != torch.float32 and not (sinks.dtype == dtype == torch.float64):
        raise TypeError(f"sinks.dtype={sinks.dtype} must be torch.float32 (or float64 with "
                        f"float64 inputs)")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")
    if tuple(sinks.shape) != (nhead_q,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; accepted: ({nhead_q},)")
    check_unit_stride("sinks", sinks)
    return sinks


def check_seed(seed, offset) -> None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**63) or None")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 2**32:
        raise ValueError(f"offset={offset!r} must be an int in [0, 2**32)")


def check_offsets(name: str, values: list[int]) -> None:
    """A prefix-sum table read on the host (cu_seqlens, kv_indptr): starts at 0, never decreases."""
    if values[0] != 0:
        raise ValueError(f"{name}[0]={values[0]} must be 0")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(f"{name} must be non-decreasing; {name}[{i + 1}]={values[i + 1]} "
                             f"< {name}[{i}]={values[i]}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device) -> None:
    check_tensor(name, cu, 1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={cu.dtype} must be torch.int32")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if cu.numel() < 1:
        raise ValueError(f"{name} must have batch + 1 >= 1 entries, got {cu.numel()}")
    if cu.device.type == "cpu" or _debug:
        values = cu.tolist()
        check_offsets(name, values)
        if values[-1] != total:
            raise ValueError(f"{name}[-1]={values[-1]} must equal the packed length {total}")


def check_max_seqlen(name: str, value, cu: torch.Tensor) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    if cu.device.type == "cpu" or _debug:
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if longest > value:
            raise ValueError(f"{name}={value} is smaller than the longest sequence ({longest})")


def check_seqused_k(seqused_k, batch: int, cu_seqlens_k: torch.Tensor, device) -> None:
    if seqused_k is None:
        return
    check_tensor("seqused_k", seqused_k, 1)
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"seqused_k.dtype={seqused_k.dtype} must be torch.int32")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k is on {seqused_k.device} but q is on {device}")
    if seqused_k.numel() != batch:
        raise ValueError(f"seqused_k has {seqused_k.numel()} entries; accepted: batch={batch}")
    if device.type == "cpu" or _debug:
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        for b, (used, length) in enumerate(zip(seqused_k.tolist(), lengths, strict=True)):
            if not 0 <= used <= length:
                raise ValueError(f"seqused_k[{b}]={used} must be in [0, {length}] "
                                 f"(the length of sequence {b} in cu_seqlens_k)")
