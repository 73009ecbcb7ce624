"""Host (Python) time of one call, kernel launches excluded, on the CPU.

The launches are replaced by no-ops, so this is what the API, validation, the plan caches
and torch's custom-op dispatch cost per call: the floor under small problems and decode.

Dense: `fmha.attention`, on the CPU tensors' own path (Triton configs for arch "cpu", the
launchers stubbed whole) and on the path of CUDA tensors on an H200 ("H200 path" lines:
dispatch for sm90, so the Gluon forward and dK/dV and the Triton dot(dO, O) and dQ convert,
with their launchers' host work: descriptors, kernel specs, `launch_cache` keys; every
`launch_cache` lookup hits a stand-in compiled kernel whose launch does nothing), where
`fmha.attention_varlen` on packed sequences is timed too.

Decode: `fmha.attention_with_kvcache` at the decode bench's 32k shape (B=8 Hq=32 Hk=8
D=128 bf16, Sq=1, pages of 64), through a block table and through FlashInfer/SGLang tables,
with the split count picked (num_splits=0) and forced, and a float8 cache with per-(batch, KV
head) descales (block table; and contiguous: the Gluon decode on the H200 path); launchers stubbed whole (they return
no launch plan, so every call takes the full path), then ("H200 path" lines) the real launchers
with only the final launch stubbed (repeated calls take the decode call plan,
`kvcache._DecodeCallPlan`).
The decode calls take the path of CUDA tensors on an H200: dispatch for sm90 with 132
SMs (so num_splits=0 picks 4 splits and the combine kernel runs) and no host-side checks
of index values (CUDA tensors skip them outside debug mode). Device ops on CPU tensors are
cheaper than CUDA launches, so a path that runs extra device ops costs more on a GPU.

    PYTHONPATH=src python tools/host_overhead.py [--calls N] [--decode-only] [--dense-only]
"""

import sys
import time
import types

import torch

import fmha
from fmha import kvcache
from fmha.kernels.gluon import bwd as bwd_gluon
from fmha.kernels.gluon import fwd as fwd_gluon
from fmha.kernels.launch import cache as launch_cache
from fmha.kernels.launch import loader, plan_tables
from fmha.ops import attention as attention_ops
from fmha.ops import call_plans, prepare

OPS = (prepare, attention_ops, call_plans)  # (each binds the names it imports: patch all)


def _patch_ops(name: str, value) -> None:
    for module in OPS:
        if hasattr(module, name):
            setattr(module, name, value)

_REAL_LAUNCHERS = (prepare.launch_forward, prepare.launch_dkdv)


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Best of `repeats` timings of `calls` calls (the machine's noise only adds time)."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def stub_dense_launches_cpu() -> None:
    """CPU tensors' own path, every launcher a no-op."""
    _patch_ops("launch_forward", lambda *a, **k: None)  # time the host path only
    _patch_ops("launch_dkdv", lambda *a, **k: None)
    no_launch = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in (
        "launch_dot_do_o", "launch_delta", "launch_dkdv", "launch_dq", "launch_convert_dq")})
    _patch_ops("family_module", lambda name, interpreted=False: no_launch)
    prepare.PREPARED.clear()  # (cached Problems carry the arch, and so do the call plans)
    plan_tables.clear_plans()


class _AlwaysHit(dict):
    """launch_cache's table, answering every key with a compiled kernel that launches nothing."""

    _HIT = (types.SimpleNamespace(run=lambda *a: None, function=None, packed_metadata=None,
                                  launch_metadata=lambda grid, stream, *args: None), (), None)

    def get(self, key, default=None):
        hash(key)  # (what a real lookup costs)
        return self._HIT


def stub_dense_launches_h200() -> None:
    """CUDA tensors' path on an H200 (sm90, 132 SMs): the real launchers (compiled modules)
    up to the launch, which `launch_cache` turns into a no-op."""
    _patch_ops("launch_forward", _REAL_LAUNCHERS[0])
    _patch_ops("launch_dkdv", _REAL_LAUNCHERS[1])
    _patch_ops("arch_of", lambda device: "sm90")
    _patch_ops("family_module", lambda name, interpreted=False: loader.family_module(name, interpreted=False))
    launch_cache._CACHE = _AlwaysHit()
    launch_cache.driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0))
    torch.cuda.current_device = lambda: 0  # (CUDA tensors name their device; CPU ones do not)
    fwd_gluon._sm_count = bwd_gluon._sm_count = lambda device: 132
    prepare.PREPARED.clear()
    plan_tables.clear_plans()


def dense_cases(h200: bool = False) -> dict:
    """The dense calls; h200: on the path of CUDA tensors on an H200 (stub_dense_launches_h200)."""
    (stub_dense_launches_h200 if h200 else stub_dense_launches_cpu)()
    suffix = " (H200 path)" if h200 else ""
    q = torch.randn(1, 4, 16, 64, dtype=torch.bfloat16)
    leaf = q.clone().requires_grad_()
    fmha.attention(leaf, leaf, leaf, causal=True)  # (the call plan: the timed graph below is a planned call's)
    out = fmha.attention(leaf, leaf, leaf, causal=True)
    grad = torch.randn_like(out)
    cases = {
        "attention(q, k, v, causal=True)": lambda: fmha.attention(q, q, q, causal=True),
        "attention(..., return_lse=True, layout='bshd')": lambda: fmha.attention(
            q, q, q, causal=True, return_lse=True, layout="bshd"),
        "attention(q, k, v, causal=True), inputs requiring grad": lambda: fmha.attention(
            leaf, leaf, leaf, causal=True),
        "backward of it (autograd.grad, retained graph)": lambda: torch.autograd.grad(
            out, leaf, grad, retain_graph=True),
    }
    if h200:  # (the bshd call is the same host path)
        del cases["attention(..., return_lse=True, layout='bshd')"]
        # Packed sequences (8 of them, 128 tokens): the call plan keyed by cu_seqlens' metadata.
        lens = [8, 24, 4, 20, 12, 32, 16, 12]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        packed = torch.randn(sum(lens), 4, 64, dtype=torch.bfloat16)
        leaves = [packed.clone().requires_grad_() for _ in range(3)]
        varlen_out = [fmha.attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True) for _ in range(2)][-1]
        varlen_grad = torch.randn_like(varlen_out)
        cases["attention_varlen(q, k, v, cu, cu, ..., causal=True)"] = lambda: fmha.attention_varlen(
            packed, packed, packed, cu, cu, max(lens), max(lens), causal=True)
        cases["backward of the varlen call (autograd.grad, retained graph)"] = lambda: torch.autograd.grad(
            varlen_out, leaves, varlen_grad, retain_graph=True)
    return {name + suffix: fn for name, fn in cases.items()}


def stub_decode_launches(launches: list | None = None) -> None:
    """Decode calls as for CUDA tensors on an H200, without running a kernel (launch
    arguments are appended to `launches` when given)."""
    def launcher(name):
        def launch(*args, **kwargs):
            if launches is not None:
                launches.append((name, args, kwargs))
        return launch

    stub = types.SimpleNamespace(**{n: launcher(n) for n in ("launch_attention", "launch_combine",
                                                               "launch_rotary_append")})
    kvcache.family_module = lambda *a, **k: stub
    kvcache._reads_values = lambda device: False  # CUDA tensors outside debug mode
    kvcache._arch = lambda device: "sm90"
    kvcache._sm_count = lambda device: 132


def decode_tables(B=8, Hq=32, Hk=8, S=32768, D=128, page=64):
    """q, a page pool (one page's storage, expanded: no kernel reads it) and equivalent
    block-table and indptr tables of full sequences."""
    n = B * S // page
    q = torch.randn(B, 1, Hq, D, dtype=torch.bfloat16)
    pool = torch.empty(1, page, Hk, D, dtype=torch.bfloat16).expand(n, page, Hk, D)
    table = torch.randperm(n).int().reshape(B, S // page)
    block = dict(block_table=table, cache_seqlens=torch.full((B,), S, dtype=torch.int32))
    indptr = dict(kv_indices=table.reshape(-1).contiguous(),
                  kv_indptr=torch.arange(0, n + 1, S // page, dtype=torch.int32),
                  kv_last_page_len=torch.full((B,), page, dtype=torch.int32))
    return q, pool, block, indptr


def stub_decode_launches_h200() -> None:
    """Decode calls on the H200's path with the real launchers (compiled module: arguments,
    launch plans), only the final launch stubbed (`launch_cache` hits a no-op kernel)."""
    stub_decode_launches()
    kvcache.family_module = lambda name, interpreted=False: loader.family_module(name, interpreted=False)
    launch_cache._CACHE = _AlwaysHit()
    launch_cache.driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0))
    torch.cuda.current_device = lambda: 0


def decode_cases(h200: bool = False) -> dict:
    """The decode calls: launchers stubbed whole, or (h200) on the H200 path with real launchers."""
    (stub_decode_launches_h200 if h200 else stub_decode_launches)()
    q, pool, block, indptr = decode_tables()
    cases = {}
    for form, tables in (("block_table", block), ("indptr", indptr)):
        for splits in (0, 4, 1):
            name = f"attention_with_kvcache {form} num_splits={splits}" + (" (H200 path)" if h200 else "")
            cases[name] = (lambda t=tables, s=splits: fmha.attention_with_kvcache(q, pool, pool, **t, num_splits=s))
    # the float8 cache with per-(batch, KV head) descales, as the decode bench gives it
    pool8 = torch.empty(1, *pool.shape[1:], dtype=torch.float8_e4m3fn).expand(pool.shape)  # (as `pool`)
    descales = dict(k_descale=torch.rand(q.shape[0], pool.shape[2]) + 0.5,
                    v_descale=torch.rand(q.shape[0], pool.shape[2]) + 0.5)
    for splits in (0, 1):
        name = f"attention_with_kvcache fp8 cache block_table num_splits={splits}" + (" (H200 path)" if h200 else "")
        cases[name] = (lambda s=splits: fmha.attention_with_kvcache(q, pool8, pool8, **block, **descales,
                                                                     num_splits=s))
    # a contiguous float8 cache (its own storage: 16-byte aligned rows), on the H200 path the Gluon decode
    cache8 = torch.empty(q.shape[0], block["block_table"].shape[1] * pool.shape[1], *pool.shape[2:],
                         dtype=torch.float8_e4m3fn)
    for splits in (0, 1):
        name = f"attention_with_kvcache fp8 cache contiguous num_splits={splits}" + (" (H200 path)" if h200 else "")
        cases[name] = (lambda s=splits: fmha.attention_with_kvcache(
            q, cache8, cache8, cache_seqlens=block["cache_seqlens"], **descales, num_splits=s))
    return cases


def main() -> int:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 3000
    groups = []  # each group installs its stubs when built: built and timed one after another
    if "--decode-only" not in sys.argv:
        groups += [dense_cases, lambda: dense_cases(h200=True)]
    if "--dense-only" not in sys.argv:
        groups += [decode_cases, lambda: decode_cases(h200=True)]
    for group in groups:
        for name, fn in group().items():
            print(f"{name:<67} {per_call_us(fn, max(1, calls // 5)):7.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
