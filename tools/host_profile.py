"""cProfile of fmha calls' host path on the GPU machine: `calls` calls back to back (no
synchronization between them), top functions by own time. The features suite's varlen shape
(forward and backward through fmha.bench.suite's calls) and its window shape's forward as a dense
control.

    PYTHONPATH=src python tools/host_profile.py [--calls 20] [--rows 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from fmha.bench import suite as bench
from fmha.bench.suite import Shape

SHAPES = {"varlen": Shape(1, 16, 16, 16384, 128, "bf16", True, docs=8),
          "window": Shape(2, 16, 16, 8192, 128, "bf16", True, window=1024)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    for name, mode in (("varlen", "fwd"), ("varlen", "bwd"), ("window", "fwd")):
        shape = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        heads = (shape.nhead_q, shape.nhead_k, shape.nhead_k, shape.nhead_q)
        q, k, v, dout = (torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen, device="cuda")
                         .to(torch.bfloat16) for h in heads)
        fn = bench._setup("fmha", shape, mode, q, k, v, dout).parts[0][1]
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.rows)
        print(f"== {shape.label} {mode}: {host:.1f} us of host time a call (unprofiled)\n{out.getvalue()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
