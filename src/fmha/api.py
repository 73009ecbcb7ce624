"""Public torch entry points: `attention`, `attention_varlen`, `explain`.

Each call validates its arguments (fmha.validation), describes itself as a `Problem`,
asks the dispatcher for a plan (cached per problem), and runs the plan's launches.
CUDA tensors run compiled kernels; CPU tensors run the same kernels through Triton's
interpreter. The kernel work is a `torch.library` custom op (`fmha::fwd`) with a fake
implementation, so `torch.compile` traces it without graph breaks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import validation as V
from .configs import Family, KernelConfig
from .dispatcher import Dispatcher, Plan, default_dispatcher
from .kernels.loader import family_module
from .problem import DType, MaskAlign, Problem

Tensor = torch.Tensor

_dispatcher: Dispatcher | None = None


def set_dispatcher(dispatcher: Dispatcher | None) -> None:
    """Route every call through `dispatcher` (None: back to the default registry)."""
    global _dispatcher
    _dispatcher = dispatcher
    _plan_forward.cache_clear()
    _plan_backward.cache_clear()


def get_dispatcher() -> Dispatcher:
    return _dispatcher if _dispatcher is not None else default_dispatcher()


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


def _algorithm_args(config: KernelConfig) -> dict:
    a = config.algorithm
    return dict(block_m=a.block_m, block_n=a.block_n, num_warps=a.num_warps, num_stages=a.num_stages)


# ----------------------------------------------------------------------------------------
# Argument preparation: validation + Problem, shared by the dense and varlen entry points.


@dataclass
class _Prepared:
    problem: Problem
    q: Tensor  # kernel views: bhsd (dense) or packed (total, H, D) (varlen)
    k: Tensor
    v: Tensor
    bias: Tensor | None
    alibi: Tensor | None
    sinks: Tensor | None
    scale: float
    seed: int


def _prepare(q, k, v, *, varlen, layout, scale, causal, window, mask_align, sink_size, bias,
             alibi_slopes, softcap, sinks, dropout_p, seed, offset, deterministic,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             seqused_k=None) -> _Prepared:
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(name, t, ndim)
    dtype = V.check_dtype("q", q)
    V.check_same(("q", "k", "v"), (q, k, v))
    layout = V.check_layout(layout)
    align = V.check_mask_align(mask_align)
    window = V.check_scalars(scale=scale, softcap=softcap, window=window, sink_size=sink_size,
                             dropout_p=dropout_p, causal=causal)
    V.check_seed(seed, offset)
    if varlen:
        qv, kv, vv = q, k, v
        batch = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, Tensor) else 0
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
    head_axis = 1
    nhead_q, nhead_k = qv.shape[head_axis], kv.shape[head_axis]
    V.check_heads(nhead_q, nhead_k, vv.shape[head_axis])
    if kv.shape[-1] != qv.shape[-1]:
        raise ValueError(f"k has head dim {kv.shape[-1]} but q has {qv.shape[-1]}; they must match")
    V.check_last_dim_contiguous("q", q)
    V.check_last_dim_contiguous("k", k)
    v_column_major = V.check_last_dim_contiguous("v", vv, allow_column_major=True)
    bias4 = V.check_bias(bias, (batch, nhead_q, seqlen_q, seqlen_k), q.dtype, q.device)
    alibi = V.check_alibi(alibi_slopes, batch, nhead_q, q.device)
    sinks = V.check_sinks(sinks, nhead_q, q.device, q.dtype)
    if dropout_p > 0 and seed is None:
        # Drawn on the host from torch's default CPU generator: no GPU synchronisation.
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
    problem = Problem(
        batch=batch, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim_qk=qv.shape[-1], head_dim_v=vv.shape[-1], dtype=dtype, layout=layout,
        arch=_arch_of(q.device), causal=causal, window=window, mask_align=align,
        sink_size=sink_size, bias=bias4 is not None, alibi=alibi is not None,
        softcap=float(softcap), sinks=sinks is not None, dropout_p=float(dropout_p),
        varlen=varlen, seqused_k=seqused_k is not None, v_column_major=v_column_major,
        deterministic=deterministic,
    )
    scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)
    return _Prepared(problem, qv, kv, vv, bias, alibi_slopes, sinks, scale, seed or 0)


# ----------------------------------------------------------------------------------------
# The kernel work as a custom op.


def _expand_bias(bias: Tensor | None, shape) -> Tensor | None:
    """The user's bias as a 4-d zero-stride view (validated earlier)."""
    if bias is None:
        return None
    return bias[(None,) * (4 - bias.dim())].expand(shape)


def _kernel_args(problem: Problem, q, k, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 scale, seed, offset) -> dict:
    """Keyword arguments shared by the forward and backward launchers."""
    p = problem
    shape = (p.batch, p.nhead_q, p.seqlen_q, p.seqlen_k)
    return dict(
        batch=p.batch, max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        bias=_expand_bias(bias, shape), alibi_slopes=None if alibi_slopes is None else (
            alibi_slopes[None] if alibi_slopes.dim() == 1 else alibi_slopes),
        scale=scale, softcap=p.softcap, window=p.window, sink_size=p.sink_size,
        align_bottom_right=p.mask_align == MaskAlign.BOTTOM_RIGHT, dropout_p=p.dropout_p,
        seed=seed, offset=offset,
    )


def _algo(config: KernelConfig) -> dict:
    return dict(_algorithm_args(config), dot_precision=config.algorithm.dot_precision)


@torch.library.custom_op("fmha::fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor,
    bias: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, seqused_k: Tensor | None,
    scale: float, seed: int, offset: int, problem_key: str,
) -> tuple[Tensor, Tensor]:
    """q/k/v are kernel views (bhsd or packed); returns (o, lse) with o in the user's layout."""
    problem = _problems[problem_key]
    plan = _plan_forward(problem, False)
    o, o_view, lse = _alloc_like(q, v.shape[-1], problem)
    if o.numel() or lse.numel():
        kernels = family_module("fwd", interpreted=q.device.type == "cpu")
        with _device_guard(q):
            kernels.launch(
                q, k, v, o_view, lse, sinks=sinks,
                **_kernel_args(problem, q, k, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               seqused_k, scale, seed, offset),
                **_algo(plan.config(Family.FWD)),
            )
    return o, lse


def _stats_dtype(q: Tensor) -> torch.dtype:
    """LSE, delta and dQ accumulators: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _alloc_like(q: Tensor, head_dim: int, problem: Problem, dtype=None):
    """(tensor in the user's layout, its kernel view, lse-shaped fp32) for q-shaped outputs."""
    dtype = dtype or q.dtype
    stats = _stats_dtype(q)
    if problem.varlen:
        total, nhead = q.shape[0], q.shape[1]
        o = q.new_empty((total, nhead, head_dim), dtype=dtype)
        return o, o, torch.empty((nhead, total), dtype=stats, device=q.device)
    batch, nhead, seqlen = q.shape[0], q.shape[1], q.shape[2]
    lse = torch.empty((batch, nhead, seqlen), dtype=stats, device=q.device)
    if problem.layout == "bshd":
        o = q.new_empty((batch, seqlen, nhead, head_dim), dtype=dtype)
        return o, o.transpose(1, 2), lse
    o = q.new_empty((batch, nhead, seqlen, head_dim), dtype=dtype)
    return o, o, lse


@_fwd_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, scale, seed,
      offset, problem_key):
    o, _, lse = _alloc_like(q, v.shape[-1], _problems[problem_key])
    return o, lse


@torch.library.custom_op("fmha::bwd", mutates_args=())
def _bwd_op(
    do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    bias: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, seqused_k: Tensor | None,
    scale: float, seed: int, offset: int, problem_key: str, want_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv as kernel views; dbias in bias' shape or empty; dsinks or empty)."""
    problem = _problems[problem_key]
    plan = _plan_backward(problem)
    interpreted = q.device.type == "cpu"
    kernels = family_module("bwd", interpreted=interpreted)
    varlen = problem.varlen
    o_view = o if (varlen or problem.layout == "bhsd") else o.transpose(1, 2)
    do_view = do if (varlen or problem.layout == "bhsd") else do.transpose(1, 2)
    dq, dq_view, delta = _alloc_like(q, q.shape[-1], problem)
    dk, dk_view, _ = _alloc_like(k, k.shape[-1], problem)
    dv, dv_view, _ = _alloc_like(v, v.shape[-1], problem)
    if seqused_k is not None:  # keys past seqused_k belong to no program: their gradient is 0
        dk.zero_()
        dv.zero_()
    dsinks_rows = torch.empty_like(delta) if sinks is not None else None
    shared = _kernel_args(problem, q, k, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          scale, seed, offset)
    dbias_full = None
    if want_dbias:
        dbias_full = torch.zeros((problem.batch, problem.nhead_q, problem.seqlen_q, problem.seqlen_k),
                                 dtype=_stats_dtype(q), device=q.device)
    with _device_guard(q):
        kernels.launch_dot_do_o(o_view, do_view, lse, delta, dlse=dlse, sinks=sinks,
                                dsinks_rows=dsinks_rows, **shared,
                                **_algo(plan.config(Family.BWD_DOT_DO_O)))
        if problem.deterministic:
            kernels.launch_dkdv(q, k, v, do_view, lse, delta, dk_view, dv_view, dbias=dbias_full,
                                **shared, **_algo(plan.config(Family.BWD_DQ_DK_DV)))
            kernels.launch_dq(q, k, v, do_view, lse, delta, dq_view, **shared,
                              **_algo(plan.config(Family.BWD_DQ)))
        else:
            dq_acc = torch.zeros(dq.shape, dtype=_stats_dtype(q), device=q.device)
            dq_acc_view = dq_acc if (varlen or problem.layout == "bhsd") else dq_acc.transpose(1, 2)
            kernels.launch_dkdv(q, k, v, do_view, lse, delta, dk_view, dv_view, dq_acc=dq_acc_view,
                                dbias=dbias_full, **shared,
                                **_algo(plan.config(Family.BWD_DQ_DK_DV)))
            kernels.launch_convert_dq(dq_acc, dq, scale=scale,
                                      **_algo(plan.config(Family.BWD_CONVERT_DQ)))
    dbias = q.new_empty(0)
    if want_dbias:
        dbias = _reduce_to(dbias_full, bias).to(bias.dtype)
    dsinks = q.new_empty(0)
    if sinks is not None:  # per-row shares (B, Hq, Sq) or (Hq, total_q), summed per head
        head_axis = 0 if varlen else 1
        dsinks = dsinks_rows.sum(dim=tuple(i for i in range(dsinks_rows.dim()) if i != head_axis))
    return dq_view, dk_view, dv_view, dbias, dsinks


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """Sum a (B, Hq, Sq, Sk) gradient over the dimensions `like` broadcasts."""
    lead = grad.dim() - like.dim()
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


@_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
      scale, seed, offset, problem_key, want_dbias):
    problem = _problems[problem_key]
    dq = _alloc_like(q, q.shape[-1], problem)[1]
    dk = _alloc_like(k, k.shape[-1], problem)[1]
    dv = _alloc_like(v, v.shape[-1], problem)[1]
    dbias = torch.empty_like(bias) if want_dbias else q.new_empty(0)
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0)
    return dq, dk, dv, dbias, dsinks


def _setup_context(ctx, inputs, output):
    (q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
     scale, seed, offset, problem_key) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                          seqused_k)
    ctx.scalars = (scale, seed, offset, problem_key)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k = ctx.saved_tensors
    scale, seed, offset, problem_key = ctx.scalars
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    dlse = None if grad_lse is None else grad_lse.contiguous()
    dq, dk, dv, dbias, dsinks = _bwd_op(
        grad_o, dlse, q, k, v, o, lse, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k,
        scale, seed, offset, problem_key, want_dbias)
    return (dq, dk, dv, dbias if want_dbias else None, None,
            dsinks if sinks is not None else None, None, None, None, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@functools.lru_cache(maxsize=4096)
def _plan_backward(problem: Problem) -> Plan:
    return get_dispatcher().plan_backward(problem)


class _device_guard:
    def __init__(self, t: Tensor):
        self.ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# Problems travel to the custom op by key: ops take only tensors and scalars.
_problems: dict[str, Problem] = {}


def _problem_key(problem: Problem) -> str:
    key = repr(problem)
    _problems.setdefault(key, problem)
    return key


def _run_forward(prep: _Prepared, *, return_lse, return_dropout_mask, offset,
                 cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None):
    p = prep.problem
    plan = _plan_forward(p, return_dropout_mask)  # raises NoKernelError with every refusal
    if any(t is not None and t.requires_grad for t in (prep.q, prep.k, prep.v, prep.bias, prep.sinks)):
        _plan_backward(p)  # refuse before running anything if no backward kernel fits
    o, lse = _fwd_op(
        prep.q, prep.k, prep.v, prep.bias, prep.alibi, prep.sinks,
        cu_seqlens_q, cu_seqlens_k, seqused_k, prep.scale, prep.seed, offset, _problem_key(p),
    )
    results = [o]
    if return_lse:
        results.append(lse)
    if return_dropout_mask:
        results.append(_dropout_mask(plan, prep.q, prep.seed, offset))
    return results[0] if len(results) == 1 else tuple(results)


def _dropout_mask(plan: Plan, q: Tensor, seed: int, offset: int) -> Tensor:
    p = plan.problem
    mask = torch.zeros((p.batch, p.nhead_q, p.seqlen_q, p.seqlen_k), dtype=torch.uint8, device=q.device)
    if p.dropout_p > 0 and mask.numel():
        kernels = family_module("dropout", interpreted=q.device.type == "cpu")
        with _device_guard(q):
            kernels.launch(mask, dropout_p=p.dropout_p, seed=seed, offset=offset,
                           **_algorithm_args(plan.config(Family.DROPOUT_MASK)))
    else:
        mask.fill_(1)
    return mask.view(torch.bool)


# ----------------------------------------------------------------------------------------
# Public functions.


def attention(
    q: Tensor, k: Tensor, v: Tensor, *,
    layout: str = "bhsd", scale: float | None = None, causal: bool = False,
    window: tuple[int, int] = (-1, -1), mask_align: str = "bottom_right", sink_size: int = 0,
    bias: Tensor | None = None, alibi_slopes: Tensor | None = None, softcap: float = 0.0,
    sinks: Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
    offset: int = 0, return_lse: bool = False, return_dropout_mask: bool = False,
    deterministic: bool = False,
):
    """Fused multi-head attention (SPEC section 1).

    Args:
        q: (B, Hq, Sq, Dqk) for layout "bhsd", (B, Sq, Hq, Dqk) for "bshd"; fp16/bf16/fp32.
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
        return_lse: also return lse (B, Hq, Sq), fp32, natural log.
        return_dropout_mask: also return the boolean keep mask (B, Hq, Sq, Sk).

    Returns: o in q's layout and dtype (with Dv), then lse and the mask if asked for.
    """
    prep = _prepare(q, k, v, varlen=False, layout=layout, scale=scale, causal=causal,
                    window=window, mask_align=mask_align, sink_size=sink_size, bias=bias,
                    alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                    seed=seed, offset=offset, deterministic=deterministic)
    return _run_forward(prep, return_lse=return_lse, return_dropout_mask=return_dropout_mask,
                        offset=offset)


def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, seqused_k: Tensor | None = None,
    scale: float | None = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right", sink_size: int = 0, bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None, softcap: float = 0.0, sinks: Tensor | None = None,
    dropout_p: float = 0.0, seed: int | None = None, offset: int = 0,
    return_lse: bool = False, return_dropout_mask: bool = False, deterministic: bool = False,
):
    """Attention over packed variable-length sequences (CK's group mode).

    q: (total_q, Hq, Dqk), k: (total_k, Hk, Dqk), v: (total_k, Hk, Dv); cu_seqlens_q/k:
    int32 (B + 1,) prefix sums starting at 0; seqused_k: int32 (B,) keys used per sequence.
    Masks align per sequence. bias is broadcastable to (B, Hq, max_seqlen_q, max_seqlen_k)
    and indexed by positions within each sequence; the dropout mask has that shape too.
    Returns o (total_q, Hq, Dv), then lse (Hq, total_q) and the mask if asked for.
    """
    prep = _prepare(q, k, v, varlen=True, layout="bhsd", scale=scale, causal=causal,
                    window=window, mask_align=mask_align, sink_size=sink_size, bias=bias,
                    alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                    seed=seed, offset=offset, deterministic=deterministic,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    return _run_forward(prep, return_lse=return_lse, return_dropout_mask=return_dropout_mask,
                        offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        seqused_k=seqused_k)


def problem_of(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Problem:
    """The `Problem` that `attention(q, k, v, **kwargs)` would solve."""
    names = ("layout", "scale", "causal", "window", "mask_align", "sink_size", "bias",
             "alibi_slopes", "softcap", "sinks", "dropout_p", "seed", "offset", "deterministic")
    defaults = dict(layout="bhsd", scale=None, causal=False, window=(-1, -1),
                    mask_align="bottom_right", sink_size=0, bias=None, alibi_slopes=None,
                    softcap=0.0, sinks=None, dropout_p=0.0, seed=None, offset=0, deterministic=False)
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"problem_of() got unexpected keyword arguments {sorted(unknown)}")
    return _prepare(q, k, v, varlen=False, **{**defaults, **kwargs}).problem


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str:
    """Which kernels `attention(q, k, v, **kwargs)` would launch, and why."""
    problem = problem_of(q, k, v, **kwargs)
    dispatcher = get_dispatcher()
    return "\n".join([dispatcher.plan_forward(problem).describe(), "",
                      dispatcher.explain(problem, Family.FWD)])


__all__ = ["attention", "attention_varlen", "explain", "problem_of", "set_dispatcher",
           "get_dispatcher", "DType"]
