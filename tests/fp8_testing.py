"""Helpers for fp8 tests: quantized inputs and the error bound of the fp8 forward.

The truth is the float64 reference (fmha.reference) applied to the *dequantized* inputs
x8 * descale, so quantizing q/k/v costs nothing in the comparison: what is left is the
kernel's own error, bounded element by element as follows (P = reference probabilities,
normalised with the sink, after dropout; Pmax = max_j P_ij over visible j):

- P rounded to e4m3 as 256 * P (fmha.fp8): an e4m3 number is within 2^-4 relative of
  its source when normal (3 mantissa bits, round to nearest even), within 2^-10 absolute
  when subnormal (< 2^-6). In units of the kernel's unnormalised p_j = P_j / Pmax that is
  max(2^-4 p_j, 2^-18) per key, so |o - o_ref| <= sum_j max(2^-4 P_ij, 2^-18 Pmax_i) |v_j|
  (a per-block v descale divides P's column by up to spread = max/min descale of the
  row's blocks: the 2^-18 term grows by that factor);
- logits: exact fp8 products, fp32 sums (CPU: ~2^-20 relative); Hopper's fp8 MMA adds
  products with about 14 bits (aligned to the largest product of each group of 32), so
  on the GPU |ds| <= 2^-13 * scale * D * max|q_i| * max|k| and P's relative error grows by
  2 |ds|; the P @ V MMA's own truncation adds 2^-7 to the relative coefficient;
- the output's rounding: 2^-8 |o| (bf16), 2^-11 (fp16), 2^-24 (fp32); plus 1e-6 absolute.

LSE comes from the unrounded fp32 P: |lse - lse_ref| <= 1e-5 (1 + |lse|) + |ds|.
"""

from __future__ import annotations

import numpy as np
import torch

import fmha
from fmha import reference
from fmha.fp8 import dequantize_fp8, quantize_fp8

OUT_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def quantized(x, dtype, granularity, block_size=16, layout="bhsd", cu_seqlens=None):
    """(x8, descale, dequantized float64 numpy in bhsd or packed layout)."""
    x8, d = quantize_fp8(x, dtype, granularity, block_size, layout=layout, cu_seqlens=cu_seqlens)
    deq = dequantize_fp8(x8, d, layout=layout, block_size=block_size, cu_seqlens=cu_seqlens)
    if x.dim() == 4 and layout == "bshd":
        deq = deq.transpose(1, 2)
    return x8, d, deq.double().cpu().numpy()


def spread(descale) -> float:
    """Largest ratio of v descales within one (batch, head): 1 unless per block."""
    if descale is None or descale.dim() < 3:
        return 1.0
    d = descale.double()
    return float((d.amax(-1) / d.amin(-1)).max())


def bound(q, k, v, *, out_dtype, gpu: bool, v_spread: float = 1.0, dropout_mask=None, **kw):
    """(o_ref, lse_ref, o_tol, lse_tol) for dequantized float64 bhsd numpy q, k, v."""
    f = reference._forward_core(q, k, v, scale=kw.get("scale"), causal=kw.get("causal", False),
                                window=kw.get("window", (-1, -1)),
                                mask_align=kw.get("mask_align", "bottom_right"),
                                sink_size=kw.get("sink_size", 0), bias=kw.get("bias"),
                                alibi_slopes=kw.get("alibi_slopes"), softcap=kw.get("softcap", 0.0),
                                sinks=kw.get("sinks"), dropout_p=kw.get("dropout_p", 0.0),
                                dropout_mask=dropout_mask)
    p, valid, vabs = f["p"], f["valid"], np.abs(f["v_rep"])
    drop = f["drop"] if f["drop"] is not None else 1.0
    pmax = np.max(np.where(valid, p, 0.0), axis=-1, keepdims=True)
    ds = np.zeros(p.shape[:-1])
    if gpu:
        qmax = np.abs(f["q"]).max(-1)  # (B, Hq, Sq)
        kmax = np.abs(f["k_rep"]).max(axis=(-1, -2))[..., None]  # (B, Hq, 1)
        ds = 2.0**-13 * f["scale"] * f["q"].shape[-1] * qmax * kmax
    coef = 2.0**-4 + (2.0**-7 if gpu else 0.0) + 2 * ds[..., None]
    terms = np.maximum(coef * p, 2.0**-18 * v_spread * pmax * valid) * drop
    o_tol = terms @ vabs + OUT_UNIT[out_dtype] * np.abs(f["o"]) + 1e-6
    lse = f["lse"]
    lse_tol = 1e-5 * (1 + np.abs(np.where(np.isfinite(lse), lse, 0.0))) + ds
    return f["o"], lse, o_tol, lse_tol


def check_close(name, got, ref, tol):
    got = got.double().cpu().numpy() if isinstance(got, torch.Tensor) else got
    same_inf = np.isinf(ref) & (got == ref)
    err = np.where(same_inf, 0.0, np.abs(got - ref))
    assert not np.isnan(got).any(), f"{name}: NaN"
    ratio = err / tol
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert ratio[worst] <= 1.0, (f"{name}: error {err[worst]:.3g} exceeds the fp8 bound {tol[worst]:.3g} "
                                 f"at {worst} (got {got[worst]:.6g}, ref {ref[worst]:.6g}); "
                                 f"max error/bound = {ratio.max():.3f}")
    return float(ratio.max())


def run_and_check(q, k, v, *, dtype=torch.float8_e4m3fn, granularity="tensor", block_size=16,
                  layout="bhsd", out_dtype=torch.bfloat16, gpu=False, **kw):
    """Quantize q/k/v, run fmha.attention in fp8, check o and lse against the bound.

    Returns the largest error/bound ratio of o."""
    q8, qd, qf = quantized(q, dtype, granularity, block_size, layout)
    k8, kd, kf = quantized(k, dtype, granularity, block_size, layout)
    v8, vd, vf = quantized(v, dtype, granularity, block_size, layout)
    want_mask = kw.get("dropout_p", 0) > 0
    res = fmha.attention(q8, k8, v8, layout=layout, q_descale=qd, k_descale=kd, v_descale=vd,
                         descale_block_size=block_size if granularity == "block" else None,
                         out_dtype=out_dtype, return_lse=True, return_dropout_mask=want_mask, **kw)
    o, lse = res[0], res[1]
    assert o.dtype == out_dtype and lse.dtype == torch.float32
    ref_kw = {key: (val.double().cpu().numpy() if isinstance(val, torch.Tensor) else val)
              for key, val in kw.items() if key not in ("seed", "offset")}
    mask = res[2].cpu().numpy() if want_mask else None
    o_ref, lse_ref, o_tol, lse_tol = bound(qf, kf, vf, out_dtype=out_dtype, gpu=gpu, v_spread=spread(vd),
                                           dropout_mask=mask, **ref_kw)
    ob = o if layout == "bhsd" else o.transpose(1, 2)
    ratio = check_close("o", ob, o_ref, o_tol)
    check_close("lse", lse, lse_ref, lse_tol)
    return ratio
