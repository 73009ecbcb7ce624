"""Public torch entry points: `attention`, `attention_varlen`, `problem_of`, `explain`.

Each call checks its scalar arguments (plain Python, traceable), then runs one custom op
(fmha.ops.attention), which validates the tensors, describes the call as a `Problem`, asks
the dispatcher for a plan and runs the plan's launches. CUDA tensors run compiled kernels;
CPU tensors run the same kernels through Triton's interpreter. A repeated plain call takes
its call plan (fmha.ops.call_plans).
"""

from __future__ import annotations

import torch

from . import validation as V
from .dispatch.configs import Family
from .dispatch.state import get_dispatcher, set_dispatcher, use_dispatcher
from .kernels.launch.plan_tables import keep_plan
from .ops.attention import EagerAttention, check_fp8_call, direct_op, dropout_mask_op, fwd_fp8_op, fwd_op, plain_eager
from .ops.call_plans import (
    FORWARD_PLANS,
    Fp8ForwardPlan,
    keep_forward_plan,
    plain_call,
    plain_fp8_call,
    plain_scalars,
    varlen_plan_key,
)
from .ops.prepare import check_call_types, op_scalars, prepare_call, tensor_meta
from .problem import DType, Problem

Tensor = torch.Tensor



def _call(q, k, v, *, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
          max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size,
          softcap, dropout_p, seed, offset, deterministic, return_lse, return_dropout_mask,
          q_descale=None, k_descale=None, v_descale=None, descale_block_size=None, out_dtype=None):
    check_call_types(q, k, v, dict(bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                                    cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, q_descale=q_descale,
                                    k_descale=k_descale, v_descale=v_descale),
                      dict(layout=layout, mask_align=mask_align),
                      dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    scalars = op_scalars(max_seqlen_q, max_seqlen_k, layout, scale, causal, window, mask_align, sink_size, softcap,
                          dropout_p, seed, offset, deterministic)
    seed = scalars[11]
    out_dtype = check_fp8_call(q, k, v, q_descale, k_descale, v_descale, descale_block_size, out_dtype,
                                return_dropout_mask)
    tensors = (q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k)
    if out_dtype is not None:  # float8 inputs
        o, lse = direct_op(fwd_fp8_op, tensors + (q_descale, k_descale, v_descale))(
            *tensors, q_descale, k_descale, v_descale, descale_block_size, out_dtype, *scalars)
    else:
        o, lse = direct_op(fwd_op, tensors, autograd=EagerAttention)(*tensors, *scalars)
    results = [o]
    if return_lse:
        results.append(lse)
    if return_dropout_mask:
        results.append(dropout_mask_op(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, layout,
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
    if (plain_call(q, k, v, (bias, alibi_slopes, sinks, q_descale, k_descale, v_descale, descale_block_size,
                              out_dtype, seed), return_dropout_mask)
            and plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                               deterministic) and plain_eager()):
        key = (tensor_meta(q), tensor_meta(k), tensor_meta(v), layout, scale, causal, window, mask_align, sink_size,
               softcap, offset, deterministic)
        plan = FORWARD_PLANS.get(key)
        if plan is not None:
            o, lse = plan.run(q, k, v)
            return (o, lse) if return_lse else o
    elif (plain_fp8_call(q, k, v, (bias, alibi_slopes, sinks, seed), (q_descale, k_descale, v_descale),
                          descale_block_size, out_dtype, return_dropout_mask)
          and plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                             deterministic) and plain_eager()):
        key = ("fp8", tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(q_descale), tensor_meta(k_descale),
               tensor_meta(v_descale), descale_block_size, out_dtype, layout, scale, causal, window, mask_align,
               sink_size, softcap, offset, deterministic)
        plan = FORWARD_PLANS.get(key)
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
        keep_plan(FORWARD_PLANS, key, Fp8ForwardPlan(q, k, v, (q_descale, k_descale, v_descale), descale_block_size,
                                                       out_dtype, op_scalars(*op_scalar_args)))
    else:
        keep_forward_plan(key, q, k, v, op_scalar_args)
    return result


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
    if (plain_call(q, k, v, (seqused_k, bias, alibi_slopes, sinks, q_descale, k_descale, v_descale,
                              descale_block_size, out_dtype, seed), return_dropout_mask)
            and type(cu_seqlens_q) is Tensor and type(cu_seqlens_k) is Tensor and type(max_seqlen_q) is int
            and type(max_seqlen_k) is int
            and plain_scalars("bhsd", scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                               deterministic) and plain_eager()):
        key = varlen_plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                               window, mask_align, sink_size, softcap, offset, deterministic)
        plan = FORWARD_PLANS.get(key) if key is not None else None
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
    keep_forward_plan(key, q, k, v, (max_seqlen_q, max_seqlen_k, "bhsd", scale, causal, window, mask_align,
                                      sink_size, softcap, dropout_p, None, offset, deterministic),
                       (cu_seqlens_q, cu_seqlens_k))
    return result


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
    problem = prepare_call(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
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


__all__ = ["attention", "attention_varlen", "explain", "problem_of", "set_dispatcher", "get_dispatcher",
           "use_dispatcher", "DType"]
