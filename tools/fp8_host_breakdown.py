"""Where an fp8 `fmha.attention` call's host time goes, on the GPU machine (Next item 2: the fp8
forward's host path is 4-6x bf16's). For each shape: the host time a call (`bench.host_ms_per_call`,
calls back to back, no synchronization) of bf16, fp8 e4m3 with per-(batch, head) descales, and
fp8 without descales; then, for the fp8 call, the median time of each step of its host path,
measured by wrapping the functions the call goes through (each wrapper adds ~0.3 us); then a
cProfile of the fp8 call by own time.

    PYTHONPATH=src python tools/fp8_host_breakdown.py [--shape B,H,S,D] [--calls 200]

Default shapes: B=1 H=16 S=1024 D=128 (GPU time well below the host path's: the calls' host
time is what a user sees) and issue 6's B=4 H=16 S=8192 D=128.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict

import torch

import fmha
from fmha import api
from fmha import fp8 as fp8_module
from fmha.bench.suite import host_ms_per_call

TIMES: dict[str, list[int]] = defaultdict(list)


def wrap(module, name: str, label: str) -> None:
    """Replace module.name by a wrapper recording each call's time (ns) under label."""
    inner = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter_ns() - start)

    setattr(module, name, timed)


def install_wrappers() -> None:
    """The steps of `attention_ops.fwd_fp8_op` and of the Gluon launcher below it (the modules the call
    really goes through: `api.family_module` gives the launcher's module)."""
    fwd = api.family_module("gluon.fwd", interpreted=False)
    for module, name in ((api, "_prepare_op"), (fp8_module, "check_descales"), (api, "_plan_forward"),
                         (api, "_alloc_like"), (api, "_kernel_args"), (api, "_launch_forward"),
                         (fwd, "launch"), (fwd, "_transposed"), (fwd.fp8_vt, "launch_vt"),
                         (fwd, "_tensor_args"), (fwd.launch_cache, "make_plan"), (fwd.launch_cache, "keep")):
        wrap(module, name, f"{module.__name__.split('.')[-1]}.{name}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", help="B,H,S,D (repeatable)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shape] if args.shape else [(1, 16, 1024, 128),
                                                                                     (4, 16, 8192, 128)]
    for batch, nhead, seqlen, head_dim in shapes:
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k, v = (torch.randn(batch, nhead, seqlen, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))
        (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, k, v))
        calls = {"bf16": lambda: fmha.attention(q, k, v, causal=True),
                 "fp8": lambda: fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True),
                 "fp8 no descales": lambda: fmha.attention(q8, k8, v8, causal=True)}
        few = 10 if seqlen >= 4096 else args.calls  # (long calls: few enough that the queue never fills)
        print(f"B={batch} H={nhead} S={seqlen} D={head_dim} causal", flush=True)
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            best = min(host_ms_per_call(fn, few) for _ in range(5))
            print(f"  {name:16} host {best * 1e3:7.1f} us a call (best of 5 runs of {few} calls)", flush=True)
    install_wrappers()
    batch, nhead, seqlen, head_dim = shapes[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, nhead, seqlen, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, q, q))

    def fp8_call():
        return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)

    for _ in range(20):
        fp8_call()
    torch.cuda.synchronize()
    TIMES.clear()
    total = []
    for _ in range(args.calls):
        start = time.perf_counter_ns()
        fp8_call()
        total.append(time.perf_counter_ns() - start)
        if len(total) % 20 == 0:
            torch.cuda.synchronize()  # (keep the queue short: no call waits for the GPU)
    print(f"fp8 call, B={batch} H={nhead} S={seqlen} D={head_dim}, steps (median us a call, wrapped):")
    print(f"  {'whole call':32} {statistics.median(total) / 1e3:8.1f}")
    for label, values in TIMES.items():
        per_call = len(values) / args.calls
        print(f"  {label:32} {statistics.median(values) / 1e3:8.1f}  ({per_call:g} a call)")
    for name, fn in (("fp8", fp8_call), ("fp8 no descales", lambda: fmha.attention(q8, q8, q8, causal=True))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(100):
            fn()
            if i % 20 == 19:
                torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"cProfile of 100 {name} calls, by own time:")
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
