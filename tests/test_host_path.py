"""The host path of a call: plain eager calls that autograd does not need skip torch's
custom-op dispatch (attention_ops.direct_op); every other call still goes through the registered op."""

import inspect

import pytest
import torch

import fmha
from fmha import api
from fmha.dispatch.configs import Family
from fmha.dispatch.dispatcher import Dispatcher
from fmha.dispatch.registry import default_registry
from fmha.ops import attention as attention_ops
from fmha.ops import prepare
from fmha.problem import DType, Problem

from attn_testing import SeenOps, make_qkv


def _qkv(rng, requires_grad=False):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=9, seqlen_k=12, head_dim=16,
                       dtype=torch.float32)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_no_grad_eager_call_runs_the_body_directly(rng):
    q, k, v = _qkv(rng)
    assert attention_ops.direct_op(attention_ops.fwd_op, (q, k, v)) is attention_ops.fwd_op._init_fn
    direct = fmha.attention(q, k, v, causal=True)
    through_op = attention_ops.fwd_op(q, k, v, None, None, None, None, None, None, 0, 0, "bhsd", None, True, -1, 0,
                             "bottom_right", 0, 0.0, 0.0, 0, 0, False)[0]
    assert torch.equal(direct, through_op)


def test_calls_autograd_needs_keep_the_op_or_take_the_eager_function(rng):
    q, k, v = _qkv(rng, requires_grad=True)
    ops = attention_ops
    assert ops.direct_op(ops.fwd_op, (q, k, v)) is ops.fwd_op
    assert ops.direct_op(ops.fwd_op, (q, k, v), autograd=ops.EagerAttention) == ops.EagerAttention.apply
    with torch.no_grad():
        assert ops.direct_op(ops.fwd_op, (q, k, v), autograd=ops.EagerAttention) is ops.fwd_op._init_fn
    o = fmha.attention(q, k, v, causal=True)
    assert type(o.grad_fn).__name__ == "EagerAttentionBackward"
    o.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_eager_autograd_function_matches_the_registered_op(rng):
    """The same forward and gradients (dq, dk, dv, and the LSE's) as through the custom op's
    registered autograd, bit for bit: both run the same body and backward."""
    scalars = (0, 0, "bhsd", 0.3, True, -1, 0, "bottom_right", 0, 0.0, 0.0, 0, 0, False)
    q, k, v = _qkv(rng, requires_grad=True)
    do, dlse = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9)
    results = []
    for fn in (attention_ops.fwd_op, attention_ops.EagerAttention.apply):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = fn(*leaves, None, None, None, None, None, None, *scalars)
        results.append((o, lse, *torch.autograd.grad((o, lse), leaves, (do, dlse))))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_dispatch_modes_and_torch_function_modes_see_the_op(rng):
    q, k, v = _qkv(rng)
    with SeenOps() as mode:
        fmha.attention(q, k, v)
    assert any("fmha.fwd" in op for op in mode.ops), mode.ops
    with torch.device("cpu"):  # a torch-function mode
        assert attention_ops.direct_op(attention_ops.fwd_op, (q, k, v)) is attention_ops.fwd_op


def test_torch_compile_of_an_inference_call_keeps_the_op_in_the_graph(rng):
    q, k, v = _qkv(rng)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    compiled = torch.compile(lambda q, k, v: fmha.attention(q, k, v, causal=True), backend=backend, fullgraph=True)
    assert torch.allclose(compiled(q, k, v), fmha.attention(q, k, v, causal=True))
    assert any("fmha.fwd" in target for target in seen), seen


def test_op_arguments_reach_prepare_in_its_own_order():
    """_prepare_op passes an op's flattened arguments positionally."""
    assert tuple(inspect.signature(prepare.prepare_call).parameters)[3:] == prepare.OP_ARGS
    assert tuple(inspect.signature(attention_ops.fwd_op._init_fn).parameters)[3:] == prepare.OP_ARGS


def _grads(fn, leaves, do, dlse, kw):
    o, lse = fn(*leaves, **kw)
    return (o, lse, *torch.autograd.grad((o, lse), leaves, (do, dlse)))


@pytest.mark.parametrize("case", ["bshd_views", "column_major_v", "gqa_dbias_dsinks", "varlen"])
def test_eager_backward_reuses_the_forward_and_matches_the_op(rng, case):
    """The eager backward takes the forward's Problem from its context instead of validating
    again, allocates the gradients with *_like and skips the unwanted placeholders: the same
    values, shapes and strides as the backward of the registered op (which prepares again),
    bit for bit, for strided and column-major inputs, GQA with dbias/dsinks, and varlen."""
    B, H, Hk, S, D = 2, 4, 2, 12, 16
    extra, names = {}, ["q", "k", "v"]
    if case == "varlen":
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k, v = (torch.randn(12, h, D, generator=rng) for h in (H, Hk, Hk))
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
        layout = "bhsd"
    else:
        layout = "bshd" if case == "bshd_views" else "bhsd"
        q = torch.randn(B, H, S, D, generator=rng)
        k, v = (torch.randn(B, Hk, S, D, generator=rng) for _ in range(2))
        if case == "bshd_views":  # transposed (non-contiguous) views in the bshd layout
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        elif case == "column_major_v":
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
        else:
            extra = dict(bias=torch.randn(1, H, S, S, generator=rng), sinks=torch.randn(H, generator=rng))
            names += ["bias", "sinks"]
    scalars = dict(max_seqlen_q=extra.pop("max_seqlen_q", 0), max_seqlen_k=extra.pop("max_seqlen_k", 0),
                   layout=layout, scale=None, causal=True, window_left=-1, window_right=0,
                   mask_align="bottom_right", sink_size=0, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
                   deterministic=False)
    inputs = dict(q=q, k=k, v=v, bias=None, alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, seqused_k=None, **scalars)
    inputs.update(extra)

    def call(fn, leaves):
        args = {**inputs, **dict(zip(names, leaves, strict=True))}
        return fn(*(args[n] for n in ("q", "k", "v", *prepare.OP_ARGS)))

    o, lse = call(attention_ops.fwd_op, [inputs[n] for n in names])
    do, dlse = torch.randn(o.shape, generator=rng), torch.randn(lse.shape, generator=rng)
    results = []
    for fn in (attention_ops.EagerAttention.apply, attention_ops.fwd_op):
        leaves = [inputs[n].detach().clone().requires_grad_() for n in names]
        if case == "bshd_views":  # keep the transposed strides
            leaves = [inputs[n].detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_() for n in names]
        o, lse = call(fn, leaves)
        results.append((o, lse, *torch.autograd.grad((o, lse), leaves, (do, dlse))))
    assert type(results[0][0].grad_fn).__name__ == "EagerAttentionBackward"
    assert results[0][0].grad_fn.fmha_forward[0].varlen == (case == "varlen")  # (the kept Problem)
    for eager, op in zip(*results, strict=True):
        assert torch.equal(eager, op) and eager.stride() == op.stride() and eager.dtype == op.dtype
    for grad, leaf in zip(results[0][2:], names, strict=True):
        assert grad.shape == inputs[leaf].shape and grad.is_contiguous()


def test_backward_launches_are_cached_per_problem_and_follow_the_dispatcher():
    problem = Problem(batch=1, nhead_q=2, nhead_k=2, seqlen_q=8, seqlen_k=8, head_dim_qk=16, head_dim_v=16,
                      dtype=DType.FP32)
    first = attention_ops.backward_launches(problem, False)
    assert attention_ops.backward_launches(problem, False) is first
    plan = api.get_dispatcher().plan_backward(problem)
    assert first.stage1 == prepare.algo_kwargs(plan.config(Family.BWD_DOT_DO_O)) and first.dq is None
    assert first.dkdv == plan.config(Family.BWD_DQ_DK_DV)
    assert first.convert == prepare.algo_kwargs(plan.config(Family.BWD_CONVERT_DQ))
    exact = api.get_dispatcher().plan_backward(problem, exact_delta=True)
    assert attention_ops.backward_launches(problem, True).stage1 == prepare.algo_kwargs(exact.config(Family.BWD_DQ))
    deterministic = attention_ops.backward_launches(problem.with_(deterministic=True), False)
    assert deterministic.convert is None and deterministic.dq is not None

    class Counting(Dispatcher):
        calls = 0

        def plan_backward(self, problem, *, exact_delta=False):
            Counting.calls += 1
            return super().plan_backward(problem, exact_delta=exact_delta)

    with api.use_dispatcher(Counting(default_registry())):  # a new dispatcher: planned again
        attention_ops.backward_launches(problem, False)
        attention_ops.backward_launches(problem, False)
        assert Counting.calls == 1
    assert attention_ops.backward_launches(problem, False) is not first  # and again after it


def test_eager_backward_refuses_inputs_changed_since_the_forward(rng):
    """What lets the eager backward reuse the forward's Problem: autograd refuses saved inputs
    changed in place (shape and stride changes included) before the backward runs."""
    leaf = torch.randn(1, 2, 8, 16, generator=rng, requires_grad=True)
    changes = (lambda t: t.mul_(2), lambda t: t.transpose_(2, 3),
               lambda t: t.as_strided_((1, 2, 8, 16), (256, 128, 1, 8)))
    for change in changes:
        q = leaf * 1
        o = fmha.attention(q, q, q, causal=True)
        change(q)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            o.sum().backward()
