"""Inference entry points: `attention_with_kvcache` and `merge_states`.

`attention_with_kvcache` follows FlashAttention's `flash_attn_with_kvcache`: new keys and
values (optionally rotated) are written into the cache in place at `cache_seqlens`, then
q (rotated at its positions) attends to the first `cache_seqlens[b] + Snew` keys of its
batch. The cache is contiguous (B_cache, S_cache, Hk, D) or paged
(num_pages, page_size, Hk, D), addressed by a vLLM-style `block_table` or by
FlashInfer/SGLang page tables (`kv_indptr`, `kv_indices`, `kv_last_page_len`). Queries
are (B, Sq, Hq, D), or packed varlen (total_q, Hq, D) with `cu_seqlens_q` (batch prefill:
chunked prefill and decode sequences in one call). Nothing here reads a device tensor on
the host (unless debug mode checks values), so a step can be captured in a CUDA graph.
Keys may be split across programs (flash-decoding); partial results are merged by the
combine kernel, which also serves `merge_states`.

Host cost per call (a decode step's kernels take a few hundred microseconds, so Python on
the way to them matters, tools/host_overhead.py): the dispatcher's answer (configs, split
count) is cached per problem; the FlashInfer/SGLang tables go to the kernel as they are
(it computes each sequence's key count), so they cost no device ops of their own. A plain
decode call repeated with inputs of the same metadata takes its call plan
(`_DecodeCallPlan`): it allocates the outputs and relaunches the launchers' own plans.
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from dataclasses import dataclass

import torch

from . import validation as V
from .dispatch.configs import Family
from .dispatch.dispatcher import Dispatcher, split_keys
from .dispatch.state import get_dispatcher, on_dispatcher_change
from .kernels.gluon.common import tma_aligned
from .kernels.launch.args import unit_descale
from .kernels.launch.loader import family_module
from .kernels.launch.plan_tables import keep_plan, plan_table
from .ops.attention import plain_eager
from .ops.prepare import algorithm_args, arch_of, device_guard, tensor_meta
from .problem import MaskAlign, Problem

Tensor = torch.Tensor


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=16)
def _arch(device: torch.device) -> str:
    return arch_of(device)


def _reads_values(device: torch.device) -> bool:
    """Whether index values are checked on the host: always for CPU tensors, for CUDA tensors
    only in debug mode (a read waits for the GPU and cannot be captured in a CUDA graph)."""
    return device.type == "cpu" or V.debug_enabled()


def _check_index(name: str, t, ndim: int, device) -> None:
    V.check_tensor(name, t, ndim)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={t.dtype} must be torch.int32")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


@dataclass(frozen=True)
class _Queries:
    """q's shape: (B, Sq, Hq, D), or packed (total_q, Hq, D) with cu_seqlens_q."""

    batch: int
    seqlen_q: int  # max_seqlen_q for varlen
    nhead_q: int
    head_dim: int
    cu_seqlens_q: Tensor | None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def new_tokens(self, k: Tensor | None) -> Tensor | int:
        """Keys appended per sequence: 0 without k, Snew, or each sequence's query count
        (varlen: one new token per query)."""
        if k is None:
            return 0
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1] if self.varlen else k.shape[1]


def _check_queries(q, cu_seqlens_q, max_seqlen_q) -> _Queries:
    if cu_seqlens_q is None:
        if max_seqlen_q is not None:
            raise ValueError(f"max_seqlen_q={max_seqlen_q!r} is for packed (varlen) queries; pass "
                             f"cu_seqlens_q with it, or neither")
        V.check_tensor("q", q, 4)
        batch, seqlen_q, nhead_q, head_dim = q.shape
        return _Queries(batch, seqlen_q, nhead_q, head_dim, None)
    if not isinstance(q, Tensor) or q.dim() != 3:
        shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q has shape {shape}; with cu_seqlens_q, q must be packed (total_q, Hq, D)")
    V.check_tensor("q", q, 3)
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    if max_seqlen_q is None:
        raise ValueError("cu_seqlens_q needs max_seqlen_q (int, the longest query sequence), as in "
                         "flash_attn_varlen_func")
    V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    return _Queries(cu_seqlens_q.numel() - 1, max_seqlen_q, q.shape[1], q.shape[2], cu_seqlens_q)


@dataclass(frozen=True)
class _CacheIndex:
    """Where each sequence's keys are, and how many there are (device tensors)."""

    base: Tensor | None  # int32 (B,): tokens before this call's append (new tokens go at
    # base + t); None with indptr tables and nothing to append (no launch reads it)
    seqlens_k: Tensor | None  # int32 (B,): keys attended to, base + new tokens; None with
    # indptr tables: the attention kernel computes them from kv_indptr and last_page_len
    table: Tensor | None  # block_table (B, max_pages), or kv_indices with indptr
    indptr: Tensor | None  # kv_indptr (B + 1,)
    last_page_len: Tensor | None  # kv_last_page_len (B,) with indptr
    cache_batch_idx: Tensor | None
    seqlen_k: int  # for kernel choice: the capacity, or the mean length for indptr tables


def _no_new(n_new: Tensor | int) -> bool:
    return isinstance(n_new, int) and n_new == 0


def _cache_index(qs: _Queries, k_cache, n_new, *, cache_seqlens, block_table, cache_batch_idx,
                 kv_indptr, kv_indices, kv_last_page_len) -> _CacheIndex:
    """Validate one of the two page-table forms (or a contiguous cache) and resolve the
    per-sequence key counts on the device (no host synchronisation)."""
    batch, device = qs.batch, k_cache.device
    tables = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len)
    if any(t is not None for t in tables.values()):
        missing = [name for name, t in tables.items() if t is None]
        if missing:
            raise ValueError(f"kv_indptr, kv_indices and kv_last_page_len come together (FlashInfer/"
                             f"SGLang page tables); missing: {', '.join(missing)}")
        given = [name for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens),
                                      ("cache_batch_idx", cache_batch_idx)) if t is not None]
        if given:
            raise ValueError(f"pass either block_table + cache_seqlens or kv_indptr + kv_indices + "
                             f"kv_last_page_len (which give the lengths), not both; also got "
                             f"{', '.join(given)}")
        _check_index("kv_indptr", kv_indptr, 1, device)
        _check_index("kv_indices", kv_indices, 1, device)
        _check_index("kv_last_page_len", kv_last_page_len, 1, device)
        if kv_indptr.numel() != batch + 1:
            raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries; accepted: batch + 1 = {batch + 1}")
        if kv_last_page_len.numel() != batch:
            raise ValueError(f"kv_last_page_len has {kv_last_page_len.numel()} entries; accepted: batch={batch}")
        page_size = k_cache.shape[1]
        if _reads_values(device):
            _check_indptr_values(kv_indptr, kv_indices, kv_last_page_len, n_new, page_size, k_cache.shape[0])
        base = None
        if not _no_new(n_new):  # the append kernel needs the positions: L - Snew (device ops)
            pages = kv_indptr[1:] - kv_indptr[:-1]
            lengths = torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len, 0)
            base = (lengths - n_new).to(torch.int32)
        mean_pages = -(-kv_indices.numel() // max(batch, 1))
        return _CacheIndex(base, None, kv_indices, kv_indptr, kv_last_page_len, None,
                           max(1, mean_pages * page_size))
    if block_table is not None:
        _check_index("block_table", block_table, 2, device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows; accepted: batch={batch}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; a paged cache uses block_table")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, 1, device)
            if cache_batch_idx.numel() != batch:
                raise ValueError(f"cache_batch_idx has {cache_batch_idx.numel()} entries; accepted: {batch}")
        elif k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch} (pass "
                             f"cache_batch_idx to pick rows)")
    if cache_seqlens is None:
        full = capacity if _no_new(n_new) else 0
        cache_seqlens = torch.full((batch,), full, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    _check_index("cache_seqlens", cache_seqlens, 1, device)
    if cache_seqlens.numel() != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.numel()} entries; accepted: batch={batch}")
    if _reads_values(device):
        _check_kvcache_values(cache_seqlens, n_new, capacity, block_table, k_cache.shape[0], cache_batch_idx)
    seqlens_k = cache_seqlens if _no_new(n_new) else (cache_seqlens + n_new).to(torch.int32)
    return _CacheIndex(cache_seqlens, seqlens_k, block_table, None, None, cache_batch_idx, capacity)


@dataclass(frozen=True)
class _DecodePlan:
    """What one KV-cache call launches: the split count and each kernel's config arguments."""

    splits: int
    attention: dict  # split-KV kernel: tile, warps, stages, dot precision
    append: dict | None  # append kernel, when new k/v are given
    combine: dict | None  # combine kernel, with splits > 1
    attention_module: str = "triton.kvcache"  # the split-KV kernel's module (gluon.kvcache: Gluon pipelines)


# Decode steps repeat a few shapes, and the dispatcher's answer for one (registry scans, a
# tuning-database lookup, the split policy) costs more Python than the rest of the call:
# it is cached per dispatcher, keyed by the problem, the call's choices and the dispatcher's
# parts (another registry, heuristic, tuning database or split policy is another key).
# As for dense calls (api._plan_forward), fmha.set_dispatcher clears it: a tuning database
# edited after the first call of a shape is read again after set_dispatcher.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLANS_MAX = 1024  # per dispatcher


@on_dispatcher_change
def clear_plans() -> None:
    """Forget every cached KV-cache plan and call plan (run when the dispatcher changes)."""
    _PLANS.clear()
    _DECODE_CALL_PLANS.clear()


def _dispatch_state(dispatcher: Dispatcher) -> tuple:
    """The dispatcher's parts that `_decode_plan`'s key holds besides the call's own."""
    registry = dispatcher.registry
    return (dispatcher.split_policy, registry, len(registry), dispatcher.heuristic, dispatcher.tuning)


def _decode_plan(dispatcher: Dispatcher, problem: Problem, *, append: bool, num_splits: int,
                 sm_count: int) -> _DecodePlan:
    """The kernels of a call (num_splits 0: the dispatcher's split policy picks), cached."""
    plans = _PLANS.get(dispatcher)
    if plans is None:
        plans = _PLANS.setdefault(dispatcher, {})
    key = (problem, append, num_splits, sm_count, *_dispatch_state(dispatcher))
    try:
        plan = plans.get(key)
    except TypeError:  # an unhashable heuristic (a callable object with __eq__): not cached
        return _make_decode_plan(dispatcher, problem, append=append, num_splits=num_splits, sm_count=sm_count)
    if plan is None:
        plan = _make_decode_plan(dispatcher, problem, append=append, num_splits=num_splits, sm_count=sm_count)
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = plan
    return plan


def _make_decode_plan(dispatcher: Dispatcher, problem: Problem, *, append: bool, num_splits: int,
                      sm_count: int) -> _DecodePlan:
    attn_config, _ = dispatcher.select(problem, Family.FWD_SPLITKV)
    algorithm = attn_config.algorithm
    splits = num_splits or dispatcher.num_splits(problem, sm_count, algorithm.block_m, algorithm.block_n,
                                                 algorithm.programs_per_sm)
    plan = dispatcher.plan_kvcache(problem, append=append, num_splits=splits)
    return _DecodePlan(
        splits=splits,
        attention=dict(algorithm_args(attn_config), dot_precision=algorithm.dot_precision),
        append=algorithm_args(plan.config(Family.APPEND_KV)) if append else None,
        combine=algorithm_args(plan.config(Family.SPLITKV_COMBINE)) if splits > 1 else None,
        attention_module="gluon.kvcache" if algorithm.pipeline.is_gluon else "triton.kvcache",
    )


@dataclass(frozen=True)
class _Call:
    """An `attention_with_kvcache` call checked: its queries, cache index and Problem, the mask
    window and alignment, whether RoPE applies, and a float8 cache's descales as fp32 views."""

    queries: _Queries
    cache: _CacheIndex
    problem: Problem
    window: tuple[int, int]
    align: MaskAlign
    rotary: bool
    k_descale: Tensor | None
    v_descale: Tensor | None


def _checked_call(q, k_cache, v_cache, *, k, v, cache_seqlens, block_table, cache_batch_idx, kv_indptr, kv_indices,
                  kv_last_page_len, cu_seqlens_q, max_seqlen_q, rotary_cos, rotary_sin, num_splits, scale, causal,
                  window, mask_align, sink_size, softcap, alibi_slopes, sinks, k_descale, v_descale) -> _Call:
    """Every check of `attention_with_kvcache`'s arguments (errors name the argument) and the
    Problem it solves; what both the call and `explain_kvcache` start from."""
    qs = _check_queries(q, cu_seqlens_q, max_seqlen_q)
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
    batch, seqlen_q, nhead_q, head_dim = qs.batch, qs.seqlen_q, qs.nhead_q, qs.head_dim
    nhead_k = k_cache.shape[2]
    V.check_heads(nhead_q, nhead_k, v_cache.shape[2])
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[-1]} but q has {head_dim}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
                         f"agree in all but the last dimension")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        V.check_last_dim_contiguous(name, t)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens for the cache)")
    if k is not None:
        _check_new_kv(qs, q, k, v, nhead_k, v_cache.shape[-1])
    cache = _cache_index(qs, k_cache, qs.new_tokens(k), cache_seqlens=cache_seqlens,
                         block_table=block_table, cache_batch_idx=cache_batch_idx, kv_indptr=kv_indptr,
                         kv_indices=kv_indices, kv_last_page_len=kv_last_page_len)
    paged = cache.table is not None
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, q.device, head_dim)
        if k is None:
            raise ValueError("rotary_cos/rotary_sin rotate the new k and q: pass k and v")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= 128:
        raise ValueError(f"num_splits={num_splits!r} must be an int in [0, 128] (0: heuristic)")
    V.check_alibi(alibi_slopes, batch, nhead_q, q.device)
    V.check_sinks(sinks, nhead_q, q.device, q.dtype)
    kd2, vd2 = _check_cache_descales(kv_fp8, k_cache, k_descale, v_descale, batch, nhead_k, q.device)
    if kv_fp8 and qs.varlen and k is not None and (kd2.shape[0] != 1 or vd2.shape[0] != 1):
        raise NotImplementedError("per-(batch, KV head) k_descale/v_descale with packed new k/v "
                                  "(cu_seqlens_q) are not supported: pass per-tensor descales, or "
                                  "append without cu_seqlens_q")

    problem = Problem(
        batch=batch, nhead_q=nhead_q, nhead_k=nhead_k, seqlen_q=seqlen_q, seqlen_k=cache.seqlen_k,
        head_dim_qk=head_dim, head_dim_v=v_cache.shape[-1], dtype=dtype, layout="bshd",
        arch=_arch(q.device), causal=causal, window=(left, right), mask_align=align,
        sink_size=sink_size, alibi=alibi_slopes is not None, softcap=float(softcap),
        sinks=sinks is not None, varlen=qs.varlen, seqused_k=True, paged_kv=paged, kv_fp8=kv_fp8,
        # (16-byte aligned cache rows: what the Gluon fp8 decode's 16-byte copies need)
        tma_aligned=not kv_fp8 or tma_aligned(k_cache, v_cache),
    )
    return _Call(qs, cache, problem, (left, right), align, rotary, kd2, vd2)


def attention_with_kvcache(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, k: Tensor | None = None, v: Tensor | None = None,
    cache_seqlens: Tensor | int | None = None, block_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None, kv_indptr: Tensor | None = None,
    kv_indices: Tensor | None = None, kv_last_page_len: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None, max_seqlen_q: int | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, rotary_interleaved: bool = False,
    num_splits: int = 0, scale: float | None = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right", sink_size: int = 0, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, sinks: Tensor | None = None, return_lse: bool = False,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None,
):
    """Attention of q over a KV cache, appending k/v first (inference; no autograd).

    Args:
        q: (B, Sq, Hq, D); or, with cu_seqlens_q, packed (total_q, Hq, D) (batch prefill).
        k_cache, v_cache: (B_cache, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D)
            with block_table or the kv_indptr tables; any page size >= 1. Modified in
            place when k/v are given.
        k, v: new tokens, written into the cache before attention: (B, Snew, Hk, D) at
            positions cache_seqlens[b] + t; with cu_seqlens_q, packed (total_q, Hk, D), one
            per query (sequence b appends its seqlen_q[b] tokens).
        cache_seqlens: int32 (B,) tokens already in each cache (or one int); None: full.
        block_table: int32 (B, max_pages) page ids (vLLM). cache_batch_idx: int32 (B,) cache
            row of each batch (contiguous caches only).
        kv_indptr, kv_indices, kv_last_page_len: FlashInfer/SGLang page tables, instead of
            block_table + cache_seqlens (all three or none). Sequence b owns the pages
            kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (int32; kv_indptr (B + 1,) starts at 0
            and never decreases); its last page holds kv_last_page_len[b] tokens, in
            [1, page_size], or 0 for a sequence with no pages. The tables describe the cache
            AFTER this call's append (FlashInfer convention): sequence b has
            L = (pages - 1) * page_size + kv_last_page_len[b] keys and new k/v take its
            last Snew positions (L >= Snew).
        cu_seqlens_q: int32 (B + 1,) prefix sums of the query counts (from 0, ending at
            total_q); max_seqlen_q: int, the longest. Sequences mix decode (1 query) and
            prefill chunks (many); each sees its own keys, bottom-right aligned: with L_b keys
            (after any append) query t of sequence b sits at position L_b - seqlen_q[b] + t,
            as flash_attn_varlen_func with a block_table.
        rotary_cos, rotary_sin: (max_pos, rotary_dim / 2); k and q are rotated at positions
            base[b] + t, base[b] = the tokens before the append (interleaved pairs or NeoX
            halves).
        num_splits: 0 picks by the dispatcher's `SplitPolicy` from the shapes (lengths stay
            on the device: it assumes the capacity, or with kv_indptr tables the mean
            kv_indices.numel() * page_size / B); 1..128 forces it.
        Masks, soft-cap, ALiBi and sink logits as in `fmha.attention`; the bottom-right
        alignment puts the last query on the last key of each batch.
        k_descale, v_descale: float8 caches (e4m3fn / e5m2) with fp16/bf16/fp32 q: fp32,
            per tensor (0-d or (1,)) or per (batch, KV head) (B, Hk), indexed by q's batch;
            the cache holds x / descale (None: 1). Tiles are dequantized on load (exact)
            and the products run in q's dtype. New k/v (in q's dtype) are divided by the
            descale and rounded to the cache's format (after RoPE) as they are appended.
            With cu_seqlens_q, appending new k/v needs per-tensor descales.
    Returns: o (B, Sq, Hq, Dv) [varlen: (total_q, Hq, Dv)] in q's dtype, and, if
        return_lse, lse (B, Hq, Sq) [varlen: (Hq, total_q)] fp32.
    """
    key = None
    if (k is None and v is None and rotary_cos is None and rotary_sin is None
            and (alibi_slopes is None or type(alibi_slopes) is Tensor) and (sinks is None or type(sinks) is Tensor)
            and cache_batch_idx is None and cu_seqlens_q is None and max_seqlen_q is None
            and (k_descale is None or type(k_descale) is Tensor) and (v_descale is None or type(v_descale) is Tensor)
            and type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
            and _plain_index(cache_seqlens, block_table, kv_indptr, kv_indices, kv_last_page_len)
            and _plain_decode_scalars(num_splits, scale, causal, window, mask_align, sink_size, softcap)
            and not _reads_values(q.device) and plain_eager()):
        key = (tensor_meta(q), tensor_meta(k_cache), tensor_meta(v_cache), tensor_meta(cache_seqlens),
               tensor_meta(block_table), tensor_meta(kv_indptr), tensor_meta(kv_indices),
               tensor_meta(kv_last_page_len), tensor_meta(k_descale), tensor_meta(v_descale),
               tensor_meta(alibi_slopes), tensor_meta(sinks), num_splits, scale, causal, window, mask_align, sink_size,
               softcap)
        call_plan = _DECODE_CALL_PLANS.get(key)
        if call_plan is not None:
            indptr_tables = kv_indptr is not None
            out = call_plan.run(q, k_cache, v_cache, kv_last_page_len if indptr_tables else cache_seqlens,
                                kv_indices if indptr_tables else block_table, kv_indptr,
                                _descale_view(k_descale), _descale_view(v_descale), alibi_slopes, sinks)
            if out is not None:
                return out if return_lse else out[0]
    call = _checked_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
                         cache_batch_idx=cache_batch_idx, kv_indptr=kv_indptr, kv_indices=kv_indices,
                         kv_last_page_len=kv_last_page_len, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                         rotary_cos=rotary_cos, rotary_sin=rotary_sin, num_splits=num_splits, scale=scale,
                         causal=causal, window=window, mask_align=mask_align, sink_size=sink_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale, v_descale=v_descale)
    qs, cache, problem, (left, right), align = call.queries, call.cache, call.problem, call.window, call.align
    kd2, vd2, rotary, kv_fp8 = call.k_descale, call.v_descale, call.rotary, problem.kv_fp8
    batch, seqlen_q, nhead_q, head_dim = qs.batch, qs.seqlen_q, qs.nhead_q, qs.head_dim
    dispatcher = get_dispatcher()
    plan = _decode_plan(dispatcher, problem, append=k is not None, num_splits=num_splits,
                        sm_count=_sm_count(q.device))
    splits = plan.splits
    kernels = family_module("triton.kvcache", interpreted=q.device.type == "cpu")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    alibi2 = V.alibi_rows(alibi_slopes)
    pages = dict(block_table=cache.table, kv_indptr=cache.indptr)  # block_table, or kv_indices + kv_indptr
    varlen = dict(cu_seqlens=qs.cu_seqlens_q, max_seqlen=seqlen_q) if qs.varlen else {}

    with device_guard(q):
        if k is not None:
            append = plan.append
            cos_sin = dict(cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved) if rotary else {}
            if kv_fp8:  # the cache holds x / descale; rounded to float8 by the append
                if qs.varlen:  # (total_q, Hk, D); descales are per tensor here (checked above)
                    k, v = k.float() / kd2.reshape(1, -1, 1), v.float() / vd2.reshape(1, -1, 1)
                else:
                    k, v = k.float() / kd2[:, None, :, None], v.float() / vd2[:, None, :, None]
            for src, dst, rope in ((k, k_cache, cos_sin), (v, v_cache, {})):
                kernels.launch_rotary_append(src, dst, base=cache.base, cache_batch_idx=cache.cache_batch_idx,
                                             dst_at_base=True, **pages, **varlen, **rope, **append)
            if rotary:
                q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
                kernels.launch_rotary_append(q, q_rot, base=cache.base, dst_at_base=False, **varlen,
                                             **cos_sin, **append)
                q = q_rot
        head_dim_v = v_cache.shape[-1]
        rows = (q.shape[0],) if qs.varlen else (batch, seqlen_q)  # (total_q,) or (B, Sq)
        o = q.new_empty((*rows, nhead_q, head_dim_v))
        lse_shape = (nhead_q, q.shape[0]) if qs.varlen else (batch, nhead_q, seqlen_q)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        attn = dict(seqlens_k=cache.seqlens_k, kv_last_page_len=cache.last_page_len,
                    cache_batch_idx=cache.cache_batch_idx, **pages,
                    cu_seqlens_q=qs.cu_seqlens_q, max_seqlen_q=seqlen_q if qs.varlen else 0,
                    alibi_slopes=alibi2, sinks=sinks, scale=scale, softcap=float(softcap),
                    window=(left, right), sink_size=sink_size,
                    align_bottom_right=align == MaskAlign.BOTTOM_RIGHT,
                    **plan.attention,
                    **(dict(k_descale=kd2, v_descale=vd2) if kv_fp8 else {}))
        combined = None
        # (the split-KV kernel: Triton's, or the Gluon fp8 decode where the registry chose it)
        attention = kernels if plan.attention_module == "triton.kvcache" else family_module(plan.attention_module,
                                                                                      interpreted=False)
        if splits == 1:
            attended = attention.launch_attention(q, k_cache, v_cache, o, lse, num_splits=1, **attn)
        else:
            # partial results (splits, B, Hq, Sq, Dv) [varlen: (splits, Hq, total_q, Dv)]
            part_rows = (nhead_q, q.shape[0]) if qs.varlen else (batch, nhead_q, seqlen_q)
            o_parts = torch.empty((splits, *part_rows, head_dim_v), dtype=torch.float32, device=q.device)
            lse_parts = torch.empty((splits, *part_rows), dtype=torch.float32, device=q.device)
            attended = attention.launch_attention(q, k_cache, v_cache, o_parts, lse_parts, num_splits=splits,
                                                  **attn)
            # the combine reads rows (b * Hq + h) * Sq + i; varlen is one batch of total_q rows
            o4, lse3 = (o[None], lse[None]) if qs.varlen else (o, lse)
            combined = kernels.launch_combine(o_parts.view(splits, -1, head_dim_v), lse_parts.view(splits, -1),
                                              o4, lse3, nheads=nhead_q, seqlen=o4.shape[1], sinks=sinks,
                                              **plan.combine)
    if key is not None and attended is not None and (splits == 1 or combined is not None):
        state = _dispatch_state(dispatcher)
        if _hashable(state):  # (else `_decode_plan` asks the dispatcher on every call: so must the call)
            keep_plan(_DECODE_CALL_PLANS, key, _DecodeCallPlan(dispatcher, state, o.shape, lse_shape, splits,
                                                               attended, combined))
    return (o, lse) if return_lse else o


def explain_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, **kwargs) -> str:
    """Which kernels `attention_with_kvcache(q, k_cache, v_cache, **kwargs)` would launch, with
    how many key splits, and why: the call's checks and the dispatcher's choices, nothing
    launched (the cache is not written)."""
    arguments = inspect.signature(attention_with_kvcache).bind(q, k_cache, v_cache, **kwargs)
    arguments.apply_defaults()
    named = dict(arguments.arguments)
    for name in ("q", "k_cache", "v_cache", "return_lse", "rotary_interleaved"):  # (no checks depend on the last two)
        del named[name]
    call = _checked_call(q, k_cache, v_cache, **named)
    dispatcher = get_dispatcher()
    append, forced = named["k"] is not None, named["num_splits"]
    decode = _decode_plan(dispatcher, call.problem, append=append, num_splits=forced, sm_count=_sm_count(q.device))
    splits = decode.splits
    plan = dispatcher.plan_kvcache(call.problem, append=append, num_splits=splits)
    per_sm = plan.config(Family.FWD_SPLITKV).algorithm.programs_per_sm
    keys = split_keys(call.problem)
    how = f"num_splits={forced}" if forced else f"the split policy's, {dispatcher.split_policy}" + (
        f", counting this kernel's {per_sm} programs an SM" if per_sm else "") + (
        f", over the {keys} keys the window shows of {call.problem.seqlen_k}" if keys < call.problem.seqlen_k else "")
    lines = [plan.describe(), f"key splits: {splits} ({how})"]
    if call.problem.kv_fp8:
        module = family_module(decode.attention_module, interpreted=q.device.type == "cpu"
                               and decode.attention_module == "triton.kvcache")
        products = module.products_dtype(q.dtype, True)
        lines.append(f"float8 cache: converted to {products} for the products (exact)" + (
            f"; bf16 queries scaled by a power of two into fp16's range per program, P by 2**15"
            f" (kernels.{decode.attention_module})" if products != q.dtype else ""))
    return "\n".join([*lines, "", dispatcher.explain(call.problem, Family.FWD_SPLITKV)])


# ----------------------------------------------------------------------------------------
# Decode call plans: a plain decode call repeated with inputs of the same metadata.

REAL_TYPES = (float, int)


def _plain_index(cache_seqlens, block_table, kv_indptr, kv_indices, kv_last_page_len) -> bool:
    """Index arguments a call plan takes as they are: tensors (or None), with cache_seqlens a
    tensor unless the indptr tables give the lengths (an int or None is turned into a tensor
    by the full path on every call)."""
    for t in (block_table, kv_indptr, kv_indices, kv_last_page_len):
        if t is not None and type(t) is not Tensor:
            return False
    return cache_seqlens is None if kv_indptr is not None else type(cache_seqlens) is Tensor


def _plain_decode_scalars(num_splits, scale, causal, window, mask_align, sink_size, softcap) -> bool:
    """Scalars of the types a call plan's key tells apart (bools as bools, ints as ints, a float
    or None scale): equal keys then mean calls validation treats alike."""
    return type(num_splits) is int and (type(scale) is float or scale is None) and type(causal) is bool \
        and type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int \
        and type(mask_align) is str and type(sink_size) is int and type(softcap) in REAL_TYPES


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _DecodeCallPlan:
    """What a validated plain decode call (no new k/v, rotary, cache batch index or varlen
    queries; ALiBi slopes and sinks as tensors or not at all; float8 caches too, their descales
    given as tensors or not at all; CUDA tensors outside debug mode, whose index values the full
    path does not read either) repeats
    for inputs of the same metadata and scalars (`attention_with_kvcache`'s key): the outputs'
    shapes, the split count and the launchers' own plans (kernels/kvcache.py). Checks,
    description and dispatch ran for the call that made it; a later call of the same key would
    pass them alike, and would get the same kernels while the dispatcher and the parts
    `_decode_plan` keys on are the same."""

    __slots__ = ("dispatcher", "dispatch_state", "o_shape", "lse_shape", "splits", "attention", "combine",
                 "launches", "runnable")

    def __init__(self, dispatcher: Dispatcher, dispatch_state: tuple, o_shape, lse_shape, splits: int, attention,
                 combine) -> None:
        from .kernels.launch.cache import runnable  # (Triton is loaded by now: the launchers ran)

        self.dispatcher, self.dispatch_state = dispatcher, dispatch_state
        self.o_shape, self.lse_shape, self.splits = tuple(o_shape), tuple(lse_shape), splits
        self.attention, self.combine = attention, combine
        self.launches = (attention,) if combine is None else (attention, combine)
        self.runnable = runnable

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, table: Tensor | None,
            indptr: Tensor | None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
            alibi_slopes: Tensor | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        """o, lse as the full path computes them; None where the plan may not run (another
        dispatcher state, or a launcher plan that may not launch now): then the full path runs.
        lengths: cache_seqlens, or kv_last_page_len with indptr tables; table: block_table or
        kv_indices; a float8 cache's descales as the kernels take them (`_descale_view`); ALiBi
        slopes (Hq,) or (B, Hq) and sinks as the call gives them."""
        dispatcher = get_dispatcher()
        if (dispatcher is not self.dispatcher or _dispatch_state(dispatcher) != self.dispatch_state
                or not self.runnable(*self.launches)):
            return None
        # (no device guard: `runnable` found the current device to be the plans', q's device)
        o = q.new_empty(self.o_shape)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        alibi_slopes = V.alibi_rows(alibi_slopes)  # (Hq,) -> (1, Hq), as the full path
        if self.combine is None:
            self.attention.launch(q, k_cache, v_cache, o, lse, lengths, table, indptr, k_descale, v_descale, None,
                                  alibi_slopes, sinks)
            return o, lse
        splits, head_dim_v = self.splits, self.o_shape[-1]
        # partial results (splits, B, Hq, Sq, Dv): lse's rows (the queries are not packed here)
        o_parts = torch.empty((splits, *self.lse_shape, head_dim_v), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty((splits, *self.lse_shape), dtype=torch.float32, device=q.device)
        self.attention.launch(q, k_cache, v_cache, o_parts, lse_parts, lengths, table, indptr, k_descale, v_descale,
                              None, alibi_slopes, sinks)
        self.combine.launch(o_parts.view(splits, -1, head_dim_v), lse_parts.view(splits, -1), o, lse, sinks)
        return o, lse


_DECODE_CALL_PLANS = plan_table()  # (forgotten with the launchers' plans: plan_tables.clear_plans)


def _check_new_kv(qs: _Queries, q, k, v, nhead_k: int, head_dim_v: int) -> None:
    ndim = 3 if qs.varlen else 4
    V.check_tensor("k", k, ndim)
    V.check_tensor("v", v, ndim)
    V.check_same(("q", "k", "v"), (q, k, v))
    if qs.varlen:
        accepted = (q.shape[0], nhead_k, qs.head_dim)
        if tuple(k.shape) != accepted:
            raise ValueError(f"k has shape {tuple(k.shape)}; accepted with cu_seqlens_q: {accepted} "
                             f"(one new token per query)")
    elif k.shape[0] != qs.batch or k.shape[2] != nhead_k or k.shape[3] != qs.head_dim:
        raise ValueError(f"k has shape {tuple(k.shape)}; accepted: ({qs.batch}, Snew, {nhead_k}, {qs.head_dim})")
    if tuple(v.shape) != (*k.shape[:-1], head_dim_v):
        raise ValueError(f"v has shape {tuple(v.shape)}; accepted: {(*k.shape[:-1], head_dim_v)}")


def _check_rotary(rotary_cos, rotary_sin, device, head_dim: int) -> None:
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        V.check_tensor(name, t, 2)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
                         f"{tuple(rotary_sin.shape)} must have one shape")
    if not 0 < 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[1]} columns: rotary_dim = "
                         f"{2 * rotary_cos.shape[1]} must be in [2, head_dim={head_dim}]")


def _per_sequence(n_new, batch: int) -> list[int]:
    return n_new.tolist() if isinstance(n_new, Tensor) else [n_new] * batch


def _descale_view(d: Tensor | None) -> Tensor | None:
    """A float8 cache's descale as `_check_cache_descales` passes it to the kernels, for a call
    whose key (the descale's metadata) matched a checked one: (B, Hk) as given, one value as
    (1, 1)."""
    return d if d is None or d.dim() == 2 else d.reshape(1, 1)


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
            views.append(unit_descale(device))
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
        if _reads_values(device) and not bool((torch.isfinite(d) & (d > 0)).all()):
            raise ValueError(f"{name} must be finite and > 0 everywhere")
    return views[0], views[1]


def _check_kvcache_values(cache_seqlens, n_new, capacity, block_table, n_rows, cache_batch_idx):
    """Host-side checks of index values (always for CPU tensors; CUDA in debug mode)."""
    lengths = cache_seqlens.tolist()
    news = _per_sequence(n_new, len(lengths))
    for b, (n, new) in enumerate(zip(lengths, news, strict=True)):
        if not 0 <= n or n + new > capacity:
            raise ValueError(f"cache_seqlens[{b}]={n} plus {new} new tokens exceeds the cache "
                             f"capacity {capacity} (or is negative)")
    if block_table is not None:
        bad = (block_table < 0) | (block_table >= n_rows)
        page_size = max(1, capacity // max(1, block_table.shape[1]))
        for b, (n, new) in enumerate(zip(lengths, news, strict=True)):
            pages = -(-(n + new) // page_size)
            if bad[b, :pages].any():
                j = int(bad[b, :pages].nonzero()[0])
                raise ValueError(f"block_table[{b}, {j}]={int(block_table[b, j])} is outside the page "
                                 f"pool [0, {n_rows})")
    if cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < n_rows:
                raise ValueError(f"cache_batch_idx[{b}]={row} is outside [0, {n_rows})")


def _check_indptr_values(kv_indptr, kv_indices, kv_last_page_len, n_new, page_size: int, n_pages: int):
    """Host-side checks of FlashInfer/SGLang page tables (CPU tensors; CUDA in debug mode)."""
    indptr = kv_indptr.tolist()
    V.check_offsets("kv_indptr", indptr)
    if indptr[-1] > kv_indices.numel():
        raise ValueError(f"kv_indptr[-1]={indptr[-1]} exceeds the {kv_indices.numel()} entries of kv_indices")
    used = kv_indices[:indptr[-1]]
    bad = ((used < 0) | (used >= n_pages)).nonzero()
    if bad.numel():
        j = int(bad[0])
        raise ValueError(f"kv_indices[{j}]={int(used[j])} is outside the page pool [0, {n_pages})")
    news = _per_sequence(n_new, len(indptr) - 1)
    for b, last in enumerate(kv_last_page_len.tolist()):
        pages = indptr[b + 1] - indptr[b]
        if pages == 0 and last != 0:
            raise ValueError(f"kv_last_page_len[{b}]={last}: sequence {b} has no pages, so it must be 0")
        if pages > 0 and not 1 <= last <= page_size:
            raise ValueError(f"kv_last_page_len[{b}]={last} must be in [1, page_size={page_size}] "
                             f"(sequence {b} has {pages} pages)")
        length = (pages - 1) * page_size + last if pages else 0
        if length < news[b]:
            raise ValueError(f"sequence {b} has {length} tokens in its pages but appends {news[b]}: the "
                             f"kv_indptr tables describe the cache after the append, new tokens included")


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
                      arch=arch_of(outs[0].device))
    config, _ = get_dispatcher().select(problem, Family.SPLITKV_COMBINE)
    kernels = family_module("triton.kvcache", interpreted=outs[0].device.type == "cpu")
    with device_guard(outs[0]):
        kernels.launch_combine(o_parts, lse_parts, o, lse, nheads=1, seqlen=rows, **algorithm_args(config))
    return o.reshape(shape), lse.reshape(shape[:-1])
