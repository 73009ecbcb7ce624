"""FP8 forward on the CPU: quantize helpers, argument checks, and the real kernel through
Triton's interpreter (fmha.kernels.launch.loader patches its float8 conversions to be exact).

Kernel results are checked against the float64 reference on the dequantized inputs with
the element-wise fp8 error bound derived in tests/fp8_testing.py.
"""

from __future__ import annotations

import collections
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fmha
from fmha import reference
from fmha.fp8 import dequantize_fp8, quantize_fp8

from fp8_testing import bound as fp8_bound
from fp8_testing import check_close, probabilities, quantized, run_and_check, run_and_check_varlen, stored_as

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]


def _rng():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))


def _x(shape, rng, scale=1.0):
    return torch.randn(shape, generator=rng) * scale


# ---------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_quantize_round_trip_is_within_one_rounding(dtype, granularity, layout):
    rng = _rng()
    shape = (2, 3, 37, 8) if layout == "bhsd" else (2, 37, 3, 8)
    x = _x(shape, rng) * torch.linspace(0.1, 10, 37)[:, None] .expand(37, 8).reshape(
        (1, 1, 37, 8) if layout == "bhsd" else (1, 37, 1, 8))
    x8, d = quantize_fp8(x, dtype, granularity, 16, layout=layout)
    assert x8.dtype == dtype and x8.shape == x.shape
    expected = {"tensor": (), "head": (2, 3), "block": (2, 3, 3)}[granularity]
    assert tuple(d.shape) == expected and d.dtype == torch.float32
    back = dequantize_fp8(x8, d, layout=layout, block_size=16)
    # relative unit 2^-4 (e4m3) / 2^-3 (e5m2) for normal numbers; subnormal steps below
    unit, sub = (2.0**-4, 2.0**-10) if dtype == E4M3 else (2.0**-3, 2.0**-17)
    full = d.reshape(-1).max() if granularity == "tensor" else None
    dmax = float(full if full is not None else d.max())
    assert ((back - x).abs() <= unit * x.abs() + sub * dmax + 1e-12).all()
    # the largest |x| of each group maps to the format's largest value
    assert float(x8.float().abs().max()) == torch.finfo(dtype).max


def test_quantize_varlen_blocks_count_positions_per_sequence():
    rng = _rng()
    cu = torch.tensor([0, 5, 25, 26], dtype=torch.int32)
    x = _x((26, 2, 8), rng)
    x[5:9] *= 100  # first block of sequence 1 is large
    x8, d = quantize_fp8(x, E4M3, "block", 4, cu_seqlens=cu)
    assert tuple(d.shape) == (3, 2, 5)  # ceil(max_seqlen 20 / 4)
    assert (d[1, :, 0] > 10 * d[1, :, 1]).all()
    assert (d[2, :, 1:] == 1).all() and (d[0, :, 2:] == 1).all()  # blocks past a sequence's end
    back = dequantize_fp8(x8, d, block_size=4, cu_seqlens=cu)
    assert ((back - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * float(d.max())).all()
    with pytest.raises(ValueError, match="cu_seqlens"):
        quantize_fp8(x, E4M3, "head")


def test_quantize_zero_tensor_gets_descale_one():
    x8, d = quantize_fp8(torch.zeros(1, 1, 4, 8), E4M3, "head")
    assert (d == 1).all() and (x8.float() == 0).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=torch.float16), "dtype"),
    (dict(granularity="row"), "granularity"),
    (dict(block_size=0), "block_size"),
])
def test_quantize_rejects_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_fp8(torch.randn(1, 1, 4, 8), **kwargs)


# ---------------------------------------------------------------------------- the bound


def test_torch_float64_truth_matches_the_numpy_reference():
    """The bound's float64 forward (torch, runs on the GPU too) is fmha.reference's."""
    rng = _rng()
    q, k, v = _x((2, 4, 9, 8), rng), _x((2, 2, 13, 8), rng), _x((2, 2, 13, 6), rng)
    kw = dict(scale=0.4, window=(5, 2), sink_size=2, bias=_x((1, 4, 9, 13), rng), softcap=1.5,
              alibi_slopes=torch.rand(2, 4, generator=rng), sinks=_x((4,), rng), dropout_p=0.3)
    mask = torch.rand(2, 4, 9, 13, generator=rng) > 0.3
    f = probabilities(q, k, v, dropout_mask=mask, **kw)
    ref_o, ref_lse = reference.attention_fwd(*(t.double().numpy() for t in (q, k, v)), dropout_mask=mask.numpy(),
                                             **{n: (t.double().numpy() if isinstance(t, torch.Tensor) else t)
                                                for n, t in kw.items()})
    np.testing.assert_allclose(f["o"].numpy(), ref_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f["lse"].numpy(), ref_lse, rtol=1e-12, atol=1e-12)


def test_error_bound_catches_a_wrong_descale():
    """The bound is tight enough that a v descale off by 25% fails (so the checks can fail)."""
    rng = _rng()
    q, k, v = _x((1, 1, 24, 16), rng), _x((1, 1, 40, 16), rng), _x((1, 1, 40, 16), rng)
    q8, qd, qf = quantized(q, E4M3, "tensor")
    k8, kd, kf = quantized(k, E4M3, "tensor")
    v8, vd, vf = quantized(v, E4M3, "tensor")
    o_ref, lse_ref, o_tol, lse_tol = fp8_bound(qf, kf, vf, out_dtype=torch.float32, gpu=False)
    o = fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd * 1.25, out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="exceeds the fp8 bound"):
        check_close("o", o, o_ref, o_tol)


# ---------------------------------------------------------------------------- kernel (interpreter)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_fp8_forward_matches_reference(dtype, granularity):
    rng = _rng()
    q, k, v = _x((1, 2, 21, 24), rng), _x((1, 1, 37, 24), rng, 2.0), _x((1, 1, 37, 24), rng)
    run_and_check(q, k, v, dtype=dtype, granularity=granularity, causal=True)


@pytest.mark.parametrize("case", ["window_sinktokens_bshd", "softcap_sinks_alibi", "bias_dropout",
                                  "top_left_fp16_out", "dims_fp32_out"])
def test_fp8_forward_features(case):
    rng = _rng()
    B, Hq, Hk, Sq, Sk, D, Dv = 1, 2, 1, 21, 35, 32, 32
    kw, layout, out_dtype, gran = {}, "bhsd", torch.bfloat16, "head"
    if case == "window_sinktokens_bshd":
        kw = dict(window=(9, 3), sink_size=4)
        layout = "bshd"
    elif case == "softcap_sinks_alibi":
        kw = dict(softcap=2.0, sinks=_x((Hq,), rng), alibi_slopes=torch.rand(Hq, generator=rng))
        gran = "block"
    elif case == "bias_dropout":
        kw = dict(bias=_x((1, Hq, Sq, Sk), rng), dropout_p=0.2, seed=7)
        gran = "tensor"
    elif case == "top_left_fp16_out":
        kw = dict(causal=True, mask_align="top_left")
        out_dtype = torch.float16
    else:
        D, Dv, Hk = 20, 12, 2
        out_dtype = torch.float32
        kw = dict(scale=0.3)

    def shape(h, s, d):
        return (B, h, s, d) if layout == "bhsd" else (B, s, h, d)

    q, k, v = _x(shape(Hq, Sq, D), rng), _x(shape(Hk, Sk, D), rng), _x(shape(Hk, Sk, Dv), rng)
    run_and_check(q, k, v, granularity=gran, layout=layout, out_dtype=out_dtype, **kw)


def test_fp8_q_descale_per_query_head_and_per_kv_head():
    """q's descale may be (B, Hq) or (B, Hk) (shared by a KV head's query heads)."""
    rng = _rng()
    q, k, v = _x((1, 4, 12, 16), rng), _x((1, 2, 20, 16), rng), _x((1, 2, 20, 16), rng)
    k8, kd, kf = quantized(k, E4M3, "head")
    v8, vd, vf = quantized(v, E4M3, "head")
    q8, qd, qf = quantized(q, E4M3, "head")  # (1, 4)
    assert qd.shape == (1, 4)
    o_ref, lse_ref, o_tol, lse_tol = fp8_bound(qf, kf, vf, out_dtype=torch.bfloat16, gpu=False)
    o, lse = fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    check_close("o", o, o_ref, o_tol)
    check_close("lse", lse, lse_ref, lse_tol)
    # per KV head: both query heads of a group share the descale
    qd2 = torch.stack([qd[:, 0] * 1.5, qd[:, 2] * 0.5], dim=1)
    qf2 = dequantize_fp8(q8, qd2).double()
    o_ref, lse_ref, o_tol, lse_tol = fp8_bound(qf2, kf, vf, out_dtype=torch.bfloat16, gpu=False)
    o, lse = fmha.attention(q8, k8, v8, q_descale=qd2, k_descale=kd, v_descale=vd, return_lse=True)
    check_close("o", o, o_ref, o_tol)
    check_close("lse", lse, lse_ref, lse_tol)


def test_fp8_varlen_with_block_descales():
    rng = _rng()
    seqs_q, seqs_k = [5, 19, 1], [12, 30, 7]
    Hq, Hk, D, bs = 4, 2, 16, 8
    q, k, v = _x((sum(seqs_q), Hq, D), rng), _x((sum(seqs_k), Hk, D), rng), _x((sum(seqs_k), Hk, D), rng)
    run_and_check_varlen(q, k, v, seqs_q, seqs_k, block_size=bs, gpu=False)


def test_fp8_without_descales_means_descale_one():
    rng = _rng()
    q8, k8, v8 = (_x((1, 1, 16, 16), rng).to(E4M3) for _ in range(3))
    o = fmha.attention(q8, k8, v8, out_dtype=torch.float32)
    o_ref, _, o_tol, _ = fp8_bound(*(t.double() for t in (q8, k8, v8)), out_dtype=torch.float32, gpu=False)
    check_close("o", o, o_ref, o_tol)


# ---------------------------------------------------------------------------- Gluon fp8 key permutation


def _kernel_key_permutation(n):
    """perm with P_perm[:, a] = P[:, perm[a]]: the reshape/permute of kernels/fwd_gluon.py's
    `_p_operand` on a row of n keys, written in numpy."""
    return np.arange(n).reshape(n // 32, 2, 2, 4, 2).transpose(0, 1, 3, 2, 4).reshape(n)


def test_gluon_fp8_key_permutation_maps_the_accumulator_fragment_onto_the_a_fragment():
    """PTX ISA wgmma fragments, per 32 columns of a row: the m64nNk32 f32 accumulator gives
    thread t = lane % 4 the columns 2t + e + 8i (i = 0..3), the e4m3 A operand (k32) wants
    4t + k + 16i (k = 0..3, i = 0..1); taken in register order, the value the thread holds at
    accumulator column c is P_perm's value at the A column it fills (no data moves, which the
    kernel's `convert_layout(..., assert_trivial=True)` also checks at compile time)."""
    perm = _kernel_key_permutation(32)
    assert sorted(perm) == list(range(32))
    for t in range(4):
        acc = [2 * t + e + 8 * i for i in range(4) for e in range(2)]
        a_frag = [4 * t + k + 16 * i for i in range(2) for k in range(4)]
        assert [int(perm[a]) for a in a_frag] == acc


@pytest.mark.parametrize("seqlen", [1, 31, 32, 64, 100, 300])
@pytest.mark.parametrize("view", ["bhsd", "bshd", "column_major"])
def test_gluon_fp8_v_transposed_with_key_permutation_gives_p_v(seqlen, view):
    """The V^T scratch of the Gluon fp8 forward (P through shared memory with its keys permuted):
    keys rounded up to 32, permuted within each block of 32 as the kernel permutes P's keys,
    zeros past the end (finite where the masked P is 0); P_perm V_perm = P V (to float64
    rounding). Without the permutation: the plain V^T."""
    from fmha.kernels.gluon.fwd import _transposed

    rng = _rng()
    B, H, D = 2, 3, 16
    v = _x((B, H, seqlen, D), rng).to(E4M3)
    v = stored_as(v, view)
    plain = _transposed(v)
    assert plain.shape == (B, H, D, seqlen) and torch.equal(plain.view(torch.uint8), v.view(torch.uint8).mT)
    vt = _transposed(v, key_perm=True)
    n = -(-seqlen // 32) * 32
    assert vt.shape == (B, H, D, n) and vt.is_contiguous()
    perm = _kernel_key_permutation(n)
    v_pad = np.zeros((B, H, n, D))
    v_pad[:, :, :seqlen] = v.double().numpy()
    np.testing.assert_array_equal(vt.double().numpy(), v_pad[:, :, perm].swapaxes(2, 3))
    p = np.zeros((B, H, 5, n))
    p[..., :seqlen] = torch.rand((B, H, 5, seqlen), generator=rng, dtype=torch.float64).numpy()
    np.testing.assert_allclose(p[..., perm] @ vt.double().numpy().swapaxes(2, 3), p @ v_pad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key_perm", [False, True])
@pytest.mark.parametrize("seqlen, head_dim, view", [(1, 16, "bhsd"), (31, 80, "bshd"), (100, 16, "column_major"),
                                                    (300, 48, "bhsd")])
def test_fp8_vt_kernel_copies_as_the_torch_permutation_does(seqlen, head_dim, view, key_perm):
    """`fp8_vt.vt_kernel` (the GPU's V^T scratch copy), run by the interpreter with tiles smaller
    than the keys and D, writes the bytes the torch copy above (checked against P V) writes,
    zeros included, over a buffer filled with other bytes; each program's keys are permuted
    within blocks of 32 and D split across programs."""
    from fmha.kernels.gluon.fwd import _transposed_by_torch
    from fmha.kernels.launch.loader import family_module

    rng = _rng()
    v = _x((2, 3, seqlen, head_dim), rng).to(E4M3)
    v = stored_as(v, view)
    n = -(-seqlen // 32) * 32 if key_perm else seqlen
    expected = torch.full((2, 3, head_dim, n), 7, dtype=torch.uint8)
    _transposed_by_torch(v, expected, key_perm)
    got = torch.full((2, 3, head_dim, n), 9, dtype=torch.uint8)
    family_module("gluon.fp8_vt", interpreted=True).launch_vt(v.view(torch.uint8), got, key_perm=key_perm,
                                                        block_s=32, block_d=16)
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------- dispatch and errors


def test_dispatcher_selects_an_fp8_config_and_explain_shows_it():
    q8 = torch.zeros(1, 2, 16, 64, dtype=E4M3)
    text = fmha.explain(q8, q8, q8)
    assert "fp8_e4m3" in text and "selected: fwd_fp8_e4m3-fp8_e5m2" in text
    problem = fmha.Problem(batch=1, nhead_q=2, nhead_k=2, seqlen_q=16, seqlen_k=16, head_dim_qk=128,
                           head_dim_v=128, dtype=fmha.DType.FP8_E5M2, arch="sm90")
    config, _ = fmha.get_dispatcher().select(problem)
    assert fmha.DType.FP8_E5M2 in config.signature.dtypes and "sm90" in config.signature.archs
    with pytest.raises(fmha.NoKernelError, match="dtype fp8_e5m2 not in"):
        fmha.get_dispatcher().select(problem.with_(arch="sm80"))


def _q8(shape=(2, 4, 8, 16)):
    return torch.randn(shape).to(E4M3)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q_descale=torch.ones(3)), ValueError, r"q_descale has shape \(3,\); accepted"),
    (dict(k_descale=torch.ones(2, 4)), ValueError, r"k_descale has shape \(2, 4\)"),  # Hk=2 here
    (dict(v_descale=torch.ones(2, 2, 2)), ValueError, "needs descale_block_size"),
    (dict(v_descale=torch.ones(2, 2, 3), descale_block_size=8), ValueError, r"ceil\(seqlen / descale_block_size\) = 2"),
    (dict(descale_block_size=8), ValueError, "no descale is per block"),
    (dict(q_descale=torch.ones((), dtype=torch.float64)), TypeError, "q_descale.dtype"),
    (dict(k_descale=torch.zeros(())), ValueError, "finite and > 0"),
    (dict(out_dtype=torch.float8_e4m3fn), TypeError, "out_dtype"),
    (dict(bias=torch.zeros(16, 16, dtype=E4M3)), TypeError, "bias.dtype"),
])
def test_fp8_arguments_are_checked(kwargs, error, match):
    q8, kv = _q8(), _q8((2, 2, 16, 16))
    with pytest.raises(error, match=match):
        fmha.attention(q8, kv, kv, **kwargs)


def test_descales_with_16_bit_inputs_are_refused():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="descales are for float8 inputs"):
        fmha.attention(q, q, q, k_descale=torch.ones(()))
    with pytest.raises(ValueError, match="out_dtype"):
        fmha.attention(q, q, q, out_dtype=torch.float32)


def test_mixed_fp8_formats_are_refused():
    q8 = _q8()
    with pytest.raises(TypeError, match="one dtype"):
        fmha.attention(q8, q8.to(torch.float32).to(E5M2), q8)


def test_fp8_grad_raises_not_implemented():
    q8 = _q8((1, 1, 8, 16)).requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward for float8"):
        fmha.attention(q8, q8.detach(), q8.detach())
    qd = torch.ones((), requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward for float8"):
        fmha.attention(q8.detach(), q8.detach(), q8.detach(), q_descale=qd)
    with torch.no_grad():  # fine without autograd
        o = fmha.attention(q8, q8.detach(), q8.detach())
    assert o.dtype == torch.bfloat16 and not math.isnan(float(o.float().sum()))


# ---------------------------------------------------------------------------- fp8 KV cache


def _fp8_cache(rng, shape, dtype, per_head: bool, batch: int, base: float = 0.01):
    """(cache8, descale, dequantized float64 cache); per-head descales are per (batch, KV head)."""
    x = _x(shape, rng)
    nhead_k = shape[2]
    d = (torch.rand(batch, nhead_k, generator=rng) + 0.5) * base if per_head else torch.tensor(1.3 * base)
    if per_head and shape[0] != batch:  # paged: pages are shared, so one descale per KV head
        d = d[:1].expand(batch, nhead_k).contiguous()
    d_rows = d.reshape(1, 1, 1, 1) if d.dim() == 0 else d[:shape[0] if shape[0] == batch else 1, None, :, None]
    x8 = (x / d_rows).to(dtype)
    return x8, d, (x8.double() * d_rows.double())


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kvcache_matches_reference_on_the_dequantized_cache(paged, per_head, num_splits):
    rng = _rng()
    B, Sq, Hq, Hk, D = 2, 2, 4, 2, 32
    q = _x((B, Sq, Hq, D), rng).to(torch.float16)
    dtype = E4M3 if per_head else E5M2
    shape = (11, 4, Hk, D) if paged else (B, 40, Hk, D)
    kc, kd, kf = _fp8_cache(rng, shape, dtype, per_head, B)
    vc, vd, vf = _fp8_cache(rng, shape, dtype, per_head, B)
    block_table = torch.randperm(11, generator=rng)[:10].reshape(B, 5).int() if paged else None
    seqlens = torch.tensor([17, 20] if paged else [17, 40], dtype=torch.int32)
    kw = dict(causal=True, softcap=4.0, sinks=_x((Hq,), rng))
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=block_table,
                                         k_descale=kd, v_descale=vd, num_splits=num_splits, return_lse=True, **kw)
    assert o.dtype == torch.float16
    ro, rl, _, _ = reference.attention_with_kvcache(
        q.double().numpy(), kf.numpy(), vf.numpy(), cache_seqlens=seqlens.numpy(),
        block_table=None if block_table is None else block_table.numpy(), causal=True, softcap=4.0,
        sinks=kw["sinks"].double().numpy())
    assert float(np.abs(o.double().numpy() - ro).max()) < 3e-3  # fp16 P and output, as the fp16 cache tests
    assert float(np.abs(lse.double().numpy() - rl).max()) < 1e-4


@pytest.mark.parametrize("q_log2", [-40, 0, 20])
def test_fp8_cache_with_bf16_queries_of_any_magnitude(q_log2):
    """bf16 queries over a float8 cache take fp16 products (kvcache.FP8_F16_DOTS), q scaled by a
    power of two into fp16's range and P by 2**15: queries 2**20 and 2**-40 times their size (the
    softmax scale undoing it) give the same attention, where q turned into fp16 as it is would be
    infinities or zeros. With sinks (the row sum's sink term carries P's factor) and splits (each
    partial LSE drops it)."""
    rng = _rng()
    B, Hq, Hk, D = 2, 4, 2, 32
    factor = 2.0 ** q_log2
    q = (_x((B, 1, Hq, D), rng) * factor).to(torch.bfloat16)
    kc, kd, kf = _fp8_cache(rng, (B, 40, Hk, D), E4M3, True, B)
    vc, vd, vf = _fp8_cache(rng, (B, 40, Hk, D), E4M3, True, B)
    seqlens = torch.tensor([23, 40], dtype=torch.int32)
    sinks = _x((Hq,), rng)
    scale = D ** -0.5 / factor
    ro, rl, _, _ = reference.attention_with_kvcache(q.double().numpy(), kf.numpy(), vf.numpy(),
                                                    cache_seqlens=seqlens.numpy(), scale=scale,
                                                    sinks=sinks.double().numpy())
    for num_splits in (1, 3):
        o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                             scale=scale, sinks=sinks, num_splits=num_splits, return_lse=True)
        assert o.dtype == torch.bfloat16
        err_o = float(np.abs(o.double().numpy() - ro).max())
        err_lse = float(np.abs(lse.double().numpy() - rl).max())
        assert err_o < 1e-2 and err_lse < 1e-4, (num_splits, err_o, err_lse)  # bf16 output: 2**-9 of |o| <~ 3


@pytest.mark.parametrize("q_dtype, kv_dtype, cvt", [("bf16", "fp8e4nv", "e4m3x2"), ("fp16", "fp8e5", "e5m2x2")])
def test_fp8_cache_is_converted_once_without_byte_loads(q_dtype, kv_dtype, cvt):
    """Compiled for sm_90 at the float8 cache's decode tile (m16n128), the K/V tiles are copied to
    shared memory 16 bytes at a time and converted by kvcache.FP8_ASM's PTX, without byte loads
    from shared memory: K at the dot's operand loads (8 bytes a load, attempt 58), V on the
    load's layout, through shared memory as 16-bit values; with both on the load's layout
    (attempt 56) twice the 16-bit stores. Triton's own conversion (the control) reads V byte by
    byte and copies 8 bytes at a time."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
    from compile_check_kvcache import compiled_with_runtime_divisibility

    from fmha.kernels.triton import kvcache

    pointers = {"Q": q_dtype, "K": kv_dtype, "V": kv_dtype, "O": q_dtype, "LSE": "fp32", "Alibi": "fp32",
                "Sinks": "fp32", "KDescale": "fp32", "VDescale": "fp32",
                **dict.fromkeys(("BlockTable", "KvIndptr", "CacheBatchIdx", "SeqlensK", "CuSeqlensQ"), "i32")}
    flags = dict.fromkeys(("HAS_CACHE_BATCH_IDX", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT", "HAS_SINK_TOKENS",
                           "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINKS", "SPLIT", "TABLE_INDPTR"), False)
    ptx, copies, shared = {}, {}, {}
    for mode in ("k_at_dot", "load_layout", "triton"):
        constexprs = dict(flags, PAGED=True, PAGE_PER_TILE=True, PAGE_SHIFT=-1, OFFSETS_32=True, KV_SAME_STRIDES=True,
                          ALIGN_BOTTOM_RIGHT=True, DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=128, BLOCK_DQK=128,
                          BLOCK_DV=128, KV_FP8=True, FP8_ASM=mode != "triton", FP8_K_AT_DOT=mode == "k_at_dot")
        ptx[mode] = p = compiled_with_runtime_divisibility(kvcache.splitkv_kernel, pointers, {"scale", "softcap"},
                                                           constexprs, 4, 3).asm["ptx"]
        copies[mode] = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", p)
        shared[mode] = collections.Counter(re.findall(r"\b((?:ld|st)\.shared(?:\.v\d)?\.[bu]\d+)", p))
    for mode in ("k_at_dot", "load_layout"):
        assert copies[mode] and set(copies[mode]) == {"0x10"}, copies[mode]  # pipelined, 16 bytes a copy
        assert shared[mode]["ld.shared.b8"] == 0 and shared[mode]["ld.shared.u8"] == 0, shared[mode]
        assert f"cvt.rn.f16x2.{cvt}" in ptx[mode] and "cvt.rn.bf16.f16" not in ptx[mode]
    assert shared["k_at_dot"]["ld.shared.v2.b32"] > 0  # K's operand loads, 8 bytes each
    assert 0 < shared["k_at_dot"]["st.shared.v4.b32"] < 0.6 * shared["load_layout"]["st.shared.v4.b32"], shared
    # the control: Triton's route reads bytes from shared memory and copies 8 bytes at a time
    assert shared["triton"]["ld.shared.b8"] > 0 and "0x8" in copies["triton"]


@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_cache_batch_prefill_mixes_decode_and_prefill_chunks(num_splits):
    """Chunked prefill over a paged float8 cache (bf16 queries, so fp16 products): sequence 0
    decodes, 1 prefills a chunk after cached tokens, 2 has no queries, 3 prefills from scratch;
    causal bottom-right per sequence, GQA 4:2, per-tensor descales; against the float64 reference
    on the dequantized cache."""
    rng = _rng()
    q_lens, cached, page, Hq, Hk, D = [1, 9, 0, 20], [30, 5, 4, 0], 8, 4, 2, 32
    lengths = [c + n for c, n in zip(cached, q_lens, strict=True)]
    pages_per_seq = -(-max(lengths) // page)
    num_pages = 4 * pages_per_seq + 1
    kc, kd, kf = _fp8_cache(rng, (num_pages, page, Hk, D), E4M3, False, 4)
    vc, vd, vf = _fp8_cache(rng, (num_pages, page, Hk, D), E4M3, False, 4)
    table = torch.randperm(num_pages, generator=rng)[:4 * pages_per_seq].reshape(4, pages_per_seq).int()
    q = _x((sum(q_lens), Hq, D), rng).to(torch.bfloat16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, cu_seqlens_q=cu,
                                         max_seqlen_q=max(q_lens), k_descale=kd, v_descale=vd, causal=True,
                                         num_splits=num_splits, return_lse=True)
    ro, rl, _, _ = reference.batch_prefill_with_kvcache(q.double().numpy(), kf.numpy(), vf.numpy(), cu.numpy(),
                                                        cache_seqlens=seqlens.numpy(), block_table=table.numpy(),
                                                        causal=True)
    assert float(np.abs(o.double().numpy() - ro).max()) < 1e-2  # bf16 outputs of |o| < 3
    assert float(np.abs(lse.double().numpy() - rl).max()) < 1e-4


def test_bf16_queries_over_a_float8_cache_take_fp16_products():
    """Compiled for sm_90 at the float8 cache's decode tile, bf16 queries take fp16 products with
    F16_DOTS (kvcache.FP8_F16_DOTS, what the launcher passes for them): the cache's bytes go to fp16
    by one cvt a pair, none through fp32 as the bf16 route's do, and the kernel's PTX is a sixth shorter."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
    from compile_check_kvcache import compiled_with_runtime_divisibility

    from fmha.kernels.triton import kvcache

    pointers = {"Q": "bf16", "K": "fp8e4nv", "V": "fp8e4nv", "O": "bf16", "LSE": "fp32", "Alibi": "fp32",
                "Sinks": "fp32", "KDescale": "fp32", "VDescale": "fp32",
                **dict.fromkeys(("BlockTable", "KvIndptr", "CacheBatchIdx", "SeqlensK", "CuSeqlensQ"), "i32")}
    flags = dict.fromkeys(("HAS_CACHE_BATCH_IDX", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT", "HAS_SINK_TOKENS",
                           "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINKS", "SPLIT", "TABLE_INDPTR", "PAGED",
                           "PAGE_PER_TILE"), False)
    ptx = {}
    for f16 in (False, True):
        constexprs = dict(flags, PAGE_SHIFT=-1, OFFSETS_32=True, KV_SAME_STRIDES=True, ALIGN_BOTTOM_RIGHT=True,
                          DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=128, BLOCK_DQK=128, BLOCK_DV=128, KV_FP8=True,
                          FP8_ASM=True, FP8_K_AT_DOT=True, F16_DOTS=f16)
        ptx[f16] = compiled_with_runtime_divisibility(kvcache.splitkv_kernel, pointers, {"scale", "softcap"},
                                                      constexprs, 4, 3).asm["ptx"]
    mma = {f16: set(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(\w+)\.", p)) for f16, p in ptx.items()}
    assert mma == {False: {"bf16"}, True: {"f16"}}, mma
    assert "cvt.f32.f16" in ptx[False] and "cvt.f32.f16" not in ptx[True]
    # instructions (inline asm's lines start at column 0) before the debug sections
    count = {f16: len(re.findall(r"^\s*[a-z][\w.]*[ \t]", p.split(".section")[0], re.M)) for f16, p in ptx.items()}
    assert count[True] < 0.85 * count[False], count


_ALL_DECODE_FEATURES = dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SINK_TOKENS=True, HAS_SOFTCAP=True, HAS_ALIBI=True)


@pytest.mark.parametrize("q_dtype, cache, page_size, features, head_dim", [
    ("bf16", "fp8e4nv", 0, {}, 128), ("fp16", "fp8e5", 0, {}, 128), ("bf16", "fp8e4nv", 64, {}, 128),
    ("bf16", "fp8e4nv", 16, {}, 128), ("fp16", "fp8e4nv", 48, {}, 128),
    ("bf16", "fp8e4nv", 0, _ALL_DECODE_FEATURES, 128),
    ("bf16", "fp8e4nv", 16, _ALL_DECODE_FEATURES, 128), ("bf16", "fp8e4nv", 0, {}, 64), ("bf16", "fp8e4nv", 16, {}, 64),
    ("bf16", "fp8e4nv", 0, {}, 256), ("fp16", "fp8e5", 64, _ALL_DECODE_FEATURES, 256)])
@pytest.mark.parametrize("split", [True, False])
def test_gluon_fp8_decode_copies_16_bytes_and_feeds_the_products_from_registers(q_dtype, cache, page_size, features,
                                                                               head_dim, split):
    """The Gluon fp8 decode (kernels/kvcache_gluon.py) compiled for sm_90 at the registry's tiles (32
    keys at D=64 and 128, 16 at D=256; 3 stages, one warp), contiguous or over pages of 64 keys (one
    page id a tile), 16 (one a row, a shift) or 48 (a division), plain or with every mask and score
    feature: K and V reach shared memory by 16-byte cp.async only (a tile's bytes / 16 a warp, two
    tiles ahead), each lane reads its bytes back by 16-byte (V at D=64: 8-byte) shared loads straight
    into the mma operands (fp16 m16n8k16: 32 for S and 32 for P V a 4 KB tile), and nothing else is
    stored to shared memory but q's one conversion: no 16-bit copy of V. A paged build reads 32-bit
    page ids."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fmha.kernels.gluon import kvcache as kvcache_gluon

    block_n = {64: 32, 128: 32, 256: 16}[head_dim]
    tile = block_n * head_dim  # bytes of K (and of V) a tile
    signature, constexprs, options = kvcache_gluon.compile_spec(q_dtype, block_n, 3, cache=cache, split=split,
                                                                page_size=page_size, head_dim=head_dim, **features)
    pointers = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    ptx = triton.compile(GluonASTSource(kvcache_gluon.decode_fp8_kernel, signature, constexprs, pointers),
                         target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    copies = re.findall(r"cp\.async\.\w+\.shared\.global(?:\.L2::\w+)? \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", ptx)
    assert len(copies) == 3 * 2 * tile // 512 and set(copies) <= {"0x10", "16"}, copies  # 2 tiles ahead + 1
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)) == 64 * tile // 4096
    shared = collections.Counter(re.findall(r"\b((?:ld|st)\.shared(?:\.v\d)?\.[bu]\d+)", ptx))
    q_stores = head_dim // 16  # q's conversion: 16 rows x D fp16 a warp
    assert shared["st.shared.v4.b32"] == q_stores and sum(n for op, n in shared.items() if op.startswith("st.")) \
        == q_stores, shared
    # K's and V's bytes of a tile over 32 lanes, besides q's conversion (as many 16-byte loads as stores)
    assert 16 * (shared["ld.shared.v4.b32"] - q_stores) + 8 * shared["ld.shared.v2.b32"] == 2 * tile // 32, shared
    assert not re.search(r"ld\.global(?:\.\w+)*\.(?:b8|u8)\b", ptx)
    words = len(re.findall(r"ld\.global(?:\.\w+)*\.b32\b", ptx))  # the length, 2 descales (and page ids)
    assert words == 3 + 2 * bool(features) if page_size == 0 else words > 3, words  # (+ a lane's 2 rows' ALiBi slopes)


def test_gluon_fp8_decode_refuses_calls_outside_its_signature_before_launching():
    """kvcache_gluon.launch_attention (reached only through the registry's fp8_decode signature)
    still names what it cannot take, before any launch: a head dim other than 64/128/256, more than
    16 query rows a (sequence, KV head); compile_spec refuses such a head dim too."""
    from fmha.kernels.gluon import kvcache as kvcache_gluon

    def call(seqlen_q, head_dim):
        q = torch.zeros(2, seqlen_q, 8, head_dim, dtype=torch.bfloat16)
        cache = torch.zeros(2, 64, 2, head_dim, dtype=E4M3)
        return kvcache_gluon.launch_attention(q, cache, cache, torch.empty_like(q), torch.empty(2, 8, seqlen_q),
                                              seqlens_k=torch.full((2,), 64, dtype=torch.int32), num_splits=1,
                                              scale=1.0, block_n=32, num_stages=3)

    with pytest.raises(ValueError, match=r"head dim 96 \(only \[64, 128, 256\]\)"):
        call(1, 96)
    with pytest.raises(ValueError, match=r"20 query rows a \(sequence, KV head\)"):
        call(5, 128)
    with pytest.raises(ValueError, match=r"head_dim=80: decode_fp8_kernel takes \[64, 128, 256\]"):
        kvcache_gluon.compile_spec("bf16", 32, 3, head_dim=80)


@pytest.mark.parametrize("rotary", [False, True])
def test_fp8_kvcache_append_rounds_new_tokens_into_the_cache(rotary):
    rng = _rng()
    B, Hq, Hk, D, n_new = 2, 2, 1, 16, 3
    q = _x((B, 1, Hq, D), rng).to(torch.bfloat16)
    # descales large enough that the new (rotated) tokens do not saturate (|x| < 448 * 0.025)
    kc, kd, _ = _fp8_cache(rng, (B, 24, Hk, D), E4M3, True, B, base=0.05)
    vc, vd, _ = _fp8_cache(rng, (B, 24, Hk, D), E4M3, True, B, base=0.05)
    k_new, v_new = _x((B, n_new, Hk, D), rng).to(torch.bfloat16), _x((B, n_new, Hk, D), rng).to(torch.bfloat16)
    seqlens = torch.tensor([5, 20], dtype=torch.int32)
    rot = dict(rotary_cos=_x((32, 4), rng), rotary_sin=_x((32, 4), rng)) if rotary else {}
    kc0 = kc.clone()
    o = fmha.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens, k_descale=kd,
                                    v_descale=vd, **rot)
    # the reference's appended (and rotated) rows, in float64
    _, _, rk, rv = reference.attention_with_kvcache(
        q.double().numpy(), (kc0.double() * kd[:, None, :, None]).numpy(), np.zeros(vc.shape), k=k_new.double().numpy(),
        v=v_new.double().numpy(), cache_seqlens=seqlens.numpy(),
        **{n: t.double().numpy() for n, t in rot.items()})
    for b, n in enumerate(seqlens.tolist()):
        for cache, d, ref in ((kc, kd, rk), (vc, vd, rv)):
            got = cache[b, n:n + n_new].double() * d[b][None, :, None]
            want = torch.from_numpy(ref[b, n:n + n_new])
            assert ((got - want).abs() <= 2.0**-4 * want.abs() + 2.0**-10 * float(d.max()) + 1e-6).all()
        assert torch.equal(kc[b, :n], kc0[b, :n])  # rows before cache_seqlens untouched
    if not rotary:  # attention over what is now in the cache
        ro, _, _, _ = reference.attention_with_kvcache(
            q.double().numpy(), (kc.double() * kd[:, None, :, None]).numpy(),
            (vc.double() * vd[:, None, :, None]).numpy(), cache_seqlens=(seqlens + n_new).numpy())
        assert float(np.abs(o.double().numpy() - ro).max()) < 2e-2  # bf16 P and output


def test_fp8_kvcache_arguments_are_checked():
    q = torch.randn(1, 1, 2, 16, dtype=torch.float16)
    c16 = torch.randn(1, 8, 2, 16, dtype=torch.float16)
    c8 = c16.to(E4M3)
    with pytest.raises(ValueError, match="descales are for float8 caches"):
        fmha.attention_with_kvcache(q, c16, c16, k_descale=torch.ones(()))
    with pytest.raises(ValueError, match=r"k_descale has shape \(2,\)"):
        fmha.attention_with_kvcache(q, c8, c8, k_descale=torch.ones(2))
    with pytest.raises(TypeError, match="v_cache.dtype"):
        fmha.attention_with_kvcache(q, c8, c8.float().to(E5M2))
    with pytest.raises(TypeError, match="q.dtype"):
        fmha.attention_with_kvcache(q.to(E4M3), c8, c8)
