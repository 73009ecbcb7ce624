"""On a GPU: narrow down why dK of the fast dK/dV tile (block_m=32) is not bitwise
reproducible (docs/performance.md, attempt 4). Launches the dK/dV kernel directly (no dQ,
no atomics) N times on fixed inputs, per tile and per kind of delta, and records which
outputs differ, by how much, and where.

    PYTHONPATH=src python tools/dkdv_determinism_probe.py OUT.json [--runs 10]

What the variants tell apart (reading of the sm_90 TTGIR/PTX, see the JSON's "notes"):
- num_stages 3 / 2 / 1: with stages > 1 the per-row LSE and delta loads are software-
  pipelined into a shared-memory ring with cp.async (2 slots for 3 stages); stages=1 has
  no ring. Only dK reads delta, dV does not: a race on the delta ring would show in dK only.
- delta "real" / "zero" / "const": with one value in every row a read from the wrong slot
  or row (or a stale slot) gives the same number, so a delta-ring race disappears; if dK
  still differs with zero delta, the cause is elsewhere (the dP = dO V^T mma, the ds^T
  round trip through shared memory, or the dK wgmma reading q).
- block_m 32 vs 64: block_m=32 with 4 warps computes QK^T and dO V^T with mma.sync (M=32 is
  below one warpgroup's 64) and dK/dV with wgmma; block_m=64 uses wgmma throughout.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import fmha
from fmha.kernels.triton import bwd

TILES = [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 1), (32, 128, 8, 2), (64, 128, 8, 2)]


def where_differs(a: torch.Tensor, b: torch.Tensor, block_n: int) -> dict:
    diff = (a.float() - b.float()).abs()
    bad = diff > 0
    idx = bad.nonzero()
    return {
        "count": int(bad.sum()), "of": a.numel(), "max_abs": float(diff.max()),
        "max_rel": float((diff / a.float().abs().clamp_min(1e-6)).max()),
        "batches": sorted({int(i) for i in idx[:, 0].tolist()}),
        "kv_heads": sorted({int(i) for i in idx[:, 1].tolist()}),
        "rows_mod_block_n": sorted({int(i) % block_n for i in idx[:, 2].tolist()})[:64],
        "key_blocks": sorted({int(i) // block_n for i in idx[:, 2].tolist()})[:64],
        "head_dim_columns": sorted({int(i) for i in idx[:, 3].tolist()})[:128],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, H, Hk, S, D = 2, 16, 4, 2048, 128
    dt = torch.bfloat16
    q = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    k, v = (torch.randn(B, Hk, S, D, device="cuda", dtype=dt) for _ in range(2))
    do = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    results = []
    for causal in (False, True):
        o, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
        delta_real = torch.empty_like(lse)
        common = dict(batch=B, max_seqlen_q=S, max_seqlen_k=S, scale=D ** -0.5, softcap=0.0,
                      window=(-1, 0) if causal else (-1, -1), sink_size=0, align_bottom_right=True,
                      dropout_p=0.0, seed=0, offset=0)
        bwd.launch_dot_do_o(o, do, lse, delta_real, **common, block_m=64, num_warps=4, num_stages=1)
        deltas = {"real": delta_real, "zero": torch.zeros_like(lse), "const": torch.full_like(lse, 0.37)}
        for bm, bn, w, s in TILES:
            for name, delta in deltas.items():
                runs = []
                for _ in range(args.runs):
                    dk, dv = torch.empty_like(k), torch.empty_like(v)
                    bwd.launch_dkdv(q, k, v, do, lse, delta, dk, dv, **common, block_m=bm, block_n=bn,
                                    num_warps=w, num_stages=s, dot_precision="ieee")
                    runs.append((dk, dv))
                torch.cuda.synchronize()
                entry = {"causal": causal, "tile": [bm, bn, w, s], "delta": name,
                         "dk_bitwise": all(torch.equal(runs[0][0], r[0]) for r in runs[1:]),
                         "dv_bitwise": all(torch.equal(runs[0][1], r[1]) for r in runs[1:])}
                for which, i in (("dk", 0), ("dv", 1)):
                    worst = max(range(1, len(runs)), key=lambda j: int((runs[0][i] != runs[j][i]).sum()))
                    if not entry[f"{which}_bitwise"]:
                        entry[f"{which}_diff"] = where_differs(runs[0][i], runs[worst][i], bn)
                print(json.dumps({k_: entry[k_] for k_ in ("causal", "tile", "delta", "dk_bitwise",
                                                          "dv_bitwise")}), flush=True)
                results.append(entry)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": args.runs, "results": results,
                   "notes": __doc__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
