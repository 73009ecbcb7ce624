"""Host cost of one Gluon forward launch, piece by piece, on the GPU's host (B=16 H=16 S=1024
D=64 causal bf16): how much of a call is the api, how much our launcher, how much Triton's
launcher (its Python wrapper, the TMA descriptor encoding, the C launch).

Each line: host microseconds a call, the calls queued behind a GPU sleep (no launch waits,
tools/host_overhead_gpu.py's measure), best of 5 runs of N calls.

    PYTHONPATH=src python tools/launcher_cost.py [--calls N]
"""

import sys

import torch
from host_overhead_gpu import _host_us  # (tools/ is on the path when a tool runs)
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.kernels.gluon import fwd as fwd_gluon
from fmha.kernels.launch import cache as launch_cache


def host_us(fn, calls: int) -> float:
    """Best of 5 of host_overhead_gpu's host-only time (the calls queued behind a GPU sleep)."""
    return min(_host_us(fn, calls) for _ in range(5))


def main() -> int:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 200
    B, H, S, D = 16, 16, 1024, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.set_grad_enabled(False)
    o = fmha.attention(q, k, v, causal=True)
    ((key, planned),) = fwd_gluon._PLANS.items()
    plan, lse = planned.plan, torch.empty(B, H, S, device="cuda")
    block_n = 128
    targs = fwd_gluon._tensor_args(q, k, v, o, lse, block_n, True, False)  # (bf16 O: by TMA)
    bound = (*targs, *planned.tail, *plan.tail)
    compiled = plan.compiled
    runner = compiled.run  # triton's CudaLauncher
    inner = runner.launch  # its wrapper that encodes the TMA descriptors
    cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
    c_launch = cells["launcher"]  # the compiled C launcher
    meta = cells["tensordesc_meta"]
    from triton.backends.nvidia.driver import make_tensordesc_arg
    descs = [a for a in targs if hasattr(a, "block_shape")]
    grid = plan.grid

    def expanded():
        out, i = [], 0
        for a in bound:
            if hasattr(a, "block_shape"):
                out.extend(make_tensordesc_arg(a, meta[i]))
                i += 1
            else:
                out.append(a)
        return out

    pre = expanded()
    stream = torch.cuda.current_stream().cuda_stream
    base = (grid[0], grid[1], grid[2], stream, compiled.function, runner.launch_cooperative_grid,
            runner.launch_pdl, None, None, compiled.packed_metadata, None, None, None)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = [
        ("fmha.attention (no grad)", lambda: fmha.attention(q, k, v, causal=True)),
        ("SDPA cuDNN (no grad)", sdpa),
        ("the plan (direct C launch, cached encodings)", lambda: planned.launch(q, k, v, o, lse)),
        ("descriptors + Triton's CudaLauncher", lambda: launch_cache._run(plan.compiled, plan.grid, plan.device, (
            *fwd_gluon._tensor_args(q, k, v, o, lse, block_n, True, False), *planned.tail, *plan.tail))),
        ("C launcher, descriptors encoded per call", lambda: c_launch(*base, *expanded())),
        ("C launcher, encoded once", lambda: c_launch(*base, *pre)),
        ("4 x make_tensordesc_arg", lambda: [make_tensordesc_arg(d, meta[i]) for i, d in enumerate(descs)]),
        ("2 x torch.empty (o, lse)", lambda: (torch.empty_like(q), torch.empty(B, H, S, device="cuda"))),
    ]
    print(f"{len(bound)} kernel arguments, {len(pre)} after expansion, grid {grid}")
    for name, fn in rows:
        print(f"{name:<45} {host_us(fn, calls):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
