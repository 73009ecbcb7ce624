"""Stress test (CK example 07): many random attention problems, each checked against float64.

Random dtype, shapes (GQA), layout, causal / sliding-window masks in both alignments, sink
tokens, soft-cap, bias or ALiBi, sink logits, dropout and input seed; every problem runs
through `fmha.attention` with the kernel the dispatcher selects and is compared with a
float64 truth (fmha.reference on the CPU), on a GPU the gradients dq, dk, dv too.
Raises if any case fails.

    python examples/07_stress.py [SEED]
"""

import sys

import torch
from rich.console import Console

from fmha.testing import sweeps

from _common import done, header

header("07 stress: random problems against float64")

device = "cuda" if torch.cuda.is_available() else "cpu"
seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
on_gpu = device == "cuda"
count = 24 if on_gpu else 4  # the CPU runs Triton's interpreter: small and few, forward only

rows = sweeps.stress(count, seed, device, time_budget=150, backward=on_gpu)
Console(width=140).print(sweeps.stress_table(rows))
failed = [r for r in rows if not r["ok"]]
for r in failed:
    print(f"case {r['index']} failed: {r['error'] or r['check']}\n  reproduce: fmha run --device {device} {r['flags']}")
if failed:
    raise SystemExit(f"{len(failed)} of {len(rows)} random problems failed their check")
what = "forward and backward" if on_gpu else "forward"
done(f"stress on {device}, seed {seed}: all {len(rows)} random problems match the float64 truth ({what})")
