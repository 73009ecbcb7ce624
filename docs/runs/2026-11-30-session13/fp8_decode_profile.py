"""fp8-cache decode: timing of bf16/fp16 queries over e4m3/e5m2 caches (--time), or a few calls for ncu."""
import sys
import torch, triton
import fmha
B, Hq, Hk, S, D = 32, 32, 8, 8192, 128
torch.manual_seed(0)
seqlens = torch.full((B,), S, dtype=torch.int32, device="cuda")
kc, vc = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
def case(qdt, kvdt):
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=qdt)
    k8, v8 = kc.to(kvdt), vc.to(kvdt)
    return lambda: fmha.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens)
if "--time" in sys.argv:
    qb = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    runs = {"bf16 q, bf16 cache": lambda: fmha.attention_with_kvcache(qb, kc, vc, cache_seqlens=seqlens)}
    for qdt in (torch.bfloat16, torch.float16):
        for kvdt in (torch.float8_e4m3fn, torch.float8_e5m2):
            runs[f"{str(qdt)[6:]} q, {str(kvdt)[6:]} cache"] = case(qdt, kvdt)
    times = {}
    for _ in range(3):
        for n, f in runs.items():
            times.setdefault(n, []).append(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"))
    ref = sorted(times["bf16 q, bf16 cache"])[1]
    for n, t in times.items():
        ms = sorted(t)[1]
        print(f"{n:<28} {ms*1e3:7.1f} us  x{ref/ms:.2f} vs bf16 cache")
else:
    f = case(torch.bfloat16, torch.float8_e4m3fn)
    for _ in range(4):
        f()
    torch.cuda.synchronize()
