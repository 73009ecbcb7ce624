"""Example 03: timing fmha and PyTorch SDPA on the same problems.

    python examples/03_benchmark.py

Times fmha.attention (forward, and forward + backward) with fmha.bench.time_ms (CUDA
events on a GPU, perf_counter on the CPU, where the interpreter is timed: slow, and no
measure of kernel speed), reports TFLOP/s in the FlashAttention convention, and checks
the output of every timed problem. For the full harness: `fmha bench --suite quick`.
"""

import torch
import torch.nn.functional as F

import fmha
from _common import DEVICE, check, done, header, qkv, sizes, truth_and_baseline
from fmha.bench import time_ms

header("Example 03: benchmark")
problems = sizes([(1, 2, 64, 64, False), (1, 2, 64, 64, True)],
                 [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (2, 16, 8192, 64, True)])
warmup, repeat = sizes((0, 1), (3, 20))
gen = torch.Generator().manual_seed(3)
print(f"  {'problem':<28} {'fmha fwd ms':>12} {'TFLOP/s':>9} {'sdpa fwd ms':>12} {'fmha fwd+bwd ms':>16}")
for b, h, s, d, causal in problems:
    q, k, v = qkv(b, h, h, s, s, d, gen=gen, grad=True)
    problem = fmha.problem_of(q, k, v, causal=causal)
    fwd = time_ms(lambda: fmha.attention(q, k, v, causal=causal), device=DEVICE, warmup=warmup, repeat=repeat)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), device=DEVICE,
                   warmup=warmup, repeat=repeat)
    do = torch.randn_like(q)
    both = time_ms(lambda: torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), do),
                   device=DEVICE, warmup=warmup, repeat=repeat)
    name = f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
    print(f"  {name:<28} {fwd:>12.3f} {problem.flops_fwd() / fwd / 1e9:>9.2f} {sdpa:>12.3f} {both:>16.3f}")
    # Square problems: both alignments of the causal mask agree, so SDPA is a fair peer.
    with torch.no_grad():
        o = fmha.attention(q, k, v, causal=causal)
        truth_o, _, base_o, _ = truth_and_baseline(q, k, v, causal=causal)
    check("o", o, truth_o, base_o, q.dtype)
done()
