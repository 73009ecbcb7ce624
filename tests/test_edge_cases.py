"""Edge cases through Triton's interpreter (CPU tensors): empty and length-1 sequences,
rows that see no key, huge logits, NaN containment, extreme shapes, and the backward of
some of these. Outputs must never be NaN unless an input NaN is visible to the row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fmha
from fmha import reference
from fmha.testing.numerics import max_abs_error

from attn_testing import check_attention, check_backward, make_qkv, randn


def assert_no_nan(**tensors):
    for name, t in tensors.items():
        assert not torch.isnan(t).any(), f"NaN in {name}"


# ----------------------------------------------------------------------------------------
# Empty sequences


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_seqlen_q_zero_gives_empty_outputs(rng, layout):
    q, k, v = make_qkv(rng, batch=2, nhead_q=2, nhead_k=1, seqlen_q=0, seqlen_k=9, head_dim=16,
                       head_dim_v=8, dtype=torch.float16, layout=layout)
    o, lse = fmha.attention(q, k, v, layout=layout, causal=True, return_lse=True)
    assert o.shape == ((2, 2, 0, 8) if layout == "bhsd" else (2, 0, 2, 8))
    assert lse.shape == (2, 2, 0) and lse.dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_seqlen_k_zero_gives_zeros_and_minus_inf_lse(rng, causal, layout):
    q, k, v = make_qkv(rng, batch=2, nhead_q=4, nhead_k=2, seqlen_q=7, seqlen_k=0, head_dim=16,
                       dtype=torch.float16, layout=layout)
    o, lse = fmha.attention(q, k, v, layout=layout, causal=causal, return_lse=True)
    assert o.shape == q.shape
    assert torch.all(o == 0), "rows without keys must output 0"
    assert torch.all(torch.isneginf(lse)), "rows without keys must have lse = -inf"


def test_seqlen_k_zero_with_sinks_gives_the_sink_logit(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=3, nhead_k=3, seqlen_q=5, seqlen_k=0, head_dim=16,
                       dtype=torch.float32)
    sinks = torch.tensor([0.5, -2.0, 3.0])
    o, lse = fmha.attention(q, k, v, sinks=sinks, return_lse=True)
    assert torch.all(o == 0)
    assert torch.equal(lse, sinks[None, :, None].expand(1, 3, 5))


def test_both_seqlens_zero(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=0, seqlen_k=0, head_dim=16,
                       dtype=torch.float32)
    o, lse = fmha.attention(q, k, v, return_lse=True)
    assert o.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def test_backward_with_seqlen_k_zero(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=6, seqlen_k=0, head_dim=16,
                       dtype=torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = fmha.attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert torch.all(dq == 0)
    assert dk.shape == k.shape and dv.shape == v.shape


def test_backward_with_seqlen_q_zero(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=0, seqlen_k=6, head_dim=16,
                       dtype=torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = fmha.attention(q, k, v, return_lse=True)
    dq, dk, dv = torch.autograd.grad((o, lse), (q, k, v), (torch.ones_like(o), torch.ones_like(lse)))
    assert dq.shape == q.shape
    assert torch.all(dk == 0) and torch.all(dv == 0)


def _cu(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


def test_varlen_zero_length_sequences_forward_and_backward(rng):
    """Sequences with no queries or no keys: zero output and grads, lse -inf, no NaN."""
    lens_q, lens_k = [3, 0, 4, 2, 0], [0, 5, 4, 3, 0]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    Hq, Hk, Dh = 4, 2, 16
    q = randn((sum(lens_q), Hq, Dh), torch.float32, rng).requires_grad_()
    k = randn((sum(lens_k), Hk, Dh), torch.float32, rng).requires_grad_()
    v = randn((sum(lens_k), Hk, Dh), torch.float32, rng).requires_grad_()
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                   return_lse=True)
    o_, lse_ = o.detach(), lse.detach()
    assert_no_nan(o=o_)
    # Sequence 0 has 3 queries and no keys.
    assert torch.all(o_[:3] == 0) and torch.all(torch.isneginf(lse_[:, :3]))
    ref_o, ref_lse = reference.attention_varlen_fwd(
        *(t.detach().double().numpy() for t in (q, k, v)), cu_q.numpy(), cu_k.numpy(), causal=True)
    assert max_abs_error(o_, torch.from_numpy(ref_o)) < 1e-5
    assert max_abs_error(lse_, torch.from_numpy(ref_lse)) < 1e-5

    do = randn(o.shape, torch.float32, rng)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert_no_nan(dq=dq, dk=dk, dv=dv)
    assert torch.all(dq[:3] == 0), "queries of a sequence without keys get dq = 0"
    assert torch.all(dk[:5] == 0) and torch.all(dv[:5] == 0), "keys of a sequence without queries"
    ref = reference.attention_varlen_bwd(
        *(t.detach().double().numpy() for t in (q, k, v)), do.double().numpy(), cu_q.numpy(),
        cu_k.numpy(), causal=True)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert max_abs_error(got, torch.from_numpy(ref[name])) < 1e-4, name


# ----------------------------------------------------------------------------------------
# Length 1, fully masked rows


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 23), (23, 1)])
def test_seqlen_one(rng, causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(rng, batch=2, nhead_q=2, nhead_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=16, dtype=torch.float16)
    check_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("mask_align,window,seqlen_q,seqlen_k,masked", [
    # bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key
    ("bottom_right", (-1, 0), 20, 6, range(0, 14)),
    # bottom-right, window entirely to the left of the diagonal for the first rows
    ("bottom_right", (3, 0), 20, 6, range(0, 14)),
    # top-left, the diagonal leaves the key range: rows >= Sk see nothing with left = 0
    ("top_left", (0, 0), 20, 6, range(6, 20)),
    ("top_left", (2, 1), 20, 6, range(8, 20)),
])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows_give_zero_output(rng, mask_align, window, seqlen_q, seqlen_k, masked,
                                            with_sinks):
    H = 2
    q, k, v = make_qkv(rng, batch=1, nhead_q=H, nhead_k=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=16, dtype=torch.float16)
    sinks = torch.tensor([0.25, -1.5]) if with_sinks else None
    visible = reference.visible_mask(seqlen_q, seqlen_k, window=window, mask_align=mask_align)
    assert [i for i in range(seqlen_q) if not visible[i].any()] == list(masked)
    o, lse = check_attention(q, k, v, window=window, mask_align=mask_align, sinks=sinks)
    rows = list(masked)
    assert torch.all(o[:, :, rows] == 0)
    expect = sinks[None, :, None] if with_sinks else torch.tensor(float("-inf"))
    assert torch.equal(lse[:, :, rows], expect.expand(1, H, len(rows)))
    others = [i for i in range(seqlen_q) if i not in masked]
    assert torch.isfinite(lse[:, :, others]).all()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_backward_through_fully_masked_rows(rng, with_sinks):
    """Rows that see no key: zero dq, no NaN anywhere, even with a gradient on lse."""
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=24, seqlen_k=8, head_dim=16,
                       dtype=torch.float32)
    sinks = torch.tensor([0.5, -1.0]) if with_sinks else None
    grads = check_backward(q, k, v, causal=True, sinks=sinks, with_dlse=with_sinks)
    assert torch.all(grads["dq"][:, :, :16] == 0)


_SINK_TILE_BUG = (
    "fwd kernel: for a query tile that sees no key through the window (bottom-right, "
    "Sq - Sk >= block_m + right), key_range returns lo = hi = 0 and the sink-token pass covers "
    "[0, min(sink_size, lo)) = []: the tile's rows drop the sink tokens (o = 0, lse = -inf)")


@pytest.mark.parametrize("seqlen_q,seqlen_k,sink_size,window", [
    (33, 1, 1, (-1, 0)), (64, 1, 1, (-1, 0)), (80, 20, 3, (2, 0)),
])
def test_sink_tokens_stay_visible_to_query_tiles_left_of_the_window(seqlen_q, seqlen_k, sink_size,
                                                                     window):
    """Every row sees the sink tokens, even rows whose whole tile is masked by the window."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(gen, batch=1, nhead_q=1, nhead_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=8, dtype=torch.float32)
    assert reference.visible_mask(seqlen_q, seqlen_k, window=window, sink_size=sink_size).any(1).all()
    o, lse = fmha.attention(q, k, v, window=window, sink_size=sink_size, return_lse=True)
    dead = torch.isneginf(lse[0, 0]).nonzero().flatten().tolist()
    assert not dead, f"rows {dead[0]}..{dead[-1]} lost their sink tokens (lse = -inf)"
    check_attention(q, k, v, window=window, sink_size=sink_size)


def test_sink_token_gradients_for_query_tiles_left_of_the_window():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(gen, batch=1, nhead_q=2, nhead_k=1, seqlen_q=40, seqlen_k=4, head_dim=16,
                       dtype=torch.float32)
    torch.manual_seed(0)
    check_backward(q, k, v, causal=True, sink_size=2)


# ----------------------------------------------------------------------------------------
# Numerics


def _huge_logit_problem(rng, dtype):
    """q scaled by 1e3: logits ~ 1e3, far beyond exp's range (exp overflows fp32 at 89)."""
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=24, seqlen_k=40, head_dim=32,
                       dtype=torch.float32)
    return (q * 1e3).to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_huge_logits_do_not_overflow(rng, dtype):
    q, k, v = _huge_logit_problem(rng, dtype)
    o, lse = check_attention(q, k, v, causal=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 100  # the logits really are huge


def test_bf16_output_is_rounded_to_nearest():
    # Three keys with equal logits: o = (1 + 1 + 0) / 3 = 0.6667 in fp32. Round to nearest
    # gives 0.66796875 (torch, the GPU); truncation gives 0.6640625.
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 3, 16, dtype=torch.bfloat16)
    v = torch.tensor([1.0, 1.0, 0.0], dtype=torch.bfloat16).reshape(1, 1, 3, 1).repeat(1, 1, 1, 16)
    o = fmha.attention(q, k, v)
    expect = torch.tensor(2 / 3).to(torch.bfloat16)
    assert torch.all(o == expect), f"got {o.flatten()[0].item()}, round to nearest gives {expect.item()}"


def test_huge_logits_backward(rng):
    """q scaled by 30 (logits ~ 100, beyond fp32 exp's range): finite gradients within a
    relative 5e-5 of the float64 truth.

    Not the 2x rule: with P almost one-hot the fp32 baseline (torch autograd through softmax)
    is nearly exact, while the flash backward recomputes P = exp(s - lse) from an fp32 lse of
    ~100 (about one ulp of 100 in the exponent); q = 100x violates the 2x rule by up to 10x.
    """
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=16, seqlen_k=20, head_dim=16,
                       dtype=torch.float32)
    q, k, v = (q * 30).requires_grad_(), k.requires_grad_(), v.requires_grad_()
    o = fmha.attention(q, k, v, causal=True)
    do = randn(o.shape, torch.float32, rng)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = reference.attention_bwd(*(t.detach().double().numpy() for t in (q, k, v)),
                                  do.double().numpy(), causal=True)
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert torch.isfinite(got).all(), name
        truth = torch.from_numpy(ref[name])
        assert max_abs_error(got, truth) <= 5e-5 * float(truth.abs().max()), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_nan_in_one_key_reaches_only_rows_that_see_it(rng, dtype):
    S, nan_key = 40, 21
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=S, seqlen_k=S, head_dim=16,
                       dtype=dtype)
    k[0, 0, nan_key, 5] = float("nan")
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    blind = slice(0, nan_key)  # causal: row i sees keys 0..i
    assert not torch.isnan(o[:, :, blind]).any(), "NaN leaked into rows that cannot see the key"
    assert not torch.isnan(lse[:, :, blind]).any(), "NaN leaked into lse of rows that cannot see it"
    assert torch.isnan(o[:, :, nan_key:]).any(dim=-1).all(), "rows that see a NaN key must be NaN"
    # The rows that cannot see the key are exactly right.
    clean_k = k.clone()
    clean_k[0, 0, nan_key, 5] = 0
    ref_o, ref_lse = fmha.attention(q, clean_k, v, causal=True, return_lse=True)
    assert torch.equal(o[:, :, blind], ref_o[:, :, blind])
    truth_o, _ = reference.attention_fwd(q.double().numpy(), clean_k.double().numpy(),
                                         v.double().numpy(), causal=True)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert max_abs_error(o[:, :, blind], torch.from_numpy(truth_o)[:, :, blind]) < tol


def test_nan_in_a_key_outside_the_window_is_harmless(rng):
    S = 40
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=2, seqlen_q=S, seqlen_k=S, head_dim=16,
                       dtype=torch.float32)
    k[:, :, 0] = float("nan")  # only rows 0..3 see key 0 with a left window of 3
    o, lse = fmha.attention(q, k, v, window=(3, 0), return_lse=True)
    assert not torch.isnan(o[:, :, 4:]).any() and not torch.isnan(lse[:, :, 4:]).any()
    assert torch.isnan(o[:, :, :4]).any(dim=-1).all()


# ----------------------------------------------------------------------------------------
# Extreme shapes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 3), (2, 64)])
def test_very_unequal_sequence_lengths(rng, causal, mask_align, seqlen_q, seqlen_k):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       head_dim=16, dtype=torch.float16)
    check_attention(q, k, v, causal=causal, mask_align=mask_align)


@pytest.mark.parametrize("head_dim", [1, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_dim_extremes(rng, head_dim, dtype):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=17, seqlen_k=20,
                       head_dim=head_dim, dtype=dtype)
    check_attention(q, k, v, causal=True)


@pytest.mark.parametrize("head_dim", [1, 256])
def test_head_dim_extremes_backward(rng, head_dim):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=9, seqlen_k=12,
                       head_dim=head_dim, dtype=torch.float16)
    check_backward(q, k, v)


def test_batch_64_with_tiny_sequences(rng):
    q, k, v = make_qkv(rng, batch=64, nhead_q=1, nhead_k=1, seqlen_q=2, seqlen_k=3, head_dim=8,
                       dtype=torch.float16, layout="bshd")
    check_attention(q, k, v, layout="bshd", causal=True)


def test_varlen_64_tiny_sequences(rng):
    gen = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))
    lens_q, lens_k = gen.integers(0, 4, 64), gen.integers(0, 4, 64)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = randn((int(lens_q.sum()), 2, 8), torch.float32, rng)
    k = randn((int(lens_k.sum()), 1, 8), torch.float32, rng)
    v = randn((int(lens_k.sum()), 1, 8), torch.float32, rng)
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                                   return_lse=True)
    ref_o, ref_lse = reference.attention_varlen_fwd(q.double().numpy(), k.double().numpy(),
                                                    v.double().numpy(), cu_q.numpy(), cu_k.numpy())
    assert_no_nan(o=o)
    assert max_abs_error(o, torch.from_numpy(ref_o)) < 1e-5
    assert max_abs_error(lse, torch.from_numpy(ref_lse)) < 1e-5


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_8_to_1(rng, layout):
    q, k, v = make_qkv(rng, batch=2, nhead_q=8, nhead_k=1, seqlen_q=19, seqlen_k=27, head_dim=16,
                       dtype=torch.float16, layout=layout)
    check_attention(q, k, v, layout=layout, causal=True)


def test_gqa_8_to_1_backward(rng):
    q, k, v = make_qkv(rng, batch=1, nhead_q=8, nhead_k=1, seqlen_q=12, seqlen_k=15, head_dim=16,
                       dtype=torch.float32)
    check_backward(q, k, v, causal=True)
