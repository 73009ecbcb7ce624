"""FlashAttention 2's Python interface on fmha's kernels, so code written for it runs.

    from fmha.compat.flash_attn import flash_attn_func   # instead of `from flash_attn import ...`

Tensors are (batch, seqlen, nheads, headdim) as in flash_attn; masks align bottom-right;
`softmax_lse` is (batch, nheads, seqlen), or (nheads, total_q) for the varlen functions.
Where flash_attn returns `S_dmask` (return_attn_probs=True, for testing) this returns the
boolean dropout keep mask when dropout_p > 0, else None: fmha never materialises P.
"""

from __future__ import annotations

import torch

from .. import api, kvcache
from .. import validation as V

Tensor = torch.Tensor


def _window(window_size, causal: bool) -> tuple[int, int]:
    # flash_attn sets the right edge to 0 under causal=True whatever window_size says.
    left, right = window_size
    return (left, 0) if causal else (left, right)


def _finish(result, return_attn_probs: bool, dropout_p: float):
    if not return_attn_probs:
        return result[0]
    out, lse = result[0], result[1]
    return out, lse, (result[2] if dropout_p > 0 else None)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> out (B, Sq, Hq, Dv) [, lse (B, Hq, Sq), S_dmask]."""
    result = api.attention(q, k, v, layout="bshd", scale=softmax_scale, causal=causal,
                           window=_window(window_size, causal), softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, deterministic=deterministic, return_lse=True,
                           return_dropout_mask=return_attn_probs and dropout_p > 0)
    return _finish(result, return_attn_probs, dropout_p)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                              deterministic: bool = False, return_attn_probs: bool = False):
    """qkv (B, S, 3, H, D): q, k and v are strided views, not copies."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                             deterministic: bool = False, return_attn_probs: bool = False):
    """q (B, Sq, Hq, D), kv (B, Sk, 2, Hk, D)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None):
    """Packed q (total_q, Hq, D), k/v (total_k, Hk, D) -> out (total_q, Hq, Dv) [, lse (Hq, total_q)].

    With block_table (B, max_pages), k and v are paged caches (num_pages, page_size, Hk, D)
    and sequence b attends to its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cached keys
    (batch prefill through `fmha.attention_with_kvcache`; forward only, no dropout)."""
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                             block_table)
    result = api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  scale=softmax_scale, causal=causal, window=_window(window_size, causal),
                                  softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  deterministic=deterministic, return_lse=True,
                                  return_dropout_mask=return_attn_probs and dropout_p > 0)
    return _finish(result, return_attn_probs, dropout_p)


def _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table):
    if dropout_p != 0.0:
        raise NotImplementedError(f"flash_attn_varlen_func(block_table=..., dropout_p={dropout_p}): the paged "
                                  f"(KV cache) path is inference only; dropout_p must be 0")
    if k_cache.dim() != 4:
        raise ValueError(f"with block_table, k is a paged cache (num_pages, page_size, Hk, D); got shape "
                         f"{tuple(k_cache.shape)}")
    _check_cu_seqlens_k(cu_seqlens_k, cu_seqlens_q, q.device)
    V.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    cache_seqlens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    o, lse = kvcache.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, scale=softmax_scale, causal=causal, window=_window(window_size, causal),
        softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)
    return (o, lse, None) if return_attn_probs else o


def _check_cu_seqlens_k(cu_seqlens_k, cu_seqlens_q, device) -> None:
    """cu_seqlens_k of the paged path: prefix sums of the cached lengths (their total is
    not tied to k, which is the page pool)."""
    V.check_tensor("cu_seqlens_k", cu_seqlens_k, 1)
    if cu_seqlens_k.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_k.dtype={cu_seqlens_k.dtype} must be torch.int32")
    if cu_seqlens_k.device != device:
        raise ValueError(f"cu_seqlens_k is on {cu_seqlens_k.device} but q is on {device}")
    if isinstance(cu_seqlens_q, Tensor) and cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries; accepted: "
                         f"{cu_seqlens_q.numel()} (as cu_seqlens_q, batch + 1)")
    if device.type == "cpu" or V.debug_enabled():
        values = cu_seqlens_k.tolist()
        if not values or values[0] != 0 or any(b < a for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"cu_seqlens_k={values} must start at 0 and never decrease")


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: Tensor | int | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True,
                            alibi_slopes: Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """flash_attn_with_kvcache: appends k/v (rotated) in place, then attends. Note flash_attn's
    default rotary_interleaved=True, kept here. q is rotated at cache_seqlens[b] + t."""
    if cache_leftpad is not None:
        raise NotImplementedError("flash_attn_with_kvcache(cache_leftpad=...) is not implemented")
    return kvcache.attention_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
        cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits, scale=softmax_scale, causal=causal,
        window=_window(window_size, causal), softcap=softcap, alibi_slopes=alibi_slopes,
        return_lse=return_softmax_lse)
