"""Helpers for kernel tests: random inputs and the FlashAttention-style check."""

from __future__ import annotations

import numpy as np
import torch

import fmha
from fmha import numerics, reference


def randn(shape, dtype, rng, device="cpu", scale=1.0):
    x = torch.randn(shape, generator=rng, dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def make_qkv(rng, *, batch, nhead_q, nhead_k, seqlen_q, seqlen_k, head_dim, head_dim_v=None,
             dtype=torch.float16, layout="bhsd", device="cpu"):
    head_dim_v = head_dim_v or head_dim

    def shape(h, s, d):
        return (batch, h, s, d) if layout == "bhsd" else (batch, s, h, d)

    q = randn(shape(nhead_q, seqlen_q, head_dim), dtype, rng, device)
    k = randn(shape(nhead_k, seqlen_k, head_dim), dtype, rng, device)
    v = randn(shape(nhead_k, seqlen_k, head_dim_v), dtype, rng, device)
    return q, k, v


def bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(1, 2)


def to_np(x):
    return None if x is None else x.detach().double().cpu().numpy()


REF_KEYS = ("scale", "causal", "window", "mask_align", "sink_size", "softcap", "dropout_p")


def check_attention(q, k, v, *, layout="bhsd", truth="numpy", **kw):
    """Run fmha.attention and check o and lse against the float64 truth (2x rule).

    truth="numpy": fmha.reference; truth="torch64": numerics.torch_attention in float64 on
    the inputs' device (for large GPU problems). Returns (o, lse).
    """
    want_mask = kw.get("dropout_p", 0) > 0
    result = fmha.attention(q, k, v, layout=layout, return_lse=True,
                            return_dropout_mask=want_mask, **kw)
    o, lse = result[0], result[1]
    mask = result[2] if want_mask else None
    qb, kb, vb = (bhsd(t, layout) for t in (q, k, v))
    ob = bhsd(o, layout)
    assert not torch.isnan(ob).any(), "NaN in output"
    extra = {key: kw[key] for key in REF_KEYS if key in kw}
    tensors = {key: kw.get(key) for key in ("bias", "alibi_slopes", "sinks")}
    if truth == "numpy":
        ref_o, ref_lse = reference.attention_fwd(
            to_np(qb), to_np(kb), to_np(vb), dropout_mask=None if mask is None else mask.cpu().numpy(),
            **extra, **{key: to_np(t) for key, t in tensors.items() if t is not None})
        ref_o, ref_lse = torch.from_numpy(np.asarray(ref_o)), torch.from_numpy(np.asarray(ref_lse))
    else:
        ref_o, ref_lse = numerics.torch_attention(qb, kb, vb, compute_dtype=torch.float64,
                                                  dropout_mask=mask, **extra, **tensors)
    base_o, base_lse = numerics.torch_attention(qb, kb, vb, dropout_mask=mask, **extra, **tensors)
    for c in (numerics.compare("o", ob, ref_o, base_o, q.dtype),
              numerics.compare("lse", lse, ref_lse, base_lse, torch.float32)):
        assert c.ok, str(c)
    return o, lse
