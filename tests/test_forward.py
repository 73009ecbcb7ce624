"""Forward kernel through Triton's interpreter (CPU tensors) against the float64 reference."""

import pytest
import torch

import fmha
from fmha import reference
from fmha.testing.numerics import max_abs_error

from attn_testing import check_attention, make_qkv, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_plain_attention_matches_reference(rng, dtype, layout):
    q, k, v = make_qkv(rng, batch=2, nhead_q=3, nhead_k=3, seqlen_q=45, seqlen_k=70,
                       head_dim=64, dtype=dtype, layout=layout)
    check_attention(q, k, v, layout=layout)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 17), (17, 1), (17, 113), (113, 17), (33, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_sequence_lengths(rng, seqlen_q, seqlen_k, causal):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=32, dtype=torch.float16)
    check_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim,head_dim_v", [(1, 1), (40, 40), (80, 80), (96, 96), (200, 200),
                                                 (256, 256), (72, 40), (40, 128)])
def test_head_dims_are_padded_inside_the_kernel(rng, head_dim, head_dim_v):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=20, seqlen_k=37,
                       head_dim=head_dim, head_dim_v=head_dim_v, dtype=torch.float32)
    check_attention(q, k, v)


@pytest.mark.parametrize("nhead_q,nhead_k", [(6, 2), (7, 1), (4, 4)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_and_mqa_share_kv_heads(rng, nhead_q, nhead_k, layout):
    q, k, v = make_qkv(rng, batch=2, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=19, seqlen_k=40,
                       head_dim=32, dtype=torch.float16, layout=layout)
    check_attention(q, k, v, layout=layout)


@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 70), (70, 40), (50, 50)])
def test_causal_in_both_alignments(rng, mask_align, seqlen_q, seqlen_k):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=32, dtype=torch.float16)
    o, lse = check_attention(q, k, v, causal=True, mask_align=mask_align)
    if mask_align == "bottom_right" and seqlen_q > seqlen_k:
        # The first Sq - Sk rows see no key: output 0, lse -inf, never NaN.
        empty = seqlen_q - seqlen_k
        assert torch.all(o[:, :, :empty] == 0)
        assert torch.all(torch.isneginf(lse[:, :, :empty]))


def test_scale_is_applied(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=30, seqlen_k=30,
                       head_dim=32, dtype=torch.float32)
    o1, _ = check_attention(q, k, v, scale=0.3)
    o2, _ = check_attention(q, k, v)
    assert (o1 - o2).abs().max() > 1e-3


def test_arbitrary_strides_are_read_without_copies(rng):
    # Slices of a bigger buffer: non-contiguous batch/head/sequence strides.
    big = randn((3, 40, 5, 96), torch.float16, rng)
    q = big[::2, :33, 1:4, :64]  # bshd view, last dim contiguous
    k = big[1:3, 2:40, 0:3, 32:96]
    v = big[:2, 1:39, 2:5, 16:48]
    assert not q.is_contiguous()
    check_attention(q, k, v, layout="bshd", causal=True)


def test_v_column_major_is_read_by_strides(rng):
    q, k, _ = make_qkv(rng, batch=2, nhead_q=2, nhead_k=2, seqlen_q=20, seqlen_k=35,
                       head_dim=32, dtype=torch.float16)
    v_dmajor = randn((2, 2, 32, 35), torch.float16, rng)  # (B, H, D, S) in memory
    v = v_dmajor.transpose(-1, -2)  # logical (B, H, S, D), stride 1 along S
    assert v.stride(-1) != 1
    check_attention(q, k, v)
    assert fmha.problem_of(q, k, v).v_column_major


@pytest.mark.parametrize("window", [(8, 0), (5, 3), (-1, 4), (0, 0), (10, -1)])
@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
def test_sliding_window(rng, window, mask_align):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=40, seqlen_k=57,
                       head_dim=32, dtype=torch.float16)
    check_attention(q, k, v, window=window, mask_align=mask_align)


@pytest.mark.parametrize("window", [(4, 0), (-1, 0), (6, 2)])
def test_sink_tokens_stay_visible(rng, window):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=48, seqlen_k=64,
                       head_dim=32, dtype=torch.float16)
    check_attention(q, k, v, window=window, sink_size=5)


@pytest.mark.parametrize("bias_shape", ["full", "1h1k", "b1qk", "qk"])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_additive_bias_broadcasts(rng, bias_shape, bias_dtype):
    B, H, Sq, Sk = 2, 3, 21, 38
    q, k, v = make_qkv(rng, batch=B, nhead_q=H, nhead_k=H, seqlen_q=Sq, seqlen_k=Sk,
                       head_dim=32, dtype=torch.float16)
    shape = {"full": (B, H, Sq, Sk), "1h1k": (1, H, 1, Sk), "b1qk": (B, 1, Sq, Sk), "qk": (Sq, Sk)}
    bias = randn(shape[bias_shape], bias_dtype, rng)
    check_attention(q, k, v, bias=bias)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
def test_alibi(rng, per_batch, mask_align):
    B, H = 2, 4
    q, k, v = make_qkv(rng, batch=B, nhead_q=H, nhead_k=2, seqlen_q=30, seqlen_k=45,
                       head_dim=32, dtype=torch.float16)
    slopes = torch.rand((B, H) if per_batch else (H,), generator=rng) * 0.5
    check_attention(q, k, v, alibi_slopes=slopes, causal=True, mask_align=mask_align)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap_combined_with_bias(rng, softcap):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=30, seqlen_k=45,
                       head_dim=32, dtype=torch.float16)
    bias = randn((1, 2, 30, 45), torch.float32, rng)
    check_attention(q, k, v, softcap=softcap, bias=bias, scale=0.8)


@pytest.mark.parametrize("causal", [False, True])
def test_sink_logits_join_the_denominator(rng, causal):
    q, k, v = make_qkv(rng, batch=2, nhead_q=4, nhead_k=2, seqlen_q=40, seqlen_k=30,
                       head_dim=32, dtype=torch.float16)
    sinks = randn((4,), torch.float32, rng, scale=2.0)
    o, lse = check_attention(q, k, v, sinks=sinks, causal=causal)
    if causal:  # rows 0..9 see no key: lse is the sink logit, output 0
        assert torch.allclose(lse[:, :, :10], sinks[None, :, None].expand(2, 4, 10))
        assert torch.all(o[:, :, :10] == 0)


def test_dropout_output_equals_reference_with_returned_mask(rng):
    q, k, v = make_qkv(rng, batch=2, nhead_q=2, nhead_k=2, seqlen_q=33, seqlen_k=47,
                       head_dim=32, dtype=torch.float16)
    check_attention(q, k, v, dropout_p=0.3, seed=1234, offset=7, causal=True)


def test_dropout_is_reproducible_and_seed_dependent(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=64, seqlen_k=64,
                       head_dim=16, dtype=torch.float16)
    o1, m1 = fmha.attention(q, k, v, dropout_p=0.25, seed=5, return_dropout_mask=True)
    o2, m2 = fmha.attention(q, k, v, dropout_p=0.25, seed=5, return_dropout_mask=True)
    _, m3 = fmha.attention(q, k, v, dropout_p=0.25, seed=6, return_dropout_mask=True)
    _, m4 = fmha.attention(q, k, v, dropout_p=0.25, seed=5, offset=1, return_dropout_mask=True)
    assert torch.equal(o1, o2) and torch.equal(m1, m2)
    assert not torch.equal(m1, m3) and not torch.equal(m1, m4)
    keep = m1.float().mean().item()  # 8192 draws: std of the mean ~ 0.005
    assert abs(keep - 0.75) < 0.03
    # Independent across seeds: agreement rate ~ 0.75^2 + 0.25^2 = 0.625.
    agree = (m1 == m3).float().mean().item()
    assert abs(agree - 0.625) < 0.03


def test_feature_combination(rng):
    """Window + sink tokens + bias + ALiBi + soft-cap + sinks + GQA + bshd in one call."""
    B, Hq, Hk, Sq, Sk = 2, 4, 2, 37, 52
    q, k, v = make_qkv(rng, batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=Sq, seqlen_k=Sk,
                       head_dim=40, head_dim_v=24, dtype=torch.float16, layout="bshd")
    check_attention(q, k, v, layout="bshd", window=(9, 2), sink_size=3,
                    bias=randn((1, Hq, Sq, Sk), torch.float32, rng),
                    alibi_slopes=torch.rand(Hq, generator=rng) * 0.3, softcap=4.0,
                    sinks=randn((Hq,), torch.float32, rng), dropout_p=0.2, seed=3)


def _varlen_case(rng, dtype, lens_q, lens_k, nhead_q=4, nhead_k=2, head_dim=32):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = randn((int(cu_q[-1]), nhead_q, head_dim), dtype, rng)
    k = randn((int(cu_k[-1]), nhead_k, head_dim), dtype, rng)
    v = randn((int(cu_k[-1]), nhead_k, head_dim), dtype, rng)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_seqused", [False, True])
def test_varlen_matches_reference_with_empty_sequences(rng, causal, use_seqused):
    lens_q, lens_k = [5, 0, 33, 1, 17], [9, 4, 40, 0, 17]
    q, k, v, cu_q, cu_k = _varlen_case(rng, torch.float16, lens_q, lens_k)
    seqused = torch.tensor([7, 0, 25, 0, 17], dtype=torch.int32) if use_seqused else None
    sinks = randn((4,), torch.float32, rng)
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused,
                                   causal=causal, sinks=sinks, return_lse=True)
    ref_o, ref_lse = reference.attention_varlen_fwd(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), cu_q.numpy(), cu_k.numpy(),
        seqused_k=None if seqused is None else seqused.numpy(), causal=causal,
        sinks=sinks.double().numpy())
    assert not torch.isnan(o).any()
    assert max_abs_error(o, torch.from_numpy(ref_o)) < 2e-3
    assert max_abs_error(lse, torch.from_numpy(ref_lse)) < 1e-3


def test_varlen_with_bias_window_and_dropout(rng):
    lens_q, lens_k = [12, 30, 7], [20, 30, 3]
    q, k, v, cu_q, cu_k = _varlen_case(rng, torch.float32, lens_q, lens_k)
    bias = randn((3, 1, 30, 30), torch.float32, rng)
    o, lse, mask = fmha.attention_varlen(
        q, k, v, cu_q, cu_k, 30, 30, bias=bias, window=(6, 1), dropout_p=0.2, seed=9,
        return_lse=True, return_dropout_mask=True)
    assert mask.shape == (3, 4, 30, 30)
    ref_o, ref_lse = reference.attention_varlen_fwd(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), cu_q.numpy(), cu_k.numpy(),
        bias=bias.double().numpy(), window=(6, 1), dropout_p=0.2, dropout_mask=mask.numpy())
    assert max_abs_error(o, torch.from_numpy(ref_o)) < 1e-4
    assert max_abs_error(lse, torch.from_numpy(ref_lse)) < 1e-4


def test_varlen_combines_alibi_softcap_sink_tokens_and_gqa(rng):
    lens_q, lens_k = [9, 26, 1], [30, 26, 4]
    q, k, v, cu_q, cu_k = _varlen_case(rng, torch.float32, lens_q, lens_k, nhead_q=6, nhead_k=2)
    slopes = torch.rand(3, 6, generator=rng) * 0.3
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, 26, 30, alibi_slopes=slopes, softcap=2.5,
                                   window=(5, 0), sink_size=2, mask_align="top_left", return_lse=True)
    ref_o, ref_lse = reference.attention_varlen_fwd(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), cu_q.numpy(), cu_k.numpy(),
        alibi_slopes=slopes.double().numpy(), softcap=2.5, window=(5, 0), sink_size=2,
        mask_align="top_left")
    assert max_abs_error(o, torch.from_numpy(ref_o)) < 1e-4
    assert max_abs_error(lse, torch.from_numpy(ref_lse)) < 1e-4
