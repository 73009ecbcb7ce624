"""GPU tests of the Hopper Gluon forward (kernels/fwd_gluon.py, pipeline `gluon_ws`).

Each case checks that the dispatcher picked the Gluon config (explain) and compares o and
LSE with the float64 truth under the FlashAttention 2x rule. Sizes cross every tile border
(rows not a multiple of 64/128, keys not a multiple of the key tile), both causal
alignments with Sq < Sk and Sq > Sk (fully masked rows), GQA/MQA, both layouts.
"""

import pytest
import torch

import fmha
from fmha.kernels.gluon.persistent_schedule import causal_tile_order
from fmha.kernels.launch import plan_tables
from fmha.ops import call_plans

from attn_testing import check_attention, make_qkv

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _uses_gluon(q, k, v, **kw) -> bool:
    """The forward config the dispatcher picked (explain's "1. fwd ..." line) is the Gluon one."""
    fwd_line = next(line for line in fmha.explain(q, k, v, **kw).splitlines() if "1. fwd" in line)
    return "gluon_ws" in fwd_line


SHAPES = [  # (batch, nhead_q, nhead_k, seqlen_q, seqlen_k)
    (2, 8, 2, 1000, 1533),
    (1, 4, 4, 2048, 2048),
    (2, 4, 1, 77, 4099),
    (1, 2, 2, 4099, 77),
    (3, 2, 2, 1, 300),
]


def _masked_problem(rng, dtype, head_dim, mask, shape):
    """q, k, v (bhsd, CUDA) of shape (batch, hq, hk, sq, sk) and the attention kwargs of `mask`
    ("none", "causal", "causal_top_left")."""
    batch, hq, hk, sq, sk = shape
    q, k, v = make_qkv(rng, dtype=dtype, layout="bhsd", device=CUDA, batch=batch, nhead_q=hq,
                       nhead_k=hk, seqlen_q=sq, seqlen_k=sk, head_dim=head_dim)
    kw = {} if mask == "none" else {"causal": True}
    if mask == "causal_top_left":
        kw["mask_align"] = "top_left"
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_forward(rng, dtype, head_dim, mask, shape):
    q, k, v, kw = _masked_problem(rng, dtype, head_dim, mask, shape)
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("left", [0, 100, 1000])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3]], ids=lambda s: "x".join(map(str, s)))
def test_gluon_forward_sliding_window(rng, head_dim, left, align, shape):
    """Windows (left, 0) on the one-tile Gluon forward (HAS_LEFT): only the diagonal key (0),
    a window inside a key tile's span (100) and over several tiles (1000), both alignments,
    rows with no key (Sq > Sk, top-left) and keys past the last row (Sk > Sq)."""
    q, k, v, _ = _masked_problem(rng, torch.bfloat16, head_dim, "none", shape)
    kw = dict(window=(left, 0), mask_align=align)
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)


def _sink_logits(rng, nhead_q: int) -> torch.Tensor:
    """Per-head sink logits: small, large (the sink dominates the row: 2**(sink - max) must not
    overflow) and -inf (no sink), the rest random."""
    sinks = torch.randn(nhead_q, generator=rng)
    sinks[0] = 25.0
    if nhead_q > 1:
        sinks[1] = float("-inf")
    return sinks.to(CUDA)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left", "window"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4]], ids=lambda s: "x".join(map(str, s)))
def test_gluon_forward_with_sink_logits(rng, head_dim, mask, shape):
    """Sink logits in the Gluon forward's epilogue (HAS_SINKS), one-tile and persistent kernels:
    rows with no visible key (Sq > Sk) must give O = 0 and LSE = the head's sink."""
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, head_dim, "none" if mask == "window" else mask, shape)
    if mask == "window":
        kw = dict(window=(127, 0))
    kw["sinks"] = _sink_logits(rng, q.shape[1])
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (127, 0)])
def test_gluon_sink_logits_forward_and_backward_at_a_gpt_oss_layer(rng, window):
    """gpt-oss's attention (GQA 64:8, D=64, sink logits, windows of 128 keys on every other
    layer) at a realistic size: forward and backward on the Gluon kernels, dsinks from stage 1."""
    from attn_testing import check_backward

    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bshd", device=CUDA, batch=1, nhead_q=16,
                       nhead_k=2, seqlen_q=2048, seqlen_k=2048, head_dim=64)
    kw = dict(layout="bshd", window=window, sinks=_sink_logits(rng, 16))
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)
    assert _bwd_uses_gluon(q.requires_grad_(), k, v, **kw), fmha.explain(q, k, v, **kw)
    check_backward(q.detach(), k, v, truth="torch64", with_dlse=True, **kw)


@pytest.mark.parametrize("left", [0, 700])
def test_gluon_sliding_window_fp16_gqa_bshd_and_backward(rng, left):
    """A window in fp16, bshd, GQA, at a realistic size, then its backward (the Gluon dK/dV kernel,
    LEFT_WINDOW) from the Gluon forward's o and LSE, with a gradient of the LSE too."""
    from attn_testing import check_backward

    q, k, v = make_qkv(rng, dtype=torch.float16, layout="bshd", device=CUDA, batch=2, nhead_q=16,
                       nhead_k=4, seqlen_q=3000, seqlen_k=3000, head_dim=128)
    assert _uses_gluon(q, k, v, layout="bshd", window=(left, 0))
    check_attention(q, k, v, layout="bshd", window=(left, 0), truth="torch64")
    q, k, v = (t[:, :2000] for t in (q, k, v))
    assert _bwd_uses_gluon(q.requires_grad_(), k, v, layout="bshd", window=(left, 0))
    check_backward(q.detach(), k, v, layout="bshd", window=(left, 0), truth="torch64", with_dlse=True)


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_bshd_and_realistic(rng, causal):
    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bshd", device=CUDA, batch=2, nhead_q=16,
                       nhead_k=16, seqlen_q=4096, seqlen_k=4096, head_dim=128)
    assert _uses_gluon(q, k, v, layout="bshd", causal=causal)
    check_attention(q, k, v, layout="bshd", causal=causal, truth="torch64")


def test_gluon_backward_through_autograd(rng):
    """The backward (Triton) consumes the Gluon forward's o and LSE."""
    from attn_testing import check_backward

    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bhsd", device=CUDA, batch=2, nhead_q=8,
                       nhead_k=2, seqlen_q=1000, seqlen_k=1000, head_dim=128)
    check_backward(q, k, v, causal=True, truth="torch64")


def test_unaligned_strides_fall_back_with_reason(rng):
    # Head dim 64 inside a 68-wide buffer: a row stride of 136 bytes breaks TMA's 16-byte rule.
    base = torch.randn(2, 4, 512, 68, device=CUDA, dtype=torch.bfloat16)
    q = base[..., :64]
    k, v = torch.randn_like(q), torch.randn_like(q)
    assert not _uses_gluon(q, k, v)
    assert "16-byte aligned" in fmha.explain(q, k, v)
    check_attention(q, k, v, truth="torch64")


@pytest.mark.parametrize("scale", [-0.09, 0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_scales(rng, scale, causal):
    """The kernel keeps the running max unscaled (one FMA per exponent): check any sign."""
    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bhsd", device=CUDA, batch=1, nhead_q=4,
                       nhead_k=4, seqlen_q=700, seqlen_k=900, head_dim=128)
    assert _uses_gluon(q, k, v, causal=causal, scale=scale)
    check_attention(q, k, v, causal=causal, scale=scale, truth="torch64")


def _bwd_uses_gluon(q, k, v, **kw) -> bool:
    lines = fmha.explain(q, k, v, **kw).splitlines()
    return "gluon" in next(line for line in lines if "bwd_dq_dk_dv " in line)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 4, 4, 1024, 1024), (2, 2, 1, 77, 700),
                                   (1, 2, 2, 700, 77)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward(rng, dtype, head_dim, mask, shape):
    from attn_testing import check_backward

    q, k, v, kw = _masked_problem(rng, dtype, head_dim, mask, shape)
    assert _bwd_uses_gluon(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), **kw)
    check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)


def test_gluon_backward_bshd_realistic_and_strided_dout(rng):
    from attn_testing import check_backward

    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bshd", device=CUDA, batch=2, nhead_q=16,
                       nhead_k=4, seqlen_q=4096, seqlen_k=4096, head_dim=128)
    check_backward(q, k, v, layout="bshd", causal=True, truth="torch64", with_dlse=True)
    # dO that TMA cannot load (a broadcast view): the API makes it contiguous first.
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fmha.attention(qg, kg, vg, layout="bshd", causal=True)
    o.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    from fmha.testing.numerics import torch_attention
    qr, kr, vr = (t.transpose(1, 2) for t in ref)
    torch_attention(qr, kr, vr, causal=True, compute_dtype=torch.float64)[0].sum().backward()
    for got, want in zip((qg, kg, vg), ref, strict=True):
        err = (got.grad.double() - want.grad).abs().max().item()
        assert err < 0.05 * want.grad.abs().max().item(), err


def _backward_dispatcher(pipeline):
    """The registry without the Gluon dK/dV configs of the other pipeline and without the
    persistent ones (D=64's first choice; tested by `_check_persistent_backward`): the one-tile
    kernel with or without warp specialization, whichever the registry puts first."""
    from fmha import Registry, default_registry
    from fmha.dispatch.configs import Family
    from fmha.dispatch.dispatcher import Dispatcher

    configs = [c for c in default_registry()
               if not (c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon
                       and (c.algorithm.pipeline.value != pipeline or c.algorithm.persistent))]
    return Dispatcher(Registry(configs, name=f"gluon-bwd-{pipeline}"))


@pytest.mark.parametrize("dq", ["tma", "atomics"])
@pytest.mark.parametrize("pipeline", ["gluon", "gluon_ws"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 2, 2, 700, 77)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_both_pipelines(rng, monkeypatch, dq, pipeline, head_dim, mask, shape):
    """Both dK/dV kernels at D 64/128, whichever the registry picks (test_gluon_backward covers
    that one at more shapes), with dQ by TMA reduce-add (the default) and by atomics (what
    dQ accumulators TMA cannot address get)."""
    _check_backward_with_shape(rng, monkeypatch, pipeline, head_dim, mask, shape, dq_tma=int(dq == "tma"))


@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 2, 2, 700, 77), (2, 4, 1, 77, 700)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_d256_without_warp_specialization(rng, monkeypatch, mask, shape):
    """The registry's second D=256 dK/dV kernel (no warp specialization; `fmha tune` times it
    against the first), dQ staged in the Q/dO buffers and added by TMA reduce-add."""
    _check_backward_with_shape(rng, monkeypatch, "gluon", 256, mask, shape)


@pytest.mark.parametrize("pipeline", ["gluon_ws", "gluon"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("left", [0, 100, 1000])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 2, 2, 700, 77), (2, 4, 1, 77, 700),
                                   (1, 4, 4, 1024, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_sliding_window(rng, pipeline, head_dim, left, align, shape):
    """Windows (left, 0) on both one-tile dK/dV kernels (LEFT_WINDOW): only the diagonal key (0), a
    window inside a tile (100) and over several tiles (1000); both alignments; GQA; Sq > Sk (rows
    with no key, key tiles after the last row's window) and Sk > Sq (key tiles no query sees)."""
    from attn_testing import check_backward

    q, k, v, _ = _masked_problem(rng, torch.bfloat16, head_dim, "none", shape)
    kw = dict(window=(left, 0), mask_align=align)
    with fmha.api.use_dispatcher(_backward_dispatcher(pipeline)):
        line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
        assert f"sm90_{pipeline}_m" in line, line
        check_backward(q.detach(), k, v, truth="torch64", **kw)


def _change_bwd_shape(monkeypatch, pipeline, head_dim, changes):
    """bwd_gluon.SHAPES[pipeline][head_dim] updated with `changes` for this test only."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    shapes = {p: {d: dict(sh) for d, sh in by_dim.items()} for p, by_dim in bwd_gluon.SHAPES.items()}
    shapes[pipeline][head_dim].update(changes)
    monkeypatch.setattr(bwd_gluon, "SHAPES", shapes)


def _check_backward_with_shape(rng, monkeypatch, pipeline, head_dim, mask, shape, **changes):
    """check_backward (float64 truth) through `pipeline`'s dK/dV kernel at `head_dim`, its
    kernel shape (bwd_gluon.SHAPES) changed so."""
    from attn_testing import check_backward

    _change_bwd_shape(monkeypatch, pipeline, head_dim, changes)
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, head_dim, mask, shape)
    with fmha.api.use_dispatcher(_backward_dispatcher(pipeline)):
        line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
        block_m = 128 if (pipeline, head_dim) == ("gluon_ws", 64) else 64  # the registry's query tile
        assert f"sm90_{pipeline}_m{block_m}" in line, line
        check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)


def _m128_dispatcher(stages):
    """The registry with its D=64 warp-specialized dK/dV config on 128-query stages (block_m 128,
    bwd_gluon._ws_compute_m128) and the D=64 kernel without warp specialization left out."""
    import dataclasses

    from fmha import Registry, default_registry
    from fmha.dispatch.configs import Family, Pipeline
    from fmha.dispatch.dispatcher import Dispatcher

    configs = []
    for c in default_registry():
        if c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon and c.signature.head_dims == (64,):
            if c.algorithm.pipeline != Pipeline.GLUON_WS:
                continue
            c = type(c)(c.signature, dataclasses.replace(c.algorithm, block_m=128, num_stages=stages), notes=c.notes)
        configs.append(c)
    return Dispatcher(Registry(configs, name=f"gluon-bwd-d64-m128-s{stages}"))


# (stages, SHAPES["gluon_ws"][64] changes): 3 stages fit with one dQ buffer only (227 KB).
M128_KERNELS = {"s2": (2, {}), "s2_atomics": (2, {"dq_tma": 0}), "s3_bufs1": (3, {"dq_bufs": 1})}


@pytest.mark.parametrize("kernel", list(M128_KERNELS))
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 2, 2, 700, 77), (2, 4, 1, 77, 700),
                                   (1, 4, 4, 1024, 1024), (1, 2, 2, 1001, 1001)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_backward_d64_m128(rng, monkeypatch, kernel, mask, shape):
    """The 128-query warp-specialized D=64 dK/dV kernel (two 64-query halves a stage) against
    float64: GQA, both causal alignments with Sq < Sk and Sq > Sk, sequences off the 128-row
    tile (a stage's second half past the end, or both), Sq % 4 != 0 (LSE/delta not by TMA), dQ
    by TMA reduce-add or the writer's atomics."""
    from attn_testing import check_backward

    stages, changes = M128_KERNELS[kernel]
    _change_bwd_shape(monkeypatch, "gluon_ws", 64, changes)
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, 64, mask, shape)
    with fmha.api.use_dispatcher(_m128_dispatcher(stages)):
        line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
        assert f"sm90_gluon_ws_m128n128w8s{stages}" in line, line
        check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)


# SHAPES["gluon_ws"][256] changes: the default (P^T, dS^T from shared memory), dQ by the
# writer's red.v4 (what dq_acc TMA cannot address gets), P^T/dS^T converted to register
# operands, dQ's second half issued before the first half's store.
D256_WS_KERNELS = {"default": {}, "atomics": {"dq_tma": 0}, "convert": {"ps_smem": 0}, "dq_early": {"dq_early": 1}}


def _check_d256_ws(rng, monkeypatch, kernel, mask, shape, dtype=torch.bfloat16):
    from attn_testing import check_backward

    _change_bwd_shape(monkeypatch, "gluon_ws", 256, D256_WS_KERNELS[kernel])
    q, k, v, kw = _masked_problem(rng, dtype, 256, mask, shape)
    line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
    assert "sm90_gluon_ws_m64n64w8s2" in line, line  # the registry's first D=256 choice
    check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)


@pytest.mark.parametrize("kernel", list(D256_WS_KERNELS))
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (1, 2, 2, 700, 77), (2, 4, 1, 77, 700),
                                   (1, 4, 4, 1024, 1024), (1, 2, 2, 1001, 1001)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_backward_d256(rng, monkeypatch, kernel, mask, shape):
    """The warp-specialized D=256 dK/dV kernel against float64: GQA (4 query heads a KV head:
    the ring crosses query heads), both causal alignments with Sq < Sk and Sq > Sk (key tiles
    without a query), sequences off the 64-row tiles, Sq % 4 != 0 (LSE/delta by ld.global, not
    TMA), dQ by TMA reduce-add or the writer's atomics, both P^T/dS^T paths, DQ_EARLY."""
    _check_d256_ws(rng, monkeypatch, kernel, mask, shape)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gluon_ws_backward_d256_fp16_long(rng, monkeypatch, mask):
    """fp16, 2048 x 2048 with 4 query heads a KV head: 128 tiles a key tile, the 2-stage ring's
    phases wrap 64 times."""
    _check_d256_ws(rng, monkeypatch, "default", mask, (1, 8, 2, 2048, 2048), dtype=torch.float16)


def test_warp_specialized_backward_is_chosen_at_d64(rng):
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, 64, "causal", (1, 4, 4, 1024, 1024))
    line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
    assert "gluon_ws" in line, line


# The persistent forward (fwd_gluon.launch(persistent=True), constexpr PERSISTENT): the same
# checks with every Gluon forward launch of the dispatcher made persistent. programs: the SM
# count the launcher sees (None: the real one), so that each program runs many CTA tiles
# (ring and Q barrier phases carried across tiles, the snake order's partial last round).
PERSISTENT_SHAPES = [  # (batch, nhead_q, nhead_k, seqlen_q, seqlen_k)
    (4, 16, 4, 1000, 1533),  # GQA, 512 tiles: more than the SMs; rows and keys off the tile
    (16, 16, 16, 1024, 1024),  # the short-sequence shape the persistent kernel is for
    (2, 4, 1, 77, 4099),
    (1, 2, 2, 4099, 77),  # Sq > Sk: fully masked rows under bottom-right causal
    (1, 3, 1, 1300, 1300),  # 11 row tiles x 3 heads, MQA: odd, the pairs order's single last tile
    (3, 4, 2, 1400, 1100),  # 11 row tiles x 12 heads: blocks of two heads with a middle unit each
]


def _persistent_launches(monkeypatch, programs=None, tile_order=None):
    """Make the dispatcher's Gluon forward persistent (at most `programs` SMs), in causal tile order
    `tile_order` (None: launch's default, `fwd_gluon.default_tile_order` where it balances the
    programs, persistent_schedule.causal_tile_order); returns the list the
    launches' (grid, number of CTA
    tiles) are appended to."""
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.launch import cache as launch_cache
    from fmha.kernels.launch import loader

    seen = []
    real_launch, real_cache_launch = fwd_gluon.launch, launch_cache.launch

    def launch(q, *args, **kwargs):
        kwargs["persistent"] = True
        if tile_order is not None:
            kwargs["tile_order"] = tile_order
        row_tiles = -(-q.shape[2] // kwargs["block_m"])
        tiles = row_tiles * q.shape[0] * q.shape[1]

        def record(kernel, grid, *a, **kw):
            if kernel is not fwd_gluon.fwd_ws_kernel:  # (fp8: the V^T copy, kernels/fp8_vt.py)
                return real_cache_launch(kernel, grid, *a, **kw)
            assert kw["PERSISTENT"] is True
            default = causal_tile_order(fwd_gluon.default_tile_order(q.shape[3], row_tiles),
                                        q.shape[0] * q.shape[1], row_tiles, grid[0])
            order = (default if tile_order is None else tile_order) if kwargs["causal"] else 0
            assert kw["TILE_ORDER"] == order, (kw["TILE_ORDER"], order)
            seen.append((grid[0], tiles))
            return real_cache_launch(kernel, grid, *a, **kw)

        monkeypatch.setattr(launch_cache, "launch", record)
        try:
            return real_launch(q, *args, **kwargs)
        finally:
            monkeypatch.setattr(launch_cache, "launch", real_cache_launch)

    monkeypatch.setattr(fwd_gluon, "launch", launch)
    if programs is not None:
        monkeypatch.setattr(fwd_gluon, "_sm_count", lambda device: programs)
    # the compiled module's guarded launchers wrap the functions they found: a fresh one
    monkeypatch.setitem(loader._guarded, "gluon.fwd", loader._GuardedModule(fwd_gluon))
    return seen


def _check_persistent_grid(seen, programs, kernel="Gluon forward"):
    assert seen, f"no persistent {kernel} launch"
    sms = programs or torch.cuda.get_device_properties(0).multi_processor_count
    for grid, tiles in seen:
        assert grid == min(tiles, sms), (grid, tiles, sms)


@pytest.mark.parametrize("programs", [None, 5], ids=["all_sms", "5_programs"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_forward_persistent(rng, monkeypatch, programs, head_dim, mask, shape):
    seen = _persistent_launches(monkeypatch, programs)
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, head_dim, mask, shape)
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)
    _check_persistent_grid(seen, programs)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("scale", [-0.09, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_persistent_fp16_scales_layouts(rng, monkeypatch, layout, scale, causal):
    """fp16, a negative and a zero scale (NEG_SCALE, TINY_SCALE), the bshd view (strided O by TMA)."""
    seen = _persistent_launches(monkeypatch, programs=7)
    q, k, v = make_qkv(rng, dtype=torch.float16, layout=layout, device=CUDA, batch=2, nhead_q=8,
                       nhead_k=2, seqlen_q=700, seqlen_k=900, head_dim=128)
    assert _uses_gluon(q, k, v, layout=layout, causal=causal, scale=scale)
    check_attention(q, k, v, layout=layout, causal=causal, scale=scale, truth="torch64")
    _check_persistent_grid(seen, 7)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_persistent_fp8(rng, monkeypatch, head_dim, causal):
    """The e4m3 kernel (V^T tiles, descales per (batch, head) loaded per CTA tile, O stored
    from registers as bf16) persistent, against the fp8 bound of tests/fp8_testing.py."""
    from fp8_testing import run_and_check

    seen = _persistent_launches(monkeypatch, programs=6)
    q, k, v = (torch.randn(shape, generator=rng).to(CUDA) for shape in
               ((2, 8, 777, head_dim), (2, 2, 1500, head_dim), (2, 2, 1500, head_dim)))
    run_and_check(q, k, v, granularity="head", causal=causal, gpu=True)
    _check_persistent_grid(seen, 6)



@pytest.mark.parametrize("tile_order", [0, 1], ids=["lpt", "heads"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left"])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_forward_persistent_tile_orders(rng, monkeypatch, tile_order, head_dim, mask, shape):
    """The causal tile orders the registry does not choose (fwd_gluon.launch tile_order 0, 1)
    against the float64 truth, at more tiles than programs (5): a missed or doubled tile shows as
    a wrong row block."""
    seen = _persistent_launches(monkeypatch, 5, tile_order)
    q, k, v, kw = _masked_problem(rng, torch.bfloat16, head_dim, mask, shape)
    assert _uses_gluon(q, k, v, **kw), fmha.explain(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)
    _check_persistent_grid(seen, 5)


# The lazy O rescale (fwd_gluon's constexpr RESCALE_TAU, FlashAttention-4's trick): the running
# max used as the exponent reference moves only when a row's max grew by more than tau. The same
# float64 checks with tau 8 forced on every fp16/bf16 launch (the default uses it on one-tile
# kernels and the persistent D=256 one: fwd_gluon.default_rescale_tau), on adversarial logits:
# a slow ramp (the max grows by `per_64_keys` log2 units every 64 keys, under tau: the reference
# lags, P grows up to 2**tau), big jumps, fully masked rows.
def _lazy_rescale(monkeypatch, tau=None):
    """Make every fp16/bf16 Gluon forward launch use RESCALE_TAU = tau (None: fwd_gluon.TAU_HALF)
    unless it names its own; returns the list of the RESCALE_TAU values the kernel launches got."""
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.launch import cache as launch_cache

    tau = fwd_gluon.TAU_HALF if tau is None else tau
    monkeypatch.setattr(fwd_gluon, "default_rescale_tau", lambda head_dim, persistent, fp8: 0.0 if fp8 else tau)
    seen, real = [], launch_cache.launch

    def record(kernel, grid, *a, **kw):
        if kernel is fwd_gluon.fwd_ws_kernel:
            seen.append(kw.get("RESCALE_TAU", 0.0))
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(launch_cache, "launch", record)
    return seen


def ramp_qkv(rng, dtype, shape, head_dim, per_64_keys, jumps=(), scale=None, device=CUDA):
    """q, k, v (bhsd, float32 on `device` before the cast to dtype) whose logits q.k * scale grow
    by about `per_64_keys` (log2 units) every 64 keys, plus `jumps` (key index, log2 units) added
    to single keys; the rest of the logits is small noise."""
    import math

    batch, hq, hk, sq, sk = shape
    scale = head_dim ** -0.5 if scale is None else scale
    q = torch.randn(batch, hq, sq, head_dim, generator=rng) * 0.3
    k = torch.randn(batch, hk, sk, head_dim, generator=rng) * 0.3
    v = torch.randn(batch, hk, sk, head_dim, generator=rng)
    q[..., 0] = 1.0 / scale
    ramp = torch.arange(sk, dtype=torch.float32) / 64 * per_64_keys / math.log2(math.e)
    for key, size in jumps:
        ramp[key] += size / math.log2(math.e)
    k[..., 0] = ramp
    return tuple(t.to(device).to(dtype) for t in (q, k, v))


RAMPS = {  # (per_64_keys, jumps) in log2 units
    "ramp_0.5": (0.5, ()),
    "ramp_7.9": (7.9, ()),  # just under bf16's tau: the reference lags by up to 7.9
    "jumps": (0.05, ((700, 30.0), (1400, 12.0), (1401, 40.0))),
    "descending": (-0.5, ((5, 9.0),)),
}


@pytest.mark.parametrize("persistent", [False, True], ids=["one_tile", "persistent"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("case", sorted(RAMPS))
def test_gluon_lazy_rescale_adversarial(rng, monkeypatch, persistent, head_dim, mask, case):
    seen = _lazy_rescale(monkeypatch)
    if persistent:
        _persistent_launches(monkeypatch, programs=5)
    per_64, jumps = RAMPS[case]
    q, k, v = ramp_qkv(rng, torch.bfloat16, (2, 4, 2, 1500, 1777), head_dim, per_64, jumps)
    kw = {} if mask == "none" else {"causal": True}
    if mask == "causal_top_left":
        kw["mask_align"] = "top_left"
    assert _uses_gluon(q, k, v, **kw)
    check_attention(q, k, v, truth="torch64", **kw)
    assert seen and all(t == 8.0 for t in seen), seen


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_lazy_rescale_random(rng, monkeypatch, head_dim, mask, shape):
    """test_gluon_forward's problems (fully masked rows: Sq > Sk bottom-right) with tau 8, fp16
    (the adversarial cases are bf16)."""
    seen = _lazy_rescale(monkeypatch)
    q, k, v, kw = _masked_problem(rng, torch.float16, head_dim, mask, shape)
    check_attention(q, k, v, truth="torch64", **kw)
    assert seen and all(t == 8.0 for t in seen), seen


@pytest.mark.parametrize("scale", [-0.09, 0.0, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_lazy_rescale_scales(rng, monkeypatch, scale, causal):
    """A negative scale (NEG_SCALE), 0 (TINY_SCALE: the max never grows by tau) and a large one."""
    _lazy_rescale(monkeypatch)
    q, k, v = make_qkv(rng, dtype=torch.bfloat16, layout="bhsd", device=CUDA, batch=1, nhead_q=4,
                       nhead_k=4, seqlen_q=700, seqlen_k=900, head_dim=128)
    check_attention(q, k, v, causal=causal, scale=scale, truth="torch64")


# The persistent warp-specialized dK/dV kernel (bwd_gluon.launch_dkdv(persistent=True), constexpr
# PERSISTENT): the registry's gluon_ws dK/dV configs (D 64/128/256) made persistent. programs: the SM count
# the launcher sees (None: the real one), so that each program runs many key tiles (the Q/dO
# ring's, the statistics' and the dQ hand-over's phases carried across tiles, kv_bar/kv_empty
# flipping per tile, the snake's partial last round). docs/notes/bwd-persistent.md.
PERSISTENT_BWD_SHAPES = [  # (batch, nhead_q, nhead_k, seqlen_q, seqlen_k)
    (2, 8, 2, 1000, 1533),  # GQA: the ring crosses query heads; 48 key tiles of 128 (D=256: 96 of 64)
    (1, 2, 2, 700, 77),  # Sq > Sk: fully masked rows under bottom-right causal; fewer tiles than programs
    (2, 4, 1, 77, 700),  # key tiles without a query under causal (top-left: keys past 77)
    (1, 4, 4, 1024, 1024),
    (1, 2, 2, 1001, 1001),  # Sq % 4 != 0: LSE/delta by ld.global, not TMA; rows off every tile
]


def _persistent_bwd_dispatcher():
    """The registry with its warp-specialized Gluon dK/dV configs made persistent (D=64's is
    already: its one-tile twin is left out) and the Gluon dK/dV kernels without warp
    specialization left out."""
    import dataclasses

    from fmha import Registry, default_registry
    from fmha.dispatch.configs import Family, Pipeline
    from fmha.dispatch.dispatcher import Dispatcher

    configs = []
    for c in default_registry():
        if c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon:
            if c.algorithm.pipeline != Pipeline.GLUON_WS:
                continue
            c = type(c)(c.signature, dataclasses.replace(c.algorithm, persistent=True), notes=c.notes)
            if any(o.name == c.name for o in configs):  # D=64: the registry's own persistent config
                continue
        configs.append(c)
    return Dispatcher(Registry(configs, name="gluon-bwd-persistent"))


def _persistent_bwd_launches(monkeypatch, programs=None, tile_order=None):
    """Spy on bwd_gluon.launch_dkdv (at most `programs` SMs; causal key-tile order `tile_order`
    through SHAPES and run whether or not it balances the programs; None: SHAPES' own per head
    dim, where it balances, else pairs: persistent_schedule.causal_tile_order); returns the list
    the persistent launches' (grid, number of key tiles) are appended to."""
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.launch import cache as launch_cache
    from fmha.kernels.launch import loader

    seen = []
    real_launch, real_cache_launch = bwd_gluon.launch_dkdv, launch_cache.launch
    balanced = causal_tile_order
    if tile_order is not None:
        for head_dim in (64, 128, 256):
            _change_bwd_shape(monkeypatch, "gluon_ws", head_dim, {"tile_order": tile_order})
        monkeypatch.setattr(bwd_gluon, "causal_tile_order", lambda order, *shape: order)  # (as forced)
        balanced = bwd_gluon.causal_tile_order
    orders = {d: shape.get("tile_order", bwd_gluon.DEFAULT_TILE_ORDER)
              for d, shape in bwd_gluon.SHAPES["gluon_ws"].items()}  # (D=64: heads)

    def launch_dkdv(q, k, *args, **kwargs):
        assert kwargs["persistent"] is True and kwargs["warp_specialized"] is True, kwargs
        n_tiles = -(-k.shape[2] // kwargs["block_n"])
        tiles = n_tiles * k.shape[0] * k.shape[1]

        def record(kernel, grid, *a, **kw):
            order = balanced(orders[q.shape[3]], k.shape[0] * k.shape[1], n_tiles, grid[0])
            assert kernel is bwd_gluon.bwd_dkdv_ws_kernel and kw["PERSISTENT"] is True
            assert kw["TILE_ORDER"] == (order if kwargs["causal"] else 0), (kw["TILE_ORDER"], order)
            seen.append((grid[0], tiles))
            return real_cache_launch(kernel, grid, *a, **kw)

        monkeypatch.setattr(launch_cache, "launch", record)
        try:
            return real_launch(q, k, *args, **kwargs)
        finally:
            monkeypatch.setattr(launch_cache, "launch", real_cache_launch)

    monkeypatch.setattr(bwd_gluon, "launch_dkdv", launch_dkdv)
    if programs is not None:
        monkeypatch.setattr(bwd_gluon, "_sm_count", lambda device: programs)
    # the compiled module's guarded launchers wrap the functions they found: a fresh one
    monkeypatch.setitem(loader._guarded, "gluon.bwd", loader._GuardedModule(bwd_gluon))
    return seen


def _check_persistent_backward(rng, monkeypatch, programs, head_dim, mask, shape, dtype=torch.bfloat16,
                               tile_order=None, **changes):
    """check_backward (float64 truth) through the persistent dK/dV kernel; explain names the
    persistent config and every dK/dV launch ran min(key tiles, SMs) programs."""
    from attn_testing import check_backward

    seen = _persistent_bwd_launches(monkeypatch, programs, tile_order)
    if changes:
        _change_bwd_shape(monkeypatch, "gluon_ws", head_dim, changes)
    q, k, v, kw = _masked_problem(rng, dtype, head_dim, mask, shape)
    with fmha.api.use_dispatcher(_persistent_bwd_dispatcher()):
        line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
        tile = {64: "m128n128w8s2", 128: "m64n128w8s3", 256: "m64n64w8s2"}[head_dim]  # the registry's tiles
        assert f"sm90_gluon_ws_{tile}_persistent" in line, line
        check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)
    _check_persistent_grid(seen, programs, "dK/dV")


@pytest.mark.parametrize("programs", [5, 7], ids=lambda p: f"{p}_programs")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
@pytest.mark.parametrize("shape", PERSISTENT_BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_backward_persistent(rng, monkeypatch, programs, head_dim, mask, shape):
    _check_persistent_backward(rng, monkeypatch, programs, head_dim, mask, shape)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_top_left"])
def test_gluon_ws_backward_persistent_all_sms(rng, monkeypatch, head_dim, mask):
    """The short-sequence shape the persistent kernel is for, on every SM (2048 key tiles at
    block_n 128: ~16 a program; D=256: 4096 of 64 keys)."""
    _check_persistent_backward(rng, monkeypatch, None, head_dim, mask, (16, 16, 16, 1024, 1024))


@pytest.mark.parametrize("tile_order", [0, 1, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1533), (2, 4, 1, 77, 700), (1, 3, 1, 1300, 1300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_backward_persistent_tile_orders(rng, monkeypatch, tile_order, head_dim, mask, shape):
    """Each causal key-tile order (LPT, heads, pairs; 1300 keys: 11 key tiles a head, the pairs
    order's middle tile and odd unit count) on 5 programs."""
    _check_persistent_backward(rng, monkeypatch, 5, head_dim, mask, shape, tile_order=tile_order)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("kernel", ["fp16", "atomics"])
def test_gluon_ws_backward_persistent_fp16_and_atomics(rng, monkeypatch, head_dim, mask, kernel):
    """fp16, and dQ by the writer's red.v4 (dq_tma 0: what dq_acc TMA cannot address gets), on 7
    programs, GQA 4 query heads a KV head."""
    if kernel == "fp16":
        _check_persistent_backward(rng, monkeypatch, 7, head_dim, mask, (2, 8, 2, 1000, 1533), dtype=torch.float16)
    else:
        _check_persistent_backward(rng, monkeypatch, 7, head_dim, mask, (2, 8, 2, 1000, 1533), dq_tma=0)


# Varlen on the one-tile Gluon forward (fwd_gluon's VARLEN): packed sequences, rows and keys offset
# per sequence in the kernel. Lengths: empty sequences (queries without keys, keys without
# queries), lengths off the 128-row and key tiles, and long ones.
VARLEN_LENGTHS = {
    "mixed": ([1, 0, 777, 2048, 33, 300], [9, 5, 1000, 2048, 0, 129]),
    "equal": ([1024] * 3, [1024] * 3),
    "docs": ([2000, 100, 3000, 1, 700], [2000, 100, 3000, 1, 700]),
    # sequences starting off 4-row boundaries with a total that is a multiple of 4 (the
    # features suite's case: a TMA copy of LSE rows from such a start faulted)
    "odd_starts": ([3, 1021, 5, 1019], [3, 1021, 5, 1019]),
}
VARLEN_MASKS = {"none": {}, "causal": dict(causal=True), "causal_top_left": dict(causal=True, mask_align="top_left"),
                "window": dict(window=(100, 0))}


def _calls_of(monkeypatch, module, name):
    """The keyword arguments of every call of `module.name` from now on (a module-level function
    its module's launcher looks up when it runs: fwd_gluon's or bwd_gluon's varlen launch, which
    runs only where the dispatcher picked that Gluon kernel)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _varlen_launches(monkeypatch):
    from fmha.kernels.gluon import fwd as fwd_gluon

    return _calls_of(monkeypatch, fwd_gluon, "_launch_varlen")


def _check_varlen_forward(rng, dtype, head_dim, lens_q, lens_k, hq, hk, **kw):
    """fmha.attention_varlen against float64 attention of each sequence alone (o: the 2x rule
    against the same math at the inputs' dtype; lse to 1e-3)."""
    from fmha.testing.numerics import torch_attention

    from attn_testing import randn

    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
                  for n in (lens_q, lens_k))
    q = randn((sum(lens_q), hq, head_dim), dtype, rng, CUDA)
    k = randn((sum(lens_k), hk, head_dim), dtype, rng, CUDA)
    v = randn((sum(lens_k), hk, head_dim), dtype, rng, CUDA)
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k, strict=True)):
        if sq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if sk == 0:  # no keys: o 0, lse -inf
            assert (o[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
            continue
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[rows], k[keys], v[keys]))
        want, want_lse = torch_attention(qs, ks, vs, compute_dtype=torch.float64, **kw)
        base, _ = torch_attention(qs, ks, vs, **kw)
        got = o[rows].transpose(0, 1)[None].double()
        err, base_err = (got - want).abs().max().item(), (base.double() - want).abs().max().item()
        assert err <= 2 * base_err + 1e-3, (b, sq, sk, err, base_err)
        live = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse[:, rows][None]), live), b
        assert (lse[:, rows][None][live].double() - want_lse[live]).abs().max().item() < 1e-3, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
@pytest.mark.parametrize("lengths", list(VARLEN_LENGTHS))
def test_gluon_varlen_forward(rng, monkeypatch, dtype, head_dim, mask, lengths):
    """Varlen on the one-tile Gluon forward: GQA 4:2 (MQA at D=256), masks aligned per sequence,
    a window (100, 0), against float64 per sequence."""
    calls = _varlen_launches(monkeypatch)
    lens_q, lens_k = VARLEN_LENGTHS[lengths]
    kw = VARLEN_MASKS[mask]
    _check_varlen_forward(rng, dtype, head_dim, lens_q, lens_k, 4, 1 if head_dim == 256 else 2, **kw)
    assert len(calls) == 1


def test_gluon_varlen_forward_features_suite_shape(rng, monkeypatch):
    """The features suite's varlen shape: 8 causal documents packed into 16384 tokens, Hq=32 Hk=8."""
    calls = _varlen_launches(monkeypatch)
    lens = [3072, 1024, 4096, 512, 2048, 1536, 2560, 1536]
    _check_varlen_forward(rng, torch.bfloat16, 128, lens, lens, 32, 8, causal=True)
    assert len(calls) == 1


def _varlen_backward_launches(monkeypatch):
    from fmha.kernels.gluon import bwd as bwd_gluon

    return _calls_of(monkeypatch, bwd_gluon, "_launch_dkdv_varlen")


def _check_varlen_backward(rng, dtype, head_dim, lens_q, lens_k, hq, hk, **kw):
    """dq, dk, dv of fmha.attention_varlen against float64 autograd of each sequence alone (the
    2x rule against the same math at the inputs' dtype, `numerics.compare`)."""
    from fmha.testing import numerics
    from fmha.testing.numerics import torch_attention

    from attn_testing import randn

    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
                  for n in (lens_q, lens_k))
    q = randn((sum(lens_q), hq, head_dim), dtype, rng, CUDA).requires_grad_()
    k = randn((sum(lens_k), hk, head_dim), dtype, rng, CUDA).requires_grad_()
    v = randn((sum(lens_k), hk, head_dim), dtype, rng, CUDA).requires_grad_()
    o = fmha.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    do = randn(o.shape, dtype, rng, CUDA)
    ours = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(o, (q, k, v), do), strict=True))
    want = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in (("dq", q), ("dk", k), ("dv", v))}
    base = {n: torch.zeros_like(t) for n, t in (("dq", q), ("dk", k), ("dv", v))}
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k, strict=True)):
        if sq == 0 or sk == 0:  # no pairs: every gradient of the sequence is 0
            continue
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        for dt, into in ((torch.float64, want), (None, base)):
            qs, ks, vs = ((t[s].detach().to(dt or dtype).transpose(0, 1)[None]).requires_grad_()
                          for t, s in ((q, rows), (k, keys), (v, keys)))
            out, _ = torch_attention(qs, ks, vs, compute_dtype=dt, **kw)
            grads = torch.autograd.grad(out, (qs, ks, vs), do[rows].to(out.dtype).transpose(0, 1)[None])
            for n, g, s in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), strict=True):
                into[n][s] = g[0].transpose(0, 1).to(into[n].dtype)
    for n in ("dq", "dk", "dv"):
        c = numerics.compare(n, ours[n], want[n], base[n], dtype)
        assert c.ok, str(c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
@pytest.mark.parametrize("lengths", list(VARLEN_LENGTHS))
def test_gluon_varlen_backward(rng, monkeypatch, dtype, head_dim, mask, lengths):
    """Varlen on the one-tile warp-specialized Gluon dK/dV kernel (VARLEN): GQA 4:2 (MQA at
    D=256), masks aligned per sequence, a window (100, 0), empty sequences on either side, against
    float64 per sequence."""
    calls = _varlen_backward_launches(monkeypatch)
    lens_q, lens_k = VARLEN_LENGTHS[lengths]
    kw = VARLEN_MASKS[mask]
    _check_varlen_backward(rng, dtype, head_dim, lens_q, lens_k, 4, 1 if head_dim == 256 else 2, **kw)
    assert len(calls) == 1


@pytest.mark.parametrize("dq", ["tma", "atomics"])
def test_gluon_varlen_backward_features_suite_shape(rng, monkeypatch, dq):
    """The features suite's varlen shape (8 causal documents in 16384 tokens, Hq=32 Hk=8), dQ by TMA
    reduce-add and by the writer's red.v4; an odd total (LSE/delta not TMA-aligned)."""
    _change_bwd_shape(monkeypatch, "gluon_ws", 128, {"dq_tma": int(dq == "tma")})
    calls = _varlen_backward_launches(monkeypatch)
    lens = [3072, 1024, 4096, 511, 2048, 1536, 2560, 1536]
    _check_varlen_backward(rng, torch.bfloat16, 128, lens, lens, 32, 8, causal=True)
    assert len(calls) == 1


@pytest.mark.parametrize("order", ["seq_major", "tile_major", "seq_bands"])
@pytest.mark.parametrize("case", ["varlen_mixed", "varlen_docs", "dense_causal", "dense_causal_top_left"])
def test_gluon_dkdv_grid_orders(rng, monkeypatch, order, case):
    """Each program order of the one-tile warp-specialized dK/dV grids (bwd_gluon.GRID_ORDERS: which
    (batch or sequence, KV head, key tile) a program takes) covers every key tile once: D=128 bf16
    causal, GQA, varlen (empty and long sequences) and dense (the registry's one-tile kernel at
    D=128), against float64."""
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.launch import plan_tables

    from attn_testing import check_backward

    monkeypatch.setattr(bwd_gluon, "VARLEN_GRID_ORDER", bwd_gluon.GRID_ORDERS[order])
    monkeypatch.setattr(bwd_gluon, "DENSE_GRID_ORDER", bwd_gluon.GRID_ORDERS[order])
    plan_tables.clear_plans()  # (plans keep the order they were made with)
    if case.startswith("varlen"):
        calls = _varlen_backward_launches(monkeypatch)
        lens_q, lens_k = VARLEN_LENGTHS[case.removeprefix("varlen_")]
        _check_varlen_backward(rng, torch.bfloat16, 128, lens_q, lens_k, 4, 2, causal=True)
        assert len(calls) == 1
    else:
        mask = case.removeprefix("dense_")
        q, k, v, kw = _masked_problem(rng, torch.bfloat16, 128, mask, (2, 8, 2, 1000, 1533))
        with fmha.api.use_dispatcher(_backward_dispatcher("gluon_ws")):
            line = next(x for x in fmha.explain(q.requires_grad_(), k, v, **kw).splitlines() if "bwd_dq_dk_dv " in x)
            assert "gluon_ws_m64" in line, line
            check_backward(q.detach(), k.detach(), v.detach(), truth="torch64", **kw)
    plan_tables.clear_plans()


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gluon_varlen_planned_calls_match_the_truth(rng, monkeypatch, direction):
    """Repeated attention_varlen calls on CUDA take the api's call plan and the launchers' plans
    (keyed by metadata: the lengths live on the device) with new inputs and new lengths of the same
    metadata: forward, and backward through the planned call, against float64 per sequence."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    calls = (_varlen_launches if direction == "forward" else _varlen_backward_launches)(monkeypatch)
    check = _check_varlen_forward if direction == "forward" else _check_varlen_backward
    plan_tables.clear_plans()
    # (the same total and longest sequence each time: the same metadata; empty and odd-start sequences)
    for lens in ([700, 0, 300, 24], [100, 700, 200, 24], [3, 700, 5, 316]):
        check(rng, torch.bfloat16, 128, lens, lens, 4, 2, causal=True)
    (planned,) = call_plans.FORWARD_PLANS.values()  # (the first call made it; the metadata repeats)
    assert planned.problem.varlen
    if direction == "forward":  # (the second call keeps the launcher's plan, the third launches it directly)
        assert len(calls) == 2 and planned.launched is not None and planned.launched.plan.direct is not None
    else:  # (the second call's backward keeps its launches' plans, the third launches them directly)
        assert len(calls) == 2 and len(planned.backward_plans) == 1 and len(bwd_gluon._PLANS) == 1
