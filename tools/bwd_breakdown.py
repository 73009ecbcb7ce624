"""Where a backward call's time goes: GPU time per kernel (torch.profiler) and host time per
call, fmha against SDPA cuDNN, on the standard suite's short rows (B=16 H=16 S=1024) and one
long control (B=2 H=16 S=8192 D=128).

    PYTHONPATH=src python tools/bwd_breakdown.py [--hdims 64,128,256] [--iters 20]

Per contender and shape: the kernels of one backward (average GPU us per call, by name), their
sum, the wall time per call with the GPU kept busy (do_bench median) and the host time per call
(the CPU time to enqueue, without synchronizing). Wall >> GPU sum means host-bound or gaps.
"""

import sys
from collections import defaultdict

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fmha
from fmha.bench.suite import host_ms_per_call


def backward_call(name, q, k, v, do, causal):
    """A function running one backward on a retained graph (as `fmha bench` times it)."""
    if name == "fmha":
        o = fmha.attention(q, k, v, causal=causal)
    else:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def kernels_per_call(fn, iters):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:70]] += e.device_time_total / iters
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def host_us(fn, iters):
    """CPU time to enqueue one call (fmha.bench.suite.host_ms_per_call), after a warm call."""
    fn()
    return host_ms_per_call(fn, iters) * 1e3


def main() -> int:
    args = sys.argv[1:]
    hdims = [int(d) for d in args[args.index("--hdims") + 1].split(",")] if "--hdims" in args else [64, 128, 256]
    iters = int(args[args.index("--iters") + 1]) if "--iters" in args else 20
    shapes = [(16, 16, 1024, d, c) for d in hdims for c in (False, True)] + [(2, 16, 8192, 128, False)]
    for b, h, s, d, causal in shapes:
        gen = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        print(f"\nB={b} H={h} S={s} D={d} causal={causal}")
        for name in ("fmha", "cudnn"):
            fn = backward_call(name, q, k, v, do, causal)
            ks = kernels_per_call(fn, iters)
            wall = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
            host = host_us(fn, iters)
            gpu = sum(ks.values())
            print(f"  {name:6} wall {wall:7.1f} us ({flops / wall / 1e6:5.0f} TFLOP/s)  GPU sum {gpu:7.1f} us"
                  f"  host {host:6.1f} us/call  gaps {wall - gpu:6.1f} us")
            for kname, us in ks.items():
                print(f"      {us:7.1f} us  {kname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
