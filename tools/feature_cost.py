"""On a GPU: what each forward feature costs, atomic vs deterministic backward, and a
small tile sweep of the plain Triton configs. Writes JSON to $OUT (or ./out).

    PYTHONPATH=src python tools/feature_cost.py [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

import fmha
from fmha.dispatch.configs import CUDA_ARCHS, Algorithm, Family, KernelConfig, Signature
from fmha.dispatch.registry import Registry, default_registry
from fmha.problem import DType

B, H, S, D = 4, 16, 4096, 128
DT = torch.bfloat16


def bench(fn, rounds=3):
    times = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(rounds)]
    return sorted(times)[len(times) // 2]


def tflops(ms, causal, mode="fwd", window=None):
    flops = 4 * B * H * S * S * D
    if window is not None:
        flops = 4 * B * H * S * min(S, window + 1) * D
    elif causal:
        flops /= 2
    if mode == "bwd":
        flops *= 2.5
    return flops / ms / 1e9


def inputs(requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=DT, generator=g) for _ in range(3))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def feature_costs(results):
    q, k, v = inputs()
    features = {
        "plain": {}, "causal": dict(causal=True), "window 256": dict(window=(256, 0)),
        "window 256 + 4 sink tokens": dict(window=(256, 0), sink_size=4),
        "bias (1,H,S,S) bf16": dict(bias=torch.randn(1, H, S, S, device="cuda", dtype=DT)),
        "alibi": dict(alibi_slopes=torch.rand(H, device="cuda")),
        "softcap 30": dict(softcap=30.0), "sinks": dict(sinks=torch.randn(H, device="cuda")),
        "dropout 0.1": dict(dropout_p=0.1, seed=1),
    }
    plain = None
    for name, kw in features.items():
        ms = bench(lambda kw=kw: fmha.attention(q, k, v, **kw))
        plain = plain or ms
        results.append(dict(kind="feature", name=name, ms=ms, rel=ms / plain))
        print(f"feature {name:<28} {ms:8.3f} ms  x{ms / plain:5.2f} of plain", flush=True)


def backward_modes(results):
    q, k, v = inputs(True)
    do = torch.randn_like(q)
    for causal in (False, True):
        for det in (False, True):
            o = fmha.attention(q, k, v, causal=causal, deterministic=det)

            def step(o=o):
                torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            ms = bench(step)
            results.append(dict(kind="bwd_mode", causal=causal, deterministic=det, ms=ms,
                                tflops=tflops(ms, causal, "bwd")))
            print(f"bwd causal={causal} deterministic={det}: {ms:8.3f} ms "
                  f"{tflops(ms, causal, 'bwd'):6.1f} TFLOP/s", flush=True)


def with_first(config: KernelConfig) -> Registry:
    rest = [c for c in default_registry() if c.name != config.name]
    return Registry([config] + rest, name="sweep")


def tile_sweep(results, quick):
    half = (DType.FP16, DType.BF16)
    fwd_tiles = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
                 (64, 64, 4, 3), (128, 32, 4, 4)]
    dkdv_tiles = [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 1)]
    dq_tiles = [(128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2)]
    if quick:
        fwd_tiles, dkdv_tiles, dq_tiles = fwd_tiles[:3], dkdv_tiles[:2], dq_tiles[:2]
    q, k, v = inputs(True)
    do = torch.randn_like(q)
    for family, tiles in ((Family.FWD, fwd_tiles), (Family.BWD_DQ_DK_DV, dkdv_tiles),
                          (Family.BWD_DQ, dq_tiles)):
        for bm, bn, w, s in tiles:
            config = KernelConfig(Signature(family, half, CUDA_ARCHS, 128), Algorithm(bm, bn, w, s))
            fmha.set_dispatcher(fmha.Dispatcher(with_first(config)))
            for causal in (False, True):
                try:
                    if family == Family.FWD:
                        ms = bench(lambda causal=causal: fmha.attention(q, k, v, causal=causal))
                        mode = "fwd"
                    else:
                        det = family == Family.BWD_DQ
                        o = fmha.attention(q, k, v, causal=causal, deterministic=det)
                        ms = bench(lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
                        mode = "bwd"
                    rate = tflops(ms, causal, mode)
                    results.append(dict(kind="tile", family=family.value, tile=[bm, bn, w, s],
                                        causal=causal, ms=ms, tflops=rate))
                    print(f"tile {family.value:<13} m{bm} n{bn} w{w} s{s} causal={causal}: "
                          f"{ms:8.3f} ms {rate:6.1f} TFLOP/s", flush=True)
                except Exception as e:  # a tile that does not fit is a result, not a crash
                    msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                    results.append(dict(kind="tile", family=family.value, tile=[bm, bn, w, s],
                                        causal=causal, error=msg))
                    print(f"tile {family.value} m{bm} n{bn} w{w} s{s} causal={causal}: FAILED {msg}")
    fmha.set_dispatcher(None)


def main() -> int:
    quick = "--quick" in sys.argv
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, shape=[B, H, S, D], dtype=str(DT))
    for step in (feature_costs, backward_modes):
        step(results)
    if "--no-sweep" not in sys.argv:
        tile_sweep(results, quick)
    (out / "feature_cost.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
