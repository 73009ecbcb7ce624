"""Sweeps (CK examples 29-32): the dispatcher's kernel over a range of sequence lengths and
head dims, timed and checked against float64 at every point where that is affordable.

Writes a CSV and a PNG plot per sweep to a temporary directory and prints a table. Raises if
a point fails its check.

    python examples/26_sweeps.py
"""

import tempfile
from pathlib import Path

import torch
from rich.console import Console

from fmha.testing import sweeps

from _common import done, header

header("26 sweeps")

device = "cuda" if torch.cuda.is_available() else "cpu"
on_cpu = device == "cpu"
out_dir = Path(tempfile.mkdtemp(prefix="fmha_sweeps_"))
console = Console(width=140)
# Causal GQA (4 query heads per KV head); small on the CPU (Triton's interpreter).
if on_cpu:
    base = sweeps.base_spec(True, batch=1, nhead_q=4, nhead_k=1, seqlen_q=32, seqlen_k=32, hdim_q=32,
                            hdim_v=32, causal=True)
    plan = {"seqlen": [16, 40], "hdim": [24, 64]}
else:
    base = sweeps.base_spec(False, batch=4, nhead_q=32, nhead_k=8, seqlen_q=4096, seqlen_k=4096, hdim_q=128,
                            hdim_v=128, causal=True)
    plan = {"seqlen": [512, 1024, 2048, 4096, 8192, 16384], "hdim": [64, 96, 128, 192, 256]}

failed = 0
for axis, values in plan.items():
    rows = sweeps.sweep(axis, values, base, device)
    console.print(sweeps.sweep_table(rows))
    sweeps.write_csv(out_dir / f"{axis}.csv", rows)
    sweeps.plot(out_dir / f"{axis}.png", rows)
    failed += sum(not r["ok"] for r in rows)
    checked = sum(bool(r["validation"] and r["validation"]["comparisons"]) for r in rows)
    print(f"{axis}: {len(rows)} points, {checked} checked against float64, plot {out_dir / f'{axis}.png'}")
if failed:
    raise SystemExit(f"{failed} sweep points failed")
done(f"sweeps on {device}: every point ran and every checked point matches the float64 truth")
