"""Example 02: one API, many shapes.

    python examples/02_multi_shape.py

Batch, head counts, sequence lengths (square and not, smaller than one tile and not a
multiple of it) and head dims vary; each call is checked against the float64 reference
and the kernel the dispatcher chose is printed.
"""

import torch

import fmha

from _common import done, header, qkv, run_checked, sizes

header("Example 02: multi-shape")
shapes = sizes(
    # (batch, nhead_q, nhead_k, seqlen_q, seqlen_k, head_dim)
    [(1, 2, 2, 16, 16, 32), (2, 2, 2, 33, 47, 64), (1, 4, 2, 64, 17, 32), (3, 1, 1, 5, 70, 16),
     (1, 2, 1, 48, 48, 128)],
    [(1, 4, 4, 64, 64, 128), (2, 8, 8, 128, 128, 128), (4, 8, 8, 1000, 1000, 64),
     (1, 16, 16, 4096, 4096, 128), (2, 32, 8, 1024, 3000, 128), (1, 8, 8, 2048, 2048, 256)],
)
gen = torch.Generator().manual_seed(2)
for b, hq, hk, sq, sk, d in shapes:
    q, k, v = qkv(b, hq, hk, sq, sk, d, gen=gen)
    kernel = fmha.get_dispatcher().plan_forward(fmha.problem_of(q, k, v)).config(fmha.Family.FWD).name
    run_checked(f"B{b} Hq{hq} Hk{hk} S{sq}x{sk} D{d} -> {kernel}", q, k, v, causal=sq <= sk)
done(f"{len(shapes)} shapes")
