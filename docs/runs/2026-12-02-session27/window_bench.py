import torch, triton, fmha
B, Hq, Hk, D, S = 8, 32, 8, 128, 32768
kc, vc = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
L = torch.full((B,), S, dtype=torch.int32, device="cuda")
for splits in (0, 1, 4):
    f = lambda: fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=L, window=(4095, 0), num_splits=splits)
    t = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
    print(f"bf16 B=8 32k window 4096 num_splits={splits}: {t*1e3:.1f} us")
