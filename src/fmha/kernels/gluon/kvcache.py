"""Decode over a float8 KV cache in Gluon (family `fwd_splitkv`, pipeline `gluon`, sm90).

One warp a program: a (batch, KV head, key split) triple, the KV head's query rows packed into
one 16-row tile (row r: query r // GROUP of query head r % GROUP; a decode step, or a few
speculative tokens a sequence). K and V tiles of BLOCK_N keys go
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

Masks and scores as splitkv_kernel's (SPEC steps 2-4): causal and windows in both alignments,
sink tokens, soft-cap (tanh through exp2 and an approximate reciprocal), ALiBi, sink logits
(folded here with one split, by the combine with more). A sequence's key tiles are the sink
tokens left of the window, the window, the sink tokens right of it; the splits take equal runs of
those tiles (so a window's keys are what is split), and only the tiles the mask cuts compute it.

D = 64 takes half those bytes a lane (V's reads 8 bytes a key, its copies laid out as K's); D = 256
is two D = 128 halves, a lane's bytes of the upper half 128 bytes on (the k-steps 8-15 of S, the
n-tiles 16-31 of P V), so that the 16-byte loads of one instruction stay on distinct banks.

Scope (the registry's `fp8_decode` signature): D = 64, 128 or 256, seqlen_q x query heads per KV
head <= 16 (no packed varlen queries), a contiguous cache (B_cache, S, Hk, D) (optionally rows picked
by cache_batch_idx) or pages (num_pages, page_size, Hk, D) through a block table or
FlashInfer/SGLang tables (as splitkv_kernel's: one page id a tile where pages hold a multiple of
BLOCK_N keys, else one a row; the ids are loaded a tile before their copies are issued), with
16-byte aligned rows, descales per tensor or per (batch, KV head). Everything else runs on the
Triton kernel (kvcache.py).
Measured (H200, docs/performance.md attempts 106-108, 111): 1.79x the bf16 cache's decode, where the
Triton kernel with fp16 products ran 1.52x; over pages as fast as contiguous (64 or 256 keys) or
2-3% slower (16 and 1 key); 1.16-1.26x the Triton kernel with causal speculative rows and
windows, even with soft-cap, ALiBi and sink logits; the Triton kernel's time over this one's
1.29-1.32x at D=64 and 1.71-1.90x at D=256 over two runs (up to 4.1 TB/s of fp8 bytes at D=128 and 256).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..launch import cache as launch_cache
from ..launch.args import alibi_strides, unit_descale
from ..triton.kvcache import F16_P_SHIFT, _descale_strides, _optional_meta, _paging

ROWS = gl.constexpr(16)  # the mma tile's rows: a KV head's query heads (at most 16)
HEAD_DIMS = (64, 128, 256)  # _tile_layout's
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _tile_layout(block_n, head_dim, for_v):
    """[keys, D] of a K or V tile as lanes read it, each lane's registers along D first, then the
    keys' bits from 8 up. At D = 128:
    K: lane (key k % 8, q) holds D = 32q .. 32q + 31 of keys k % 8 + 8i;
    V (for_v): lane (q, n) holds D = 16n .. 16n + 15 of keys 2q, 2q + 1 (+ 8i).
    D = 64 halves those runs; D = 256 is two D = 128 halves, the upper one at + 128 in the lane's
    registers (so the lanes' 16-byte reads of one instruction stay on distinct banks)."""
    half = _half(head_dim)
    w = half // 8 if for_v else half // 4
    regs = [[0, 1 << i] for i in range(w.bit_length() - 1)] + ([[0, 128]] if head_dim == 256 else [])
    if for_v:
        regs, lanes = regs + [[1, 0]], [[2, 0], [4, 0], [0, w], [0, 2 * w], [0, 4 * w]]
    else:
        lanes = [[0, w], [0, 2 * w], [1, 0], [2, 0], [4, 0]]
    upper_keys = [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs + upper_keys, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, head_dim])


@gluon.constexpr_function
def _ring_layout(head_dim):
    """A K/V ring slot's swizzle: rows of D bytes in 16-byte units, a unit's index xor'd with its row's
    phase (two rows a phase at D = 64, where two rows share a 128-byte line)."""
    return gl.SwizzledSharedLayout(vec=16, per_phase=2 if head_dim == 64 else 1,
                                   max_phase=4 if head_dim == 64 else 8, order=[1, 0])


@gluon.constexpr_function
def _half(head_dim):
    """The run of D laid out as at D = 128: D itself up to 128; D = 256 is two such halves."""
    return min(head_dim, 128)


@gluon.jit
def _qk_d(d, HEAD_DIM: gl.constexpr):
    """The D that position d of S's reduction reads (K's lane q holds _tile_layout's D's), each half
    of D laid out alike: d = 16s + 8h + 2q + e -> 128 (s // 8) + (half / 4) q + 4 (s % 8) + 2h + e."""
    HALF: gl.constexpr = _half(HEAD_DIM)
    s = d >> 4
    return 128 * (s >> 3) + HALF // 4 * ((d >> 1) & 3) + 4 * (s & 7) + 2 * ((d >> 3) & 1) + (d & 1)


@gluon.jit
def _k_transposed(k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """K^T in S's order of D (_qk_d): [keys, D] -> [d, keys], a relabelling of the lanes' registers:
    D = 128u + (half / 4) q + 4s + 2h + e -> d = 128u + 16s + 8h + 2q + e."""
    HALF: gl.constexpr = _half(HEAD_DIM)
    kt = k.reshape([BLOCK_N, HEAD_DIM // HALF, 4, HALF // 16, 2, 2]).permute((1, 3, 4, 2, 5, 0))
    return kt.reshape([HEAD_DIM, BLOCK_N])


@gluon.jit
def _v_columns(v, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """V in P V's order of columns (_out_d): [keys, D] -> [keys, c], a relabelling of the lanes' registers:
    D = 128u + (half / 8) n + j -> c = 128u + 8j + n."""
    HALF: gl.constexpr = _half(HEAD_DIM)
    vc = v.reshape([BLOCK_N, HEAD_DIM // HALF, 8, HALF // 8]).permute((0, 1, 3, 2))
    return vc.reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _out_d(c, HEAD_DIM: gl.constexpr):
    """The D of P V's column c: lane n of the 8-column n-tile t holds V's D = (half / 8) n + t of its
    half of D."""
    HALF: gl.constexpr = _half(HEAD_DIM)
    return 128 * (c >> 7) + HALF // 8 * (c % 8) + (c & 127) // 8


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


@gluon.jit
def _tile_start(t, n_sink0, lo, n_win, main_end, BLOCK_N: gl.constexpr, HAS_SINK_TOKENS: gl.constexpr):
    """First key of tile t of a sequence's tiles: n_sink0 tiles of sink tokens from key 0, n_win
    tiles of the window from lo, then sink tokens from main_end."""
    if HAS_SINK_TOKENS:
        return gl.where(t < n_sink0, t * BLOCK_N,
                        gl.where(t < n_sink0 + n_win, lo + (t - n_sink0) * BLOCK_N,
                                 main_end + (t - n_sink0 - n_win) * BLOCK_N))
    return lo + t * BLOCK_N


@gluon.jit
def _tanh(x):
    """tanh through exp2, saturating to +-1 for large |x| (as common.tanh)."""
    e = gl.exp2(-2.0 * LOG2E * gl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return gl.where(x < 0, -t, t)


@gluon.jit(do_not_specialize=["num_splits", "seqlen_q", "window_left", "window_right", "sink_size"])
def decode_fp8_kernel(Q, K, V, O, LSE, KDescale, VDescale, SeqlensK, CacheBatchIdx, BlockTable, KvIndptr, Alibi,
                      Sinks, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                      stride_vh, stride_ob, stride_om, stride_oh, stride_os, stride_lb, stride_lh, stride_lm,
                      stride_ls, stride_kdb, stride_kdh, stride_vdb, stride_vdh, stride_btb, page_size,
                      stride_alibib, stride_alibih, nheads_k, seqlen_q, num_splits, scale, softcap, window_left,
                      window_right, sink_size,
                      HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      Q_BF16: gl.constexpr,
                      HAS_CACHE_BATCH_IDX: gl.constexpr, PAGED: gl.constexpr,
                      TABLE_INDPTR: gl.constexpr, PAGE_PER_TILE: gl.constexpr, PAGE_SHIFT: gl.constexpr,
                      ALIGN_BOTTOM_RIGHT: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      HAS_SINK_TOKENS: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                      FOLD_SINKS: gl.constexpr):
    mma: gl.constexpr = _mma_layout()
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    k_layout: gl.constexpr = _tile_layout(BLOCK_N, HEAD_DIM, False)
    v_layout: gl.constexpr = _tile_layout(BLOCK_N, HEAD_DIM, True)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
    ring_layout: gl.constexpr = _ring_layout(HEAD_DIM)
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
    diag = 0  # query i's diagonal key is i + diag
    if ALIGN_BOTTOM_RIGHT:
        diag = len_k - seqlen_q
    # The sequence's key tiles: the sink tokens left of the window, the window [lo, hi) (lo rounded
    # down to a tile), the sink tokens right of it (splitkv_kernel's three ranges); the splits take
    # equal runs of these tiles (a window's keys, not [0, len_k), are what is split).
    lo = 0
    hi = len_k
    if HAS_LEFT:
        lo = gl.maximum(diag - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = gl.minimum(seqlen_q + diag + window_right, len_k)
    hi = gl.maximum(hi, lo)
    n_win = gl.cdiv(hi - lo, BLOCK_N)
    main_end = lo + n_win * BLOCK_N
    n_sink0 = 0
    n_all = n_win
    if HAS_SINK_TOKENS:
        n_sink0 = gl.cdiv(gl.minimum(gl.minimum(sink_size, lo), len_k), BLOCK_N)
        n_all = n_sink0 + n_win + gl.cdiv(gl.maximum(gl.minimum(sink_size, len_k) - main_end, 0), BLOCK_N)
    chunk = gl.cdiv(n_all, num_splits)
    t_lo = split * chunk
    t_end = gl.minimum(t_lo + chunk, n_all)  # this program's tiles: t_lo .. t_end - 1
    n_tiles = gl.maximum(t_end - t_lo, 0)
    # Every query row sees every key of a tile starting at n0 with full_lo <= n0 <= full_hi - BLOCK_N
    full_lo = 0
    full_hi = len_k
    if HAS_LEFT:
        full_lo = seqlen_q - 1 + diag - window_left
    if HAS_RIGHT:
        full_hi = gl.minimum(diag + window_right + 1, len_k)

    # q: row r of the tile is query r // GROUP of head hk * GROUP + r % GROUP (rows past GROUP *
    # seqlen_q are zeros), its columns in S's order of D; bf16 scaled by 2**e into fp16's range
    # (the logit scale takes 2**-e).
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    b64 = b.to(gl.int64)
    q = gl.load(Q + b64 * stride_qb + (r // GROUP * stride_qm + (hk * GROUP + r % GROUP) * stride_qh)[:, None]
                + _qk_d(d, HEAD_DIM)[None, :], mask=(r < GROUP * seqlen_q)[:, None], other=0.0).to(gl.float32)
    scale = scale * gl.load(KDescale + b * stride_kdb + hk * stride_kdh)
    if Q_BF16:
        amax = gl.max(gl.max(gl.abs(q), 1), 0)
        e = gl.minimum(gl.maximum(14 - (((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127), -126), 126)
        q = q * _pow2(e)
        scale = scale * _pow2(-e)
    scale = scale * LOG2E  # logits in log2 units (exp2 below)
    if HAS_SOFTCAP:
        cap_scale = 2.0 * scale / softcap  # exp2 of this times the product is e^(2 y), y = logit / softcap
        cap_log2 = softcap * LOG2E
    q_op = gl.convert_layout(q.to(gl.float16), a_layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    query = rows // GROUP
    h = hk * GROUP + rows % GROUP
    row_ok = rows < GROUP * seqlen_q
    if HAS_ALIBI:
        slope = gl.load(Alibi + b * stride_alibib + h * stride_alibih, mask=row_ok, other=0.0).to(gl.float32) * LOG2E

    k_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    k_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, k_layout))
    # V's copies: 16 bytes a lane as its reads at D >= 128; at D = 64 (8 bytes a key a lane) as K's
    v_copy: gl.constexpr = k_layout if HEAD_DIM == 64 else v_layout
    v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_copy))
    v_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, v_copy))
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
    # The ring's first tiles; a paged cache's page ids are loaded a tile before their copies are
    # issued (carried in the loop), so the copies do not wait on the table's latency. Copies of
    # the tiles past the program's last read nothing (limit 0: zero-filled).
    k_row0 = b_row.to(gl.int64) * stride_kb
    v_row0 = b_row.to(gl.int64) * stride_vb
    for i in gl.static_range(STAGES):
        n_i = _tile_start(t_lo + i, n_sink0, lo, n_win, main_end, BLOCK_N, HAS_SINK_TOKENS)
        limit = gl.where(t_lo + i < t_end, len_k, 0)
        if PAGED:
            k_pages = _page_ids(n_i + k_rows, n_i, limit, BlockTable, table_row, page_size, PAGE_PER_TILE, PAGE_SHIFT)
            v_pages = _page_ids(n_i + v_rows, n_i, limit, BlockTable, table_row, page_size, PAGE_PER_TILE, PAGE_SHIFT)
        if i < STAGES - 1:
            if PAGED:
                k_offsets = _paged_offsets(k_pages, n_i + k_rows, page_size, stride_kb, stride_kn, PAGE_SHIFT)
                v_offsets = _paged_offsets(v_pages, n_i + v_rows, page_size, stride_vb, stride_vn, PAGE_SHIFT)
            else:
                k_offsets = k_row0 + (n_i + k_rows).to(gl.int64) * stride_kn
                v_offsets = v_row0 + (n_i + v_rows).to(gl.int64) * stride_vn
            _copy_tile(k_ring, i, k_base, k_offsets, n_i + k_rows, k_cols, limit)
            _copy_tile(v_ring, i, v_base, v_offsets, n_i + v_rows, v_cols, limit)
            async_copy.commit_group()
    for j in range(n_tiles):
        n0 = _tile_start(t_lo + j, n_sink0, lo, n_win, main_end, BLOCK_N, HAS_SINK_TOKENS)
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # every lane's copies of tile j landed, every lane read slot (j - 1) % STAGES
        k8 = k_ring.index(j % STAGES).load(k_layout)
        v8 = v_ring.index(j % STAGES).load(v_layout)
        ahead = j + STAGES - 1
        n_ahead = _tile_start(t_lo + ahead, n_sink0, lo, n_win, main_end, BLOCK_N, HAS_SINK_TOKENS)
        limit = gl.where(t_lo + ahead < t_end, len_k, 0)
        if PAGED:
            k_offsets = _paged_offsets(k_pages, n_ahead + k_rows, page_size, stride_kb, stride_kn, PAGE_SHIFT)
            v_offsets = _paged_offsets(v_pages, n_ahead + v_rows, page_size, stride_vb, stride_vn, PAGE_SHIFT)
            n_next = _tile_start(t_lo + ahead + 1, n_sink0, lo, n_win, main_end, BLOCK_N, HAS_SINK_TOKENS)
            limit_next = gl.where(t_lo + ahead + 1 < t_end, len_k, 0)
            k_pages = _page_ids(n_next + k_rows, n_next, limit_next, BlockTable, table_row, page_size, PAGE_PER_TILE,
                                PAGE_SHIFT)
            v_pages = _page_ids(n_next + v_rows, n_next, limit_next, BlockTable, table_row, page_size, PAGE_PER_TILE,
                                PAGE_SHIFT)
        else:
            k_offsets = k_row0 + (n_ahead + k_rows).to(gl.int64) * stride_kn
            v_offsets = v_row0 + (n_ahead + v_rows).to(gl.int64) * stride_vn
        _copy_tile(k_ring, ahead % STAGES, k_base, k_offsets, n_ahead + k_rows, k_cols, limit)
        _copy_tile(v_ring, ahead % STAGES, v_base, v_offsets, n_ahead + v_rows, v_cols, limit)
        async_copy.commit_group()
        kt = _k_transposed(k8.to(gl.float16), BLOCK_N, HEAD_DIM)
        s = mma_v2(q_op, gl.convert_layout(kt, b_layout), gl.zeros([ROWS, BLOCK_N], gl.float32, mma))
        c = n0 + key_cols
        if HAS_SOFTCAP:  # softcap * tanh(s * scale / softcap), tanh(y) = 1 - 2 / (1 + e^2y), in log2 units
            s = cap_log2 - 2.0 * cap_log2 * gl.fdiv(gl.full_like(s, 1.0), 1.0 + gl.exp2(s * cap_scale))
        else:
            s = s * scale
        if HAS_ALIBI:
            s = s - slope[:, None] * gl.abs(query[:, None] + diag - c[None, :]).to(gl.float32)
        # SPEC step 4 (common.visible) and the sequence's end, on the tiles that need it (a uniform
        # branch: the window's inner tiles are seen whole by every query row)
        if (n0 < full_lo) | (n0 + BLOCK_N > full_hi):
            seen = (c < len_k)[None, :] & (query >= 0)[:, None]
            if HAS_LEFT:
                seen = seen & (c[None, :] >= (query + diag - window_left)[:, None])
            if HAS_RIGHT:
                seen = seen & (c[None, :] <= (query + diag + window_right)[:, None])
            if HAS_SINK_TOKENS:
                seen = seen | (c < gl.minimum(sink_size, len_k))[None, :]
            s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_safe - F16_P_SHIFT)[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        vt = _v_columns(v8.to(gl.float16), BLOCK_N, HEAD_DIM)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_layout), gl.convert_layout(vt, b_layout), acc)
    async_copy.wait_group(0)  # (the ring's copies past the last tile, all masked off)

    if FOLD_SINKS:  # one split: the sink logit joins the denominator here (else the combine adds it)
        sink = gl.load(Sinks + h, mask=row_ok, other=float("-inf")).to(gl.float32) * LOG2E
        m_fin = gl.maximum(m_i, sink)
        m_fin = gl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = gl.exp2(m_i - m_fin)
        l_i = l_i * alpha + gl.exp2(sink - (m_fin - F16_P_SHIFT))
        acc = acc * alpha[:, None]
        m_i = m_fin
    acc = acc * gl.load(VDescale + b * stride_vdb + hk * stride_vdh)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe) - F16_P_SHIFT) * LN2)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    d_out = _out_d(cols, HEAD_DIM)  # O's columns back in D's order
    o_rows = split.to(gl.int64) * stride_os + b64 * stride_ob + query * stride_om + h * stride_oh
    gl.store(O + o_rows[:, None] + d_out[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    gl.store(LSE + split * stride_ls + b * stride_lb + h * stride_lh + query * stride_lm, lse, mask=row_ok)


def products_dtype(q_dtype: torch.dtype, kv_fp8: bool = True) -> torch.dtype:
    """The dtype of this kernel's products: always fp16 (bf16 queries scaled into its range)."""
    return torch.float16


def compile_spec(dtype: str, block_n: int, num_stages: int, *, cache: str = "fp8e4nv", split: bool = True,
                 group: int = 4, page_size: int = 0, head_dim: int = 128, **features) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `decode_fp8_kernel` for an ahead-of-time compile (fmha
    kernels build) without a GPU: q and a final output in `dtype` ("fp16" or "bf16"), a `cache`
    ("fp8e4nv" or "fp8e5") cache, partial outputs (split) or the final one, `group` query heads
    a KV head, a contiguous cache (page_size 0) or a block table of pages of `page_size` keys,
    head dim `head_dim` (64, 128 or 256); `features`: the kernel's mask and score constexprs
    (HAS_LEFT=True, ...), off by default."""
    pointers = {"Q": dtype, "K": cache, "V": cache, "O": "fp32" if split else dtype, "LSE": "fp32",
                "KDescale": "fp32", "VDescale": "fp32", "SeqlensK": "i32", "CacheBatchIdx": "i32",
                "BlockTable": "i32", "KvIndptr": "i32", "Alibi": "fp32", "Sinks": "fp32"}
    paged = page_size > 0
    constexprs = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_N=block_n, STAGES=num_stages, Q_BF16=dtype == "bf16",
                      HAS_CACHE_BATCH_IDX=False, PAGED=paged, TABLE_INDPTR=False,
                      PAGE_PER_TILE=paged and page_size % block_n == 0,
                      PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1,
                      ALIGN_BOTTOM_RIGHT=True, HAS_LEFT=False, HAS_RIGHT=False, HAS_SINK_TOKENS=False,
                      HAS_SOFTCAP=False, HAS_ALIBI=False, FOLD_SINKS=False)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim}: decode_fp8_kernel takes {list(HEAD_DIMS)}")
    unknown = set(features) - set(constexprs)
    if unknown:
        raise ValueError(f"decode_fp8_kernel has no constexpr {sorted(unknown)}")
    constexprs.update(features)
    signature = {name: "*" + pointers[name] if name in pointers else "fp32" if name in ("scale", "softcap")
                 else "constexpr" if name in constexprs else "i32" for name in decode_fp8_kernel.arg_names}
    return signature, constexprs, {"num_warps": 1}


def launch_attention(q, k_cache, v_cache, o, lse, *, seqlens_k=None, block_table=None, kv_indptr=None,
                     kv_last_page_len=None, cache_batch_idx=None, alibi_slopes=None, sinks=None, num_splits: int,
                     scale: float, softcap: float = 0.0, window: tuple[int, int] = (-1, -1), sink_size: int = 0,
                     align_bottom_right: bool = True, block_n: int, num_stages: int, k_descale=None, v_descale=None,
                     **_triton_only) -> launch_cache.Planned | None:
    """`kvcache.launch_attention`'s contract for what this kernel serves (the registry's
    `fp8_decode` signature): q (B, Sq, Hq, D) fp16/bf16, D 64, 128 or 256, with Sq * Hq / Hk <= 16 (no
    packed varlen queries); caches (B_cache, S, Hk, D) or pages, float8; o, lse final (one split:
    (B, Sq, Hq, D), (B, Hq, Sq)) or partials ((splits, B, Hq, Sq, D) fp32, (splits, B, Hq, Sq)).
    Returns the launch plan this call ran or made, `Planned.launch(q, k_cache, v_cache, o, lse,
    lengths, block_table, kv_indptr, k_descale, v_descale, cache_batch_idx, alibi_slopes, sinks)`
    repeating it (the last three may be left out where the call had none)."""
    _check_scope(_triton_only, q.shape[3], q.shape[1] * (q.shape[2] // k_cache.shape[2]))
    # the kernel's SeqlensK: the key counts, or kv_last_page_len with indptr tables
    lengths = kv_last_page_len if kv_indptr is not None else seqlens_k
    key = None
    if launch_cache.plans_enabled(decode_fp8_kernel):
        tables = _optional_meta(block_table, kv_indptr)
        key = (q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
               k_cache.dtype, o.shape, o.stride(), o.dtype, lse.shape, lse.stride(),
               tuple((d.shape, d.stride()) if d is not None else None for d in (k_descale, v_descale)),
               lengths.dtype, tuple(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache, o, lse, lengths)), tables,
               _optional_meta(cache_batch_idx, alibi_slopes, sinks), launch_cache.current_device(), num_splits,
               scale, softcap, window, sink_size, align_bottom_right, block_n, num_stages)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale,
                           cache_batch_idx, alibi_slopes, sinks)
            return planned
    batch, seqlen_q, nheads_q, _ = q.shape
    nheads_k = k_cache.shape[2]
    split = num_splits > 1
    if split:  # (splits, B, Hq, Sq, D), (splits, B, Hq, Sq): kernel order (batch, query, head, split)
        o_strides = (o.stride(1), o.stride(3), o.stride(2), o.stride(0))
        lse_strides = (lse.stride(1), lse.stride(2), lse.stride(3), lse.stride(0))
    else:  # (B, Sq, Hq, D), (B, Hq, Sq)
        o_strides = (*o.stride()[:3], 0)
        lse_strides = (*lse.stride(), 0)
    grid = (batch * nheads_k * num_splits,)
    if grid[0] == 0 or seqlen_q == 0:
        return None
    left, right = window
    # at one query aligned bottom-right a right edge >= 0 hides no key (the query is the last)
    has_right = right >= 0 and not (align_bottom_right and seqlen_q == 1)
    paging = _paging(block_table, kv_indptr, k_cache.shape[1], block_n)
    tail = (*q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *lse_strides,
            *_descale_strides(k_cache, k_descale), *_descale_strides(k_cache, v_descale), paging.pop("stride_btb"),
            paging.pop("page_size"), *alibi_strides(alibi_slopes), nheads_k, seqlen_q, num_splits, scale, softcap,
            left, right, sink_size)
    tensors = _tensors(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale,
                       cache_batch_idx, alibi_slopes, sinks)
    plan = launch_cache.make_plan(decode_fp8_kernel, grid, *tensors, *tail, HEAD_DIM=q.shape[3],
                                  GROUP=nheads_q // nheads_k,
                                  BLOCK_N=block_n, STAGES=num_stages, Q_BF16=q.dtype == torch.bfloat16,
                                  HAS_CACHE_BATCH_IDX=cache_batch_idx is not None, **paging,
                                  ALIGN_BOTTOM_RIGHT=align_bottom_right, HAS_LEFT=left >= 0, HAS_RIGHT=has_right,
                                  HAS_SINK_TOKENS=sink_size > 0, HAS_SOFTCAP=softcap > 0,
                                  HAS_ALIBI=alibi_slopes is not None, FOLD_SINKS=sinks is not None and not split,
                                  num_warps=1)
    return launch_cache.keep(_PLANS, key, plan, decode_fp8_kernel, tail, _tensors)


def _check_scope(args: dict, head_dim: int, rows: int) -> None:
    """The arguments of kvcache.launch_attention this kernel does not take must be neutral, its head
    dim one of HEAD_DIMS and its query rows a (sequence, KV head) at most 16 (the registry's
    `fp8_decode` signature keeps other calls on the Triton kernel)."""
    offside = [name for name in ("cu_seqlens_q",) if args.get(name) is not None]
    if args.get("max_seqlen_q", 0):
        offside.append("max_seqlen_q")
    if head_dim not in HEAD_DIMS:
        offside.append(f"head dim {head_dim} (only {list(HEAD_DIMS)})")
    if rows > ROWS:
        offside.append(f"{rows} query rows a (sequence, KV head) (seqlen_q x query heads per KV head; at most {ROWS})")
    if offside:
        raise ValueError(f"the Gluon fp8 decode does not take {', '.join(offside)}: the dispatcher's fp8_decode "
                         f"signature should have refused this call")


def _tensors(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale,
             cache_batch_idx=None, alibi_slopes=None, sinks=None) -> tuple:
    """decode_fp8_kernel's leading (tensor) arguments, in `Planned.launch`'s order (an absent descale
    is 1; `lengths` stands in for the other absent tensors)."""
    one = None if k_descale is not None and v_descale is not None else unit_descale(q.device)
    rest = tuple(t if t is not None else lengths
                 for t in (cache_batch_idx, block_table, kv_indptr, alibi_slopes, sinks))
    return (q, k_cache, v_cache, o, lse, k_descale if k_descale is not None else one,
            v_descale if v_descale is not None else one, lengths, *rest)


_PLANS = launch_cache.plan_table()

