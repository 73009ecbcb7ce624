"""A/B of the one-tile dK/dV grids' program orders (bwd_gluon.GRID_ORDERS: which (batch or
sequence, KV head, key tile) each program takes), fmha's backward on causal problems: dense
(the standard suite's causal D=128 rows, and D=256 and a non-causal row as controls) against SDPA
cuDNN, and varlen (packed causal documents, the features suite's shapes and more) against
FlexAttention; the forward of the varlen shapes too (the order does not touch it: a control).
Contenders alternate in rotated order each round (`fmha.bench.suite`'s protocol, its shapes and calls).
Then a check that neither varlen call synchronizes with the host (torch's sync debug mode set to
error) and a profile of one varlen backward call's kernels.

    PYTHONPATH=src python tools/bench_grid_order.py [--rounds 3] [--json F] [--orders a,b]
                                                    [--suite dense|varlen|both]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from fmha.bench import suite as bench
from fmha.bench.suite import Shape
from fmha.kernels.gluon import bwd as bwd_gluon
from fmha.kernels.launch import plan_tables

DENSE = [Shape(16, 16, 16, 1024, 128, "bf16", True), Shape(4, 16, 16, 4096, 128, "bf16", True),
         Shape(2, 16, 16, 8192, 128, "bf16", True), Shape(1, 16, 16, 16384, 128, "bf16", True),
         Shape(4, 32, 8, 8192, 128, "bf16", True), Shape(2, 16, 16, 8192, 256, "bf16", True),
         Shape(2, 16, 16, 8192, 128, "bf16", False)]
VARLEN = [Shape(1, 16, 16, 16384, 128, "bf16", True, docs=8), Shape(1, 32, 8, 16384, 128, "bf16", True, docs=8),
          Shape(1, 16, 16, 16384, 128, "bf16", True, docs=32), Shape(1, 16, 16, 32768, 128, "bf16", True, docs=8),
          Shape(1, 16, 16, 16384, 64, "bf16", True, docs=8)]


def set_order(name: str) -> None:
    bwd_gluon.DENSE_GRID_ORDER = bwd_gluon.VARLEN_GRID_ORDER = bwd_gluon.GRID_ORDERS[name]
    plan_tables.clear_plans()  # (a plan keeps the order it was made with)


def inputs(shape: Shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads = (shape.nhead_q, shape.nhead_k, shape.nhead_k, shape.nhead_q)  # q, k, v, dout
    return tuple(torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen, device="cuda")
                 .to(bench.DTYPES[shape.dtype]) for h in heads)


def run(shape: Shape, mode: str, orders: list[str], rounds: int) -> dict:
    from torch import _dynamo

    _dynamo.reset()  # (FlexAttention: one compile per shape, as fmha.bench.suite does)
    q, k, v, dout = inputs(shape)
    other = "flex" if shape.docs else "cudnn"
    fmha_runner = bench._setup("fmha", shape, mode, q, k, v, dout)
    other_runner = bench._setup(other, shape, mode, q, k, v, dout)
    assert fmha_runner.error is None, fmha_runner.error
    names = [*orders, other]
    for name in orders:  # (each order's kernels compiled before timing)
        set_order(name)
        fmha_runner.parts[0][1]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name == other:
                if other_runner.error is None:
                    times[name].append(other_runner.measure(25, 100))
                continue
            set_order(name)
            times[name].append(fmha_runner.measure(25, 100))
    row = {"shape": shape.label, "mode": mode, "against": other}
    for name, ts in times.items():
        if ts:
            ms = statistics.median(ts)
            row[name] = {"ms": ms, "times_ms": ts, "tflops": shape.flops(mode) / ms / 1e9}
    return row


def profile_backward(shape: Shape) -> str:
    """GPU time of each kernel of one varlen backward call (the default order)."""
    q, k, v, dout = inputs(shape)
    fn = bench._setup("fmha", shape, "bwd", q, k, v, dout).parts[0][1]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


def check_no_sync(shape: Shape) -> str:
    q, k, v, dout = inputs(shape)
    calls = [bench._setup("fmha", shape, mode, q, k, v, dout).parts[0][1] for mode in ("fwd", "bwd")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "no host synchronization in the varlen forward and backward calls"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--orders", default="seq_major,seq_bands")
    parser.add_argument("--suite", default="both", choices=["dense", "varlen", "both"])
    args = parser.parse_args()
    orders = args.orders.split(",")
    defaults = (bwd_gluon.DENSE_GRID_ORDER, bwd_gluon.VARLEN_GRID_ORDER)
    work = ([(s, "bwd") for s in DENSE] if args.suite != "varlen" else []) + (
        [(s, m) for s in VARLEN for m in ("fwd", "bwd")] if args.suite != "dense" else [])
    rows = []
    for shape, mode in work:
        row = run(shape, mode, orders, args.rounds)
        rows.append(row)
        base = row[orders[0]]["ms"]
        cells = "  ".join(f"{n} {row[n]['tflops']:6.1f} ({base / row[n]['ms']:.3f})" for n in (*orders, row["against"])
                          if n in row)
        print(f"{shape.label:55s} {mode}  {cells}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "orders": orders, "rows": rows}, f, indent=1)
    bwd_gluon.DENSE_GRID_ORDER, bwd_gluon.VARLEN_GRID_ORDER = defaults
    plan_tables.clear_plans()
    if args.suite != "dense":
        try:
            print(check_no_sync(VARLEN[0]), flush=True)
        except RuntimeError as e:
            print(f"a varlen call synchronized with the host: {e}", flush=True)
        print(profile_backward(VARLEN[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
