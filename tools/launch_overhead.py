"""Host time of the kernel launchers on the CPU, through Triton's real JIT, with and without
kernels/launch_cache.py (no GPU needed).

A stand-in CUDA driver (an sm90 target) lets `kernel[grid](...)` run its argument binding
and cache lookup for real; the kernels compile for real on the first call (ptxas); module
loading and the launcher itself are no-ops (they cost the same on both paths). Each
launcher is timed with the cache (hits after the first call) and with every call through
the JIT, alternating, best of 3 x 7 x 300 calls.

    PYTHONPATH=src python tools/launch_overhead.py [--decode]
"""

from __future__ import annotations

import sys

import torch
from host_overhead import per_call_us  # tools/: the same best-of-N timing
from triton.backends.compiler import GPUTarget
from triton.compiler import compiler
from triton.runtime import driver


class _StandInDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _no_load(self):  # CompiledKernel._init_handles without a GPU: nothing loaded, a no-op launcher
    if self.module is None:
        self.module, self.function, self._run = object(), None, lambda *args: None


def _dense_cases():
    from fmha.kernels.gluon import bwd as bwd_gluon
    from fmha.kernels.gluon import fwd as fwd_gluon
    from fmha.kernels.triton import bwd

    b, h, s, d = 2, 4, 1024, 128
    q, k, v, o, do = (torch.randn(b, h, s, d).to(torch.bfloat16) for _ in range(5))
    lse, delta, acc = torch.randn(b, h, s), torch.randn(b, h, s), torch.zeros(b, h, s, d)
    return {
        "fwd_gluon.launch": lambda: fwd_gluon.launch(q, k, v, o, lse, causal=True, align_bottom_right=True,
                                                     scale=0.1, block_m=128, block_n=128, num_stages=2),
        "bwd_gluon.launch_dkdv": lambda: bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, k, v, acc, causal=True,
                                                              align_bottom_right=False, scale=0.1, block_m=64,
                                                              block_n=128, num_stages=2),
        "bwd.launch_dot_do_o": lambda: bwd.launch_dot_do_o(o, do, lse, delta, batch=b, max_seqlen_q=s, block_m=64,
                                                           num_warps=4, num_stages=1),
        "bwd.launch_convert_dq": lambda: bwd.launch_convert_dq(acc, q, scale=0.1, block_m=64, num_warps=4),
    }


def _decode_cases():
    """The decode bench's 32k shape (B=8 Hq=32 Hk=8 D=128 bf16, pages of 64), 4 splits."""
    from fmha.kernels.triton import kvcache

    b, hq, hk, s, d, page, splits = 8, 32, 8, 32768, 128, 64, 4
    q = torch.randn(b, 1, hq, d).to(torch.bfloat16)
    pool = torch.empty(1, page, hk, d, dtype=torch.bfloat16).expand(b * s // page, page, hk, d)
    table = torch.arange(b * s // page, dtype=torch.int32).reshape(b, -1)
    o_parts, lse_parts = torch.empty(splits, b, hq, 1, d), torch.empty(splits, b, hq, 1)
    o, lse = torch.empty(b, 1, hq, d).to(torch.bfloat16), torch.empty(b, hq, 1)
    attn = dict(seqlens_k=torch.full((b,), s, dtype=torch.int32), block_table=table, scale=0.1, softcap=0.0,
                window=(-1, -1), sink_size=0, align_bottom_right=True, block_m=16, block_n=64, num_warps=4,
                num_stages=2, dot_precision="ieee")
    return {
        "kvcache.launch_attention": lambda: kvcache.launch_attention(q, pool, pool, o_parts, lse_parts,
                                                                     num_splits=splits, **attn),
        "kvcache.launch_combine": lambda: kvcache.launch_combine(
            o_parts.view(splits, -1, d), lse_parts.view(splits, -1), o, lse, nheads=hq, seqlen=1, block_m=16,
            num_warps=4),
    }


def main() -> int:
    driver.set_active(_StandInDriver())
    compiler.CompiledKernel._init_handles = _no_load
    compiler.CompiledKernel.run = property(lambda self: (self._init_handles(), self._run)[1])
    from fmha.kernels.launch import cache as launch_cache

    launch_cache.driver = driver
    cases = _decode_cases() if "--decode" in sys.argv else _dense_cases()
    cached_launch = launch_cache.launch

    def jit_launch(kernel, grid, *args, **kwargs):
        kernel[grid](*args, **kwargs)

    cached, jit = dict.fromkeys(cases, float("inf")), dict.fromkeys(cases, float("inf"))
    for _ in range(3):
        for name, fn in cases.items():
            launch_cache.launch = cached_launch
            cached[name] = min(cached[name], per_call_us(fn, 300, repeats=7))
            launch_cache.launch = jit_launch
            jit[name] = min(jit[name], per_call_us(fn, 300, repeats=7))
    launch_cache.launch = cached_launch
    for name in cases:
        print(f"{name:<26} launch cache {cached[name]:6.1f} us   JIT every call {jit[name]:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
