"""On a GPU: which dK/dV and dQ tiles give a bitwise-reproducible deterministic backward,
and how fast each is. PYTHONPATH=src python tools/determinism_sweep.py"""

import torch
import triton

import fmha
from fmha.dispatch.configs import CUDA_ARCHS, Algorithm, Family, KernelConfig, Signature
from fmha.dispatch.registry import Registry, default_registry
from fmha.problem import DType

HALF = (DType.FP16, DType.BF16)


def registry(dkdv, dq):
    first = [KernelConfig(Signature(Family.BWD_DQ_DK_DV, HALF, CUDA_ARCHS, 128), Algorithm(*dkdv)),
             KernelConfig(Signature(Family.BWD_DQ, HALF, CUDA_ARCHS, 128), Algorithm(*dq))]
    names = {c.name for c in first}
    return Registry(first + [c for c in default_registry() if c.name not in names], name="sweep")


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hk, S, D = 2, 16, 4, 2048, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hk, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for dkdv, dq in [((32, 64, 4, 3), (64, 64, 4, 2)), ((32, 64, 4, 2), (64, 64, 4, 2)),
                     ((32, 64, 4, 3), (128, 64, 8, 2)), ((32, 128, 8, 2), (64, 64, 4, 2)),
                     ((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 64, 4, 2), (64, 64, 4, 3))]:
        fmha.set_dispatcher(fmha.Dispatcher(registry(dkdv, dq)))
        for causal in (False, True):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            o = fmha.attention(qq, kk, vv, causal=causal, deterministic=True)
            runs = [torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True) for _ in range(5)]
            same = [all(torch.equal(a, b) for a, b in zip(runs[0], r)) for r in runs[1:]]
            which = [[not torch.equal(a, b) for a, b in zip(runs[0], r)] for r in runs[1:]]
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True),
                                         warmup=25, rep=100, return_mode="median")
            print(f"dkdv {dkdv} dq {dq} causal={causal}: bitwise={all(same)} differ(dq,dk,dv)={which[0]} "
                  f"{ms:.3f} ms {2.5 * 4 * B * H * S * S * D / (2 if causal else 1) / ms / 1e9:.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
