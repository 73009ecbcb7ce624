"""GPU time of each kernel of a decode call (`attention_with_kvcache`) and of SDPA cuDNN's, from
torch's profiler: the split-KV attention and the combine apart, and the span of one call on the
GPU (first kernel's start to last kernel's end, gaps included). For issue 5's question where the
last percent to cuDNN goes (docs/performance.md, Next item 4): the split kernel itself, the
combine, or the gap between them.

Contenders alternate in rotated order each round (each profiled over --calls calls a round; the
medians over all rounds are reported): cuDNN, fmha as it is, fmha with forced split counts
(--splits), fmha with another decode tile first in the registry (--tiles BLOCK_N:warps:stages,...),
and fmha without programmatic dependent launch between the split kernel and the combine
(kvcache.PDL off).

    PYTHONPATH=src python tools/decode_kernel_times.py [--calls 50] [--rounds 3] [--splits 3,6]
        [--tiles 32:4:4,64:4:4] [--paged] [--cold [--flush write|read]] [--json F]

--cold: as triton.testing.do_bench times a call (what `fmha bench --decode` reports), a 256 MB
buffer is zeroed before each call (L2 flushed); "gap" is then the time from that fill's end to
the call's first kernel's start, "span" from the fill's end to the call's last kernel's end.
--flush read: the 256 MB buffer is read instead (a sum), which leaves L2 full of clean lines:
against the default (write, do_bench's), it shows what the write-back of the fill's dirty lines
costs the call that follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import fmha
from fmha.bench.decode import DecodeShape, _call, _inputs
from fmha.dispatch.configs import CUDA_ARCHS, KVCACHE_FEATURES, Algorithm, Family, KernelConfig, Signature
from fmha.kernels.triton import kvcache as kvcache_kernels
from fmha.kvcache import attention_with_kvcache
from fmha.problem import DType

SWITCHES = ("PDL",)  # kvcache's A/B switches (each True unless a contender turns it off)


def dispatcher_for(tile: tuple[int, int, int]) -> fmha.Dispatcher:
    """The default registry with a 16-bit decode config of this (BLOCK_N, warps, stages) first."""
    block_n, warps, stages = tile
    variant = KernelConfig(Signature(Family.FWD_SPLITKV, (DType.FP16, DType.BF16), CUDA_ARCHS, 128, 1,
                                     KVCACHE_FEATURES), Algorithm(16, block_n, warps, stages))
    return fmha.Dispatcher(fmha.Registry([variant], name="tile").merged(fmha.default_registry()))


def l2_fill(kind: str):
    """do_bench's cache flush as a function: a 256 MB buffer zeroed ("write", L2 left full of
    dirty lines) or summed ("read", L2 left full of clean lines)."""
    buffer = torch.ones(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    return buffer.zero_ if kind == "write" else buffer.sum


def kernel_count(fn) -> int:
    """CUDA kernels (and memsets) that one call of fn runs."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def profiled(fn, calls: int, flush=None, fills: int = 0) -> tuple[dict[str, list[float]], list[float]]:
    """({kernel name: [us]}, [span of each call in us]) over `calls` calls; with `flush` (--cold,
    a function of `fills` kernels) it runs before each call, its kernels are left out, the spans
    start at its end and the kernels hold "gap": its end to the call's first kernel's start."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if flush is not None:
                flush()
            fn()
            torch.cuda.synchronize()  # one call's kernels apart from the next's
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per_call = len(events) // calls
    per_kernel: dict[str, list[float]] = defaultdict(list)
    spans = []
    for i in range(0, per_call * calls, per_call):
        call = events[i:i + per_call]
        if flush is not None:
            fill, call = call[fills - 1], call[fills:]
            per_kernel["gap"].append(call[0].time_range.start - fill.time_range.end)
            spans.append(call[-1].time_range.end - fill.time_range.end)
        else:
            spans.append(call[-1].time_range.end - call[0].time_range.start)
        for e in call:
            per_kernel[e.name[:60]].append(e.time_range.elapsed_us())
    return per_kernel, spans


def contenders(shape: DecodeShape, splits: list[int], tiles: list[tuple[int, int, int]]) -> dict:
    """name -> (dispatcher or None, kvcache switches to set, call)."""
    fmha_args, sdpa_args = _inputs(shape, "cuda")
    call = lambda: attention_with_kvcache(**fmha_args)  # noqa: E731
    runs = {"cudnn": (None, {}, _call("cudnn", fmha_args, sdpa_args)),
            "fmha": (None, {}, call),
            "fmha no PDL": (None, {"PDL": False}, call)}
    for n in splits:
        runs[f"fmha splits={n}"] = (None, {}, lambda n=n: attention_with_kvcache(**fmha_args, num_splits=n))
    for tile in tiles:
        runs[f"fmha n{tile[0]}w{tile[1]}s{tile[2]}"] = (dispatcher_for(tile), {}, call)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--splits", default="")
    parser.add_argument("--tiles", default="")
    parser.add_argument("--paged", action="store_true", help="also the caches in shuffled pages of 64")
    parser.add_argument("--cold", action="store_true", help="a 256 MB fill before each call (do_bench's)")
    parser.add_argument("--flush", choices=("write", "read"), default="write",
                        help="--cold's fill: zero the buffer (do_bench's) or read it")
    parser.add_argument("--json")
    args = parser.parse_args()
    flush = l2_fill(args.flush) if args.cold else None
    fills = kernel_count(flush) if flush is not None else 0
    splits = [int(x) for x in args.splits.split(",") if x]
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",") if t]
    shapes = [DecodeShape(32, 32, 8, 8192, 128), DecodeShape(8, 32, 8, 32768, 128)]
    if args.paged:
        shapes += [DecodeShape(32, 32, 8, 8192, 128, page_size=64), DecodeShape(8, 32, 8, 32768, 128, page_size=64)]
    rows = []
    for shape in shapes:
        runs = contenders(shape, splits, tiles)
        names = list(runs)
        kernels: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in names}
        spans: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dispatcher, switches, fn = runs[name]
                fmha.set_dispatcher(dispatcher)  # (clears the call and launch plans)
                for switch in SWITCHES:
                    setattr(kvcache_kernels, switch, switches.get(switch, True))
                per_kernel, call_spans = profiled(fn, args.calls, flush, fills)
                for k, v in per_kernel.items():
                    kernels[name][k] += v
                spans[name] += call_spans
        fmha.set_dispatcher(None)
        for switch in SWITCHES:
            setattr(kvcache_kernels, switch, True)
        for name in names:
            row = {"shape": shape.label, "contender": name, "span_us": statistics.median(spans[name]),
                   "kernels": {k: statistics.median(v) for k, v in kernels[name].items()}}
            rows.append(row)
            cells = "  ".join(f"{k[:30]} {v:.1f}" for k, v in row["kernels"].items())
            print(f"{shape.label:55s} {name:20s} span {row['span_us']:6.1f} us | {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "calls": args.calls, "rounds": args.rounds,
                       "cold": args.cold and args.flush, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
