"""Is the fp8 forward's benchmark time its kernels' time? At B=4 H=16 S=8192 (issue 6's shape),
fp8 e4m3 and bf16 through `fmha.attention`: the host's time a call (`bench.host_ms_per_call`),
`do_bench` of the eager call (what tools/fp8_bench.py reports), `do_bench` of the same call
captured in a CUDA graph (the GPU's time alone, with do_bench's flush before each replay), and a
cProfile of the eager fp8 call's host path.

    PYTHONPATH=src python tools/fp8_host_probe.py
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
import triton
from fp8_bench import B, H, S, issue_inputs  # (tools/: the script's directory)

import fmha
from fmha.bench.suite import host_ms_per_call


def main() -> int:
    for D in (128, 256):
        (q, k, v), ((q8, qd), (k8, kd), (v8, vd)) = issue_inputs(D)
        for causal in (False, True):
            calls = {"bf16": lambda: fmha.attention(q, k, v, causal=causal),
                     "fp8": lambda: fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                                   causal=causal)}
            for name, fn in calls.items():
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                host = host_ms_per_call(fn, 10)
                eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                replay = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                print(f"D={D} causal={causal!s:5} {name:4}: host {host * 1e3:6.1f} us a call, do_bench eager "
                      f"{eager * 1e3:7.1f} us ({flops / eager / 1e9:6.1f} TFLOP/s), graph replay {replay * 1e3:7.1f}"
                      f" us ({flops / replay / 1e9:6.1f})", flush=True)
        if D == 128:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                calls["fp8"]()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
            print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
