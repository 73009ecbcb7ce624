"""Helpers for kernel tests: random inputs and the FlashAttention-style check."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.utils._python_dispatch

import fmha
from fmha import reference
from fmha.testing import numerics


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


def check_backward(q, k, v, *, layout="bhsd", truth="numpy", with_dlse=False, **kw):
    """fmha gradients (dq, dk, dv, dbias, dsinks) against the float64 truth (2x rule).

    The baseline is torch autograd through `numerics.torch_attention` at the inputs'
    dtype. Bias/sinks in kw get requires_grad here. Returns fmha's gradients.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bias, sinks = kw.pop("bias", None), kw.pop("sinks", None)
    bias = None if bias is None else bias.detach().requires_grad_()
    sinks = None if sinks is None else sinks.detach().requires_grad_()
    want_mask = kw.get("dropout_p", 0) > 0
    result = fmha.attention(q, k, v, layout=layout, return_lse=True, bias=bias, sinks=sinks,
                            return_dropout_mask=want_mask, **kw)
    o, lse = result[0], result[1]
    mask = result[2] if want_mask else None
    do = torch.randn(o.shape, dtype=torch.float32, device="cpu").to(o.dtype).to(o.device)
    dlse = torch.randn(lse.shape, dtype=torch.float32).to(lse.device) if with_dlse else None
    outputs = (o, lse) if with_dlse else (o,)
    grads_out = (do, dlse) if with_dlse else (do,)
    inputs = [t for t in (q, k, v, bias, sinks) if t is not None]
    ours = torch.autograd.grad(outputs, inputs, grads_out)
    names = ["dq", "dk", "dv"] + (["dbias"] if bias is not None else []) + (["dsinks"] if sinks is not None else [])
    ours = dict(zip(names, ours, strict=True))

    qb, kb, vb, dob = (bhsd(t, layout) for t in (q, k, v, do))
    extra = {key: kw[key] for key in REF_KEYS if key in kw}
    alibi = kw.get("alibi_slopes")
    # Baseline: the same math in torch at the inputs' dtype, through torch autograd.
    grads = functools.partial(torch_attention_grads, qb, kb, vb, dob, dlse if with_dlse else None, bias, sinks,
                              alibi, mask, extra)
    base = dict(zip(names, grads(None), strict=True))
    base["dq"], base["dk"], base["dv"] = (bhsd(base[n], layout) for n in ("dq", "dk", "dv"))

    if truth == "numpy":
        ref = reference.attention_bwd(
            to_np(qb), to_np(kb), to_np(vb), to_np(dob), dlse=to_np(dlse),
            bias=to_np(bias), sinks=to_np(sinks), alibi_slopes=to_np(alibi),
            dropout_mask=None if mask is None else mask.cpu().numpy(), **extra)
        ref = {n: torch.from_numpy(np.asarray(ref[n])) for n in names}
        ref["dq"], ref["dk"], ref["dv"] = (bhsd(ref[n], layout) for n in ("dq", "dk", "dv"))
    else:
        ref = dict(zip(names, grads(torch.float64), strict=True))
        ref["dq"], ref["dk"], ref["dv"] = (bhsd(ref[n], layout) for n in ("dq", "dk", "dv"))
    for n in names:
        assert ours[n].shape == ref[n].shape, (n, ours[n].shape, ref[n].shape)
        assert not torch.isnan(ours[n]).any(), f"NaN in {n}"
        c = numerics.compare(n, ours[n], ref[n], base[n], q.dtype)
        assert c.ok, str(c)
    return ours


def torch_attention_grads(qb, kb, vb, dob, dlse, bias, sinks, alibi, mask, extra, dtype):
    """Gradients (dq, dk, dv[, dbias][, dsinks]) of `numerics.torch_attention` (bhsd) by torch
    autograd, in `dtype` (float64: the truth; None: the inputs' dtype, the 2x rule's baseline),
    one batch element at a time: the (Hq, Sq, Sk) intermediates of one element, not of all B
    (B=16 S=1024 in float64 held ~25 GB at once, which parallel GPU test runs ran out of).
    The elements are independent; a bias or sinks shared by the batch sums its gradients."""
    def cast(t):
        t = t.detach()
        return (t.to(dtype) if dtype is not None else t).requires_grad_()

    def element(t, b, batch_dim=4):  # t[b:b+1] where t has a batch dimension of extent > 1
        return t[b:b + 1] if t is not None and t.dim() == batch_dim and t.shape[0] > 1 else t

    batch = qb.shape[0]
    parts = []
    for b in range(batch):
        leaves = [cast(t[b:b + 1]) for t in (qb, kb, vb)]
        r_bias = None if bias is None else cast(element(bias, b))
        r_sinks = None if sinks is None else cast(sinks)
        o, lse = numerics.torch_attention(*leaves, compute_dtype=dtype, bias=r_bias, sinks=r_sinks,
                                          alibi_slopes=element(alibi, b, 2), dropout_mask=element(mask, b), **extra)
        outs, grads_out = [o], [dob[b:b + 1].to(o.dtype)]
        if dlse is not None:
            outs.append(lse)
            grads_out.append(dlse[b:b + 1].to(lse.dtype))
        inputs = leaves + [t for t in (r_bias, r_sinks) if t is not None]
        parts.append(torch.autograd.grad(outs, inputs, grads_out))
    result = [torch.cat([p[i] for p in parts]) for i in range(3)]
    i = 3
    if bias is not None:
        per_element = bias.dim() == 4 and bias.shape[0] > 1
        result.append(torch.cat([p[i] for p in parts]) if per_element else sum(p[i] for p in parts))
        i += 1
    if sinks is not None:
        result.append(sum(p[i] for p in parts))
    return result


class SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees (which ops a call runs)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
