"""The GPU kernels of one fp8 forward call (`fmha.attention` with e4m3 q/k/v) and their times:
how much of a call is the attention kernel and how much the V^T scratch copy
(`fwd_gluon._transposed`). B=4 H=16 S=8192, D 128 / 256, torch's profiler, medians of 20 calls.

    PYTHONPATH=src python tools/fp8_call_kernels.py
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
import triton
from fp8_bench import issue_inputs  # (tools/: the script's directory)
from torch.profiler import ProfilerActivity, profile

import fmha
from fmha.kernels.gluon import fwd as fwd_gluon


def main() -> int:
    for D in (128, 256):
        _, ((q8, qd), (k8, kd), (v8, vd)) = issue_inputs(D)
        for causal in (False, True):
            def call():
                return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            times = defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    times[e.name[:70]].append(e.time_range.elapsed_us())
            total = sum(statistics.median(t) * len(t) / 20 for t in times.values())
            print(f"D={D} causal={causal}: {total:.1f} us of kernels a call")
            for name, t in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
                print(f"   {statistics.median(t):9.1f} us x{len(t) / 20:.0f}  {name}")
        for perm in (False, True):
            ms = triton.testing.do_bench(lambda perm=perm: fwd_gluon._transposed(v8, perm), warmup=10, rep=50)
            gbs = 2 * v8.numel() / ms / 1e6  # bytes read and written
            print(f"D={D} _transposed(key_perm={perm}): {ms * 1e3:.1f} us ({gbs:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
