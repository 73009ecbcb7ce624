"""D=64 forward: the registry's launch (recorded from fmha.attention) replayed with num_stages 2/3/4
(and block_n 64 s4/s5 persistent), alternating with cuDNN; medians over rounds."""
import json, math, statistics, sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import fmha
from fmha.kernels import fwd_gluon as G
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
rec = {}
orig = G.launch
def recorder(*a, **kw):
    rec["a"], rec["kw"] = a, kw
    return orig(*a, **kw)
G.launch = recorder
SHAPES = [(16, 16, 16, 1024), (4, 16, 16, 4096), (2, 16, 16, 8192), (1, 16, 16, 16384), (4, 32, 8, 8192)]
VARIANTS = {"s3": dict(num_stages=3), "s2": dict(num_stages=2), "s4": dict(num_stages=4),
            "n64s4": dict(block_n=64, num_stages=4), "n64s6": dict(block_n=64, num_stages=6)}
rows = []
for b, hq, hk, s in SHAPES:
    for causal in (False, True):
        for dt in (torch.bfloat16,):
            torch.manual_seed(0)
            q = torch.randn(b, hq, s, 64, device="cuda", dtype=dt)
            k = torch.randn(b, hk, s, 64, device="cuda", dtype=dt)
            v = torch.randn(b, hk, s, 64, device="cuda", dtype=dt)
            rec.clear(); ref = fmha.attention(q, k, v, causal=causal); torch.cuda.synchronize()
            a, kw = rec["a"], dict(rec["kw"])
            calls = {}
            for name, over in VARIANTS.items():
                kw2 = dict(kw, **over)
                try:
                    orig(*a, **kw2); torch.cuda.synchronize()
                    err = (a[3].float() - ref.transpose(1, 2).float() if a[3].shape != ref.shape else a[3].float() - ref.float()).abs().max().item()
                    calls[name] = (lambda kw2=kw2: orig(*a, **kw2))
                    print(name, "maxdiff vs api", err, flush=True)
                except Exception as e:
                    print(name, "failed", type(e).__name__, str(e)[:200], flush=True)
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
            rows.append(dict(b=b, hq=hq, hk=hk, s=s, causal=causal, tflops=tf, launch={k2: v2 for k2, v2 in kw.items()}))
            print(f"B={b} Hq={hq} Hk={hk} S={s} {'causal' if causal else 'full'} persistent={kw.get('persistent')}: " +
                  " ".join(f"{n} {t:.0f} ({t / tf['cudnn']:.3f})" for n, t in tf.items()), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
for n in VARIANTS:
    r = [x["tflops"][n] / x["tflops"]["s3"] for x in rows if n in x["tflops"]]
    if r:
        print(n, "geomean over s3", round(math.exp(sum(map(math.log, r)) / len(r)), 4), len(r))
