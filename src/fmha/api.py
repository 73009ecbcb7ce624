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
    sinks = V.check_sinks(sinks, nhead_q, q.device)
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
    return _Prepared(problem, qv, kv, vv, bias4, alibi, sinks, scale, seed or 0)


# ----------------------------------------------------------------------------------------
# The kernel work as a custom op.


@torch.library.custom_op("fmha::fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor,
    bias: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, seqused_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, out_bshd: bool,
    scale: float, window_left: int, window_right: int, bottom_right: bool, sink_size: int,
    softcap: float, dropout_p: float, seed: int, offset: int, problem_key: str,
) -> tuple[Tensor, Tensor]:
    """q/k/v are kernel views (bhsd or packed); returns (o, lse) with o in the user's layout."""
    problem = _problems[problem_key]
    plan = _plan_forward(problem, False)
    o, o_view, lse = _alloc_out(q, v, cu_seqlens_q is not None, out_bshd)
    if o.numel() or lse.numel():
        kernels = family_module("fwd", interpreted=q.device.type == "cpu")
        with _device_guard(q):
            kernels.launch(
                q, k, v, o_view, lse,
                batch=problem.batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, scale=scale, softcap=softcap,
                window=(window_left, window_right), sink_size=sink_size,
                align_bottom_right=bottom_right, dropout_p=dropout_p, seed=seed, offset=offset,
                dot_precision=plan.config(Family.FWD).algorithm.dot_precision,
                **_algorithm_args(plan.config(Family.FWD)),
            )
    return o, lse


def _alloc_out(q: Tensor, v: Tensor, varlen: bool, out_bshd: bool):
    """(o in the user's layout, o as a kernel view, lse)."""
    dv = v.shape[-1]
    if varlen:
        total, nhead = q.shape[0], q.shape[1]
        o = q.new_empty((total, nhead, dv))
        return o, o, torch.empty((nhead, total), dtype=torch.float32, device=q.device)
    batch, nhead, seqlen = q.shape[0], q.shape[1], q.shape[2]
    lse = torch.empty((batch, nhead, seqlen), dtype=torch.float32, device=q.device)
    if out_bshd:
        o = q.new_empty((batch, seqlen, nhead, dv))
        return o, o.transpose(1, 2), lse
    o = q.new_empty((batch, nhead, seqlen, dv))
    return o, o, lse


@_fwd_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
      max_seqlen_k, out_bshd, *args):
    o, _, lse = _alloc_out(q, v, cu_seqlens_q is not None, out_bshd)
    return o, lse


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
    if any(t is not None and t.requires_grad for t in (prep.q, prep.k, prep.v, prep.bias, prep.sinks)) \
            and torch.is_grad_enabled():
        raise NotImplementedError(
            "fmha: the backward pass is not implemented yet (issue 4); call under "
            "torch.no_grad() or detach the inputs")
    plan = _plan_forward(p, return_dropout_mask)  # raises NoKernelError with every refusal
    o, lse = _fwd_op(
        prep.q, prep.k, prep.v, prep.bias, prep.alibi, prep.sinks,
        cu_seqlens_q, cu_seqlens_k, seqused_k, p.seqlen_q, p.seqlen_k,
        p.layout == "bshd" and not p.varlen, prep.scale, p.window[0], p.window[1],
        p.mask_align == MaskAlign.BOTTOM_RIGHT, p.sink_size, p.softcap, p.dropout_p,
        prep.seed, offset, _problem_key(p),
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
