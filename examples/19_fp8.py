"""Example 19: FP8 attention (forward), with per-tensor, per-head and per-block descales.

    python examples/19_fp8.py

q, k and v are quantized to float8 e4m3 with `fmha.quantize_fp8` (amax scaling); each
comes with an fp32 descale, and the real values are x_fp8 * descale. The kernel folds the
q/k descales into the logit scale, rounds the probabilities to e4m3 for the P @ V
product and writes the output in bf16. On a CPU the same kernel runs through Triton's
interpreter (fmha patches its float8 conversions to be exact), at small sizes.

The check: the float64 reference on the *dequantized* inputs, with the error of rounding
P to e4m3 (2^-4 relative per probability) as the bound: |o - o_ref| <= 2^-4 (P |V|) +
the bf16 output rounding + a small absolute slack for the tiniest probabilities.
"""

import sys

import numpy as np
import torch

import fmha
from fmha import reference

from _common import done, header

header("19 fp8 attention")

device = "cuda" if torch.cuda.is_available() else "cpu"
B, Hq, Hk, S, D = (2, 4, 2, 40, 32) if device == "cpu" else (2, 8, 2, 1024, 128)
print(f"Example 19: fp8 attention on {device}, B={B} Hq={Hq} Hk={Hk} S={S} D={D}")
gen = torch.Generator().manual_seed(19)
q, k, v = (torch.randn(B, h, S, D, generator=gen).to(device) for h in (Hq, Hk, Hk))

failures = 0
for granularity in ("tensor", "head", "block"):
    block = 16 if device == "cpu" else 128
    (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, granularity, block)
                                    for t in (q, k, v))
    o, lse = fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                            descale_block_size=block if granularity == "block" else None,
                            return_lse=True)
    qf, kf, vf = (fmha.dequantize_fp8(x, d, block_size=block).double().cpu().numpy()
                  for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    o_ref, lse_ref = reference.attention_fwd(qf, kf, vf, causal=True)
    pv_abs, _ = reference.attention_fwd(qf, kf, np.abs(vf), causal=True)  # P |V|
    bound = 2.0**-4 * pv_abs + 2.0**-8 * np.abs(o_ref) + 1e-3 * np.abs(vf).max()
    err = np.abs(o.double().cpu().numpy() - o_ref)
    lse_err = float(np.abs(lse.double().cpu().numpy() - lse_ref).max())
    ok = bool((err <= bound).all()) and lse_err < 1e-2
    failures += not ok
    print(f"  {granularity:<6} descale {tuple(qd.shape)!s:<12} o: max error {err.max():.4f} "
          f"(worst error/bound {float((err / bound).max()):.2f}), lse: max error {lse_err:.1e}  "
          f"{'ok' if ok else 'FAILED'}")
print(fmha.explain(q8, k8, v8, causal=True).splitlines()[1])
if failures:
    sys.exit(f"{failures} fp8 checks failed")
done("fp8 forward matches the float64 reference within the e4m3 bound")
