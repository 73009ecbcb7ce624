"""Argument preparation shared by every call path: validation and the `Problem` of a call
(cached by tensor metadata for dense calls), the kernels' views and outputs, and the
launches of the forward and dK/dV kernels of a config. It runs inside the custom ops, so
torch.compile sees one opaque op per call and no host logic."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import fp8 as F8
from .. import validation as V
from ..dispatch.configs import KernelConfig, Pipeline
from ..kernels.launch.loader import family_module
from ..problem import MaskAlign, Problem

Tensor = torch.Tensor



@functools.lru_cache(maxsize=64)
def arch_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"tensors on {device} are not supported; accepted: cuda or cpu")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def tma_aligned(*tensors: Tensor) -> bool:
    """What TMA descriptors can address (kernels/gluon_common). Imported on first use:
    `import fmha` does not import Triton."""
    return gluon_common_module().tma_aligned(*tensors)


@functools.cache
def gluon_common_module():
    # (an import statement costs ~1 us a call; the Gluon backward checks dO on every call)
    from ..kernels.gluon import common as gluon_common

    return gluon_common


def algorithm_args(config: KernelConfig) -> dict:
    a = config.algorithm
    return dict(block_m=a.block_m, block_n=a.block_n, num_warps=a.num_warps, num_stages=a.num_stages)


# ----------------------------------------------------------------------------------------
# Argument preparation: validation + Problem, shared by every call path. It runs inside
# the custom ops, so torch.compile sees one opaque op per call and no host logic.


@dataclass
class Prepared:
    problem: Problem
    q: Tensor  # kernel views: bhsd (dense) or packed (total, H, D) (varlen)
    k: Tensor
    v: Tensor
    scale: float


# The arguments every op takes after its tensors, in order (the user's call, flattened).
OP_ARGS = ("bias", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
            "max_seqlen_q", "max_seqlen_k", "layout", "scale", "causal", "window_left",
            "window_right", "mask_align", "sink_size", "softcap", "dropout_p", "seed", "offset",
            "deterministic")


def tensor_meta(t: Tensor | None):
    """What validation and the Problem read of a tensor: its metadata (and TMA alignment)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.device.type == "meta" or t.data_ptr() % 16 == 0)


# Dense calls repeat a few shapes: their validation + Problem (metadata only: dense checks
# read no values) is cached by the tensors' metadata and the scalars. Varlen calls check
# cu_seqlens values on the CPU and are never cached.
PREPARED: dict = {}
PREPARED_MAX = 4096


def prepare_call(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
             max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
             mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic) -> Prepared:
    key = None
    if cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None:
        key = (tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(bias), tensor_meta(alibi_slopes),
               tensor_meta(sinks), max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
               mask_align, sink_size, softcap, dropout_p, deterministic)
        hit = PREPARED.get(key)
        if hit is not None:
            return prepared_views(hit[0], q, k, v, hit[1])
    prep = validate_and_describe(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                  max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
                                  mask_align, sink_size, softcap, dropout_p, deterministic)
    if key is not None:
        if len(PREPARED) >= PREPARED_MAX:
            PREPARED.clear()
        PREPARED[key] = (prep.problem, prep.scale)
    return prep


def prepared_views(problem: Problem, q, k, v, scale: float) -> Prepared:
    """The Prepared of a validated problem: q, k, v as kernel views (bshd read transposed)."""
    if problem.layout == "bshd" and not problem.varlen:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return Prepared(problem, q, k, v, scale)


def validate_and_describe(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                           max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
                           mask_align, sink_size, softcap, dropout_p, deterministic) -> Prepared:
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(name, t, ndim)
    dtype = V.check_dtype("q", q, allow_fp8=True)
    V.check_same(("q", "k", "v"), (q, k, v))
    layout = V.check_layout(layout)
    align = V.check_mask_align(mask_align)
    if varlen:
        qv, kv, vv = q, k, v
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, Tensor):
                raise TypeError(f"{name} must be an int32 tensor, got {type(cu).__name__}")
        batch = cu_seqlens_q.numel() - 1
        V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        if cu_seqlens_k.numel() != cu_seqlens_q.numel():
            raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries but cu_seqlens_q "
                             f"has {cu_seqlens_q.numel()}; both must be batch + 1")
        V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
        V.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
        V.check_seqused_k(seqused_k, batch, cu_seqlens_k, q.device)
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}; they must match")
    else:
        # Kernel views are bhsd; a bshd tensor is read through its transposed strides.
        qv, kv, vv = (t.transpose(1, 2) if layout == "bshd" else t for t in (q, k, v))
        batch, seqlen_q, seqlen_k = qv.shape[0], qv.shape[2], kv.shape[2]
        for name, t in (("k", kv), ("v", vv)):
            if t.shape[0] != batch:
                raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {batch}")
        if vv.shape[2] != seqlen_k:
            raise ValueError(f"v has seqlen {vv.shape[2]} but k has seqlen {seqlen_k}")
    nhead_q, nhead_k = qv.shape[1], kv.shape[1]
    V.check_heads(nhead_q, nhead_k, vv.shape[1])
    if kv.shape[-1] != qv.shape[-1]:
        raise ValueError(f"k has head dim {kv.shape[-1]} but q has {qv.shape[-1]}; they must match")
    V.check_last_dim_contiguous("q", q)
    V.check_last_dim_contiguous("k", k)
    v_column_major = V.check_last_dim_contiguous("v", vv, allow_column_major=True)
    V.check_bias(bias, (batch, nhead_q, seqlen_q, seqlen_k),
                 torch.float32 if F8.is_fp8(q) else q.dtype, q.device)
    V.check_alibi(alibi_slopes, batch, nhead_q, q.device)
    V.check_sinks(sinks, nhead_q, q.device, q.dtype)
    problem = Problem(
        batch=batch, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim_qk=qv.shape[-1], head_dim_v=vv.shape[-1], dtype=dtype, layout=layout,
        arch=arch_of(q.device), causal=causal, window=(window_left, window_right),
        mask_align=align, sink_size=sink_size, bias=bias is not None,
        alibi=alibi_slopes is not None, softcap=float(softcap), sinks=sinks is not None,
        dropout_p=float(dropout_p), varlen=varlen, seqused_k=seqused_k is not None,
        v_column_major=v_column_major, deterministic=deterministic,
        tma_aligned=tma_aligned(qv, kv, vv),
    )
    scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)
    return Prepared(problem, qv, kv, vv, scale)


def expand_bias(bias: Tensor | None, shape) -> Tensor | None:
    """The user's bias as a 4-d zero-stride view (validated earlier)."""
    if bias is None:
        return None
    return bias[(None,) * (4 - bias.dim())].expand(shape)


def kernel_args(prep: Prepared, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 seed, offset) -> dict:
    """Keyword arguments shared by the forward and backward launchers."""
    p = prep.problem
    shape = (p.batch, p.nhead_q, p.seqlen_q, p.seqlen_k)
    return dict(
        batch=p.batch, max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        bias=expand_bias(bias, shape), alibi_slopes=V.alibi_rows(alibi_slopes),
        scale=prep.scale, softcap=p.softcap, window=p.window, sink_size=p.sink_size,
        align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT, dropout_p=p.dropout_p,
        seed=seed, offset=offset,
    )


def algo_kwargs(config: KernelConfig) -> dict:
    return dict(algorithm_args(config), dot_precision=config.algorithm.dot_precision)


def stats_dtype(q: Tensor) -> torch.dtype:
    """LSE, delta and dQ accumulators: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def alloc_like(q: Tensor, head_dim: int, varlen: bool, layout: str, dtype=None):
    """For q-shaped outputs: (tensor in the user's layout, its kernel view, lse-shaped stats).

    `q` is the user's tensor (bhsd or bshd, or packed (total, H, D) for varlen).
    """
    dtype = dtype or q.dtype
    stats = stats_dtype(q)
    if varlen:
        total, nhead = q.shape[0], q.shape[1]
        o = q.new_empty((total, nhead, head_dim), dtype=dtype)
        return o, o, torch.empty((nhead, total), dtype=stats, device=q.device)
    if layout == "bshd":
        batch, seqlen, nhead = q.shape[0], q.shape[1], q.shape[2]
        o = q.new_empty((batch, seqlen, nhead, head_dim), dtype=dtype)
        view = o.transpose(1, 2)
    else:
        batch, nhead, seqlen = q.shape[0], q.shape[1], q.shape[2]
        o = view = q.new_empty((batch, nhead, seqlen, head_dim), dtype=dtype)
    return o, view, torch.empty((batch, nhead, seqlen), dtype=stats, device=q.device)


def kernel_view(t: Tensor, prep: Prepared) -> Tensor:
    """A user-layout tensor shaped like o (or dO) as the kernels' bhsd view."""
    return t.transpose(1, 2) if (prep.problem.layout == "bshd" and not prep.problem.varlen) else t


VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def launch_forward(prep: Prepared, config: KernelConfig, o_view: Tensor, lse: Tensor,
                    sinks: Tensor | None, kernel_args: dict, fp8_descales: dict | None = None,
                    descale_block: int = 0):
    """Run the forward `config` (Triton, or Gluon on Hopper) into o_view / lse.
    fp8_descales: float8 inputs' q/k/v_descale kernel views (fmha.fp8.check_descales).
    Returns the Gluon launcher's plan (fwd_gluon.launch), else None."""
    p, a = prep.problem, config.algorithm
    with device_guard(prep.q):
        if a.pipeline.is_gluon:  # the configs refuse per-block descales
            return family_module("gluon.fwd", interpreted=False).launch(
                prep.q, prep.k, prep.v, o_view, lse, causal=p.window[1] == 0, window_left=p.window[0],
                align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT, scale=prep.scale,
                block_m=a.block_m, block_n=a.block_n, num_stages=a.num_stages,
                pingpong=a.pipeline == Pipeline.GLUON_WS_PINGPONG, persistent=a.persistent,
                descales=tuple(fp8_descales.values()) if fp8_descales else None, sinks=sinks,
                **({key: kernel_args[key] for key in VARLEN_ARGS} if p.varlen else {}))
        else:
            family_module("triton.fwd", interpreted=prep.q.device.type == "cpu").launch(
                prep.q, prep.k, prep.v, o_view, lse, sinks=sinks, **kernel_args, **algo_kwargs(config),
                **(fp8_descales or {}), **({"descale_block": descale_block} if fp8_descales else {}))
    return None


def launch_dkdv(prep: Prepared, config: KernelConfig, do_view: Tensor, lse: Tensor, delta: Tensor,
                 dk_view: Tensor, dv_view: Tensor, dq_acc_view: Tensor | None, dbias: Tensor | None,
                 kernel_args: dict) -> None:
    """Run the dK/dV `config` (Triton, or Gluon on Hopper, which adds dQ into dq_acc_view).
    Returns the Gluon launcher's plan (bwd_gluon.launch_dkdv), else None."""
    p, a = prep.problem, config.algorithm
    if a.pipeline.is_gluon:
        if not tma_aligned(do_view):  # dO from autograd may be any view (TMA loads it)
            do_view = do_view.contiguous()
        return family_module("gluon.bwd", interpreted=False).launch_dkdv(
            prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view, dq_acc_view,
            causal=p.window[1] == 0, align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT,
            scale=prep.scale, block_m=a.block_m, block_n=a.block_n, num_stages=a.num_stages,
            num_warps=a.num_warps, warp_specialized=a.pipeline == Pipeline.GLUON_WS,
            persistent=a.persistent, window_left=p.window[0],
            **({key: kernel_args[key] for key in VARLEN_ARGS} if p.varlen else {}))
    else:
        family_module("triton.bwd", interpreted=prep.q.device.type == "cpu").launch_dkdv(
            prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view, dq_acc=dq_acc_view, dbias=dbias,
            **kernel_args, **algo_kwargs(config))
    return None


class device_guard:
    def __init__(self, t: Tensor):
        self.ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def check_call_types(q, k, v, optional: dict, strings: dict, ints: dict) -> None:
    """Types and devices, before the op: torch's schema check would otherwise answer with a
    RuntimeError, and a meta tensor among real ones would route the call to the fake."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in optional.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    for name, t in [("k", k), ("v", v), *optional.items()]:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all tensors must be on one device")
    for name, value in strings.items():
        if not isinstance(value, str):
            raise TypeError(f"{name}={value!r} must be a str")
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be an int")


def op_scalars(max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size, softcap,
                dropout_p, seed, offset, deterministic) -> tuple:
    """The ops' scalar arguments (`OP_ARGS` after the tensors), checked and normalized: the
    window's right edge 0 when causal, floats as floats, a seed drawn when dropout needs one."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic={deterministic!r} must be a bool")
    window_left, window_right = V.check_scalars(scale=scale, softcap=softcap, window=window,
                                                sink_size=sink_size, dropout_p=dropout_p,
                                                causal=causal)
    V.check_seed(seed, offset)
    if seed is None:
        # Drawn on the host from torch's default CPU generator (no GPU synchronisation);
        # under torch.compile pass `seed` to keep dropout inside the graph.
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item()) if dropout_p > 0 else 0
    return (max_seqlen_q, max_seqlen_k, layout, None if scale is None else float(scale), causal,
            window_left, window_right, mask_align, sink_size, float(softcap), float(dropout_p), seed,
            offset, deterministic)
