import json, sys
import torch, triton
from fmha.bench_decode import DecodeShape, _inputs, _call
from fmha.kernels import plan_tables, loader
kg = loader.family_module("kvcache_gluon", interpreted=False)
rounds = 3
rows = []
for D, B, S, page in ((64, 32, 8192, 0), (64, 8, 32768, 0), (128, 32, 8192, 0), (128, 8, 32768, 64), (256, 32, 8192, 0), (256, 8, 32768, 64)):
    args, _ = _inputs(DecodeShape(B, 32, 8, S, D, "bf16", page, True), "cuda")
    fn = _call("fmha", args, None)
    outs, times = {}, {"old": [], "keys as rows": []}
    for r in range(rounds):
        for name in times:
            kg.KEYS_AS_ROWS = name != "old"
            plan_tables.clear_plans()
            if r == 0:
                outs[name] = fn().float()
            times[name].append(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
            plan_tables.clear_plans()
    diff = (outs["old"] - outs["keys as rows"]).abs().max().item()
    med = {k: sorted(v)[rounds // 2] * 1e3 for k, v in times.items()}
    print(f"D={D:3d} B={B:2d} S={S:5d} page={page:2d} old {med['old']:6.1f} us  keys-as-rows {med['keys as rows']:6.1f} us  "
          f"old/new {med['old'] / med['keys as rows']:.3f}  maxdiff {diff:.2e}", flush=True)
    rows.append(dict(D=D, B=B, S=S, page=page, times_ms=times, maxdiff=diff))
kg.KEYS_AS_ROWS = True
json.dump(rows, open(sys.argv[1], "w"), indent=1)
