"""kernels/launch_cache: the compiled-kernel key must separate every argument property the
JIT specializes on (a shared key would run a kernel compiled for other arguments), and an
interpreted kernel always goes through its own call. The launches themselves run in the GPU
tests (tests/test_gpu.py::test_launch_cache_*)."""

import numpy as np
import pytest
import torch

from fmha.kernels.gluon.common import _shared_layout, descriptor
from fmha.kernels.launch import cache as launch_cache
from fmha.kernels.launch import plan_tables
from fmha.ops import call_plans


def test_int_keys_are_values_and_bools_differ_from_ints():
    assert launch_cache._key_of(16) == 16 and launch_cache._key_of(2**40) == 2**40
    assert launch_cache._key_of(True) != launch_cache._key_of(1)
    assert launch_cache._key_of(0.5) is launch_cache._key_of(2.0) is float
    assert launch_cache._key_of(None) is type(None)


def test_tensor_keys_see_dtype_and_16_byte_alignment():
    x = torch.zeros(64, dtype=torch.float32)
    assert launch_cache._key_of(x) == launch_cache._key_of(x[4:])  # 16 bytes further: aligned
    assert launch_cache._key_of(x) != launch_cache._key_of(x[1:])  # 4 bytes: not
    assert launch_cache._key_of(x) != launch_cache._key_of(x.to(torch.float16))


def test_descriptor_keys_see_block_and_layout():
    t = torch.zeros(2, 4, 256, 128, dtype=torch.bfloat16)
    a, b = descriptor(t, 128), descriptor(t, 64)
    assert launch_cache._key_of(a) == launch_cache._key_of(descriptor(t.clone(), 128))
    assert launch_cache._key_of(a) != launch_cache._key_of(b)
    assert a.layout is _shared_layout("bf16", 128, 128)  # cached: one object per block


def test_other_argument_types_are_refused():
    import pytest

    with pytest.raises(TypeError, match="no key"):
        launch_cache._key_of("text")


def test_interpreted_kernels_take_their_own_call(monkeypatch):
    calls = []

    class Interpreted:  # not a JITFunction (as triton's InterpretedFunction)
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launch_cache.launch(Interpreted(), (3,), 1, 2.0, BLOCK=4)
    assert calls == [((3,), (1, 2.0), {"BLOCK": 4})]
    assert not launch_cache._CACHE  # (the CPU backward tests run the interpreted bwd launches)


def _recorded_launches(monkeypatch):
    """launch_cache.launch replaced by a recorder: the compiled modules' launchers run on CPU
    tensors up to their kernel call."""
    seen = []
    monkeypatch.setattr(launch_cache, "launch", lambda kernel, grid, *a, **k: seen.append((kernel, grid, a, k)))
    return seen


def test_every_argument_the_launchers_pass_has_a_key(monkeypatch):
    """A launcher passing an argument `_key_of` cannot key would fail only on the GPU (CPU
    runs take the interpreter, which bypasses the cache): check their real arguments here."""
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.triton import bwd

    seen = _recorded_launches(monkeypatch)
    b, h, s, d = 2, 4, 256, 128
    q, k, v, o, do = (torch.randn(b, h, s, d).to(torch.bfloat16) for _ in range(5))
    lse, delta = torch.randn(b, h, s), torch.randn(b, h, s)
    fwd_gluon.launch(q, k, v, o, lse, causal=True, align_bottom_right=True, scale=0.1, block_m=128,
                     block_n=128, num_stages=2)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    fwd_gluon.launch(q8, k8, v8, o, lse, causal=False, align_bottom_right=True, scale=0.1, block_m=128,
                     block_n=128, num_stages=2, descales=(torch.ones(b, h, 1), None, None))
    bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v),
                          torch.zeros(b, h, s, d), causal=True, align_bottom_right=False, scale=0.1,
                          block_m=64, block_n=128, num_stages=2)
    bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v),
                          torch.zeros(b, h, s, d), causal=False, align_bottom_right=False, scale=0.1,
                          block_m=64, block_n=128, num_stages=2, warp_specialized=True)
    bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v),
                          torch.zeros(b, h, s, d), causal=True, align_bottom_right=False, scale=0.1,
                          block_m=64, block_n=128, num_stages=2, warp_specialized=True, window_left=100)
    packed = q.transpose(1, 2).reshape(b * s, h, d)  # varlen: (total, H, D), lse (H, total)
    cu = torch.tensor([0, 100, b * s], dtype=torch.int32)
    fwd_gluon.launch(packed, packed, packed, torch.empty_like(packed), torch.empty(h, b * s), causal=True,
                     align_bottom_right=True, scale=0.1, block_m=128, block_n=128, num_stages=2,
                     cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=b * s - 100, max_seqlen_k=b * s - 100)
    bwd_gluon.launch_dkdv(packed, packed, packed, packed, torch.empty(h, b * s), torch.empty(h, b * s),
                          torch.empty_like(packed), torch.empty_like(packed), torch.zeros(b * s, h, d), causal=True,
                          align_bottom_right=True, scale=0.1, block_m=64, block_n=128, num_stages=3,
                          warp_specialized=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=b * s - 100,
                          max_seqlen_k=b * s - 100)
    bwd.launch_dot_do_o(o, do, lse, delta, batch=b, max_seqlen_q=s, block_m=64, num_warps=4, num_stages=1)
    bwd.launch_convert_dq(torch.zeros(b, h, s, d), torch.empty_like(q), scale=0.1, block_m=64, num_warps=4)
    assert len(seen) == 9
    for kernel, grid, args, kwargs in seen:
        assert all(isinstance(g, int) for g in grid)
        hash((tuple(map(launch_cache._key_of, args)), tuple(kwargs.items())))  # keys and hashes
        assert set(kernel.arg_names[len(args):]) <= kwargs.keys(), kernel  # cacheable: no defaults left,
        assert all(type(x) in launch_cache._PLAIN for x in kwargs.values()), kernel  # no tensors by keyword


def test_tensors_by_keyword_are_not_cached(monkeypatch):
    """The key holds keyword values as they are: a tensor there (hashed by identity) would
    miss every time and keep the tensor alive, so such calls are left to the JIT."""
    from triton.runtime.jit import JITFunction

    calls = []

    class Kernel(JITFunction):
        def __init__(self):  # no function to compile: a stand-in for a compiled kernel
            self.arg_names = ["x", "Y"]

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(k) or object()

    import types

    active = types.SimpleNamespace(get_current_device=lambda: 0)
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(active=active))
    kernel = Kernel()
    launch_cache.launch(kernel, (1,), 1, Y=torch.zeros(2))
    launch_cache.launch(kernel, (1,), 1, Y=3)
    assert len(calls) == 2
    assert [key[3] for key in launch_cache._CACHE if key[0] == id(kernel)] == [(("Y", 3),)]
    launch_cache._CACHE.clear()


def test_every_decode_launch_has_a_key_and_the_16_bit_ones_are_cached(monkeypatch):
    """attention_with_kvcache as for CUDA tensors on an H200 (the compiled kvcache module,
    launches recorded): block table, indptr tables, split-KV + combine, append with rotary.
    float8 caches too, their descales (absent, per tensor, per (batch, KV head)) among the
    kernel's tensors."""
    import fmha
    from fmha import kvcache as api_kvcache
    from fmha.kernels.triton import kvcache as kernels

    seen = _recorded_launches(monkeypatch)
    monkeypatch.setattr(api_kvcache, "family_module", lambda *a, **k: kernels)
    monkeypatch.setattr(api_kvcache, "_reads_values", lambda device: False)
    monkeypatch.setattr(api_kvcache, "_arch", lambda device: "sm90")
    monkeypatch.setattr(api_kvcache, "_sm_count", lambda device: 132)
    b, hq, hk, d, page, pages = 2, 8, 2, 64, 16, 8
    q = torch.randn(b, 1, hq, d).to(torch.bfloat16)
    pool = torch.randn(b * pages, page, hk, d).to(torch.bfloat16)
    table = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages)
    lens = torch.full((b,), 100, dtype=torch.int32)
    for splits in (0, 1, 3):
        fmha.attention_with_kvcache(q, pool, pool, block_table=table, cache_seqlens=lens, num_splits=splits)
    fmha.attention_with_kvcache(q, pool, pool, kv_indices=table.reshape(-1), kv_last_page_len=lens - 96,
                                kv_indptr=torch.tensor([0, pages, 2 * pages], dtype=torch.int32))
    cos, sin = torch.randn(256, d // 2), torch.randn(256, d // 2)
    new = torch.randn(b, 1, hk, d).to(torch.bfloat16)
    fmha.attention_with_kvcache(q, pool, pool, k=new, v=new, block_table=table, cache_seqlens=lens,
                                rotary_cos=cos, rotary_sin=sin)
    fp8 = pool.to(torch.float8_e4m3fn)
    fmha.attention_with_kvcache(q, fp8, fp8, block_table=table, cache_seqlens=lens, num_splits=1)
    fmha.attention_with_kvcache(q, fp8, fp8, block_table=table, cache_seqlens=lens, k_descale=torch.tensor(0.5),
                                v_descale=torch.rand(b, hk) + 0.5)
    names = [kernel.fn.__name__ for kernel, *_ in seen]
    assert {"splitkv_kernel", "combine_kernel", "rotary_append_kernel"} <= set(names), names
    for kernel, _grid, args, kwargs in seen:
        hash((tuple(map(launch_cache._key_of, args)), tuple(kwargs.items())))
        assert set(kernel.arg_names[len(args):]) <= kwargs.keys(), kernel.fn.__name__
    plain = [all(type(x) in launch_cache._PLAIN for x in kwargs.values()) for *_, kwargs in seen]
    assert plain == [True] * len(seen)


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_the_gluon_backward_adds_dq_by_tma_where_it_can_address_the_accumulator(monkeypatch, warp_specialized):
    """dQ by TMA reduce-add needs a 16-byte aligned dq_acc: then the kernel gets its
    descriptor (blocks of 64 queries x the dQ columns of one reduction); otherwise the
    unspecialized kernel takes its atomics and the warp-specialized one refuses (its writer
    adds 16-byte quads)."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    seen = _recorded_launches(monkeypatch)
    b, h, s, d = 1, 2, 128, 128
    q, k, v, do = (torch.randn(b, h, s, d).to(torch.bfloat16) for _ in range(4))
    lse, delta = torch.randn(b, h, s), torch.randn(b, h, s)

    def launch(dq_acc):
        bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v), dq_acc,
                              causal=False, align_bottom_right=False, scale=0.1, block_m=64, block_n=128,
                              num_stages=2, warp_specialized=warp_specialized)
        return seen[-1]

    _, _, args, kwargs = launch(torch.zeros(b, h, s, d))
    assert kwargs["DQ_TMA"] is True and list(args[6].block_shape) == [1, 1, 64, d]
    shifted = torch.zeros(b * h * s * d + 1)[1:].view(b, h, s, d)  # 4 bytes off: no TMA
    if warp_specialized:
        with pytest.raises(ValueError, match="dq_acc"):
            launch(shifted)
    else:
        _, _, args, kwargs = launch(shifted)
        assert kwargs["DQ_TMA"] is False and args[6] is shifted


def test_the_d256_backward_stages_dq_in_the_tiles_q_and_do_buffers(monkeypatch):
    from fmha.kernels.gluon import bwd as bwd_gluon

    seen = _recorded_launches(monkeypatch)
    b, h, s, d = 1, 2, 128, 256
    q, k, v, do = (torch.randn(b, h, s, d).to(torch.bfloat16) for _ in range(4))
    lse, delta = torch.randn(b, h, s), torch.randn(b, h, s)
    bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v),
                          torch.zeros(b, h, s, d), causal=True, align_bottom_right=False, scale=0.1,
                          block_m=64, block_n=64, num_stages=2)
    _, _, args, kwargs = seen[-1]
    assert kwargs["DQ_TMA"] and kwargs["DQ_ALIAS"] and kwargs["DQ_COLS"] == 128
    assert list(args[6].block_shape) == [1, 1, 64, 128]  # one half per reduce-add


def _recorded_runs(monkeypatch):
    """The launch cache answering every key with a compiled kernel whose launch records its
    bound arguments and grid (launch_cache.run and run_plan reach it), so launchers run on CPU
    tensors with their plans enabled."""
    import types

    runs = []

    def run(g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *bound):
        runs.append(((g0, g1, g2), bound))

    compiled = types.SimpleNamespace(run=run, function=None, packed_metadata=None,
                                     launch_metadata=lambda grid, stream, *args: None)

    class AlwaysHit(dict):
        def get(self, key, default=None):
            hash(key)
            return compiled, (), None

    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 0)
    monkeypatch.setattr(launch_cache, "_CACHE", AlwaysHit())
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return runs


def _check_plan(call, make):
    """call(make()) makes a plan, call(second) runs it, and after clear_plans call(second) takes
    the launcher's full path: both launches must be the same. Returns the full path's launch."""
    launch_cache.clear_plans()
    call(make())
    second = make()
    planned = call(second)
    launch_cache.clear_plans()
    built = call(second)
    assert planned[0] == built[0]
    assert all(_same(a, b) for a, b in zip(planned[1], built[1], strict=True))
    return built


def _same(a, b) -> bool:
    """Equal launch arguments: the same tensors (by identity), descriptors over the same tensor
    with equal shape, strides, block and layout, equal other values."""
    if hasattr(a, "block_shape"):
        return (hasattr(b, "block_shape") and a.base is b.base and list(a.shape) == list(b.shape)
                and list(a.strides) == list(b.strides) and a.block_shape == b.block_shape and a.layout == b.layout)
    if isinstance(a, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, torch.float32])
def test_forward_plan_launches_what_the_launcher_builds(monkeypatch, persistent, causal, o_dtype):
    """fwd_gluon.launch's plan, made by one call, run by the next with other tensors of the
    same metadata, passes exactly what the full launcher builds for those tensors (checked
    against a call after clear_plans); a call with other metadata makes a plan of its own."""
    from fmha.kernels.gluon import fwd as fwd_gluon

    runs = _recorded_runs(monkeypatch)
    monkeypatch.setattr(fwd_gluon, "_sm_count", lambda device: 132)

    def tensors(b, hq, hk, s):
        q = torch.empty(b, hq, s, 64, dtype=torch.bfloat16)
        k, v = (torch.empty(b, hk, s, 64, dtype=torch.bfloat16) for _ in range(2))
        return q, k, v, torch.empty(b, hq, s, 64, dtype=o_dtype), torch.empty(b, hq, s)

    def call(ts):
        fwd_gluon.launch(*ts, causal=causal, align_bottom_right=True, scale=0.125, block_m=128, block_n=128,
                         num_stages=3, persistent=persistent)
        return runs[-1]

    _check_plan(call, lambda: tensors(2, 8, 2, 300))
    assert len(fwd_gluon._PLANS) == 1
    other = tensors(1, 4, 4, 700)
    call(other)
    call(other)
    assert len(fwd_gluon._PLANS) == 2


@pytest.mark.parametrize("descales", ["head", "tensor", "none"])
def test_fp8_forward_plan_launches_what_the_launcher_builds(monkeypatch, descales):
    """fwd_gluon.launch's fp8 plan, made by one call, run by the next with other tensors and
    descales of the same metadata: the launch is alike the full launcher's for those tensors
    (V^T is a new scratch buffer in each: compared by value), and it passes the call's descale
    views; descales of other metadata make a plan of their own."""
    from fmha.fp8 import descale_view
    from fmha.kernels.gluon import fwd as fwd_gluon

    runs = _recorded_runs(monkeypatch)

    def tensors(hq=8, hk=2, s=300, descale_shape=None):
        q = torch.randn(2, hq, s, 128).to(torch.float8_e4m3fn)
        k, v = (torch.randn(2, hk, s, 128).to(torch.float8_e4m3fn) for _ in range(2))
        shape = descale_shape if descale_shape is not None else {"head": (2, hk), "tensor": (), "none": None}[descales]
        ds = (None,) * 3 if shape is None else tuple(torch.rand(shape) + 0.5 for _ in range(3))
        views = tuple(descale_view(d) for d in ds)
        return (q, k, v, torch.empty(2, hq, s, 128, dtype=torch.bfloat16), torch.empty(2, hq, s)), views

    def call(ts):
        tensors_, views = ts
        fwd_gluon.launch(*tensors_, causal=True, align_bottom_right=True, scale=0.125, block_m=128, block_n=256,
                         num_stages=2, descales=views)
        return runs[-1]

    def alike_with_values(a, b) -> bool:  # (and the call's own tensors, but for broadcast descale views)
        if isinstance(a, torch.Tensor) and a.dim() and a.stride(0):
            return a is b
        return _alike_by_value(a, b)

    launch_cache.clear_plans()
    call(tensors())
    second = tensors()
    planned = call(second)
    assert len(fwd_gluon._PLANS) == 1
    launch_cache.clear_plans()
    built = call(second)
    assert planned[0] == built[0]
    assert all(alike_with_values(a, b) for a, b in zip(planned[1], built[1], strict=True))
    if descales == "head":  # the call's own descale views, not the first call's
        assert sum(any(a is d for d in second[1]) for a in planned[1]) == 3
        other = tensors(descale_shape=())  # per tensor: other strides
        call(other)
        call(other)
        assert len(fwd_gluon._PLANS) == 2


def test_fp8_vt_plan_launches_what_the_launcher_builds(monkeypatch):
    """fp8_vt.launch_vt's plan (the V^T copy of every fp8 forward call) passes what its full path
    builds for other tensors of the same metadata."""
    from fmha.kernels.gluon import fp8_vt

    runs = _recorded_runs(monkeypatch)

    def tensors():
        return torch.empty(2, 4, 300, 128, dtype=torch.uint8), torch.empty(2, 4, 128, 320, dtype=torch.uint8)

    def call(ts):
        fp8_vt.launch_vt(*ts, key_perm=True)
        return runs[-1]

    _check_plan(call, tensors)
    assert len(fp8_vt._PLANS) == 1


@pytest.mark.parametrize("warp_specialized, persistent", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("stats_aligned", [True, False])
def test_dkdv_plan_launches_what_the_launcher_builds(monkeypatch, warp_specialized, persistent, stats_aligned):
    """bwd_gluon.launch_dkdv's plan against its full path, as for the forward (LSE/delta by TMA
    and, unaligned, by pointer)."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    runs = _recorded_runs(monkeypatch)
    monkeypatch.setattr(bwd_gluon, "_sm_count", lambda device: 132)
    sq = 1000 if stats_aligned else 1001  # (Sq % 4: the stats rows' 16-byte alignment)

    def tensors():
        q, do = (torch.empty(2, 8, sq, 128, dtype=torch.bfloat16) for _ in range(2))
        k, v, dk, dv = (torch.empty(2, 2, 900, 128, dtype=torch.bfloat16) for _ in range(4))
        lse, delta = torch.empty(2, 8, sq), torch.empty(2, 8, sq)
        return q, k, v, do, lse, delta, dk, dv, torch.zeros(2, 8, sq, 128)

    def call(ts):
        bwd_gluon.launch_dkdv(*ts, causal=True, align_bottom_right=False, scale=0.088, block_m=64, block_n=128,
                              num_stages=2, warp_specialized=warp_specialized, persistent=persistent)
        return runs[-1]

    built = _check_plan(call, tensors)
    assert len(bwd_gluon._PLANS) == 1
    assert (not hasattr(built[1][4], "block_shape")) == (not stats_aligned)  # (LSE by TMA or by pointer)


def test_a_spy_on_launch_sees_every_launch(monkeypatch):
    """While `launch` is replaced, launchers build every launch (no plan), so the spy sees them."""
    from fmha.kernels.gluon import fwd as fwd_gluon

    _recorded_runs(monkeypatch)
    ts = [torch.empty(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(4)] + [torch.empty(1, 2, 128)]
    launch_cache.clear_plans()
    for _ in range(2):
        fwd_gluon.launch(*ts, causal=False, align_bottom_right=True, scale=0.1, block_m=128, block_n=128,
                         num_stages=2)
    assert len(fwd_gluon._PLANS) == 1
    seen = _recorded_launches(monkeypatch)
    assert not launch_cache.plans_enabled(fwd_gluon.fwd_ws_kernel)
    for _ in range(3):
        fwd_gluon.launch(*ts, causal=False, align_bottom_right=True, scale=0.1, block_m=128, block_n=128,
                         num_stages=2)
    assert len(seen) == 3


def test_backward_helper_plans_launch_what_the_launchers_build(monkeypatch):
    """bwd.launch_dot_do_o (dense, no dlse/sinks) and bwd.launch_convert_dq: a plan run
    passes what the full launcher builds; a dot(dO, O) with dlse never takes a plan."""
    from fmha.kernels.triton import bwd

    runs = _recorded_runs(monkeypatch)
    b, h, s, d = 2, 4, 333, 64

    def dot_tensors():
        o, do = (torch.empty(b, h, s, d, dtype=torch.bfloat16) for _ in range(2))
        return o, do, torch.empty(b, h, s), torch.empty(b, h, s)

    def dot(ts, **kw):
        bwd.launch_dot_do_o(*ts, batch=b, max_seqlen_q=s, block_m=64, num_warps=4, num_stages=1, **kw)
        return runs[-1]

    def convert(ts):
        bwd.launch_convert_dq(*ts, scale=0.125, block_m=64, num_warps=4)
        return runs[-1]

    _check_plan(dot, dot_tensors)
    _check_plan(dot, lambda: (*dot_tensors(), torch.empty(b, h, s, d)))  # with the dQ accumulator to zero
    _check_plan(convert, lambda: (torch.empty(b, h, s, d), torch.empty(b, h, s, d, dtype=torch.bfloat16)))
    launch_cache.clear_plans()
    # a dQ accumulator 4 bytes off 16-byte alignment (the JIT specializes on it) is a plan of its own
    dot((*dot_tensors(), torch.empty(b, h, s, d)))
    dot((*dot_tensors(), torch.empty(b * h * s * d + 1)[1:].view(b, h, s, d)))
    assert len(bwd._DOT_DO_O_PLANS) == 2
    launch_cache.clear_plans()
    ts = dot_tensors()
    for _ in range(2):
        dot(ts, dlse=torch.empty(b, h, s))
    assert not bwd._DOT_DO_O_PLANS


@pytest.mark.parametrize("tables", ["contiguous", "block_table", "indptr"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_plans_launch_what_the_launchers_build(monkeypatch, tables, num_splits):
    """kernels/kvcache.launch_attention (contiguous cache, block table or FlashInfer indptr
    tables; one split or four into fp32 partials; plain, or with ALiBi slopes, sinks and a cache
    batch index) and launch_combine (without and with sinks): a plan run passes what the full
    launcher builds."""
    from fmha.kernels.triton import kvcache

    runs = _recorded_runs(monkeypatch)
    b, hq, hk, d, page, pages = 3, 8, 2, 128, 16, 40

    def tensors():
        q = torch.empty(b, 1, hq, d, dtype=torch.bfloat16)
        if tables == "contiguous":
            cache = torch.empty(b, page * 8, hk, d, dtype=torch.bfloat16)
            kw = dict(seqlens_k=torch.full((b,), 100, dtype=torch.int32))
        else:
            cache = torch.empty(pages, page, hk, d, dtype=torch.bfloat16)
            ids = torch.arange(b * 8, dtype=torch.int32)
            kw = (dict(block_table=ids.reshape(b, 8), seqlens_k=torch.full((b,), 100, dtype=torch.int32))
                  if tables == "block_table" else
                  dict(block_table=ids, kv_indptr=torch.arange(0, b * 8 + 1, 8, dtype=torch.int32),
                       kv_last_page_len=torch.full((b,), 4, dtype=torch.int32)))
        if num_splits == 1:
            o, lse = torch.empty(b, 1, hq, d, dtype=torch.bfloat16), torch.empty(b, hq, 1)
        else:
            o, lse = torch.empty(num_splits, b, hq, 1, d), torch.empty(num_splits, b, hq, 1)
        return (q, cache, cache.clone(), o, lse), kw

    def attention(made, **extra):
        args, kw = made
        kvcache.launch_attention(*args, **kw, **extra, num_splits=num_splits, scale=0.088, softcap=0.0,
                                 window=(-1, -1), sink_size=0, align_bottom_right=True, block_m=16, block_n=64,
                                 num_warps=4, num_stages=2, dot_precision="ieee")
        return runs[-1]

    def combine(ts):
        kvcache.launch_combine(*ts, nheads=hq, seqlen=1, block_m=16, num_warps=4)
        return runs[-1]

    _check_plan(attention, tensors)
    assert len(kvcache._ATTENTION_PLANS) == 1
    _check_plan(combine, lambda: (torch.empty(4, b * hq, d), torch.empty(4, b * hq),
                                  torch.empty(b, 1, hq, d, dtype=torch.bfloat16), torch.empty(b, hq, 1)))

    def with_features():
        args, kw = tensors()
        extra = dict(alibi_slopes=torch.rand(b, hq), sinks=torch.randn(hq))
        if tables == "contiguous":
            extra["cache_batch_idx"] = torch.randperm(b).int()
        return args, {**kw, **extra}

    _check_plan(attention, with_features)
    assert len(kvcache._ATTENTION_PLANS) == 1

    def combine_with_sinks(ts):
        kvcache.launch_combine(*ts[:4], sinks=ts[4], nheads=hq, seqlen=1, block_m=16, num_warps=4)
        return runs[-1]

    _check_plan(combine_with_sinks, lambda: (torch.empty(4, b * hq, d), torch.empty(4, b * hq),
                                             torch.empty(b, 1, hq, d, dtype=torch.bfloat16), torch.empty(b, hq, 1),
                                             torch.randn(hq)))
    launch_cache.clear_plans()  # a plain call and one with ALiBi slopes: two plans, not one
    attention(tensors())
    attention(with_features())
    assert len(kvcache._ATTENTION_PLANS) == 2



@pytest.mark.parametrize("pdl", [True, False])
def test_split_decode_chains_the_combine_by_programmatic_dependent_launch(monkeypatch, pdl):
    """Where kernels chain by PDL (sm_90+ CUDA devices, kvcache._pdl), a split-KV launch lets its
    dependents start (LAUNCH_DEPENDENTS) and the combine is launched with `launch_pdl` and waits
    for it (WAIT_PRIOR); one split has no dependent. Elsewhere (CPU tensors, the interpreter, or
    kvcache.PDL off) neither flag is set."""
    from fmha.kernels.triton import kvcache

    seen = _recorded_launches(monkeypatch)
    monkeypatch.setattr(kvcache, "_pdl", lambda t: pdl)
    b, hq, hk, d = 2, 8, 2, 64
    q, cache = torch.empty(b, 1, hq, d), torch.empty(b, 256, hk, d)
    for splits in (4, 1):
        o = torch.empty(splits, b, hq, 1, d) if splits > 1 else torch.empty(b, 1, hq, d)
        lse = torch.empty(splits, b, hq, 1) if splits > 1 else torch.empty(b, hq, 1)
        kvcache.launch_attention(q, cache, cache, o, lse, seqlens_k=torch.full((b,), 200, dtype=torch.int32),
                                 num_splits=splits, scale=0.1, softcap=0.0, window=(-1, -1), sink_size=0,
                                 align_bottom_right=True, block_m=16, block_n=64, num_warps=4, num_stages=2,
                                 dot_precision="ieee")
    kvcache.launch_combine(torch.empty(4, b * hq, d), torch.empty(4, b * hq), torch.empty(b, 1, hq, d),
                           torch.empty(b, hq, 1), nheads=hq, seqlen=1, block_m=16, num_warps=4)
    (_, _, _, split4), (_, _, _, split1), (_, _, _, combine) = seen
    assert split4["LAUNCH_DEPENDENTS"] is pdl and split1["LAUNCH_DEPENDENTS"] is False
    assert combine["WAIT_PRIOR"] is pdl and combine["launch_pdl"] is pdl
    monkeypatch.undo()
    assert not kvcache._pdl(q)  # (CPU tensors: the interpreter runs no griddepcontrol)


class _CLauncher:
    """Stands in for Triton's compiled C launcher (`mod.launch`): records its arguments. An
    object, so it has no closure (a kernel without descriptors gets it unwrapped)."""

    def __init__(self) -> None:
        self.calls = []
        self.wrapped = 0  # (calls that came through Triton's CudaLauncher.__call__)

    def __call__(self, *args) -> None:
        self.calls.append(args)


def _triton_launchers(monkeypatch, bound: tuple):
    """The launch cache answering every key with a compiled kernel whose `run` is Triton's own
    CudaLauncher.__call__ and descriptor wrapper (`wrap_handle_tensordesc`) around a recording
    C launcher, for a kernel with `bound`'s arguments (descriptors where `bound` has them);
    TMA encoding by a stand-in that returns what it was given."""
    import types

    import triton
    from triton.backends.nvidia import driver as nvidia

    c_launch = _CLauncher()
    is_desc = [hasattr(a, "block_shape") for a in bound]
    signature = {i: "tensordesc<bf16[1,1,64,64]>" if d else "i32" for i, d in enumerate(is_desc)}
    metas = [dict(swizzle=3, elem_size=2, elem_type=i, block_size=[1, 1, 64 + i, 64], fp4_padded=False)
             for i in range(sum(is_desc))]
    class CountingLauncher(nvidia.CudaLauncher):
        """Triton's launcher, counting the calls that go through its Python __call__."""

        def __call__(self, *args):
            c_launch.wrapped += 1
            super().__call__(*args)

    runner = object.__new__(CountingLauncher)
    runner.launch = nvidia.wrap_handle_tensordesc(c_launch, signature, metas if metas else None)
    runner.num_ctas, runner.launch_cooperative_grid, runner.launch_pdl = 1, False, False
    runner.global_scratch_size = runner.profile_scratch_size = 0
    runner.global_scratch_align = runner.profile_scratch_align = 1
    compiled = types.SimpleNamespace(run=runner, function=7, packed_metadata=(4, 1, 0),
                                     launch_metadata=lambda grid, stream, *args: None)

    class AlwaysHit(dict):
        def get(self, key, default=None):
            return compiled, (), None

    utils = types.SimpleNamespace(fill_tma_descriptor=lambda *a: ("tma", *map(repr, a)))
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 5)
    monkeypatch.setattr(launch_cache, "_CACHE", AlwaysHit())
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return c_launch


def _check_direct_plan(monkeypatch, call, make):
    """A plan's direct launch (Triton's C launcher called without its Python wrapper, the
    descriptors encoded by launch_cache) passes the C launcher exactly what Triton's own launch
    path passes it for the same tensors."""
    runs = _recorded_runs(monkeypatch)
    launch_cache.clear_plans()
    call(make())
    c_launch = _triton_launchers(monkeypatch, runs[-1][1])
    launch_cache.clear_plans()
    call(make())
    second = make()
    wrapped = c_launch.wrapped
    call(second)  # the plan, direct
    planned = c_launch.calls[-1]
    assert c_launch.wrapped == wrapped
    launch_cache.clear_plans()
    call(second)  # the full path: CudaLauncher.__call__ and Triton's descriptor wrapper
    built = c_launch.calls[-1]
    assert c_launch.wrapped == wrapped + 1 and len(c_launch.calls) == 3
    assert len(planned) == len(built)
    for a, b in zip(planned, built, strict=True):
        assert a is b if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b), (a, b)
    return planned, built


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, torch.float32])
def test_forward_direct_plan_passes_what_triton_passes(monkeypatch, persistent, o_dtype):
    from fmha.kernels.gluon import fwd as fwd_gluon

    monkeypatch.setattr(fwd_gluon, "_sm_count", lambda device: 132)

    def tensors():
        q, k, v = (torch.empty(2, 4, 300, 64, dtype=torch.bfloat16) for _ in range(3))
        return q, k, v, torch.empty(2, 4, 300, 64, dtype=o_dtype), torch.empty(2, 4, 300)

    def call(ts):
        fwd_gluon.launch(*ts, causal=True, align_bottom_right=True, scale=0.125, block_m=128, block_n=128,
                         num_stages=3, persistent=persistent)

    planned, _ = _check_direct_plan(monkeypatch, call, tensors)
    assert sum(isinstance(a, tuple) and a[:1] == ("tma",) for a in planned) == 4  # q, k, v, o (or q again)


@pytest.mark.parametrize("stats_aligned", [True, False])
def test_dkdv_direct_plan_passes_what_triton_passes(monkeypatch, stats_aligned):
    from fmha.kernels.gluon import bwd as bwd_gluon

    monkeypatch.setattr(bwd_gluon, "_sm_count", lambda device: 132)
    sq = 1000 if stats_aligned else 1001

    def tensors():
        q, do = (torch.empty(2, 8, sq, 128, dtype=torch.bfloat16) for _ in range(2))
        k, v, dk, dv = (torch.empty(2, 2, 900, 128, dtype=torch.bfloat16) for _ in range(4))
        return q, k, v, do, torch.empty(2, 8, sq), torch.empty(2, 8, sq), dk, dv, torch.zeros(2, 8, sq, 128)

    def call(ts):
        bwd_gluon.launch_dkdv(*ts, causal=True, align_bottom_right=False, scale=0.088, block_m=64, block_n=128,
                              num_stages=2, warp_specialized=True, persistent=True)

    planned, _ = _check_direct_plan(monkeypatch, call, tensors)
    encoded = sum(isinstance(a, tuple) and a[:1] == ("tma",) for a in planned)
    assert encoded == (7 if stats_aligned else 5)  # q, k, v, dO, (LSE, delta,) dQ


def test_direct_plan_of_a_kernel_without_descriptors(monkeypatch):
    """The Triton dot(dO, O) kernel: no descriptors, so Triton calls its C launcher unwrapped
    and so does the plan."""
    from fmha.kernels.triton import bwd

    b, h, s, d = 2, 4, 333, 64

    def tensors():
        o, do = (torch.empty(b, h, s, d, dtype=torch.bfloat16) for _ in range(2))
        return o, do, torch.empty(b, h, s), torch.empty(b, h, s)

    def call(ts):
        bwd.launch_dot_do_o(*ts, batch=b, max_seqlen_q=s, block_m=64, num_warps=4, num_stages=1)

    _check_direct_plan(monkeypatch, call, tensors)


def test_a_launch_hook_takes_tritons_path(monkeypatch):
    """With a launch hook set (a profiler's), a plan launches through Triton's CudaLauncher,
    which calls the hook's protocol: the C launcher then receives the hooks."""
    from triton import knobs

    from fmha.kernels.gluon import fwd as fwd_gluon

    def tensors():
        return tuple(torch.empty(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(4)) + (torch.empty(1, 2, 128),)

    def call(ts):
        fwd_gluon.launch(*ts, causal=False, align_bottom_right=True, scale=0.1, block_m=128, block_n=128,
                         num_stages=2)

    runs = _recorded_runs(monkeypatch)
    call(tensors())
    c_launch = _triton_launchers(monkeypatch, runs[-1][1])
    launch_cache.clear_plans()
    ts = tensors()
    call(ts)

    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        call(ts)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert c_launch.calls[-1][11] is knobs.runtime.launch_enter_hook  # (gridX, gridY, gridZ, stream, function,
    #                    coop, pdl, 2 scratch, packed metadata, launch metadata, enter hook, exit hook, ...)
    assert c_launch.wrapped == 2 and len(seen) == 0  # (the stand-in C launcher calls no hook)
    call(ts)
    assert c_launch.calls[-1][11] is None and c_launch.wrapped == 2  # (hook removed: direct again)


def _alike(a, b) -> bool:
    """Launch arguments of two calls on different tensors of the same metadata: tensors alike
    (shape, strides, dtype), descriptors over alike tensors with equal shape, strides, block and
    layout, equal other values."""
    if hasattr(a, "block_shape"):
        return (hasattr(b, "block_shape") and _alike(a.base, b.base) and list(a.shape) == list(b.shape)
                and list(a.strides) == list(b.strides) and a.block_shape == b.block_shape and a.layout == b.layout)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    return type(a) is type(b) and a == b


def _alike_by_value(a, b) -> bool:
    """`_alike`, and descriptors over tensors of equal bytes: an fp8 launch's V^T is a new scratch
    buffer in each call, so only its values can be compared."""
    if hasattr(a, "block_shape"):
        return _alike(a, b) and torch.equal(a.base.view(torch.uint8), b.base.view(torch.uint8))
    return _alike(a, b)


def _h200_path(monkeypatch):
    """fmha's calls on CPU tensors as on an H200 (sm90, 132 SMs): the dispatcher picks the Gluon
    forward and dK/dV; launches are recorded, not run (_recorded_runs)."""
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.launch import loader
    from fmha.ops import attention as attention_ops
    from fmha.ops import prepare

    runs = _recorded_runs(monkeypatch)
    monkeypatch.setattr(prepare, "arch_of", lambda device: "sm90")
    for module in (prepare, attention_ops):  # (compiled modules: the launchers' plans)
        monkeypatch.setattr(module, "family_module",
                            lambda name, interpreted=False: loader.family_module(name, interpreted=False))
    monkeypatch.setattr(prepare, "PREPARED", {})
    monkeypatch.setattr(fwd_gluon, "_sm_count", lambda device: 132)
    monkeypatch.setattr(bwd_gluon, "_sm_count", lambda device: 132)
    return runs


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_api_call_plans_launch_what_the_full_path_launches(monkeypatch, layout):
    """On the H200 path: the forward call plan (no grad) and the backward plan (an eager
    autograd.grad) launch the kernels, grids and arguments the full path launches for inputs of
    the same metadata (the forward's one Gluon launch; the backward's dot(dO, O), Gluon dK/dV and
    dQ convert)."""
    import fmha

    runs = _h200_path(monkeypatch)

    def inputs():
        shape = (2, 8, 256, 64) if layout == "bhsd" else (2, 256, 8, 64)
        return [torch.randn(shape).to(torch.bfloat16).requires_grad_() for _ in range(3)]

    forward, backward = _forward_and_backward_launches(runs, lambda ts: fmha.attention(*ts, causal=True,
                                                                                        layout=layout))
    forward(inputs())
    backward(inputs())
    second = inputs()
    planned = forward(second), backward(second)
    (forward_plan,) = call_plans.FORWARD_PLANS.values()
    assert len(forward_plan.backward_plans) == 1  # (the graph: _PlannedAttention, the plan's backward)
    plan_tables.clear_plans()
    _assert_alike_launches(planned, (forward(second), backward(second)))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp8_call_plans_launch_what_the_full_path_launches(monkeypatch, layout):
    """On the H200 path: an fp8 call repeated with inputs and descales of the same metadata takes
    the api's fp8 plan and the Gluon launcher's plan, and launches what the full path launches
    for those inputs (V^T compared by value), with the call's own descales."""
    import fmha

    runs = _h200_path(monkeypatch)

    def inputs():
        shape = (2, 8, 256, 128) if layout == "bhsd" else (2, 256, 8, 128)
        ts = [torch.randn(shape).to(torch.float8_e4m3fn) for _ in range(3)]
        return ts, [torch.rand(2, 8) + 0.5 for _ in range(3)]

    def forward(x):
        (q, k, v), (qd, kd, vd) = x
        del runs[:]
        fmha.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, layout=layout)
        return list(runs)

    forward(inputs())
    forward(inputs())
    second = inputs()
    planned = forward(second)
    (plan,) = call_plans.FORWARD_PLANS.values()
    assert type(plan).__name__ == "Fp8ForwardPlan" and plan.launched is not None
    plan_tables.clear_plans()
    full = forward(second)
    assert len(planned) == len(full) == 1 and planned[0][0] == full[0][0]
    assert all(_alike_by_value(a, b) for a, b in zip(planned[0][1], full[0][1], strict=True))
    passed = [a for a in planned[0][1] if isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.shape[-1] == 1]
    assert [p.data_ptr() for p in passed] == [d.data_ptr() for d in second[1]]


def _forward_and_backward_launches(runs, call, leaves=lambda ts: ts):
    """forward(ts), backward(ts): the launches (`_recorded_runs`) of call(ts) without grad, and of
    the backward of call(ts) with respect to leaves(ts)."""
    def forward(ts):
        del runs[:]
        with torch.no_grad():
            call(ts)
        return list(runs)

    def backward(ts):
        o = call(ts)
        del runs[:]
        torch.autograd.grad(o, leaves(ts), torch.randn_like(o))
        return list(runs)

    return forward, backward


def _assert_alike_launches(planned, full):
    """A planned forward's and backward's launches (1 and 3) alike the full path's, in order."""
    assert [len(r) for r in planned] == [len(r) for r in full] == [1, 3]
    for p, f in zip(planned[0] + planned[1], full[0] + full[1], strict=True):
        assert p[0] == f[0]
        assert all(_alike(a, b) for a, b in zip(p[1], f[1], strict=True))


@pytest.mark.parametrize("window", [(-1, 0), (50, 0)])
def test_varlen_call_plans_launch_what_the_full_path_launches(monkeypatch, window):
    """On the H200 path: attention_varlen's call plan (no grad; the launcher's own plan under it)
    and the backward through it (its three launches' plans) launch the kernels, grids and arguments
    the full path launches for inputs of the same metadata; the plans are keyed by metadata, so
    other lengths of the same metadata are launched alike too (the kernel reads the prefix sums)."""
    import fmha
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.gluon import fwd as fwd_gluon

    runs = _h200_path(monkeypatch)
    lens = [300, 0, 77, 647]

    def inputs():
        q = torch.randn(sum(lens), 8, 128).to(torch.bfloat16).requires_grad_()
        k, v = (torch.randn(sum(lens), 2, 128).to(torch.bfloat16).requires_grad_() for _ in range(2))
        return q, k, v, torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)

    forward, backward = _forward_and_backward_launches(
        runs, lambda ts: fmha.attention_varlen(*ts[:3], ts[3], ts[3], max(lens), max(lens), window=window),
        lambda ts: ts[:3])
    forward(inputs())
    backward(inputs())
    second = inputs()
    planned = forward(second), backward(second)
    assert len(call_plans.FORWARD_PLANS) == 1 and len(fwd_gluon._PLANS) == 1 and len(bwd_gluon._PLANS) == 1
    (forward_plan,) = call_plans.FORWARD_PLANS.values()
    assert len(forward_plan.backward_plans) == 1  # (the backward's three launches planned too)
    plan_tables.clear_plans()
    _assert_alike_launches(planned, (forward(second), backward(second)))
    assert any(a is second[3] for a in planned[0][0][1])  # (the call's own prefix sums, not the first call's)


def test_plans_keep_no_tensor_of_the_call_that_made_them(monkeypatch):
    """A plan (and the api's call plans above it) must not hold the first call's tensors: a
    training loop's first q, k, v, o would otherwise stay allocated for as long as the plan."""
    import gc
    import weakref

    import fmha

    runs = _h200_path(monkeypatch)
    ts = [torch.randn(2, 8, 256, 64).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    o = fmha.attention(*ts, causal=True)
    torch.autograd.grad(o, ts, torch.randn_like(o))
    o2 = fmha.attention(*ts, causal=True)  # (a planned call and its backward)
    torch.autograd.grad(o2, ts, torch.randn_like(o2))
    assert call_plans.FORWARD_PLANS
    refs = [weakref.ref(t) for t in (*ts, o, o2)]
    del ts, o, o2, runs[:]  # (the recorder's own copies of the launches' arguments)
    gc.collect()
    assert all(r() is None for r in refs)


def _decode_h200_path(monkeypatch):
    """attention_with_kvcache on CPU tensors as for CUDA tensors on an H200 (sm90, 132 SMs, no
    host-side checks of index values, as outside debug mode): the compiled kvcache launchers
    with their plans; launches are recorded, not run (_recorded_runs). Returns (runs, the count
    of calls that took the full path)."""
    from fmha import kvcache as api_kvcache
    from fmha.kernels.launch import loader

    runs = _recorded_runs(monkeypatch)
    monkeypatch.setattr(api_kvcache, "family_module",  # (compiled module: the launchers' plans)
                        lambda name, interpreted=False: loader.family_module(name, interpreted=False))
    monkeypatch.setattr(api_kvcache, "_reads_values", lambda device: False)
    monkeypatch.setattr(api_kvcache, "_arch", lambda device: "sm90")
    monkeypatch.setattr(api_kvcache, "_sm_count", lambda device: 132)
    full_path = []
    check_queries = api_kvcache._check_queries

    def counted(*args):
        full_path.append(1)
        return check_queries(*args)

    monkeypatch.setattr(api_kvcache, "_check_queries", counted)
    return runs, full_path


_DECODE_B, _DECODE_HQ, _DECODE_HK, _DECODE_D, _DECODE_PAGE, _DECODE_S = 4, 8, 2, 64, 16, 4096


def _decode_inputs(tables: str, cache_dtype=torch.bfloat16, descales: str = "none", d: int = _DECODE_D) -> dict:
    """A decode step's arguments at a size where num_splits=0 picks several splits on the H200
    path: new tensors of the same metadata on each call (pools expanded from one page: no kernel
    reads them). descales (float8 caches): "none", "tensor" (one value each, k's 0-d and v's
    (1,)) or "head" (per (batch, KV head))."""
    b, hq, hk, page, s = _DECODE_B, _DECODE_HQ, _DECODE_HK, _DECODE_PAGE, _DECODE_S
    n = b * s // page
    q = torch.randn(b, 1, hq, d).to(torch.bfloat16)
    lengths = torch.randint(1, s + 1, (b,), dtype=torch.int32)
    scales = {"none": {}, "tensor": dict(k_descale=torch.rand(()) + 0.5, v_descale=torch.rand(1) + 0.5),
              "head": dict(k_descale=torch.rand(b, hk) + 0.5, v_descale=torch.rand(b, hk) + 0.5)}[descales]
    if tables == "contiguous":
        cache = torch.empty(1, s, hk, d, dtype=cache_dtype).expand(b, s, hk, d)
        return dict(q=q, k_cache=cache, v_cache=cache.clone(), cache_seqlens=lengths, **scales)
    pool = torch.empty(1, page, hk, d, dtype=cache_dtype).expand(n, page, hk, d)
    table = torch.randperm(n).int().reshape(b, s // page)
    if tables == "block_table":
        return dict(q=q, k_cache=pool, v_cache=pool, block_table=table, cache_seqlens=lengths, **scales)
    return dict(q=q, k_cache=pool, v_cache=pool, kv_indices=table.reshape(-1).contiguous(),
                kv_indptr=torch.arange(0, n + 1, s // page, dtype=torch.int32),
                kv_last_page_len=torch.randint(1, page + 1, (b,), dtype=torch.int32), **scales)


_CACHES = {"bf16": (torch.bfloat16, "none"), "fp8": (torch.float8_e4m3fn, "none"),
           "fp8 per tensor": (torch.float8_e4m3fn, "tensor"), "fp8 per head": (torch.float8_e4m3fn, "head")}


@pytest.mark.parametrize("cache", list(_CACHES))
@pytest.mark.parametrize("tables", ["contiguous", "block_table", "indptr"])
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_decode_call_plans_launch_what_the_full_path_launches(monkeypatch, tables, num_splits, cache):
    """On the H200 path: a plain decode call repeated with new inputs of the same metadata takes
    its call plan (no validation, description or dispatch) and launches the kernels, grids and
    arguments the full path launches for those inputs (after clear_plans): the inputs
    themselves, outputs alike, into the o and lse it returns. float8 caches too, with their
    descales absent, per tensor or per (batch, KV head)."""
    import fmha
    from fmha import kvcache as api_kvcache

    runs, full_path = _decode_h200_path(monkeypatch)
    cache_dtype, descales = _CACHES[cache]

    def call(args):
        del runs[:]
        o, lse = fmha.attention_with_kvcache(**args, num_splits=num_splits, causal=True, return_lse=True)
        return o, lse, list(runs)

    call(_decode_inputs(tables, cache_dtype, descales))
    second = _decode_inputs(tables, cache_dtype, descales)
    planned = call(second)
    assert len(full_path) == 1 and len(api_kvcache._DECODE_CALL_PLANS) == 1
    launch_cache.clear_plans()
    full = call(second)
    assert len(full_path) == 2
    assert len(planned[2]) == len(full[2]) == (1 if num_splits == 1 else 2)  # (num_splits=0: several, combined)
    inputs = {id(t) for t in second.values()}
    for (o, lse, launches) in (planned, full):
        assert any(a is o for a in launches[-1][1]) and any(a is lse for a in launches[-1][1])
    for p, f in zip(planned[2], full[2], strict=True):
        assert p[0] == f[0]
        for a, b in zip(p[1], f[1], strict=True):
            assert _alike(a, b) and (a is b or (id(a) not in inputs and id(b) not in inputs))
    for a, b in zip(planned[:2], full[:2], strict=True):
        assert _alike(a, b) and a.device == b.device


@pytest.mark.parametrize("kw, bad, error", [
    (dict(causal=True), dict(causal=1), TypeError),  # (1 == True: the key alone would match)
    (dict(scale=1.0), dict(scale=True), ValueError),
    (dict(softcap=0.0), dict(softcap=False), ValueError),
    (dict(window=(3, 0)), dict(window=(3, False)), ValueError),
    (dict(sink_size=0), dict(sink_size=False), ValueError),
    (dict(num_splits=2), dict(num_splits=2.0), ValueError),
    (dict(num_splits=1), dict(num_splits=True), ValueError),  # (True == 1: the key alone would match)
    (dict(mask_align="top_left"), dict(mask_align="top-left"), ValueError),
    (dict(), dict(max_seqlen_q=1), ValueError),
    (dict(), dict(cache_seqlens=torch.zeros(_DECODE_B, dtype=torch.int64)), TypeError),
    (dict(), dict(block_table=torch.zeros(_DECODE_B + 1, 2, dtype=torch.int32)), ValueError),
])
def test_a_decode_call_plan_never_serves_a_call_the_full_path_refuses(monkeypatch, kw, bad, error):
    import fmha
    from fmha import kvcache as api_kvcache

    _decode_h200_path(monkeypatch)
    args = _decode_inputs("block_table")
    for _ in range(2):
        fmha.attention_with_kvcache(**args, **kw)
    assert len(api_kvcache._DECODE_CALL_PLANS) == 1
    with pytest.raises(error):
        fmha.attention_with_kvcache(**{**args, **kw, **bad})


@pytest.mark.parametrize("cache", ["bf16", "fp8 per head", "fp8 at D=128"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("slopes", ["(Hq,)", "(B, Hq)"])
def test_decode_call_plans_with_alibi_and_sinks_launch_what_the_full_path_launches(monkeypatch, cache, num_splits,
                                                                                  slopes):
    """On the H200 path, a decode call with ALiBi slopes ((Hq,) or (B, Hq)) and sink logits takes a
    call plan too (the slopes and sinks are tensors of the key's metadata) and launches what the
    full path launches for the same inputs: the Triton kernel (a bf16 cache at D=64, a float8 one at
    D=96) or the Gluon decode (float8 at D=128), with one split (sinks folded in the kernel) or four (sinks
    added by the combine)."""
    import fmha
    from fmha import kvcache as api_kvcache

    runs, full_path = _decode_h200_path(monkeypatch)
    cache_dtype, descales = _CACHES["bf16" if cache == "bf16" else "fp8 per head"]
    d = 128 if cache == "fp8 at D=128" else 96 if cache == "fp8 per head" else _DECODE_D

    def inputs():
        shape = (_DECODE_HQ,) if slopes == "(Hq,)" else (_DECODE_B, _DECODE_HQ)
        args = dict(_decode_inputs("block_table", cache_dtype, descales, d), alibi_slopes=torch.rand(shape),
                    sinks=torch.randn(_DECODE_HQ))
        # (pools of their own pages: the Gluon decode's 16-byte aligned strides, where an expanded pool has 0)
        return dict(args, **{name: torch.empty(args[name].shape, dtype=cache_dtype) for name in ("k_cache", "v_cache")})

    def call(args):
        del runs[:]
        o, lse = fmha.attention_with_kvcache(**args, num_splits=num_splits, return_lse=True)
        return o, lse, list(runs)

    first = inputs()
    assert ("_sm90_gluon_" in fmha.explain_kvcache(**first, num_splits=num_splits).splitlines()[1]) is (d == 128)
    del full_path[:]  # (explain checked the call too)
    call(first)
    second = inputs()
    planned = call(second)
    assert len(full_path) == 1 and len(api_kvcache._DECODE_CALL_PLANS) == 1
    launch_cache.clear_plans()
    full = call(second)
    assert len(full_path) == 2 and len(planned[2]) == len(full[2]) == (1 if num_splits == 1 else 2)
    inputs_ids = {id(t) for t in second.values()}
    for p, f in zip(planned[2], full[2], strict=True):
        assert p[0] == f[0]
        for a, b in zip(p[1], f[1], strict=True):
            assert _alike(a, b) and (a is b or (id(a) not in inputs_ids and id(b) not in inputs_ids))
    launched = {id(a) for _, args in full[2] for a in args}
    assert id(second["sinks"]) in launched  # (the slopes (Hq,) go as a (1, Hq) view)


def test_decode_calls_with_features_or_value_checks_take_no_call_plan(monkeypatch):
    """Appended k/v (with RoPE or not), a cache batch index, an int cache_seqlens:
    the full path every time. So too where the full path checks index values
    on the host (CPU tensors, debug mode): a plan made without those checks never serves such a
    call, which still refuses a bad value."""
    import fmha
    from fmha import kvcache as api_kvcache

    _decode_h200_path(monkeypatch)
    b, hk, d = _DECODE_B, _DECODE_HK, _DECODE_D
    args = _decode_inputs("block_table")
    new = torch.randn(b, 1, hk, d).to(torch.bfloat16)
    cos, sin = torch.randn(_DECODE_S + 1, d // 2), torch.randn(_DECODE_S + 1, d // 2)
    appended = dict(args, cache_seqlens=args["cache_seqlens"] - 1)
    contiguous = _decode_inputs("contiguous")
    calls = [
        dict(appended, k=new, v=new),
        dict(appended, k=new, v=new, rotary_cos=cos, rotary_sin=sin),
        dict(contiguous, cache_batch_idx=torch.arange(b, dtype=torch.int32)),
        dict(contiguous, cache_seqlens=100),
    ]
    for call in calls:
        for _ in range(2):
            fmha.attention_with_kvcache(**call)
    assert not api_kvcache._DECODE_CALL_PLANS
    for _ in range(2):
        fmha.attention_with_kvcache(**args)
    assert len(api_kvcache._DECODE_CALL_PLANS) == 1
    monkeypatch.setattr(api_kvcache, "_reads_values", lambda device: True)  # (debug mode)
    fmha.attention_with_kvcache(**args)
    with pytest.raises(ValueError, match="capacity"):
        fmha.attention_with_kvcache(**dict(args, cache_seqlens=args["cache_seqlens"] + _DECODE_S))


@pytest.mark.parametrize("bad, error", [
    (dict(k_descale=0.5), TypeError),  # a float, not a tensor
    (dict(v_descale=torch.ones(_DECODE_B, _DECODE_HK, dtype=torch.float64)), TypeError),
    (dict(k_descale=torch.ones(_DECODE_HK, _DECODE_B)), ValueError),  # (Hk, B): not (B, Hk)
])
def test_a_float8_decode_call_plan_never_serves_bad_descales(monkeypatch, bad, error):
    """A float8 cache's call plan (its key: the descales' metadata) and descales the full path
    refuses: refused all the same."""
    import fmha
    from fmha import kvcache as api_kvcache

    _decode_h200_path(monkeypatch)
    args = _decode_inputs("block_table", torch.float8_e4m3fn, "head")
    for _ in range(2):
        fmha.attention_with_kvcache(**args)
    assert len(api_kvcache._DECODE_CALL_PLANS) == 1
    with pytest.raises(error):
        fmha.attention_with_kvcache(**{**args, **bad})


def test_decode_call_plans_follow_the_dispatcher(monkeypatch):
    """A call plan holds the dispatcher's answer: another split policy on the same dispatcher
    (which `_decode_plan` sees) takes the full path, and set_dispatcher forgets the plans."""
    import fmha
    from fmha import kvcache as api_kvcache

    runs, full_path = _decode_h200_path(monkeypatch)
    dispatcher = fmha.Dispatcher()
    args = _decode_inputs("indptr")
    with fmha.api.use_dispatcher(dispatcher):
        for _ in range(2):
            del runs[:]
            fmha.attention_with_kvcache(**args)
        assert len(full_path) == 1 and len(runs) == 2  # (several splits, combined)
        dispatcher.split_policy = fmha.SplitPolicy(max_splits=1)
        del runs[:]
        fmha.attention_with_kvcache(**args)
        assert len(full_path) == 2 and len(runs) == 1  # the new policy's one split
        fmha.set_dispatcher(dispatcher)
        assert not api_kvcache._DECODE_CALL_PLANS


@pytest.mark.parametrize("case, tma", [("aligned", True), ("fp32", False), ("persistent", False), ("shape_off", False),
                                       ("bshd", True), ("misaligned", False), ("persistent_d64", True),
                                       ("persistent_d64_fp32", False)])
def test_dkdv_leave_by_tma_stores_where_they_can(monkeypatch, case, tma):
    """The warp-specialized dK/dV launch passes dK and dV as TMA descriptors (block_n rows, K's
    layout) with DKDV_TMA where they have K's and V's dtype and TMA can address them and, for the
    persistent kernel, its staging buffers fit (D=64's m128n128 tile), and as pointers otherwise
    (fp32 dK/dV, an odd base address, the persistent kernel at D=128, or SHAPES' dkdv_tma 0)."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    seen = _recorded_launches(monkeypatch)
    b, h, s, d = 2, 4, 256, 64 if "d64" in case else 128
    q, k, v, do = (torch.randn(b, h, s, d).to(torch.bfloat16) for _ in range(4))
    lse, delta = torch.randn(b, h, s), torch.randn(b, h, s)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if case.endswith("fp32"):
        dk, dv = dk.float(), dv.float()
    elif case == "bshd":
        dk, dv = (torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    elif case == "misaligned":
        dk = torch.empty(b * h * s * d + 1, dtype=torch.bfloat16)[1:].view(b, h, s, d)
    elif case == "shape_off":
        shapes = {p: {dim: dict(sh) for dim, sh in by.items()} for p, by in bwd_gluon.SHAPES.items()}
        shapes["gluon_ws"][128]["dkdv_tma"] = 0
        monkeypatch.setattr(bwd_gluon, "SHAPES", shapes)
    monkeypatch.setattr(bwd_gluon, "_sm_count", lambda device: 132)
    tile = dict(block_m=128, num_stages=2) if d == 64 else dict(block_m=64, num_stages=3)
    bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, dk, dv, torch.zeros(b, h, s, d), causal=True,
                          align_bottom_right=False, scale=0.1, block_n=128, warp_specialized=True,
                          persistent=case.startswith("persistent"), **tile)
    kernel, _, args, kwargs = seen[-1]
    assert kernel is bwd_gluon.bwd_dkdv_ws_kernel and kwargs["DKDV_TMA"] is tma
    assert kwargs["PERSISTENT"] is case.startswith("persistent")
    for arg, tensor in ((args[7], dk), (args[8], dv)):
        if tma:
            assert arg.base is tensor and arg.block_shape == [1, 1, 128, d] and arg.layout == args[1].layout
        else:
            assert arg is tensor


def test_varlen_dkdv_reads_lse_and_delta_per_thread(monkeypatch):
    """The varlen dK/dV launch never takes LSE/delta by TMA, even where the (Hq, total) tensors are
    TMA-aligned: a copy from a sequence's first query is 16-byte aligned only where that query's
    index is a multiple of 4 (a misaligned one faulted on the H200, 2026-12-01)."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    seen = _recorded_launches(monkeypatch)
    h, d, total = 4, 128, 2048  # total % 4 == 0: the LSE rows are TMA-aligned
    packed = torch.randn(total, h, d).to(torch.bfloat16)
    lse, delta = torch.empty(h, total), torch.empty(h, total)
    cu = torch.tensor([0, 3, 1024, total], dtype=torch.int32)  # a sequence starting at query 3
    bwd_gluon.launch_dkdv(packed, packed, packed, packed, lse, delta, torch.empty_like(packed),
                          torch.empty_like(packed), torch.zeros(total, h, d), causal=True, align_bottom_right=True,
                          scale=0.1, block_m=64, block_n=128, num_stages=3, warp_specialized=True,
                          cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
    (kernel, grid, args, kwargs), = seen
    assert kwargs["VARLEN"] is True and kwargs["GRID_ORDER"] == bwd_gluon.VARLEN_GRID_ORDER
    assert kwargs["STATS_TMA"] is False and kwargs["DKDV_TMA"] is False
    names = kernel.arg_names
    for name, t in (("lse", lse), ("delta", delta)):  # pointers (views of the tensors), not descriptors
        arg = args[names.index(name)]
        assert isinstance(arg, torch.Tensor) and arg.data_ptr() == t.data_ptr(), name
    assert grid == (-(-1024 // 128) * 3 * h,)
