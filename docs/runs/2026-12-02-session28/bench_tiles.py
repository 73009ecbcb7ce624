"""D=64 Gluon fp8 decode variants (tile, stages, programs an SM), GPU time (graph)."""
import contextlib, dataclasses, json, sys
import torch, triton
import fmha
from fmha.api import use_dispatcher
from fmha.configs import Family
from fmha.kernels import plan_tables
from fmha.bench_decode import DecodeShape, _inputs, _call

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
out = sys.argv[2] if len(sys.argv) > 2 else None
reg = fmha.default_registry()
gl_cfg = lambda c: c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon
def variant(d, **alg):
    base = next(c for c in reg if gl_cfg(c) and c.signature.head_dims == (d,))
    new = dataclasses.replace(base, algorithm=dataclasses.replace(base.algorithm, **alg))
    return fmha.Dispatcher(fmha.Registry([new] + [c for c in reg if c is not base], name=str(alg)))
variants = {64: {"n32 s3 p4": None, "n32 s3 p8": variant(64, programs_per_sm=8), "n32 s4 p4": variant(64, num_stages=4),
                 "n32 s2 p4": variant(64, num_stages=2), "n64 s3 p4": variant(64, block_n=64), "n32 s3 p2": variant(64, programs_per_sm=2)},
            256: {"n16 s3 p4": None, "n16 s3 p8": variant(256, programs_per_sm=8), "n16 s3 p2": variant(256, programs_per_sm=2),
                  "n16 s2 p4": variant(256, num_stages=2)},
            128: {"n32 s3 p4": None, "n32 s3 p8": variant(128, programs_per_sm=8)}}
rows = []
for D, conts in variants.items():
    for B, S in ((32, 8192), (8, 32768), (128, 2048)):
        for page in (0, 64):
            shape8 = DecodeShape(B, 32, 8, S, D, "bf16", page, True)
            args8, sdpa = _inputs(shape8, "cuda")
            cont = {name: (_call("fmha", args8, None), disp) for name, disp in conts.items()}
            ref = None
            times = {k: [] for k in cont}
            for r in range(rounds):
                for name, (fn, disp) in cont.items():
                    plan_tables.clear_plans()
                    with use_dispatcher(disp) if disp is not None else contextlib.nullcontext():
                        if r == 0:
                            o = fn().float()
                            ref = o if ref is None else ref
                            assert (o - ref).abs().max().item() < 1e-2, name
                        times[name].append(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
                    plan_tables.clear_plans()
            med = {k: sorted(v)[rounds // 2] for k, v in times.items()}
            base = next(iter(med.values()))
            print(f"D={D:3d} B={B:3d} S={S:5d} page={page:2d} " + "  ".join(
                f"{k} {v*1e3:6.1f}us ({base / v:.3f})" for k, v in med.items()), flush=True)
            rows.append(dict(D=D, B=B, S=S, page=page, times_ms=times, median_ms=med))
if out:
    json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=rounds, rows=rows), open(out, "w"), indent=1)
