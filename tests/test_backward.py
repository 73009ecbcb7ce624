"""Backward kernels through Triton's interpreter against the float64 reference."""

import pytest
import torch

import fmha
from fmha.ops import attention as attention_ops

from attn_testing import check_backward, make_qkv, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_match_reference(rng, dtype, deterministic):
    q, k, v = make_qkv(rng, batch=2, nhead_q=2, nhead_k=2, seqlen_q=40, seqlen_k=53,
                       head_dim=32, dtype=dtype)
    check_backward(q, k, v, deterministic=deterministic)


@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 70), (70, 40)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_causal_gradients_both_alignments(rng, mask_align, seqlen_q, seqlen_k, layout):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=32, dtype=torch.float16, layout=layout)
    check_backward(q, k, v, layout=layout, causal=True, mask_align=mask_align)


@pytest.mark.parametrize("window,sink_size", [((6, 2), 0), ((5, 0), 3), ((-1, 4), 2)])
def test_window_and_sink_token_gradients(rng, window, sink_size):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=45, seqlen_k=60,
                       head_dim=32, dtype=torch.float16)
    check_backward(q, k, v, window=window, sink_size=sink_size)


@pytest.mark.parametrize("bias_shape", ["full", "1h1k", "b1qk", "qk"])
def test_bias_gradient_is_reduced_over_broadcast_dims(rng, bias_shape):
    B, H, Sq, Sk = 2, 2, 21, 38
    q, k, v = make_qkv(rng, batch=B, nhead_q=H, nhead_k=H, seqlen_q=Sq, seqlen_k=Sk,
                       head_dim=32, dtype=torch.float32)
    shape = {"full": (B, H, Sq, Sk), "1h1k": (1, H, 1, Sk), "b1qk": (B, 1, Sq, Sk), "qk": (Sq, Sk)}
    grads = check_backward(q, k, v, bias=randn(shape[bias_shape], torch.float32, rng), causal=True)
    assert grads["dbias"].shape == shape[bias_shape]


@pytest.mark.parametrize("dtype,with_sinks", [(torch.float16, False), (torch.float16, True), (torch.float32, True)])
def test_alibi_softcap_sinks_gqa_and_dlse(rng, dtype, with_sinks):
    q, k, v = make_qkv(rng, batch=2, nhead_q=4, nhead_k=2, seqlen_q=33, seqlen_k=47,
                       head_dim=40, head_dim_v=24, dtype=dtype)
    sinks = randn((4,), torch.float32, rng) if with_sinks else None
    check_backward(q, k, v, alibi_slopes=torch.rand(4, generator=rng) * 0.3, softcap=3.0,
                   sinks=sinks, causal=True, with_dlse=True)


@pytest.mark.parametrize("nhead_q,nhead_k", [(7, 1), (6, 3)])
def test_gqa_gradients_sum_over_query_heads(rng, nhead_q, nhead_k):
    q, k, v = make_qkv(rng, batch=1, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=24, seqlen_k=33,
                       head_dim=16, dtype=torch.float16)
    check_backward(q, k, v)


@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_gradients_replay_the_forward_mask(rng, deterministic):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=37, seqlen_k=41,
                       head_dim=32, dtype=torch.float32)
    check_backward(q, k, v, dropout_p=0.3, seed=77, offset=3, deterministic=deterministic)


@pytest.mark.parametrize("head_dim,head_dim_v", [(1, 1), (200, 96), (256, 256)])
def test_gradients_for_odd_and_large_head_dims(rng, head_dim, head_dim_v):
    q, k, v = make_qkv(rng, batch=1, nhead_q=1, nhead_k=1, seqlen_q=17, seqlen_k=20,
                       head_dim=head_dim, head_dim_v=head_dim_v, dtype=torch.float32)
    check_backward(q, k, v, causal=True)


def test_deterministic_backward_is_bitwise_reproducible(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=4, nhead_k=1, seqlen_q=40, seqlen_k=40,
                       head_dim=16, dtype=torch.float16)
    runs = []
    for _ in range(3):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = fmha.attention(qq, kk, vv, causal=True, deterministic=True)
        o.backward(torch.ones_like(o))
        runs.append(torch.cat([t.grad.flatten() for t in (qq, kk, vv)]))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_gradients(rng, deterministic):
    from fmha import reference
    lens_q, lens_k = [5, 0, 30, 12], [9, 3, 30, 0]
    cu_q = torch.tensor([0, 5, 5, 35, 47], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 42, 42], dtype=torch.int32)
    seqused = torch.tensor([7, 3, 25, 0], dtype=torch.int32)
    q = randn((47, 4, 32), torch.float32, rng).requires_grad_()
    k = randn((42, 2, 32), torch.float32, rng).requires_grad_()
    v = randn((42, 2, 32), torch.float32, rng).requires_grad_()
    sinks = randn((4,), torch.float32, rng).requires_grad_()
    o = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused,
                              causal=True, sinks=sinks, deterministic=deterministic)
    do = randn(o.shape, torch.float32, rng)
    o.backward(do)
    ref = reference.attention_varlen_bwd(
        q.detach().double().numpy(), k.detach().double().numpy(), v.detach().double().numpy(),
        do.double().numpy(), cu_q.numpy(), cu_k.numpy(), seqused_k=seqused.numpy(), causal=True,
        sinks=sinks.detach().double().numpy())
    for name, t in (("dq", q), ("dk", k), ("dv", v), ("dsinks", sinks)):
        err = (t.grad.double() - torch.from_numpy(ref[name])).abs().max().item()
        assert err < 1e-4, (name, err)


def test_gradcheck_in_fp64_through_the_interpreter():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(1, 2, 9, 12, dtype=torch.float64, generator=g, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)
    for deterministic in (False, True):
        def f(q, k, v, bias, sinks, deterministic=deterministic):
            return fmha.attention(q, k, v, causal=True, softcap=2.0, bias=bias, sinks=sinks,
                                  window=(5, 0), sink_size=1, return_lse=True,
                                  deterministic=deterministic)
        assert torch.autograd.gradcheck(f, (q, k, v, bias, sinks), fast_mode=True)


def test_torch_compile_fullgraph_transformer_block(rng):
    class Block(torch.nn.Module):
        def __init__(self, dim=32, heads=2):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.out = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            o = fmha.attention(q, k, v, layout="bshd", causal=True)
            return x + self.out(o.reshape(b, s, d))

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 24, 32, generator=rng, requires_grad=True)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert torch.allclose(out, eager, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_fake_implementations_give_real_shapes(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = make_qkv(rng, batch=2, nhead_q=4, nhead_k=2, seqlen_q=5, seqlen_k=7, head_dim=16,
                       head_dim_v=8, dtype=torch.float16, layout="bshd")
    real_o, real_lse = fmha.attention(q, k, v, layout="bshd", return_lse=True)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake_o, fake_lse = fmha.attention(fq, fk, fv, layout="bshd", return_lse=True)
    assert fake_o.shape == real_o.shape and fake_lse.shape == real_lse.shape


def test_exact_delta_pass_only_when_bias_or_sinks_need_grad(rng):
    """dbias/dsinks need delta = rowsum(P * dP) (stage 1 is the dQ kernel in its delta mode);
    without their gradients the plan and the results are the plain ones."""
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=20, seqlen_k=27, head_dim=16,
                       dtype=torch.float16)
    sinks, bias = randn((2,), torch.float32, rng), randn((20, 27), torch.float32, rng)
    problem = fmha.problem_of(q, k, v, sinks=sinks, bias=bias)
    dispatcher = fmha.get_dispatcher()
    plain, exact = dispatcher.plan_backward(problem), dispatcher.plan_backward(problem, exact_delta=True)
    assert [launch.family for launch in plain.launches][0] == fmha.Family.BWD_DOT_DO_O
    assert exact.launches[0].family == fmha.Family.BWD_DQ and "rowsum(P * dP)" in exact.launches[0].why
    assert exact.launches[1:] == plain.launches[1:]
    assert "rowsum(P * dP)" in fmha.explain(q, k, v, sinks=sinks.clone().requires_grad_(), bias=bias)
    assert "rowsum(P * dP)" not in fmha.explain(q.clone().requires_grad_(), k, v, sinks=sinks, bias=bias)

    qq = q.clone().requires_grad_()
    o = fmha.attention(qq, k, v, sinks=sinks, bias=bias)  # neither needs grad: dot_do_o
    do = randn(o.shape, torch.float16, rng)
    (dq_plain,) = torch.autograd.grad(o, qq, do)
    s2, b2 = sinks.clone().requires_grad_(), bias.clone().requires_grad_()
    o = fmha.attention(qq, k, v, sinks=s2, bias=b2)
    dq_exact, dsinks, dbias = torch.autograd.grad(o, (qq, s2, b2), do)
    assert dsinks.shape == sinks.shape and dbias.shape == bias.shape
    assert (dq_plain.float() - dq_exact.float()).abs().max() < 2e-3  # same dq up to fp16 rounding


@pytest.mark.parametrize("dtype, kw", [(torch.float16, dict(dropout_p=0.3, seed=169130250)),
                                       (torch.float32, dict(scale=1.0)),
                                       (torch.float16, dict(causal=True, mask_align="top_left"))])
def test_a_single_key_gives_exactly_zero_dq_and_dk(rng, dtype, kw):
    """Softmax over one key: dS is exactly 0, so dq = dk = 0 exactly. The kernels' dP and
    delta (two summation orders, O rounded) left noise there: `fmha stress` on the GPU (fp16
    dropout, 2.3e-3 vs a 2e-4 bound) and the property test (fp32, 2.4e-5 vs 2e-5) found it."""
    q, k, v = make_qkv(rng, batch=4, nhead_q=2, nhead_k=1, seqlen_q=25, seqlen_k=1, head_dim=64,
                       dtype=dtype)
    grads = check_backward(q, k, v, **kw)
    assert not grads["dq"].any() and not grads["dk"].any()
    assert grads["dv"].abs().max() > 0


def test_a_single_key_with_dlse_or_sinks_keeps_its_gradients(rng):
    """With a gradient into the LSE or a sink logit, dS is not 0 for one key: computed as usual."""
    q, k, v = make_qkv(rng, batch=2, nhead_q=2, nhead_k=2, seqlen_q=9, seqlen_k=1, head_dim=16,
                       dtype=torch.float32)
    grads = check_backward(q, k, v, with_dlse=True)
    assert grads["dq"].abs().max() > 0
    grads = check_backward(q, k, v, sinks=torch.randn(2, generator=rng))
    assert grads["dq"].abs().max() > 0


def test_gradients_through_lse_alone(rng):
    """Only the returned LSE is used: o's gradient is None (not materialized) and lse.sum()'s
    gradient is an expanded, stride-0 view, which the kernels used to read with lse's strides
    (past its one element: garbage gradients, ~1e17). The gradients match float64 autograd."""
    from fmha.testing import numerics
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=13, seqlen_k=19, head_dim=16,
                       dtype=torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _, lse = fmha.attention(*leaves, causal=True, return_lse=True)
    ours = torch.autograd.grad(lse.sum(), leaves[:2])
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, ref_lse = numerics.torch_attention(*ref_leaves, causal=True)
    ref = torch.autograd.grad(ref_lse.sum(), ref_leaves[:2])
    for a, b in zip(ours, ref, strict=True):
        assert torch.allclose(a.double(), b, atol=1e-5), float((a.double() - b).abs().max())


def test_dot_do_o_zeroes_the_dq_accumulator(rng):
    """Stage 1 of the atomic backward zeroes the fp32 dQ accumulator (no fill kernel of its own):
    every row and head-dim column of it (q's head dim, here wider than v's), with delta still
    rowsum(dO * O). The accumulator starts as NaN, so a row left out shows."""
    from fmha.kernels.launch.loader import family_module

    bwd = family_module("triton.bwd", interpreted=True)
    b, h, s, dqk, dv = 2, 3, 37, 40, 24  # 37 rows: a partial last block of 16
    o, do = randn((b, h, s, dv), torch.float16, rng), randn((b, h, s, dv), torch.float16, rng)
    lse, delta = randn((b, h, s), torch.float32, rng), torch.full((b, h, s), float("nan"))
    dq_acc = torch.full((b, s, h, dqk), float("nan")).transpose(1, 2)  # a bshd buffer in the kernels' view
    bwd.launch_dot_do_o(o, do, lse, delta, dq_acc, batch=b, max_seqlen_q=s, block_m=16, num_warps=4, num_stages=1)
    assert not dq_acc.isnan().any() and not dq_acc.any()
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), atol=1e-3, rtol=1e-3)


def test_backward_gradients_with_an_unzeroed_dq_accumulator(rng, monkeypatch):
    """The dense atomic backward allocates its dQ accumulator without zeroing it (stage 1 does):
    with that buffer filled with NaN first, the gradients still match the reference."""
    original = attention_ops.dq_accumulator

    def poisoned(*args):
        acc, zeroed = original(*args)
        if not zeroed:
            acc.fill_(float("nan"))
        return acc, zeroed

    monkeypatch.setattr(attention_ops, "dq_accumulator", poisoned)
    for layout in ("bhsd", "bshd"):
        q, k, v = make_qkv(rng, batch=2, nhead_q=4, nhead_k=2, seqlen_q=37, seqlen_k=45, head_dim=32,
                           dtype=torch.float16, layout=layout)
        grads = check_backward(q, k, v, layout=layout, causal=True)
        assert not grads["dq"].isnan().any()
