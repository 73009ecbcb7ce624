"""Host (Python) time of one call, kernel launches excluded, on the CPU.

The launches are replaced by no-ops, so this is what the API, validation, the plan caches
and torch's custom-op dispatch cost per call: the floor under small problems and decode.

Dense: `fmha.attention`. Decode: `fmha.attention_with_kvcache` at the decode bench's
32k shape (B=8 Hq=32 Hk=8 D=128 bf16, Sq=1, pages of 64), through a block table and
through FlashInfer/SGLang tables, with the split count picked (num_splits=0) and forced.
The decode calls take the path of CUDA tensors on an H200: dispatch for sm90 with 132
SMs (so num_splits=0 picks 4 splits and the combine kernel runs) and no host-side checks
of index values (CUDA tensors skip them outside debug mode). Device ops on CPU tensors are
cheaper than CUDA launches, so a path that runs extra device ops costs more on a GPU.

    PYTHONPATH=src python tools/host_overhead.py [--calls N] [--decode-only]
"""

import sys
import time
import types

import torch

import fmha
from fmha import api, kvcache


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


def dense_cases() -> dict:
    api._launch_forward = lambda *a, **k: None  # time the host path only
    api._launch_dkdv = lambda *a, **k: None
    no_launch = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in (
        "launch_dot_do_o", "launch_delta", "launch_dkdv", "launch_dq", "launch_convert_dq")})
    api.family_module = lambda name, interpreted=False: no_launch
    q = torch.randn(1, 4, 16, 64, dtype=torch.bfloat16)
    leaf = q.clone().requires_grad_()
    out = fmha.attention(leaf, leaf, leaf, causal=True)
    grad = torch.randn_like(out)
    return {
        "attention(q, k, v, causal=True)": lambda: fmha.attention(q, q, q, causal=True),
        "attention(..., return_lse=True, layout='bshd')": lambda: fmha.attention(
            q, q, q, causal=True, return_lse=True, layout="bshd"),
        "attention(q, k, v, causal=True), inputs requiring grad": lambda: fmha.attention(
            leaf, leaf, leaf, causal=True),
        "backward of it (autograd.grad, retained graph)": lambda: torch.autograd.grad(
            out, leaf, grad, retain_graph=True),
    }


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


def decode_cases() -> dict:
    stub_decode_launches()
    q, pool, block, indptr = decode_tables()
    cases = {}
    for form, tables in (("block_table", block), ("indptr", indptr)):
        for splits in (0, 4, 1):
            name = f"attention_with_kvcache {form} num_splits={splits}"
            cases[name] = (lambda t=tables, s=splits: fmha.attention_with_kvcache(q, pool, pool, **t, num_splits=s))
    return cases


def main() -> int:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 3000
    cases = {} if "--decode-only" in sys.argv else dense_cases()
    cases.update(decode_cases())
    for name, fn in cases.items():
        print(f"{name:<55} {per_call_us(fn, max(1, calls // 5)):7.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
