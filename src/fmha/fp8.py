"""FP8 attention inputs: quantize helpers and the descale conventions of `fmha.attention`.

A float8 tensor `x8` with descale `d` stands for the real values `x8.float() * d` (as in
FlashAttention 3: `q_descale`, `k_descale`, `v_descale`). A descale is fp32 and comes at
one of three granularities:

- per tensor: a 0-d or 1-element tensor;
- per (batch, head): shape (B, H). For k and v, H is the KV head count Hk; for q it may
  be Hk (FlashAttention 3's convention: the query heads of one KV head share it) or Hq;
- per block along the sequence: shape (B, H, ceil(S / block_size)), H as above, S the
  tensor's sequence length (the maximum one for varlen; blocks count positions inside each
  sequence). `block_size` cannot be told from the shape, so `attention` takes it as
  `descale_block_size` (one value for every 3-d descale of the call).

`quantize_fp8(x, dtype, granularity, block_size)` returns `(x8, descale)` in these shapes
(amax scaling: each group's largest |x| maps to the format's largest finite value), and
`dequantize_fp8` undoes it in float32, for references and tests.

Inside the kernel (see fmha.kernels.triton.fwd): the q and k descales fold into the logit scale;
the probabilities P in [0, 1] are multiplied by 256 (exactly: a power of two, done as
`exp2(s - m + 8)`, FlashAttention 3's offset) and rounded to e4m3 for the P @ V product
(e4m3 whatever the input format: 3 mantissa bits instead of e5m2's 2; the largest value
256 is below e4m3's 448); the factor 256 cancels against the row sum, which is accumulated
from the unrounded fp32 P (so LSE is as accurate as in 16-bit attention). The v descale
multiplies the output; a per-block v descale scales P's columns before the rounding.
"""

from __future__ import annotations

import math

import torch

from . import validation as V

Tensor = torch.Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES = ("tensor", "head", "block")
P_SCALE = 256.0  # P is rounded to e4m3 as P * P_SCALE
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_fp8(t) -> bool:
    return isinstance(t, Tensor) and t.dtype in FP8_DTYPES


def _seq_groups(x: Tensor, layout: str, cu_seqlens: Tensor | None):
    """x as a list over batches of (H, S, D) float32 views, and (B, H, S_max)."""
    if x.dim() == 3:
        if cu_seqlens is None:
            raise ValueError("a packed (total, H, D) tensor needs cu_seqlens for granularity "
                             "'head' or 'block'")
        bounds = cu_seqlens.tolist()
        parts = [x[bounds[b]:bounds[b + 1]].transpose(0, 1) for b in range(len(bounds) - 1)]
        return parts, max((p.shape[1] for p in parts), default=0)
    xb = x if layout == "bhsd" else x.transpose(1, 2)
    return list(xb), xb.shape[2]


def quantize_fp8(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity: str = "tensor",
                 block_size: int = 128, *, layout: str = "bhsd",
                 cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantize q, k or v to float8 with amax scaling; returns (x8, descale).

    Args:
        x: (B, H, S, D) for layout "bhsd", (B, S, H, D) for "bshd", or packed
            (total, H, D) with `cu_seqlens` int32 (B + 1,); fp16/bf16/fp32.
        dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        granularity: "tensor" -> descale shape (); "head" -> (B, H); "block" ->
            (B, H, ceil(S / block_size)), S the (maximum) sequence length.
        block_size: positions per block for granularity "block" (pass the same value to
            `attention(..., descale_block_size=...)`).
    Returns: x8 with x's shape and strides order, and the fp32 descale: x ~ x8 * descale.
    A group that is all zeros gets descale 1.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x must be a float16/bfloat16/float32 tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; accepted: {list(FP8_DTYPES)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not supported; accepted: {list(GRANULARITIES)}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    if x.dim() not in (3, 4):
        raise ValueError(f"x must be 4-d (B, H, S, D) / (B, S, H, D) or packed 3-d (total, H, D), "
                         f"got shape {tuple(x.shape)}")
    V.check_layout(layout)
    fmax = torch.finfo(dtype).max
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        return (xf / descale).clamp(-fmax, fmax).to(dtype), descale.float()
    parts, s_max = _seq_groups(xf, layout, cu_seqlens)
    batch, nhead = len(parts), x.shape[-2] if x.dim() == 3 else (x.shape[1] if layout == "bhsd" else x.shape[2])
    nblk = 1 if granularity == "head" else max(1, math.ceil(s_max / block_size))
    descale = torch.ones((batch, nhead, nblk), dtype=torch.float32, device=x.device)
    x8 = torch.empty_like(x, dtype=dtype)
    out_parts, _ = _seq_groups(x8, layout, cu_seqlens)
    for b, (part, out) in enumerate(zip(parts, out_parts, strict=True)):  # part: (H, S, D)
        seqlen = part.shape[1]
        size = seqlen if granularity == "head" else block_size
        for j in range(0, max(1, -(-seqlen // size))):
            chunk = part[:, j * size:(j + 1) * size]
            amax = chunk.abs().amax(dim=(1, 2)) if chunk.numel() else chunk.new_zeros(nhead)
            d = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
            descale[b, :, j] = d
            out[:, j * size:(j + 1) * size] = (chunk / d[:, None, None]).clamp(-fmax, fmax).to(dtype)
    return x8, (descale[:, :, 0] if granularity == "head" else descale)


def dequantize_fp8(x8: Tensor, descale: Tensor | None, *, layout: str = "bhsd",
                   block_size: int | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
    """float32 values of x8 * descale, for any descale shape `attention` accepts.

    A (B, H) or (B, H, blocks) descale whose H divides x's head count is repeated over
    consecutive heads (q with a per-KV-head descale under GQA).
    """
    x = x8.float()
    if descale is None:
        return x
    d = descale.float()
    if d.numel() == 1:
        return x * d.reshape(())
    parts, _ = _seq_groups(x, layout, cu_seqlens)
    nhead = parts[0].shape[0] if parts else d.shape[1]
    d = d.repeat_interleave(nhead // d.shape[1], dim=1)
    out = torch.empty_like(x)
    out_parts, _ = _seq_groups(out, layout, cu_seqlens)
    for b, (part, o) in enumerate(zip(parts, out_parts, strict=True)):
        if d.dim() == 2:
            o.copy_(part * d[b][:, None, None])
        else:
            idx = torch.arange(part.shape[1], device=x.device) // block_size
            o.copy_(part * d[b][:, idx][:, :, None])
    return out


def check_descales(q: Tensor, descales: dict, *, batch: int, nhead_q: int, nhead_k: int,
                   seqlen_q: int, seqlen_k: int, block_size, varlen: bool) -> dict:
    """Validate q/k/v_descale for float8 inputs; returns fp32 3-d kernel views (or None).

    Views are (B or 1, H or 1, blocks) with zero strides where they broadcast.
    """
    any_block = any(isinstance(d, Tensor) and d.dim() == 3 for d in descales.values())
    if block_size is not None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"descale_block_size={block_size!r} must be an int >= 1")
        if not any_block:
            raise ValueError(f"descale_block_size={block_size} is given but no descale is per block "
                             f"(3-d); drop it or pass (B, Hk, blocks) descales")
    elif any_block:
        raise ValueError("a per-block descale (3-d, (B, H, blocks)) needs descale_block_size: the number "
                         "of sequence positions each block covers (as given to quantize_fp8)")
    views = {}
    for name, d in descales.items():
        if d is None:
            views[name] = None
            continue
        if not isinstance(d, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name}.dtype={d.dtype} must be torch.float32")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device} but q is on {q.device}")
        heads = (nhead_k, nhead_q) if name == "q_descale" else (nhead_k,)
        seqlen = seqlen_q if name == "q_descale" else seqlen_k
        what = "max_seqlen" if varlen else "seqlen"
        nblk = -(-seqlen // block_size) if block_size else None
        accepted = (f"() or (1,) per tensor, ({batch}, {' or '.join(map(str, sorted(set(heads))))}) per "
                    f"(batch, head), or ({batch}, H, ceil({what} / descale_block_size)"
                    + (f" = {nblk})" if nblk is not None else ")") + " per block")
        if not ((d.numel() == 1 and d.dim() <= 1)
                or (d.dim() == 2 and d.shape[0] == batch and d.shape[1] in heads)
                or (d.dim() == 3 and d.shape[0] == batch and d.shape[1] in heads and d.shape[2] == max(1, nblk))):
            raise ValueError(f"{name} has shape {tuple(d.shape)}; accepted: {accepted}")
        views[name] = descale_view(d)
        check_descale_values(name, d)
    return views


def descale_view(d: Tensor | None) -> Tensor | None:
    """The kernel view (B or 1, H or 1, blocks) of a descale `check_descales` accepted: a per-tensor
    one with zero strides, a per-(batch, head) one with one block."""
    if d is None or d.dim() == 3:
        return d
    if d.dim() == 2:
        return d.unsqueeze(2)  # (not d[:, :, None]: indexing costs twice as much host time)
    return d.as_strided((1, 1, 1), (0, 0, 0))


def check_descale_values(name: str, d: Tensor | None) -> None:
    """A descale's values are finite and > 0: checked where reading them costs no GPU
    synchronization (CPU tensors), or in debug mode."""
    if d is not None and (d.device.type == "cpu" or V.debug_enabled()):
        if d.numel() and not bool(torch.isfinite(d).all() and (d > 0).all()):
            raise ValueError(f"{name} must be finite and > 0 everywhere; got min "
                             f"{float(d.min())}, max {float(d.max())}")


__all__ = ["quantize_fp8", "dequantize_fp8", "FP8_DTYPES", "P_SCALE", "is_fp8"]
