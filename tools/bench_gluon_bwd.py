"""Backward side by side: fmha (Gluon dK/dV where the dispatcher picks it), fmha with the
Triton dK/dV (a registry without Gluon backward configs), SDPA cuDNN and SDPA flash.

Times the backward only (autograd.grad with the graph retained), B=4 H=16, S 4096/8192,
D 64/128, bf16, causal and not, plus GQA 4x32/8 at 8192. Contenders alternate per round.

    PYTHONPATH=src python tools/bench_gluon_bwd.py [--rounds N] [--quick] [--hdims 64,128]
                                                   [--no-ldg] [--no-triton]   ($OUT/bench_gluon_bwd.json)

--hdims: head dims of the B=4 H=16 rows (and of the GQA rows, for head dims >= 128);
--no-ldg, --no-triton: leave out the fmha_ldg_stats / fmha_triton contender.
--shapes B:Hq:Hk:S:D:c,...: these rows instead (c causal, f full), e.g. 4:16:16:4096:256:c.
--variants d64:m64n64w4s3,...: more contenders, `fmha_<variant>`: the Gluon dK/dV config of
    that head dim with this tile (block_m, block_n, warps, stages), the rest of the registry as is;
    a third field names the pipeline (d128:m64n128w8s2:gluon, the kernel without warp specialization),
    a fourth changes that pipeline's kernel shape (`bwd_gluon.SHAPES`), e.g.
    d128:m64n128w8s2:gluon_ws:dq_bufs=1+dq_cols=64, d128:m64n128w8s2:gluon:dq_tma=0;
    persistent=1 there makes the config persistent (gluon_ws: one program per SM
    walking the key tiles) and tile_order=N sets its causal key-tile order (bwd_gluon._my_key_tile:
    0 LPT, 1 heads, 2 pairs, the default), e.g. d128:m64n128w8s3:gluon_ws:persistent=1+tile_order=0.
    Short sequences, where the persistent kernel is meant to help: --shapes 16:16:16:1024:128:f,...
"""

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha import Registry, default_registry
from fmha.dispatch.configs import Family, Pipeline
from fmha.dispatch.dispatcher import Dispatcher
from fmha.kernels.gluon import bwd as bwd_gluon
from fmha.kernels.gluon import common as gluon_common

# "fmha_ldg_stats": the Gluon dK/dV with LSE/delta read by per-thread loads instead of TMA
# (its fallback for unaligned LSE), to measure what the TMA path gains in the same run.
STATS_VARIANTS = {"fmha": True, "fmha_ldg_stats": False}
DEFAULT_SHAPES = bwd_gluon.SHAPES  # the module's; a variant swaps in a changed copy


def _stats_tma(on: bool) -> None:
    bwd_gluon.tma_aligned = gluon_common.tma_aligned if on else (lambda *tensors: False)


SHAPES = {}  # contender -> bwd_gluon.SHAPES while it runs


def _setup(name: str) -> None:
    """Module switches of contender `name` (LSE/delta by TMA, kernel shapes), for its calls."""
    _stats_tma(STATS_VARIANTS.get(name, True))
    bwd_gluon.SHAPES = SHAPES.get(name, DEFAULT_SHAPES)


def _variant_dispatcher(spec: str) -> Dispatcher:
    import dataclasses
    import re

    head_dim, tile, *rest = spec.split(":")
    m, n, w, st = map(int, re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", tile).groups())
    changes = dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
    if rest:
        changes["pipeline"] = Pipeline(rest[0])
    if len(rest) > 1:
        d, pipeline = int(head_dim[1:]), rest[0]
        assigned = {k: int(v) for k, v in (kv.split("=") for kv in rest[1].split("+"))}
        if "persistent" in assigned:  # the config's, not the kernel shape's
            changes["persistent"] = bool(assigned.pop("persistent"))
        if assigned:
            shape = {**DEFAULT_SHAPES[pipeline][d], **assigned}
            SHAPES[f"fmha_{spec}"] = {**DEFAULT_SHAPES, pipeline: {**DEFAULT_SHAPES[pipeline], d: shape}}
    configs, replaced = [], False
    for c in default_registry():
        if c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon and c.signature.head_dims == (
                int(head_dim[1:]),):
            if replaced:  # the registry's other Gluon dK/dV kernel of this head dim: the variant replaces both
                continue
            c, replaced = type(c)(c.signature, dataclasses.replace(c.algorithm, **changes), notes=c.notes), True
        configs.append(c)
    return Dispatcher(Registry(configs, name=f"variant-{spec}"))


TRITON_BWD = Dispatcher(Registry([c for c in default_registry()
                                  if not (c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon)],
                                 name="no-gluon-bwd"))


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    quick = "--quick" in sys.argv
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    hdims = [int(d) for d in sys.argv[sys.argv.index("--hdims") + 1].split(",")] if "--hdims" in sys.argv \
        else [64, 128]
    shapes = [(4, 16, 16, s, d, c) for s in ((4096,) if quick else (4096, 8192)) for d in hdims
              for c in (False, True)]
    shapes += [(4, 32, 8, 8192, d, c) for d in hdims if d >= 128 for c in (False, True)]
    if "--shapes" in sys.argv:
        shapes = [(*map(int, row.split(":")[:5]), row.split(":")[5] == "c")
                  for row in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    contenders = [n for n in ("fmha", "fmha_ldg_stats", "fmha_triton", "cudnn", "flash")
                  if not (n == "fmha_ldg_stats" and "--no-ldg" in sys.argv)
                  and not (n == "fmha_triton" and "--no-triton" in sys.argv)]
    variants = {}
    if "--variants" in sys.argv:
        variants = {f"fmha_{v}": _variant_dispatcher(v) for v in sys.argv[sys.argv.index("--variants") + 1].split(",")}
        contenders[1:1] = list(variants)

    def dispatcher_of(name):
        return TRITON_BWD if name == "fmha_triton" else variants.get(name)
    rows = []
    for b, hq, hk, s, d, causal in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        flops = 2.5 * 4.0 * b * hq * s * s * d / (2 if causal else 1)
        extra = {"enable_gqa": True} if hq != hk else {}
        graphs, grads, times = {}, {}, {}
        for name in contenders:
            fmha.set_dispatcher(dispatcher_of(name))
            if name.startswith("fmha"):
                o = fmha.attention(q, k, v, causal=causal)
            else:
                backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)
            graphs[name] = o
            _setup(name)
            grads[name] = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            _setup("fmha")
            times[name] = []
        fmha.set_dispatcher(None)
        diffs = {n: max((a.float() - r.float()).abs().max().item() for a, r in zip(g, grads["cudnn"], strict=True))
                 for n, g in grads.items()}
        for _ in range(rounds):
            for name, o in graphs.items():
                fmha.set_dispatcher(dispatcher_of(name))
                _setup(name)
                times[name].append(triton.testing.do_bench(
                    lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup=25, rep=100))
                _setup("fmha")
            fmha.set_dispatcher(None)
        tflops = {n: flops / (statistics.median(t) * 1e-3) / 1e12 for n, t in times.items()}
        chosen = next((line for line in fmha.explain(q, k, v, causal=causal).splitlines()
                       if "bwd_dq_dk_dv " in line), "(no backward plan shown)")
        row = {"shape": f"B={b} Hq={hq} Hk={hk} S={s} D={d} {'causal' if causal else 'full'}", "tflops": tflops,
               "max_abs_diff_vs_cudnn": diffs, "fmha_dkdv": chosen.strip()}
        rows.append(row)
        line = " ".join(f"{n}={t:.0f}" for n, t in sorted(tflops.items(), key=lambda x: -x[1]))
        print(f"{row['shape']}: {line} | fmha/cudnn {tflops['fmha'] / tflops['cudnn']:.3f} "
              f"| diffs {({n: round(x, 4) for n, x in diffs.items()})} | {chosen.strip()}", flush=True)
        (out_dir / "bench_gluon_bwd.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "rows": rows}, indent=1))
        del graphs, grads
    for name in (n for n in contenders if n != "cudnn"):
        ratios = [r["tflops"][name] / r["tflops"]["cudnn"] for r in rows]
        print(f"geomean {name}/cudnn: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
