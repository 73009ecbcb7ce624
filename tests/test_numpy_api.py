"""fmha.numpy_api: numpy arrays in, numpy results out, through the interpreter on the CPU."""

import ml_dtypes
import numpy as np
import pytest
import torch

import fmha
from fmha import reference
from fmha.numpy_api import NumpyResult, attention, to_numpy, to_torch
from fmha.testing import numerics

NP_DTYPES = {np.float16: torch.float16, np.float32: torch.float32, ml_dtypes.bfloat16: torch.bfloat16}
FAST = dict(device="cpu", warmup=0, repeat=1)


def _arrays(rng, dtype, shape_q, shape_kv, shape_v=None):
    def draw(shape):
        return torch.randn(shape, generator=rng).numpy().astype(dtype)

    return draw(shape_q), draw(shape_kv), draw(shape_v or shape_kv)


def _check_against_reference(q, k, v, out, lse, torch_dtype, **kw):
    """2x rule against fmha.reference, with torch_attention in the inputs' dtype as baseline."""
    qt, kt, vt = (torch.from_numpy(a.astype(np.float32)).to(torch_dtype) for a in (q, k, v))
    ref_o, ref_lse = reference.attention_fwd(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    base_o, base_lse = numerics.torch_attention(qt, kt, vt, **kw)
    out_t = torch.from_numpy(out.astype(np.float32))
    for c in (numerics.compare("o", out_t, torch.from_numpy(ref_o), base_o, torch_dtype),
              numerics.compare("lse", torch.from_numpy(lse), torch.from_numpy(ref_lse), base_lse,
                               torch.float32)):
        assert c.ok, str(c)


@pytest.mark.parametrize("dtype", list(NP_DTYPES), ids=["fp16", "fp32", "bf16"])
def test_output_matches_reference_and_keeps_dtype(rng, dtype):
    q, k, v = _arrays(rng, dtype, (1, 2, 24, 32), (1, 2, 40, 32))
    r = attention(q, k, v, causal=True, **FAST)
    assert isinstance(r, NumpyResult)
    assert r.out.dtype == np.dtype(dtype) and r.out.shape == (1, 2, 24, 32)
    assert r.lse.dtype == np.float32 and r.lse.shape == (1, 2, 24)
    _check_against_reference(q, k, v, r.out, r.lse, NP_DTYPES[dtype], causal=True)


def test_timing_kernel_and_problem_fields(rng):
    q, k, v = _arrays(rng, np.float16, (1, 2, 16, 16), (1, 2, 16, 16))
    r = attention(q, k, v, device="cpu", warmup=1, repeat=2)
    assert r.time_ms > 0 and r.tflops > 0
    assert r.problem == fmha.problem_of(*(torch.from_numpy(a) for a in (q, k, v)))
    assert r.kernel == fmha.get_dispatcher().plan_forward(r.problem).config(fmha.Family.FWD).name
    assert r.tflops == pytest.approx(r.problem.flops_fwd() / (r.time_ms * 1e-3) / 1e12)


def test_bshd_layout_gqa_and_numpy_keyword_arrays(rng):
    q, k, v = _arrays(rng, np.float32, (1, 20, 4, 16), (1, 28, 2, 16), (1, 28, 2, 8))
    sinks = torch.randn(4, generator=rng).numpy()
    r = attention(q, k, v, layout="bshd", window=(6, 1), sinks=sinks, **FAST)
    assert r.out.shape == (1, 20, 4, 8)
    assert r.problem.layout == "bshd" and r.problem.sinks
    qb, kb, vb = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    kw = dict(window=(6, 1), sinks=sinks)
    ref_o, _ = reference.attention_fwd(*(a.astype(np.float64) for a in (qb, kb, vb)), **kw)
    assert np.abs(np.swapaxes(r.out, 1, 2) - ref_o).max() < 1e-4


def test_dropout_mask_is_returned_when_asked(rng):
    q, k, v = _arrays(rng, np.float16, (1, 2, 16, 16), (1, 2, 16, 16))
    r = attention(q, k, v, dropout_p=0.3, seed=7, return_dropout_mask=True, **FAST)
    assert r.dropout_mask is not None and r.dropout_mask.dtype == np.bool_
    assert r.dropout_mask.shape == (1, 2, 16, 16)
    ref_o, _ = reference.attention_fwd(*(a.astype(np.float64) for a in (q, k, v)), dropout_p=0.3,
                                       dropout_mask=r.dropout_mask)
    assert np.abs(r.out.astype(np.float64) - ref_o).max() < 5e-3


@pytest.mark.parametrize("bad", [np.float64, np.int32])
@pytest.mark.parametrize("which", ["q", "k"])
def test_unsupported_numpy_dtype_is_a_type_error_naming_the_argument(rng, bad, which):
    q, k, v = _arrays(rng, np.float16, (1, 2, 8, 16), (1, 2, 8, 16))
    arrays = {"q": q, "k": k, "v": v}
    arrays[which] = arrays[which].astype(bad)
    with pytest.raises(TypeError, match=rf"{which}\.dtype={np.dtype(bad)} is not supported"):
        attention(arrays["q"], arrays["k"], arrays["v"], **FAST)


def test_non_arrays_and_return_lse_are_refused(rng):
    q, k, v = _arrays(rng, np.float16, (1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(TypeError, match="v must be a numpy.ndarray"):
        attention(q, k, v.tolist(), **FAST)
    with pytest.raises(TypeError, match="return_lse"):
        attention(q, k, v, return_lse=False, **FAST)
    with pytest.raises(ValueError, match="repeat"):
        attention(q, k, v, device="cpu", repeat=0)


def test_bf16_conversion_keeps_the_bits():
    bits = np.arange(0, 2**16, 97, dtype=np.uint16)
    a = bits.view(ml_dtypes.bfloat16)
    t = to_torch("a", a, "cpu")
    assert t.dtype == torch.bfloat16
    assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), bits)
    assert np.array_equal(to_numpy(t).view(np.uint16), bits)
