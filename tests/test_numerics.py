"""The validation machinery itself: the float64 torch truth and the 2x rule can fail."""

import numpy as np
import pytest
import torch

from fmha import reference
from fmha.testing import numerics

from attn_testing import randn


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True), dict(causal=True, mask_align="top_left"), dict(window=(4, 2), sink_size=2),
    dict(softcap=3.0), dict(scale=0.7), dict(alibi=True), dict(bias=True), dict(sinks=True), dict(dropout=True),
])
def test_torch_float64_truth_matches_the_numpy_reference(rng, kw):
    B, Hq, Hk, Sq, Sk = 2, 4, 2, 9, 13
    q, k, v = randn((B, Hq, Sq, 8), torch.float64, rng), randn((B, Hk, Sk, 8), torch.float64, rng), \
        randn((B, Hk, Sk, 8), torch.float64, rng)
    kw = dict(kw)
    extra = {}
    if kw.pop("alibi", False):
        extra["alibi_slopes"] = torch.rand(B, Hq, generator=rng, dtype=torch.float64)
    if kw.pop("bias", False):
        extra["bias"] = randn((1, Hq, Sq, Sk), torch.float64, rng)
    if kw.pop("sinks", False):
        extra["sinks"] = randn((Hq,), torch.float64, rng)
    if kw.pop("dropout", False):
        extra["dropout_p"] = 0.3
        extra["dropout_mask"] = torch.rand(B, Hq, Sq, Sk, generator=rng) > 0.3
    o, lse = numerics.torch_attention(q, k, v, compute_dtype=torch.float64, **kw, **extra)
    np_extra = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in extra.items()}
    ref_o, ref_lse = reference.attention_fwd(q.numpy(), k.numpy(), v.numpy(), **kw, **np_extra)
    assert np.allclose(o.numpy(), ref_o, atol=1e-12)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse.numpy()))
    assert np.allclose(lse.numpy()[finite], ref_lse[finite], atol=1e-12)


def test_compare_fails_on_a_wrong_output_and_passes_the_baseline(rng):
    truth = randn((64, 64), torch.float64, rng)
    baseline = truth.to(torch.bfloat16).double()
    assert numerics.compare("o", baseline, truth, baseline, torch.bfloat16).ok
    wrong = baseline.clone()
    wrong[3, 5] += 0.1
    c = numerics.compare("o", wrong, truth, baseline, torch.bfloat16)
    assert not c.ok and "FAIL" in str(c)
    nan = baseline.clone()
    nan[0, 0] = float("nan")
    assert not numerics.compare("o", nan, truth, baseline, torch.bfloat16).ok


def test_fp32_slack_is_relative_to_the_truths_magnitude_above_1(rng):
    """fp32 values of magnitude ~11 (CI's property-test case): the slack is 2e-5 x 11, not a
    flat 2e-5; below magnitude 1 it stays 2e-5."""
    truth = (randn((64,), torch.float64, rng) * 11 / 3).clamp(-11.0, 11.0)  # (the largest magnitude is 11:
    truth[0] = 11.0  # an unclamped draw above 11 widened the slack past 3e-4 on some seeds)
    baseline = truth + 1e-5
    assert numerics.compare("dq", truth + 1.5e-4, truth, baseline, torch.float32).ok  # 1.5e-4 <= 2e-5 + 2.2e-4
    assert not numerics.compare("dq", truth + 3e-4, truth, baseline, torch.float32).ok
    small = truth / 22  # magnitude 0.5: flat slack
    assert not numerics.compare("dq", small + 5e-5, small, small + 1e-5, torch.float32).ok  # > 2e-5 + 2e-5


def test_rounding_slack_scales_with_dtype(rng):
    truth = randn((256,), torch.float64, rng)
    assert numerics.rounding_slack(truth, torch.bfloat16) > numerics.rounding_slack(truth, torch.float16) > 0
    assert numerics.rounding_slack(truth, torch.float32) < 1e-6


def test_compare_never_passes_an_infinite_error_even_against_a_void_bound(rng):
    truth = randn((8, 8), torch.float64, rng)
    overflowed = truth.clone()
    overflowed[1, 1] = float("inf")  # a baseline that overflowed: bound = inf
    nan = truth.clone()
    nan[2, 2] = float("nan")
    c = numerics.compare("o", nan, truth, overflowed, torch.float16)
    assert c.bound == float("inf") and not c.ok
    nan_truth = truth.clone()
    nan_truth[0, 0] = float("nan")
    assert not numerics.compare("o", truth, nan_truth, nan_truth, torch.float16).ok


def test_torch_truth_gradients_of_rows_that_see_nothing_are_zero_not_nan(rng):
    """Sq > Sk, bottom-right causal: the first rows see no key. Their lse is -inf; its
    gradient (dlse) and dO must give 0 there, not NaN through log(0)."""
    q = randn((1, 2, 7, 8), torch.float64, rng).requires_grad_()
    k, v = (randn((1, 2, 4, 8), torch.float64, rng).requires_grad_() for _ in range(2))
    o, lse = numerics.torch_attention(q, k, v, compute_dtype=torch.float64, causal=True)
    assert torch.isneginf(lse[:, :, :3]).all() and (o[:, :, :3] == 0).all()
    grads = torch.autograd.grad((o, lse), (q, k, v), (torch.randn_like(o), torch.randn_like(lse)))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, :, :3] == 0).all()


def test_torch_attention_without_keys_gives_zero_rows_and_minus_inf_lse():
    """The baseline of a sequence with no (used) keys, e.g. seqused_k = 0 in varlen (example 18
    on the GPU crashed here): o = 0, lse = -inf; with sink logits lse = the sink."""
    q = torch.randn(1, 2, 3, 8)
    empty = torch.randn(1, 1, 0, 8)
    o, lse = numerics.torch_attention(q, empty, empty)
    assert o.shape == (1, 2, 3, 8) and torch.equal(o, torch.zeros_like(o))
    assert torch.equal(lse, torch.full((1, 2, 3), float("-inf")))
    sinks = torch.tensor([0.5, -1.0])
    _, lse = numerics.torch_attention(q, empty, empty, sinks=sinks)
    assert torch.allclose(lse, sinks[None, :, None].expand(1, 2, 3))


@pytest.mark.parametrize("bias_shape", [None, (1, 4, 9, 13), (3, 4, 9, 13), (9, 13)])
def test_per_element_truth_gradients_equal_whole_batch_autograd(rng, bias_shape):
    """attn_testing.torch_attention_grads (one batch element at a time, to bound the float64
    truth's memory) gives the gradients of autograd over the whole batch: GQA, causal, ALiBi
    per (batch, head), dropout, sinks, a bias shared by or per batch element, dlse."""
    from attn_testing import torch_attention_grads

    B, Hq, Hk, Sq, Sk = 3, 4, 2, 9, 13
    q, do = (randn((B, Hq, Sq, 8), torch.float32, rng) for _ in range(2))
    k, v = (randn((B, Hk, Sk, 8), torch.float32, rng) for _ in range(2))
    bias = None if bias_shape is None else randn(bias_shape, torch.float32, rng)
    sinks, dlse = randn((Hq,), torch.float32, rng), randn((B, Hq, Sq), torch.float32, rng)
    alibi = torch.rand(B, Hq, generator=rng)
    mask = torch.rand(B, Hq, Sq, Sk, generator=rng) > 0.3
    extra = dict(causal=True, dropout_p=0.3)
    got = torch_attention_grads(q, k, v, do, dlse, bias, sinks, alibi, mask, extra, torch.float64)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    r_bias = None if bias is None else bias.double().requires_grad_()
    r_sinks = sinks.double().requires_grad_()
    o, lse = numerics.torch_attention(*leaves, compute_dtype=torch.float64, bias=r_bias, sinks=r_sinks,
                                      alibi_slopes=alibi, dropout_mask=mask, **extra)
    inputs = leaves + ([r_bias] if bias is not None else []) + [r_sinks]
    want = torch.autograd.grad((o, lse), inputs, (do.double(), dlse.double()))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float64
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)
