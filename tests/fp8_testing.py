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

import math

import numpy as np
import torch

import fmha
from fmha import reference
from fmha.fp8 import dequantize_fp8, quantize_fp8

OUT_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def quantized(x, dtype, granularity, block_size=16, layout="bhsd", cu_seqlens=None):
    """(x8, descale, dequantized float64 tensor in bhsd or packed layout, on x's device)."""
    x8, d = quantize_fp8(x, dtype, granularity, block_size, layout=layout, cu_seqlens=cu_seqlens)
    deq = dequantize_fp8(x8, d, layout=layout, block_size=block_size, cu_seqlens=cu_seqlens)
    if x.dim() == 4 and layout == "bshd":
        deq = deq.transpose(1, 2)
    return x8, d, deq.double()


def stored_as(v, view: str):
    """v (B, H, S, D) with the same values stored as `view`: "bhsd" (as it is), "bshd" (rows of all
    heads together), or "column_major" (S the unit-stride dimension)."""
    if view == "bshd":
        return v.transpose(1, 2).contiguous().transpose(1, 2)
    if view == "column_major":
        return v.transpose(2, 3).contiguous().transpose(2, 3)
    return v


def spread(descale) -> float:
    """Largest ratio of v descales within one (batch, head): 1 unless per block."""
    if descale is None or descale.dim() < 3:
        return 1.0
    d = descale.double()
    return float((d.amax(-1) / d.amin(-1)).max())


def probabilities(q, k, v, *, scale=None, causal=False, window=(-1, -1), mask_align="bottom_right",
                  sink_size=0, bias=None, alibi_slopes=None, softcap=0.0, sinks=None, dropout_p=0.0,
                  dropout_mask=None):
    """float64 torch forward on the inputs' device (bhsd): dict of p (normalised with the
    sink, before dropout), valid, drop factor (or None), v_rep, q, k_rep, scale, o, lse.
    Checked against fmha.reference by tests/test_fp8.py."""
    f64 = torch.float64
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    batch, nhead_q, seqlen_q, head_dim = q.shape
    seqlen_k, group = k.shape[2], nhead_q // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(f64)
    if alibi_slopes is not None:
        off = seqlen_k - seqlen_q if mask_align == "bottom_right" else 0
        rows = torch.arange(seqlen_q, device=q.device, dtype=f64)[:, None]
        cols = torch.arange(seqlen_k, device=q.device, dtype=f64)[None, :]
        s = s - alibi_slopes.to(f64).reshape(-1, nhead_q, 1, 1) * (rows + off - cols).abs()
    vis = torch.as_tensor(reference.visible_mask(seqlen_q, seqlen_k, causal=causal, window=tuple(window),
                                                 mask_align=mask_align, sink_size=sink_size), device=q.device)
    valid = vis & (s > -math.inf)
    s = s.masked_fill(~valid, -math.inf)
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(f64).reshape(1, nhead_q, 1, 1))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.to(f64).reshape(1, nhead_q, 1, 1) - m)
    lse = torch.where(denom > 0, m + torch.log(denom.clamp_min(1e-300)), -math.inf)[..., 0]
    p = e / torch.where(denom > 0, denom, 1.0)
    drop = None
    if dropout_mask is not None:
        drop = dropout_mask.to(q.device).to(f64) / (1.0 - dropout_p)
    o = (p * drop if drop is not None else p) @ v
    return dict(p=p, valid=valid, drop=drop, v_rep=v, q=q, k_rep=k, scale=scale, o=o, lse=lse)


def bound(q, k, v, *, out_dtype, gpu: bool, v_spread: float = 1.0, dropout_mask=None, **kw):
    """(o_ref, lse_ref, o_tol, lse_tol) as float64 tensors for dequantized bhsd q, k, v."""
    f = probabilities(q, k, v, dropout_mask=dropout_mask, **kw)
    p, valid, vabs = f["p"], f["valid"], f["v_rep"].abs()
    drop = f["drop"] if f["drop"] is not None else 1.0
    pmax = torch.where(valid, p, 0.0).amax(-1, keepdim=True)
    ds = torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)
    if gpu:
        qmax = f["q"].abs().amax(-1)  # (B, Hq, Sq)
        kmax = f["k_rep"].abs().amax(dim=(-1, -2))[..., None]  # (B, Hq, 1)
        ds = 2.0**-13 * abs(f["scale"]) * f["q"].shape[-1] * qmax * kmax  # |scale|: it may be < 0
    coef = 2.0**-4 + (2.0**-7 if gpu else 0.0) + 2 * ds[..., None]
    terms = torch.maximum(coef * p, 2.0**-18 * v_spread * pmax * valid) * drop
    o_tol = terms @ vabs + OUT_UNIT[out_dtype] * f["o"].abs() + 1e-6
    lse = f["lse"]
    lse_tol = 1e-5 * (1 + torch.where(torch.isfinite(lse), lse, 0.0).abs()) + ds
    return f["o"], lse, o_tol, lse_tol


def check_close(name, got, ref, tol):
    got, ref, tol = (np.asarray(t.double().cpu().numpy() if isinstance(t, torch.Tensor) else t)
                     for t in (got, ref, tol))
    same_inf = np.isinf(ref) & (got == ref)
    with np.errstate(invalid="ignore"):  # inf - inf where both are -inf (an empty row's LSE): masked next
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
    ref_kw = {key: val for key, val in kw.items() if key not in ("seed", "offset")}
    mask = res[2] if want_mask else None
    o_ref, lse_ref, o_tol, lse_tol = bound(qf, kf, vf, out_dtype=out_dtype, gpu=gpu, v_spread=spread(vd),
                                           dropout_mask=mask, **ref_kw)
    ob = o if layout == "bhsd" else o.transpose(1, 2)
    ratio = check_close("o", ob, o_ref, o_tol)
    check_close("lse", lse, lse_ref, lse_tol)
    return ratio


def run_and_check_varlen(q, k, v, seqs_q, seqs_k, *, block_size, dtype=torch.float8_e4m3fn,
                         out_dtype=torch.float32, gpu=False, causal=True):
    """Packed q, k quantized per block of `block_size` positions of each sequence, v per
    head; fmha.attention_varlen in fp8; o and lse of each sequence checked against the bound."""
    cu_q = torch.tensor(np.cumsum([0] + list(seqs_q)), dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(np.cumsum([0] + list(seqs_k)), dtype=torch.int32, device=q.device)
    q8, qd = quantize_fp8(q, dtype, "block", block_size, cu_seqlens=cu_q)
    k8, kd = quantize_fp8(k, dtype, "block", block_size, cu_seqlens=cu_k)
    v8, vd = quantize_fp8(v, dtype, "head", cu_seqlens=cu_k)
    o, lse = fmha.attention_varlen(q8, k8, v8, cu_q, cu_k, max(seqs_q), max(seqs_k), causal=causal,
                                   q_descale=qd, k_descale=kd, v_descale=vd, descale_block_size=block_size,
                                   return_lse=True, out_dtype=out_dtype)
    qf = dequantize_fp8(q8, qd, block_size=block_size, cu_seqlens=cu_q).double()
    kf = dequantize_fp8(k8, kd, block_size=block_size, cu_seqlens=cu_k).double()
    vf = dequantize_fp8(v8, vd, cu_seqlens=cu_k).double()
    for b in range(len(seqs_q)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o_ref, lse_ref, o_tol, lse_tol = bound(qf[sq].transpose(0, 1)[None], kf[sk].transpose(0, 1)[None],
                                               vf[sk].transpose(0, 1)[None], out_dtype=out_dtype, gpu=gpu,
                                               causal=causal)
        check_close(f"o[{b}]", o[sq].transpose(0, 1)[None], o_ref, o_tol)
        check_close(f"lse[{b}]", lse[:, sq][None], lse_ref, lse_tol)
