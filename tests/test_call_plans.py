"""The api's call plans: a plain `attention` call repeated with inputs of the same metadata and
the same scalars skips validation, description and dispatch (call_plans.ForwardPlan), and a plain
eager backward repeats its three launches' plans (attention_ops.BackwardPlan). A plan must give what
the full path gives, and must never serve a call the full path would refuse. (That planned
launches pass what the launchers build: tests/test_launch_cache.py, which also holds the decode
call plans' tests on the H200 path: CPU tensors never take one, below.)"""

import numpy as np
import pytest
import torch

import fmha
from fmha import api, kvcache, reference
from fmha.kernels.launch import plan_tables
from fmha.ops import call_plans
from fmha.testing.numerics import max_abs_error

from attn_testing import SeenOps, make_qkv, randn


def _qkv(rng, layout="bhsd", requires_grad=False):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=9, seqlen_k=12, head_dim=16,
                       dtype=torch.float32, layout=layout)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _full_path_calls(monkeypatch):
    """Counts the calls that take the full path (api._call)."""
    calls = []
    full = api._call

    def counted(*args, **kwargs):
        calls.append(1)
        return full(*args, **kwargs)

    monkeypatch.setattr(api, "_call", counted)
    return calls


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_repeated_call_takes_its_plan_and_gives_the_full_paths_answer(rng, monkeypatch, layout, return_lse):
    q, k, v = _qkv(rng, layout)
    calls = _full_path_calls(monkeypatch)
    kw = dict(causal=True, layout=layout, scale=0.3, return_lse=return_lse)
    first = fmha.attention(q, k, v, **kw)
    q2, k2, v2 = (t.clone() + 0.5 for t in (q, k, v))  # other tensors, the same metadata
    planned = fmha.attention(q2, k2, v2, **kw)
    assert len(calls) == 1 and len(call_plans.FORWARD_PLANS) == 1
    plan_tables.clear_plans()
    full = fmha.attention(q2, k2, v2, **kw)
    assert len(calls) == 2
    for a, b in zip(planned if return_lse else (planned,), full if return_lse else (full,), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first if not return_lse else first[0], full if not return_lse else full[0])


@pytest.mark.parametrize("kw, bad, error", [
    (dict(causal=True), dict(causal=1), TypeError),  # (1 == True: the key alone would match)
    (dict(scale=1.0), dict(scale=True), ValueError),
    (dict(window=(3, 0)), dict(window=(3, False)), ValueError),
    (dict(deterministic=False), dict(deterministic=0), TypeError),
    (dict(offset=0), dict(offset=False), ValueError),
    (dict(sink_size=0), dict(sink_size=False), ValueError),
])
def test_a_plan_never_serves_a_call_the_full_path_refuses(rng, kw, bad, error):
    q, k, v = _qkv(rng)
    fmha.attention(q, k, v, **kw)
    fmha.attention(q, k, v, **kw)
    assert len(call_plans.FORWARD_PLANS) == 1
    with pytest.raises(error):
        fmha.attention(q, k, v, **bad)


def test_calls_with_optional_tensors_dropout_or_a_seed_take_no_plan(rng):
    q, k, v = _qkv(rng)
    fmha.attention(q, k, v, alibi_slopes=torch.rand(2))
    fmha.attention(q, k, v, dropout_p=0.1)
    fmha.attention(q, k, v, seed=3)
    fmha.attention(q, k, v, sinks=torch.rand(2))
    assert not call_plans.FORWARD_PLANS
    fmha.attention(q, k, v, dropout_p=0.0)
    assert len(call_plans.FORWARD_PLANS) == 1


def test_a_plan_serves_autograd_calls_with_the_same_gradients(rng):
    q, k, v = _qkv(rng)
    with torch.no_grad():
        fmha.attention(q, k, v, causal=True)  # the plan
    assert len(call_plans.FORWARD_PLANS) == 1

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fmha.attention(*leaves, causal=True)
        assert type(o.grad_fn).__name__ in ("PlannedAttentionBackward", "EagerAttentionBackward")
        return (o, *torch.autograd.grad(o, leaves, torch.ones_like(o)))

    planned = grads()
    plan_tables.clear_plans()
    for a, b in zip(planned, grads(), strict=True):
        assert torch.equal(a, b)


def test_dispatch_modes_see_the_op_even_with_a_plan(rng):
    q, k, v = _qkv(rng)
    fmha.attention(q, k, v)
    assert len(call_plans.FORWARD_PLANS) == 1
    with SeenOps() as seen:
        fmha.attention(q, k, v)
    assert any("fmha.fwd" in op or "fmha::fwd" in op for op in seen.ops)


def test_a_dispatcher_change_forgets_the_plans(rng):
    q, k, v = _qkv(rng)
    fmha.attention(q, k, v)
    assert len(call_plans.FORWARD_PLANS) == 1
    with api.use_dispatcher(None):
        assert not call_plans.FORWARD_PLANS


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_on_cpu_tensors_takes_no_call_plan(rng, num_splits):
    """The full path checks CPU tensors' index values on every call (kvcache._reads_values), so
    a decode call on them never takes a call plan: repeated calls match the float64 reference,
    and a bad value is refused after them."""
    batch, hq, hk, d, page, pages = 2, 4, 2, 16, 8, 3
    table = torch.randperm(batch * pages, generator=rng).int().reshape(batch, pages)
    seqlens = torch.tensor([pages * page, 5], dtype=torch.int32)
    for _ in range(2):
        q = randn((batch, 1, hq, d), torch.float32, rng)
        kc, vc = (randn((batch * pages, page, hk, d), torch.float32, rng) for _ in range(2))
        o, lse = fmha.attention_with_kvcache(q, kc, vc, block_table=table, cache_seqlens=seqlens, causal=True,
                                             num_splits=num_splits, return_lse=True)
        ro, rl, _, _ = reference.attention_with_kvcache(
            *(t.double().numpy() for t in (q, kc, vc)), cache_seqlens=seqlens.numpy(), block_table=table.numpy(),
            causal=True)
        assert max_abs_error(o, torch.from_numpy(ro)) < 1e-4 and max_abs_error(lse, torch.from_numpy(rl)) < 1e-4
        assert np.isfinite(rl).all()
    assert not kvcache._DECODE_CALL_PLANS
    with pytest.raises(ValueError, match="capacity"):
        fmha.attention_with_kvcache(q, kc, vc, block_table=table, cache_seqlens=seqlens + pages * page,
                                    causal=True, num_splits=num_splits)


def _packed(rng, lens_q=(5, 0, 9), lens_k=(7, 3, 9), requires_grad=False):
    q, k, v = (randn((sum(n), h, 16), torch.float32, rng).requires_grad_(requires_grad)
               for n, h in ((lens_q, 2), (lens_k, 1), (lens_k, 1)))
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_repeated_varlen_call_takes_its_plan_and_gives_the_full_paths_answer(rng, monkeypatch, return_lse):
    q, k, v, cu_q, cu_k, mq, mk = _packed(rng)
    calls = _full_path_calls(monkeypatch)
    kw = dict(causal=True, scale=0.3, return_lse=return_lse)
    fmha.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, **kw)
    q2, k2, v2 = (t.clone() + 0.5 for t in (q, k, v))  # other tensors, the same metadata and lengths
    planned = fmha.attention_varlen(q2, k2, v2, cu_q.clone(), cu_k.clone(), mq, mk, **kw)
    assert len(calls) == 1 and len(call_plans.FORWARD_PLANS) == 1
    plan_tables.clear_plans()
    full = fmha.attention_varlen(q2, k2, v2, cu_q, cu_k, mq, mk, **kw)
    assert len(calls) == 2
    for a, b in zip(planned if return_lse else (planned,), full if return_lse else (full,), strict=True):
        assert torch.equal(a, b)


def test_a_varlen_plan_serves_autograd_calls_with_the_same_gradients(rng):
    q, k, v, cu_q, cu_k, mq, mk = _packed(rng)
    with torch.no_grad():
        fmha.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True)  # the plan
    assert len(call_plans.FORWARD_PLANS) == 1

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fmha.attention_varlen(*leaves, cu_q, cu_k, mq, mk, causal=True)
        return (type(o.grad_fn).__name__, o, *torch.autograd.grad(o, leaves, torch.ones_like(o)))

    planned = grads()
    plan_tables.clear_plans()
    full = grads()
    assert planned[0] == "PlannedAttentionBackward" and full[0] != planned[0]
    for a, b in zip(planned[1:], full[1:], strict=True):
        assert torch.equal(a, b)


def test_a_varlen_plan_never_serves_other_lengths_or_a_call_the_full_path_refuses(rng, monkeypatch):
    """CPU prefix sums are part of the key (the full path checks their values): other lengths of
    the same metadata take the full path, and bad ones are refused after a planned call."""
    q, k, v, cu_q, cu_k, mq, mk = _packed(rng)
    calls = _full_path_calls(monkeypatch)
    for _ in range(2):
        fmha.attention_varlen(q, k, v, cu_q, cu_k, mq, mk)
    assert len(calls) == 1
    other = torch.tensor([0, 7, 7, 14], dtype=torch.int32)  # the same total, other lengths
    out = fmha.attention_varlen(q, k, v, other, cu_k, mq, mk)
    assert len(calls) == 2
    want, _ = reference.attention_varlen_fwd(*(t.detach().double().numpy() for t in (q, k, v)), other.numpy(),
                                             cu_k.numpy())
    assert max_abs_error(out, torch.from_numpy(want)) < 1e-4
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fmha.attention_varlen(q, k, v, torch.tensor([0, 1, 2, 14], dtype=torch.int32), cu_k, mq, mk)
    with pytest.raises(ValueError, match="non-decreasing"):
        fmha.attention_varlen(q, k, v, torch.tensor([0, 9, 5, 14], dtype=torch.int32), cu_k, mq, mk)
    with pytest.raises(TypeError):
        fmha.attention_varlen(q, k, v, cu_q, cu_k, True, mk)  # (the key's max_seqlen_q is an int)


# ---------------------------------------------------------------------------- float8 call plans


def _fp8_inputs(rng, granularity="head", scale=1.0, layout="bhsd"):
    """Quantized q, k, v (GQA 2:1, an odd key count) and their descales, with the dequantized
    float64 bhsd tensors for the reference."""
    from fp8_testing import quantized

    shapes = ((1, 2, 9, 16), (1, 1, 13, 16), (1, 1, 13, 16))
    if layout == "bshd":
        shapes = tuple((b, s, h, d) for b, h, s, d in shapes)
    return [quantized(randn(shape, torch.float32, rng) * scale, torch.float8_e4m3fn, granularity, 4, layout)
            for shape in shapes]


@pytest.mark.parametrize("granularity", ["tensor", "head", "block", "none"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_repeated_fp8_call_takes_its_plan_with_the_calls_descales(rng, monkeypatch, granularity, layout):
    """A float8 call repeated with inputs and descales of the same metadata takes its plan
    (call_plans.Fp8ForwardPlan) and reads the new call's descale values: its output is the full
    path's for the same inputs, bitwise, and within the fp8 bound of the float64 truth. (Without
    descales: out_dtype left to its default too, the call an unplanned 16-bit plan lookup sees.)"""
    from fp8_testing import bound, check_close

    calls = _full_path_calls(monkeypatch)
    out_dtype = None if granularity == "none" else torch.float32
    kw = dict(causal=True, layout=layout, out_dtype=out_dtype, return_lse=True,
              descale_block_size=4 if granularity == "block" else None)

    def call(inputs):
        (q8, qd, _), (k8, kd, _), (v8, vd, _) = inputs
        if granularity == "none":
            qd = kd = vd = None
        return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)

    call(_fp8_inputs(rng, granularity if granularity != "none" else "tensor", 1.0, layout))
    second = _fp8_inputs(rng, granularity if granularity != "none" else "tensor", 3.0, layout)  # other values
    planned = call(second)
    assert len(calls) == 1 and [type(p).__name__ for p in call_plans.FORWARD_PLANS.values()] == ["Fp8ForwardPlan"]
    plan_tables.clear_plans()
    full = call(second)
    assert len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(planned, full, strict=True))
    (q8, _, qf), (k8, _, kf), (v8, _, vf) = second
    if granularity == "none":
        qf, kf, vf = (t.double() if layout == "bhsd" else t.double().transpose(1, 2) for t in (q8, k8, v8))
    o_ref, lse_ref, o_tol, lse_tol = bound(qf, kf, vf, out_dtype=out_dtype or torch.bfloat16, gpu=False, causal=True)
    check_close("o", planned[0] if layout == "bhsd" else planned[0].transpose(1, 2), o_ref, o_tol)
    check_close("lse", planned[1], lse_ref, lse_tol)


def test_an_fp8_plan_never_serves_a_call_the_full_path_refuses(rng):
    """After a plan exists: a descale with a bad value (CPU tensors: values are checked), one that
    requires grad, or another shape, and float8 inputs that require grad, are refused as by
    the full path; another out_dtype makes a plan of its own."""
    (q8, qd, _), (k8, kd, _), (v8, vd, _) = _fp8_inputs(rng, "head")
    for _ in range(2):
        fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert len(call_plans.FORWARD_PLANS) == 1
    with pytest.raises(ValueError, match="finite and > 0"):
        fmha.attention(q8, k8, v8, q_descale=qd, k_descale=-kd, v_descale=vd)
    with pytest.raises(ValueError, match="finite and > 0"):
        fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd * float("nan"))
    with pytest.raises(NotImplementedError, match="no backward for float8"):
        fmha.attention(q8, k8, v8, q_descale=qd.clone().requires_grad_(), k_descale=kd, v_descale=vd)
    with pytest.raises(NotImplementedError, match="no backward for float8"):
        fmha.attention(q8.clone().requires_grad_(), k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="k_descale has shape"):
        fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd[:, :1].expand(1, 2), v_descale=vd)
    o = fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
    assert o.dtype == torch.float16 and len(call_plans.FORWARD_PLANS) == 2
