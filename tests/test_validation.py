"""Input validation of `fmha.attention` and `fmha.attention_varlen` (SPEC section 5).

One test per input rule. Each asserts the exception type (ValueError or TypeError), that
the message names the argument and the value given, and that it is raised before any
kernel runs: `family_module` (the only way the API reaches the kernels) is replaced by a
function that fails the test if called.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fmha
import fmha.api
import fmha.kernels.launch.loader
from fmha.dispatch.configs import Family
from fmha.ops import attention as attention_ops
from fmha.ops import prepare

from attn_testing import check_attention, randn

F32 = torch.float32


@pytest.fixture
def allow_kernels():
    """Requested by the few tests here that must run a kernel (valid inputs)."""


@pytest.fixture(autouse=True)
def no_kernel_launch(request, monkeypatch):
    if "allow_kernels" in request.fixturenames:
        return

    def forbidden(name, **kwargs):
        raise AssertionError(f"kernel family {name!r} was loaded before validation rejected the input")

    monkeypatch.setattr(fmha.kernels.launch.loader, "family_module", forbidden)
    for module in (prepare, attention_ops):
        monkeypatch.setattr(module, "family_module", forbidden)


def rejected(call, exc_type, *fragments):
    """Run `call`; it must raise `exc_type` whose message contains every fragment."""
    try:
        call()
    except Exception as e:  # the type is what is checked
        err = e
    else:
        raise AssertionError(f"no exception; expected {exc_type.__name__} mentioning {fragments}")
    assert isinstance(err, exc_type), (
        f"expected {exc_type.__name__}, got {type(err).__name__}: {err}")
    message = str(err)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message {message!r}"
    return err


# A valid dense problem (bhsd) and a valid varlen problem; each test breaks one thing.
B, HQ, HK, SQ, SK, D = 1, 4, 2, 8, 8, 16


def dense(dtype=F32):
    g = torch.Generator().manual_seed(0)
    q = randn((B, HQ, SQ, D), dtype, g)
    k = randn((B, HK, SK, D), dtype, g)
    v = randn((B, HK, SK, D), dtype, g)
    return q, k, v


CU_Q = [0, 3, 8]  # sequence lengths 3, 5
CU_K = [0, 4, 10]  # 4, 6


def varlen(dtype=F32):
    g = torch.Generator().manual_seed(0)
    q = randn((CU_Q[-1], HQ, D), dtype, g)
    k = randn((CU_K[-1], HK, D), dtype, g)
    v = randn((CU_K[-1], HK, D), dtype, g)
    cu_q = torch.tensor(CU_Q, dtype=torch.int32)
    cu_k = torch.tensor(CU_K, dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def run_dense(**changes):
    q, k, v = dense()
    tensors = {"q": q, "k": k, "v": v}
    for name in ("q", "k", "v"):
        if name in changes:
            tensors[name] = changes.pop(name)
    return lambda: fmha.attention(tensors["q"], tensors["k"], tensors["v"], **changes)


def run_varlen(**changes):
    q, k, v, cu_q, cu_k = varlen()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": 5, "max_seqlen_k": 6}
    for name in list(args):
        if name in changes:
            args[name] = changes.pop(name)
    return lambda: fmha.attention_varlen(*args.values(), **changes)


def test_valid_inputs_pass_the_checks_and_reach_the_kernels():
    """Sanity check of the harness: valid inputs get as far as loading the kernels."""
    rejected(run_dense(), AssertionError, "before validation")
    rejected(run_varlen(), AssertionError, "before validation")


# ----------------------------------------------------------------------------------------
# Tensors: type, ndim, dtype, device, strides


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_ndim_dense(name):
    t = dense()["qkv".index(name)]
    rejected(run_dense(**{name: t[0]}), ValueError, name, "must have 4 dimensions",
             str(tuple(t[0].shape)))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_ndim_varlen(name):
    t = varlen()["qkv".index(name)]
    rejected(run_varlen(**{name: t[None]}), ValueError, name, "must have 3 dimensions",
             str(tuple(t[None].shape)))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_tensor_q_k_v(name):
    t = dense()["qkv".index(name)]
    rejected(run_dense(**{name: t.tolist()}), TypeError, name, "list")


@pytest.mark.parametrize("name,value", [("bias", 1.0), ("alibi_slopes", [0.5] * HQ),
                                        ("sinks", [0.0] * HQ)])
def test_non_tensor_optional_tensors(name, value):
    rejected(run_dense(**{name: value}), TypeError, name, type(value).__name__)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"])
def test_non_tensor_index_tensors(name):
    value = [3, 5] if name == "seqused_k" else (CU_Q if name == "cu_seqlens_q" else CU_K)
    rejected(run_varlen(**{name: value}), TypeError, name, "list")


def test_missing_cu_seqlens():
    rejected(run_varlen(cu_seqlens_k=None), TypeError, "cu_seqlens_q and cu_seqlens_k")


def _unsupported_dtypes():
    # float8 inputs are supported (forward, with descales): tests/test_fp8.py
    return [torch.int32, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", _unsupported_dtypes(), ids=str)
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in dense())
    rejected(run_dense(q=q, k=k, v=v), TypeError, f"q.dtype={dtype}", "accepted", "torch.float16")
    qv, kv, vv, _, _ = varlen()
    rejected(run_varlen(q=qv.to(dtype), k=kv.to(dtype), v=vv.to(dtype)), TypeError,
             f"q.dtype={dtype}")


@pytest.mark.parametrize("name,dtype", [("k", torch.float16), ("v", torch.bfloat16)])
def test_q_k_v_dtypes_must_match(name, dtype):
    t = dense()["qkv".index(name)]
    rejected(run_dense(**{name: t.to(dtype)}), TypeError, f"{name}.dtype={dtype}",
             "q.dtype=torch.float32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mixing needs a CUDA device")
@pytest.mark.parametrize("name", ["k", "v"])
def test_device_mixing(name):
    t = dense()["qkv".index(name)]
    rejected(run_dense(**{name: t.cuda()}), ValueError, name, "cuda", "cpu", "one device")


def test_device_check_message():
    """The device check itself (a 'meta' tensor stands in for a second device)."""
    q, k, _ = dense()
    rejected(lambda: fmha.validation.check_same(("q", "k"), (q, k.to("meta"))), ValueError,
             "k is on meta", "q is on cpu")


@pytest.mark.parametrize("name", ["k", "bias"])
def test_cpu_and_meta_tensors_are_refused(name):
    q, k, _ = dense()
    value = k.to("meta") if name == "k" else torch.zeros(SQ, SK, device="meta")
    rejected(run_dense(**{name: value}), ValueError, name, "meta", "cpu")


@pytest.mark.parametrize("name", ["q", "k"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_last_dim_must_be_contiguous(name, layout):
    q, k, v = dense()
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    t = {"q": q, "k": k}[name]
    strided = torch.cat([t, t], dim=-1)[..., ::2]  # stride 2 along the head dim
    assert strided.stride(-1) == 2
    call = lambda: fmha.attention(**{"q": q, "k": k, "v": v, name: strided}, layout=layout)
    rejected(call, ValueError, f"{name} must have a contiguous last dimension",
             str(strided.stride()))


def test_v_strided_last_dim_that_is_not_column_major_is_refused():
    _, _, v = dense()
    strided = torch.cat([v, v], dim=-1)[..., ::2]
    rejected(run_dense(v=strided), ValueError, "v must have a contiguous last dimension",
             "column-major", str(strided.stride()))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_v_column_major_is_accepted_and_correct(allow_kernels, layout):
    g = torch.Generator().manual_seed(1)
    q, k, _ = dense()
    v_dmajor = randn((B, HK, D, SK), F32, g)  # memory (B, H, D, S): stride 1 along S
    v = v_dmajor.transpose(-1, -2)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    assert v.stride(-1) != 1
    check_attention(q, k, v, layout=layout, causal=True)
    assert fmha.problem_of(q, k, v, layout=layout).v_column_major


# ----------------------------------------------------------------------------------------
# Shapes


def test_nhead_q_must_be_a_multiple_of_nhead_k():
    q = torch.randn(1, 12, 4, 8)
    k = v = torch.randn(1, 5, 4, 8)
    rejected(lambda: fmha.attention(q, k, v), ValueError, "nhead_q=12 is not a multiple of nhead_k=5")
    rejected(lambda: fmha.attention(q, k[:, :0], v[:, :0]), ValueError,
             "nhead_q=12 is not a multiple of nhead_k=0")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    rejected(lambda: fmha.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                           v[0].transpose(0, 1), cu, cu, 4, 4),
             ValueError, "nhead_q=12 is not a multiple of nhead_k=5")


def test_k_and_v_head_counts_must_match():
    _, _, v = dense()
    rejected(run_dense(v=v[:, :1]), ValueError, "k has 2 heads but v has 1")
    _, _, vv, _, _ = varlen()
    rejected(run_varlen(v=vv[:, :1]), ValueError, "k has 2 heads but v has 1")


def test_k_and_v_seqlens_must_match():
    _, _, v = dense()
    rejected(run_dense(v=v[:, :, :SK - 1]), ValueError, f"v has seqlen {SK - 1} but k has seqlen {SK}")
    _, _, vv, _, _ = varlen()
    rejected(run_varlen(v=vv[:-1]), ValueError, f"k has {CU_K[-1]} tokens but v has {CU_K[-1] - 1}")


@pytest.mark.parametrize("name", ["k", "v"])
def test_batch_must_match(name):
    t = dense()["qkv".index(name)]
    rejected(run_dense(**{name: torch.cat([t, t])}), ValueError, f"{name} has batch 2 but q has batch 1")


def test_head_dim_of_q_and_k_must_match():
    _, k, _ = dense()
    rejected(run_dense(k=k[..., :8].contiguous()), ValueError, "k has head dim 8 but q has 16")
    _, kv, _, _, _ = varlen()
    rejected(run_varlen(k=kv[..., :8].contiguous()), ValueError, "k has head dim 8 but q has 16")


@pytest.mark.parametrize("name", ["q", "v"])
def test_head_dim_zero_is_refused(name):
    q, k, v = dense()
    if name == "q":
        q, k = q[..., :0], k[..., :0]
    else:
        v = v[..., :0]
    rejected(lambda: fmha.attention(q, k, v), ValueError, f"{name} has head dim 0", "1..256")


def test_head_dim_above_256_lists_every_candidate_and_its_refusal():
    q = k = v = torch.randn(1, 1, 4, 300)
    err = rejected(lambda: fmha.attention(q, k, v), fmha.NoKernelError, "no fwd kernel",
                   "Dqk=300")
    assert isinstance(err, ValueError)
    message = str(err)
    candidates = [c for c in fmha.get_dispatcher().registry if c.family == Family.FWD]
    assert candidates
    for config in candidates:
        line = next((ln for ln in message.splitlines() if ln.strip().startswith(config.name + ":")), None)
        assert line is not None, f"candidate {config.name} missing from {message!r}"
        assert "head dim 300 outside" in line, line
    cpu_line = next(ln for ln in message.splitlines() if "_cpu_" in ln)
    assert "arch" not in cpu_line  # the interpreter config is refused for its head dim only
    # Dv alone above 256 is refused the same way.
    v = torch.randn(1, 1, 4, 300)
    q = k = torch.randn(1, 1, 4, 16)
    rejected(lambda: fmha.attention(q, k, v), fmha.NoKernelError, "Dv=300", "head dim 300 outside")


# ----------------------------------------------------------------------------------------
# String and scalar arguments


@pytest.mark.parametrize("layout", ["BHSD", "sbhd", ""])
def test_bad_layout(layout):
    rejected(run_dense(layout=layout), ValueError, f"layout={layout!r}", "'bhsd'", "'bshd'")


@pytest.mark.parametrize("name,value", [("layout", None), ("layout", 1), ("mask_align", None)])
def test_non_string_layout_or_mask_align(name, value):
    rejected(run_dense(**{name: value}), TypeError, f"{name}={value!r}")


@pytest.mark.parametrize("mask_align", ["bottom-right", "left", "TOP_LEFT"])
def test_bad_mask_align(mask_align):
    rejected(run_dense(mask_align=mask_align), ValueError, f"mask_align={mask_align!r}",
             "'bottom_right'", "'top_left'")
    rejected(run_varlen(mask_align=mask_align), ValueError, f"mask_align={mask_align!r}")


@pytest.mark.parametrize("softcap", [-1.0, -1e-9, math.nan, math.inf, "5", None])
def test_bad_softcap(softcap):
    rejected(run_dense(softcap=softcap), ValueError, f"softcap={softcap!r}", ">= 0")


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5, math.nan, math.inf, "0.1"])
def test_dropout_p_outside_0_1(dropout_p):
    rejected(run_dense(dropout_p=dropout_p), ValueError, f"dropout_p={dropout_p!r}", "[0, 1)")
    rejected(run_varlen(dropout_p=dropout_p), ValueError, f"dropout_p={dropout_p!r}")


@pytest.mark.parametrize("sink_size", [-1, 1.5, 2.0, "2", True, None])
def test_bad_sink_size(sink_size):
    rejected(run_dense(sink_size=sink_size), ValueError, f"sink_size={sink_size!r}", "int >= 0")


@pytest.mark.parametrize("window,fragment", [
    ((-2, 0), "window left=-2"), ((0, -5), "window right=-5"), ((1.5, 0), "window left=1.5"),
    ((0, "1"), "window right='1'"), ((True, 0), "window left=True"),
    ((1, 2, 3), "window=(1, 2, 3)"), (4, "window=4"), (None, "window=None"), ((3,), "window=(3,)"),
])
def test_bad_window(window, fragment):
    rejected(run_dense(window=window), ValueError, fragment, ">= -1")
    rejected(run_varlen(window=window), ValueError, fragment)


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, "0.5", torch.tensor(0.5)])
def test_bad_scale(scale):
    rejected(run_dense(scale=scale), ValueError, f"scale={scale!r}", "finite")


def test_numpy_scalars_are_accepted(allow_kernels):
    q, k, v = dense()
    expect = fmha.attention(q, k, v, scale=0.25, softcap=3.0)
    got = fmha.attention(q, k, v, scale=np.float32(0.25), softcap=np.float64(3.0),
                         dropout_p=np.float32(0.0))
    assert torch.equal(expect, got)


def test_causal_must_be_a_bool():
    rejected(run_dense(causal=1), TypeError, "causal=1", "bool")


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"])
def test_seed_out_of_range(seed):
    rejected(run_dense(seed=seed, dropout_p=0.1), ValueError, f"seed={seed!r}", "[0, 2**63)")


@pytest.mark.parametrize("offset", [-1, 2**32, 1.0, None])
def test_offset_out_of_range(offset):
    rejected(run_dense(offset=offset, dropout_p=0.1), ValueError, f"offset={offset!r}", "[0, 2**32)")


# ----------------------------------------------------------------------------------------
# bias, ALiBi, sinks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32, torch.bool])
def test_bias_dtype(dtype):
    bias = torch.zeros(SQ, SK, dtype=dtype)
    rejected(run_dense(bias=bias), TypeError, f"bias.dtype={dtype}", "torch.float32")


@pytest.mark.parametrize("shape", [(3, SQ, SK), (SQ, SK + 1), (2, HQ, SQ, SK), (1, HQ + 1, 1, 1), (SK + 1,)])
def test_bias_not_broadcastable(shape):
    rejected(run_dense(bias=torch.zeros(shape)), ValueError, f"bias of shape {shape}",
             f"{(B, HQ, SQ, SK)}")


def test_bias_varlen_shape_uses_batch_and_max_seqlens():
    rejected(run_varlen(bias=torch.zeros(2, HQ, 5, 5)), ValueError, "bias of shape (2, 4, 5, 5)",
             "(2, 4, 5, 6)")


def test_bias_more_than_4_dims():
    rejected(run_dense(bias=torch.zeros(1, 1, 1, SQ, SK)), ValueError, "at most 4 dimensions",
             str((1, 1, 1, SQ, SK)))


@pytest.mark.parametrize("shape", [(HQ + 1,), (HK,), (2, HQ), (B, HQ, 1), ()])
def test_alibi_shape(shape):
    rejected(run_dense(alibi_slopes=torch.zeros(shape)), ValueError,
             f"alibi_slopes has shape {shape}", f"({HQ},)", f"({B}, {HQ})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_alibi_dtype(dtype):
    rejected(run_dense(alibi_slopes=torch.zeros(HQ, dtype=dtype)), TypeError,
             f"alibi_slopes.dtype={dtype}", "torch.float32")


@pytest.mark.parametrize("shape", [(HQ + 1,), (HK,), (1, HQ), ()])
def test_sinks_shape(shape):
    rejected(run_dense(sinks=torch.zeros(shape)), ValueError, f"sinks has shape {shape}", f"({HQ},)")
    rejected(run_varlen(sinks=torch.zeros(shape)), ValueError, f"sinks has shape {shape}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_sinks_dtype(dtype):
    rejected(run_dense(sinks=torch.zeros(HQ, dtype=dtype)), TypeError, f"sinks.dtype={dtype}",
             "torch.float32")


def test_sinks_must_be_contiguous():
    # The kernels read sinks[h] as `ptr + h`: a strided view would be read wrongly.
    sinks = torch.zeros(2 * HQ)[::2]
    rejected(run_dense(sinks=sinks), ValueError, "sinks must be contiguous", "strides (2,)")


# ----------------------------------------------------------------------------------------
# varlen index tensors


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32])
def test_cu_seqlens_dtype(name, dtype):
    values = CU_Q if name == "cu_seqlens_q" else CU_K
    rejected(run_varlen(**{name: torch.tensor(values, dtype=dtype)}), TypeError,
             f"{name}.dtype={dtype}", "torch.int32")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_must_start_at_0(name):
    bad = [1, 3, 8] if name == "cu_seqlens_q" else [2, 4, 10]
    rejected(run_varlen(**{name: torch.tensor(bad, dtype=torch.int32)}), ValueError,
             f"{name}[0]={bad[0]} must be 0")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_must_not_decrease(name):
    bad = [0, 9, 8] if name == "cu_seqlens_q" else [0, 11, 10]
    rejected(run_varlen(**{name: torch.tensor(bad, dtype=torch.int32)}, max_seqlen_q=9,
                        max_seqlen_k=11),
             ValueError, f"{name} must be non-decreasing", f"{name}[2]={bad[2]} < {name}[1]={bad[1]}")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_last_entry_must_equal_packed_length(name):
    bad = [0, 3, 7] if name == "cu_seqlens_q" else [0, 4, 12]
    total = CU_Q[-1] if name == "cu_seqlens_q" else CU_K[-1]
    rejected(run_varlen(**{name: torch.tensor(bad, dtype=torch.int32)}, max_seqlen_k=8), ValueError,
             f"{name}[-1]={bad[-1]}", f"packed length {total}")


def test_cu_seqlens_q_and_k_lengths_must_match():
    cu_q = torch.tensor([0, 8], dtype=torch.int32)
    rejected(run_varlen(cu_seqlens_q=cu_q, max_seqlen_q=8), ValueError,
             "cu_seqlens_k has 3 entries but cu_seqlens_q has 2")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_shape(name):
    values = CU_Q if name == "cu_seqlens_q" else CU_K
    t = torch.tensor(values, dtype=torch.int32)
    rejected(run_varlen(**{name: t[None]}), ValueError, f"{name} must have 1 dimensions",
             str((1, 3)))
    rejected(run_varlen(**{name: t[:0]}), ValueError, f"{name} must have batch + 1 >= 1 entries, got 0")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_must_be_contiguous(name):
    # The kernels read cu_seqlens[b] as `ptr + b`: a strided view was read out of bounds.
    values = CU_Q if name == "cu_seqlens_q" else CU_K
    strided = torch.tensor([x for v in values for x in (v, 999)], dtype=torch.int32)[::2]
    assert strided.tolist() == values
    rejected(run_varlen(**{name: strided}), ValueError, f"{name} must be contiguous", "strides (2,)")


@pytest.mark.parametrize("name,value,longest", [("max_seqlen_q", 4, 5), ("max_seqlen_k", 5, 6),
                                                ("max_seqlen_q", 0, 5)])
def test_max_seqlen_smaller_than_longest_sequence(name, value, longest):
    rejected(run_varlen(**{name: value}), ValueError, f"{name}={value}",
             f"longest sequence ({longest})")


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_negative(name):
    rejected(run_varlen(**{name: -1}), ValueError, f"{name}=-1", "int >= 0")


@pytest.mark.parametrize("value", [5.0, None, "5"])
def test_max_seqlen_not_an_int(value):
    rejected(run_varlen(max_seqlen_q=value), TypeError, f"max_seqlen_q={value!r}")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_seqused_k_dtype(dtype):
    rejected(run_varlen(seqused_k=torch.tensor([3, 5], dtype=dtype)), TypeError,
             f"seqused_k.dtype={dtype}", "torch.int32")


@pytest.mark.parametrize("values", [[3], [3, 5, 1], []])
def test_seqused_k_length(values):
    rejected(run_varlen(seqused_k=torch.tensor(values, dtype=torch.int32)), ValueError,
             f"seqused_k has {len(values)} entries", "batch=2")


def test_seqused_k_2d():
    rejected(run_varlen(seqused_k=torch.tensor([[3, 5]], dtype=torch.int32)), ValueError,
             "seqused_k must have 1 dimensions", "(1, 2)")


@pytest.mark.parametrize("values,bad", [([5, 2], "seqused_k[0]=5 must be in [0, 4]"),
                                        ([4, 7], "seqused_k[1]=7 must be in [0, 6]"),
                                        ([-1, 2], "seqused_k[0]=-1 must be in [0, 4]")])
def test_seqused_k_value_above_its_sequence_length(values, bad):
    rejected(run_varlen(seqused_k=torch.tensor(values, dtype=torch.int32)), ValueError, bad)


def test_seqused_k_must_be_contiguous():
    # Read as `ptr + b` by the kernels: a strided view gave garbage outputs.
    strided = torch.tensor([3, 99, 5, 99], dtype=torch.int32)[::2]
    rejected(run_varlen(seqused_k=strided), ValueError, "seqused_k must be contiguous", "strides (2,)")



# ----------------------------------------------------------------------------------------
# The same index-tensor rule for fmha.attention_with_kvcache (shared check_tensor)


@pytest.mark.parametrize("name", ["cache_seqlens", "cache_batch_idx", "block_table"])
def test_kvcache_index_tensors_must_be_contiguous(name):
    # Read as `ptr + i` by the kernels: a strided cache_seqlens gave NaN outputs.
    g = torch.Generator().manual_seed(0)
    q = randn((2, 1, 2, 16), F32, g)
    args = {"cache_seqlens": torch.tensor([5, 7], dtype=torch.int32)}
    if name == "block_table":
        cache = randn((4, 4, 2, 16), F32, g)  # 4 pages of 4 tokens
        args[name] = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32).t().contiguous().t()
    else:
        cache = randn((2, 8, 2, 16), F32, g)
        values = [5, 7] if name == "cache_seqlens" else [1, 0]
        args[name] = torch.tensor([x for v in values for x in (v, 99)], dtype=torch.int32)[::2]
    assert args[name].stride(-1) != 1
    rejected(lambda: fmha.attention_with_kvcache(q, cache, cache, **args), ValueError,
             f"{name} must be contiguous", str(args[name].stride()))


def test_causal_with_a_right_window_edge_is_refused_not_overridden():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"causal=True fixes the window's right edge at 0 but window=\(3, 2\)"):
        fmha.attention(q, q, q, causal=True, window=(3, 2))
    assert fmha.validation.check_scalars(scale=None, softcap=0.0, window=(3, 0), sink_size=0, dropout_p=0.0,
                                         causal=True) == (3, 0)
