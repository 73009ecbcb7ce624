"""One fp8 (e4m3, per-head descales) forward at B=4 H=16 S=8192 D=128, three times, for ncu."""

import torch

import fmha

q, k, v = (torch.randn(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
(q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, k, v))
for _ in range(3):
    fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
torch.cuda.synchronize()
