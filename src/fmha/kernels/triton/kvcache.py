"""KV-cache kernels: families `fwd_splitkv`, `splitkv_combine` and `append_kv`.

`splitkv_kernel`: attention of q (B, Sq, Hq, D), or packed varlen queries
(total_q, Hq, D) with `cu_seqlens_q` (batch prefill), over a KV cache: contiguous
(B_cache, S_cache, Hk, D) (optionally rows picked by `cache_batch_idx`) or paged
(num_pages, page_size, Hk, D). Pages are found through a vLLM-style `block_table`
(row b at b * stride) or FlashInfer/SGLang tables (row b at `kv_indptr[b]` of the flat
`kv_indices`); both are one "table row" per sequence. Per-batch key counts are read on
the device (no host synchronisation, CUDA-graph safe): `seqlens_k[b]`, or with
FlashInfer/SGLang tables computed in the kernel from `kv_indptr` and `kv_last_page_len`
(no per-call conversion of the tables on the host). With several splits each program
covers one slice of the keys and writes an fp32 partial output and its LSE;
`combine_kernel` merges them (also the engine of `fmha.merge_states`).
`rotary_append_kernel`: rotates rows (RoPE, interleaved or half-split) and writes them
to a destination: new keys into the cache at `cache_seqlens[b] + t`, or queries into a
rotated copy.

Masks, soft-cap and ALiBi come from `common`, shared with the other families.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..launch import cache as launch_cache
from ..launch.args import alibi_strides, cdiv, padded_dim, unit_descale
from .common import LN2, LOG2E, key_range, modify_logits, visible


@triton.jit
def _table_row(b, b_row, KvIndptr, stride_btb, TABLE_INDPTR: tl.constexpr):
    """Offset of sequence b's page ids in the page table: b_row * stride (block_table) or
    kv_indptr[b] (FlashInfer/SGLang kv_indices)."""
    if TABLE_INDPTR:
        return tl.load(KvIndptr + b)
    return b_row * stride_btb


@triton.jit
def _seqlen_k(b, table_row, SeqlensK, KvIndptr, page_size, TABLE_INDPTR: tl.constexpr):
    """Keys of sequence b: SeqlensK[b]; with FlashInfer/SGLang tables SeqlensK is
    kv_last_page_len and table_row is kv_indptr[b]: (pages - 1) * page_size +
    kv_last_page_len[b], or 0 for a sequence without pages."""
    if TABLE_INDPTR:
        pages = tl.load(KvIndptr + b + 1) - table_row
        return tl.where(pages > 0, (pages - 1) * page_size + tl.load(SeqlensK + b), 0)
    return tl.load(SeqlensK + b)


@triton.jit
def _kv_slots(b_row, Table, table_row, page_size, n0, len_k, PAGED: tl.constexpr, PAGE_PER_TILE: tl.constexpr,
              PAGE_SHIFT: tl.constexpr, OFFSETS_32: tl.constexpr, BLOCK_N: tl.constexpr):
    """(slot, token) of the keys n0 + arange(BLOCK_N) of one sequence: the cache row or
    page id and the position in it; page ids past len_k are not read. PAGE_PER_TILE:
    page_size and n0 are multiples of BLOCK_N, so the tile is in one page: one id is loaded.
    PAGE_SHIFT >= 0: page_size is 2**PAGE_SHIFT, so the page of a key is a shift, not an
    integer division by a run-time value. OFFSETS_32: slots stay int32 (the launcher checked
    that every offset into the caches fits)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    if PAGED:
        if PAGE_PER_TILE:
            page_idx = n0 // page_size
            slot = tl.load(Table + table_row + page_idx, mask=n0 < len_k, other=0)
            tok = cols - page_idx * page_size
        elif PAGE_SHIFT >= 0:
            slot = tl.load(Table + table_row + (cols >> PAGE_SHIFT), mask=cols < len_k, other=0)
            tok = cols & ((1 << PAGE_SHIFT) - 1)
        else:
            slot = tl.load(Table + table_row + cols // page_size, mask=cols < len_k, other=0)
            tok = cols % page_size
    else:
        slot = b_row
        tok = cols
    if not OFFSETS_32:
        slot = slot.to(tl.int64)
    return slot, tok


@triton.jit
def _kv_rows(slot, tok, stride_row, stride_tok, hk, stride_h, OFFSETS_32: tl.constexpr):
    """Element offsets [BLOCK_N] of the cache entries (slot, tok) of KV head hk."""
    if OFFSETS_32:
        rows = slot * stride_row + tok * stride_tok + hk * stride_h
    else:
        rows = slot * stride_row + tok.to(tl.int64) * stride_tok + hk * stride_h
    return rows


# float8 caches (KV_FP8) in compiled kernels: each loaded K/V element converted by inline PTX
# (`_dequantized`), once, on the load's layout. Triton's own `.to(bf16)` is moved into the dots'
# operand loads, so the fp8 tile is read from shared memory in the operand layout (V byte by byte:
# its keys are not the contiguous dimension) and each element converted twice (fp8 -> f16 -> bf16)
# on the slow conversion pipe (attempt 56, docs/performance.md). False: Triton's conversion.
FP8_ASM = True
# With FP8_ASM, K's conversion at the dot (pure: Triton moves it into the operand loads, which read
# K's fp8 rows 8 bytes at a time, its reduction dimension being the contiguous one), V's on the
# load's layout (through shared memory as 16-bit: its operand loads would be byte loads). Shared
# memory wavefronts limited the decode (ncu: 76% L1 pipe, 21% of them bank-conflicted bf16
# stores); this halves the 16-bit stores (attempt 58). False: both on the load's layout.
FP8_K_AT_DOT = True
# bf16 queries over a float8 cache: the products in fp16 (q scaled by a power of two into fp16's
# range, P by 2**F16_P_SHIFT), since float8 -> fp16 is one cvt a pair where float8 -> bf16 goes
# on through fp32 (three more instructions a pair): 1.39x -> 1.53x the bf16 cache's decode at 8k
# keys, 1.51x -> 1.52x at 32k (attempt 104). Exact for q and the cache; P keeps 3 more bits than
# in bf16. False: the products in bf16, as over a bf16 cache.
FP8_F16_DOTS = True
# P * 2**15 <= 32768 fits fp16 (65504), and a p that fp16 would flush (below 2**-24 / 2**15) adds
# under 2**-40 a key to a row sum of at least 1. l and O carry the same factor; the LSE drops it.
F16_P_SHIFT = tl.constexpr(15)

# fp8 pairs -> f16 pairs (the hardware's cvt), 4 elements an instance: $2 holds 4 bytes, $0 and
# $1 two halves each; for bf16 on through fp32 (exact: every fp8 value is an f16 and a bf16 value).
_TO_F16 = """{{
.reg .b16 a0, a1;
mov.b32 {{a0, a1}}, $2;
cvt.rn.f16x2.{fmt} $0, a0;
cvt.rn.f16x2.{fmt} $1, a1;
}}"""
_TO_BF16 = """{{
.reg .b16 a0, a1;
.reg .b32 h0, h1;
.reg .f16 f0, f1, f2, f3;
.reg .f32 g0, g1, g2, g3;
mov.b32 {{a0, a1}}, $2;
cvt.rn.f16x2.{fmt} h0, a0;
cvt.rn.f16x2.{fmt} h1, a1;
mov.b32 {{f0, f1}}, h0;
mov.b32 {{f2, f3}}, h1;
cvt.f32.f16 g0, f0;
cvt.f32.f16 g1, f1;
cvt.f32.f16 g2, f2;
cvt.f32.f16 g3, f3;
cvt.rn.bf16x2.f32 $0, g1, g0;
cvt.rn.bf16x2.f32 $1, g3, g2;
}}"""


@triton.constexpr_function
def _fp8_ptx(fp8, dtype):
    """The conversion's PTX from float8 `fp8` (e4m3 or e5m2) to `dtype` (fp16 or bf16)."""
    fmt = "e4m3x2" if fp8 == tl.float8e4nv else "e5m2x2"
    return (_TO_F16 if dtype == tl.float16 else _TO_BF16).format(fmt=fmt)


@triton.jit
def _dequantized(x, dtype: tl.constexpr, FP8_ASM: tl.constexpr, AT_DOT: tl.constexpr = False):
    """A float8 tile in `dtype` (exact). FP8_ASM (fp16/bf16 `dtype`): by inline PTX, kept where
    the tile was loaded (impure, so no pass moves it into a dot's operand load), or with AT_DOT
    marked pure, which lets Triton place it at the dot's operand loads; else Triton's `.to`."""
    if FP8_ASM and dtype.primitive_bitwidth == 16:
        return tl.inline_asm_elementwise(_fp8_ptx(x.dtype, dtype), "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=dtype.value, is_pure=AT_DOT, pack=4)  # (dtype: a constexpr)
    else:
        return x.to(dtype)


@triton.constexpr_function
def _dot_dtype(f16_dots, q_dtype):
    """The products' input dtype: fp16 with F16_DOTS, else q's."""
    return tl.float16 if f16_dots else q_dtype


@triton.jit
def _pow2(n):
    """2.0**n for integer n in [-126, 127], exact (the float's exponent bits)."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _q_in_f16(q):
    """(q * 2**e in fp16, 2**-e): e puts q's largest |value| in [2**14, 2**15), so that every
    bf16 value of q at most 2**28 below it is exact in fp16 (e clamped to [-126, 126]; zeros,
    infinities and NaN stay what they are)."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    floor_log2 = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(14 - floor_log2, -126), 126)
    return (q.to(tl.float32) * _pow2(e)).to(tl.float16), _pow2(-e)


@triton.jit(do_not_specialize=["window_left", "window_right", "sink_size"])
def splitkv_kernel(
    Q, K, V, O, LSE, Alibi, Sinks, BlockTable, KvIndptr, CacheBatchIdx, SeqlensK, CuSeqlensQ, KDescale, VDescale,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_os,
    stride_lb, stride_lh, stride_lm, stride_ls,
    stride_btb, page_size, stride_alibib, stride_alibih, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    batch, nheads_q, group_size, seqlen_q, head_dim_qk, head_dim_v, num_splits,
    scale, softcap, window_left, window_right, sink_size,
    PAGED: tl.constexpr, TABLE_INDPTR: tl.constexpr, PAGE_PER_TILE: tl.constexpr, PAGE_SHIFT: tl.constexpr,
    OFFSETS_32: tl.constexpr, KV_SAME_STRIDES: tl.constexpr,
    HAS_CACHE_BATCH_IDX: tl.constexpr, IS_VARLEN: tl.constexpr, ALIGN_BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr = False, FP8_ASM: tl.constexpr = False, FP8_K_AT_DOT: tl.constexpr = False,
    F16_DOTS: tl.constexpr = False, LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    # KV_FP8: float8 caches, dequantized on load to the products' dtype (exact); the k descale of
    # (b, hk) folds into the logit scale, the v descale multiplies the output. FP8_ASM: the
    # conversion by inline PTX (`_dequantized`; compiled kernels only), FP8_K_AT_DOT: K's at
    # the dot's operand loads (see the module's FP8_K_AT_DOT). F16_DOTS (bf16 q, float8 cache):
    # the products in fp16 (the module's FP8_F16_DOTS), P and so l and O times 2**F16_P_SHIFT.
    # GQA packing: the query rows of all `group_size` heads that share one KV head form
    # the tile's M dimension (row r = query i * group_size + head g), so each KV head's
    # keys and values are read once per query block, not once per query head.
    # seqlen_q is the grid's query length (max_seqlen_q for varlen queries).
    num_m = tl.cdiv(seqlen_q * group_size, BLOCK_M)
    nheads_k = nheads_q // group_size
    pid = tl.program_id(0)
    pid_m = pid % num_m
    rest = pid // num_m
    bhk = rest % (batch * nheads_k)
    split = rest // (batch * nheads_k)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    q_start = 0
    len_q = seqlen_q
    if IS_VARLEN:  # packed queries: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
        q_start = tl.load(CuSeqlensQ + b)
        len_q = tl.load(CuSeqlensQ + b + 1) - q_start
    packed = len_q * group_size
    if pid_m * BLOCK_M >= packed:
        return
    b_row = b
    if HAS_CACHE_BATCH_IDX:
        b_row = tl.load(CacheBatchIdx + b)
    table_row = 0
    if PAGED:
        table_row = _table_row(b, b_row, KvIndptr, stride_btb, TABLE_INDPTR)
    len_k = _seqlen_k(b, table_row, SeqlensK, KvIndptr, page_size, TABLE_INDPTR)
    diag_offset = 0
    if ALIGN_BOTTOM_RIGHT:
        diag_offset = len_k - len_q
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = r // group_size  # query index of each packed row (within its sequence)
    q_rows = (q_start + rows).to(tl.int64)  # row in q, o and lse (packed for varlen)
    h = hk * group_size + r % group_size
    row_ok = r < packed
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + q_rows[:, None] * stride_qm + h[:, None] * stride_qh + offs_dq[None, :],
                mask=row_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0)
    alibi_slope = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b * stride_alibib + h * stride_alibih, mask=row_ok, other=0.0)[:, None]

    if KV_FP8:
        scale = scale * tl.load(KDescale + b * stride_kdb + hk * stride_kdh)
    DOT_DTYPE: tl.constexpr = _dot_dtype(F16_DOTS, Q.dtype.element_ty)
    P_SHIFT: tl.constexpr = F16_P_SHIFT if F16_DOTS else 0
    q_dot = q.to(DOT_DTYPE, bitcast=F16_DOTS)  # q itself without F16_DOTS (with it, replaced below)
    if F16_DOTS:
        q_dot, q_unscale = _q_in_f16(q)
        scale = scale * q_unscale
    m_lo = (pid_m * BLOCK_M) // group_size
    m_hi = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, packed) - 1) // group_size + 1
    lo, hi = key_range(m_lo, m_hi, len_k, diag_offset, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The key tiles these rows see, in three ranges: sink tokens left of the window, the window
    # [lo, hi), sink tokens right of the window's last tile. The splits take equal runs of these
    # tiles (so a window's keys, not [0, len_k), are what is split; without a mask, the same
    # BLOCK_N-aligned slices as before). Every tile starts at a multiple of BLOCK_N (lo and
    # main_end are), which PAGE_PER_TILE relies on.
    n_win = tl.cdiv(hi - lo, BLOCK_N)
    main_end = lo + n_win * BLOCK_N
    n_sink0 = 0
    n_sink2 = 0
    if HAS_SINK_TOKENS:
        n_sink0 = tl.cdiv(tl.minimum(tl.minimum(sink_size, lo), len_k), BLOCK_N)
        n_sink2 = tl.cdiv(tl.maximum(tl.minimum(sink_size, len_k) - main_end, 0), BLOCK_N)
    chunk = tl.cdiv(n_sink0 + n_win + n_sink2, num_splits)
    t_lo = split * chunk  # this split's tiles: t_lo .. t_lo + chunk - 1 of the three ranges'
    for part in tl.static_range(3):
        if part == 0:
            first, count, base = 0, n_sink0, 0
        elif part == 1:
            first, count, base = n_sink0, n_win, lo
        else:
            first, count, base = n_sink0 + n_win, n_sink2, main_end
        a = tl.minimum(tl.maximum(t_lo - first, 0), count)
        start = base + a * BLOCK_N
        end = base + tl.maximum(tl.minimum(t_lo + chunk - first, count), a) * BLOCK_N
        # Page ids are loaded one tile ahead (carried through the loop), so the K/V loads
        # of a tile depend on no load of their own iteration and the software pipeline
        # runs as deep for a paged cache as for a contiguous one.
        slot_next, tok_next = _kv_slots(b_row, BlockTable, table_row, page_size, start, len_k,
                                        PAGED, PAGE_PER_TILE, PAGE_SHIFT, OFFSETS_32, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < len_k
            slot, tok = slot_next, tok_next
            slot_next, tok_next = _kv_slots(b_row, BlockTable, table_row, page_size, n0 + BLOCK_N, len_k,
                                            PAGED, PAGE_PER_TILE, PAGE_SHIFT, OFFSETS_32, BLOCK_N)
            k_rows = _kv_rows(slot, tok, stride_kb, stride_kn, hk, stride_kh, OFFSETS_32)
            k = tl.load(K + k_rows[:, None] + offs_dq[None, :],
                        mask=col_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0)
            if KV_FP8:
                k = _dequantized(k, DOT_DTYPE, FP8_ASM, FP8_K_AT_DOT)
            s = tl.dot(q_dot, tl.trans(k), input_precision=DOT_PRECISION) * scale
            if HAS_SOFTCAP or HAS_ALIBI:
                s, _ = modify_logits(s, rows, cols, diag_offset, Q, row_ok[:, None], alibi_slope, softcap,
                                     HAS_SOFTCAP, False, HAS_ALIBI)
            vis = visible(rows, cols, len_q, len_k, diag_offset, window_left, window_right, sink_size,
                          HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
            s = tl.where(vis, s * LOG2E, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_safe - P_SHIFT)[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = k_rows  # K and V share their strides (the usual cache): one set of row offsets
            if not KV_SAME_STRIDES:
                v_rows = _kv_rows(slot, tok, stride_vb, stride_vn, hk, stride_vh, OFFSETS_32)
            v = tl.load(V + v_rows[:, None] + offs_dv[None, :],
                        mask=col_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
            if KV_FP8:
                v = _dequantized(v, DOT_DTYPE, FP8_ASM)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
    if LAUNCH_DEPENDENTS:  # the combine (launched with PDL) may start; its loads wait for this grid's end
        gdc_launch_dependents()
    if HAS_SINKS and not SPLIT:  # with splits the combine adds the sink once
        sink = tl.load(Sinks + h, mask=row_ok, other=float("-inf")) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.math.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.math.exp2(sink - (m_fin - P_SHIFT))
        acc = acc * alpha[:, None]
        m_i = m_fin
    if KV_FP8:
        acc = acc * tl.load(VDescale + b * stride_vdb + hk * stride_vdh)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe) - P_SHIFT) * LN2)
    split64 = split.to(tl.int64)
    tl.store(O + split64 * stride_os + b64 * stride_ob + q_rows[:, None] * stride_om + h[:, None] * stride_oh
             + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v))
    tl.store(LSE + split64 * stride_ls + b64 * stride_lb + h * stride_lh + q_rows * stride_lm, lse, mask=row_ok)


@triton.jit
def combine_kernel(
    Opart, LSEpart, O, LSE, Sinks,
    n_parts, n_rows, nheads, seqlen, head_dim,
    stride_pp, stride_pr, stride_lp,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr = 1,
    WAIT_PRIOR: tl.constexpr = False,
):
    """Merge partial (o, lse) pairs: lse = logsumexp_s lse_s, o = sum_s exp(lse_s - lse) o_s.

    Partial rows r = (b * nheads + h) * seqlen + i; outputs are addressed by (b, h, i).
    The partials of a row are read BLOCK_S at a time as one [BLOCK_M, BLOCK_S, BLOCK_D] tile (all
    of them when n_parts <= BLOCK_S): one trip to memory per BLOCK_S partials, where a loop over
    the partials one by one waited for each load in turn (a split-KV decode's combine is a few
    hundred rows: latency, not bandwidth).
    WAIT_PRIOR (launched with programmatic dependent launch, after the split-KV kernel): waits
    for the grid before it to finish and its writes to be visible before reading the partials.
    """
    if WAIT_PRIOR:
        gdc_wait()
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    dmask = r_ok[:, None] & (offs_d[None, :] < head_dim)
    r64 = r.to(tl.int64)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_parts, BLOCK_S):
        s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        ok = r_ok[:, None] & (s < n_parts)[None, :]
        lse_s = tl.load(LSEpart + s[None, :] * stride_lp + r64[:, None], mask=ok,
                        other=float("-inf")).to(tl.float32)  # [M, S]
        o_s = tl.load(Opart + s[None, :, None] * stride_pp + r64[:, None, None] * stride_pr
                      + offs_d[None, None, :], mask=ok[:, :, None] & (offs_d < head_dim)[None, None, :],
                      other=0.0).to(tl.float32)  # [M, S, D]
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 1)
        l_sum = l_sum * alpha + tl.sum(w, 1)
        m = m_new
    i = r % seqlen
    h = (r // seqlen) % nheads
    b = (r // seqlen // nheads).to(tl.int64)
    if HAS_SINKS:
        sink = tl.load(Sinks + h, mask=r_ok, other=float("-inf"))
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha[:, None]
        l_sum = l_sum * alpha + tl.exp(sink - m_safe)
        m = m_new
    empty = l_sum == 0.0
    l_safe = tl.where(empty, 1.0, l_sum)
    m_out = tl.where(m == float("-inf"), 0.0, m)
    tl.store(O + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_om + offs_d[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_lm,
             tl.where(empty, float("-inf"), m_out + tl.log(l_safe)), mask=r_ok)


@triton.jit
def rotary_append_kernel(
    Src, Dst, Cos, Sin, BlockTable, KvIndptr, CacheBatchIdx, Base, CuSeqlens,
    stride_sb, stride_st, stride_sh,
    stride_db, stride_dt, stride_dh,
    stride_cos, stride_btb, page_size,
    ntok, nheads, head_dim, rotary_half,
    PAGED: tl.constexpr, TABLE_INDPTR: tl.constexpr, HAS_CACHE_BATCH_IDX: tl.constexpr,
    IS_VARLEN: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, DST_AT_BASE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows t of src (B, T, H, D) -> dst at position (Base[b] if DST_AT_BASE else 0) + t,
    rotated at position Base[b] + t when ROTATE (first 2 * rotary_half features).

    IS_VARLEN: src is packed (total, H, D), sequence b its rows CuSeqlens[b] .. [b + 1]
    (ntok is then the longest); a destination that is not the cache is packed the same way.
    """
    num_t = tl.cdiv(ntok, BLOCK_T)
    pid = tl.program_id(0)
    pid_t = pid % num_t
    bh = pid // num_t
    b = bh // nheads
    h = bh % nheads
    start = 0
    len_t = ntok
    if IS_VARLEN:
        start = tl.load(CuSeqlens + b)
        len_t = tl.load(CuSeqlens + b + 1) - start
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < len_t
    d = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (d[None, :] < head_dim)
    base = tl.load(Base + b)
    src_rows = Src + b.to(tl.int64) * stride_sb + (start + t[:, None]).to(tl.int64) * stride_st + h * stride_sh
    x = tl.load(src_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        rot = d < 2 * rotary_half
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            j = d // 2
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:  # halves (j, j + rotary_half)
            j = tl.where(d < rotary_half, d, d - rotary_half)
            partner = tl.where(d < rotary_half, d + rotary_half, d - rotary_half)
            sign = tl.where(d < rotary_half, -1.0, 1.0)
        pos = (base + t).to(tl.int64)
        rmask = mask & rot[None, :]
        cos = tl.load(Cos + pos[:, None] * stride_cos + j[None, :], mask=rmask, other=1.0).to(tl.float32)
        sin = tl.load(Sin + pos[:, None] * stride_cos + j[None, :], mask=rmask, other=0.0).to(tl.float32)
        xp = tl.load(src_rows + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
        x = tl.where(rot[None, :], x * cos + sign[None, :] * xp * sin, x)
    dst_t = start + t
    if DST_AT_BASE:
        dst_t = base + t
    b_row = b
    if HAS_CACHE_BATCH_IDX:
        b_row = tl.load(CacheBatchIdx + b)
    if PAGED:
        table_row = _table_row(b, b_row, KvIndptr, stride_btb, TABLE_INDPTR)
        page = tl.load(BlockTable + table_row + dst_t // page_size, mask=t_ok, other=0)
        rows = page.to(tl.int64) * stride_db + (dst_t % page_size) * stride_dt
    else:
        rows = b_row.to(tl.int64) * stride_db + dst_t.to(tl.int64) * stride_dt
    tl.store(Dst + rows[:, None] + h * stride_dh + d[None, :], x.to(Dst.dtype.element_ty), mask=mask)


def _paging(block_table, kv_indptr, page_size: int, block_n: int) -> dict:
    """Kernel arguments of the page table: a block table (B, max_pages) or, with kv_indptr,
    the flat kv_indices (FlashInfer/SGLang); none for a contiguous cache."""
    paged = block_table is not None
    return dict(
        stride_btb=block_table.stride(0) if paged and kv_indptr is None else 0,
        page_size=page_size if paged else 1,
        PAGED=paged, TABLE_INDPTR=kv_indptr is not None,
        PAGE_PER_TILE=paged and page_size % block_n == 0,
        # pages smaller than a tile: a power-of-two size makes a key's page a shift
        PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1,
    )


def _offsets_fit_int32(*caches) -> bool:
    """Whether every element offset into these caches (any page, token, head, column) fits
    in int32, so the kernel may compute row offsets in 32 bits."""
    return all(sum((n - 1) * st for n, st in zip(c.shape, c.stride(), strict=True)) < 2**31 for c in caches)


def _same_strides(k_cache, v_cache) -> bool:
    """Whether K and V entries sit at the same offsets (page/row, token, head): then the
    kernel computes one set of row offsets for both."""
    return k_cache.stride()[:3] == v_cache.stride()[:3]


def launch_attention(q, k_cache, v_cache, o, lse, *, seqlens_k=None, block_table=None, kv_indptr=None,
                     kv_last_page_len=None, cache_batch_idx=None, cu_seqlens_q=None, max_seqlen_q: int = 0,
                     alibi_slopes=None, sinks=None, num_splits: int, scale: float, softcap: float,
                     window: tuple[int, int], sink_size: int, align_bottom_right: bool,
                     block_m: int, block_n: int, num_warps: int, num_stages: int,
                     dot_precision: str, k_descale=None, v_descale=None) -> launch_cache.Planned | None:
    """q (B, Sq, Hq, D), or packed (total_q, Hq, D) with cu_seqlens_q (B + 1,) and
    max_seqlen_q; caches (B_cache, S, Hk, D) or (pages, page_size, Hk, D) with a
    block_table (B, max_pages), or kv_indptr (B + 1,) and the flat kv_indices as block_table.
    Key counts: seqlens_k (B,), or with kv_indptr the kernel computes them from kv_indptr
    and kv_last_page_len (B,) (then seqlens_k is not used). float8 caches: k_descale and
    v_descale are fp32 (B or 1, Hk or 1) views (zero strides where they broadcast).

    num_splits == 1: o (B, Sq, Hq, Dv) [varlen: (total_q, Hq, Dv)] and lse (B, Hq, Sq)
    [(Hq, total_q)] are final. num_splits > 1: o is (splits, B, Hq, Sq, Dv) fp32
    [(splits, Hq, total_q, Dv)] and lse (splits, B, Hq, Sq) [(splits, Hq, total_q)]: partial
    results whose rows flatten to (b * Hq + h) * Sq + i [h * total_q + i], as
    `launch_combine` reads them.

    Returns the launch plan this call ran or made (None with packed varlen queries):
    `Planned.launch(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale,
    cache_batch_idx, alibi_slopes, sinks)` repeats it (the last three may be left out where the call
    had none), lengths being seqlens_k, or kv_last_page_len with kv_indptr (the descales, index and
    ALiBi slopes: as given here, views of the same shapes and strides, or None).
    """
    varlen = cu_seqlens_q is not None
    # the kernel's SeqlensK: the key counts, or kv_last_page_len with indptr tables
    lengths = kv_last_page_len if kv_indptr is not None else seqlens_k
    if lengths is None:
        raise ValueError("launch_attention needs seqlens_k, or kv_last_page_len with kv_indptr")
    key = None  # a plan (launch_cache) for the queries of a padded batch (not packed varlen ones)
    if not varlen and launch_cache.plans_enabled(splitkv_kernel):
        tables = _optional_meta(block_table, kv_indptr)
        # float8 caches: the descales' shapes and strides (their strides are the kernel's), and
        # the conversion's switches (module constants a test may change)
        fp8 = (tuple((d.shape, d.stride(), d.dtype) if d is not None else None for d in (k_descale, v_descale)),
               FP8_ASM, FP8_K_AT_DOT, FP8_F16_DOTS) if k_cache.element_size() == 1 else None
        key = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), o.shape,
               o.stride(), lse.shape, lse.stride(), q.dtype, k_cache.dtype, v_cache.dtype, o.dtype, lse.dtype,
               lengths.dtype, q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0,
               o.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0, lengths.data_ptr() % 16 == 0, tables, fp8,
               _optional_meta(cache_batch_idx, alibi_slopes, sinks),
               launch_cache.current_device(), num_splits, scale, softcap, window, sink_size, align_bottom_right,
               block_m, block_n, num_warps, num_stages, dot_precision, PDL)
        planned = _ATTENTION_PLANS.get(key)
        if planned is not None:
            planned.launch(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale, v_descale,
                           cache_batch_idx, alibi_slopes, sinks)
            return planned
    if varlen:
        batch, seqlen_q = cu_seqlens_q.numel() - 1, max_seqlen_q
        nheads_q, head_dim_qk = q.shape[1], q.shape[2]
        q_strides = (0, q.stride(0), q.stride(1))
    else:
        batch, seqlen_q, nheads_q, head_dim_qk = q.shape
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
    nheads_k, head_dim_v = k_cache.shape[2], v_cache.shape[-1]
    split = num_splits > 1
    # kernel order: (batch, row, head, split)
    if varlen:
        o_strides = (0, o.stride(2), o.stride(1), o.stride(0)) if split else (0, o.stride(0), o.stride(1), 0)
        lse_strides = (0, lse.stride(1), lse.stride(2), lse.stride(0)) if split else (0, *lse.stride(), 0)
    else:
        o_strides = (o.stride(1), o.stride(3), o.stride(2), o.stride(0)) if split else (*o.stride()[:3], 0)
        lse_strides = (lse.stride(1), lse.stride(2), lse.stride(3), lse.stride(0)) if split else (*lse.stride(), 0)
    left, right = window
    grid = (cdiv(seqlen_q * (nheads_q // nheads_k), block_m) * batch * nheads_k * num_splits,)
    if grid[0] == 0:
        return None
    paging = _paging(block_table, kv_indptr, k_cache.shape[1], block_n)
    # (after the tensors: every argument fixed by the plan's key)
    tail = (*q_strides,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *o_strides, *lse_strides,
            paging.pop("stride_btb"), paging.pop("page_size"), *alibi_strides(alibi_slopes),
            *_descale_strides(k_cache, k_descale), *_descale_strides(k_cache, v_descale),
            batch, nheads_q, nheads_q // nheads_k, seqlen_q, head_dim_qk, head_dim_v, num_splits,
            scale, softcap, left, right, sink_size)
    plan = launch_cache.make_plan(splitkv_kernel, grid,
        *_attention_tensors(q, k_cache, v_cache, o, lse, lengths, alibi_slopes, sinks, block_table, kv_indptr,
                            cache_batch_idx, cu_seqlens_q, k_descale, v_descale),
        *tail,
        **paging, OFFSETS_32=_offsets_fit_int32(k_cache, v_cache),
        KV_SAME_STRIDES=_same_strides(k_cache, v_cache),
        HAS_CACHE_BATCH_IDX=cache_batch_idx is not None, IS_VARLEN=varlen,
        ALIGN_BOTTOM_RIGHT=align_bottom_right, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_SINK_TOKENS=sink_size > 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINKS=sinks is not None, SPLIT=split, DOT_PRECISION=dot_precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=padded_dim(head_dim_qk), BLOCK_DV=padded_dim(head_dim_v),
        num_warps=num_warps, num_stages=num_stages, **_fp8_flags(k_cache, q.dtype),
        LAUNCH_DEPENDENTS=split and _pdl(q),
    )
    return launch_cache.keep(_ATTENTION_PLANS, key, plan, splitkv_kernel, tail, _planned_attention_tensors)


def _attention_tensors(q, k_cache, v_cache, o, lse, lengths, alibi_slopes, sinks, block_table, kv_indptr,
                       cache_batch_idx, cu_seqlens_q, k_descale=None, v_descale=None) -> tuple:
    """splitkv_kernel's leading (tensor) arguments; `lengths` stands in for the absent ones (a
    float8 cache's absent descale is 1: `launch_args.unit_descale`)."""
    def given(t):
        return t if t is not None else lengths

    if k_cache.element_size() == 1:
        k_descale, v_descale = (d if d is not None else unit_descale(k_cache.device) for d in (k_descale, v_descale))
    return (q, k_cache, v_cache, o, lse, given(alibi_slopes), given(sinks), given(block_table), given(kv_indptr),
            given(cache_batch_idx), lengths, given(cu_seqlens_q), given(k_descale), given(v_descale))


def _planned_attention_tensors(q, k_cache, v_cache, o, lse, lengths, block_table, kv_indptr, k_descale=None,
                               v_descale=None, cache_batch_idx=None, alibi_slopes=None, sinks=None) -> tuple:
    """`_attention_tensors` of a planned call (no packed varlen queries), in `Planned.launch`'s order."""
    return _attention_tensors(q, k_cache, v_cache, o, lse, lengths, alibi_slopes, sinks, block_table, kv_indptr,
                              cache_batch_idx, None, k_descale, v_descale)


def _optional_meta(*tensors) -> tuple:
    """A plan key's part for optional tensors (page tables, index, ALiBi slopes, sinks): what the
    launch takes of each (its strides, dtype and alignment; None where absent)."""
    return tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) if t is not None else None for t in tensors)


_ATTENTION_PLANS = launch_cache.plan_table()
_COMBINE_PLANS = launch_cache.plan_table()


def products_dtype(q_dtype: torch.dtype, kv_fp8: bool) -> torch.dtype:
    """The dtype of splitkv_kernel's products: fp16 for bf16 queries over a float8 cache
    (FP8_F16_DOTS), else q's."""
    return torch.float16 if kv_fp8 and FP8_F16_DOTS and q_dtype == torch.bfloat16 else q_dtype


def _fp8_flags(k_cache, q_dtype) -> dict:
    """The float8 constexprs of splitkv_kernel (given explicitly, so that launch_cache keeps the
    launch; the interpreter runs no PTX: CPU tensors take Triton's conversion)."""
    fp8 = k_cache.element_size() == 1
    return dict(KV_FP8=fp8, FP8_ASM=fp8 and FP8_ASM and k_cache.is_cuda, FP8_K_AT_DOT=fp8 and FP8_K_AT_DOT,
                F16_DOTS=products_dtype(q_dtype, fp8) != q_dtype)


def _descale_strides(k_cache, descale) -> tuple[int, int]:
    """(batch, head) strides of a float8 cache's (B or 1, Hk or 1) descale view, 0 where it
    broadcasts (absent: one value, 1); (0, 0) for 16/32-bit caches."""
    if k_cache.element_size() != 1 or descale is None:
        return (0, 0)
    return tuple(st if n > 1 else 0 for st, n in zip(descale.stride(), descale.shape, strict=True))


# combine_kernel's tile: up to COMBINE_PARTS partials of a row at once, and rows so that a program
# holds at most COMBINE_TILE of (row, partial) pairs: the 256 rows of a B=8 Hq=32 decode make 128
# programs, not 8 (its combine took 5.2 us against cuDNN's 2.2 us reduction, H200 2026-12-01).
COMBINE_PARTS, COMBINE_TILE = 16, 8
# Programmatic dependent launch between the split-KV kernel and its combine (`_pdl`); a switch
# for A/B runs (tools/decode_kernel_times.py), part of both launchers' plan keys.
PDL = True


def _pdl(t) -> bool:
    """Whether kernels on t's device chain by programmatic dependent launch: a CUDA device of
    sm_90 or later (the interpreter runs no PTX). The split-KV kernel lets the combine launch
    early (LAUNCH_DEPENDENTS), the combine waits for it before reading (WAIT_PRIOR): the launch
    gap between the two goes under the split kernel's tail."""
    return t.is_cuda and _pdl_on(_capability(t.device.index if t.device.index is not None
                                             else torch.cuda.current_device()))


def _pdl_on(capability: int) -> bool:
    """Whether a GPU of compute capability `capability` (major) chains the two kernels by PDL."""
    return PDL and capability >= 9


@functools.cache
def _capability(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


def combine_tile(n_parts: int, block_m: int) -> tuple[int, int]:
    """(rows a program, partials read at once) of combine_kernel for n_parts partials, at most
    block_m rows (the config's)."""
    block_s = min(triton.next_power_of_2(max(n_parts, 1)), COMBINE_PARTS)
    return max(1, min(block_m, COMBINE_TILE // block_s)), block_s


def combine_variants(block_m: int, capability: int) -> list[tuple[str, dict]]:
    """The combine kernels `launch_combine` compiles for a config's block_m on a GPU of compute
    capability `capability` (major): one tile per partial count it rounds to (1, 2, 4, ...,
    COMBINE_PARTS), as (variant name, constexprs) for an ahead-of-time build (fmha.dispatch.precompile)."""
    wait_prior = _pdl_on(capability)
    out = []
    for parts in (1 << i for i in range(COMBINE_PARTS.bit_length())):
        rows, block_s = combine_tile(parts, block_m)
        out.append((f"parts{block_s}", {"BLOCK_M": rows, "BLOCK_S": block_s, "WAIT_PRIOR": wait_prior}))
    return out


def launch_combine(o_parts, lse_parts, o, lse, *, nheads: int, seqlen: int, sinks=None,
                   block_m: int, num_warps: int, **_unused) -> launch_cache.Planned | None:
    """o_parts (n, R, D) with rows r = (b * nheads + h) * seqlen + i; lse_parts (n, R).

    o is addressed as (B, Sq, H, D) [strides of o.permute], lse as (B, H, Sq).
    block_m: the most rows a program merges; a program reads up to COMBINE_PARTS partials of its
    rows at once (`combine_tile`).
    Returns the launch plan this call ran or made: `Planned.launch(o_parts, lse_parts, o, lse, sinks)`
    repeats it (sinks left out where the call had none).
    """
    key = None
    if launch_cache.plans_enabled(combine_kernel):
        key = (o_parts.shape, o_parts.stride(), lse_parts.shape, lse_parts.stride(), o.shape, o.stride(), lse.shape,
               lse.stride(), o_parts.dtype, o.dtype, o_parts.data_ptr() % 16 == 0, lse_parts.data_ptr() % 16 == 0,
               o.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0, _optional_meta(sinks), launch_cache.current_device(),
               nheads, seqlen, block_m, num_warps, PDL)
        planned = _COMBINE_PLANS.get(key)
        if planned is not None:
            planned.launch(o_parts, lse_parts, o, lse, sinks)
            return planned
    n_parts, n_rows, head_dim = o_parts.shape
    if n_rows == 0:
        return None
    block_m, block_s = combine_tile(n_parts, block_m)
    grid = (cdiv(n_rows, block_m),)
    pdl = _pdl(o_parts)
    tail = (n_parts, n_rows, nheads, seqlen, head_dim,
            o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0),
            o.stride(0), o.stride(2), o.stride(1), lse.stride(0), lse.stride(1), lse.stride(2))
    plan = launch_cache.make_plan(combine_kernel, grid,
        o_parts, lse_parts, o, lse, sinks if sinks is not None else lse, *tail,
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_D=padded_dim(head_dim), BLOCK_S=block_s,
        WAIT_PRIOR=pdl, num_warps=num_warps, launch_pdl=pdl,
    )
    return launch_cache.keep(_COMBINE_PLANS, key, plan, combine_kernel, tail, _combine_tensors)


def _combine_tensors(o_parts, lse_parts, o, lse, sinks=None) -> tuple:
    """combine_kernel's tensors (lse in the place of absent sinks)."""
    return o_parts, lse_parts, o, lse, sinks if sinks is not None else lse


def launch_rotary_append(src, dst, *, base, cos=None, sin=None, interleaved=False, block_table=None,
                         kv_indptr=None, cache_batch_idx=None, cu_seqlens=None, max_seqlen: int = 0,
                         dst_at_base: bool, block_m: int, num_warps: int, **_unused) -> None:
    """src (B, T, H, D), or packed (total, H, D) with cu_seqlens (B + 1,) and max_seqlen ->
    dst cache (B_cache, S, H, D) / (pages, page_size, H, D) at base[b] + t (dst_at_base), or
    a tensor shaped like src. Pages as in `launch_attention`."""
    varlen = cu_seqlens is not None
    if varlen:
        batch, ntok, (nheads, head_dim) = cu_seqlens.numel() - 1, max_seqlen, src.shape[1:]
        src_strides = (0, src.stride(0), src.stride(1))
    else:
        batch, ntok, nheads, head_dim = src.shape
        src_strides = (src.stride(0), src.stride(1), src.stride(2))
    if dst_at_base or not varlen:
        dst_strides = (dst.stride(0), dst.stride(1), dst.stride(2))
    else:
        dst_strides = (0, dst.stride(0), dst.stride(1))
    grid = (cdiv(ntok, block_m) * batch * nheads,)
    if grid[0] == 0:
        return
    rotate = cos is not None
    rotary_kernel_args = (cos, sin, cos.stride(0), cos.shape[1]) if rotate else (base, base, 0, 0)
    paging = _paging(block_table, kv_indptr, dst.shape[1], 1)
    launch_cache.launch(rotary_append_kernel, grid,
        src, dst, rotary_kernel_args[0], rotary_kernel_args[1],
        block_table if block_table is not None else base, kv_indptr if kv_indptr is not None else base,
        cache_batch_idx if cache_batch_idx is not None else base, base,
        cu_seqlens if varlen else base,
        *src_strides, *dst_strides,
        rotary_kernel_args[2], paging["stride_btb"], paging["page_size"],
        ntok, nheads, head_dim, rotary_kernel_args[3],
        PAGED=paging["PAGED"], TABLE_INDPTR=paging["TABLE_INDPTR"],
        HAS_CACHE_BATCH_IDX=cache_batch_idx is not None, IS_VARLEN=varlen,
        ROTATE=rotate, INTERLEAVED=interleaved, DST_AT_BASE=dst_at_base,
        BLOCK_T=block_m, BLOCK_D=padded_dim(head_dim), num_warps=num_warps,
    )
