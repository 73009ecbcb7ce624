"""Helpers shared by the examples: device, random inputs, checks against the float64 truth.

Every check follows fmha.testing.numerics: the error of fmha's result against the float64 truth
may be at most twice the error of the same math done plainly in PyTorch at the inputs'
dtype, plus a small slack. A failed check raises, so a failing example exits non-zero.
"""

from __future__ import annotations

import numpy as np
import torch

import fmha
from fmha import reference
from fmha.testing import numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def sizes(cpu, gpu):
    """`cpu` when the kernels run through Triton's interpreter, `gpu` on a CUDA device."""
    return gpu if ON_GPU else cpu


def randn(*shape, dtype=torch.float16, gen=None, device=DEVICE, scale=1.0):
    """Random normal values drawn in fp32 on the host (reproducible), then cast and moved."""
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def qkv(b, hq, hk, sq, sk, d, dv=None, *, dtype=torch.float16, layout="bhsd", gen=None, grad=False):
    """q (B, Hq, Sq, D), k (B, Hk, Sk, D), v (B, Hk, Sk, Dv) in `layout` ("bhsd" or "bshd")."""
    dv = dv or d

    def make(h, s, dim):
        shape = (b, h, s, dim) if layout == "bhsd" else (b, s, h, dim)
        return randn(*shape, dtype=dtype, gen=gen).requires_grad_(grad)

    return make(hq, sq, d), make(hk, sk, d), make(hk, sk, dv)


def bhsd(t, layout):
    return t if layout == "bhsd" else t.transpose(1, 2)


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def check(name, out, truth, baseline, dtype):
    """numerics.compare, printed; raises AssertionError when the bound is exceeded."""
    c = numerics.compare(name, out.detach(), torch.as_tensor(truth), baseline.detach(), dtype)
    print(f"    {c}")
    if not c.ok:
        raise AssertionError(str(c))
    return c


_TRUTH_KEYS = ("scale", "causal", "window", "mask_align", "sink_size", "softcap", "dropout_p",
               "bias", "alibi_slopes", "sinks")


def truth_and_baseline(q, k, v, *, layout="bhsd", dropout_mask=None, **kw):
    """(truth o, truth lse, baseline o, baseline lse), all bhsd.

    Truth: fmha.reference (numpy float64) on the CPU, numerics.torch_attention in float64
    on a GPU (same math, faster at large sizes). Baseline: torch_attention at q's dtype.
    """
    kw = {key: value for key, value in kw.items() if key in _TRUTH_KEYS}
    qb, kb, vb = (bhsd(t, layout).detach() for t in (q, k, v))
    tensors = {key: kw.pop(key) for key in ("bias", "alibi_slopes", "sinks") if key in kw}
    tensors = {key: t.detach() for key, t in tensors.items() if t is not None}
    if ON_GPU:
        o, lse = numerics.torch_attention(qb, kb, vb, compute_dtype=torch.float64,
                                          dropout_mask=dropout_mask, **kw, **tensors)
    else:
        o, lse = reference.attention_fwd(_np(qb), _np(kb), _np(vb), **kw,
                                         **{key: _np(t) for key, t in tensors.items()},
                                         dropout_mask=None if dropout_mask is None else dropout_mask.cpu().numpy())
        o, lse = torch.from_numpy(np.asarray(o)), torch.from_numpy(np.asarray(lse))
    base_o, base_lse = numerics.torch_attention(qb, kb, vb, dropout_mask=dropout_mask, **kw, **tensors)
    return o, lse, base_o, base_lse


def run_checked(title, q, k, v, *, layout="bhsd", **kw):
    """fmha.attention(q, k, v, **kw), o and lse checked against the float64 truth.

    Returns (o, lse) in fmha's layouts. With dropout, the keep mask fmha drew is given
    to the truth, so the check is exact in distribution and in value.
    """
    print(f"  {title}")
    dropout = kw.get("dropout_p", 0.0) > 0
    o, lse, *mask = fmha.attention(q, k, v, layout=layout, return_lse=True, return_dropout_mask=dropout, **kw)
    truth_o, truth_lse, base_o, base_lse = truth_and_baseline(q, k, v, layout=layout,
                                                              dropout_mask=mask[0] if mask else None, **kw)
    check("o", bhsd(o, layout), truth_o, base_o, q.dtype)
    check("lse", lse, truth_lse, base_lse, torch.float32)
    return o, lse


def grads_checked(title, q, k, v, *, layout="bhsd", with_dlse=False, **kw):
    """Backward of fmha.attention checked against torch autograd in float64.

    Differentiates q, k, v and, when given, bias and sinks. The baseline is autograd
    through numerics.torch_attention at the inputs' dtype. Returns fmha's gradients.
    """
    print(f"  {title}")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    extra = {key: kw.pop(key).detach().requires_grad_() for key in ("bias", "sinks") if kw.get(key) is not None}
    dropout = kw.get("dropout_p", 0.0) > 0
    o, lse, *mask = fmha.attention(q, k, v, layout=layout, return_lse=True, return_dropout_mask=dropout,
                                   **extra, **kw)
    gen = torch.Generator().manual_seed(1234)
    do = randn(*o.shape, dtype=o.dtype, gen=gen)
    dlse = randn(*lse.shape, dtype=torch.float32, gen=gen) if with_dlse else None
    leaves = [q, k, v, *extra.values()]
    names = ["dq", "dk", "dv", *("d" + key for key in extra)]
    ours = torch.autograd.grad((o, lse) if with_dlse else (o,), leaves, (do, dlse) if with_dlse else (do,))

    def torch_grads(compute_dtype):
        xs = [bhsd(t, layout).detach().to(compute_dtype if i < 3 else t.dtype) for i, t in enumerate(leaves)]
        if compute_dtype == torch.float64:
            xs = [t.double() for t in xs]
        xs = [t.requires_grad_() for t in xs]
        named = dict(zip(extra, xs[3:], strict=True))
        other = {key: value for key, value in kw.items() if key in _TRUTH_KEYS}
        to, tlse = numerics.torch_attention(*xs[:3], compute_dtype=compute_dtype,
                                            dropout_mask=mask[0] if mask else None, **named, **other)
        outs = (to, tlse) if with_dlse else (to,)
        gos = (bhsd(do, layout).to(to.dtype), dlse.to(tlse.dtype)) if with_dlse else (bhsd(do, layout).to(to.dtype),)
        gs = list(torch.autograd.grad(outs, xs, gos))
        gs[:3] = [bhsd(g, layout) for g in gs[:3]]
        return gs

    truth, base = torch_grads(torch.float64), torch_grads(q.dtype)
    for name, g, t, b in zip(names, ours, truth, base, strict=True):
        check(name, g, t, b, q.dtype)
    return dict(zip(names, ours, strict=True))


def header(title):
    print("=" * 72)
    print(f"{title}  (device: {DEVICE}{'' if ON_GPU else ', kernels through the Triton interpreter'})")
    print("=" * 72)


def done(title="all checks passed"):
    print(f"OK: {title}")


_KV_REF_KEYS = ("block_table", "cache_batch_idx", "rotary_cos", "rotary_sin", "rotary_interleaved", "scale",
                "causal", "window", "mask_align", "sink_size", "alibi_slopes", "softcap", "sinks")


def kvcache_checked(title, q, k_cache, v_cache, *, k=None, v=None, cache_seqlens, **kw):
    """fmha.attention_with_kvcache on copies of the caches, checked against
    fmha.reference.attention_with_kvcache (float64): o, lse and the updated caches.

    The baseline of the 2x rule is plain torch attention at q's dtype, batch entry by
    batch entry, over the keys the reference says are visible (q rotated like fmha's).
    Returns (o, lse, k_cache, v_cache) of fmha.
    """
    print(f"  {title}")
    kc, vc = k_cache.clone(), v_cache.clone()
    o, lse = fmha.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=cache_seqlens, return_lse=True, **kw)
    as_np = {key: (_np(value) if key not in ("block_table", "cache_batch_idx") else value.cpu().numpy())
             if isinstance(value, torch.Tensor) else value for key, value in kw.items() if key in _KV_REF_KEYS}
    lens = cache_seqlens.cpu().numpy() if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
    ro, rl, rk, rv = reference.attention_with_kvcache(_np(q), _np(k_cache), _np(v_cache), k=_np(k), v=_np(v),
                                                      cache_seqlens=lens, **as_np)
    # Baseline: per batch entry, torch at q's dtype over the keys that are visible.
    batch, seqlen_q = q.shape[:2]
    seen = np.broadcast_to(np.asarray(lens), (batch,)) + (0 if k is None else k.shape[1])
    if kw.get("block_table") is not None:
        keys = reference.paged_gather(rk, as_np["block_table"], seen)
        values = reference.paged_gather(rv, as_np["block_table"], seen)
    else:
        rows = as_np.get("cache_batch_idx")
        rows = np.arange(batch) if rows is None else rows
        keys = [rk[rows[b], :seen[b]] for b in range(batch)]
        values = [rv[rows[b], :seen[b]] for b in range(batch)]
    qr = _np(q)
    if kw.get("rotary_cos") is not None:
        pos = np.asarray(seen - (k.shape[1]))[:, None] + np.arange(seqlen_q)[None]
        qr = reference.apply_rotary(qr, as_np["rotary_cos"], as_np["rotary_sin"], positions=pos,
                                    interleaved=kw.get("rotary_interleaved", False))
    opts = {key: kw[key] for key in ("scale", "causal", "window", "mask_align", "sink_size", "softcap") if key in kw}
    base_o, base_lse = [], []
    for b in range(batch):
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(q.dtype).to(q.device).transpose(0, 1)[None]
        alibi = kw.get("alibi_slopes")
        if alibi is not None and alibi.dim() == 2:
            alibi = alibi[b]
        bo, bl = numerics.torch_attention(to(qr[b]), to(keys[b]), to(values[b]), alibi_slopes=alibi,
                                          sinks=kw.get("sinks"), **opts)
        base_o.append(bo[0].transpose(0, 1))
        base_lse.append(bl[0])
    check("o", o, torch.from_numpy(ro), torch.stack(base_o), q.dtype)
    check("lse", lse, torch.from_numpy(rl), torch.stack(base_lse), torch.float32)
    for name, ours, ref in (("k_cache", kc, rk), ("v_cache", vc, rv)):
        err = numerics.max_abs_error(ours, torch.from_numpy(ref))
        # New tokens are stored in the cache's dtype (rotated in fp32 first): one rounding.
        rotated = name == "k_cache" and k is not None and kw.get("rotary_cos") is not None
        tol = 2 * float(torch.finfo(q.dtype).eps) * max(1.0, float(np.abs(ref).max())) if rotated else 0.0
        print(f"    {name}: max error {err:.3e} (allowed {tol:.1e})")
        if err > tol:
            raise AssertionError(f"{name} after the append differs from the reference by {err}")
    return o, lse, kc, vc
