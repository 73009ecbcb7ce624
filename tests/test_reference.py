"""Tests of fmha.reference, the numpy float64 ground truth.

The dense forward and backward are checked against torch autograd (float64) applied to an
independent, explicit softmax formulation of SPEC section 1; masks are checked against
plain Python loops; everything else is checked against the dense functions or against
hand-written step-by-step computations.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmha import reference as ref

pytestmark = pytest.mark.filterwarnings("error")  # no RuntimeWarning (inf/nan) anywhere

TOL = 1e-10
SEEDS = [11, 12]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def assert_close(x, expected, tol=TOL):
    """Same shape, no NaN, same infinities, relative Frobenius error of the rest <= tol."""
    x = np.asarray(x, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert x.shape == expected.shape
    assert not np.isnan(x).any() and not np.isnan(expected).any()
    fin = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(x), fin)
    np.testing.assert_array_equal(x[~fin], expected[~fin])
    err = np.linalg.norm(x[fin] - expected[fin])
    den = np.linalg.norm(expected[fin])
    assert err <= tol * den + 1e-300, f"relative error {err / max(den, 1e-300):.3e}"


def loop_mask(sq, sk, *, causal=False, window=(-1, -1), mask_align="bottom_right", sink_size=0):
    """SPEC step 4 written as a double loop."""
    left, right = window
    if causal:
        right = 0
    off = sk - sq if mask_align == "bottom_right" else 0
    m = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        for j in range(sk):
            ok_left = left < 0 or i + off - left <= j
            ok_right = right < 0 or j <= i + off + right
            m[i, j] = (ok_left and ok_right) or j < sink_size
    return m


def torch_attention(
    q,
    k,
    v,
    do,
    *,
    dlse=None,
    scale=None,
    causal=False,
    window=(-1, -1),
    mask_align="bottom_right",
    sink_size=0,
    bias=None,
    alibi_slopes=None,
    softcap=0.0,
    sinks=None,
    dropout_p=0.0,
    dropout_mask=None,
):
    """SPEC section 1 in torch float64 with an explicit softmax; gradients by autograd."""

    def leaf(a):
        return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)

    B, Hq, Sq, Dq = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    group = Hq // Hk
    if scale is None:
        scale = 1.0 / math.sqrt(Dq)
    qt, kt, vt = leaf(q), leaf(k), leaf(v)
    names = ["dq", "dk", "dv"]
    inputs = [qt, kt, vt]

    s = scale * torch.einsum("bhid,bhjd->bhij", qt, kt.repeat_interleave(group, dim=1))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        bt = leaf(bias)
        names.append("dbias")
        inputs.append(bt)
        s = s + bt
    if alibi_slopes is not None:
        slopes = torch.tensor(np.asarray(alibi_slopes, dtype=np.float64)).reshape(-1, Hq, 1, 1)
        off = Sk - Sq if mask_align == "bottom_right" else 0
        i = torch.arange(Sq, dtype=torch.float64)[:, None]
        j = torch.arange(Sk, dtype=torch.float64)[None, :]
        s = s - slopes * (i + off - j).abs()
    mask = torch.tensor(
        loop_mask(
            Sq,
            Sk,
            causal=causal,
            window=window,
            mask_align=mask_align,
            sink_size=sink_size,
        )
    )
    s = s.masked_fill(~mask, -math.inf)
    logits = s
    if sinks is not None:
        sinks_t = leaf(sinks)
        names.append("dsinks")
        inputs.append(sinks_t)
        logits = torch.cat([s, sinks_t.view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    m = logits.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m)
    z = e.sum(dim=-1, keepdim=True)
    z_safe = torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, m + torch.log(z_safe), torch.full_like(z, -math.inf)).squeeze(-1)
    p = (e / z_safe)[..., :Sk]
    if dropout_mask is not None:
        p = p * torch.tensor(np.asarray(dropout_mask, dtype=np.float64)) / (1.0 - dropout_p)
    o = p @ vt.repeat_interleave(group, dim=1)

    dlse_t = torch.zeros_like(lse) if dlse is None else torch.tensor(dlse)
    grads = torch.autograd.grad([o, lse], inputs, grad_outputs=[torch.tensor(do), dlse_t])
    out = {name: g.numpy() for name, g in zip(names, grads, strict=True)}
    out.setdefault("dbias", None)
    out.setdefault("dsinks", None)
    return o.detach().numpy(), lse.detach().numpy(), out


def rotate_complex(x, theta, positions, interleaved):
    """Rotary embedding as multiplication by exp(i * theta[pos]) of complex feature pairs."""
    half = theta.shape[1]
    r = 2 * half
    ang = theta[np.broadcast_to(positions, x.shape[:-2])][..., None, :]  # (..., S, 1, half)
    if interleaved:
        z = x[..., 0:r:2] + 1j * x[..., 1:r:2]
    else:
        z = x[..., :half] + 1j * x[..., half:r]
    z = z * np.exp(1j * ang)
    out = x.copy()
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:r] = z.real, z.imag
    return out


# ---------------------------------------------------------------------------
# masks and alibi
# ---------------------------------------------------------------------------


def test_visible_mask_causal_alignments_match_flash_attn_and_sdpa_conventions():
    br = ref.visible_mask(2, 4, causal=True)
    tl = ref.visible_mask(2, 4, causal=True, mask_align="top_left")
    np.testing.assert_array_equal(br, [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(tl, [[1, 0, 0, 0], [1, 1, 0, 0]])
    # more queries than keys: bottom-right leaves the first rows with nothing visible
    np.testing.assert_array_equal(ref.visible_mask(3, 2, causal=True), [[0, 0], [1, 0], [1, 1]])


def test_visible_mask_causal_with_window_forces_right_zero_and_keeps_left():
    np.testing.assert_array_equal(
        ref.visible_mask(5, 5, causal=True, window=(1, 3)),
        ref.visible_mask(5, 5, window=(1, 0)),
    )


@settings(max_examples=60, deadline=None, database=None)
@given(
    sq=st.integers(0, 7),
    sk=st.integers(0, 7),
    causal=st.booleans(),
    left=st.integers(-1, 4),
    right=st.integers(-1, 4),
    align=st.sampled_from(["bottom_right", "top_left"]),
    sink=st.integers(0, 3),
)
def test_visible_mask_equals_spec_loop(sq, sk, causal, left, right, align, sink):
    got = ref.visible_mask(sq, sk, causal=causal, window=(left, right), mask_align=align, sink_size=sink)
    assert got.dtype == np.bool_ and got.shape == (sq, sk)
    np.testing.assert_array_equal(
        got,
        loop_mask(
            sq,
            sk,
            causal=causal,
            window=(left, right),
            mask_align=align,
            sink_size=sink,
        ),
    )


def test_visible_mask_rejects_unknown_alignment():
    with pytest.raises(ValueError, match="mask_align"):
        ref.visible_mask(3, 3, mask_align="center")
    with pytest.raises(ValueError, match="mask_align"):
        ref.alibi_bias(np.ones(2), 3, 3, mask_align="bottom-right")


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("seed", SEEDS)
def test_alibi_bias_is_minus_slope_times_distance_for_per_head_and_per_batch_slopes(align, seed):
    rng = np.random.default_rng(seed)
    sq, sk = 3, 5
    off = sk - sq if align == "bottom_right" else 0
    for slopes in (
        rng.uniform(0.1, 1.0, size=(4,)),
        rng.uniform(0.1, 1.0, size=(2, 4)),
    ):
        got = ref.alibi_bias(slopes, sq, sk, mask_align=align)
        s2 = slopes.reshape(-1, 4)
        assert got.shape == (s2.shape[0], 4, sq, sk)
        for b in range(s2.shape[0]):
            for h in range(4):
                for i in range(sq):
                    for j in range(sk):
                        assert got[b, h, i, j] == -s2[b, h] * abs(i + off - j)


# ---------------------------------------------------------------------------
# dense forward / backward against torch autograd
# ---------------------------------------------------------------------------

# (id, shape dict, keyword arguments); "bias", "alibi", "sinks", "dropout", "dlse" are
# recipes turned into random arrays by make_case.
CASES = [
    ("plain", {}, {}),
    ("explicit_scale", {}, {"scale": 0.7}),
    ("gqa_6_over_2", {"hq": 6, "hk": 2}, {}),
    ("mqa_4_over_1", {"hq": 4, "hk": 1}, {}),
    ("sq_lt_sk", {"sq": 4, "sk": 9}, {}),
    ("sq_gt_sk", {"sq": 9, "sk": 4}, {}),
    ("dq_ne_dv", {"dq": 8, "dv": 5}, {}),
    ("causal_bottom_right_sq_lt_sk", {"sq": 4, "sk": 9}, {"causal": True}),
    ("causal_bottom_right_sq_gt_sk", {"sq": 9, "sk": 4}, {"causal": True}),
    (
        "causal_top_left_sq_lt_sk",
        {"sq": 4, "sk": 9},
        {"causal": True, "mask_align": "top_left"},
    ),
    (
        "causal_top_left_sq_gt_sk",
        {"sq": 9, "sk": 4},
        {"causal": True, "mask_align": "top_left"},
    ),
    ("window_2_1", {"sq": 7, "sk": 9}, {"window": (2, 1)}),
    (
        "window_2_1_top_left",
        {"sq": 7, "sk": 9},
        {"window": (2, 1), "mask_align": "top_left"},
    ),
    ("window_left_only", {"sq": 7, "sk": 7}, {"window": (3, -1)}),
    ("window_right_only", {"sq": 7, "sk": 7}, {"window": (-1, 2)}),
    ("causal_with_window", {"sq": 7, "sk": 9}, {"causal": True, "window": (2, 5)}),
    ("sink_size_with_window", {"sq": 7, "sk": 9}, {"window": (1, 0), "sink_size": 2}),
    ("bias_full", {}, {"bias": "B,H,Sq,Sk"}),
    ("bias_1_H_1_Sk", {}, {"bias": "1,H,1,Sk"}),
    ("bias_B_1_Sq_Sk", {}, {"bias": "B,1,Sq,Sk"}),
    ("bias_2d_Sq_Sk", {}, {"bias": "Sq,Sk"}),
    ("bias_with_causal", {"sq": 5, "sk": 8}, {"bias": "B,1,Sq,Sk", "causal": True}),
    ("alibi_per_head", {}, {"alibi": "H", "causal": True}),
    ("alibi_per_batch_head", {"sq": 4, "sk": 9}, {"alibi": "B,H"}),
    ("alibi_top_left", {"sq": 9, "sk": 4}, {"alibi": "H", "mask_align": "top_left"}),
    ("alibi_plus_bias", {}, {"alibi": "H", "bias": "1,H,1,Sk"}),
    ("softcap", {}, {"softcap": 2.0, "scale": 1.0}),
    ("softcap_with_bias", {}, {"softcap": 1.5, "scale": 1.0, "bias": "B,H,Sq,Sk"}),
    ("sinks", {}, {"sinks": True}),
    (
        "sinks_causal_gqa",
        {"hq": 6, "hk": 2, "sq": 6, "sk": 4},
        {"sinks": True, "causal": True},
    ),
    ("dropout", {}, {"dropout": "B,H,Sq,Sk"}),
    ("dropout_broadcast_mask", {}, {"dropout": "1,H,Sq,Sk", "causal": True}),
    ("dlse", {}, {"dlse": True}),
    (
        "dlse_with_sinks",
        {"sq": 6, "sk": 4},
        {"dlse": True, "sinks": True, "causal": True},
    ),
    (
        "everything",
        {"hq": 6, "hk": 2, "sq": 6, "sk": 9, "dq": 8, "dv": 5},
        {
            "causal": True,
            "window": (4, -1),
            "sink_size": 1,
            "bias": "1,H,Sq,Sk",
            "alibi": "B,H",
            "softcap": 3.0,
            "sinks": True,
            "dropout": "B,H,Sq,Sk",
            "dlse": True,
        },
    ),
]


def make_case(seed, shape, kw):
    """Random normal inputs (never zeros) for a CASES entry."""
    rng = np.random.default_rng(seed)
    B = shape.get("b", 2)
    hq, hk = shape.get("hq", 3), shape.get("hk", shape.get("hq", 3))
    sq, sk = shape.get("sq", 6), shape.get("sk", 6)
    dq, dv = shape.get("dq", 8), shape.get("dv", shape.get("dq", 8))
    q = rng.standard_normal((B, hq, sq, dq))
    k = rng.standard_normal((B, hk, sk, dq))
    v = rng.standard_normal((B, hk, sk, dv))
    do = rng.standard_normal((B, hq, sq, dv))
    sizes = {"B": B, "H": hq, "Sq": sq, "Sk": sk, "1": 1}
    kw = dict(kw)
    if "bias" in kw:
        kw["bias"] = rng.standard_normal(tuple(sizes[n] for n in kw["bias"].split(",")))
    if "alibi" in kw:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, tuple(sizes[n] for n in kw.pop("alibi").split(",")))
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(hq)
    if "dropout" in kw:
        p = 0.3
        kw["dropout_mask"] = rng.random(tuple(sizes[n] for n in kw.pop("dropout").split(","))) >= p
        kw["dropout_p"] = p
    dlse = rng.standard_normal((B, hq, sq)) if kw.pop("dlse", False) else None
    return q, k, v, do, dlse, kw


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_torch_autograd_float64(case, seed):
    _, shape, kw = case
    q, k, v, do, dlse, kw = make_case(seed, shape, kw)
    o, lse = ref.attention_fwd(q, k, v, **kw)
    grads = ref.attention_bwd(q, k, v, do, dlse=dlse, **kw)
    o_t, lse_t, grads_t = torch_attention(q, k, v, do, dlse=dlse, **kw)

    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert o.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    assert lse.shape == q.shape[:3]
    assert_close(o, o_t)
    assert_close(lse, lse_t)
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        assert grads[name].shape == x.shape
        assert_close(grads[name], grads_t[name])
    if kw.get("bias") is None:
        assert grads["dbias"] is None
    else:
        assert grads["dbias"].shape == kw["bias"].shape
        assert_close(grads["dbias"], grads_t["dbias"])
    if kw.get("sinks") is None:
        assert grads["dsinks"] is None
    else:
        assert grads["dsinks"].shape == (q.shape[1],)
        assert_close(grads["dsinks"], grads_t["dsinks"])


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_fully_masked_rows_give_zero_output_neg_inf_or_sink_lse_and_zero_gradients(seed, with_sinks):
    rng = np.random.default_rng(seed)
    B, H, sq, sk, d = 2, 3, 6, 3, 4
    q, k, v = (rng.standard_normal(s) for s in ((B, H, sq, d), (B, H, sk, d), (B, H, sk, d)))
    do = rng.standard_normal((B, H, sq, d))
    dlse = rng.standard_normal((B, H, sq))
    sinks = rng.standard_normal(H) if with_sinks else None
    kw = {"causal": True, "sinks": sinks}  # bottom-right: rows 0..2 see no key
    o, lse = ref.attention_fwd(q, k, v, **kw)
    g = ref.attention_bwd(q, k, v, do, dlse=dlse, **kw)
    dead = slice(0, sq - sk)
    assert not any(np.isnan(x).any() for x in (o, lse, g["dq"], g["dk"], g["dv"]))
    assert np.all(o[:, :, dead] == 0)
    if with_sinks:
        np.testing.assert_array_equal(lse[:, :, dead], np.broadcast_to(sinks[None, :, None], (B, H, 3)))
    else:
        assert np.all(lse[:, :, dead] == -np.inf)
    assert np.all(g["dq"][:, :, dead] == 0)
    # the dead rows contribute nothing to dk/dv: same as dropping them
    g_live = ref.attention_bwd(
        q[:, :, sq - sk :], k, v, do[:, :, sq - sk :], dlse=dlse[:, :, sq - sk :], **kw
    )
    assert_close(g["dk"], g_live["dk"])
    assert_close(g["dv"], g_live["dv"])
    if with_sinks:  # lse = sink on dead rows, so dlse flows straight into dsinks
        extra = dlse[:, :, dead].sum(axis=(0, 2))
        assert_close(g["dsinks"], g_live["dsinks"] + extra)
    o_t, lse_t, g_t = torch_attention(q, k, v, do, dlse=dlse, **kw)
    assert_close(o, o_t)
    assert_close(lse, lse_t)
    for name in ("dq", "dk", "dv"):
        assert_close(g[name], g_t[name])


def test_window_that_hides_every_key_gives_zero_output_and_gradients():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 4, 3)) for _ in range(3))
    do = rng.standard_normal((1, 2, 4, 3))
    kw = {
        "window": (-1, 0),
        "mask_align": "top_left",
        "bias": np.full((1, 2, 4, 4), -np.inf),
    }
    o, lse = ref.attention_fwd(q, k, v, **kw)
    g = ref.attention_bwd(q, k, v, do, **kw)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    for name in ("dq", "dk", "dv", "dbias"):
        assert np.all(g[name] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_minus_inf_bias_entries_act_as_mask(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    do = rng.standard_normal((2, 2, 5, 4))
    bias = np.where(ref.visible_mask(5, 5, window=(1, 1)), 0.0, -np.inf)
    o_b, lse_b = ref.attention_fwd(q, k, v, bias=bias)
    o_m, lse_m = ref.attention_fwd(q, k, v, window=(1, 1))
    assert_close(o_b, o_m)
    assert_close(lse_b, lse_m)
    g_b = ref.attention_bwd(q, k, v, do, bias=bias)
    g_m = ref.attention_bwd(q, k, v, do, window=(1, 1))
    for name in ("dq", "dk", "dv"):
        assert_close(g_b[name], g_m[name])


def test_bfloat16_inputs_are_converted_to_float64():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(ml_dtypes.bfloat16) for _ in range(3))
    o, lse = ref.attention_fwd(q, k, v, causal=True)
    o64, lse64 = ref.attention_fwd(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True
    )
    assert o.dtype == np.float64
    np.testing.assert_array_equal(o, o64)
    np.testing.assert_array_equal(lse, lse64)


def test_invalid_arguments_raise():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 3, 4))
    k = rng.standard_normal((1, 3, 3, 4))
    with pytest.raises(ValueError, match="nhead_q=4 is not a multiple of nhead_k=3"):
        ref.attention_fwd(q, k, k)
    k = rng.standard_normal((1, 2, 3, 4))
    with pytest.raises(ValueError, match="dropout_mask"):
        ref.attention_fwd(q, k, k, dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap"):
        ref.attention_fwd(q, k, k, softcap=-1.0)
    with pytest.raises(ValueError, match="mask_align"):
        ref.attention_fwd(q, k, k, mask_align="diagonal")
    with pytest.raises(TypeError, match="boolean"):
        ref.attention_fwd(q, k, k, dropout_p=0.1, dropout_mask=np.ones((1, 4, 3, 3)))
    with pytest.raises(ValueError, match="sinks"):
        ref.attention_fwd(q, k, k, sinks=np.zeros(2))


# ---------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------


def _dense(x, start, n):
    """Packed (total, H, D) rows start:start+n as dense (1, H, n, D)."""
    return np.swapaxes(x[start : start + n], 0, 1)[None]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bias_shape", ["full", "broadcast", None])
def test_varlen_equals_loop_over_dense_calls_with_empty_sequences_and_seqused_k(seed, bias_shape):
    rng = np.random.default_rng(seed)
    lq = np.array([3, 0, 5, 2, 4])
    lk = np.array([4, 2, 0, 6, 5])
    used = np.array([3, 2, 0, 6, 2])
    B, hq, hk, dq, dv = len(lq), 4, 2, 6, 5
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mq, mk = lq.max(), lk.max()
    q = rng.standard_normal((cq[-1], hq, dq))
    k = rng.standard_normal((ck[-1], hk, dq))
    v = rng.standard_normal((ck[-1], hk, dv))
    do = rng.standard_normal((cq[-1], hq, dv))
    dlse = rng.standard_normal((hq, cq[-1]))
    bias = {
        "full": rng.standard_normal((B, hq, mq, mk)),
        "broadcast": rng.standard_normal((1, hq, 1, mk)),
        None: None,
    }[bias_shape]
    kw = {
        "causal": True,
        "window": (3, -1),
        "bias": bias,
        "alibi_slopes": rng.uniform(0.05, 0.5, (B, hq)),
        "softcap": 4.0,
        "sinks": rng.standard_normal(hq),
        "dropout_p": 0.25,
        "dropout_mask": rng.random((B, hq, mq, mk)) >= 0.25,
    }

    o, lse = ref.attention_varlen_fwd(q, k, v, cq, ck, seqused_k=used, **kw)
    g = ref.attention_varlen_bwd(q, k, v, do, cq, ck, seqused_k=used, dlse=dlse, **kw)
    assert o.shape == (cq[-1], hq, dv) and lse.shape == (hq, cq[-1])

    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv_ = np.zeros_like(v)
    dsinks = np.zeros(hq)
    dbias_full = np.zeros((B, hq, mq, mk))
    bias_full = np.broadcast_to(bias, (B, hq, mq, mk)) if bias is not None else None
    for b in range(B):
        q0, sq, k0, sk = cq[b], lq[b], ck[b], used[b]
        kwb = dict(
            kw,
            alibi_slopes=kw["alibi_slopes"][b],
            dropout_mask=kw["dropout_mask"][b : b + 1, :, :sq, :sk],
            bias=bias_full[b : b + 1, :, :sq, :sk] if bias is not None else None,
        )
        ob, lseb = ref.attention_fwd(_dense(q, q0, sq), _dense(k, k0, sk), _dense(v, k0, sk), **kwb)
        assert_close(o[q0 : q0 + sq], np.swapaxes(ob[0], 0, 1))
        assert_close(lse[:, q0 : q0 + sq], lseb[0])
        gb = ref.attention_bwd(
            _dense(q, q0, sq),
            _dense(k, k0, sk),
            _dense(v, k0, sk),
            _dense(do, q0, sq),
            dlse=dlse[None, :, q0 : q0 + sq],
            **kwb,
        )
        dq[q0 : q0 + sq] = np.swapaxes(gb["dq"][0], 0, 1)
        dk[k0 : k0 + sk] = np.swapaxes(gb["dk"][0], 0, 1)
        dv_[k0 : k0 + sk] = np.swapaxes(gb["dv"][0], 0, 1)
        dsinks += gb["dsinks"]
        if bias is not None:
            dbias_full[b, :, :sq, :sk] = gb["dbias"][0]
    assert_close(g["dq"], dq)
    assert_close(g["dk"], dk)
    assert_close(g["dv"], dv_)
    assert_close(g["dsinks"], dsinks)
    # keys past seqused_k take no part: zero gradient there
    assert np.all(g["dk"][ck[4] + 2 : ck[5]] == 0) and np.all(g["dv"][ck[0] + 3 : ck[1]] == 0)
    if bias is None:
        assert g["dbias"] is None
    else:
        assert g["dbias"].shape == bias.shape
        assert_close(
            g["dbias"],
            dbias_full.sum(axis=(0, 2), keepdims=True) if bias_shape == "broadcast" else dbias_full,
        )


def test_varlen_rejects_seqused_k_longer_than_the_sequence():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 2, 4))
    k = rng.standard_normal((3, 2, 4))
    with pytest.raises(ValueError, match="seqused_k"):
        ref.attention_varlen_fwd(q, k, k, [0, 3], [0, 3], seqused_k=[4])


# ---------------------------------------------------------------------------
# layouts, KV cache pieces
# ---------------------------------------------------------------------------


def test_to_bhsd_and_from_bhsd_swap_heads_and_sequence_for_bshd():
    x = np.random.default_rng(7).standard_normal((2, 5, 3, 4))
    np.testing.assert_array_equal(ref.to_bhsd(x, "bshd"), x.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(ref.from_bhsd(ref.to_bhsd(x, "bshd"), "bshd"), x)
    np.testing.assert_array_equal(ref.to_bhsd(x, "bhsd"), x)
    with pytest.raises(ValueError, match="layout"):
        ref.to_bhsd(x, "sbhd")


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_paged_gather_matches_contiguous_cache(seed, page_size):
    rng = np.random.default_rng(seed)
    B, S, H, D = 3, 10, 2, 4
    contiguous = rng.standard_normal((B, S, H, D))
    max_pages = -(-S // page_size)
    perm = rng.permutation(B * max_pages + 2)  # two spare pages, shuffled placement
    table = perm[: B * max_pages].reshape(B, max_pages).astype(np.int32)
    paged = rng.standard_normal((B * max_pages + 2, page_size, H, D))
    for b in range(B):
        for t in range(S):
            paged[table[b, t // page_size], t % page_size] = contiguous[b, t]
    seqlens = np.array([0, 7, 10], dtype=np.int32)
    got = ref.paged_gather(paged, table, seqlens)
    assert len(got) == B
    for b in range(B):
        np.testing.assert_array_equal(got[b], contiguous[b, : seqlens[b]])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [4, 8])
@pytest.mark.parametrize("seed", SEEDS)
def test_apply_rotary_equals_complex_rotation(seed, rotary_dim, interleaved):
    rng = np.random.default_rng(seed)
    B, S, H, D, max_pos = 2, 5, 3, 8, 16
    x = rng.standard_normal((B, S, H, D))
    theta = rng.uniform(-np.pi, np.pi, (max_pos, rotary_dim // 2))
    positions = rng.integers(0, max_pos, (B, S))
    got = ref.apply_rotary(x, np.cos(theta), np.sin(theta), positions=positions, interleaved=interleaved)
    assert_close(got, rotate_complex(x, theta, positions, interleaved), tol=1e-14)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])
    # positions (S,) broadcast over the batch
    got_s = ref.apply_rotary(x, np.cos(theta), np.sin(theta), positions=positions[0], interleaved=interleaved)
    assert_close(got_s, rotate_complex(x, theta, positions[0], interleaved), tol=1e-14)


def test_apply_rotary_half_style_formula_on_a_single_pair():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0]).reshape(1, 1, 1, 5)
    theta = np.array([[0.3, 1.1]])
    c, s = np.cos(theta[0]), np.sin(theta[0])
    got = ref.apply_rotary(x, np.cos(theta), np.sin(theta), positions=np.zeros((1, 1), int))
    want = [
        1 * c[0] - 3 * s[0],
        2 * c[1] - 4 * s[1],
        3 * c[0] + 1 * s[0],
        4 * c[1] + 2 * s[1],
        5,
    ]
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-15)


def _kvcache_by_hand(q, k_cache, v_cache, k, v, lens, rows, theta, interleaved, kw):
    """flash_attn_with_kvcache semantics step by step on a contiguous cache."""
    kc, vc = k_cache.copy(), v_cache.copy()
    B, sq = q.shape[:2]
    snew = k.shape[1]
    o = np.zeros((B, sq, q.shape[2], v.shape[-1]))
    lse = np.zeros((B, q.shape[2], sq))
    for b in range(B):
        pos_new = lens[b] + np.arange(snew)
        kc[rows[b], lens[b] : lens[b] + snew] = rotate_complex(k[b], theta, pos_new, interleaved)
        vc[rows[b], lens[b] : lens[b] + snew] = v[b]
        qb = rotate_complex(q[b], theta, lens[b] + np.arange(sq), interleaved)
        n = lens[b] + snew
        ob, lseb = ref.attention_fwd(
            qb.transpose(1, 0, 2)[None],
            kc[rows[b], :n].transpose(1, 0, 2)[None],
            vc[rows[b], :n].transpose(1, 0, 2)[None],
            **{**kw, "alibi_slopes": kw["alibi_slopes"][b]},  # (B, Hq) -> (Hq,)
        )
        o[b] = ob[0].transpose(1, 0, 2)
        lse[b] = lseb[0]
    return o, lse, kc, vc


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_kvcache_append_with_rotary_matches_manual_steps_contiguous_and_paged(seed, interleaved):
    rng = np.random.default_rng(seed)
    B, B_cache, S_cache, hq, hk, d, dv, sq, snew = 3, 4, 12, 4, 2, 8, 6, 3, 2
    q = rng.standard_normal((B, sq, hq, d))
    k_cache = rng.standard_normal((B_cache, S_cache, hk, d))
    v_cache = rng.standard_normal((B_cache, S_cache, hk, dv))
    k = rng.standard_normal((B, snew, hk, d))
    v = rng.standard_normal((B, snew, hk, dv))
    lens = np.array([0, 4, 10], dtype=np.int32)
    rows = np.array([2, 0, 3], dtype=np.int32)
    theta = rng.uniform(-np.pi, np.pi, (S_cache + sq, 3))  # rotary_dim 6 < d
    kw = {
        "causal": True,
        "sinks": rng.standard_normal(hq),
        "softcap": 5.0,
        "alibi_slopes": rng.uniform(0.05, 0.3, (B, hq)),
    }
    inputs = [a.copy() for a in (q, k_cache, v_cache, k, v)]

    o, lse, kc, vc = ref.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=lens,
        cache_batch_idx=rows,
        rotary_cos=np.cos(theta),
        rotary_sin=np.sin(theta),
        rotary_interleaved=interleaved,
        **kw,
    )
    o_h, lse_h, kc_h, vc_h = _kvcache_by_hand(q, k_cache, v_cache, k, v, lens, rows, theta, interleaved, kw)
    assert o.shape == (B, sq, hq, dv) and lse.shape == (B, hq, sq)
    assert_close(o, o_h)
    assert_close(lse, lse_h)
    assert_close(kc, kc_h)
    assert_close(vc, vc_h)
    for before, after in zip(inputs, (q, k_cache, v_cache, k, v), strict=True):
        np.testing.assert_array_equal(before, after)  # inputs untouched

    # the same cache, paged (page size 5, shuffled pages), gives the same result
    page = 5
    max_pages = -(-S_cache // page)
    table = rng.permutation(B * max_pages).reshape(B, max_pages).astype(np.int32)
    k_paged = rng.standard_normal((B * max_pages, page, hk, d))
    v_paged = rng.standard_normal((B * max_pages, page, hk, dv))
    for b in range(B):
        for t in range(S_cache):
            k_paged[table[b, t // page], t % page] = k_cache[rows[b], t]
            v_paged[table[b, t // page], t % page] = v_cache[rows[b], t]
    o_p, lse_p, kp_new, vp_new = ref.attention_with_kvcache(
        q,
        k_paged,
        v_paged,
        k=k,
        v=v,
        cache_seqlens=lens,
        block_table=table,
        rotary_cos=np.cos(theta),
        rotary_sin=np.sin(theta),
        rotary_interleaved=interleaved,
        **kw,
    )
    assert_close(o_p, o_h)
    assert_close(lse_p, lse_h)
    n = lens + snew
    for b, (kg, vg) in enumerate(
        zip(ref.paged_gather(kp_new, table, n), ref.paged_gather(vp_new, table, n), strict=True)
    ):
        assert_close(kg, kc_h[rows[b], : n[b]])
        assert_close(vg, vc_h[rows[b], : n[b]])


@pytest.mark.parametrize("seed", SEEDS)
def test_kvcache_without_new_tokens_attends_to_cache_prefix(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 1, 4, 8))
    k_cache = rng.standard_normal((2, 9, 4, 8))
    v_cache = rng.standard_normal((2, 9, 4, 8))
    lens = np.array([3, 9])
    o, lse, kc, _vc = ref.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, window=(1, 0))
    np.testing.assert_array_equal(kc, k_cache)
    for b in range(2):
        ob, lseb = ref.attention_fwd(
            q[b].transpose(1, 0, 2)[None],
            k_cache[b, : lens[b]].transpose(1, 0, 2)[None],
            v_cache[b, : lens[b]].transpose(1, 0, 2)[None],
            window=(1, 0),
        )
        assert_close(o[b], ob[0].transpose(1, 0, 2))
        assert_close(lse[b], lseb[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_merge_states_of_split_attention_equals_full_attention(seed):
    rng = np.random.default_rng(seed)
    B, H, sq, sk, d = 2, 3, 5, 12, 4
    q = rng.standard_normal((B, H, sq, d))
    k = rng.standard_normal((B, H, sk, d))
    v = rng.standard_normal((B, H, sk, d))
    o_full, lse_full = ref.attention_fwd(q, k, v, causal=True, mask_align="top_left")
    mask = ref.visible_mask(sq, sk, causal=True, mask_align="top_left")
    outs, lses = [], []
    for cols in (
        slice(0, 2),
        slice(2, 7),
        slice(7, 12),
    ):  # the last chunk is invisible to all
        bias = np.where(mask[:, cols], 0.0, -np.inf)
        o_c, lse_c = ref.attention_fwd(q, k[:, :, cols], v[:, :, cols], bias=bias)
        outs.append(o_c)
        lses.append(lse_c)
    assert np.all(lses[2] == -np.inf)
    o, lse = ref.merge_states(outs, lses)
    assert_close(o, o_full)
    assert_close(lse, lse_full)


def test_merge_states_of_all_empty_parts_gives_zero_and_neg_inf():
    rng = np.random.default_rng(8)
    outs = [rng.standard_normal((2, 3, 4)) for _ in range(3)]
    lses = [np.full((2, 3), -np.inf) for _ in range(3)]
    lses[1][0, 0] = 0.5
    o, lse = ref.merge_states(outs, lses)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[0, 0], outs[1][0, 0])
    assert lse[0, 0] == 0.5
    assert np.all(o.reshape(-1, 4)[1:] == 0) and np.all(lse.ravel()[1:] == -np.inf)


# ---------------------------------------------------------------------------
# numerics helpers
# ---------------------------------------------------------------------------


def test_relative_error_and_max_abs_error():
    r = np.array([3.0, 4.0])
    assert ref.relative_error(r, r) == 0.0
    assert ref.relative_error(np.array([3.0, 5.0]), r) == pytest.approx(1.0 / 5.0)
    assert ref.max_abs_error(np.array([3.5, 5.0]), r) == 1.0
    # zero reference: absolute error
    assert ref.relative_error(np.array([0.0, 2.0]), np.zeros(2)) == 2.0
    # NaN anywhere: inf
    assert ref.relative_error(np.array([np.nan, 4.0]), r) == math.inf
    assert ref.relative_error(r, np.array([np.nan, 4.0])) == math.inf
    assert ref.max_abs_error(np.array([np.nan, 4.0]), r) == math.inf
    # matching -inf (lse of a fully masked row) is no error; a mismatched one is
    a = np.array([-np.inf, 1.0])
    assert ref.relative_error(a, a) == 0.0 and ref.max_abs_error(a, a) == 0.0
    assert ref.relative_error(np.array([0.0, 1.0]), a) == math.inf
    with pytest.raises(ValueError, match="shape"):
        ref.relative_error(np.zeros(3), np.zeros(2))
