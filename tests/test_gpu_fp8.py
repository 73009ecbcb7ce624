"""FP8 forward on the GPU (`pytest -m gpu`, H200): realistic sizes, every feature.

Checked against the float64 truth on the dequantized inputs with the fp8 error bound of
tests/fp8_testing.py (gpu=True: it includes Hopper's reduced-precision fp8 MMA sums).
"""

import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

import fmha
from fmha.api import use_dispatcher
from fmha.fp8 import quantize_fp8
from fmha.kernels.launch import plan_tables
from fmha.kernels.triton import kvcache
from fmha.ops import call_plans
from fmha.testing import numerics

from fp8_testing import quantized, run_and_check, run_and_check_varlen, stored_as

pytestmark = pytest.mark.gpu
CUDA = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape, rng, scale=1.0):
    return (torch.randn(shape, generator=rng) * scale).to(CUDA)


@pytest.mark.parametrize("dtype, causal, head_dim", [
    (E4M3, False, 64), (E4M3, True, 64), (E4M3, False, 128), (E4M3, True, 128), (E4M3, False, 256),
    (E4M3, True, 256), (E5M2, True, 128)])
def test_fp8_forward_realistic(rng, dtype, causal, head_dim):
    q, k, v = (_x((2, 8, 1024, head_dim), rng) for _ in range(3))
    ratio = run_and_check(q, k, v, dtype=dtype, granularity="head", causal=causal, gpu=True)
    print(f"max error / bound = {ratio:.3f}")


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_fp8_descale_granularities(rng, granularity, block_size=100):
    q, k, v = _x((2, 8, 777, 128), rng), _x((2, 2, 1500, 128), rng, 3.0), _x((2, 2, 1500, 128), rng)
    run_and_check(q, k, v, granularity=granularity, block_size=block_size, causal=True, gpu=True)


@pytest.mark.parametrize("case", ["window_sinktokens_softcap_sinks", "alibi_bias_dropout",
                                  "top_left_bshd_gqa_odd_dims_fp16"])
def test_fp8_forward_features(rng, case):
    B, Hq, Hk, Sq, Sk, D, Dv = 2, 8, 2, 600, 1100, 128, 128
    kw, layout, out_dtype = {}, "bhsd", torch.bfloat16
    if case == "window_sinktokens_softcap_sinks":
        kw = dict(window=(256, 32), sink_size=16, softcap=15.0, sinks=_x((Hq,), rng))
    elif case == "alibi_bias_dropout":
        kw = dict(alibi_slopes=torch.rand(B, Hq, generator=rng).to(CUDA), bias=_x((1, Hq, Sq, Sk), rng),
                  dropout_p=0.1, seed=1234, causal=True)
    else:
        kw = dict(causal=True, mask_align="top_left")
        layout = "bshd"
        Hq, Hk, D, Dv = 12, 3, 72, 40
        out_dtype = torch.float16

    def shape(h, s, d):
        return (B, h, s, d) if layout == "bhsd" else (B, s, h, d)

    q, k, v = _x(shape(Hq, Sq, D), rng), _x(shape(Hk, Sk, D), rng), _x(shape(Hk, Sk, Dv), rng)
    run_and_check(q, k, v, granularity="block", block_size=128, layout=layout, out_dtype=out_dtype,
                  gpu=True, **kw)


def test_fp8_varlen(rng):
    seqs_q, seqs_k = [1, 300, 77, 1024], [500, 300, 1, 1300]
    Hq, Hk, D, bs = 8, 2, 128, 128
    q, k, v = _x((sum(seqs_q), Hq, D), rng), _x((sum(seqs_k), Hk, D), rng), _x((sum(seqs_k), Hk, D), rng)
    run_and_check_varlen(q, k, v, seqs_q, seqs_k, block_size=bs, gpu=True)


def test_fp8_long_sequence(rng):
    q, k, v = _x((1, 2, 8192, 128), rng), _x((1, 1, 8192, 128), rng), _x((1, 1, 8192, 128), rng)
    run_and_check(q, k, v, granularity="tensor", causal=True, gpu=True)


GLUON_CASES = {  # (B, Hq, Hk, Sq, Sk, D, layout, out_dtype, granularity, kwargs)
    "decode_row": (4, 8, 2, 1, 3001, 128, "bhsd", torch.bfloat16, "head", {}),
    "bottom_right_sq_lt_sk_d64": (2, 4, 4, 300, 1111, 64, "bhsd", torch.bfloat16, "tensor", dict(causal=True)),
    "top_left_sq_gt_sk_d256": (2, 4, 1, 900, 333, 256, "bhsd", torch.bfloat16, "head",
                               dict(causal=True, mask_align="top_left")),
    "bshd_fp32_out": (2, 6, 2, 517, 517, 128, "bshd", torch.float32, "head", {}),
    "fp16_out_negative_scale": (1, 4, 4, 256, 700, 128, "bhsd", torch.float16, "tensor", dict(scale=-0.05)),
    "long_causal": (1, 8, 8, 8192, 8192, 128, "bhsd", torch.bfloat16, "head", dict(causal=True)),
}


@pytest.mark.parametrize("case", sorted(GLUON_CASES))
def test_fp8_gluon_forward(rng, case):
    """The Hopper Gluon fp8 kernel (e4m3, descales per tensor or per (batch, head)) is the
    one selected, and it meets the fp8 bound: odd lengths (V^T padding), GQA, both causal
    alignments, bshd, every output dtype, a negative scale."""
    B, Hq, Hk, Sq, Sk, D, layout, out_dtype, granularity, kw = GLUON_CASES[case]

    def shape(h, s):
        return (B, h, s, D) if layout == "bhsd" else (B, s, h, D)

    q, k, v = _x(shape(Hq, Sq), rng), _x(shape(Hk, Sk), rng, 2.0), _x(shape(Hk, Sk), rng)
    plan = fmha.explain(q.to(E4M3), k.to(E4M3), v.to(E4M3), layout=layout, **kw).splitlines()[1]
    assert "gluon" in plan or torch.cuda.get_device_capability() != (9, 0), plan
    run_and_check(q, k, v, granularity=granularity, layout=layout, out_dtype=out_dtype, gpu=True, **kw)


def test_fp8_q_descale_per_kv_head_equals_its_expansion(rng):
    """q_descale (B, Hk) (FlashAttention 3's convention under GQA) gives exactly the result
    of the same values repeated to (B, Hq)."""
    q, k, v = _x((2, 8, 640, 128), rng), _x((2, 2, 640, 128), rng), _x((2, 2, 640, 128), rng)
    qd_kv = (q.abs().amax(dim=(2, 3)).reshape(2, 2, 4).amax(-1) / 448.0).contiguous()  # (B, Hk)
    qd_q = qd_kv.repeat_interleave(4, dim=1)
    q8 = (q / qd_q[:, :, None, None]).to(E4M3)
    (k8, kd), (v8, vd) = quantize_fp8(k, E4M3, "head"), quantize_fp8(v, E4M3, "head")
    a = fmha.attention(q8, k8, v8, q_descale=qd_kv, k_descale=kd, v_descale=vd, causal=True)
    b = fmha.attention(q8, k8, v8, q_descale=qd_q, k_descale=kd, v_descale=vd, causal=True)
    assert torch.equal(a, b)


def test_fp8_column_major_v(rng):
    """v with stride 1 along the sequence (the layout FP8 wgmma wants) gives the same result."""
    q, k, v = (_x((2, 4, 512, 128), rng) for _ in range(3))
    q8, qd, _ = quantized(q, E4M3, "head")
    k8, kd, _ = quantized(k, E4M3, "head")
    v8, vd, _ = quantized(v, E4M3, "head")
    v8_cm = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
    a = fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    b = fmha.attention(q8, k8, v8_cm, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    # same values and math; only the load path differs (allow one bf16 rounding step)
    assert float((a.float() - b.float()).abs().max()) <= 2.0**-7 * float(a.float().abs().max())


@pytest.mark.parametrize("shape, view", [((4, 16, 8192, 128), "bhsd"), ((2, 8, 4097, 256), "bshd"),
                                         ((1, 3, 1000, 64), "column_major"), ((3, 5, 31, 80), "bhsd")])
@pytest.mark.parametrize("key_perm", [False, True])
def test_fp8_vt_kernel_matches_the_torch_copy(rng, shape, view, key_perm):
    """The V^T scratch of the Gluon fp8 forward, copied by `fp8_vt.vt_kernel` on the GPU: the same
    bytes as torch's strided copy (`_transposed_by_torch`, whose layout the CPU tests check against
    P V), zeros past the keys included, at the benchmark's size, odd lengths and every V view."""
    from fmha.kernels.gluon.fwd import _transposed, _transposed_by_torch

    v = _x(shape, rng).to(E4M3)
    v = stored_as(v, view)
    got = _transposed(v, key_perm=key_perm)
    expected = torch.full(got.shape, 7, dtype=torch.uint8, device=CUDA)
    _transposed_by_torch(v, expected, key_perm)
    assert torch.equal(got.view(torch.uint8), expected)


@pytest.mark.parametrize("granularity, causal", [("head", False), ("head", True), ("tensor", True)])
def test_fp8_planned_calls_match_the_truth(rng, granularity, causal):
    """Repeated fp8 calls of the same metadata take the api's fp8 call plan and the Gluon
    launchers' plans (V^T copied by the copy's own plan, the call's descales passed, Triton's C
    launcher directly): the second and third calls, with new inputs and descales of other
    values, against the fp8 bound; one plan of each, made by the first call."""
    from fmha.kernels.gluon import fp8_vt
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.launch import plan_tables

    plan_tables.clear_plans()
    for scale in (1.0, 3.0, 0.5):  # (the descales follow the inputs' scale)
        q, k, v = (_x(shape, rng, scale) for shape in ((2, 8, 700, 128), (2, 2, 1100, 128), (2, 2, 1100, 128)))
        run_and_check(q, k, v, granularity=granularity, causal=causal, gpu=True)
    (planned,) = fwd_gluon._PLANS.values()
    (vt_planned,) = fp8_vt._PLANS.values()
    (call_plan,) = call_plans.FORWARD_PLANS.values()
    assert planned.plan.direct is not None and vt_planned.plan.direct is not None
    assert call_plan.launched is planned


def test_fp8_gluon_forward_without_descales_reads_descale_one(rng):
    """Omitted descales are 1 for every (batch, head) in the Gluon fp8 kernel: the output equals
    the one with explicit per-tensor ones. (The absent descale was a (1, 1, 1) tensor with unit
    strides, which the kernel indexed by batch and head: reads past its one element, here into a
    freed block the allocator hands back, holding 1000.)"""
    q8, k8, v8 = (_x((3, 6, 300, 128), rng).to(E4M3) for _ in range(3))
    assert "gluon" in fmha.explain(q8, k8, v8)
    ones = [torch.ones((), device=CUDA) for _ in range(3)]
    want = fmha.attention(q8, k8, v8, q_descale=ones[0], k_descale=ones[1], v_descale=ones[2])
    for _ in range(3):
        junk = torch.full((128,), 1000.0, device=CUDA)
        del junk
        assert torch.equal(fmha.attention(q8, k8, v8), want)


def test_fp8_grad_is_refused(rng):
    q8 = _x((1, 2, 64, 64), rng).to(E4M3).requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward for float8"):
        fmha.attention(q8, q8.detach(), q8.detach())


def test_fp8_cuda_graph_capture(rng):
    """No host reads of descales on CUDA (outside debug mode): the call captures."""
    q, k, v = (_x((1, 4, 256, 64), rng) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t, E4M3, "head") for t in (q, k, v))
    args = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    want = fmha.attention(q8, k8, v8, **args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fmha.attention(q8, k8, v8, **args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------- fp8 KV cache


def _assert_decode_matches_truth(o, lse, q, b, kb, vb, what, dtype=torch.bfloat16, **mask):
    """Sequence b of a decode (o (B, Sq, Hq, D), lse (B, Hq, Sq) of queries q (B, Sq, Hq, D)) against
    the float64 truth over its keys kb, vb ((1, Hk, n, D), float64): as close as the same attention
    with K and V rounded to `dtype` (q's). what: the case, for the message."""
    qb = q[b:b + 1].transpose(1, 2)
    ref_o, ref_lse = numerics.torch_attention(qb, kb, vb, compute_dtype=torch.float64, **mask)
    base_o, base_lse = numerics.torch_attention(qb, kb.to(dtype), vb.to(dtype), **mask)
    for c in (numerics.compare("o", o[b:b + 1].transpose(1, 2), ref_o, base_o, dtype),
              numerics.compare("lse", lse[b:b + 1], ref_lse, base_lse, torch.float32)):
        assert c.ok, f"{what}, batch {b}: {c}"


def _cache8(rng, shape, dtype, batch, paged):
    """(cache8, descale (B, Hk), dequantized float64 cache) with per-(batch, KV head) amax descales."""
    x = _x(shape, rng)
    if paged:  # pages are shared: one descale per KV head, repeated over the batch
        d = (x.abs().amax(dim=(0, 1, 3)) / torch.finfo(dtype).max)[None].expand(batch, -1).contiguous()
        rows = d[:1, None, :, None]
    else:
        d = x.abs().amax(dim=(1, 3)) / torch.finfo(dtype).max
        rows = d[:, None, :, None]
    x8 = (x / rows).to(dtype)
    return x8, d, x8.double() * rows.double()


@pytest.mark.parametrize("paged, dtype, seqlen_q", [(False, E4M3, 1), (True, E4M3, 1), (True, E5M2, 4)])
def test_fp8_kvcache_decode(rng, paged, dtype, seqlen_q):
    B, Hq, Hk, D, S, page = 8, 32, 8, 128, 4096, 64
    q = _x((B, seqlen_q, Hq, D), rng).to(torch.bfloat16)
    shape = (B * S // page + 5, page, Hk, D) if paged else (B, S, Hk, D)
    kc, kd, kf = _cache8(rng, shape, dtype, B, paged)
    vc, vd, vf = _cache8(rng, shape, dtype, B, paged)
    block_table = (torch.randperm(shape[0], generator=rng)[:B * S // page].reshape(B, S // page).int().to(CUDA)
                   if paged else None)
    seqlens = torch.randint(1, S + 1, (B,), generator=rng, dtype=torch.int32).to(CUDA)
    sinks = _x((Hq,), rng)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=block_table, k_descale=kd,
                                         v_descale=vd, causal=True, sinks=sinks, return_lse=True)
    for b in range(B):
        n = int(seqlens[b])
        if paged:
            pages = block_table[b, :-(-n // page)].long()
            kb, vb = (c[pages].reshape(-1, Hk, D)[:n] for c in (kf, vf))
        else:
            kb, vb = kf[b, :n], vf[b, :n]
        _assert_decode_matches_truth(o, lse, q, b, kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                                     f"seqlen {n}", causal=True, sinks=sinks)


@pytest.mark.parametrize("q_log2", [-40, 20])
def test_fp8_cache_decode_of_bf16_queries_far_outside_fp16s_range(rng, q_log2):
    """bf16 queries 2**20 and 2**-40 times their size (the softmax scale undoing it) over a float8
    cache, at a serving size with the split policy's splits: as close to the float64 truth as the
    bf16 decode of the unscaled queries over the dequantized cache (kvcache.FP8_F16_DOTS scales q by a
    power of two into fp16's range; q itself in fp16 would be infinities or zeros)."""
    B, Hq, Hk, D, S = 4, 32, 8, 128, 8192
    q0 = _x((B, 1, Hq, D), rng)
    q = (q0 * 2.0**q_log2).to(torch.bfloat16)
    kc, kd, kf = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    vc, vd, vf = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    seqlens = torch.randint(S // 2, S + 1, (B,), generator=rng, dtype=torch.int32).to(CUDA)
    scale = D**-0.5 / 2.0**q_log2
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd, scale=scale,
                                         return_lse=True)
    for b in range(B):
        n = int(seqlens[b])
        qb = q[b:b + 1].transpose(1, 2)
        kb, vb = (c[b, :n].transpose(0, 1)[None] for c in (kf, vf))
        ref_o, ref_lse = numerics.torch_attention(qb.double(), kb, vb, compute_dtype=torch.float64, scale=scale)
        base_o, base_lse = numerics.torch_attention(q0[b:b + 1].transpose(1, 2).to(torch.bfloat16),
                                                    kb.to(torch.bfloat16), vb.to(torch.bfloat16))
        for c in (numerics.compare("o", o[b:b + 1].transpose(1, 2), ref_o, base_o, torch.bfloat16),
                  numerics.compare("lse", lse[b:b + 1], ref_lse, base_lse, torch.float32)):
            assert c.ok, f"batch {b} (seqlen {n}): {c}"


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_batch_prefill_mixed_with_decode(rng, q_dtype):
    """Chunked prefill over a paged float8 cache at serving sizes: 8 decode rows and two prefill
    chunks (512 queries after 3000 cached keys, 1024 from scratch) in one packed call, Hq=32 Hk=8
    D=128, pages of 16, per-KV-head descales; causal bottom-right per sequence, against the float64
    truth on the dequantized cache, each sequence as close as the same attention in q's dtype."""
    Hq, Hk, D, page = 32, 8, 128, 16
    q_lens = [1] * 8 + [512, 1024]
    lengths = torch.randint(100, 6000, (8,), generator=rng).tolist() + [3512, 1024]
    B = len(q_lens)
    pages = [-(-n // page) for n in lengths]
    pool = sum(pages) + 7
    kc, kd, kf = _cache8(rng, (pool, page, Hk, D), E4M3, B, True)
    vc, vd, vf = _cache8(rng, (pool, page, Hk, D), E4M3, B, True)
    ids = torch.randperm(pool, generator=rng)
    table = torch.zeros((B, max(pages)), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[start:start + n]
        start += n
    table = table.to(CUDA)
    q = _x((sum(q_lens), Hq, D), rng).to(q_dtype)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=CUDA)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                                                device=CUDA),
                                         block_table=table, cu_seqlens_q=cu, max_seqlen_q=max(q_lens), k_descale=kd,
                                         v_descale=vd, causal=True, return_lse=True)
    for b in range(B):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kb, vb = (c[table[b, :pages[b]].long()].reshape(-1, Hk, D)[:lengths[b]].transpose(0, 1)[None]
                  for c in (kf, vf))
        qb = q[rows].transpose(0, 1)[None]
        ref_o, ref_lse = numerics.torch_attention(qb, kb, vb, compute_dtype=torch.float64, causal=True)
        base_o, base_lse = numerics.torch_attention(qb, kb.to(q_dtype), vb.to(q_dtype), causal=True)
        for c in (numerics.compare("o", o[rows].transpose(0, 1)[None], ref_o, base_o, q_dtype),
                  numerics.compare("lse", lse[:, rows][None], ref_lse, base_lse, torch.float32)):
            assert c.ok, f"sequence {b} ({q_lens[b]} queries, {lengths[b]} keys): {c}"


def _gluon_decode_chosen(q, kc, vc, **kw) -> bool:
    """Whether the registry's choice for this decode call is the Gluon fp8 decode."""
    return "_sm90_gluon_" in fmha.explain_kvcache(q, kc, vc, **kw).splitlines()[1]


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8), (16, 1), (8, 8)])
@pytest.mark.parametrize("D", [128, 64, 256])
def test_gluon_fp8_decode_matches_the_truth(rng, kv_dtype, q_dtype, heads, D):
    """The one-warp Gluon decode (kernels/kvcache_gluon.py, the registry's choice for one query token
    over a contiguous float8 cache at D=64, 128 and 256): lengths 0, 1, 31, 33 and up to the capacity,
    GQA groups of 4, 16 and 1, per-(batch, KV head) and per-tensor descales, the split policy's count
    and 1 and 3 splits; each sequence as close to the float64 truth as the same decode in q's dtype."""
    Hq, Hk = heads
    B, S = 6, 5000
    q = _x((B, 1, Hq, D), rng).to(q_dtype)
    kc, kd, kf = _cache8(rng, (B, S, Hk, D), kv_dtype, B, False)
    vc, vd, vf = _cache8(rng, (B, S, Hk, D), kv_dtype, B, False)
    seqlens = torch.tensor([0, 1, 31, 33, 4321, S], dtype=torch.int32, device=CUDA)
    for descales in ("per head", "per tensor"):
        if descales == "per tensor":  # one value: the cache re-read with the largest descale
            kd, vd = kd.max(), vd.max()
            kf, vf = kc.double() * kd.double(), vc.double() * vd.double()
        for splits in (0, 1, 3):
            kw = dict(cache_seqlens=seqlens, k_descale=kd, v_descale=vd, num_splits=splits)
            assert _gluon_decode_chosen(q, kc, vc, **kw)
            o, lse = fmha.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
            assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == float("-inf")).all())
            for b in range(1, B):
                n = int(seqlens[b])
                kb, vb = (c[b, :n].transpose(0, 1)[None] for c in (kf, vf))
                _assert_decode_matches_truth(o, lse, q, b, kb, vb, f"{descales} descales, {splits} splits, seqlen {n}",
                                             q_dtype)


def _fp8_pages(rng, lengths, page_size, nhead_k, head_dim, form):
    """Shuffled float8 pages holding sequences of `lengths` keys (3 spare pages): the K and V
    (cache, descale, float64 truth) of _cache8, each sequence's page ids, and the attention
    arguments that index them: a block table with cache_seqlens ("block_table") or
    FlashInfer/SGLang tables ("indptr")."""
    batch = len(lengths)
    pages = [-(-n // page_size) for n in lengths]
    pool = sum(pages) + 3
    k = _cache8(rng, (pool, page_size, nhead_k, head_dim), E4M3, batch, True)
    v = _cache8(rng, (pool, page_size, nhead_k, head_dim), E4M3, batch, True)
    ids = torch.randperm(pool, generator=rng).int()
    rows = [ids[sum(pages[:b]):sum(pages[:b + 1])] for b in range(batch)]
    if form == "block_table":
        table = torch.zeros((batch, max(pages)), dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, :len(r)] = r
        index = dict(block_table=table.to(CUDA), cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=CUDA))
    else:
        last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages, strict=True)]
        index = dict(kv_indices=torch.cat(rows).to(CUDA),
                     kv_indptr=torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=CUDA),
                     kv_last_page_len=torch.tensor(last, dtype=torch.int32, device=CUDA))
    return k, v, rows, index


@pytest.mark.parametrize("page_size, D", [(64, 128), (32, 128), (256, 128), (16, 128), (1, 128), (48, 128),
                                          (64, 64), (32, 64), (16, 256), (48, 256), (1, 64), (1, 256)])
@pytest.mark.parametrize("form", ["block_table", "indptr"])
def test_gluon_fp8_decode_over_pages_matches_the_truth(rng, page_size, D, form):
    """The Gluon decode over a paged float8 cache: shuffled pages of 64, 32 and 256 keys (one page id a
    32-key tile at D=64 and 128), 16 (at D=256 one a 16-key tile, else one a row, a shift), 1 (one a
    row) and 48 (one a row at D=64 and 128, a division; one a tile at D=256), through a block table or
    FlashInfer/SGLang tables; lengths 0, 1, 33 and longer, the split policy's count and 3 splits; each
    sequence against the float64 truth."""
    B, Hq, Hk = 5, 32, 8
    lengths = [0, 1, 33, 2000, 3001]
    (kc, kd, kf), (vc, vd, vf), rows, index = _fp8_pages(rng, lengths, page_size, Hk, D, form)
    q = _x((B, 1, Hq, D), rng).to(torch.bfloat16)
    for splits in (0, 3):
        kw = dict(**index, k_descale=kd, v_descale=vd, num_splits=splits)
        assert _gluon_decode_chosen(q, kc, vc, **kw)
        o, lse = fmha.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
        assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == float("-inf")).all())
        for b in range(1, B):
            n = lengths[b]
            kb, vb = (c[rows[b].long()].reshape(-1, Hk, D)[:n].transpose(0, 1)[None] for c in (kf, vf))
            _assert_decode_matches_truth(o, lse, q, b, kb, vb, f"{form}, pages of {page_size}, {splits} splits, "
                                                               f"seqlen {n}")


_GLUON_DECODE_CASES = {  # name: (seqlen_q, (Hq, Hk), attention_with_kvcache's mask and score arguments)
    "causal, 4 queries": (4, (32, 8), dict(causal=True)),
    "causal top-left, 2 queries": (2, (32, 8), dict(causal=True, mask_align="top_left")),
    "window": (1, (32, 8), dict(window=(200, 0))),
    "window and sink tokens, 3 queries": (3, (16, 4), dict(window=(300, 0), sink_size=40)),
    "window with a right edge, top-left, sink tokens": (2, (32, 8), dict(window=(100, 50), mask_align="top_left",
                                                                           sink_size=70)),
    "soft-cap, ALiBi, sink logits": (2, (32, 8), dict(softcap=2.0, alibi=True, sinks=True)),
    "all of them, 16 rows": (2, (16, 2), dict(causal=True, window=(500, 0), sink_size=16, softcap=2.0, alibi=True,
                                              sinks=True)),
}


@pytest.mark.parametrize("case", list(_GLUON_DECODE_CASES))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("D", [128, 64, 256])
def test_gluon_fp8_decode_masks_and_scores_match_the_truth(rng, case, paged, D):
    """The Gluon decode with up to 16 query rows a (sequence, KV head) (speculative tokens x GQA
    group) and every mask and score feature of the KV-cache path: causal both alignments, windows
    (with and without a right edge), sink tokens left and right of the window, soft-cap, ALiBi and
    sink logits (folded in the kernel with one split, by the combine with more); contiguous and
    pages of 64 keys; D=64, 128 and 256; lengths 0 to 4000, the split policy's count and 1 and 3
    splits; each sequence as close to the float64 truth as the same attention in bf16."""
    seqlen_q, (Hq, Hk), features = _GLUON_DECODE_CASES[case]
    features = dict(features)
    B, S, page = 6, 4096, 64
    lengths = [0, seqlen_q, 37, 333, 1500, 4000]
    q = _x((B, seqlen_q, Hq, D), rng).to(torch.bfloat16)
    shape = (B * S // page + 3, page, Hk, D) if paged else (B, S, Hk, D)
    kc, kd, kf = _cache8(rng, shape, E4M3, B, paged)
    vc, vd, vf = _cache8(rng, shape, E4M3, B, paged)
    index = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=CUDA))
    if paged:
        table = torch.randperm(shape[0], generator=rng)[:B * S // page].reshape(B, S // page).int()
        index["block_table"] = table.to(CUDA)
    slopes = (torch.rand((B, Hq), generator=rng) * 0.05).to(CUDA) if features.pop("alibi", False) else None
    sinks = _x((Hq,), rng) if features.pop("sinks", False) else None
    for splits in (0, 1, 3):
        kw = dict(**index, k_descale=kd, v_descale=vd, num_splits=splits, alibi_slopes=slopes, sinks=sinks,
                  **features)
        assert _gluon_decode_chosen(q, kc, vc, **kw), fmha.explain_kvcache(q, kc, vc, **kw)
        o, lse = fmha.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
        # the same call on copies (the call plan's path, ALiBi slopes and sinks too): the same result
        again = dict(kw, alibi_slopes=None if slopes is None else slopes.clone(),
                     sinks=None if sinks is None else sinks.clone())
        o2, lse2 = fmha.attention_with_kvcache(q.clone(), kc, vc, return_lse=True, **again)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)
        if sinks is None:  # no keys, no sink: zeros and -inf
            assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == float("-inf")).all())
        for b in range(0 if sinks is not None else 1, B):
            n = lengths[b]
            if paged:
                kb, vb = (c[table[b].long()].reshape(-1, Hk, D)[:n].transpose(0, 1)[None] for c in (kf, vf))
            else:
                kb, vb = (c[b, :n].transpose(0, 1)[None] for c in (kf, vf))
            _assert_decode_matches_truth(o, lse, q, b, kb, vb, f"{case}, {splits} splits, seqlen {n}", **features,
                                         alibi_slopes=None if slopes is None else slopes[b:b + 1], sinks=sinks)


# (batch, Hq, Hk, head_dim, page_size, context, table form): issue 5's serving sizes over float8 pages
_FP8_SERVING_CASES = [
    (1, 32, 8, 128, 16, 131072, "block_table"),
    (1, 32, 8, 256, 64, 131072, "indptr"),
    (2, 64, 8, 64, 32, 131072, "block_table"),
    (256, 32, 8, 64, 16, 1024, "indptr"),
    (64, 64, 8, 256, 64, 4096, "indptr"),
    (8, 32, 8, 256, 256, 16384, "block_table"),
    (32, 64, 8, 64, 1, 2048, "block_table"),
    (4, 64, 8, 128, 64, 65536, "indptr"),
]


@pytest.mark.parametrize("batch, nhead_q, nhead_k, D, page_size, context, form", _FP8_SERVING_CASES)
def test_gluon_fp8_decode_at_serving_sizes(rng, batch, nhead_q, nhead_k, D, page_size, context, form):
    """A decode step over shuffled float8 pages at serving sizes (batch 1-256, context 1k-128k, GQA
    32:8 and 64:8, D 64/128/256, pages of 1-256 keys, block tables and FlashInfer/SGLang tables) on
    the Gluon decode with the split policy's splits: every sequence (lengths from 1 to the context)
    as close to the float64 truth as the same decode in bf16 over the dequantized cache."""
    lengths = torch.randint(1, context + 1, (batch,), generator=rng).tolist()
    lengths[0], lengths[-1] = context, 1
    (kc, kd, kf), (vc, vd, vf), rows, index = _fp8_pages(rng, lengths, page_size, nhead_k, D, form)
    q = _x((batch, 1, nhead_q, D), rng).to(torch.bfloat16)
    kw = dict(**index, k_descale=kd, v_descale=vd, causal=True)
    assert _gluon_decode_chosen(q, kc, vc, **kw), fmha.explain_kvcache(q, kc, vc, **kw)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
    for b, n in enumerate(lengths):
        kb, vb = (c[rows[b].long()].reshape(-1, nhead_k, D)[:n].transpose(0, 1)[None] for c in (kf, vf))
        _assert_decode_matches_truth(o, lse, q, b, kb, vb, f"seqlen {n}")


def test_gluon_fp8_decode_reads_cache_rows_by_cache_batch_idx(rng):
    """cache_batch_idx picks each sequence's cache row: equal to the decode over those rows copied out."""
    B, Hq, Hk, D, S = 4, 32, 8, 128, 3000
    q = _x((B, 1, Hq, D), rng).to(torch.bfloat16)
    kc, _, _ = _cache8(rng, (7, S, Hk, D), E4M3, 7, False)
    vc, _, _ = _cache8(rng, (7, S, Hk, D), E4M3, 7, False)
    rows = torch.tensor([5, 0, 6, 2], dtype=torch.int32, device=CUDA)
    seqlens = torch.tensor([100, 2999, 1, 1777], dtype=torch.int32, device=CUDA)
    assert _gluon_decode_chosen(q, kc, vc, cache_seqlens=seqlens, cache_batch_idx=rows)
    got = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_batch_idx=rows)
    want = fmha.attention_with_kvcache(q, kc[rows.long()].contiguous(), vc[rows.long()].contiguous(),
                                       cache_seqlens=seqlens)
    assert torch.equal(got, want)


def test_gluon_fp8_decode_call_plans_and_cuda_graph(rng):
    """Repeated decode steps take the call plan (the Gluon launcher keeps one too) and replay in a
    CUDA graph with new queries and lengths written in place: each equal to an eager call."""
    B, Hq, Hk, D, S = 8, 32, 8, 128, 8192
    q = _x((B, 1, Hq, D), rng).to(torch.bfloat16)
    kc, kd, _ = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    vc, vd, _ = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    seqlens = torch.randint(1, S + 1, (B,), generator=rng, dtype=torch.int32).to(CUDA)
    kw = dict(cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    assert _gluon_decode_chosen(q, kc, vc, **kw)
    first = fmha.attention_with_kvcache(q, kc, vc, **kw)
    assert torch.equal(fmha.attention_with_kvcache(q, kc, vc, **kw), first)  # (the call plan)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fmha.attention_with_kvcache(q, kc, vc, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmha.attention_with_kvcache(q, kc, vc, **kw)
    for _ in range(3):
        q.copy_(_x((B, 1, Hq, D), rng).to(torch.bfloat16))
        seqlens.copy_(torch.randint(1, S + 1, (B,), generator=rng, dtype=torch.int32).to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fmha.attention_with_kvcache(q, kc, vc, **kw))


def test_fp8_kvcache_append_decode_step(rng):
    """A decode step that appends the new token into an fp8 cache, then attends to it."""
    B, Hq, Hk, D, S = 4, 16, 4, 128, 1024
    kc, kd, _ = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    vc, vd, _ = _cache8(rng, (B, S, Hk, D), E4M3, B, False)
    q = _x((B, 1, Hq, D), rng).to(torch.bfloat16)
    k_new, v_new = (_x((B, 1, Hk, D), rng, 0.5).to(torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 5, 700, S - 1], dtype=torch.int32, device=CUDA)
    o = fmha.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    for b, n in enumerate(seqlens.tolist()):
        got = kc[b, n].double() * kd[b][:, None].double()
        want = k_new[b, 0].double()
        assert ((got - want).abs() <= 2.0**-4 * want.abs() + 2.0**-10 * float(kd[b].max())).all()
    # attention over the updated cache, dequantized, in float64
    kf, vf = kc.double() * kd[:, None, :, None].double(), vc.double() * vd[:, None, :, None].double()
    for b, n in enumerate(seqlens.tolist()):
        kb, vb = kf[b, :n + 1].transpose(0, 1)[None], vf[b, :n + 1].transpose(0, 1)[None]
        ref_o, _ = numerics.torch_attention(q[b:b + 1].transpose(1, 2), kb, vb, compute_dtype=torch.float64)
        base_o, _ = numerics.torch_attention(q[b:b + 1].transpose(1, 2), kb.to(torch.bfloat16), vb.to(torch.bfloat16))
        c = numerics.compare("o", o[b:b + 1].transpose(1, 2), ref_o, base_o, torch.bfloat16)
        assert c.ok, f"batch {b}: {c}"


def _every_finite_code(dtype, shape, rng):
    """A float8 tensor of `shape` holding every finite code of `dtype` (each about equally often,
    shuffled), so that a conversion wrong for any byte shows."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[torch.isfinite(codes.float())]
    picks = torch.randperm(math.prod(shape), generator=rng) % codes.numel()
    return codes[picks].reshape(shape).to(CUDA)


@triton.jit
def _convert_kernel(X, Y, n, K_AT_DOT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, kvcache._dequantized(x, Y.dtype.element_ty, True, K_AT_DOT), mask=offs < n)


@pytest.mark.parametrize("at_dot", [False, True])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_ptx_conversion_is_exact_for_every_code(kv_dtype, dtype, at_dot):
    """kvcache's PTX conversion (FP8_ASM; pure or not, as K's and V's) of each of the 256 codes
    equals torch's conversion bitwise; NaN codes give NaN and e5m2's infinities stay infinite."""
    x = torch.arange(256, dtype=torch.uint8).view(kv_dtype).to(CUDA)
    y = torch.empty(256, dtype=dtype, device=CUDA)
    _convert_kernel[(1,)](x, y, 256, K_AT_DOT=at_dot, BLOCK=256)
    want = x.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))  # (-0.0 included)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_decode_equals_the_16_bit_cache_it_holds(rng, monkeypatch, request, kv_dtype, q_dtype, paged):
    """A float8 cache (descales of 1) converted in the kernel (kvcache.FP8_ASM's inline PTX on the
    GPU) gives the decode over the same cache stored in q's dtype (every finite code in K and V),
    run through the Triton kernel's float8 cache decode config (which the registry otherwise gives
    float8 caches only; contiguous ones take the Gluon decode, tested below): bitwise with both
    conversions on the load's layout and the products in q's dtype (FP8_K_AT_DOT and FP8_F16_DOTS
    off: the kernel's products are then the 16-bit cache's);
    with K's at the dot (the default: Triton orders the logits' sums differently there) or bf16
    queries' products in fp16 (FP8_F16_DOTS, the default) as close to the float64 truth as that
    decode."""
    request.addfinalizer(plan_tables.clear_plans)  # (no plan made under this test's switches outlives it)
    B, Hq, Hk, D, S, page = 4, 16, 4, 128, 2048, 64
    shape = (B * S // page, page, Hk, D) if paged else (B, S, Hk, D)
    k8, v8 = _every_finite_code(kv_dtype, shape, rng), _every_finite_code(kv_dtype, shape, rng)
    q = _x((B, 1, Hq, D), rng, 0.05).to(q_dtype)  # small logits: e5m2 keys reach 57344
    table = torch.randperm(shape[0], generator=rng).reshape(B, -1).int().to(CUDA) if paged else None
    seqlens = torch.randint(1, S + 1, (B,), generator=rng, dtype=torch.int32).to(CUDA)
    ones = torch.ones((B, Hk), dtype=torch.float32, device=CUDA)
    # (the Triton kernel's routes: the registry without the Gluon decode, which would take the
    # contiguous float8 cache and not the 16-bit one)
    triton = fmha.Registry([c for c in fmha.default_registry() if not c.algorithm.pipeline.is_gluon], name="triton")
    config, _ = fmha.Dispatcher(triton).select(fmha.Problem(
        batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=1, seqlen_k=S, head_dim_qk=D, head_dim_v=D,
        dtype=fmha.DType.BF16, layout="bshd", arch="sm90", seqused_k=True, paged_kv=paged, kv_fp8=True),
        fmha.Family.FWD_SPLITKV)
    fp8_tile = fmha.Dispatcher(fmha.Registry([config]).merged(triton, name="fp8 tile"))
    truth = []  # float64, per sequence: (o (1, Hq, 1, D), lse (1, Hq, 1))
    for b in range(B):
        n = int(seqlens[b])
        kb, vb = ((c[table[b, :-(-n // page)].long()].reshape(-1, Hk, D)[:n] if paged else c[b, :n]).double()
                  .transpose(0, 1)[None] for c in (k8, v8))
        truth.append(numerics.torch_attention(q[b:b + 1].transpose(1, 2), kb, vb, compute_dtype=torch.float64))
    for splits in (1, 3):
        with use_dispatcher(fp8_tile):
            want = fmha.attention_with_kvcache(q, k8.to(q_dtype), v8.to(q_dtype), cache_seqlens=seqlens,
                                               block_table=table, num_splits=splits, return_lse=True)
        # (fp16 queries take the same kernel either way: FP8_F16_DOTS is for bf16 queries)
        f16_dots = (False, True) if q_dtype == torch.bfloat16 else (False,)
        for k_at_dot, f16 in itertools.product((False, True), f16_dots):
            monkeypatch.setattr(kvcache, "FP8_K_AT_DOT", k_at_dot)
            monkeypatch.setattr(kvcache, "FP8_F16_DOTS", f16)
            plan_tables.clear_plans()  # (a call plan keeps the switches it was made with)
            with use_dispatcher(fp8_tile):
                got = fmha.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, block_table=table,
                                                  k_descale=ones, v_descale=ones, num_splits=splits, return_lse=True)
            same_products = not k_at_dot and not f16
            for name, g, w in zip(("o", "lse"), got, want, strict=True):
                where = f"{name}, {splits} splits, K's conversion at the dot {k_at_dot}, fp16 products {f16}"
                assert torch.isfinite(g).all(), f"{where}: not finite"
                if same_products:
                    diff = (g.float() - w.float()).abs().max()
                    assert torch.equal(g, w), f"{where}: differs from the {q_dtype} cache's by up to {diff}"
            if not same_products:
                for b, (ref_o, ref_lse) in enumerate(truth):
                    for c in (numerics.compare("o", got[0][b:b + 1].transpose(1, 2), ref_o,
                                               want[0][b:b + 1].transpose(1, 2), q_dtype),
                              numerics.compare("lse", got[1][b:b + 1], ref_lse, want[1][b:b + 1], torch.float32)):
                        assert c.ok, f"{splits} splits, K at the dot {k_at_dot}, fp16 products {f16}, batch {b}: {c}"
