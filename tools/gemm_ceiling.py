"""The matrix-product ceilings of this GPU: bf16 `torch.mm` and fp8 e4m3 `torch._scaled_mm` (cuBLASLt),
M = N = K = 8192 by default, TFLOP/s by `do_bench` (median), alternating, a few rounds. The fp8 forward's
goal (1.5x our bf16 forward) read against what the tensor cores give a plain GEMM here.

    PYTHONPATH=src python tools/gemm_ceiling.py [--size 8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench


def gemm_calls(n: int) -> dict:
    """The two products at M = N = K = n: name -> call."""
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x8 = x.to(torch.float8_e4m3fn)
    y8 = y.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major B, as cuBLASLt's fp8 path wants
    one = torch.ones((), device="cuda")
    return {"bf16 mm": lambda: torch.mm(x, y),
            "fp8 e4m3 _scaled_mm": lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    n = a.size
    calls = gemm_calls(n)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(a.rounds):
        for name, fn in calls.items():
            times[name].append(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    flops = 2 * n ** 3
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"{torch.cuda.get_device_name()} {name:22s} M=N=K={n}: {ms:.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
