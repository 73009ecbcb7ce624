import contextlib, cProfile, pstats, sys, time, io
import torch, triton
import fmha
from fmha.api import use_dispatcher
from fmha.configs import Family
from fmha.kernels import plan_tables
from fmha.bench_decode import DecodeShape, _inputs, _call
from fmha.bench import host_ms_per_call
reg = fmha.default_registry()
triton_only = fmha.Dispatcher(fmha.Registry([c for c in reg if not (c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon)], name="t"))
for D in (128, 64):
    for fp8, disp, name in ((False, None, "bf16"), (True, None, "fp8 gluon"), (True, triton_only, "fp8 triton")):
        args, _ = _inputs(DecodeShape(32, 32, 8, 8192, D, "bf16", 0, fp8), "cuda")
        fn = _call("fmha", args, None)
        plan_tables.clear_plans()
        with use_dispatcher(disp) if disp else contextlib.nullcontext():
            for _ in range(5): fn()
            torch.cuda.synchronize()
            h = [host_ms_per_call(fn, c) * 1e3 for c in (10, 10, 50, 200)]
            gpu = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
            eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            print(f"D={D} {name:10s} host us (10,10,50,200 calls) {[round(x,1) for x in h]}  graph {gpu:.1f}  eager {eager:.1f}", flush=True)
            if D == 128 and name != "fp8 triton":
                pr = cProfile.Profile(); torch.cuda.synchronize(); pr.enable()
                for _ in range(50): fn()
                pr.disable(); torch.cuda.synchronize()
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-3500:])
