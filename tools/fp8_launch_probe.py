"""The Gluon forward launched directly (`fwd_gluon.launch`, bypassing the registry) at chosen tiles,
e4m3 q/k/v without descales (or, --dtype bf16|fp16, the 16-bit kernel), B=4 H=16 S=8192 unless --shape,
side by side with fmha's bf16 forward (and, for 16-bit, SDPA's cuDNN backend), alternating, rotated each
round, `do_bench` medians, with each tile's largest output difference from the first tile's.
For tiles the registry refuses (block_m 192: three consumer warpgroups; attempts 82, 87-88).

    PYTHONPATH=src python tools/fp8_launch_probe.py [--hdim 128] [--tiles 128x128x2,192x64x4] [--rounds 3]
        [--dtype e4m3|bf16|fp16] [--shape B,H,S] [--causal 0,1]

--tiles: block_m x block_n x stages, comma-separated (no ping-pong; a trailing p: the persistent kernel,
`launch(persistent=True)`); a tile may end in :NAME=V, a module
constant of fwd_gluon set to the integer V around that tile's launches (e.g. 192x128x2p:P_SMEM_16=1, or an
experiment branch's switch, e.g. 128x256x2:S_AHEAD=5 on exp/fp8-p-smem, attempt 83).
--causal: which of non-causal (0) and causal (1) to run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import fmha
from fmha.kernels.gluon import fwd as fwd_gluon


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--tiles", default="128x128x2,128x128x3,192x64x4,192x64x3,192x64x2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="e4m3", choices=["e4m3", "bf16", "fp16"])
    p.add_argument("--shape", default="4,16,8192", help="B,H,S")
    p.add_argument("--causal", default="0,1")
    a = p.parse_args()
    tiles = []
    for spec in a.tiles.split(","):
        shape, _, switch = spec.partition(":")
        name, _, value = switch.partition("=")
        persistent = shape.endswith("p")
        tiles.append((*(int(x) for x in shape.rstrip("p").split("x")), persistent,
                      (name, int(value)) if switch else None))
    batch, heads, seqlen = (int(x) for x in a.shape.split(","))
    d = a.hdim
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt16 = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", generator=gen, dtype=dt16)
               for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v)) if a.dtype == "e4m3" else (q, k, v)
    for causal in (bool(int(c)) for c in a.causal.split(",")):
        flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        calls, outs = {}, {}
        for bm, bn, st, persistent, switch in tiles:
            o = torch.empty(batch, heads, seqlen, d, device="cuda", dtype=dt16)
            lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)

            def call(o=o, lse=lse, bm=bm, bn=bn, st=st, persistent=persistent, switch=switch):
                if switch:
                    before = getattr(fwd_gluon, switch[0])
                    setattr(fwd_gluon, switch[0], switch[1])
                try:
                    fwd_gluon.launch(q8, k8, v8, o, lse, causal=causal, align_bottom_right=True, scale=d ** -0.5,
                                     block_m=bm, block_n=bn, num_stages=st, pingpong=False, persistent=persistent)
                finally:
                    if switch:
                        setattr(fwd_gluon, switch[0], before)
                return o
            name = f"m{bm}n{bn}s{st}" + (" persistent" if persistent else "") + (
                f":{switch[0]}={switch[1]}" if switch else "")
            calls[name] = call
            outs[name] = call().float().clone()
        ref = f"{'fp16' if a.dtype == 'fp16' else 'bf16'} (fmha)"
        calls[ref] = lambda: fmha.attention(q, k, v, causal=causal)
        if a.dtype != "e4m3":
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            calls["cudnn"] = cudnn
        names = list(calls)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(do_bench(calls[n], warmup=25, rep=100, return_mode="median"))
        first = outs[names[0]]
        ref_ms = statistics.median(times[ref])
        for n in names:
            ms = statistics.median(times[n])
            diff = f"max diff from {names[0]} {float((outs[n] - first).abs().max()):.2e}" if n in outs else ""
            print(f"D={d} causal={causal!s:<5} {n:22s} {ms:.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
                  f"x{ref_ms / ms:.3f} of {ref}" + (f" x{statistics.median(times['cudnn']) / ms:.3f} of cudnn"
                                                 if "cudnn" in times else "") + f"  {diff}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
