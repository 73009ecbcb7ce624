"""Decode over a float8 KV cache in Gluon (family `fwd_splitkv`, pipeline `gluon`, sm90).

One warp a program: a (batch, KV head, key split) triple, the KV head's query heads packed as
the rows of one 16-row tile (one query token a sequence). K and V tiles of BLOCK_N keys go
through a ring of STAGES shared-memory slots by `cp.async` (16 bytes a copy), and each lane
reads its part of a tile straight into the registers of an mma.sync operand (`mma_v2`): no
16-bit copy of V in shared memory, no barrier but the warp's own. That works because the head
dimension may be permuted:

- S = q K^T sums over D, so q and K may share any order of D. Order `_qk_d` gives lane q of the
  m16n8k16 B fragment (rows 2q, 2q + 1, 2q + 8, 2q + 9 of each 16-row k-step) the 32 contiguous
  bytes D = 32q .. 32q + 31 of a key over the 8 k-steps: two 16-byte shared loads.
- O = P V: V's rows are keys (its reduction dimension, the strided one in memory), its columns
  O's. Column c of the product is D = 16 * (c % 8) + c // 8 (`d_out` at the store), so that lane
  n of an n-tile's fragment (column n = lane / 4) holds D = 16n .. 16n + 15 across the 16 n-tiles: one
  16-byte load a key; the bytes of keys 2q, 2q + 1 (+ 8, + 16) are paired by PRMT into the
  fragment's registers. O's columns go back in the same order at the store.

The cache converts to fp16 (one cvt a pair; bf16 queries are scaled by a power of two into
fp16's range per program, as `kvcache.FP8_F16_DOTS` does), P enters P V as P * 2**15 (l and O
carry the factor, the LSE drops it). Partial outputs and LSEs of the splits are merged by
`kvcache.combine_kernel`; with one split the program writes the final output.

Scope (the registry's `fp8_decode` signature): D = 128, one query token a sequence (no varlen),
at most 16 query heads per KV head, a contiguous cache (B_cache, S, Hk, 128) (optionally rows
picked by cache_batch_idx) or pages (num_pages, page_size, Hk, 128) through a block table or
FlashInfer/SGLang tables (as splitkv_kernel's: one page id a tile where pages hold a multiple of
BLOCK_N keys, else one a row; the ids are loaded a tile before their copies are issued), with
16-byte aligned rows, descales per tensor or per (batch, KV
head), no mask (causal at one query aligned bottom-right is none), no ALiBi, soft-cap, sink
tokens or sink logits. Everything else runs on the Triton kernel (kvcache.py).
Measured (H200, docs/performance.md attempts 106-107): 1.79x the bf16 cache's decode, where the
Triton kernel with fp16 products ran 1.52x; over pages of 64 or 256 keys as fast as contiguous,
of 16 and 1 key 3% and 5% slower.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import launch_cache
from .kvcache import F16_P_SHIFT, _descale_strides, _paging
from .launch_args import unit_descale

HEAD_DIM = gl.constexpr(128)
ROWS = gl.constexpr(16)  # the mma tile's rows: a KV head's query heads (at most 16)
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _tile_layout(block_n, for_v):
    """[keys, D] of a K or V tile as lanes read it, each lane's registers along D first, then the
    keys' bits from 8 up. K: lane (key k % 8, q) holds D = 32q .. 32q + 31 of keys k % 8 + 8i.
    V (for_v): lane (q, n) holds D = 16n .. 16n + 15 of keys 2q, 2q + 1 (+ 8i)."""
    if for_v:
        regs, lanes = [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0]], [[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]]
    else:
        regs, lanes = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]], [[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]]
    upper_keys = [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs + upper_keys, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, HEAD_DIM])


@gluon.jit
def _qk_d(d):
    """The D that position d of S's reduction reads: d = 16s + 8h + 2q + e -> 32q + 4s + 2h + e."""
    return 32 * ((d >> 1) & 3) + 4 * (d >> 4) + 2 * ((d >> 3) & 1) + (d & 1)


@gluon.jit
def _pow2(n):
    """2.0**n for integer n in [-126, 127], exact (the float's exponent bits)."""
    return ((n + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _page_ids(rows, n0, hi, Table, table_row, page_size, PAGE_PER_TILE: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    """The page ids of keys `rows` (n0 + arange, in a tile layout's row slice), as splitkv_kernel's
    `_kv_slots`: one id a tile when pages hold a multiple of BLOCK_N keys, else one a row; ids
    past hi are not read."""
    if PAGE_PER_TILE:
        return gl.load(Table + table_row + n0 // page_size, mask=n0 < hi, other=0)
    elif PAGE_SHIFT >= 0:
        return gl.load(Table + table_row + (rows >> PAGE_SHIFT), mask=rows < hi, other=0)
    else:
        return gl.load(Table + table_row + rows // page_size, mask=rows < hi, other=0)


@gluon.jit
def _paged_offsets(pages, rows, page_size, stride_b, stride_n, PAGE_SHIFT: gl.constexpr):
    """Offsets (elements) of the cache rows of keys `rows` in pages `pages` (_page_ids')."""
    if PAGE_SHIFT >= 0:
        in_page = rows & ((1 << PAGE_SHIFT) - 1)
    else:
        in_page = rows % page_size
    return pages.to(gl.int64) * stride_b + in_page.to(gl.int64) * stride_n


@gluon.jit
def _copy_tile(ring, slot, base, offsets, rows, cols, hi):
    """cp.async of one tile's rows (< hi; the others zero-filled) into ring slot `slot`."""
    async_copy.async_copy_global_to_shared(ring.index(slot), base + offsets[:, None] + cols[None, :],
                                           mask=(rows < hi)[:, None])


@gluon.jit(do_not_specialize=["num_splits"])
def decode_fp8_kernel(Q, K, V, O, LSE, KDescale, VDescale, SeqlensK, CacheBatchIdx, BlockTable, KvIndptr,
                      stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                      stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
                      stride_kdb, stride_kdh, stride_vdb, stride_vdh, stride_btb, page_size,
                      nheads_k, num_splits, scale,
                      GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BF16: gl.constexpr,
                      HAS_CACHE_BATCH_IDX: gl.constexpr, PAGED: gl.constexpr,
                      TABLE_INDPTR: gl.constexpr, PAGE_PER_TILE: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    mma: gl.constexpr = _mma_layout()
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    k_layout: gl.constexpr = _tile_layout(BLOCK_N, False)
    v_layout: gl.constexpr = _tile_layout(BLOCK_N, True)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
    ring_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    pid = gl.program_id(0)
    split = pid % num_splits
    bhk = pid // num_splits
    b = bhk // nheads_k
    hk = bhk % nheads_k
    b_row = b
    if HAS_CACHE_BATCH_IDX:
        b_row = gl.load(CacheBatchIdx + b)
    table_row = 0
    if PAGED:  # sequence b's page ids: row b_row of the block table, or kv_indices from kv_indptr[b]
        if TABLE_INDPTR:
            table_row = gl.load(KvIndptr + b)
        else:
            table_row = b_row * stride_btb
    if TABLE_INDPTR:  # SeqlensK holds kv_last_page_len: (pages - 1) * page_size + the last page's keys
        pages = gl.load(KvIndptr + b + 1) - table_row
        len_k = gl.where(pages > 0, (pages - 1) * page_size + gl.load(SeqlensK + b), 0)
    else:
        len_k = gl.load(SeqlensK + b)
    # Keys of this split: [lo, hi), BLOCK_N-aligned slices of [0, len_k) (as splitkv_kernel's).
    chunk = gl.cdiv(gl.cdiv(len_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, len_k)

    # q: the tile's rows are query heads hk * GROUP + r (rows >= GROUP are zeros), its columns in
    # S's order of D; bf16 scaled by 2**e into fp16's range (the logit scale takes 2**-e).
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    b64 = b.to(gl.int64)
    q = gl.load(Q + b64 * stride_qb + (hk * GROUP + r)[:, None] * stride_qh + _qk_d(d)[None, :],
                mask=(r < GROUP)[:, None], other=0.0).to(gl.float32)
    scale = scale * gl.load(KDescale + b * stride_kdb + hk * stride_kdh) * LOG2E
    if Q_BF16:
        amax = gl.max(gl.max(gl.abs(q), 1), 0)
        e = gl.minimum(gl.maximum(14 - (((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127), -126), 126)
        q = q * _pow2(e)
        scale = scale * _pow2(-e)
    q_op = gl.convert_layout(q.to(gl.float16), a_layout)

    k_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    k_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, k_layout))
    v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
    v_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, v_layout))
    # The cache's strides are multiples of 16 (the registry's needs_tma checked it): written so, the
    # compiler sees 16-byte copies also where it does not specialize them (an ahead-of-time build).
    stride_kb, stride_kn, stride_kh = stride_kb // 16 * 16, stride_kn // 16 * 16, stride_kh // 16 * 16
    stride_vb, stride_vn, stride_vh = stride_vb // 16 * 16, stride_vn // 16 * 16, stride_vh // 16 * 16
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    k_ring = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], ring_layout)
    v_ring = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], ring_layout)

    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma))
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    # The ring's first tiles; a paged cache's page ids are loaded a tile before their copies are
    # issued (carried in the loop), so the copies do not wait on the table's latency.
    k_row0 = b_row.to(gl.int64) * stride_kb
    v_row0 = b_row.to(gl.int64) * stride_vb
    for i in gl.static_range(STAGES):
        n_i = lo + i * BLOCK_N
        if PAGED:
            k_pages = _page_ids(n_i + k_rows, n_i, hi, BlockTable, table_row, page_size, PAGE_PER_TILE, PAGE_SHIFT)
            v_pages = _page_ids(n_i + v_rows, n_i, hi, BlockTable, table_row, page_size, PAGE_PER_TILE, PAGE_SHIFT)
        if i < STAGES - 1:
            if PAGED:
                k_offsets = _paged_offsets(k_pages, n_i + k_rows, page_size, stride_kb, stride_kn, PAGE_SHIFT)
                v_offsets = _paged_offsets(v_pages, n_i + v_rows, page_size, stride_vb, stride_vn, PAGE_SHIFT)
            else:
                k_offsets = k_row0 + (n_i + k_rows).to(gl.int64) * stride_kn
                v_offsets = v_row0 + (n_i + v_rows).to(gl.int64) * stride_vn
            _copy_tile(k_ring, i, k_base, k_offsets, n_i + k_rows, k_cols, hi)
            _copy_tile(v_ring, i, v_base, v_offsets, n_i + v_rows, v_cols, hi)
            async_copy.commit_group()
    for j in range(n_tiles):
        n0 = lo + j * BLOCK_N
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # every lane's copies of tile j landed, every lane read slot (j - 1) % STAGES
        k8 = k_ring.index(j % STAGES).load(k_layout)
        v8 = v_ring.index(j % STAGES).load(v_layout)
        ahead = j + STAGES - 1
        n_ahead = lo + ahead * BLOCK_N
        if PAGED:
            k_offsets = _paged_offsets(k_pages, n_ahead + k_rows, page_size, stride_kb, stride_kn, PAGE_SHIFT)
            v_offsets = _paged_offsets(v_pages, n_ahead + v_rows, page_size, stride_vb, stride_vn, PAGE_SHIFT)
            n_next = n_ahead + BLOCK_N
            k_pages = _page_ids(n_next + k_rows, n_next, hi, BlockTable, table_row, page_size, PAGE_PER_TILE,
                                PAGE_SHIFT)
            v_pages = _page_ids(n_next + v_rows, n_next, hi, BlockTable, table_row, page_size, PAGE_PER_TILE,
                                PAGE_SHIFT)
        else:
            k_offsets = k_row0 + (n_ahead + k_rows).to(gl.int64) * stride_kn
            v_offsets = v_row0 + (n_ahead + v_rows).to(gl.int64) * stride_vn
        _copy_tile(k_ring, ahead % STAGES, k_base, k_offsets, n_ahead + k_rows, k_cols, hi)
        _copy_tile(v_ring, ahead % STAGES, v_base, v_offsets, n_ahead + v_rows, v_cols, hi)
        async_copy.commit_group()
        # K^T in S's order of D: [keys, D] = [keys, 32q + 4s + 2h + e] -> [16s + 8h + 2q + e, keys]
        kt = k8.to(gl.float16).reshape([BLOCK_N, 4, 8, 2, 2]).permute((2, 3, 1, 4, 0)).reshape([HEAD_DIM, BLOCK_N])
        s = mma_v2(q_op, gl.convert_layout(kt, b_layout), gl.zeros([ROWS, BLOCK_N], gl.float32, mma))
        s = gl.where((n0 + key_cols < hi)[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_safe - F16_P_SHIFT)[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        # V in O's order of columns: [keys, 16n + j] -> [keys, 8j + n]
        vt = v8.to(gl.float16).reshape([BLOCK_N, 8, 16]).permute((0, 2, 1)).reshape([BLOCK_N, HEAD_DIM])
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_layout), gl.convert_layout(vt, b_layout), acc)
    async_copy.wait_group(0)  # (the ring's copies past the last tile, all masked off)

    acc = acc * gl.load(VDescale + b * stride_vdb + hk * stride_vdh)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe) - F16_P_SHIFT) * LN2)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    h = hk * GROUP + rows
    d_out = 16 * (c % 8) + c // 8  # O's columns back in D's order
    o_ptrs = O + split.to(gl.int64) * stride_os + b64 * stride_ob + h[:, None] * stride_oh + d_out[None, :]
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows < GROUP)[:, None])
    gl.store(LSE + split * stride_ls + b * stride_lb + h * stride_lh, lse, mask=rows < GROUP)


def products_dtype(q_dtype: torch.dtype, kv_fp8: bool = True) -> torch.dtype:
    """The dtype of this kernel's products: always fp16 (bf16 queries scaled into its range)."""
    return torch.float16


def compile_spec(dtype: str, block_n: int, num_stages: int, *, cache: str = "fp8e4nv", split: bool = True,
                 group: int = 4, page_size: int = 0) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `decode_fp8_kernel` for an ahead-of-time compile (fmha
    kernels build) without a GPU: q and a final output in `dtype` ("fp16" or "bf16"), a `cache`
    ("fp8e4nv" or "fp8e5") cache, partial outputs (split) or the final one, `group` query heads
    a KV head, a contiguous cache (page_size 0) or a block table of pages of `page_size` keys."""
    pointers = {"Q": dtype, "K": cache, "V": cache, "O": "fp32" if split else dtype, "LSE": "fp32",
                "KDescale": "fp32", "VDescale": "fp32", "SeqlensK": "i32", "CacheBatchIdx": "i32",
                "BlockTable": "i32", "KvIndptr": "i32"}
    paged = page_size > 0
    constexprs = dict(GROUP=group, BLOCK_N=block_n, STAGES=num_stages, Q_BF16=dtype == "bf16",
                      HAS_CACHE_BATCH_IDX=False, PAGED=paged, TABLE_INDPTR=False,
                      PAGE_PER_TILE=paged and page_size % block_n == 0,
                      PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1)
    signature = {name: "*" + pointers[name] if name in pointers else "fp32" if name == "scale"
                 else "constexpr" if name in constexprs else "i32" for name in decode_fp8_kernel.arg_names}
    return signature, constexprs, {"num_warps": 1}


def launch_attention(q, k_cache, v_cache, o, lse, *, seqlens_k=None, block_table=None, kv_indptr=None,
                     kv_last_page_len=None, num_splits: int, scale: float, block_n: int, num_stages: int,
                     k_descale=None, v_descale=None, cache_batch_idx=None,
                     **_triton_only) -> launch_cache.Planned | None:
    """`kvcache.launch_attention`'s contract for what this kernel serves (the registry's
    `fp8_decode` signature; the other arguments of that launcher are the defaults there):
    q (B, 1, Hq, 128) fp16/bf16; caches (B_cache, S, Hk, 128) float8; o, lse final (one split)
    or (splits, B, Hq, 1, 128) fp32 and (splits, B, Hq, 1) partials. Returns the launch plan this
    call ran or made (None with cache_batch_idx), `Planned.launch(q, k_cache, v_cache, o, lse,
    lengths, block_table, kv_indptr, k_descale, v_descale)` repeating it."""
    _check_scope(_triton_only)
    # the kernel's SeqlensK: the key counts, or kv_last_page_len with indptr tables
    lengths = kv_last_page_len if kv_indptr is not None else seqlens_k
    key = None
    if cache_batch_idx is None and launch_cache.plans_enabled(decode_fp8_kernel):
        tables = tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) if t is not None else None
                       for t in (block_table, kv_indptr))
        key = (q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
               k_cache.dtype, o.shape, o.stride(), o.dtype, lse.shape, lse.stride(),
               tuple((d.shape, d.stride()) if d is not None else None for d in (k_descale, v_descale)),
               lengths.dtype, tuple(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache, o, lse, lengths)), tables,
               launch_cache.current_device(), num_splits, scale, block_n, num_stages)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale)
            return planned
    batch, _, nheads_q, _ = q.shape
    nheads_k = k_cache.shape[2]
    split = num_splits > 1
    if split:  # (splits, B, Hq, 1, D), (splits, B, Hq, 1)
        o_strides = (o.stride(1), o.stride(2), o.stride(0))
        lse_strides = (lse.stride(1), lse.stride(2), lse.stride(0))
    else:  # (B, 1, Hq, D), (B, Hq, 1)
        o_strides = (o.stride(0), o.stride(2), 0)
        lse_strides = (lse.stride(0), lse.stride(1), 0)
    grid = (batch * nheads_k * num_splits,)
    paging = _paging(block_table, kv_indptr, k_cache.shape[1], block_n)
    tail = (q.stride(0), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *lse_strides,
            *_descale_strides(k_cache, k_descale), *_descale_strides(k_cache, v_descale), paging.pop("stride_btb"),
            paging.pop("page_size"), nheads_k, num_splits, scale)
    tensors = _tensors(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale)
    if cache_batch_idx is not None:
        tensors = (*tensors[:8], cache_batch_idx, *tensors[9:])
    plan = launch_cache.make_plan(decode_fp8_kernel, grid, *tensors, *tail, GROUP=nheads_q // nheads_k,
                                  BLOCK_N=block_n, STAGES=num_stages, Q_BF16=q.dtype == torch.bfloat16,
                                  HAS_CACHE_BATCH_IDX=cache_batch_idx is not None, **paging, num_warps=1)
    return launch_cache.keep(_PLANS, key, plan, decode_fp8_kernel, tail, _tensors)


def _check_scope(args: dict) -> None:
    """The arguments of kvcache.launch_attention this kernel does not take must be neutral (the
    registry's `fp8_decode` signature keeps such calls on the Triton kernel)."""
    offside = [name for name in ("cu_seqlens_q", "alibi_slopes", "sinks") if args.get(name) is not None]
    if args.get("softcap", 0.0) or args.get("sink_size", 0) or args.get("max_seqlen_q", 0):
        offside.append("softcap/sink_size/max_seqlen_q")
    left, right = args.get("window", (-1, -1))
    if left != -1 or right not in (-1, 0) or (right == 0 and not args.get("align_bottom_right", True)):
        offside.append(f"window {(left, right)}")
    if offside:
        raise ValueError(f"the Gluon fp8 decode does not take {', '.join(offside)}: the dispatcher's fp8_decode "
                         f"signature should have refused this call")


def _tensors(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale) -> tuple:
    """decode_fp8_kernel's leading (tensor) arguments (an absent descale is 1; `lengths` stands
    in for the absent cache_batch_idx and page tables)."""
    one = None if k_descale is not None and v_descale is not None else unit_descale(q.device)
    return (q, k_cache, v_cache, o, lse, k_descale if k_descale is not None else one,
            v_descale if v_descale is not None else one, lengths, lengths,
            block_table if block_table is not None else lengths, kv_indptr if kv_indptr is not None else lengths)


_PLANS = launch_cache.plan_table()

