"""GPU tests (`pytest -m gpu`, on an H200): every feature at realistic sizes.

The float64 truth is `numerics.torch_attention` in float64 on the GPU (checked against
`fmha.reference` by the CPU tests); the bound is the FlashAttention 2x rule.
"""

import pytest
import torch

import fmha
from fmha import reference
from fmha.ops import call_plans

from attn_testing import check_attention, check_backward, make_qkv, randn

pytestmark = pytest.mark.gpu
CUDA = "cuda"
HALF = [torch.bfloat16, torch.float16]


def qkv(rng, dtype=torch.bfloat16, layout="bhsd", **shape):
    return make_qkv(rng, dtype=dtype, layout=layout, device=CUDA, **shape)


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_realistic(rng, dtype, causal, head_dim):
    q, k, v = qkv(rng, dtype, batch=2, nhead_q=8, nhead_k=8, seqlen_q=2048, seqlen_k=2048,
                  head_dim=head_dim)
    check_attention(q, k, v, causal=causal, truth="torch64")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_planned_calls_match_the_truth(rng, dtype, layout, causal, head_dim):
    """Repeated calls take the api's call plans and the launchers' plans, launched through
    Triton's C launcher directly (kernels/launch_cache.py): the forward and the eager backward of
    a second call with new inputs of the same metadata, against the float64 truth."""
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.gluon import fwd as fwd_gluon

    for _ in range(2):  # the first call of each makes the plans, the second runs them
        q, k, v = qkv(rng, dtype, layout=layout, batch=2, nhead_q=8, nhead_k=2, seqlen_q=1024, seqlen_k=1024,
                      head_dim=head_dim)
        with torch.no_grad():
            check_attention(q, k, v, layout=layout, causal=causal, truth="torch64")
        check_backward(q, k, v, layout=layout, causal=causal, truth="torch64")
    (planned,) = call_plans.FORWARD_PLANS.values()
    assert len(planned.backward_plans) == 1  # (autograd calls: _PlannedAttention, the plan's backward)
    assert planned.launched is not None and planned.launched.plan.direct is not None
    assert all(p.plan.direct is not None for p in (*fwd_gluon._PLANS.values(), *bwd_gluon._PLANS.values()))


@pytest.mark.parametrize("seqlen", [8192, 16384])
def test_forward_long_sequences(rng, seqlen):
    q, k, v = qkv(rng, torch.bfloat16, batch=1, nhead_q=2, nhead_k=1, seqlen_q=seqlen,
                  seqlen_k=seqlen, head_dim=128)
    check_attention(q, k, v, causal=True, truth="torch64")


@pytest.mark.parametrize("head_dim", [1, 40, 72, 80, 88, 96, 200])
def test_forward_all_head_dims(rng, head_dim):
    q, k, v = qkv(rng, torch.float16, batch=2, nhead_q=4, nhead_k=2, seqlen_q=1023, seqlen_k=1023,
                  head_dim=head_dim)
    check_attention(q, k, v, truth="torch64")


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 3131), (3, 799), (33, 1023), (113, 339),
                                               (339, 113), (799, 3), (3131, 33)])
@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
def test_ck_matrix_shapes(rng, seqlen_q, seqlen_k, mask_align):
    q, k, v = qkv(rng, torch.bfloat16, layout="bshd", batch=2, nhead_q=7, nhead_k=1,
                  seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=72)
    check_attention(q, k, v, layout="bshd", causal=True, mask_align=mask_align, truth="torch64")


def test_mqa_64_to_1(rng):
    q, k, v = qkv(rng, torch.bfloat16, batch=1, nhead_q=64, nhead_k=1, seqlen_q=512, seqlen_k=2048,
                  head_dim=128)
    check_attention(q, k, v, causal=True, truth="torch64")


def test_forward_feature_mix(rng):
    B, Hq, Hk, S = 2, 8, 2, 2048
    q, k, v = qkv(rng, torch.bfloat16, layout="bshd", batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=S,
                  seqlen_k=S, head_dim=128)
    check_attention(q, k, v, layout="bshd", window=(256, 0), sink_size=4,
                    bias=randn((1, Hq, S, S), torch.bfloat16, rng, CUDA),
                    alibi_slopes=torch.rand(Hq, device=CUDA) * 0.1, softcap=30.0,
                    sinks=randn((Hq,), torch.float32, rng, CUDA), dropout_p=0.1, seed=11,
                    truth="torch64")


@pytest.mark.parametrize("feature", ["window", "bias", "alibi", "softcap", "sinks", "dropout"])
def test_each_forward_feature(rng, feature):
    B, H, S = 2, 8, 2048
    q, k, v = qkv(rng, torch.float16, batch=B, nhead_q=H, nhead_k=H, seqlen_q=S, seqlen_k=S,
                  head_dim=128)
    kw = {"window": dict(window=(256, 256)), "bias": dict(bias=randn((B, 1, S, S), torch.float32, rng, CUDA)),
          "alibi": dict(alibi_slopes=torch.rand(B, H, device=CUDA) * 0.1, causal=True),
          "softcap": dict(softcap=20.0), "sinks": dict(sinks=randn((H,), torch.float32, rng, CUDA)),
          "dropout": dict(dropout_p=0.1, seed=5)}[feature]
    check_attention(q, k, v, truth="torch64", **kw)


def test_varlen_forward_and_backward(rng):
    lens_q, lens_k = [1, 0, 777, 2048, 33], [9, 5, 1000, 2048, 0]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=CUDA)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=CUDA)
    q = randn((sum(lens_q), 8, 128), torch.bfloat16, rng, CUDA).requires_grad_()
    k = randn((sum(lens_k), 2, 128), torch.bfloat16, rng, CUDA).requires_grad_()
    v = randn((sum(lens_k), 2, 128), torch.bfloat16, rng, CUDA).requires_grad_()
    o = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    do = randn(o.shape, torch.bfloat16, rng, CUDA)
    o.backward(do)
    ref = reference.attention_varlen_bwd(*(t.detach().double().cpu().numpy() for t in (q, k, v, do)),
                                         cu_q.cpu().numpy(), cu_k.cpu().numpy(), causal=True)
    ref_o, _ = reference.attention_varlen_fwd(*(t.detach().double().cpu().numpy() for t in (q, k, v)),
                                              cu_q.cpu().numpy(), cu_k.cpu().numpy(), causal=True)
    assert (o.double().cpu() - torch.from_numpy(ref_o)).abs().max() < 2e-2
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        rel = reference.relative_error(t.grad.double().cpu().numpy(), ref[name])
        assert rel < 1e-2, (name, rel)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_realistic(rng, dtype, causal, head_dim, deterministic):
    q, k, v = qkv(rng, dtype, batch=2, nhead_q=4, nhead_k=2, seqlen_q=1024, seqlen_k=1024,
                  head_dim=head_dim)
    check_backward(q, k, v, causal=causal, deterministic=deterministic, truth="torch64")


def test_backward_feature_mix(rng):
    B, Hq, Hk, S = 2, 4, 2, 1024
    q, k, v = qkv(rng, torch.bfloat16, layout="bshd", batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=S,
                  seqlen_k=S, head_dim=128, head_dim_v=64)
    check_backward(q, k, v, layout="bshd", window=(200, 0), sink_size=4,
                   bias=randn((1, Hq, S, S), torch.float32, rng, CUDA),
                   alibi_slopes=torch.rand(Hq, device=CUDA) * 0.1, softcap=30.0,
                   sinks=randn((Hq,), torch.float32, rng, CUDA), dropout_p=0.1, seed=3,
                   with_dlse=True, truth="torch64")


def test_backward_fp32(rng):
    q, k, v = qkv(rng, torch.float32, batch=1, nhead_q=4, nhead_k=4, seqlen_q=1000, seqlen_k=1100,
                  head_dim=96)
    check_backward(q, k, v, causal=True, truth="torch64")


def test_deterministic_backward_bitwise_over_five_runs(rng):
    q, k, v = qkv(rng, torch.bfloat16, batch=2, nhead_q=16, nhead_k=4, seqlen_q=2048, seqlen_k=2048,
                  head_dim=128)
    do = randn((2, 16, 2048, 128), torch.bfloat16, rng, CUDA)
    runs = []
    for _ in range(5):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fmha.attention(qq, kk, vv, causal=True, deterministic=True).backward(do)
        runs.append([t.grad.clone() for t in (qq, kk, vv)])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


def test_peak_memory_has_no_seqlen_squared_term(rng):
    S = 32768
    q, k, v = qkv(rng, torch.bfloat16, batch=1, nhead_q=8, nhead_k=8, seqlen_q=S, seqlen_k=S,
                  head_dim=128)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = fmha.attention(q, k, v, causal=True)
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    tensor_bytes = q.numel() * q.element_size()
    # o, do, dq, dk, dv, fp32 dq accumulator, lse, delta: ~10 tensors of q's size; S*S would be 16 GB.
    assert extra < 12 * tensor_bytes, extra / tensor_bytes


def _gather_cache(cache, block_table, lengths):
    """Per batch, the first lengths[b] tokens of a paged cache as (1, Hk, L, D)."""
    page = cache.shape[1]
    out = []
    for b, n in enumerate(lengths):
        pages = block_table[b, : -(-n // page)].long()
        out.append(cache[pages].reshape(-1, *cache.shape[2:])[:n].transpose(0, 1)[None])
    return out


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("nhead_q,head_dim", [(32, 128), (64, 64), (32, 256)])
def test_paged_decode_at_serving_sizes(rng, page_size, nhead_q, head_dim):
    B, Hk, cap = 8, 8, 8192
    pages_per_seq = cap // page_size
    num_pages = B * pages_per_seq
    kc = randn((num_pages, page_size, Hk, head_dim), torch.bfloat16, rng, CUDA)
    vc = randn((num_pages, page_size, Hk, head_dim), torch.bfloat16, rng, CUDA)
    bt = torch.randperm(num_pages, device=CUDA).reshape(B, pages_per_seq).int()
    lengths, seqlens, q, kn, vn = _decode_step(rng, B, nhead_q, Hk, head_dim)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, block_table=bt,
                                         causal=True, return_lse=True)
    ks = _gather_cache(kc, bt, [n + 1 for n in lengths])
    vs = _gather_cache(vc, bt, [n + 1 for n in lengths])
    _assert_decode_matches_truth(q, o, lse, ks, vs)


@pytest.mark.parametrize("nhead_q,head_dim", [(32, 128), (64, 64), (32, 64), (32, 256)])
def test_contiguous_decode_at_serving_sizes(rng, nhead_q, head_dim):
    """A decode step (append k/v at cache_seqlens, causal) over a contiguous 16-bit cache at every head dim's
    own tile (D=64: 128-key tiles, D=128: 64 keys, D=256: 32), sequences of 1 to 8191 keys, against the
    float64 truth per sequence."""
    B, Hk, cap = 8, 8, 8192
    kc = randn((B, cap, Hk, head_dim), torch.bfloat16, rng, CUDA)
    vc = randn((B, cap, Hk, head_dim), torch.bfloat16, rng, CUDA)
    lengths, seqlens, q, kn, vn = _decode_step(rng, B, nhead_q, Hk, head_dim)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, causal=True,
                                         return_lse=True)
    ks = [kc[b, :n + 1].transpose(0, 1)[None] for b, n in enumerate(lengths)]
    vs = [vc[b, :n + 1].transpose(0, 1)[None] for b, n in enumerate(lengths)]
    _assert_decode_matches_truth(q, o, lse, ks, vs)


def _decode_step(rng, batch, nhead_q, nhead_k, head_dim):
    """(lengths, cache_seqlens, q, new k, new v) of one decode step of `batch` <= 8 sequences, 1 to 8191 keys
    before it."""
    lengths = [1, 100, 1000, 4097, 8191, 8000, 2048, 777][:batch]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=CUDA)
    q = randn((batch, 1, nhead_q, head_dim), torch.bfloat16, rng, CUDA)
    kn = randn((batch, 1, nhead_k, head_dim), torch.bfloat16, rng, CUDA)
    vn = randn((batch, 1, nhead_k, head_dim), torch.bfloat16, rng, CUDA)
    return lengths, seqlens, q, kn, vn


def _assert_decode_matches_truth(q, o, lse, ks, vs):
    """Each sequence b's decode output and LSE against the float64 truth over keys ks[b], vs[b] ((1, Hk, L, D),
    the cache after the append), with the bound of a same-dtype baseline."""
    from fmha.testing import numerics
    for b in range(q.shape[0]):
        qb = q[b:b + 1].transpose(1, 2)
        ref_o, ref_lse = numerics.torch_attention(qb, ks[b], vs[b], compute_dtype=torch.float64, causal=True)
        base_o, base_lse = numerics.torch_attention(qb, ks[b], vs[b], causal=True)
        c = numerics.compare("o", o[b:b + 1].transpose(1, 2), ref_o, base_o, torch.bfloat16)
        assert c.ok, (b, str(c))
        c = numerics.compare("lse", lse[b:b + 1], ref_lse, base_lse, torch.float32)
        assert c.ok, (b, str(c))


def test_decode_step_captured_in_a_cuda_graph(rng):
    B, Hq, Hk, D, page, pages = 4, 32, 8, 128, 16, 64
    kc = randn((B * pages, page, Hk, D), torch.bfloat16, rng, CUDA)
    vc = randn((B * pages, page, Hk, D), torch.bfloat16, rng, CUDA)
    bt = torch.arange(B * pages, device=CUDA, dtype=torch.int32).reshape(B, pages)
    seqlens = torch.tensor([5, 300, 17, 900], dtype=torch.int32, device=CUDA)
    q = randn((B, 1, Hq, D), torch.bfloat16, rng, CUDA)
    kn, vn = randn((B, 1, Hk, D), torch.bfloat16, rng, CUDA), randn((B, 1, Hk, D), torch.bfloat16, rng, CUDA)

    def step():
        return fmha.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, block_table=bt,
                                           causal=True, num_splits=4)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lengths in ([6, 301, 18, 901], [100, 7, 1000, 0]):
        seqlens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


def test_launch_cache_separates_alignments_and_matches_the_jit(rng):
    """A cached launch of a kernel with an argument of other alignment gets its own compiled
    kernel (the JIT specializes on 16-byte alignment), and every launch computes what the
    JIT's own call computes."""
    from fmha.kernels.launch import cache as launch_cache
    from fmha.kernels.triton import bwd

    base = torch.randn(4 * 1000 * 64 + 1, device=CUDA)
    for offset in (0, 1, 0, 1):  # aligned, 4 bytes off, then both again (cache hits)
        acc = base[offset:offset + 4 * 1000 * 64].view(4, 1000, 64)
        dq = torch.empty(4, 1000, 64, device=CUDA, dtype=torch.bfloat16)
        before = len(launch_cache._CACHE)
        bwd.launch_convert_dq(acc, dq, scale=0.5, block_m=64, num_warps=4)
        assert torch.equal(dq, (acc * 0.5).to(torch.bfloat16))
        if offset == 1 and before:  # the misaligned view never reuses the aligned kernel
            keys = [k for k in launch_cache._CACHE if k[0] == id(bwd.convert_dq_kernel)]
            assert len({k[2][0] for k in keys}) == 2, keys
