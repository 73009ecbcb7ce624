"""Where the time of a short call goes: host (Python + launches) against GPU.

Per shape and direction (forward under no_grad; backward as autograd.grad on a retained
graph), fmha and SDPA cuDNN:
  eager   wall time per call of N back-to-back calls (one synchronize at the end): what a
          host-bound caller sees;
  host    the host's time alone: the calls queued behind a ~1 s GPU sleep, so no launch waits;
  graph   the same calls captured once in a CUDA graph and replayed: the GPU's time alone
          (fmha only where the call captures);
  bench   triton.testing.do_bench median, as `fmha bench` times it.
Then a cProfile of fmha's eager calls (top functions by own time).

    PYTHONPATH=src python tools/host_overhead_gpu.py [--calls N] [--profile-top K]   ($OUT/host_overhead.json)

(tools/host_overhead.py is the CPU-only counterpart: the host path with launches stubbed.)
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha

SHAPES = [(16, 16, 1024, d, c) for d in (64, 128, 256) for c in (False, True)]


def _calls(name, q, k, v, do, causal, direction):
    if name == "fmha":
        def fwd():
            return fmha.attention(q, k, v, causal=causal)
    else:
        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if direction == "fwd":
        def call():
            with torch.no_grad():
                return fwd()
        return call
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    q2, k2, v2 = leaves
    with torch.enable_grad():
        o = (fmha.attention(q2, k2, v2, causal=causal) if name == "fmha" else _sdpa(q2, k2, v2, causal))
    return lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)


def _sdpa(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _eager_us(call, n):
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _host_us(call, n):
    """Host time alone: the calls queued behind a long sleep kernel, so the GPU never waits for them."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU spinning: launches only queue
    t = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def _graph_us(call, n):
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                call()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                call()
        g.replay()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / n * 1e3
    except Exception as e:  # noqa: BLE001 - report, don't stop
        return f"no graph: {str(e).splitlines()[0][:120]}"


def main() -> int:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 100
    top = int(sys.argv[sys.argv.index("--profile-top") + 1]) if "--profile-top" in sys.argv else 18
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b, h, s, d, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for direction in ("fwd", "bwd"):
            row = {"shape": f"B={b} H={h} S={s} D={d}{' causal' if causal else ''}", "dir": direction}
            for name in ("fmha", "cudnn"):
                call = _calls(name, q, k, v, do, causal, direction)
                row[name] = {"eager_us": _eager_us(call, calls), "host_us": _host_us(call, calls),
                             "graph_us": _graph_us(call, 10),
                             "bench_us": triton.testing.do_bench(call, warmup=25, rep=60) * 1e3}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if d == 128 and not causal:
                call = _calls("fmha", q, k, v, do, causal, direction)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    call()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
                print(f"--- cProfile fmha {direction} {row['shape']}, {calls} calls, by own time")
                print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    (out / "host_overhead.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "fmha_commit": os.environ.get("FMHA_COMMIT", ""), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
