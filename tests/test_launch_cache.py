"""kernels/launch_cache: the compiled-kernel key must separate every argument property the
JIT specializes on (a shared key would run a kernel compiled for other arguments), and an
interpreted kernel always goes through its own call. The launches themselves run in the GPU
tests (tests/test_gpu.py::test_launch_cache_*)."""

import pytest
import torch

from fmha.kernels import launch_cache
from fmha.kernels.gluon_common import _shared_layout, descriptor


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
    from fmha.kernels import bwd, bwd_gluon, fwd_gluon

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
    bwd.launch_dot_do_o(o, do, lse, delta, batch=b, max_seqlen_q=s, block_m=64, num_warps=4, num_stages=1)
    bwd.launch_convert_dq(torch.zeros(b, h, s, d), torch.empty_like(q), scale=0.1, block_m=64, num_warps=4)
    assert len(seen) == 6
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
    float8 caches pass their descales by keyword: keyed, but left to the JIT."""
    import fmha
    from fmha import kvcache as api_kvcache
    from fmha.kernels import kvcache as kernels

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
    names = [kernel.fn.__name__ for kernel, *_ in seen]
    assert {"splitkv_kernel", "combine_kernel", "rotary_append_kernel"} <= set(names), names
    for kernel, _grid, args, kwargs in seen:
        hash((tuple(map(launch_cache._key_of, args)), tuple(kwargs.items())))
        assert set(kernel.arg_names[len(args):]) <= kwargs.keys(), kernel.fn.__name__
    plain = [all(type(x) in launch_cache._PLAIN for x in kwargs.values()) for *_, kwargs in seen]
    assert plain == [True] * (len(seen) - 1) + [False]  # only the float8 cache's launch is not cached


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_the_gluon_backward_adds_dq_by_tma_where_it_can_address_the_accumulator(monkeypatch, warp_specialized):
    """dQ by TMA reduce-add needs a 16-byte aligned dq_acc: then the kernel gets its
    descriptor (blocks of 64 queries x the dQ columns of one reduction); otherwise the
    unspecialized kernel takes its atomics and the warp-specialized one refuses (its writer
    adds 16-byte quads)."""
    from fmha.kernels import bwd_gluon

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
    from fmha.kernels import bwd_gluon

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
