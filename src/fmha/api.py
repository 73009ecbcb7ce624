"""Public torch entry points: `attention`, `attention_varlen`, `explain`.

Each call validates its arguments (fmha.validation), describes itself as a `Problem`,
asks the dispatcher for a plan (cached per problem), and runs the plan's launches.
CUDA tensors run compiled kernels; CPU tensors run the same kernels through Triton's
interpreter. The kernel work is a `torch.library` custom op (`fmha::fwd`) with a fake
implementation, so `torch.compile` traces it without graph breaks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.utils import _python_dispatch

from . import fp8 as F8
from . import validation as V
from .configs import Family, KernelConfig, Pipeline
from .dispatcher import Dispatcher, Plan, default_dispatcher
from .kernels.loader import family_module
from .kernels.plan_tables import clear_plans, keep_plan, plan_table
from .problem import DType, MaskAlign, Problem

Tensor = torch.Tensor

_dispatcher: Dispatcher | None = None


def set_dispatcher(dispatcher: Dispatcher | None) -> None:
    """Route every call through `dispatcher` (None: back to the default registry)."""
    global _dispatcher
    _dispatcher = dispatcher
    _plan_forward.cache_clear()
    _plan_backward.cache_clear()
    _backward_launches.cache_clear()
    clear_plans()  # (the forward's call plans hold configs of the dispatcher's)
    from .kvcache import clear_plans as clear_decode_plans  # imported here: fmha.kvcache imports this module

    clear_decode_plans()


def get_dispatcher() -> Dispatcher:
    return _dispatcher if _dispatcher is not None else default_dispatcher()


@contextlib.contextmanager
def use_dispatcher(dispatcher: Dispatcher | None) -> Iterator[Dispatcher]:
    """`set_dispatcher(dispatcher)` for a `with` block; the previous one is restored after."""
    previous = _dispatcher
    set_dispatcher(dispatcher)
    try:
        yield get_dispatcher()
    finally:
        set_dispatcher(previous)


@functools.lru_cache(maxsize=4096)
def _plan_forward(problem: Problem, return_dropout_mask: bool) -> Plan:
    return get_dispatcher().plan_forward(problem, return_dropout_mask=return_dropout_mask)


@functools.lru_cache(maxsize=64)
def _arch_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"tensors on {device} are not supported; accepted: cuda or cpu")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _tma_aligned(*tensors: Tensor) -> bool:
    """What TMA descriptors can address (kernels/gluon_common). Imported on first use:
    `import fmha` does not import Triton."""
    return _gluon_common().tma_aligned(*tensors)


@functools.cache
def _gluon_common():
    # (an import statement costs ~1 us a call; the Gluon backward checks dO on every call)
    from .kernels import gluon_common

    return gluon_common


def _algorithm_args(config: KernelConfig) -> dict:
    a = config.algorithm
    return dict(block_m=a.block_m, block_n=a.block_n, num_warps=a.num_warps, num_stages=a.num_stages)


# ----------------------------------------------------------------------------------------
# Argument preparation: validation + Problem, shared by every call path. It runs inside
# the custom ops, so torch.compile sees one opaque op per call and no host logic.


@dataclass
class _Prepared:
    problem: Problem
    q: Tensor  # kernel views: bhsd (dense) or packed (total, H, D) (varlen)
    k: Tensor
    v: Tensor
    scale: float


# The arguments every op takes after its tensors, in order (the user's call, flattened).
_OP_ARGS = ("bias", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
            "max_seqlen_q", "max_seqlen_k", "layout", "scale", "causal", "window_left",
            "window_right", "mask_align", "sink_size", "softcap", "dropout_p", "seed", "offset",
            "deterministic")


def _meta(t: Tensor | None):
    """What validation and the Problem read of a tensor: its metadata (and TMA alignment)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.device.type == "meta" or t.data_ptr() % 16 == 0)


# Dense calls repeat a few shapes: their validation + Problem (metadata only: dense checks
# read no values) is cached by the tensors' metadata and the scalars. Varlen calls check
# cu_seqlens values on the CPU and are never cached.
_PREPARED: dict = {}
_PREPARED_MAX = 4096


def _prepare(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
             max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
             mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic) -> _Prepared:
    key = None
    if cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None:
        key = (_meta(q), _meta(k), _meta(v), _meta(bias), _meta(alibi_slopes), _meta(sinks), max_seqlen_q,
               max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size, softcap,
               dropout_p, deterministic)
        hit = _PREPARED.get(key)
        if hit is not None:
            return _prepared_views(hit[0], q, k, v, hit[1])
    prep = _validate_and_describe(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                  max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
                                  mask_align, sink_size, softcap, dropout_p, deterministic)
    if key is not None:
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        _PREPARED[key] = (prep.problem, prep.scale)
    return prep


def _prepared_views(problem: Problem, q, k, v, scale: float) -> _Prepared:
    """The _Prepared of a validated problem: q, k, v as kernel views (bshd read transposed)."""
    if problem.layout == "bshd" and not problem.varlen:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return _Prepared(problem, q, k, v, scale)


def _validate_and_describe(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                           max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right,
                           mask_align, sink_size, softcap, dropout_p, deterministic) -> _Prepared:
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
        arch=_arch_of(q.device), causal=causal, window=(window_left, window_right),
        mask_align=align, sink_size=sink_size, bias=bias is not None,
        alibi=alibi_slopes is not None, softcap=float(softcap), sinks=sinks is not None,
        dropout_p=float(dropout_p), varlen=varlen, seqused_k=seqused_k is not None,
        v_column_major=v_column_major, deterministic=deterministic,
        tma_aligned=_tma_aligned(qv, kv, vv),
    )
    scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)
    return _Prepared(problem, qv, kv, vv, scale)


def _expand_bias(bias: Tensor | None, shape) -> Tensor | None:
    """The user's bias as a 4-d zero-stride view (validated earlier)."""
    if bias is None:
        return None
    return bias[(None,) * (4 - bias.dim())].expand(shape)


def _kernel_args(prep: _Prepared, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 seed, offset) -> dict:
    """Keyword arguments shared by the forward and backward launchers."""
    p = prep.problem
    shape = (p.batch, p.nhead_q, p.seqlen_q, p.seqlen_k)
    return dict(
        batch=p.batch, max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        bias=_expand_bias(bias, shape), alibi_slopes=V.alibi_rows(alibi_slopes),
        scale=prep.scale, softcap=p.softcap, window=p.window, sink_size=p.sink_size,
        align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT, dropout_p=p.dropout_p,
        seed=seed, offset=offset,
    )


def _algo(config: KernelConfig) -> dict:
    return dict(_algorithm_args(config), dot_precision=config.algorithm.dot_precision)


def _stats_dtype(q: Tensor) -> torch.dtype:
    """LSE, delta and dQ accumulators: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _alloc_like(q: Tensor, head_dim: int, varlen: bool, layout: str, dtype=None):
    """For q-shaped outputs: (tensor in the user's layout, its kernel view, lse-shaped stats).

    `q` is the user's tensor (bhsd or bshd, or packed (total, H, D) for varlen).
    """
    dtype = dtype or q.dtype
    stats = _stats_dtype(q)
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


def _kernel_view(t: Tensor, prep: _Prepared) -> Tensor:
    """A user-layout tensor shaped like o (or dO) as the kernels' bhsd view."""
    return t.transpose(1, 2) if (prep.problem.layout == "bshd" and not prep.problem.varlen) else t


_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _launch_forward(prep: _Prepared, config: KernelConfig, o_view: Tensor, lse: Tensor,
                    sinks: Tensor | None, kernel_args: dict, fp8_descales: dict | None = None,
                    descale_block: int = 0):
    """Run the forward `config` (Triton, or Gluon on Hopper) into o_view / lse.
    fp8_descales: float8 inputs' q/k/v_descale kernel views (fmha.fp8.check_descales).
    Returns the Gluon launcher's plan (fwd_gluon.launch), else None."""
    p, a = prep.problem, config.algorithm
    with _device_guard(prep.q):
        if a.pipeline.is_gluon:  # the configs refuse per-block descales
            return family_module("fwd_gluon", interpreted=False).launch(
                prep.q, prep.k, prep.v, o_view, lse, causal=p.window[1] == 0, window_left=p.window[0],
                align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT, scale=prep.scale,
                block_m=a.block_m, block_n=a.block_n, num_stages=a.num_stages,
                pingpong=a.pipeline == Pipeline.GLUON_WS_PINGPONG, persistent=a.persistent,
                descales=tuple(fp8_descales.values()) if fp8_descales else None,
                **({key: kernel_args[key] for key in _VARLEN_ARGS} if p.varlen else {}))
        else:
            family_module("fwd", interpreted=prep.q.device.type == "cpu").launch(
                prep.q, prep.k, prep.v, o_view, lse, sinks=sinks, **kernel_args, **_algo(config),
                **(fp8_descales or {}), **({"descale_block": descale_block} if fp8_descales else {}))
    return None


def _launch_dkdv(prep: _Prepared, config: KernelConfig, do_view: Tensor, lse: Tensor, delta: Tensor,
                 dk_view: Tensor, dv_view: Tensor, dq_acc_view: Tensor | None, dbias: Tensor | None,
                 kernel_args: dict) -> None:
    """Run the dK/dV `config` (Triton, or Gluon on Hopper, which adds dQ into dq_acc_view).
    Returns the Gluon launcher's plan (bwd_gluon.launch_dkdv), else None."""
    p, a = prep.problem, config.algorithm
    if a.pipeline.is_gluon:
        if not _tma_aligned(do_view):  # dO from autograd may be any view (TMA loads it)
            do_view = do_view.contiguous()
        return family_module("bwd_gluon", interpreted=False).launch_dkdv(
            prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view, dq_acc_view,
            causal=p.window[1] == 0, align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT,
            scale=prep.scale, block_m=a.block_m, block_n=a.block_n, num_stages=a.num_stages,
            num_warps=a.num_warps, warp_specialized=a.pipeline == Pipeline.GLUON_WS,
            persistent=a.persistent, window_left=p.window[0],
            **({key: kernel_args[key] for key in _VARLEN_ARGS} if p.varlen else {}))
    else:
        family_module("bwd", interpreted=prep.q.device.type == "cpu").launch_dkdv(
            prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view, dq_acc=dq_acc_view, dbias=dbias,
            **kernel_args, **_algo(config))
    return None


# ----------------------------------------------------------------------------------------
# The kernel work as custom ops (opaque to torch.compile, with fake implementations).


def _prepare_op(q: Tensor, k: Tensor, v: Tensor, values: tuple) -> _Prepared:
    """`_prepare` for an op's flattened arguments, given in `_OP_ARGS` order (`_prepare`'s own
    order after q, k, v: passed positionally, a dict of keywords costs ~2 us a call)."""
    return _prepare(q, k, v, *values)


@torch.library.custom_op("fmha::fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Returns (o in q's layout and dtype, lse (B, Hq, Sq) or (Hq, total_q))."""
    return _fwd_body(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                     softcap, dropout_p, seed, offset, deterministic)[:2]


def _fwd_body(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
              max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
              softcap, dropout_p, seed, offset, deterministic) -> tuple[Tensor, Tensor, _Prepared]:
    """`_fwd_op`'s work: (o, lse, and the call's _Prepared, which the eager autograd path keeps
    for the backward)."""
    prep = _prepare(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                    max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                    softcap, dropout_p, seed, offset, deterministic)
    o, lse = _run_forward(prep, _plan_forward(prep.problem, False).config(Family.FWD), q, v.shape[-1], layout, sinks,
                          _kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset))
    return o, lse, prep


def _run_forward(prep: _Prepared, config: KernelConfig, q: Tensor, head_dim_v: int, layout: str,
                 sinks: Tensor | None, kernel_args: dict) -> tuple[Tensor, Tensor]:
    """The forward's outputs (o in q's layout, lse), allocated and computed by `config`."""
    o, o_view, lse = _alloc_like(q, head_dim_v, prep.problem.varlen, layout)
    if o.numel() or lse.numel():
        _launch_forward(prep, config, o_view, lse, sinks, kernel_args)
    return o, lse


@_fwd_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
      max_seqlen_k, layout, *scalars):
    o, _, lse = _alloc_like(q, v.shape[-1], cu_seqlens_q is not None, layout)
    return o, lse


@torch.library.custom_op("fmha::bwd", mutates_args=())
def _bwd_op(
    do: Tensor, dlse: Tensor | None, o: Tensor, lse: Tensor, want_dbias: bool, want_dsinks: bool,
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv in the inputs' layouts; dbias in bias' shape or empty; dsinks or empty).

    With dbias or dsinks wanted, stage 1 computes delta exactly (`launch_delta`, one more
    QK^T and dO V^T pass) instead of from the rounded O (`launch_dot_do_o`)."""
    dq, dk, dv, dbias, dsinks = _bwd_body(
        do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
        window_right, mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic)
    return (dq, dk, dv, q.new_empty(0) if dbias is None else dbias,
            q.new_empty(0) if dsinks is None else dsinks)


@dataclass(frozen=True)
class _BackwardLaunches:
    """The backward plan's configs as its launchers' arguments, built once per plan (the
    plan lookups and argument dicts cost ~8 us a call). The dicts are only ever unpacked."""
    stage1: dict  # launch_delta's (the BWD_DQ config) when exact_delta, else launch_dot_do_o's
    dkdv: KernelConfig
    dq: dict | None  # launch_dq's, deterministic only
    convert: dict | None  # launch_convert_dq's, otherwise


@functools.lru_cache(maxsize=4096)
def _backward_launches(problem: Problem, exact_delta: bool) -> _BackwardLaunches:
    plan = _plan_backward(problem, exact_delta)
    stage1 = plan.config(Family.BWD_DQ if exact_delta else Family.BWD_DOT_DO_O)
    dq = plan.config(Family.BWD_DQ) if problem.deterministic else None
    convert = None if problem.deterministic else plan.config(Family.BWD_CONVERT_DQ)
    return _BackwardLaunches(_algo(stage1), plan.config(Family.BWD_DQ_DK_DV),
                             None if dq is None else _algo(dq), None if convert is None else _algo(convert))


def _bwd_body(do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q,
              cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
              window_right, mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic,
              forward: tuple[Problem, float] | None = None, plans: dict | None = None):
    """`_bwd_op`'s work, with None for a dbias or dsinks not wanted (the op returns empty
    tensors for them; the eager backward, which calls this directly, allocates nothing).

    forward: the forward's (Problem, scale) for these very tensors (the eager autograd path
    keeps them: saved tensors cannot change without autograd refusing them), so they are not
    validated and described again. plans: where a forward call plan keeps this backward's plans
    (`_ForwardPlan.backward`), else `_BACKWARD_PLANS`."""
    if dlse is not None and (dlse.stride() != lse.stride() or dlse.dtype != lse.dtype):
        # The kernels read dlse with lse's strides; the gradient of e.g. lse.sum() is an
        # expanded (stride 0) view, which they would read past its one element.
        dlse = torch.empty_like(lse).copy_(dlse)
    if forward is not None:
        prep = _prepared_views(forward[0], q, k, v, forward[1])
    else:
        prep = _prepare(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                        softcap, dropout_p, seed, offset, deterministic)
    problem = prep.problem
    want_dsinks = want_dsinks and sinks is not None
    exact_delta = want_dbias or want_dsinks
    plan_key = planned = None
    if (forward is not None and problem.arch != "cpu" and dlse is None and not exact_delta and seqused_k is None
            and not problem.deterministic and bias is None and alibi_slopes is None
            and sinks is None):  # (the interpreter's kernels take no plans)
        if plans is not None:  # (a forward call plan's own table: its key fixes q, k, v and so o, lse)
            table, plan_key = plans, _meta(do)
        else:
            table, plan_key = _BACKWARD_PLANS, (forward, _meta(q), _meta(k), _meta(v), _meta(o), _meta(do), _meta(lse))
        planned = table.get(plan_key)
        if planned is not None and not planned.runnable(planned.dot, planned.dkdv, planned.convert):
            planned = None
    launches = None if planned is not None else _backward_launches(problem, exact_delta)
    kernels = family_module("bwd", interpreted=q.device.type == "cpu")
    varlen = problem.varlen
    # dq, dk, dv: their inputs' shapes and dtypes, contiguous in the user's layout; delta and
    # the dQ accumulator in the stats dtype (_stats_dtype), delta shaped like lse. The *_like
    # forms parse no shape or dtype arguments: ~2 us less a tensor than new_empty/zeros.
    contiguous, stats = torch.contiguous_format, _stats_dtype(q)
    dq, dk, dv = (torch.empty_like(t, memory_format=contiguous) for t in (q, k, v))
    dq_view, dk_view, dv_view = (_kernel_view(t, prep) for t in (dq, dk, dv))
    delta = torch.empty_like(lse, dtype=stats, memory_format=contiguous)
    if seqused_k is not None:  # keys past seqused_k belong to no program: their gradient is 0
        dk.zero_()
        dv.zero_()
    dsinks_rows = torch.empty_like(delta) if want_dsinks else None
    dbias_full = None
    if want_dbias:
        dbias_full = torch.zeros((problem.batch, problem.nhead_q, problem.seqlen_q, problem.seqlen_k),
                                 dtype=stats, device=q.device)
    o_view, do_view = _kernel_view(o, prep), _kernel_view(do, prep)
    if planned is not None:  # (a plain eager backward again: its three launches' plans)
        dq_acc, zeroed = _dq_accumulator(dq, stats, exact_delta, varlen)
        dq_acc_view = _kernel_view(dq_acc, prep)
        cu_q, cu_k = ((cu_seqlens_q,), (cu_seqlens_q, cu_seqlens_k)) if varlen else ((), ())  # (the kernels read them)
        planned.dot.launch(o_view, do_view, lse, delta, None if zeroed else dq_acc_view, *cu_q)
        planned.dkdv.launch(prep.q, prep.k, prep.v, do_view.contiguous() if planned.do_copied else do_view, lse,
                            delta, dk_view, dv_view, dq_acc_view, *cu_k)
        planned.convert.launch(dq_acc, dq)
    else:
        shared = _kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset)
        dot = dq_acc = dq_acc_view = None
        zeroed = True
        if not problem.deterministic:  # dQ by atomics into an fp32 accumulator
            dq_acc, zeroed = _dq_accumulator(dq, stats, exact_delta, varlen)
            dq_acc_view = _kernel_view(dq_acc, prep)
        with _device_guard(q):
            if exact_delta:
                kernels.launch_delta(prep.q, prep.k, prep.v, do_view, lse, delta, dlse=dlse,
                                     sinks=sinks if want_dsinks else None, dsinks_rows=dsinks_rows,
                                     **shared, **launches.stage1)
            else:
                dot = kernels.launch_dot_do_o(o_view, do_view, lse, delta, None if zeroed else dq_acc_view,
                                              dlse=dlse, **shared, **launches.stage1)
            if problem.deterministic:
                kernels.launch_dkdv(prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view,
                                    dbias=dbias_full, **shared, **_algo(launches.dkdv))
                kernels.launch_dq(prep.q, prep.k, prep.v, do_view, lse, delta, dq_view, **shared, **launches.dq)
            else:
                dkdv = _launch_dkdv(prep, launches.dkdv, do_view, lse, delta, dk_view, dv_view,
                                    dq_acc_view, dbias_full, shared)
                convert = kernels.launch_convert_dq(dq_acc, dq, scale=prep.scale, **launches.convert)
                if plan_key is not None and dot is not None and dkdv is not None and convert is not None:
                    keep_plan(table, plan_key, _BackwardPlan(dot, dkdv, convert, not _tma_aligned(do_view)))
    if problem.seqlen_k == 1 and sinks is None and dlse is None:
        # Softmax over a single key: dS = P (dP - delta) is exactly 0 (delta = P dP), so dq, dk
        # and dbias are 0. The kernels form dP and delta in two different summation orders
        # (and delta from the rounded O), which left noise where the answer is exactly 0
        # (fp32 2.4e-5 against a 2e-5 bound; fp16 with dropout 2.3e-3 against 2e-4).
        dq.zero_()
        dk.zero_()
        if dbias_full is not None:
            dbias_full.zero_()
    dbias = None
    if want_dbias:
        dbias = _reduce_to(dbias_full, bias).to(bias.dtype)
    dsinks = None
    if want_dsinks:  # per-row shares (B, Hq, Sq) or (Hq, total_q), summed per head
        head_axis = 0 if varlen else 1
        dsinks = dsinks_rows.sum(dim=tuple(i for i in range(dsinks_rows.dim()) if i != head_axis))
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dbias, dsinks


def _dq_accumulator(dq: Tensor, stats: torch.dtype, exact_delta: bool, varlen: bool) -> tuple[Tensor, bool]:
    """The fp32 dQ accumulator of the atomic backward, and whether it is zeroed already. The dense
    dot(dO, O) kernel zeroes it (one fill kernel less); the exact-delta pass does not, and a varlen
    batch's rows past cu_seqlens_q[-1] belong to no dot(dO, O) program (their dQ must read 0)."""
    if exact_delta or varlen:
        return torch.zeros_like(dq, dtype=stats, memory_format=torch.contiguous_format), True
    return torch.empty_like(dq, dtype=stats, memory_format=torch.contiguous_format), False


class _BackwardPlan:
    """A plain eager backward (no dlse, bias, ALiBi, sinks or seqused_k, not deterministic; the
    Gluon dK/dV; dense or varlen, whose launches take the call's cu_seqlens) repeated for inputs of
    the same metadata after the same forward problem: the launch plans of its three launches
    (dot(dO, O), dK/dV, the dQ convert; `launch_cache.Planned`) and whether dO is copied for TMA
    first."""

    __slots__ = ("dot", "dkdv", "convert", "do_copied", "runnable")

    def __init__(self, dot, dkdv, convert, do_copied: bool) -> None:
        from .kernels.launch_cache import runnable  # (Triton is loaded by now: it ran these)

        self.dot, self.dkdv, self.convert, self.do_copied, self.runnable = dot, dkdv, convert, do_copied, runnable


_BACKWARD_PLANS = plan_table()


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """Sum a (B, Hq, Sq, Sk) gradient over the dimensions `like` broadcasts."""
    lead = grad.dim() - like.dim()
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


@_bwd_op.register_fake
def _(do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, *rest):
    dbias = torch.empty_like(bias) if want_dbias else q.new_empty(0)
    dsinks = torch.empty_like(sinks) if want_dsinks and sinks is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dsinks


def _direct(op, tensors, *, grad_free: bool = True, autograd: type | None = None):
    """`op` itself when torch's dispatcher has something to do for this call, else its Python
    body: the custom-op dispatch costs about 70-90 us per call (tools/host_overhead.py),
    which is most of the host path of a small problem. The body is used only in plain eager
    mode: not while torch.compile traces, no dispatch mode (fake tensors, flop counters),
    torch-function mode or torch.func transform active, plain tensors on the CPU or a GPU.
    A call autograd has to record (grad_free, grad mode on, an input requiring grad) takes
    `autograd.apply` where given: a plain torch.autograd.Function around the same body and
    backward, without the custom op's autograd wrapper (whose argument handling alone cost
    ~200 us a call at 23 arguments, `torch._library.utils.fill_defaults`). Otherwise the
    registered op runs."""
    if not _plain_eager():
        return op
    grad = grad_free and torch.is_grad_enabled()
    recorded = False
    for t in tensors:
        if t is not None:
            if type(t) is not Tensor:
                return op
            recorded = recorded or (grad and t.requires_grad)
    if recorded:
        return op if autograd is None else autograd.apply
    return op._init_fn


def _plain_eager() -> bool:
    """Plain eager mode: not while torch.compile traces, no dispatch mode (fake tensors, flop
    counters), torch-function mode or torch.func transform active."""
    return not (torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused lse (or o) gives None, not a zeros tensor
    q, k, v, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k = inputs[:9]
    ctx.save_for_backward(q, k, v, *output, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k)
    ctx.scalars = inputs[9:]


def _backward(ctx, grad_o, grad_lse):
    """The backward of `_fwd_op` (registered) and of `_EagerAttention`."""
    q, k, v, o, lse, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k = ctx.saved_tensors
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    want_dsinks = sinks is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbias, dsinks = _run_backward(grad_o, grad_lse, o, lse, want_dbias, want_dsinks,
                                              (q, k, v, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k),
                                              ctx.scalars, getattr(ctx, "fmha_forward", None))
    return (dq, dk, dv, dbias if want_dbias else None, None,
            dsinks if want_dsinks else None) + (None,) * (len(ctx.scalars) + 3)


def _run_backward(grad_o, grad_lse, o, lse, want_dbias: bool, want_dsinks: bool, tensors: tuple, scalars: tuple,
                  forward: tuple[Problem, float] | None, plans: dict | None = None) -> tuple:
    """The backward of a forward on `tensors` (q, k, v and the 6 optional tensors, `_OP_ARGS`
    order) with op `scalars`: `_bwd_op`, or in plain eager mode its body itself, with what the
    eager forward kept (`forward`, `plans`: see `_bwd_body`) and without the op's empty
    placeholders for an unwanted dbias / dsinks (None there). No double backward."""
    if grad_o is None:  # only lse was used
        grad_o = torch.zeros_like(o)
    op = _direct(_bwd_op, (grad_o, grad_lse, o, lse, *tensors), grad_free=False)
    args = (grad_o.contiguous() if grad_o.stride(-1) != 1 else grad_o, grad_lse, o, lse, want_dbias,
            want_dsinks, *tensors, *scalars)
    if op is _bwd_op._init_fn:
        return _bwd_body(*args, forward=forward, plans=plans)
    return op(*args)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """`_fwd_op` with its registered backward for plain eager autograd calls (`_direct`): the
    same body, context and backward, recorded by autograd directly."""

    @classmethod
    def apply(cls, *args):
        """`Function.apply` less its binding of the arguments to forward's signature through
        `inspect` (~35 us a call, a third of the call): forward takes *args, so the binding
        changes nothing. Under torch.func transforms (which `_direct` already routes to the
        op) `Function.apply` itself runs."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)[:2]
        # Dead torch.func wrappers unwrapped, as Function.apply does (only tensors can be).
        args = tuple(_unwrap_if_dead(a) if type(a) is Tensor else a for a in args)
        return super(torch.autograd.Function, cls).apply(*args)[:2]  # (the C++ apply it ends in)

    @staticmethod
    def forward(*args):
        # A third, non-tensor output (dropped by `apply`) hands the validated Problem and
        # scale to setup_context, for the backward (`_bwd_body`'s `forward`).
        o, lse, prep = _fwd_body(*args)
        return o, lse, (prep.problem, prep.scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output[:2])
        ctx.fmha_forward = output[2]

    @staticmethod
    def backward(ctx, grad_o, grad_lse, _):
        return _backward(ctx, grad_o, grad_lse)


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead  # (what Function.apply unwraps with)


@torch.library.custom_op("fmha::fwd_fp8", mutates_args=())
def _fwd_fp8_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, q_descale: Tensor | None, k_descale: Tensor | None,
    v_descale: Tensor | None, descale_block_size: int | None, out_dtype: torch.dtype,
    max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Forward of float8 q/k/v with descales (fmha.fp8): (o in out_dtype, lse fp32). No autograd."""
    prep, views = _prepare_fp8(q, k, v, (bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                         max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
                                         window_right, mask_align, sink_size, softcap, dropout_p, seed,
                                         offset, deterministic),
                               (q_descale, k_descale, v_descale), descale_block_size)
    plan = _plan_forward(prep.problem, False)
    o, o_view, lse = _alloc_like(q, v.shape[-1], prep.problem.varlen, layout, dtype=out_dtype)
    if o.numel() or lse.numel():
        _launch_forward(prep, plan.config(Family.FWD), o_view, lse, sinks,
                        _kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset),
                        fp8_descales=views, descale_block=descale_block_size or 0)
    return o, lse


_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")  # (the order of the descales tuples below)


def _prepare_fp8(q: Tensor, k: Tensor, v: Tensor, values: tuple, descales: tuple,
                 descale_block_size: int | None) -> tuple[_Prepared, dict]:
    """`_prepare_op` of a float8 call, its descales checked (`fmha.fp8.check_descales`): the
    _Prepared, its Problem marked when a descale is per block, and the descales' kernel views."""
    prep = _prepare_op(q, k, v, values)
    p = prep.problem
    views = F8.check_descales(q, dict(zip(_DESCALE_NAMES, descales, strict=True)),
                              batch=p.batch, nhead_q=p.nhead_q, nhead_k=p.nhead_k, seqlen_q=p.seqlen_q,
                              seqlen_k=p.seqlen_k, block_size=descale_block_size, varlen=p.varlen)
    block_descale = any(d is not None and d.shape[2] > 1 for d in views.values())
    return replace(prep, problem=p.with_(fp8_block_descale=block_descale)), views


@_fwd_fp8_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, q_descale, k_descale,
      v_descale, descale_block_size, out_dtype, max_seqlen_q, max_seqlen_k, layout, *scalars):
    o, _, lse = _alloc_like(q, v.shape[-1], cu_seqlens_q is not None, layout, dtype=out_dtype)
    return o, lse


def _check_fp8_call(q, k, v, q_descale, k_descale, v_descale, descale_block_size, out_dtype, return_dropout_mask):
    """Checks of the fp8 arguments that need no shapes; returns the output dtype."""
    fp8 = F8.is_fp8(q)
    if not fp8:
        given = [n for n, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                                ("descale_block_size", descale_block_size)) if d is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given but q.dtype={q.dtype}; descales are for "
                             f"float8 inputs ({', '.join(map(str, F8.FP8_DTYPES))})")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype={out_dtype} differs from q.dtype={q.dtype}; a different output "
                             f"dtype is for float8 inputs only")
        return None
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in F8.OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype!r} is not supported for float8 inputs; accepted: "
                        f"{', '.join(map(str, F8.OUT_DTYPES))}")
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                       for t in (q, k, v, q_descale, k_descale, v_descale)):
        raise NotImplementedError("fmha has no backward for float8 inputs: q/k/v (or their descales) "
                                  "require grad; run the fp8 forward under torch.no_grad() or detach "
                                  "them, or use bf16/fp16 inputs for training")
    return out_dtype


@torch.library.custom_op("fmha::dropout_mask", mutates_args=())
def _dropout_mask_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, layout: str, dropout_p: float, seed: int, offset: int,
) -> Tensor:
    """The boolean keep mask (B, Hq, Sq, Sk) the forward draws (testing and inspection)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, nhead_q, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q, max_seqlen_k
    else:
        qv, kv = (t.transpose(1, 2) if layout == "bshd" else t for t in (q, k))
        batch, nhead_q, seqlen_q, seqlen_k = qv.shape[0], qv.shape[1], qv.shape[2], kv.shape[2]
    mask = torch.ones((batch, nhead_q, seqlen_q, seqlen_k), dtype=torch.uint8, device=q.device)
    if dropout_p > 0 and mask.numel():
        problem = Problem(batch=batch, nhead_q=nhead_q, nhead_k=nhead_q, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
                          dtype=V.check_dtype("q", q, allow_fp8=True), arch=_arch_of(q.device),
                          dropout_p=dropout_p)
        config = _plan_forward(problem, True).config(Family.DROPOUT_MASK)
        kernels = family_module("dropout", interpreted=q.device.type == "cpu")
        with _device_guard(q):
            kernels.launch(mask, dropout_p=dropout_p, seed=seed, offset=offset, **_algorithm_args(config))
    return mask.view(torch.bool)


@_dropout_mask_op.register_fake
def _(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, layout, dropout_p, seed, offset):
    if cu_seqlens_q is not None:
        shape = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k)
    elif layout == "bshd":
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    else:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return q.new_empty(shape, dtype=torch.bool)


@functools.lru_cache(maxsize=4096)
def _plan_backward(problem: Problem, exact_delta: bool = False) -> Plan:
    return get_dispatcher().plan_backward(problem, exact_delta=exact_delta)


# ----------------------------------------------------------------------------------------
# Building blocks for fmha.distributed (ring attention): the kernels on one block of keys,
# into caller-owned (fp32) buffers, no autograd. The caller maps global positions onto the
# block's top-left window (and ALiBi onto a bias); soft-cap and GQA as usual.


def _block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes) -> _Prepared:
    """The block's mask is `window` aligned top-left (row i sees i - left .. i + right)."""
    return _prepare(q, k, v, bias, alibi_slopes, None, None, None, None, 0, 0, layout, scale, False,
                    window[0], window[1], "top_left", 0, softcap, 0.0, 0, 0, False)


def _block_forward(q, k, v, o, lse, *, layout, scale, window, softcap, bias=None,
                   alibi_slopes=None) -> None:
    """o (q's layout, any float dtype) and lse (B, Hq, Sq) of q over this block of keys.

    Every tensor may be a strided view (a slice along the sequence); nothing is copied.
    bias (broadcastable to (B, Hq, Sq, Sk)) and alibi_slopes as in `attention`.
    """
    prep = _block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes)
    config = _plan_forward(prep.problem, False).config(Family.FWD)
    _launch_forward(prep, config, _kernel_view(o, prep), lse, None,
                    _kernel_args(prep, bias, alibi_slopes, None, None, None, 0, 0))


def _block_backward(q, k, v, do, lse, delta, dq_acc, dk, dv, *, layout, scale, window,
                    softcap, bias=None, alibi_slopes=None) -> None:
    """Gradients of one block of keys, given the rows' final (merged) lse and delta.

    lse, delta: (B, Hq, Sq) fp32, delta = rowsum(dO * O) (minus dlse). dk/dv (k's/v's
    layout, fp32 for accumulation) are overwritten; the unscaled dQ is added into the fp32
    dq_acc (q's layout) with atomics: the caller multiplies by the scale once at the end.
    """
    prep = _block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes)
    config = _plan_backward(prep.problem).config(Family.BWD_DQ_DK_DV)
    with _device_guard(q):
        _launch_dkdv(prep, config, _kernel_view(do, prep), lse, delta, _kernel_view(dk, prep),
                     _kernel_view(dv, prep), _kernel_view(dq_acc, prep), None,
                     _kernel_args(prep, bias, alibi_slopes, None, None, None, 0, 0))


class _device_guard:
    def __init__(self, t: Tensor):
        self.ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# ----------------------------------------------------------------------------------------
# Public functions: scalar checks (plain Python, traceable), then one op call.


def _check_call_types(q, k, v, optional: dict, strings: dict, ints: dict) -> None:
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


def _op_scalars(max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size, softcap,
                dropout_p, seed, offset, deterministic) -> tuple:
    """The ops' scalar arguments (`_OP_ARGS` after the tensors), checked and normalized: the
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


def _call(q, k, v, *, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
          max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size,
          softcap, dropout_p, seed, offset, deterministic, return_lse, return_dropout_mask,
          q_descale=None, k_descale=None, v_descale=None, descale_block_size=None, out_dtype=None):
    _check_call_types(q, k, v, dict(bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                                    cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, q_descale=q_descale,
                                    k_descale=k_descale, v_descale=v_descale),
                      dict(layout=layout, mask_align=mask_align),
                      dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    scalars = _op_scalars(max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size, softcap,
                          dropout_p, seed, offset, deterministic)
    seed = scalars[11]
    out_dtype = _check_fp8_call(q, k, v, q_descale, k_descale, v_descale, descale_block_size, out_dtype,
                                return_dropout_mask)
    tensors = (q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k)
    if out_dtype is not None:  # float8 inputs
        o, lse = _direct(_fwd_fp8_op, tensors + (q_descale, k_descale, v_descale))(
            *tensors, q_descale, k_descale, v_descale, descale_block_size, out_dtype, *scalars)
    else:
        o, lse = _direct(_fwd_op, tensors, autograd=_EagerAttention)(*tensors, *scalars)
    results = [o]
    if return_lse:
        results.append(lse)
    if return_dropout_mask:
        results.append(_dropout_mask_op(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, layout,
                                        float(dropout_p), seed, offset))
    return results[0] if len(results) == 1 else tuple(results)


def attention(
    q: Tensor, k: Tensor, v: Tensor, *,
    layout: str = "bhsd", scale: float | None = None, causal: bool = False,
    window: tuple[int, int] = (-1, -1), mask_align: str = "bottom_right", sink_size: int = 0,
    bias: Tensor | None = None, alibi_slopes: Tensor | None = None, softcap: float = 0.0,
    sinks: Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
    offset: int = 0, return_lse: bool = False, return_dropout_mask: bool = False,
    deterministic: bool = False, q_descale: Tensor | None = None, k_descale: Tensor | None = None,
    v_descale: Tensor | None = None, descale_block_size: int | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Fused multi-head attention (SPEC section 1), differentiable (except for float8 inputs).

    Args:
        q: (B, Hq, Sq, Dqk) for layout "bhsd", (B, Sq, Hq, Dqk) for "bshd"; fp16/bf16/fp32,
            or float8 (e4m3fn / e5m2, forward only: see the descales below and fmha.fp8).
        k: (B, Hk, Sk, Dqk) or (B, Sk, Hk, Dqk); Hq must be a multiple of Hk (GQA/MQA).
        v: (B, Hk, Sk, Dv) or (B, Sk, Hk, Dv); may be column-major (stride 1 along Sk).
        scale: logit scale, default 1/sqrt(Dqk).
        causal: window (-1, 0). window: (left, right) keys visible around the diagonal,
            -1 unbounded. mask_align: "bottom_right" (FlashAttention) or "top_left" (SDPA).
        sink_size: the first `sink_size` keys are always visible (StreamingLLM).
        bias: additive, broadcastable to (B, Hq, Sq, Sk), fp32 or the inputs' dtype.
        alibi_slopes: fp32 (Hq,) or (B, Hq); adds -slope * |i + Sk - Sq - j| (bottom-right).
        softcap: > 0 applies softcap * tanh(s / softcap) to the scaled logits.
        sinks: fp32 (Hq,) sink logits that join the softmax denominator only.
        dropout_p, seed, offset: dropout on the probabilities, Philox keyed by seed; the
            keep decisions are a pure function of (seed, offset, b, h, i, j).
        return_lse: also return lse (B, Hq, Sq), fp32, natural log (differentiable).
        return_dropout_mask: also return the boolean keep mask (B, Hq, Sq, Sk).
        deterministic: bitwise reproducible backward (no atomics; a little slower).
        q_descale, k_descale, v_descale: float8 inputs only, fp32: the real inputs are
            x_fp8 * descale. Per tensor (0-d or (1,)), per (batch, KV head) (B, Hk) (q also
            (B, Hq)), or per block of `descale_block_size` sequence positions
            (B, Hk, ceil(S / descale_block_size)) (q also (B, Hq, ...)). None means 1.
            `fmha.fp8.quantize_fp8` makes them. No gradient: inputs that require grad raise.
        descale_block_size: positions per block of the 3-d descales (required with them).
        out_dtype: float8 inputs only: torch.bfloat16 (default), float16 or float32.

    Returns: o in q's layout and dtype (out_dtype for float8) (with Dv), then lse and the
    mask if asked for.
    """
    key = None
    if (_plain_call(q, k, v, (bias, alibi_slopes, sinks, q_descale, k_descale, v_descale, descale_block_size,
                              out_dtype, seed), return_dropout_mask)
            and _plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                               deterministic) and _plain_eager()):
        key = (_meta(q), _meta(k), _meta(v), layout, scale, causal, window, mask_align, sink_size, softcap, offset,
               deterministic)
        plan = _FORWARD_PLANS.get(key)
        if plan is not None:
            o, lse = plan.run(q, k, v)
            return (o, lse) if return_lse else o
    elif (_plain_fp8_call(q, k, v, (bias, alibi_slopes, sinks, seed), (q_descale, k_descale, v_descale),
                          descale_block_size, out_dtype, return_dropout_mask)
          and _plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                             deterministic) and _plain_eager()):
        key = ("fp8", _meta(q), _meta(k), _meta(v), _meta(q_descale), _meta(k_descale), _meta(v_descale),
               descale_block_size, out_dtype, layout, scale, causal, window, mask_align, sink_size, softcap, offset,
               deterministic)
        plan = _FORWARD_PLANS.get(key)
        if plan is not None:
            o, lse = plan.run(q, k, v, (q_descale, k_descale, v_descale))
            return (o, lse) if return_lse else o
    result = _call(q, k, v, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=None,
                   cu_seqlens_k=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0, layout=layout,
                   scale=scale, causal=causal, window=window, mask_align=mask_align,
                   sink_size=sink_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                   offset=offset, deterministic=deterministic, return_lse=return_lse,
                   return_dropout_mask=return_dropout_mask, q_descale=q_descale, k_descale=k_descale,
                   v_descale=v_descale, descale_block_size=descale_block_size, out_dtype=out_dtype)
    op_scalar_args = (0, 0, layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, None, offset,
                      deterministic)
    if key is not None and key[0] == "fp8":
        keep_plan(_FORWARD_PLANS, key, _Fp8ForwardPlan(q, k, v, (q_descale, k_descale, v_descale), descale_block_size,
                                                       out_dtype, _op_scalars(*op_scalar_args)))
    else:
        _keep_forward_plan(key, q, k, v, op_scalar_args)
    return result


# ----------------------------------------------------------------------------------------
# Forward call plans: a plain `attention` call repeated with inputs of the same metadata.

_REAL = (float, int)


def _keep_forward_plan(key, q, k, v, op_scalar_args: tuple, cu_seqlens=(None, None)) -> None:
    """After the full path validated a plain call: its forward plan under `key` (None: no plan),
    the op's scalars from `_op_scalars(*op_scalar_args)`. Not for float8 inputs (their own op)."""
    if key is not None and not F8.is_fp8(q):
        keep_plan(_FORWARD_PLANS, key, _ForwardPlan(q, k, v, _op_scalars(*op_scalar_args), cu_seqlens))


def _plain_tensors(q, k, v, nones: tuple, return_dropout_mask) -> bool:
    """Plain tensors q, k, v, every optional argument in `nones` None, no dropout mask asked for:
    what every call plan needs."""
    return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and all(x is None for x in nones)
            and not return_dropout_mask)


def _plain_call(q, k, v, nones: tuple, return_dropout_mask) -> bool:
    """A call a forward plan may serve: `_plain_tensors` (`nones`: optional tensors, float8
    arguments, the seed), not float8 (`_plain_fp8_call`)."""
    return _plain_tensors(q, k, v, nones, return_dropout_mask) and not F8.is_fp8(q)


def _plain_fp8_call(q, k, v, nones: tuple, descales: tuple, descale_block_size, out_dtype,
                    return_dropout_mask) -> bool:
    """A float8 call an fp8 forward plan may serve: `_plain_tensors` of float8 q, k, v, plain tensors
    or None for the descales, an int or None descale_block_size, a dtype or None out_dtype, and
    nothing that requires grad (the full path refuses that)."""
    return (_plain_tensors(q, k, v, nones, return_dropout_mask) and F8.is_fp8(q)
            and all(d is None or type(d) is Tensor for d in descales)
            and (descale_block_size is None or type(descale_block_size) is int)
            and (out_dtype is None or type(out_dtype) is torch.dtype)
            and not any(t is not None and t.requires_grad for t in (q, k, v, *descales)))


def _plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                   deterministic) -> bool:
    """Scalars of the types a forward plan's key tells apart (bools as bools, ints as ints, a
    float or None scale), and no dropout: equal keys then mean calls validation treats alike."""
    return (type(scale) is float or scale is None) and type(causal) is bool and type(window) is tuple \
        and len(window) == 2 and type(window[0]) is int and type(window[1]) is int and type(sink_size) is int \
        and type(softcap) in _REAL and type(dropout_p) in _REAL and dropout_p == 0 and type(offset) is int \
        and type(deterministic) is bool and type(layout) is str and type(mask_align) is str


class _ForwardPlan:
    """What a validated plain `attention` or `attention_varlen` call (no optional tensors, no
    dropout, not float8) repeats for inputs of the same metadata and the same scalars (the
    calls' keys; varlen's: cu_seqlens' metadata, and their values where validation reads them):
    the op's normalized scalars, and its forward's problem, kernel config and launcher
    arguments. A call autograd records goes through `_PlannedAttention`, whose backward keeps
    its own plans per dO metadata; otherwise the forward runs at once. Checks, description and
    dispatch ran for the call that made the plan; a later call of the same key would pass them
    alike."""

    __slots__ = ("scalars", "problem", "scale", "config", "kernel_args", "head_dim_v", "layout", "runnable",
                 "launched", "backward_plans")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scalars: tuple,
                 cu_seqlens: tuple[Tensor | None, Tensor | None] = (None, None)) -> None:
        prep = _prepare_op(q, k, v, (None, None, None, *cu_seqlens, None) + scalars)
        self.scalars, self.problem, self.scale = scalars, prep.problem, prep.scale
        self.config = _plan_forward(prep.problem, False).config(Family.FWD)
        self.kernel_args = _kernel_args(prep, None, None, *cu_seqlens, None, scalars[11], scalars[12])
        self.head_dim_v, self.layout = v.shape[-1], scalars[2]
        self.runnable = None
        if self.config.algorithm.pipeline.is_gluon:
            from .kernels.launch_cache import runnable  # (Triton is loaded by now: it ran this config)

            self.runnable = runnable
        self.launched = None  # the Gluon launcher's own plan (fwd_gluon.launch), once it ran
        self.backward_plans: dict = {}  # dO's metadata -> _BackwardPlan (`_bwd_body`)

    def run(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None = None,
            cu_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """o, lse of q, k, v (and a varlen call's cu_seqlens_q/k)."""
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _PlannedAttention.apply(self, q, k, v, cu_q, cu_k)
        return self.forward(q, k, v, cu_q, cu_k)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None = None,
                cu_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """o, lse: the forward's body as the plan keeps it."""
        o, o_view, lse = _alloc_like(q, self.head_dim_v, cu_q is not None, self.layout)
        if not (o.numel() or lse.numel()):
            return o, lse
        prep = _prepared_views(self.problem, q, k, v, self.scale)
        if self.launched is not None and self.runnable(self.launched):
            if cu_q is None:
                self.launched.launch(prep.q, prep.k, prep.v, o_view, lse)
            else:
                self.launched.launch(prep.q, prep.k, prep.v, o_view, lse, cu_q, cu_k)
            return o, lse
        kernel_args = self.kernel_args if cu_q is None else {**self.kernel_args, "cu_seqlens_q": cu_q,
                                                             "cu_seqlens_k": cu_k}
        launched = _launch_forward(prep, self.config, o_view, lse, None, kernel_args)
        if self.runnable is not None:
            self.launched = launched
        return o, lse

    def backward(self, grad_o, grad_lse, q, k, v, cu_q, cu_k, o, lse) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of the forward this plan ran on q, k, v (cu_seqlens_q/k, o, lse), as `_backward`."""
        if len(self.backward_plans) >= 16:  # (dO's metadata: a few variants at most)
            self.backward_plans.clear()
        return _run_backward(grad_o, grad_lse, o, lse, False, False, (q, k, v, None, None, None, cu_q, cu_k, None),
                             self.scalars, (self.problem, self.scale), self.backward_plans)[:3]


class _PlannedAttention(torch.autograd.Function):
    """A forward call plan's call that autograd records (`_ForwardPlan.run`): the plan's forward
    body, and its backward (`_ForwardPlan.backward`). Only in plain eager mode (plans are)."""

    @classmethod
    def apply(cls, *args):
        """`Function.apply` less its argument binding through `inspect` (as `_EagerAttention.apply`)."""
        return super(torch.autograd.Function, cls).apply(*args)

    @staticmethod
    def forward(plan, q, k, v, cu_q, cu_k):
        return plan.forward(q, k, v, cu_q, cu_k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # an unused lse (or o) gives None, not a zeros tensor
        ctx.save_for_backward(*inputs[1:], *output)
        ctx.plan = inputs[0]

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        return (None, *ctx.plan.backward(grad_o, grad_lse, *ctx.saved_tensors), None, None)


class _Fp8ForwardPlan:
    """What a validated float8 `attention` call (descales and out_dtype given or not, no other
    optional tensor, no dropout, nothing requiring grad) repeats for inputs and descales of the
    same metadata and the same scalars: the problem, kernel config and launcher arguments of
    `_fwd_fp8_op`, and the Gluon launcher's own plan once it ran. Per call: the descales' kernel
    views (`fp8.descale_view`) and, where `fp8.check_descales` reads them (CPU tensors, debug
    mode), their values. Shapes, dtypes and devices passed the full path's checks for the call
    that made the plan; a call of the same key passes them alike."""

    __slots__ = ("problem", "scale", "config", "kernel_args", "head_dim_v", "layout", "out_dtype",
                 "descale_block", "runnable", "launched")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, descales: tuple, descale_block_size: int | None,
                 out_dtype: torch.dtype | None, scalars: tuple) -> None:
        prep, _ = _prepare_fp8(q, k, v, (None,) * 6 + scalars, descales, descale_block_size)
        self.problem, self.scale = prep.problem, prep.scale
        self.config = _plan_forward(self.problem, False).config(Family.FWD)
        self.kernel_args = _kernel_args(prep, None, None, None, None, None, scalars[11], scalars[12])
        self.head_dim_v, self.layout = v.shape[-1], scalars[2]
        self.out_dtype = out_dtype or torch.bfloat16
        self.descale_block = descale_block_size or 0
        self.runnable = None
        if self.config.algorithm.pipeline.is_gluon:
            from .kernels.launch_cache import runnable  # (Triton is loaded by now: it ran this config)

            self.runnable = runnable
        self.launched = None  # the Gluon launcher's own plan (fwd_gluon.launch), once it ran

    def run(self, q: Tensor, k: Tensor, v: Tensor, descales: tuple) -> tuple[Tensor, Tensor]:
        """o (out_dtype), lse of q, k, v with these descales (None: 1)."""
        for name, d in zip(_DESCALE_NAMES, descales, strict=True):
            F8.check_descale_values(name, d)
        views = tuple(F8.descale_view(d) for d in descales)
        o, o_view, lse = _alloc_like(q, self.head_dim_v, False, self.layout, dtype=self.out_dtype)
        if not (o.numel() or lse.numel()):
            return o, lse
        prep = _prepared_views(self.problem, q, k, v, self.scale)
        if self.launched is not None and self.runnable(self.launched):
            self.launched.launch(prep.q, prep.k, prep.v, o_view, lse, *views)
            return o, lse
        launched = _launch_forward(prep, self.config, o_view, lse, None, self.kernel_args,
                                   fp8_descales=dict(zip(_DESCALE_NAMES, views, strict=True)),
                                   descale_block=self.descale_block)
        if self.runnable is not None:
            self.launched = launched
        return o, lse


_FORWARD_PLANS = plan_table()  # (forgotten with the launchers' plans: plan_tables.clear_plans)


def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, seqused_k: Tensor | None = None,
    scale: float | None = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right", sink_size: int = 0, bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None, softcap: float = 0.0, sinks: Tensor | None = None,
    dropout_p: float = 0.0, seed: int | None = None, offset: int = 0,
    return_lse: bool = False, return_dropout_mask: bool = False, deterministic: bool = False,
    q_descale: Tensor | None = None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    descale_block_size: int | None = None, out_dtype: torch.dtype | None = None,
):
    """Attention over packed variable-length sequences (CK's group mode), differentiable.

    q: (total_q, Hq, Dqk), k: (total_k, Hk, Dqk), v: (total_k, Hk, Dv); cu_seqlens_q/k:
    int32 (B + 1,) prefix sums starting at 0; seqused_k: int32 (B,) keys used per sequence.
    Masks align per sequence. bias is broadcastable to (B, Hq, max_seqlen_q, max_seqlen_k)
    and indexed by positions within each sequence; the dropout mask has that shape too.
    Returns o (total_q, Hq, Dv), then lse (Hq, total_q) and the mask if asked for.
    Float8 inputs as in `attention` (forward only); per-block descales are
    (B, H, ceil(max_seqlen / descale_block_size)) and count positions within each sequence.
    """
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise TypeError("attention_varlen needs cu_seqlens_q and cu_seqlens_k (int32 tensors)")
    key = None
    if (_plain_call(q, k, v, (seqused_k, bias, alibi_slopes, sinks, q_descale, k_descale, v_descale,
                              descale_block_size, out_dtype, seed), return_dropout_mask)
            and type(cu_seqlens_q) is Tensor and type(cu_seqlens_k) is Tensor and type(max_seqlen_q) is int
            and type(max_seqlen_k) is int
            and _plain_scalars("bhsd", scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                               deterministic) and _plain_eager()):
        key = _varlen_plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                               window, mask_align, sink_size, softcap, offset, deterministic)
        plan = _FORWARD_PLANS.get(key) if key is not None else None
        if plan is not None:
            o, lse = plan.run(q, k, v, cu_seqlens_q, cu_seqlens_k)
            return (o, lse) if return_lse else o
    result = _call(q, k, v, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout="bhsd",
                   scale=scale, causal=causal, window=window, mask_align=mask_align,
                   sink_size=sink_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                   offset=offset, deterministic=deterministic, return_lse=return_lse,
                   return_dropout_mask=return_dropout_mask, q_descale=q_descale, k_descale=k_descale,
                   v_descale=v_descale, descale_block_size=descale_block_size, out_dtype=out_dtype)
    _keep_forward_plan(key, q, k, v, (max_seqlen_q, max_seqlen_k, "bhsd", scale, causal, window, mask_align,
                                      sink_size, softcap, dropout_p, None, offset, deterministic),
                       (cu_seqlens_q, cu_seqlens_k))
    return result


def _varlen_plan_key(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, *scalars) -> tuple | None:
    """An `attention_varlen` call plan's key: the metadata and scalars, and the cu_seqlens values
    where validation reads them (CPU tensors: a repeated call must pass the same checks); None in
    debug mode off the CPU (validation then reads device values every call: no plan)."""
    values = None
    if cu_q.dim() != 1 or cu_k.dim() != 1:  # (refused by the full path)
        return None
    if cu_q.device.type == "cpu":
        values = (tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    elif V.debug_enabled():
        return None
    return ("varlen", _meta(q), _meta(k), _meta(v), _meta(cu_q), _meta(cu_k), values, max_seqlen_q, max_seqlen_k,
            *scalars)


def problem_of(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "bhsd", scale=None,
               causal: bool = False, window=(-1, -1), mask_align: str = "bottom_right",
               sink_size: int = 0, bias=None, alibi_slopes=None, softcap: float = 0.0,
               sinks=None, dropout_p: float = 0.0, seed=None, offset: int = 0,
               deterministic: bool = False, q_descale=None, k_descale=None, v_descale=None,
               descale_block_size=None, out_dtype=None, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q: int = 0, max_seqlen_k: int = 0, seqused_k=None) -> Problem:
    """The `Problem` that `attention(q, k, v, ...)` with these arguments would solve; with
    cu_seqlens_q/k (and max_seqlen_q/k, seqused_k), the one `attention_varlen` would."""
    left, right = V.check_scalars(scale=scale, softcap=softcap, window=window, sink_size=sink_size,
                                  dropout_p=dropout_p, causal=causal)
    problem = _prepare(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                       max_seqlen_k, layout, scale, causal, left, right, mask_align, sink_size, softcap, dropout_p,
                       seed or 0, offset, deterministic).problem
    # fp8: a 3-d descale with more than one block is per block (fmha.fp8.check_descales)
    block = any(isinstance(d, Tensor) and d.dim() == 3 and d.shape[2] > 1
                for d in (q_descale, k_descale, v_descale))
    return problem.with_(fp8_block_descale=block) if block else problem


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str:
    """Which kernels `attention(q, k, v, **kwargs)` would launch, and why; given cu_seqlens_q/k
    and max_seqlen_q/k (as `attention_varlen` takes them), those of `attention_varlen`."""
    problem = problem_of(q, k, v, **kwargs)
    dispatcher = get_dispatcher()
    requires_grad = any(t.requires_grad for t in (q, k, v))
    exact_delta = any(isinstance(t, Tensor) and t.requires_grad for t in (kwargs.get("bias"), kwargs.get("sinks")))
    plans = [dispatcher.plan_forward(problem)]
    if requires_grad or exact_delta:
        plans.append(dispatcher.plan_backward(problem, exact_delta=exact_delta))
    return "\n".join([*(plan.describe() for plan in plans), "",
                      dispatcher.explain(problem, Family.FWD)])


__all__ = ["attention", "attention_varlen", "explain", "problem_of", "set_dispatcher",
           "get_dispatcher", "DType"]
