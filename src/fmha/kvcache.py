"""Inference entry points: `attention_with_kvcache` and `merge_states`.

`attention_with_kvcache` follows FlashAttention's `flash_attn_with_kvcache`: new keys and
values (optionally rotated) are written into the cache in place at `cache_seqlens`, then
q (rotated at its positions) attends to the first `cache_seqlens[b] + Snew` keys of its
batch. The cache is contiguous (B_cache, S_cache, Hk, D) or paged
(num_pages, page_size, Hk, D) with a vLLM-style `block_table`. Nothing here reads a
device tensor on the host (unless debug mode checks values), so a decode step can be
captured in a CUDA graph. Keys may be split across programs (flash-decoding); partial
results are merged by the combine kernel, which also serves `merge_states`.
"""

from __future__ import annotations

import functools
import math

import torch

from . import validation as V
from .api import _algorithm_args, _arch_of, _device_guard, get_dispatcher
from .configs import Family
from .kernels.loader import family_module
from .problem import MaskAlign, Problem

Tensor = torch.Tensor


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _check_index(name: str, t, ndim: int, device) -> None:
    V.check_tensor(name, t, ndim)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={t.dtype} must be torch.int32")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def attention_with_kvcache(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, k: Tensor | None = None, v: Tensor | None = None,
    cache_seqlens: Tensor | int | None = None, block_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None, rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None, rotary_interleaved: bool = False, num_splits: int = 0,
    scale: float | None = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right", sink_size: int = 0, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, sinks: Tensor | None = None, return_lse: bool = False,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None,
):
    """Attention of q over a KV cache, appending k/v first (inference; no autograd).

    Args:
        q: (B, Sq, Hq, D). k_cache, v_cache: (B_cache, S_cache, Hk, D) or, with
            block_table, (num_pages, page_size, Hk, D); any page size >= 1. Modified in
            place when k/v are given.
        k, v: (B, Snew, Hk, D) new tokens, written at cache_seqlens[b] + t.
        cache_seqlens: int32 (B,) tokens already in each cache (or one int); None: full.
        block_table: int32 (B, max_pages) page ids. cache_batch_idx: int32 (B,) cache row
            of each batch (contiguous caches only).
        rotary_cos, rotary_sin: (max_pos, rotary_dim / 2); k and q are rotated at positions
            cache_seqlens[b] + t (interleaved pairs or NeoX halves).
        num_splits: 0 picks by a heuristic that fills the GPU; 1..128 forces it.
        Masks, soft-cap, ALiBi and sink logits as in `fmha.attention`; the bottom-right
        alignment puts the last query on the last key of each batch.
        k_descale, v_descale: float8 caches (e4m3fn / e5m2) with fp16/bf16/fp32 q: fp32,
            per tensor (0-d or (1,)) or per (batch, KV head) (B, Hk), indexed by q's batch;
            the cache holds x / descale (None: 1). Tiles are dequantized on load (exact)
            and the products run in q's dtype. New k/v (in q's dtype) are divided by the
            descale and rounded to the cache's format (after RoPE) as they are appended.
    Returns: o (B, Sq, Hq, Dv) in q's dtype, and lse (B, Hq, Sq) fp32 if return_lse.
    """
    V.check_tensor("q", q, 4)
    V.check_tensor("k_cache", k_cache, 4)
    V.check_tensor("v_cache", v_cache, 4)
    dtype = V.check_dtype("q", q)
    kv_fp8 = k_cache.dtype in V.FP8_DTYPES
    if kv_fp8:  # float8 cache, 16/32-bit queries
        V.check_same(("k_cache", "v_cache"), (k_cache, v_cache))
        if k_cache.device != q.device:
            raise ValueError(f"k_cache is on {k_cache.device} but q is on {q.device}; use one device")
    else:
        V.check_same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    left, right = V.check_scalars(scale=scale, softcap=softcap, window=window, sink_size=sink_size,
                                  dropout_p=0.0, causal=causal)
    align = V.check_mask_align(mask_align)
    batch, seqlen_q, nhead_q, head_dim = q.shape
    nhead_k = k_cache.shape[2]
    V.check_heads(nhead_q, nhead_k, v_cache.shape[2])
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[-1]} but q has {head_dim}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
                         f"agree in all but the last dimension")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        V.check_last_dim_contiguous(name, t)
    paged = block_table is not None
    if paged:
        _check_index("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows; accepted: batch={batch}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; a paged cache uses block_table")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, 1, q.device)
            if cache_batch_idx.numel() != batch:
                raise ValueError(f"cache_batch_idx has {cache_batch_idx.numel()} entries; accepted: {batch}")
        elif k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch} (pass "
                             f"cache_batch_idx to pick rows)")
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity if k is None else 0, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_index("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.numel() != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.numel()} entries; accepted: batch={batch}")
    n_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens for the cache)")
    if k is not None:
        V.check_tensor("k", k, 4)
        V.check_tensor("v", v, 4)
        V.check_same(("q", "k", "v"), (q, k, v))
        if k.shape[0] != batch or k.shape[2] != nhead_k or k.shape[3] != head_dim:
            raise ValueError(f"k has shape {tuple(k.shape)}; accepted: ({batch}, Snew, {nhead_k}, {head_dim})")
        if tuple(v.shape) != (*k.shape[:3], v_cache.shape[-1]):
            raise ValueError(f"v has shape {tuple(v.shape)}; accepted: {(*k.shape[:3], v_cache.shape[-1])}")
        n_new = k.shape[1]
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            V.check_tensor(name, t, 2)
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
                             f"{tuple(rotary_sin.shape)} must have one shape")
        if not 0 < 2 * rotary_cos.shape[1] <= head_dim:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[1]} columns: rotary_dim = "
                             f"{2 * rotary_cos.shape[1]} must be in [2, head_dim={head_dim}]")
        if k is None:
            raise ValueError("rotary_cos/rotary_sin rotate the new k and q: pass k and v")
    if not isinstance(num_splits, int) or not 0 <= num_splits <= 128:
        raise ValueError(f"num_splits={num_splits!r} must be an int in [0, 128] (0: heuristic)")
    V.check_alibi(alibi_slopes, batch, nhead_q, q.device)
    V.check_sinks(sinks, nhead_q, q.device, q.dtype)
    kd2, vd2 = _check_cache_descales(kv_fp8, k_cache, k_descale, v_descale, batch, nhead_k, q.device)
    if q.device.type == "cpu" or V.debug_enabled():
        _check_kvcache_values(cache_seqlens, n_new, capacity, block_table, k_cache.shape[0],
                              cache_batch_idx)

    problem = Problem(
        batch=batch, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=seqlen_q, seqlen_k=capacity,
        head_dim_qk=head_dim, head_dim_v=v_cache.shape[-1], dtype=dtype, layout="bshd",
        arch=_arch_of(q.device), causal=causal, window=(left, right), mask_align=align,
        sink_size=sink_size, alibi=alibi_slopes is not None, softcap=float(softcap),
        sinks=sinks is not None, seqused_k=True, paged_kv=paged,
    )
    dispatcher = get_dispatcher()
    attn_config, _ = dispatcher.select(problem, Family.FWD_SPLITKV)
    splits = num_splits or dispatcher.num_splits(problem, _sm_count(q.device),
                                                 attn_config.algorithm.block_m,
                                                 attn_config.algorithm.block_n)
    plan = dispatcher.plan_kvcache(problem, append=k is not None, num_splits=splits)
    kernels = family_module("kvcache", interpreted=q.device.type == "cpu")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    alibi2 = None if alibi_slopes is None else (alibi_slopes[None] if alibi_slopes.dim() == 1 else alibi_slopes)

    with _device_guard(q):
        if k is not None:
            append = _algorithm_args(plan.config(Family.APPEND_KV))
            cos_sin = dict(cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved) if rotary else {}
            if kv_fp8:  # the cache holds x / descale; rounded to float8 by the append
                k, v = k.float() / kd2[:, None, :, None], v.float() / vd2[:, None, :, None]
            kernels.launch_rotary_append(k, k_cache, base=cache_seqlens, block_table=block_table,
                                         cache_batch_idx=cache_batch_idx, dst_at_base=True,
                                         **cos_sin, **append)
            kernels.launch_rotary_append(v, v_cache, base=cache_seqlens, block_table=block_table,
                                         cache_batch_idx=cache_batch_idx, dst_at_base=True, **append)
            if rotary:
                q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
                kernels.launch_rotary_append(q, q_rot, base=cache_seqlens, dst_at_base=False,
                                             **cos_sin, **append)
                q = q_rot
        seqlens_k = cache_seqlens + n_new if n_new else cache_seqlens
        head_dim_v = v_cache.shape[-1]
        o = q.new_empty((batch, seqlen_q, nhead_q, head_dim_v))
        lse = torch.empty((batch, nhead_q, seqlen_q), dtype=torch.float32, device=q.device)
        attn = dict(seqlens_k=seqlens_k, block_table=block_table, cache_batch_idx=cache_batch_idx,
                    alibi_slopes=alibi2, sinks=sinks, scale=scale, softcap=float(softcap),
                    window=(left, right), sink_size=sink_size,
                    align_bottom_right=align == MaskAlign.BOTTOM_RIGHT,
                    **_algorithm_args(attn_config), dot_precision=attn_config.algorithm.dot_precision,
                    **(dict(k_descale=kd2, v_descale=vd2) if kv_fp8 else {}))
        if splits == 1:
            kernels.launch_attention(q, k_cache, v_cache, o, lse, num_splits=1, **attn)
        else:
            o_parts = torch.empty((splits, batch, nhead_q, seqlen_q, head_dim_v), dtype=torch.float32,
                                  device=q.device)
            lse_parts = torch.empty((splits, batch, nhead_q, seqlen_q), dtype=torch.float32, device=q.device)
            kernels.launch_attention(q, k_cache, v_cache, o_parts, lse_parts, num_splits=splits, **attn)
            kernels.launch_combine(o_parts.view(splits, -1, head_dim_v), lse_parts.view(splits, -1), o, lse,
                                   nheads=nhead_q, seqlen=seqlen_q, sinks=sinks,
                                   **_algorithm_args(plan.config(Family.SPLITKV_COMBINE)))
    return (o, lse) if return_lse else o


def _check_cache_descales(kv_fp8, k_cache, k_descale, v_descale, batch, nhead_k, device):
    """k/v descales of a float8 cache as fp32 (B or 1, Hk or 1) views; (None, None) otherwise."""
    given = {"k_descale": k_descale, "v_descale": v_descale}
    if not kv_fp8:
        names = [n for n, d in given.items() if d is not None]
        if names:
            raise ValueError(f"{', '.join(names)} given but k_cache.dtype={k_cache.dtype}; descales are for "
                             f"float8 caches (torch.float8_e4m3fn, torch.float8_e5m2)")
        return None, None
    views = []
    for name, d in given.items():
        if d is None:
            views.append(torch.ones((1, 1), dtype=torch.float32, device=device))
            continue
        if not isinstance(d, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name}.dtype={d.dtype} must be torch.float32")
        if d.device != device:
            raise ValueError(f"{name} is on {d.device} but q is on {device}")
        if d.numel() == 1 and d.dim() <= 1:
            views.append(d.reshape(1, 1))
        elif tuple(d.shape) == (batch, nhead_k):
            views.append(d)
        else:
            raise ValueError(f"{name} has shape {tuple(d.shape)}; accepted: () or (1,) per tensor, or "
                             f"({batch}, {nhead_k}) per (batch, KV head)")
        if (device.type == "cpu" or V.debug_enabled()) and not bool((torch.isfinite(d) & (d > 0)).all()):
            raise ValueError(f"{name} must be finite and > 0 everywhere")
    return views[0], views[1]


def _check_kvcache_values(cache_seqlens, n_new, capacity, block_table, n_rows, cache_batch_idx):
    """Host-side checks of index values (always for CPU tensors; CUDA in debug mode)."""
    for b, n in enumerate(cache_seqlens.tolist()):
        if not 0 <= n or n + n_new > capacity:
            raise ValueError(f"cache_seqlens[{b}]={n} plus {n_new} new tokens exceeds the cache "
                             f"capacity {capacity} (or is negative)")
    if block_table is not None:
        bad = (block_table < 0) | (block_table >= n_rows)
        used = [(-(-(n + n_new) // max(1, capacity // block_table.shape[1])))
                for n in cache_seqlens.tolist()]
        for b, pages in enumerate(used):
            if bad[b, :pages].any():
                j = int(bad[b, :pages].nonzero()[0])
                raise ValueError(f"block_table[{b}, {j}]={int(block_table[b, j])} is outside the page "
                                 f"pool [0, {n_rows})")
    if cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < n_rows:
                raise ValueError(f"cache_batch_idx[{b}]={row} is outside [0, {n_rows})")


def merge_states(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Combine partial attention results over disjoint key sets.

    outs: tensors (..., D) (any float dtype), lses: matching (...) natural-log LSEs.
    Returns (o in outs[0]'s dtype, lse fp32): lse = logsumexp_i lse_i,
    o = sum_i exp(lse_i - lse) o_i; all -inf gives o = 0, lse = -inf.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_states needs equally long non-empty lists; got {len(outs)} outs "
                         f"and {len(lses)} lses")
    shape = outs[0].shape
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(o, Tensor) or not isinstance(lse, Tensor):
            raise TypeError(f"outs[{i}] and lses[{i}] must be tensors")
        if o.shape != shape or lse.shape != shape[:-1]:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)} and lses[{i}] {tuple(lse.shape)}; "
                             f"accepted: {tuple(shape)} and {tuple(shape[:-1])}")
        if o.device != outs[0].device or lse.device != outs[0].device:
            raise ValueError(f"outs[{i}]/lses[{i}] are not on {outs[0].device}")
    rows = math.prod(shape[:-1])
    o_parts = torch.stack([o.reshape(rows, shape[-1]) for o in outs])
    lse_parts = torch.stack([lse.reshape(rows).float() for lse in lses])
    o = outs[0].new_empty((1, rows, 1, shape[-1]))
    lse = torch.empty((1, 1, rows), dtype=torch.float32, device=outs[0].device)
    problem = Problem(batch=1, nhead_q=1, nhead_k=1, seqlen_q=rows, seqlen_k=len(outs),
                      head_dim_qk=shape[-1], head_dim_v=shape[-1], dtype=V.check_dtype("outs[0]", outs[0]),
                      arch=_arch_of(outs[0].device))
    config, _ = get_dispatcher().select(problem, Family.SPLITKV_COMBINE)
    kernels = family_module("kvcache", interpreted=outs[0].device.type == "cpu")
    with _device_guard(outs[0]):
        kernels.launch_combine(o_parts, lse_parts, o, lse, nheads=1, seqlen=rows, **_algorithm_args(config))
    return o.reshape(shape), lse.reshape(shape[:-1])
