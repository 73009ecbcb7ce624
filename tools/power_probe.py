"""Clock and power of the GPU while one kernel runs back to back: is a contender held by the board's
power cap (700 W on the H200) rather than by its own pipes? For each contender (our bf16 and fp8
forwards at B=4 H=16 S=8192, D=128 and 256, cuBLAS bf16 and fp8 GEMMs at 8192 cubed), the call is
repeated for --seconds while `nvidia-smi` samples SM clock, power and throttle reasons every 100 ms;
prints per contender TFLOP/s over the whole stretch, the mean SM clock and power of the samples
inside it (the first 0.5 s left out), the share of samples with the SW power cap active, and
FLOP per SM per cycle at that clock (the tensor cores' dense peak is 4096 for bf16, 8192 for fp8).

    PYTHONPATH=src python tools/power_probe.py [--seconds 4] [--only fmha|gemm]
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import time
from pathlib import Path

import torch

import fmha

sys.path.insert(0, str(Path(__file__).parent))
from gemm_ceiling import gemm_calls  # noqa: E402

POWER_CAP_BIT = 0x4  # clocks_throttle_reasons: SW power cap


def contenders(only: str | None) -> dict:
    out = {}
    if only in (None, "fmha"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        for d in (128, 256):
            b, h, s = 4, 16, 8192
            q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, k, v))
            flops = 4 * b * h * s * s * d
            out[f"fmha bf16 D={d}"] = (lambda q=q, k=k, v=v: fmha.attention(q, k, v), flops, 4096)
            out[f"fmha fp8 D={d}"] = (lambda q8=q8, k8=k8, v8=v8, qd=qd, kd=kd, vd=vd: fmha.attention(
                q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd), flops, 8192)
    if only in (None, "gemm"):
        n = 8192
        gemms = gemm_calls(n)
        out["cuBLAS bf16 mm"] = (gemms["bf16 mm"], 2 * n ** 3, 4096)
        out["cuBLAS fp8 _scaled_mm"] = (gemms["fp8 e4m3 _scaled_mm"], 2 * n ** 3, 8192)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--only", choices=["fmha", "gemm"])
    a = p.parse_args()
    calls = contenders(a.only)
    for fn, _, _ in calls.values():  # compile and warm up before the sampling starts
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    spans = {}
    for name, (fn, flops, _) in calls.items():
        time.sleep(1.0)  # let the clock recover between contenders
        t0 = time.time()
        n = 0
        while time.time() - t0 < a.seconds:
            for _ in range(10):
                fn()
            n += 10
            torch.cuda.synchronize()
        t1 = time.time()
        spans[name] = (t0, t1, n * flops / (t1 - t0) / 1e12)
    time.sleep(0.5)
    smi.terminate()
    rows = list(csv.reader(io.StringIO(smi.communicate()[0])))
    samples = []
    for r in rows:
        try:
            stamp = time.mktime(time.strptime(r[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S")) + float(
                "0." + r[0].strip().split(".")[1])
            samples.append((stamp, float(r[1]), float(r[2]), int(r[3].strip(), 16)))
        except (ValueError, IndexError):
            continue
    print(f"{torch.cuda.get_device_name()}, {len(samples)} samples")
    print(f"{'contender':24s} {'TFLOP/s':>8s} {'SM MHz':>7s} {'W':>6s} {'capped':>7s} {'FLOP/SM/clk':>11s} "
          f"{'of peak':>7s}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (t0, t1, tflops) in spans.items():
        inside = [s for s in samples if t0 + 0.5 <= s[0] <= t1]  # (both local time)
        if not inside:
            print(f"{name:24s} {tflops:8.1f} (no samples)")
            continue
        mhz = sum(s[1] for s in inside) / len(inside)
        watts = sum(s[2] for s in inside) / len(inside)
        capped = sum(1 for s in inside if s[3] & POWER_CAP_BIT) / len(inside)
        per_clk = tflops * 1e12 / (sms * mhz * 1e6)
        peak = calls[name][2]
        print(f"{name:24s} {tflops:8.1f} {mhz:7.0f} {watts:6.0f} {capped:7.0%} {per_clk:11.0f} {per_clk / peak:7.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
