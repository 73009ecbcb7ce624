"""Host (Python) time of one `fmha.attention` call, kernel launch excluded, on the CPU.

The launch is replaced by a no-op, so this is what the API, validation, the plan cache and
torch's custom-op dispatch cost per call: the floor under small problems and decode.

    PYTHONPATH=src python tools/host_overhead.py [--calls N]
"""

import sys
import time

import torch

import fmha
from fmha import api


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 3000
    api._launch_forward = lambda *a, **k: None  # time the host path only
    q = torch.randn(1, 4, 16, 64, dtype=torch.bfloat16)
    cases = {
        "attention(q, k, v, causal=True)": lambda: fmha.attention(q, q, q, causal=True),
        "attention(..., return_lse=True, layout='bshd')": lambda: fmha.attention(
            q, q, q, causal=True, return_lse=True, layout="bshd"),
    }
    for name, fn in cases.items():
        print(f"{name:<50} {per_call_us(fn, calls):7.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
