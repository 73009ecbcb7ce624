"""Tiles of the 16-bit decode (the Triton split-KV kernel over a bf16 cache) at one head dim, against SDPA's
cuDNN backend over the same keys: each variant is the registry's choice for that head dim with some of its
Algorithm fields changed. Two timings a contender, alternating within each round: cold (triton's do_bench,
whose L2 flush is a write, as `fmha bench --decode`) and the call captured in a CUDA graph and replayed;
medians over the rounds. Shapes: B=32 S=8192, B=8 S=32768, B=128 S=2048 (Hq=32 Hk=8), contiguous and pages
of 64 (cuDNN has no paged row: there the registry's choice is the reference). Each fmha output is checked
against the first contender's. Attempt 113 of docs/performance.md.

    PYTHONPATH=src python tools/decode_tile_sweep.py [--head-dim 64] [--rounds 3] [--out OUT.json]
        [--variants n64s3,n64s4,n128s3w8p4]

A variant name: n<block_n> s<num_stages> w<num_warps> p<programs_per_sm>, any of them, in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re

import torch
import triton

import fmha
from fmha.api import use_dispatcher
from fmha.bench.decode import DecodeShape, _call, _inputs
from fmha.kernels.launch import plan_tables

FIELDS = {"n": "block_n", "s": "num_stages", "w": "num_warps", "p": "programs_per_sm"}


def parse_variant(name: str) -> dict[str, int]:
    """`n128s3` -> {"block_n": 128, "num_stages": 3}."""
    m = re.fullmatch(r"(n\d+)?(s\d+)?(w\d+)?(p\d+)?", name)
    if not m or not name:
        raise SystemExit(f"variant {name!r}: expected n<block_n> s<stages> w<warps> p<programs_per_sm>, e.g. n128s3")
    return {FIELDS[part[0]]: int(part[1:]) for part in m.groups() if part}


def variant_dispatcher(registry, base, changes: dict[str, int]) -> fmha.Dispatcher:
    """A dispatcher whose registry has `base` with `changes` first, in place of `base`."""
    new = dataclasses.replace(base, algorithm=dataclasses.replace(base.algorithm, **changes))
    rest = [c for c in registry if c is not base and c.name != new.name]
    return fmha.Dispatcher(fmha.Registry([new] + rest, name=new.name))


def registry_choice(registry, head_dim: int):
    """The config the default dispatcher selects for a 16-bit decode step at `head_dim` (fmha.explain_kvcache)."""
    q = torch.zeros(1, 1, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(1, 64, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    text = fmha.explain_kvcache(q, cache, cache, cache_seqlens=torch.full((1,), 64, dtype=torch.int32, device="cuda"))
    name = re.search(r"(fwd_splitkv_\S+)\s+\(heuristic", text).group(1)
    return next(c for c in registry if c.name == name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="n64s3,n64s4,n128s3,n128s3w8")
    ap.add_argument("--out")
    args = ap.parse_args()
    registry = fmha.default_registry()
    d = args.head_dim
    base = registry_choice(registry, d)
    print(f"registry's tile at D={d}: {base.name}", flush=True)
    contenders = {"cudnn": None, "registry": None}
    contenders.update({name: variant_dispatcher(registry, base, parse_variant(name))
                       for name in args.variants.split(",") if name})
    rows = []
    for batch, seqlen in ((32, 8192), (8, 32768), (128, 2048)):
        for page in (0, 64):
            shape = DecodeShape(batch, 32, 8, seqlen, d, "bf16", page, False)
            fmha_args, sdpa_args = _inputs(shape, "cuda")
            names = [n for n in contenders if not (page and n == "cudnn")]
            calls = {n: _call("cudnn" if n == "cudnn" else "fmha", fmha_args, sdpa_args) for n in names}
            times = {n: {"cold": [], "graph": []} for n in names}
            ref = None
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    plan_tables.clear_plans()  # a call plan would keep the previous dispatcher's tile
                    with use_dispatcher(contenders[name]) if contenders[name] else contextlib.nullcontext():
                        if r == 0:
                            out = calls[name]().float()
                            ref = out if ref is None else ref
                            diff = (out - ref).abs().max().item()
                            assert diff < 2e-2, f"{name}: output {diff:.3g} from the first contender's"
                        times[name]["cold"].append(triton.testing.do_bench(calls[name], rep=100,
                                                                           return_mode="median"))
                        times[name]["graph"].append(triton.testing.do_bench_cudagraph(calls[name], rep=100,
                                                                                      return_mode="median"))
                    plan_tables.clear_plans()
            med = {n: {mode: sorted(t)[args.rounds // 2] for mode, t in v.items()} for n, v in times.items()}
            ref_name = "cudnn" if "cudnn" in med else "registry"
            for mode in ("cold", "graph"):
                print(f"D={d} B={batch:3d} S={seqlen:5d} page={page:2d} {mode:5s} " + "  ".join(
                    f"{n} {v[mode] * 1e3:6.1f}us ({med[ref_name][mode] / v[mode]:.3f})" for n, v in med.items()),
                    flush=True)
            rows.append({"head_dim": d, "batch": batch, "seqlen_k": seqlen, "page_size": page, "times_ms": times,
                         "median_ms": med, "kv_bytes": shape.kv_bytes("fmha")})
            del fmha_args, sdpa_args, calls
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "base": base.name,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
