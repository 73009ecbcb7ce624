"""Example 03: timing fmha and PyTorch SDPA on the same problems.

    python examples/03_benchmark.py

Times fmha.attention (forward, and forward + backward) with fmha.bench.suite.time_ms (CUDA
events on a GPU, perf_counter on the CPU, where the interpreter is timed: slow, and no
measure of kernel speed), reports TFLOP/s in the FlashAttention convention, and checks
the output of every timed problem. For the full harness: `fmha bench --suite quick`.
"""

from functools import partial

import torch
import torch.nn.functional as F

import fmha
from fmha.bench.suite import time_ms

from _common import DEVICE, check, done, header, qkv, sizes, truth_and_baseline

header("Example 03: benchmark")
problems = sizes([(1, 2, 64, 64, False), (1, 2, 64, 64, True)],
                 [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (2, 16, 8192, 64, True)])
warmup, repeat = sizes((0, 1), (3, 20))
gen = torch.Generator().manual_seed(3)
print(f"  {'problem':<28} {'fmha fwd ms':>12} {'TFLOP/s':>9} {'sdpa fwd ms':>12} {'fmha fwd+bwd ms':>16}")
for b, h, s, d, causal in problems:
    q, k, v = qkv(b, h, h, s, s, d, gen=gen, grad=True)
    problem = fmha.problem_of(q, k, v, causal=causal)
    do = torch.randn_like(q)

    def fwd_bwd(q=q, k=k, v=v, do=do, causal=causal):
        return torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), do)

    timing = dict(device=DEVICE, warmup=warmup, repeat=repeat)
    fwd = time_ms(partial(fmha.attention, q, k, v, causal=causal), **timing)
    sdpa = time_ms(partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal), **timing)
    both = time_ms(fwd_bwd, **timing)
    name = f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
    print(f"  {name:<28} {fwd:>12.3f} {problem.flops_fwd() / fwd / 1e9:>9.2f} {sdpa:>12.3f} {both:>16.3f}")
    # Square problems: both alignments of the causal mask agree, so SDPA is a fair peer.
    with torch.no_grad():  # batch entry 0 (the float64 truth of all of it is large)
        o = fmha.attention(q, k, v, causal=causal)[:1]
        truth_o, _, base_o, _ = truth_and_baseline(q[:1], k[:1], v[:1], causal=causal)
    check("o (batch 0)", o, truth_o, base_o, q.dtype)
done()
