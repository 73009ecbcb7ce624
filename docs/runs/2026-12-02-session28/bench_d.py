"""Gluon fp8 decode at D=64/128/256 against the Triton kernel and cuDNN (bf16 cache), GPU time (graph)."""
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
def registry_without(pred, name, extra=()):
    return fmha.Dispatcher(fmha.Registry(list(extra) + [c for c in reg if not pred(c)], name=name))
gl_cfg = lambda c: c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon
triton_only = registry_without(gl_cfg, "triton decode")
d64 = next(c for c in reg if gl_cfg(c) and c.signature.head_dims == (64,))
bn32 = dataclasses.replace(d64, algorithm=dataclasses.replace(d64.algorithm, block_n=32))
d64_bn32 = registry_without(lambda c: c is d64, "d64 bn32", [bn32])
d256 = next(c for c in reg if gl_cfg(c) and c.signature.head_dims == (256,))
s4 = dataclasses.replace(d256, algorithm=dataclasses.replace(d256.algorithm, num_stages=4))
d256_s4 = registry_without(lambda c: c is d256, "d256 s4", [s4])
rows = []
for D in (64, 128, 256):
    for B, S in ((32, 8192), (8, 32768)):
        for page in (0, 64):
            shape8 = DecodeShape(B, 32, 8, S, D, "bf16", page, True)
            args8, sdpa = _inputs(shape8, "cuda")
            shape16 = DecodeShape(B, 32, 8, S, D, "bf16", page, False)
            args16, _ = _inputs(shape16, "cuda")
            cont = {"cudnn": (_call("cudnn", args8, sdpa), None), "fmha bf16": (_call("fmha", args16, None), None),
                    "fp8 gluon": (_call("fmha", args8, None), None), "fp8 triton": (_call("fmha", args8, None), triton_only)}
            if D == 64:
                cont["fp8 gluon n32"] = (_call("fmha", args8, None), d64_bn32)
            if D == 256:
                cont["fp8 gluon s4"] = (_call("fmha", args8, None), d256_s4)
            if page:
                del cont["cudnn"]
            ref = cont["fmha bf16"][0]().float()
            times = {k: [] for k in cont}
            for r in range(rounds):
                for name, (fn, disp) in cont.items():
                    plan_tables.clear_plans()
                    with use_dispatcher(disp) if disp is not None else contextlib.nullcontext():
                        if r == 0:
                            chosen = fmha.explain_kvcache(**args8).splitlines()[1] if name.startswith("fp8") else ""
                            o = fn().float()
                            err = (o - ref).abs().max().item()
                            print(f"  D={D} B={B} S={S} page={page} {name}: {chosen.strip()[:90]} maxdiff {err:.3g}", flush=True)
                        times[name].append(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
                    plan_tables.clear_plans()
            med = {k: sorted(v)[rounds // 2] for k, v in times.items()}
            base = med.get("cudnn", med["fmha bf16"])
            line = f"D={D:3d} B={B:2d} S={S:5d} page={page:2d} " + "  ".join(
                f"{k} {v*1e3:6.1f}us ({base / v:.3f})" for k, v in med.items())
            print(line, flush=True)
            rows.append(dict(D=D, B=B, S=S, page=page, times_ms=times, median_ms=med))
if out:
    json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=rounds, rows=rows), open(out, "w"), indent=1)
