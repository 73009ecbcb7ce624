"""Confirm: the persistent D=64 forward at 2 stages against 3 (the launch fmha.attention makes, stages
varied), bf16 and fp16, alternating with cuDNN, 5 rounds; persistent rows only."""
import json, math, statistics, sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import fmha
from fmha.kernels import fwd_gluon as G
rounds = int(sys.argv[2])
rec = {}
orig = G.launch
def recorder(*a, **kw):
    rec["a"], rec["kw"] = a, kw
    return orig(*a, **kw)
G.launch = recorder
rows = []
for dt in (torch.bfloat16, torch.float16):
    for b, hq, hk, s, causal in [(16, 16, 16, 1024, False), (16, 16, 16, 1024, True), (4, 16, 16, 4096, False),
                                 (4, 16, 16, 4096, True), (2, 16, 16, 8192, True), (1, 16, 16, 16384, True),
                                 (4, 32, 8, 8192, True)]:
        torch.manual_seed(1)
        q = torch.randn(b, hq, s, 64, device="cuda", dtype=dt)
        k = torch.randn(b, hk, s, 64, device="cuda", dtype=dt)
        v = torch.randn(b, hk, s, 64, device="cuda", dtype=dt)
        rec.clear(); fmha.attention(q, k, v, causal=causal); torch.cuda.synchronize()
        a, kw = rec["a"], dict(rec["kw"])
        assert kw["persistent"] and kw["num_stages"] == 2, kw
        calls = {f"s{st}": (lambda st=st: orig(*a, **dict(kw, num_stages=st))) for st in (2, 3)}
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)
        calls["cudnn"] = cud
        times = {n: [] for n in calls}
        for r in range(rounds):
            names = list(calls); names = names[r % len(names):] + names[:r % len(names)]
            for n in names:
                times[n].append(triton.testing.do_bench(calls[n], warmup=25, rep=100))
        flops = 4 * b * hq * s * s * 64 / (2 if causal else 1)
        tf = {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}
        rows.append(dict(dtype=str(dt), b=b, hq=hq, hk=hk, s=s, causal=causal, tflops=tf))
        print(f"{dt} B={b} Hq={hq} Hk={hk} S={s} {'causal' if causal else 'full'}: " +
              " ".join(f"{n} {t:.0f} ({t / tf['cudnn']:.3f})" for n, t in tf.items()) + f" | s2/s3 {tf['s2'] / tf['s3']:.3f}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
r = [x["tflops"]["s2"] / x["tflops"]["s3"] for x in rows]
print("s2/s3 geomean", round(math.exp(sum(map(math.log, r)) / len(r)), 4), "min", round(min(r), 3), "max", round(max(r), 3))
