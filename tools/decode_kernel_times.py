"""GPU time of each kernel of a decode call (`attention_with_kvcache`) and of SDPA cuDNN's, from
torch's profiler: the split-KV attention and the combine apart, and the span of one call on the
GPU (first kernel's start to last kernel's end, gaps included). For issue 5's question where the
32k shape's last 2% go (docs/performance.md, Next item 4): the split kernel itself, the combine, or
the gap between them.

    PYTHONPATH=src python tools/decode_kernel_times.py [--calls 50] [--splits 0,3,4,6] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fmha.bench_decode import DecodeShape, _call, _inputs
from fmha.kvcache import attention_with_kvcache

SHAPES = [DecodeShape(32, 32, 8, 8192, 128), DecodeShape(8, 32, 8, 32768, 128)]


def kernel_times(fn, calls: int) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()  # one call's kernels apart from the next's
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in events:
        per_kernel[e.name[:60]].append(e.time_range.elapsed_us())
    per_call = len(events) // calls
    spans = [events[i + per_call - 1].time_range.end - events[i].time_range.start
             for i in range(0, per_call * calls, per_call)] if per_call else []
    return {"kernels": {k: statistics.median(v) for k, v in per_kernel.items()},
            "kernels_per_call": per_call, "span_us": statistics.median(spans) if spans else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--splits", default="0,3,4,6")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        fmha_args, sdpa_args = _inputs(shape, "cuda")
        runs = {"cudnn": _call("cudnn", fmha_args, sdpa_args)}
        for n in (int(x) for x in args.splits.split(",")):
            runs[f"fmha splits={n or 'auto'}"] = (lambda n=n: attention_with_kvcache(**fmha_args, num_splits=n))
        for name, fn in runs.items():
            row = {"shape": shape.label, "contender": name, **kernel_times(fn, args.calls)}
            rows.append(row)
            kernels = "  ".join(f"{k[:38]} {v:.1f}" for k, v in row["kernels"].items())
            print(f"{shape.label:55s} {name:18s} span {row['span_us']:.1f} us | {kernels}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
