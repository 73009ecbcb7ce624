"""Example 01: one attention call, checked against the float64 reference.

    python examples/01_basic.py

q, k, v in the default layout (B, H, S, D); fmha picks a kernel from its registry,
runs it (compiled on a GPU, through Triton's interpreter on the CPU), and the result is
compared with fmha.reference (numpy, float64) under the FlashAttention 2x error rule.
"""

import torch

import fmha

from _common import DEVICE, done, header, qkv, run_checked, sizes

header("Example 01: basic fmha.attention")
B, H, S, D = sizes((1, 2, 64, 64), (2, 16, 2048, 128))
gen = torch.Generator().manual_seed(0)
q, k, v = qkv(B, H, H, S, S, D, gen=gen)
print(f"  q, k, v: {tuple(q.shape)} {q.dtype} on {DEVICE}")

plan = fmha.get_dispatcher().plan_forward(fmha.problem_of(q, k, v))
print(f"  kernel: {plan.config(fmha.Family.FWD).name}")
o, lse = run_checked("non-causal", q, k, v)
print(f"  o: {tuple(o.shape)} {o.dtype}; lse: {tuple(lse.shape)} {lse.dtype}")
run_checked("causal", q, k, v, causal=True)
done()
