"""Wave quantization check: forward and backward TFLOP/s of fmha and SDPA cuDNN (alternating, 5
rounds) at B=1 S=8192 without a mask, D 128 and 64, H = 31, 32, 33 heads. The standard suite's
shapes all make 2048 CTA tiles of 128 rows or keys (15.5 waves of 132 programs, one a SM): if the
last wave's idle half cost ~3%, H=31 (1984 tiles, 15.03 waves) and H=33 (2112, 16.0) would beat
H=32 per FLOP.

    PYTHONPATH=src python tools/bench_waves.py
"""

import statistics

import torch

from fmha.bench import suite as bench
from fmha.bench.suite import Shape

for d in (128, 64):
    for h in (31, 32, 33):
        shape = Shape(1, h, h, 8192, d, "bf16", False)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, h, 8192, d, generator=gen, device="cuda").to(torch.bfloat16)
                       for _ in range(4))
        for mode in ("fwd", "bwd"):
            runners = {n: bench._setup(n, shape, mode, q, k, v, do) for n in ("fmha", "cudnn")}
            times: dict[str, list[float]] = {n: [] for n in runners}
            for r in range(5):
                for n in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                    times[n].append(runners[n].measure(25, 100))
            tf = {n: shape.flops(mode) / statistics.median(t) / 1e9 for n, t in times.items()}
            print(f"D={d} H={h} {mode} fmha {tf['fmha']:6.1f} cudnn {tf['cudnn']:6.1f} ratio "
                  f"{tf['fmha'] / tf['cudnn']:.3f}", flush=True)
