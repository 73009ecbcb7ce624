"""Backward dK/dV (+ dQ added into an fp32 accumulator) for Hopper in Gluon (family
`bwd_dq_dk_dv`, pipelines `gluon` and, below, `gluon_ws`).

One program per (batch, KV head, key tile): 128 keys on 8 warps (two warpgroups of 64 key
rows), or 64 keys on 4 or 8 warps (D=256: 8, dQ formed in column halves).
K and V stay in shared memory; Q and dO tiles of 64 query rows stream through a ring of
TMA stages, over every query head of the KV head's group. Per query tile, with wgmma:

    S^T = K Q^T,  dP^T = V dO^T                     (both from shared memory)
    P^T = exp2(S^T * scale*log2(e) - LSE*log2(e)),  dS^T = P^T * (dP^T - delta)
    dV += P^T dO,  dK += dS^T Q                     (P^T, dS^T from registers)
    dQ_acc += dS K                                  (dS^T through shared memory)

dK is scaled by the softmax scale at the end; dQ_acc is converted (and scaled) by the
`bwd_convert_dq` kernel as for the Triton path. LSE and delta of each query tile come by TMA
with Q and dO (STATS_TMA; per-thread loads where TMA cannot address them). dQ goes out by a
TMA reduce-add from shared memory (DQ_TMA, FlashAttention-3's way: the copy engine adds the
tile in L2, no atomics on the warps' memory pipe), or else as `red.global.add.v2.f32` of column
pairs (DQ_V2; scalar atomics if 8-byte alignment fails).
Scope: fp16/bf16, Dqk == Dv in {64, 128, 256}, no mask or causal in either alignment, and (one
key tile a program) sliding windows (left, 0) (`LEFT_WINDOW`) and, warp-specialized, packed
varlen sequences (`VARLEN`), GQA; TMA-aligned bhsd/bshd views.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..launch import cache as launch_cache
from ..launch.args import cdiv
from . import fwd as fwd_gluon
from .common import acc_layout, descriptor, descriptor_type, fast_descriptor, tma_aligned, tma_reduce_add
from .persistent_schedule import causal_tile_order

LOG2E = gl.constexpr(1.4426950408889634)
# The kernels' CAUSAL: False (no mask), True (causal), or LEFT_WINDOW: causal with a left edge, the
# sliding window (window_left, 0) (rows i see keys i + diag - window_left <= j <= i + diag). The
# persistent kernel takes no window.
LEFT_WINDOW = gl.constexpr(2)
# GRID_ORDER: which (batch or sequence, KV head, key tile) program pid of a one-tile grid takes
# (the persistent kernel walks its own, TILE_ORDER). Under causal a head's first key tiles hold the
# most query tiles. SEQ_MAJOR: batch by batch, head by head, a head's key tiles in a row (the last
# heads' heavy first tiles start late). TILE_MAJOR: key tile outermost, every (batch, head) inside
# (heaviest first, but the programs running together read different heads' queries: L2 misses).
# SEQ_BANDS: batch by batch and, inside one, key tile then head (a batch's heavy tiles first, its
# heads' queries shared in L2). H200, attempt 66 (docs/performance.md): varlen SEQ_BANDS +2% over
# SEQ_MAJOR, TILE_MAJOR -11..-22%.
SEQ_MAJOR, TILE_MAJOR, SEQ_BANDS = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
GRID_ORDERS = {"seq_major": SEQ_MAJOR.value, "tile_major": TILE_MAJOR.value, "seq_bands": SEQ_BANDS.value}
DENSE_GRID_ORDER, VARLEN_GRID_ORDER = SEQ_MAJOR.value, SEQ_BANDS.value
# Warp-specialized variant: 8 compute warps + 1 loader warp + 2 writer warps, padded to 12
# warps, start at 168 registers (12 * 32 * 168 < 64K); the workers drop to WORKER_REGS and
# the compute warpgroups take 240. Every worker warp of the padded warpgroup must fit that
# budget: 256 * 240 + 128 * 24 is the whole 64512 (a worker asking for more would wait forever).
WORKER_REGS = gl.constexpr(24)


@gluon.jit
def _load_tile(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready, it,
               m_start, n_m, hq0, b, q0, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr):
    """TMA loads of the Q and dO tiles of iteration `it` (query head, query tile) into its stage,
    and with STATS_TMA its LSE and delta rows (zero past seqlen_q). LSE/delta signal their own
    barrier, their copies interleaved with Q/dO's: Triton's shared-memory barrier analysis puts
    a CTA barrier between two TMA copies on the same mbarrier, none between copies on different
    ones (so the loop keeps its 4 CTA barriers; one mbarrier for all four copies makes it 6).
    q0: the rows' offset (a varlen sequence's first query; else 0)."""
    stage = it % STAGES
    h = hq0 + it // n_m
    m0 = q0 + (m_start + it % n_m) * BLOCK_M
    bar = ready.index(stage)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    if STATS_TMA:
        stat_bar = stat_ready.index(stage)
        mbarrier.expect(stat_bar, lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], bar, q_smem.index(stage).reshape(q_desc.block_type.shape))
    if STATS_TMA:
        tma.async_copy_global_to_shared(lse_desc, [b, h, m0], stat_bar,
                                        lse_smem.index(stage).reshape(lse_desc.block_type.shape))
    tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], bar, do_smem.index(stage).reshape(do_desc.block_type.shape))
    if STATS_TMA:
        tma.async_copy_global_to_shared(delta_desc, [b, h, m0], stat_bar,
                                        delta_smem.index(stage).reshape(delta_desc.block_type.shape))


@gluon.jit
def _red_add_v2(ptrs, values, mask):
    """`*ptrs += values` (fp32) where mask != 0, one `red.global.add.v2.f32` per two elements.

    The accumulator layout gives each thread column pairs (2c, 2c+1) of a row, stored as
    consecutive elements; pack=2 hands the asm consecutive elements, so each call gets one
    pair: $2 the first column's address ($3 the second's, unused), {$4, $5} its values,
    $6 its row's mask (checked in the PTX: tools/gluon_sass_report.py --dump). The caller
    guarantees 8-byte aligned pairs. Same SASS (REDG.E.ADD.F32x2) as `gl.atomic_add` where
    Triton proves that alignment from the launch's divisibility specialization."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.b32 p, $6, 0;
        @p red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        "=r,=r,l,l,r,r,r,r", [ptrs, values.to(gl.int32, bitcast=True), mask], dtype=gl.int32, is_pure=False,
        pack=2)  # the int32 result is a dummy: inline asm must return something


@gluon.jit
def _red_add_v4(ptrs, values, mask):
    """`*ptrs += values` (fp32) where mask != 0, one `red.global.add.v4.f32` per four
    consecutive elements (sm_90): $4 the first element's address, {$8..$11} the values, $12
    the mask. The caller guarantees 16-byte aligned quads."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.b32 p, $12, 0;
        @p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        mov.b32 $2, 0;
        mov.b32 $3, 0;
        }""",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [ptrs, values.to(gl.int32, bitcast=True), mask], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.jit
def _grid_tile(num_n, nheads_k, GRID_ORDER: gl.constexpr):
    """(batch or sequence * nheads_k + KV head, key tile) of this program of a one-tile grid of
    num_n key tiles a head, in GRID_ORDER."""
    pid = gl.program_id(0)
    if GRID_ORDER == TILE_MAJOR:
        n_bh = gl.num_programs(0) // num_n
        bh = pid % n_bh
        tile = pid // n_bh
    elif GRID_ORDER == SEQ_BANDS:
        rest = pid % (num_n * nheads_k)
        bh = pid // (num_n * nheads_k) * nheads_k + rest % nheads_k
        tile = rest // nheads_k
    else:
        bh = pid // num_n
        tile = pid % num_n
    return bh, tile


@gluon.jit
def _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """(b, KV head, first query head, first key, first query tile, query tiles per head) of
    this program (`_query_tiles`)."""
    bh, tile = _grid_tile(gl.cdiv(seqlen_k, BLOCK_N), nheads_k, GRID_ORDER)
    n0 = tile * BLOCK_N
    b = bh // nheads_k
    hk = bh % nheads_k
    m_start, n_m = _query_tiles(n0, seqlen_q, seqlen_k, diag, window_left, CAUSAL, BLOCK_M, BLOCK_N)
    return b, hk, hk * group, n0, m_start, n_m


@gluon.jit
def _query_tiles(n0, seqlen_q, seqlen_k, diag, window_left, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """(first query tile, query tiles) of the key tile at n0. Causal rows i see keys j <= i + diag:
    earlier query tiles are skipped; with CAUSAL == LEFT_WINDOW rows i also see only keys
    j >= i + diag - window_left: the query tiles after the last row whose window reaches the
    tile's last key are skipped too."""
    m_start = 0
    if CAUSAL:
        m_start = gl.maximum(n0 - diag, 0) // BLOCK_M
    m_end = gl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL == LEFT_WINDOW:  # the last row seeing the tile's last key; (last + BLOCK_M) // BLOCK_M tiles
        last = gl.minimum(n0 + BLOCK_N, seqlen_k) - 1 - diag + window_left
        m_end = gl.minimum(m_end, gl.maximum(last + BLOCK_M, 0) // BLOCK_M)
    return m_start, gl.maximum(m_end - m_start, 0)


@gluon.jit
def _varlen_key_tile(args, stride_lm, stride_dem, GRID_ORDER: gl.constexpr, CAUSAL: gl.constexpr,
                     STATS_TMA: gl.constexpr, DQ_TMA: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """`_key_tile` of a varlen launch (VARLEN): the grid covers the longest sequence's key tiles
    (args' seqlen_k) for every (sequence, KV head), in GRID_ORDER; sequence b's queries start at q0 =
    cu_seqlens_q[b], its keys at k0 = cu_seqlens_k[b], and args' diag is 1 for bottom-right
    alignment, 0 for top-left. Returns (0 (the TMA batch coordinate of the (1, H, total, D) views),
    KV head, first query head, first key, first query tile, query tiles per head, q0, k0, the
    sequence's keys, args of the sequence): its lengths and diagonal in args, and the pointers
    read per thread moved to its first query (LSE and delta by their row strides stride_lm,
    stride_dem without STATS_TMA; dq_acc without DQ_TMA). A key tile past the sequence's keys has
    no query tiles."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    bh, tile = _grid_tile(gl.cdiv(seqlen_k, BLOCK_N), nheads_k, GRID_ORDER)
    n0 = tile * BLOCK_N
    b = bh // nheads_k
    hk = bh % nheads_k
    q0 = gl.load(cu_seqlens_q + b)
    seq_q = gl.load(cu_seqlens_q + b + 1) - q0
    k0 = gl.load(cu_seqlens_k + b)
    seq_k = gl.load(cu_seqlens_k + b + 1) - k0
    seq_diag = (seq_k - seq_q) * diag
    m_start, n_m = _query_tiles(n0, seq_q, seq_k, seq_diag, window_left, CAUSAL, BLOCK_M, BLOCK_N)
    n_m = gl.where(n0 < seq_k, n_m, 0)
    if not STATS_TMA:
        lse += q0.to(gl.int64) * stride_lm
        delta += q0.to(gl.int64) * stride_dem
    if not DQ_TMA:
        dq_acc += q0.to(gl.int64) * stride_dqm
    args = (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
            seq_q, seq_k, nheads_k, group, seq_diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
            ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens)
    return b * 0, hk, hk * group, n0, m_start, n_m, q0, k0, seq_k, args


@gluon.jit
def _varlen_out_args(out_args, k0):
    """out_args with dK's and dV's pointers at a varlen sequence's first key (their batch strides
    are 0)."""
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    return (dk_ptr + k0.to(gl.int64) * stride_dkn, dv_ptr + k0.to(gl.int64) * stride_dvn, stride_dkb, stride_dkh,
            stride_dkn, stride_dvb, stride_dvh, stride_dvn, qk_scale, scale)


@gluon.jit
def _lse_row(lse, lse_smem, stat_ready, stage, phase, b, h, queries, m0, seqlen_q, stride_lb, stride_lh, stride_lm,
             st_layout: gl.constexpr, STATS_TMA: gl.constexpr, BLOCK_M: gl.constexpr):
    """LSE*log2(e) of the query tile as a [1, BLOCK_M] row of the S^T layout. Queries past the
    end get +inf (P = 0)."""
    if STATS_TMA:  # from shared memory (broadcast reads), not 16 global loads per thread
        mbarrier.wait(stat_ready.index(stage), phase)
        lse2 = lse_smem.index(stage).load(st_layout) * LOG2E
        if m0 + BLOCK_M > seqlen_q:  # the TMA zero-filled the rows past the end
            lse2 = gl.where(queries[None, :] < seqlen_q, lse2, float("inf"))
    else:
        lse2 = gl.load(lse + b.to(gl.int64) * stride_lb + h * stride_lh + queries * stride_lm,
                       mask=queries < seqlen_q, other=float("inf"))[None, :] * LOG2E
    return lse2


@gluon.jit
def _delta_row(delta, delta_smem, stage, b, h, queries, seqlen_q, stride_deb, stride_deh, stride_dem,
               st_layout: gl.constexpr, STATS_TMA: gl.constexpr):
    """delta of the query tile as a [1, BLOCK_M] row of the S^T layout (0 past the end; with
    STATS_TMA after `_lse_row` waited for the stage's statistics)."""
    if STATS_TMA:
        delta_row = delta_smem.index(stage).load(st_layout)
    else:
        delta_row = gl.load(delta + b.to(gl.int64) * stride_deb + h * stride_deh + queries * stride_dem,
                            mask=queries < seqlen_q, other=0.0)[None, :]
    return delta_row


@gluon.jit
def _probs(st, lse2, keys, queries, n0, m0, seqlen_k, diag, window_left, qk_scale, CAUSAL: gl.constexpr,
           BLOCK_N: gl.constexpr):
    """P^T from the in-flight S^T product (issued before dP^T, which may still run); masked
    keys give P = 0 (with CAUSAL == LEFT_WINDOW also the keys left of a query's window)."""
    st = warpgroup_mma_wait(1, deps=(st,))
    pt = gl.exp2(st * qk_scale - lse2)
    need_mask = n0 + BLOCK_N > seqlen_k
    if CAUSAL:
        need_mask = need_mask | (m0 + diag < n0 + BLOCK_N - 1)
    if CAUSAL == LEFT_WINDOW:  # the first key left of the last query's window edge
        need_mask = need_mask | (n0 < m0 + queries.shape[0] - 1 + diag - window_left)
    if need_mask:
        ok = keys[:, None] < seqlen_k
        if CAUSAL:
            ok = ok & (keys[:, None] <= queries[None, :] + diag)
        if CAUSAL == LEFT_WINDOW:
            ok = ok & (keys[:, None] >= queries[None, :] + diag - window_left)
        pt = gl.where(ok, pt, 0.0)
    return pt


@gluon.jit
def _store_dkdv(dk, dv, dk_ptr, dv_ptr, b, hk, n0, seqlen_k, stride_dkb, stride_dkh, stride_dkn,
                stride_dvb, stride_dvh, stride_dvn, kv_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr):
    kv_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    kv_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    kv_ok = (kv_rows < seqlen_k)[:, None]
    gl.store(dk_ptr + b.to(gl.int64) * stride_dkb + hk * stride_dkh + kv_rows[:, None] * stride_dkn
             + kv_cols[None, :], dk.to(dk_ptr.dtype.element_ty), mask=kv_ok)
    gl.store(dv_ptr + b.to(gl.int64) * stride_dvb + hk * stride_dvh + kv_rows[:, None] * stride_dvn
             + kv_cols[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@gluon.jit
def _store_dkdv_tma(dk, dv, dk_desc, dv_desc, dk_smem, dv_smem, b, hk, n0, WAIT: gl.constexpr = True):
    """dK and dV (the kernel's output dtype) through shared buffers (the one-tile kernels: K's and
    V's) and two TMA stores, which clip the rows past the end: one bulk copy each instead of
    every thread's 4-byte stores (half of their 32-byte sectors partial). The caller guarantees
    that nothing reads the buffers any more and that every warp is past its wait for them.
    WAIT: wait for the copies here; else the caller does (`tma.store_wait`, then a barrier)
    before it writes the buffers again or the kernel ends."""
    dk_smem.store(dk.to(dk_desc.dtype))
    dv_smem.store(dv.to(dv_desc.dtype))
    fence_async_shared()  # the generic stores before the copy engine's reads
    gl.thread_barrier()  # every warp's rows are in shared memory
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], dk_smem.reshape(dk_desc.block_type.shape))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], dv_smem.reshape(dv_desc.block_type.shape))
    if WAIT:
        tma.store_wait(0)  # (the buffers must outlive the copies)


@gluon.jit
def _ws_store_dkdv(dk, dv, out_args, k_smem, v_smem, b, hk, n0, seqlen_k, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, DKDV_TMA: gl.constexpr):
    """A one-tile compute body's last step: the tile's dK (scaled) and dV to memory, with
    DKDV_TMA through K's and V's shared buffers (the body's tile function returned: no product
    reads them any more), else by each thread's stores."""
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    if DKDV_TMA:
        _store_dkdv_tma(dk * scale, dv, dk_ptr, dv_ptr, k_smem, v_smem, b, hk, n0)
    else:
        _store_dkdv(dk * scale, dv, dk_ptr, dv_ptr, b, hk, n0, seqlen_k, stride_dkb, stride_dkh, stride_dkn,
                    stride_dvb, stride_dvh, stride_dvn, acc_layout(BLOCK_N, HEAD_DIM, gl.num_warps()), BLOCK_N,
                    HEAD_DIM)


@gluon.jit
def bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, dk_ptr, dv_ptr,
                    stride_lb, stride_lh, stride_lm,
                    stride_deb, stride_deh, stride_dem,
                    stride_dqb, stride_dqh, stride_dqm,
                    stride_dkb, stride_dkh, stride_dkn,
                    stride_dvb, stride_dvh, stride_dvn,
                    seqlen_q, seqlen_k, nheads_k, group, diag, qk_scale, scale, window_left,
                    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
                    DQ_V2: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr,
                    DQ_ALIAS: gl.constexpr):
    """lse, delta: TMA descriptors of (B, Hq, Sq) fp32 with STATS_TMA, else pointers.
    CAUSAL: False, True or LEFT_WINDOW (the window (window_left, 0); window_left unused otherwise).
    dq_acc: with DQ_TMA a TMA descriptor of the (B, Hq, Sq, D) fp32 accumulator (blocks of
    BLOCK_M x DQ_COLS), else its pointer.
    DQ_COLS: dQ is formed and added DQ_COLS columns at a time (HEAD_DIM for one product; half
    at D=256, where a whole 64 x 256 fp32 dQ next to dK and dV would spill).
    DQ_ALIAS (DQ_TMA, DQ_COLS = HEAD_DIM / 2): the two fp32 halves are staged in the tile's Q
    and dO buffers (each exactly BLOCK_M x DQ_COLS x 4 bytes), free once dK and dV are
    updated and refilled only after the next tile's dS^T barrier, which waits for the reduction."""
    dtype: gl.constexpr = q_desc.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M, NUM_WARPS)  # S^T, dP^T: keys x queries
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV
    dq_layout: gl.constexpr = acc_layout(BLOCK_M, DQ_COLS, NUM_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)

    b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                             BLOCK_M, BLOCK_N)
    total = group * n_m

    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_smem_layout)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    if DQ_TMA and not DQ_ALIAS:
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout)
    if DQ_ALIAS:
        gl.static_assert(2 * DQ_COLS == HEAD_DIM, "dQ halves staged in the Q and dO buffers")
    stat_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stat_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stat_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(stat_ready.index(i), count=1)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem.reshape(k_desc.block_type.shape))
    tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem.reshape(v_desc.block_type.shape))
    for i in gl.static_range(STAGES - 1):
        if i < total:
            _load_tile(q_desc, do_desc, lse, delta, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready, i,
                       m_start, n_m, hq0, b, 0, BLOCK_M, STAGES, STATS_TMA)

    keys = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dq_rows_base = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    mbarrier.wait(kv_bar, 0)
    for it in range(total):
        stage = it % STAGES
        h = hq0 + it // n_m
        m0 = (m_start + it % n_m) * BLOCK_M
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        st = warpgroup_mma(k_smem, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        queries = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
        lse2 = _lse_row(lse, lse_smem, stat_ready, stage, (it // STAGES) & 1, b, h, queries, m0, seqlen_q,
                        stride_lb, stride_lh, stride_lm, st_layout, STATS_TMA, BLOCK_M)
        delta_row = _delta_row(delta, delta_smem, stage, b, h, queries, seqlen_q, stride_deb, stride_deh,
                               stride_dem, st_layout, STATS_TMA)
        pt = _probs(st, lse2, keys, queries, n0, m0, seqlen_k, diag, window_left, qk_scale, CAUSAL, BLOCK_N)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dst = pt * (dpt - delta_row)
        pt_op = gl.convert_layout(pt.to(dtype), a_layout)
        dst16 = dst.to(dtype)
        dst_op = gl.convert_layout(dst16, a_layout)
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
        ds_buf = ds_smem.index(it % 2)
        ds_buf.store(dst16)
        fence_async_shared()
        if DQ_TMA:
            tma.store_wait(0)  # the issuing thread: the last dQ reduction has read dq_smem
        gl.thread_barrier()  # dS^T complete in shared memory; every warp is past iteration it-1
        if it + STAGES - 1 < total:  # the stage of iteration it-1 is free: prefetch ahead
            _load_tile(q_desc, do_desc, lse, delta, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready,
                       it + STAGES - 1, m_start, n_m, hq0, b, 0, BLOCK_M, STAGES, STATS_TMA)
        dq_rows = m0 + dq_rows_base
        if not DQ_TMA:
            dq_base = dq_acc + (b.to(gl.int64) * stride_dqb + h * stride_dqh + dq_rows[:, None] * stride_dqm
                                + dq_cols[None, :])
        for c in gl.static_range(HEAD_DIM // DQ_COLS):
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem.slice(c * DQ_COLS, DQ_COLS, dim=1), dq_zero,
                               use_acc=False, is_async=True)
            if c == 0:
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            else:
                dq = warpgroup_mma_wait(0, deps=(dq,))
            if DQ_ALIAS:
                if c == 0:
                    gl.thread_barrier()  # every warp's dK/dV products (the Q and dO readers) are done
                    q_tile._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout).store(dq)
                else:
                    do_tile._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout).store(dq)
                    fence_async_shared()
                    gl.thread_barrier()  # both halves in shared memory, visible to the TMA unit
                    tma_reduce_add(dq_acc, [b, h, m0, 0], q_tile._reinterpret(
                        gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout).reshape(dq_acc.block_type.shape))
                    tma_reduce_add(dq_acc, [b, h, m0, DQ_COLS], do_tile._reinterpret(
                        gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout).reshape(dq_acc.block_type.shape))
            elif DQ_TMA:
                if c > 0:  # column blocks share the buffer
                    tma.store_wait(0)
                    gl.thread_barrier()
                dq_smem.store(dq)
                fence_async_shared()
                gl.thread_barrier()  # the whole tile is in shared memory, visible to the TMA unit
                tma_reduce_add(dq_acc, [b, h, m0, c * DQ_COLS], dq_smem.reshape(dq_acc.block_type.shape))
            elif DQ_V2:
                _red_add_v2(dq_base + c * DQ_COLS, dq, (dq_rows < seqlen_q).to(gl.int32)[:, None])
            else:
                gl.atomic_add(dq_base + c * DQ_COLS, dq, mask=(dq_rows < seqlen_q)[:, None], sem="relaxed")
    if DQ_TMA:
        tma.store_wait(0)  # shared memory must outlive the last reduction's reads

    _store_dkdv(dk * scale, dv, dk_ptr, dv_ptr, b, hk, n0, seqlen_k, stride_dkb, stride_dkh, stride_dkn,
                stride_dvb, stride_dvh, stride_dvn, kv_layout, BLOCK_N, HEAD_DIM)

# ----------------------------------------------------------------------------------------
# Warp-specialized variant (pipeline `gluon_ws`): the same tile and products, with the TMA
# loads in a loader warp and the dQ reduction in two writer warps, so the wgmma warpgroups
# neither issue copies nor wait for dQ to leave. The compute warps hand dQ over in shared
# memory; the writer adds it to dq_acc by TMA reduce-add (DQ_TMA) or else with
# `red.global.add.v4.f32`. One 8-warp compute partition: two warpgroups over the 128 keys, in
# lockstep at the dS^T barrier as in bwd_dkdv_kernel (separate partitions per warpgroup, each
# with its own partial dQ, measured slower: docs/performance.md, attempt 23). D=256
# (`_ws_compute_d256`, DQ_ALIAS): 64 keys split by head-dim columns as in bwd_dkdv_kernel, dQ
# handed over in the consumed Q/dO stage, which the writer releases (docs/notes/bwd-d256-ws.md).

@gluon.jit
def _key_coords(bh, n0, seqlen_q, nheads_k, group, diag, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """`_key_tile` of the key tile at key n0 of (batch, KV head) bh (the persistent kernel's; the
    one-tile kernels keep their own copy: an extra inlined call changes their SASS through the
    debug information ptxas sees)."""
    ubh = bh.to(gl.uint32)  # (unsigned: fewer registers for the division's operands)
    b = (ubh // nheads_k.to(gl.uint32)).to(gl.int32)
    hk = (ubh % nheads_k.to(gl.uint32)).to(gl.int32)
    m_start = 0
    if CAUSAL:
        m_start = gl.maximum(n0 - diag, 0) // BLOCK_M
    n_m = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - m_start, 0)
    return b, hk, hk * group, n0, m_start, n_m


# Persistent schedule (bwd_dkdv_ws_kernel's PERSISTENT): program p of P runs the key tiles
# t(k) = k * P + slot(k), slot(k) = p in even rounds k and P - 1 - p in odd ones (a snake), while
# t(k) < number of key tiles (fwd_gluon._my_tile_count). Order of the key tiles: without a mask
# heads outermost as in the one-tile grid (a head's key tiles share its Q and dO in L2); under
# causal, where key tile i of a head has ~(n - i) query tiles (the first the most), TILE_ORDER:
#   0 (LPT): key tile 0 of every (batch, KV head), then key tile 1, ...;
#   1 (heads): heads outermost, key tiles in order (the longest of a head first);
#   2 (pairs): units of two tiles handed out by the snake, a head's longest and shortest key tile,
#      then its second longest and second shortest, ... (equal work per unit), heads outermost
#      (fwd_gluon._pair_tile with key tiles for row tiles, reversed).
# Every partition of a program walks the same sequence.
@gluon.jit
def _my_key_tile(k, num_bh, seqlen_q, seqlen_k, nheads_k, group, diag, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILE_ORDER: gl.constexpr):
    """`_key_tile` of this program's k-th key tile (k < fwd_gluon._my_tile_count(num_bh * key tiles))."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_n = gl.cdiv(seqlen_k, BLOCK_N)
    if CAUSAL and TILE_ORDER == 2:
        j = k // 2
        u = j * nprog + pid + (j & 1) * (nprog - 1 - 2 * pid)
        bh, longest_last = fwd_gluon._pair_tile(2 * u + (k & 1), num_bh, num_n)
        n_idx = num_n - 1 - longest_last
    else:
        t = k * nprog + pid + (k & 1) * (nprog - 1 - 2 * pid)
        if CAUSAL and TILE_ORDER == 0:
            bh = t % num_bh
            n_idx = t // num_bh
        else:
            ut = t.to(gl.uint32)
            bh = (ut // num_n.to(gl.uint32)).to(gl.int32)
            n_idx = (ut % num_n.to(gl.uint32)).to(gl.int32)
    return _key_coords(bh, n_idx * BLOCK_N, seqlen_q, nheads_k, group, diag, CAUSAL, BLOCK_M)


@gluon.jit
def _load_stage(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready,
                slot, j, m_start, n_m, hq0, b, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                STATS_TMA: gl.constexpr):
    """`_load_tile` of the key tile's iteration j (query head, query tile) into ring use `slot`
    (stage slot % STAGES): the persistent kernel's ring counts on across key tiles. (A copy:
    `_load_tile` calling this changes the one-tile kernels' SASS through the debug information.)"""
    stage = slot % STAGES
    h = hq0 + j // n_m
    m0 = (m_start + j % n_m) * BLOCK_M
    bar = ready.index(stage)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    if STATS_TMA:
        stat_bar = stat_ready.index(stage)
        mbarrier.expect(stat_bar, lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], bar, q_smem.index(stage).reshape(q_desc.block_type.shape))
    if STATS_TMA:
        tma.async_copy_global_to_shared(lse_desc, [b, h, m0], stat_bar,
                                        lse_smem.index(stage).reshape(lse_desc.block_type.shape))
    tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], bar, do_smem.index(stage).reshape(do_desc.block_type.shape))
    if STATS_TMA:
        tma.async_copy_global_to_shared(delta_desc, [b, h, m0], stat_bar,
                                        delta_smem.index(stage).reshape(delta_desc.block_type.shape))


@gluon.jit
def _ring_step(base, j, hq0, m_start, n_m, BLOCK_M: gl.constexpr, BUFS: gl.constexpr):
    """(ring use, buffer, phase, query head, first query) of a key tile's iteration j, whose ring
    use (and hand-over) is `base + j` of BUFS buffers (the compute tiles' and writers' loop head)."""
    it = base + j
    buf = it % BUFS
    phase = (it // BUFS) & 1
    h = hq0 + j // n_m
    m0 = (m_start + j % n_m) * BLOCK_M
    return it, buf, phase, h, m0


@gluon.jit
def _ws_loader(args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, STATS_TMA: gl.constexpr, VARLEN: gl.constexpr = False,
               GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    q0 = 0
    k0 = 0
    if VARLEN:  # (TMA only: no pointer offsets)
        b, hk, hq0, n0, m_start, n_m, q0, k0, _, _ = _varlen_key_tile(
            args, 0, 0, GRID_ORDER, CAUSAL, True, True, BLOCK_M, BLOCK_N)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, k0 + n0, 0], kv_bar, k_smem.reshape(k_desc.block_type.shape))
    tma.async_copy_global_to_shared(v_desc, [b, hk, k0 + n0, 0], kv_bar, v_smem.reshape(v_desc.block_type.shape))
    for it in range(group * n_m):
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(it % STAGES), ((it // STAGES) & 1) ^ 1)
        _load_tile(q_desc, do_desc, lse, delta, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready, it,
                   m_start, n_m, hq0, b, q0, BLOCK_M, STAGES, STATS_TMA)


@gluon.jit
def _ws_loader_persistent(args, kv_empty, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, STATS_TMA: gl.constexpr, TILE_ORDER: gl.constexpr):
    """`_ws_loader` of the persistent kernel: the ring counts on across key tiles (`it`). K and V
    are single buffers: tile k's go in once the compute warps released tile k-1's (kv_empty,
    phase k-1: after their last products of the tile, before its dK/dV stores). Before that wait
    the loader issues tile k's first min(STAGES, iterations) Q/dO stages, which need only ring
    stages the compute warps free while they finish tile k-1 (no wait on kv_empty), so the ring
    keeps streaming across the tile border."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    num_bh = k_desc.shape[0] * nheads_k
    it = 0
    for k in range(fwd_gluon._my_tile_count(gl.cdiv(seqlen_k, BLOCK_N) * num_bh, CAUSAL, TILE_ORDER)):
        b, hk, hq0, n0, m_start, n_m = _my_key_tile(k, num_bh, seqlen_q, seqlen_k, nheads_k, group, diag, CAUSAL,
                                                    BLOCK_M, BLOCK_N, TILE_ORDER)
        total = group * n_m
        early = gl.where(k > 0, gl.minimum(total, STAGES), 0)  # the first tile: K and V first
        for j in range(early):
            mbarrier.wait(empty.index((it + j) % STAGES), (((it + j) // STAGES) & 1) ^ 1)
            _load_stage(q_desc, do_desc, lse, delta, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready,
                        it + j, j, m_start, n_m, hq0, b, BLOCK_M, STAGES, STATS_TMA)
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(kv_empty, (k & 1) ^ 1)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem.reshape(k_desc.block_type.shape))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem.reshape(v_desc.block_type.shape))
        for j in range(early, total):
            mbarrier.wait(empty.index((it + j) % STAGES), (((it + j) // STAGES) & 1) ^ 1)
            _load_stage(q_desc, do_desc, lse, delta, q_smem, do_smem, lse_smem, delta_smem, ready, stat_ready,
                        it + j, j, m_start, n_m, hq0, b, BLOCK_M, STAGES, STATS_TMA)
        it += total


# The dQ writers' red.v4 path (without DQ_TMA; `_ws_dq_writer`): blocks of 8 rows x 32 fp32 columns.
QUAD_ROWS = gl.constexpr(8)
QUAD_COLS = gl.constexpr(32)


@gluon.constexpr_function
def _quad_layout():
    """A QUAD_ROWS x QUAD_COLS fp32 block over 2 warps, 4 consecutive columns a thread."""
    return gl.BlockedLayout([1, 4], [4, 8], [2, 1], [1, 0])


@gluon.jit
def _quad_offsets(stride_dqm):
    """(the rows of a block, each element's offset from the block's first in dq_acc), computed
    once per writer (`_quad_layout`)."""
    gl.static_assert(gl.num_warps() == 2, "a block of 8 x 32 fp32 is one quad per thread of 2 warps")
    layout: gl.constexpr = _quad_layout()
    block_rows = gl.arange(0, QUAD_ROWS, layout=gl.SliceLayout(1, layout))
    offsets = block_rows[:, None] * stride_dqm + gl.arange(0, QUAD_COLS, layout=gl.SliceLayout(0, layout))[None, :]
    return block_rows, offsets


@gluon.jit
def _add_dq(dq_acc, bufs, b, h, m0, q0, seqlen_q, stride_dqb, stride_dqh, stride_dqm, block_rows, offsets,
            BLOCK_M: gl.constexpr, COLS: gl.constexpr, DQ_TMA: gl.constexpr):
    """Adds a handed-over dQ tile to dq_acc: `bufs`, fp32 BLOCK_M x COLS buffers of consecutive
    column ranges (the whole tile, or D=256's two halves). With DQ_TMA one TMA reduce-add a buffer,
    waited for; else red.v4 blocks (block_rows, offsets: `_quad_offsets`), the buffers' blocks
    interleaved. q0: the TMA rows' offset (a varlen sequence's first query; else 0; the pointers
    of the red.v4 path are offset by the caller)."""
    if DQ_TMA:
        for i in gl.static_range(len(bufs)):
            tma_reduce_add(dq_acc, [b, h, q0 + m0, i * COLS], bufs[i].reshape(dq_acc.block_type.shape))
        tma.store_wait(0)
    else:
        layout: gl.constexpr = _quad_layout()
        tile = dq_acc + b.to(gl.int64) * stride_dqb + h * stride_dqh + m0.to(gl.int64) * stride_dqm
        for r in gl.static_range(0, BLOCK_M, QUAD_ROWS):
            in_range = (m0 + r + block_rows < seqlen_q).to(gl.int32)[:, None]
            for c in gl.static_range(0, COLS, QUAD_COLS):
                for i in gl.static_range(len(bufs)):
                    dq = bufs[i].slice(r, QUAD_ROWS, dim=0).slice(c, QUAD_COLS, dim=1).load(layout)
                    _red_add_v4(tile + (r * stride_dqm + i * COLS + c) + offsets, dq, in_range)


@gluon.jit
def _ws_dq_writer(args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, DQ_BUFS: gl.constexpr, DQ_TMA: gl.constexpr, VARLEN: gl.constexpr = False,
                  GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """Adds each handed-over dQ tile to dq_acc: with DQ_TMA by one TMA reduce-add of the
    buffer, released once the copy engine has read it; else in blocks of 8 rows x 32 columns
    (one swizzle atom of the fp32 buffer: 8 rows of 128 bytes), one quad of consecutive columns
    a thread (one v4 reduction). The worker warps run on 24 registers, so a step holds little
    more than one quad a thread."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    q0 = 0
    if VARLEN:
        b, hk, hq0, n0, m_start, n_m, q0, k0, _, args = _varlen_key_tile(
            args, 0, 0, GRID_ORDER, CAUSAL, True, DQ_TMA, BLOCK_M, BLOCK_N)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    _ws_dq_writer_tile(args, b, hq0, m_start, n_m, 0, q0, BLOCK_M, HEAD_DIM, DQ_BUFS, DQ_TMA)


@gluon.jit
def _ws_dq_writer_persistent(args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr,
                             DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DQ_ALIAS: gl.constexpr,
                             TILE_ORDER: gl.constexpr):
    """`_ws_dq_writer` (DQ_ALIAS: `_ws_dq_writer_alias`) of the persistent kernel: the hand-over
    buffers (the ring's stages) count on across key tiles."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    num_bh = k_desc.shape[0] * nheads_k
    it = 0
    for k in range(fwd_gluon._my_tile_count(gl.cdiv(seqlen_k, BLOCK_N) * num_bh, CAUSAL, TILE_ORDER)):
        b, hk, hq0, n0, m_start, n_m = _my_key_tile(k, num_bh, seqlen_q, seqlen_k, nheads_k, group, diag, CAUSAL,
                                                    BLOCK_M, BLOCK_N, TILE_ORDER)
        if DQ_ALIAS:
            _ws_dq_writer_alias_tile(args, b, hq0, m_start, n_m, it, 0, BLOCK_M, STAGES, DQ_COLS, DQ_TMA)
        else:
            _ws_dq_writer_tile(args, b, hq0, m_start, n_m, it, 0, BLOCK_M, HEAD_DIM, DQ_BUFS, DQ_TMA)
        it += group * n_m


@gluon.jit
def _ws_dq_writer_tile(args, b, hq0, m_start, n_m, base, q0, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                       DQ_BUFS: gl.constexpr, DQ_TMA: gl.constexpr):
    """The writer's work for one key tile: its iterations j take hand-over `base + j`."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    block_rows, offsets = _quad_offsets(stride_dqm)
    for j in range(group * n_m):
        it, buf, phase, h, m0 = _ring_step(base, j, hq0, m_start, n_m, BLOCK_M, DQ_BUFS)
        mbarrier.wait(dq_full.index(buf), phase)
        _add_dq(dq_acc, (dq_smem.index(buf),), b, h, m0, q0, seqlen_q, stride_dqb, stride_dqh, stride_dqm, block_rows,
                offsets, BLOCK_M, HEAD_DIM, DQ_TMA)
        gl.thread_barrier()  # both warps have read the buffer (or waited for the copy engine)
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _ws_tile_start(kv_bar, kv_phase, n0, BLOCK_N: gl.constexpr, S_COLS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   DQ_ROWS: gl.constexpr, DQ_COLS: gl.constexpr):
    """The start of a compute tile: its keys (a column of the BLOCK_N x S_COLS S^T layout), zero
    dK and dV, the zero accumulators of the S^T/dP^T and the DQ_ROWS x DQ_COLS dQ products; then
    the wait for the tile's K and V (phase kv_phase of kv_bar)."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = acc_layout(BLOCK_N, S_COLS, NUM_WARPS)  # S^T, dP^T: keys x queries
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, S_COLS], gl.float32, st_layout)
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, acc_layout(DQ_ROWS, DQ_COLS, NUM_WARPS))
    mbarrier.wait(kv_bar, kv_phase)
    return keys, dk, dv, st_zero, dq_zero


@gluon.jit
def _ws_compute(args, lse_strides, out_args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr, DQ_BUFS: gl.constexpr,
                DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DKDV_TMA: gl.constexpr, VARLEN: gl.constexpr = False,
                GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    if VARLEN:
        b, hk, hq0, n0, m_start, n_m, q0, k0, seqlen_k, args = _varlen_key_tile(
            args, stride_lm, stride_dem, GRID_ORDER, CAUSAL, STATS_TMA, DQ_TMA, BLOCK_M, BLOCK_N)
        out_args = _varlen_out_args(out_args, k0)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    dk, dv = _ws_compute_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, 0, 0, CAUSAL, BLOCK_M,
                              BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_BUFS, DQ_COLS, DQ_TMA)
    _ws_store_dkdv(dk, dv, out_args, k_smem, v_smem, b, hk, n0, seqlen_k, BLOCK_N, HEAD_DIM, DKDV_TMA)


@gluon.jit
def _ws_probs(args, lse_strides, qk_scale, st_zero, keys, b, n0, stage, phase, h, m0, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STATS_TMA: gl.constexpr):
    """The head of a 64-query iteration (`_ws_compute_tile`, `_ws_compute_d256_tile`): waits for
    the stage's Q and dO, issues S^T = K Q^T and dP^T = V dO^T, forms P^T. Returns (Q tile, dO
    tile, queries, P^T, dP^T still in flight)."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    st_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M, gl.num_warps())  # S^T, dP^T: keys x queries
    q_tile = q_smem.index(stage)
    do_tile = do_smem.index(stage)
    mbarrier.wait(ready.index(stage), phase)
    st = warpgroup_mma(k_smem, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    queries = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    lse2 = _lse_row(lse, lse_smem, stat_ready, stage, phase, b, h, queries, m0, seqlen_q, stride_lb, stride_lh,
                    stride_lm, st_layout, STATS_TMA, BLOCK_M)
    pt = _probs(st, lse2, keys, queries, n0, m0, seqlen_k, diag, window_left, qk_scale, CAUSAL, BLOCK_N)
    return q_tile, do_tile, queries, pt, dpt


@gluon.jit
def _ws_compute_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, base, kv_phase, CAUSAL: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     STATS_TMA: gl.constexpr, DQ_BUFS: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr):
    """`_ws_compute`'s work on one key tile (its coordinates from `_key_tile`), K and V of the
    tile in phase kv_phase of kv_bar: iteration j takes ring use and hand-over `base + j`.
    Returns the unscaled dK and dV; when it returns, every product reading K and V is done."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    dtype: gl.constexpr = q_desc.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M, NUM_WARPS)  # S^T, dP^T: keys x queries
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    keys, dk, dv, st_zero, dq_zero = _ws_tile_start(kv_bar, kv_phase, n0, BLOCK_N, BLOCK_M, HEAD_DIM, BLOCK_M,
                                                    DQ_COLS)
    for j in range(group * n_m):
        it, stage, phase, h, m0 = _ring_step(base, j, hq0, m_start, n_m, BLOCK_M, STAGES)
        q_tile, do_tile, queries, pt, dpt = _ws_probs(args, lse_strides, qk_scale, st_zero, keys, b, n0, stage, phase,
                                                      h, m0, CAUSAL, BLOCK_M, BLOCK_N, STATS_TMA)
        # delta after P: its registers are not held while S^T is awaited.
        delta_row = _delta_row(delta, delta_smem, stage, b, h, queries, seqlen_q, stride_deb, stride_deh,
                               stride_dem, st_layout, STATS_TMA)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dst = pt * (dpt - delta_row)
        dst16 = dst.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_tile, dk, is_async=True)
        ds_smem.store(dst16)
        fence_async_shared()
        gl.thread_barrier()  # dS^T complete in shared memory (both warpgroups' key rows)
        buf = it % DQ_BUFS
        dq_buf = dq_smem.index(buf)
        for c in gl.static_range(HEAD_DIM // DQ_COLS):
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(c * DQ_COLS, DQ_COLS, dim=1), dq_zero,
                               use_acc=False, is_async=True)
            if c == 0:
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
                mbarrier.wait(dq_empty.index(buf), ((it // DQ_BUFS) & 1) ^ 1)
            else:
                dq = warpgroup_mma_wait(0, deps=(dq,))
            dq_buf.slice(c * DQ_COLS, DQ_COLS, dim=1).store(dq)
        if DQ_TMA:
            fence_async_shared()  # the writer's TMA reads the buffer
        gl.thread_barrier()  # dQ stored by every warp; every product reading Q, dO and dS is done
        mbarrier.arrive(dq_full.index(buf), count=1)
        mbarrier.arrive(empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _stat_half(ptr, smem, stat_ready, stage, phase, b, h, queries, m0, seqlen_q, stride_b, stride_h, stride_m,
               other: gl.constexpr, WAIT: gl.constexpr, HALF: gl.constexpr, hm: gl.constexpr,
               st_layout: gl.constexpr, STATS_TMA: gl.constexpr):
    """LSE (other=+inf) or delta (other=0) of query half `hm` of the stage's 2 x HALF queries, as
    a [1, HALF] row of the S^T layout; queries past the end get `other`. WAIT: first read of the
    stage's statistics (waits for their TMA)."""
    if STATS_TMA:
        if WAIT:
            mbarrier.wait(stat_ready.index(stage), phase)
        row = smem.index(stage).slice(hm * HALF, HALF, dim=1).load(st_layout)
        if m0 + (hm + 1) * HALF > seqlen_q:  # the TMA zero-filled the rows past the end
            row = gl.where(queries[None, :] < seqlen_q, row, other)
    else:
        row = gl.load(ptr + b.to(gl.int64) * stride_b + h * stride_h + queries * stride_m,
                      mask=queries < seqlen_q, other=other)[None, :]
    return row


@gluon.jit
def _ws_compute_m128(args, lse_strides, out_args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
                     DQ_BUFS: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DKDV_TMA: gl.constexpr,
                     VARLEN: gl.constexpr = False,
                     GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """`_ws_compute` for 128-query stages (BLOCK_M = 128, FlashAttention-3's D=64 tile), worked
    in two 64-query halves so that S^T and dP^T (and P^T, dS^T) of one half only are live:

        S^T_0, dP^T_0 -> P^T_0, dS^T_0 -> dV += P_0^T dO_0, dK += dS_0^T Q_0, issue S^T_1, dP^T_1
        (under those: dS^T_0 to shared memory) -> P^T_1, dS^T_1 -> dV, dK products of half 1
        -> dS^T_1 to shared memory, barrier -> dQ = dS K for all 128 queries (one m64n64k128
        per warpgroup, its 64 queries over both warpgroups' keys) -> hand-over.

    The ring wait, the statistics wait, the two CTA barriers, the dQ hand-over (one 128 x D
    fp32 buffer, one TMA reduce-add) and the stage release come once per 128 queries; half 1's
    S^T/dP^T run on the tensor cores while half 0's softmax ends and dS^T_0 is stored."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    if VARLEN:
        b, hk, hq0, n0, m_start, n_m, q0, k0, seqlen_k, args = _varlen_key_tile(
            args, stride_lm, stride_dem, GRID_ORDER, CAUSAL, STATS_TMA, DQ_TMA, BLOCK_M, BLOCK_N)
        out_args = _varlen_out_args(out_args, k0)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    dk, dv = _ws_compute_m128_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, 0, 0, CAUSAL, BLOCK_M,
                                   BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_BUFS, DQ_COLS, DQ_TMA)
    _ws_store_dkdv(dk, dv, out_args, k_smem, v_smem, b, hk, n0, seqlen_k, BLOCK_N, HEAD_DIM, DKDV_TMA)


@gluon.jit
def _ws_compute_m128_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, base, kv_phase,
                          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                          STATS_TMA: gl.constexpr, DQ_BUFS: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr):
    """`_ws_compute_m128`'s work on one key tile (its coordinates from `_key_tile`), K and V of the
    tile in phase kv_phase of kv_bar: iteration j takes ring use and hand-over `base + j`.
    Returns the unscaled dK and dV; when it returns, every product reading K and V is done."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    HALF: gl.constexpr = BLOCK_M // 2
    gl.static_assert(HALF == 64, "two 64-query halves")
    gl.static_assert(DQ_COLS == HEAD_DIM, "dQ in one product")
    dtype: gl.constexpr = q_desc.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = acc_layout(BLOCK_N, HALF, NUM_WARPS)  # S^T, dP^T of a half: keys x queries
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    # S^T of a half; dQ of all BLOCK_M queries in one product (64 a warpgroup)
    keys, dk, dv, st_zero, dq_zero = _ws_tile_start(kv_bar, kv_phase, n0, BLOCK_N, HALF, HEAD_DIM, BLOCK_M, HEAD_DIM)
    for j in range(group * n_m):
        it, stage, phase, h, m0 = _ring_step(base, j, hq0, m_start, n_m, BLOCK_M, STAGES)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        mbarrier.wait(ready.index(stage), phase)
        st = warpgroup_mma(k_smem, q_tile.slice(0, HALF, dim=0).permute((1, 0)), st_zero, use_acc=False,
                           is_async=True)
        dpt = warpgroup_mma(v_smem, do_tile.slice(0, HALF, dim=0).permute((1, 0)), st_zero, use_acc=False,
                            is_async=True)
        for hm in gl.static_range(2):
            q_half = q_tile.slice(hm * HALF, HALF, dim=0)
            do_half = do_tile.slice(hm * HALF, HALF, dim=0)
            m0h = m0 + hm * HALF
            queries = m0h + gl.arange(0, HALF, layout=col_layout)
            lse2 = _stat_half(lse, lse_smem, stat_ready, stage, phase, b, h, queries, m0, seqlen_q, stride_lb,
                              stride_lh, stride_lm, float("inf"), hm == 0, HALF, hm, st_layout, STATS_TMA) * LOG2E
            # (half 1: this wait also retires half 0's dV/dK products, issued before S^T_1)
            pt = _probs(st, lse2, keys, queries, n0, m0h, seqlen_k, diag, window_left, qk_scale, CAUSAL, BLOCK_N)
            delta_row = _stat_half(delta, delta_smem, stat_ready, stage, phase, b, h, queries, m0, seqlen_q,
                                   stride_deb, stride_deh, stride_dem, 0.0, False, HALF, hm, st_layout, STATS_TMA)
            dpt = warpgroup_mma_wait(0, deps=(dpt,))
            dst16 = (pt * (dpt - delta_row)).to(dtype)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_half, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_half, dk, is_async=True)
            if hm == 0:  # half 1's products queue behind half 0's dV/dK
                st = warpgroup_mma(k_smem, q_tile.slice(HALF, HALF, dim=0).permute((1, 0)), st_zero,
                                   use_acc=False, is_async=True)
                dpt = warpgroup_mma(v_smem, do_tile.slice(HALF, HALF, dim=0).permute((1, 0)), st_zero,
                                    use_acc=False, is_async=True)
            ds_smem.slice(hm * HALF, HALF, dim=1).store(dst16)
        fence_async_shared()
        gl.thread_barrier()  # dS^T complete in shared memory (both halves, both warpgroups' key rows)
        buf = it % DQ_BUFS
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.wait(dq_empty.index(buf), ((it // DQ_BUFS) & 1) ^ 1)
        dq_smem.index(buf).store(dq)
        if DQ_TMA:
            fence_async_shared()  # the writer's TMA reads the buffer
        gl.thread_barrier()  # dQ stored by every warp; every product reading Q, dO and dS is done
        mbarrier.arrive(dq_full.index(buf), count=1)
        mbarrier.arrive(empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _ws_compute_partition(args, lse_strides, out_args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                          STATS_TMA: gl.constexpr, DQ_BUFS: gl.constexpr, DQ_COLS: gl.constexpr,
                          DQ_TMA: gl.constexpr, DKDV_TMA: gl.constexpr, VARLEN: gl.constexpr = False,
                          GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """The compute partition: 128-query stages in two 64-query halves (`_ws_compute_m128`) or
    64-query stages (`_ws_compute`)."""
    if BLOCK_M == 128:
        _ws_compute_m128(args, lse_strides, out_args, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA,
                         DQ_BUFS, DQ_COLS, DQ_TMA, DKDV_TMA, VARLEN, GRID_ORDER)
    else:
        _ws_compute(args, lse_strides, out_args, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA,
                    DQ_BUFS, DQ_COLS, DQ_TMA, DKDV_TMA, VARLEN, GRID_ORDER)


@gluon.jit
def _ws_compute_persistent(args, kv_empty, lse_strides, out_args, p_smem, dkdv_smem, CAUSAL: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, STATS_TMA: gl.constexpr, DQ_BUFS: gl.constexpr,
                           DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DQ_ALIAS: gl.constexpr,
                           DQ_EARLY: gl.constexpr, PS_SMEM: gl.constexpr, TILE_ORDER: gl.constexpr,
                           DKDV_TMA: gl.constexpr):
    """`_ws_compute_partition` of the persistent kernel: this program's key tiles in turn (see
    `_my_key_tile`), dK and dV zeroed per tile; the ring and the dQ hand-over count on across
    tiles (`it`), K and V of tile k arrive in phase k & 1 of kv_bar. After the tile's last
    iteration (its closing CTA barrier: every warp's products are done, K and V no longer read)
    kv_empty lets the loader bring the next tile's K and V while dK and dV go out: from registers,
    or with DKDV_TMA through `dkdv_smem` (two BLOCK_N x HEAD_DIM buffers of their own: K's and V's
    are being refilled) by TMA stores that drain under the next tile and are waited for before
    the buffers are written again."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, gl.num_warps())  # dK, dV
    num_bh = k_desc.shape[0] * nheads_k
    it = 0
    for k in range(fwd_gluon._my_tile_count(gl.cdiv(seqlen_k, BLOCK_N) * num_bh, CAUSAL, TILE_ORDER)):
        b, hk, hq0, n0, m_start, n_m = _my_key_tile(k, num_bh, seqlen_q, seqlen_k, nheads_k, group, diag, CAUSAL,
                                                    BLOCK_M, BLOCK_N, TILE_ORDER)
        if DQ_ALIAS:  # D=256 (`_ws_compute_d256`)
            dk, dv = _ws_compute_d256_tile(args, lse_strides, qk_scale, p_smem, b, hk, hq0, n0, m_start, n_m, it,
                                           k & 1, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_COLS,
                                           DQ_TMA, DQ_EARLY, PS_SMEM)
        elif BLOCK_M == 128:
            dk, dv = _ws_compute_m128_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, it, k & 1,
                                           CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_BUFS, DQ_COLS,
                                           DQ_TMA)
        else:
            dk, dv = _ws_compute_tile(args, lse_strides, qk_scale, b, hk, hq0, n0, m_start, n_m, it, k & 1, CAUSAL,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_BUFS, DQ_COLS, DQ_TMA)
        # Every warp is past its last wgmma wait of the tile (its last iteration ended in a CTA
        # barrier too) and past its kv_bar wait: without this barrier, after a tile without
        # queries (no iteration, no barrier) a warp still before its kv_bar wait could find
        # kv_bar two phases on (the next tile's K/V already in) and wait for ever.
        if DKDV_TMA:  # the previous tile's copies have read the staging buffers (then the barrier)
            tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(kv_empty, count=1)
        if DKDV_TMA:
            _store_dkdv_tma(dk * scale, dv, dk_ptr, dv_ptr, dkdv_smem.index(0), dkdv_smem.index(1), b, hk, n0,
                            WAIT=False)
        else:
            _store_dkdv(dk * scale, dv, dk_ptr, dv_ptr, b, hk, n0, seqlen_k, stride_dkb, stride_dkh, stride_dkn,
                        stride_dvb, stride_dvh, stride_dvn, kv_layout, BLOCK_N, HEAD_DIM)
        it += group * n_m
    if DKDV_TMA:
        tma.store_wait(0)  # the last tile's copies, before the kernel's shared memory goes


@gluon.jit
def _ws_compute_d256(args, lse_strides, out_args, p_smem, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
                     DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DQ_EARLY: gl.constexpr, PS_SMEM: gl.constexpr,
                     DKDV_TMA: gl.constexpr, VARLEN: gl.constexpr = False,
                     GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """`_ws_compute` for D=256 (DQ_ALIAS): bwd_dkdv_kernel's 64 keys x 64 queries on 8 warps
    (warpgroup w: S^T/dP^T of queries 32w..32w+31, dK/dV of head-dim columns 128w..128w+127; P^T
    and dS^T reach the other warpgroup's queries through shared memory), dQ in two column
    halves staged in the tile's own Q and dO buffers (64 x 256 bf16 = 64 x 128 fp32 each):

        S^T, dP^T -> P^T, dS^T -> dV += P^T dO, dK += dS^T Q; dS^T to shared memory, barrier
        -> dQ_0 = dS K[:, :128]; wait dV, dK, dQ_0; barrier (no warp reads Q or dO any more)
        -> dQ_0 over Q; dQ_1 = dS K[:, 128:]; dQ_1 over dO; fence, barrier; arrive dq_full[stage].

    No hand-over buffer and no dq_empty: the writer adds both halves (TMA reduce-add) and then
    releases the stage to the loader itself (`empty`), so the ring is the hand-over's flow
    control. DQ_EARLY: dQ_1 issued before the barrier and dQ_0's store (on the tensor cores
    while they run; 32 more registers live).
    PS_SMEM (FlashAttention-3's D=256 way): P^T goes to `p_smem` (stored as soon as it is
    formed, under dP^T) and the dV and dK products take P^T and dS^T from shared memory after
    the dS^T barrier, instead of converting both to register operands (each conversion is 2-3
    round trips through a scratch buffer with a 256-thread barrier each: 11 CTA barriers a
    tile against 4)."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     qk_scale, scale) = out_args
    if VARLEN:
        b, hk, hq0, n0, m_start, n_m, q0, k0, seqlen_k, args = _varlen_key_tile(
            args, stride_lm, stride_dem, GRID_ORDER, CAUSAL, STATS_TMA, DQ_TMA, BLOCK_M, BLOCK_N)
        out_args = _varlen_out_args(out_args, k0)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    dk, dv = _ws_compute_d256_tile(args, lse_strides, qk_scale, p_smem, b, hk, hq0, n0, m_start, n_m, 0, 0, CAUSAL,
                                   BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_COLS, DQ_TMA, DQ_EARLY,
                                   PS_SMEM)
    _ws_store_dkdv(dk, dv, out_args, k_smem, v_smem, b, hk, n0, seqlen_k, BLOCK_N, HEAD_DIM, DKDV_TMA)


@gluon.jit
def _ws_compute_d256_tile(args, lse_strides, qk_scale, p_smem, b, hk, hq0, n0, m_start, n_m, base, kv_phase,
                          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
                          DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr, DQ_EARLY: gl.constexpr,
                          PS_SMEM: gl.constexpr):
    """`_ws_compute_d256`'s work on one key tile (its coordinates from `_key_tile`), K and V of the
    tile in phase kv_phase of kv_bar: iteration j takes ring use `base + j`. Returns the
    unscaled dK and dV; when it returns, every product reading K and V is done."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem = lse_strides
    gl.static_assert(2 * DQ_COLS == HEAD_DIM, "dQ halves staged in the Q and dO buffers")
    dtype: gl.constexpr = q_desc.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M, NUM_WARPS)  # S^T, dP^T: keys x queries
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    keys, dk, dv, st_zero, dq_zero = _ws_tile_start(kv_bar, kv_phase, n0, BLOCK_N, BLOCK_M, HEAD_DIM, BLOCK_M,
                                                    DQ_COLS)
    for j in range(group * n_m):
        it, stage, phase, h, m0 = _ring_step(base, j, hq0, m_start, n_m, BLOCK_M, STAGES)
        q_tile, do_tile, queries, pt, dpt = _ws_probs(args, lse_strides, qk_scale, st_zero, keys, b, n0, stage, phase,
                                                      h, m0, CAUSAL, BLOCK_M, BLOCK_N, STATS_TMA)
        if PS_SMEM:
            p_smem.store(pt.to(dtype))  # (dP^T still on the tensor cores)
        delta_row = _delta_row(delta, delta_smem, stage, b, h, queries, seqlen_q, stride_deb, stride_deh,
                               stride_dem, st_layout, STATS_TMA)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dst16 = (pt * (dpt - delta_row)).to(dtype)
        if PS_SMEM:
            ds_smem.store(dst16)
            fence_async_shared()
            gl.thread_barrier()  # P^T and dS^T complete in shared memory (both warpgroups' queries)
            dv = warpgroup_mma(p_smem, do_tile, dv, is_async=True)
            dk = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)
        else:
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_tile, dk, is_async=True)
            ds_smem.store(dst16)
            fence_async_shared()
            gl.thread_barrier()  # dS^T complete in shared memory (both warpgroups' queries)
        dq_half0 = q_tile._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout)
        dq_half1 = do_tile._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(0, DQ_COLS, dim=1), dq_zero, use_acc=False,
                           is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        if DQ_EARLY:
            dq1 = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(DQ_COLS, DQ_COLS, dim=1), dq_zero,
                                use_acc=False, is_async=True)
            gl.thread_barrier()  # every warp's dK/dV products (the Q and dO readers) are done
            dq_half0.store(dq)
            dq1 = warpgroup_mma_wait(0, deps=(dq1,))
            dq_half1.store(dq1)
        else:
            gl.thread_barrier()  # every warp's dK/dV products (the Q and dO readers) are done
            dq_half0.store(dq)
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(DQ_COLS, DQ_COLS, dim=1), dq_zero,
                               use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            dq_half1.store(dq)
        # Always fenced: the loader's next TMA copy into this stage (async proxy) follows these
        # generic stores, also where the writer reads them with ld.shared (no DQ_TMA).
        fence_async_shared()
        gl.thread_barrier()  # dQ stored by every warp; every product reading dS^T is done
        mbarrier.arrive(dq_full.index(stage), count=1)
    return dk, dv


@gluon.jit
def _ws_dq_writer_alias(args, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr,
                        VARLEN: gl.constexpr = False,
                        GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """`_ws_dq_writer` for `_ws_compute_d256`: dQ's two column halves lie in the stage's Q and
    dO buffers (fp32, BLOCK_M x DQ_COLS each); after adding them (two TMA reduce-adds, or the
    red.v4 blocks of `_ws_dq_writer`) the writer, not the compute warps, releases the stage."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    q0 = 0
    if VARLEN:
        b, hk, hq0, n0, m_start, n_m, q0, k0, _, args = _varlen_key_tile(
            args, 0, 0, GRID_ORDER, CAUSAL, True, DQ_TMA, BLOCK_M, BLOCK_N)
    else:
        b, hk, hq0, n0, m_start, n_m = _key_tile(seqlen_q, seqlen_k, nheads_k, group, diag, window_left, CAUSAL,
                                                 BLOCK_M, BLOCK_N, GRID_ORDER)
    _ws_dq_writer_alias_tile(args, b, hq0, m_start, n_m, 0, q0, BLOCK_M, STAGES, DQ_COLS, DQ_TMA)


@gluon.jit
def _ws_dq_writer_alias_tile(args, b, hq0, m_start, n_m, base, q0, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                             DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr):
    """The alias writer's work for one key tile: its iterations j take ring use `base + j`."""
    (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
     seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left, cu_seqlens) = args
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    block_rows, offsets = _quad_offsets(stride_dqm)
    for j in range(group * n_m):
        it, stage, phase, h, m0 = _ring_step(base, j, hq0, m_start, n_m, BLOCK_M, STAGES)
        mbarrier.wait(dq_full.index(stage), phase)
        dq_half0 = q_smem.index(stage)._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout)
        dq_half1 = do_smem.index(stage)._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], dq_smem_layout)
        _add_dq(dq_acc, (dq_half0, dq_half1), b, h, m0, q0, seqlen_q, stride_dqb, stride_dqh, stride_dqm, block_rows,
                offsets, BLOCK_M, DQ_COLS, DQ_TMA)
        if not DQ_TMA:
            fence_async_shared()  # these generic reads before the loader's TMA refill of the stage
        gl.thread_barrier()  # both warps have read the stage (or waited for the copy engine)
        mbarrier.arrive(empty.index(stage), count=1)


@gluon.jit
def bwd_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, dk_ptr, dv_ptr,
                       stride_lb, stride_lh, stride_lm,
                       stride_deb, stride_deh, stride_dem,
                       stride_dqb, stride_dqh, stride_dqm,
                       stride_dkb, stride_dkh, stride_dkn,
                       stride_dvb, stride_dvh, stride_dvn,
                       seqlen_q, seqlen_k, nheads_k, group, diag, qk_scale, scale, window_left,
                       cu_seqlens_q, cu_seqlens_k,
                       CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
                       DQ_BUFS: gl.constexpr, DQ_COLS: gl.constexpr, DQ_TMA: gl.constexpr,
                       DQ_ALIAS: gl.constexpr, DQ_EARLY: gl.constexpr, PS_SMEM: gl.constexpr,
                       PERSISTENT: gl.constexpr = False, TILE_ORDER: gl.constexpr = 0,
                       DKDV_TMA: gl.constexpr = False, VARLEN: gl.constexpr = False,
                       GRID_ORDER: gl.constexpr = SEQ_MAJOR):
    """Arguments as bwd_dkdv_kernel's (dq_acc 16-byte aligned, strides multiples of 4; with
    DQ_TMA its descriptor, blocks of BLOCK_M x HEAD_DIM). DQ_BUFS: dQ hand-over buffers in shared
    memory; DQ_COLS: dQ columns per product.
    DQ_ALIAS (D=256, `_ws_compute_d256`): no hand-over buffers (DQ_BUFS unused); dQ's two halves
    of DQ_COLS columns are staged in the consumed stage's Q and dO buffers (dq_acc blocks of
    BLOCK_M x DQ_COLS), one dq_full barrier per stage, and the writer releases the stage.
    DQ_EARLY, PS_SMEM (with DQ_ALIAS; PS_SMEM: a BLOCK_N x BLOCK_M buffer for P^T): see
    `_ws_compute_d256`.
    PERSISTENT: a grid of at most one program per SM, each running key tiles
    in turn (`_my_key_tile`, causal order TILE_ORDER), every partition walking the same
    sequence; the ring's and the hand-over's barriers count on across tiles, K and V (single
    buffers) are refilled once the compute warps arrive on kv_empty (docs/notes/bwd-persistent.md).
    DKDV_TMA: dk_ptr and dv_ptr are TMA descriptors of dK and dV (blocks of BLOCK_N x HEAD_DIM,
    K's and V's dtype and layout); the tile's dK and dV leave through K's and V's shared buffers
    (`_store_dkdv_tma`), with PERSISTENT through two staging buffers of their own.
    VARLEN (one key tile a program, neither DKDV_TMA nor STATS_TMA): packed sequences. q/k/v/dO and dq_acc are
    (1, H, total, D) views, lse/delta (1, Hq, total), dK/dV pointers with batch strides 0; sequence
    b's queries are cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (keys: cu_seqlens_k), seqlen_q /
    seqlen_k the longest sequences (the grid covers seqlen_k's key tiles for every sequence), diag
    1 for bottom-right alignment, 0 for top-left (`_varlen_key_tile`). A tile's queries past its
    sequence's end (the next sequence's) get P = 0 (their LSE is taken as +inf), so their dQ rows
    are 0 and adding them changes nothing; its keys past the end are masked and not stored."""
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(not (PERSISTENT and CAUSAL == LEFT_WINDOW), "the persistent kernel takes no window")
    gl.static_assert(not (VARLEN and (PERSISTENT or DKDV_TMA or STATS_TMA)),
                     "VARLEN: one key tile a program, dK/dV by stores, LSE/delta by loads")
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
    stat_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    if DQ_ALIAS:
        dq_smem = q_smem  # (not read: dQ goes to the stage's Q and dO buffers)
        if PS_SMEM:
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
        else:
            p_smem = ds_smem  # (not used)
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_DIM], dq_smem_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stat_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stat_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if DQ_ALIAS:  # dQ of a stage handed over in the stage; the writer's `empty` releases it
        dq_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_empty = dq_full  # (not used)
    else:
        dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(stat_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if DQ_ALIAS:
        for i in gl.static_range(STAGES):
            mbarrier.init(dq_full.index(i), count=1)
    else:
        for i in gl.static_range(DQ_BUFS):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)

    args = (q_desc, k_desc, v_desc, do_desc, lse, delta, dq_acc, stride_dqb, stride_dqh, stride_dqm,
            seqlen_q, seqlen_k, nheads_k, group, diag, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
            ds_smem, dq_smem, kv_bar, ready, stat_ready, empty, dq_full, dq_empty, window_left,
            (cu_seqlens_q, cu_seqlens_k))
    lse_strides = (stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem)
    out_args = (dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                qk_scale, scale)
    if PERSISTENT:  # key tiles in turn (any of the three bodies below)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=1)
        if not DQ_ALIAS:
            p_smem = ds_smem  # (not used)
        if DKDV_TMA:  # dK and dV staged for their TMA stores (K's and V's buffers are refilled)
            dkdv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_smem_layout)
        else:
            dkdv_smem = k_smem  # (not used)
        gl.warp_specialize([
            (_ws_compute_persistent, (args, kv_empty, lse_strides, out_args, p_smem, dkdv_smem, CAUSAL, BLOCK_M,
                                      BLOCK_N, HEAD_DIM, STAGES, STATS_TMA, DQ_BUFS, DQ_COLS, DQ_TMA, DQ_ALIAS,
                                      DQ_EARLY, PS_SMEM, TILE_ORDER, DKDV_TMA)),
            (_ws_loader_persistent, (args, kv_empty, CAUSAL, BLOCK_M, BLOCK_N, STAGES, STATS_TMA, TILE_ORDER)),
            (_ws_dq_writer_persistent, (args, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, DQ_BUFS, DQ_COLS, DQ_TMA,
                                        DQ_ALIAS, TILE_ORDER)),
        ], [1, 2], [WORKER_REGS, WORKER_REGS])
    elif DQ_ALIAS:  # D=256: 64 keys x 64 queries, dQ staged in the consumed Q/dO stage
        gl.warp_specialize([
            (_ws_compute_d256, (args, lse_strides, out_args, p_smem, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                STATS_TMA, DQ_COLS, DQ_TMA, DQ_EARLY, PS_SMEM, DKDV_TMA, VARLEN, GRID_ORDER)),
            (_ws_loader, (args, CAUSAL, BLOCK_M, BLOCK_N, STAGES, STATS_TMA, VARLEN, GRID_ORDER)),
            (_ws_dq_writer_alias, (args, CAUSAL, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, DQ_TMA, VARLEN, GRID_ORDER)),
        ], [1, 2], [WORKER_REGS, WORKER_REGS])
    else:  # 64- or 128-query stages (_ws_compute_partition picks the body)
        gl.warp_specialize([
            (_ws_compute_partition, (args, lse_strides, out_args, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                     STATS_TMA, DQ_BUFS, DQ_COLS, DQ_TMA, DKDV_TMA, VARLEN, GRID_ORDER)),
            (_ws_loader, (args, CAUSAL, BLOCK_M, BLOCK_N, STAGES, STATS_TMA, VARLEN, GRID_ORDER)),
            (_ws_dq_writer, (args, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_BUFS, DQ_TMA, VARLEN, GRID_ORDER)),
        ], [1, 2], [WORKER_REGS, WORKER_REGS])


def dq_columns(head_dim: int) -> int:
    """Columns of dQ per product (see DQ_COLS)."""
    return min(head_dim, 128)


# Kernel shapes per pipeline and head dim. dq_tma: dQ by TMA reduce-add (+20% at D=128 over
# atomics, attempt 25); dq_alias: its two column halves staged in the tile's Q and dO buffers
# (D=256: a separate buffer does not fit next to its 218 KB).
# Warp-specialized: dQ hand-over buffers (D=128: one, so 3 stages fit) and dQ columns per
# product (64-column products measured 3% slower at D=128, attempt 22); D=256 (dq_alias, no
# hand-over buffer: `_ws_compute_d256`, docs/notes/bwd-d256-ws.md): dQ in two halves of 128
# columns staged in the consumed Q/dO stage; dq_early: the second half's product issued before
# the first half's store (not measured yet).
# dkdv_tma (default 1; warp-specialized kernels): dK and dV leave by TMA stores where dK/dV are
# TMA-addressable in K's/V's dtype (`DKDV_TMA`); 0: per-thread stores. One-tile kernels: through
# K's and V's shared buffers; attempt 54 (H200, 2026-11-30, `docs/runs/2026-11-30-session12/
# bench_bwd_dkdv_tma.log`): +5-7% at D=128 (S 1024/4096, full and causal), +9% at D=256 S=1024
# causal; the stores were half partial sectors and 19% of the compute warps' stall samples.
# Persistent kernel: through staging buffers of its own where they fit (D=64's m128n128 2 stages;
# not D 128/256), except in pairs order (TILE_ORDER 2); attempt 55 (H200, 2026-11-30,
# `docs/runs/2026-11-30-session13/`): +2-4% at S=1024, S >= 4096 unchanged, but the pairs order
# (B=1 S=16384 causal) 413 against 434 TFLOP/s in two runs.
# Persistent (PERSISTENT) causal key-tile order where SHAPES gives no tile_order (see `_my_key_tile`):
# pairs (a head's longest with its shortest key tile), the forward's best at most shapes. At D=64
# (the one head dim registered persistent) heads outermost measured best: dK/dV GPU time 1.10x
# the one-tile kernel's at B=16 S=1024 causal (pairs 1.08x, LPT 0.95x) and 1.08x at B=4 S=4096
# (pairs 1.04x, LPT 1.05x); H200, 2026-11-30, attempt 43. Where heads outermost leaves the
# static schedule unbalanced (B=1 H=16 S=16384: 0.71x cuDNN) a launch runs pairs instead
# (persistent_schedule.causal_tile_order, attempt 44).
DEFAULT_TILE_ORDER = 2
SHAPES = {
    "gluon": {64: dict(dq_tma=1), 128: dict(dq_tma=1), 256: dict(dq_tma=1, dq_alias=1)},
    "gluon_ws": {64: dict(dq_bufs=2, dq_cols=64, dq_tma=1, tile_order=1), 128: dict(dq_bufs=1, dq_cols=128, dq_tma=1),
                 256: dict(dq_bufs=0, dq_cols=128, dq_tma=1, dq_alias=1, dq_early=0, ps_smem=1)},
}


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, dq_acc, *, causal: bool, align_bottom_right: bool,
                scale: float, block_m: int, block_n: int, num_stages: int, num_warps: int = 8,
                warp_specialized: bool = False, persistent: bool = False, window_left: int = -1,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
                max_seqlen_k: int = 0) -> launch_cache.Planned | None:
    """(B, H, S, D) views; lse/delta (B, Hq, Sq) fp32; dq_acc fp32 (B, Hq, Sq, D) view, zeroed
    (16-byte aligned rows for the warp-specialized kernel: fmha allocates it so).
    window_left >= 0 (with causal, not persistent): the sliding window (window_left, 0), each
    query's keys from window_left before its diagonal to the diagonal (CAUSAL=LEFT_WINDOW: a key
    tile's loop ends at the last query tile whose windows reach it); -1: none.
    cu_seqlens_q/k (int32 (B + 1,) prefix sums; the one-tile warp-specialized kernel): packed
    sequences (VARLEN): q/k/v/do/dk/dv/dq_acc (total, H, D), lse/delta (Hq, total_q),
    max_seqlen_q/k the longest sequences; masks align per sequence; LSE/delta by per-thread loads.
    No launch plan.
    persistent (warp_specialized): one program per SM walks the key tiles
    (bwd_dkdv_ws_kernel's PERSISTENT; causal tile order `preferred_tile_order`, pairs where
    heads outermost would unbalance the programs: persistent_schedule.causal_tile_order).
    Returns the launch plan this call ran or made (None: none), as fwd_gluon.launch."""
    if window_left >= 0 and (not causal or persistent):
        raise ValueError(f"window_left={window_left}: a window (window_left, 0) needs causal=True and the "
                         f"one-tile kernel (persistent=False); got causal={causal}, persistent={persistent}")
    if cu_seqlens_q is not None:
        return _launch_dkdv_varlen(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal=causal, align_bottom_right=align_bottom_right, scale=scale,
                                   block_m=block_m, block_n=block_n, num_stages=num_stages,
                                   warp_specialized=warp_specialized, persistent=persistent, window_left=window_left)
    key = None
    if launch_cache.plans_enabled(bwd_dkdv_ws_kernel):
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), do.stride(), lse.shape, lse.stride(),
               delta.stride(), dq_acc.stride(), dk.stride(), dv.stride(), q.dtype, dk.dtype, dv.dtype, lse.dtype,
               delta.dtype, dq_acc.dtype, lse.data_ptr() % 16, delta.data_ptr() % 16, dq_acc.data_ptr() % 16,
               dk.data_ptr() % 16 == 0, dv.data_ptr() % 16 == 0, q.get_device(), launch_cache.current_device(),
               id(SHAPES), DENSE_GRID_ORDER, causal, align_bottom_right, scale, block_m, block_n, num_stages,
               num_warps, warp_specialized, persistent, window_left)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k, v, do, lse, delta, dk, dv, dq_acc)
            return planned
    batch, nheads_q, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    diag = seqlen_k - seqlen_q if align_bottom_right else 0
    grid = (cdiv(seqlen_k, block_n) * batch * nheads_k,)
    tile_order = None
    if persistent:  # one program per SM (~200 KB of shared memory a program)
        grid = (min(grid[0], _sm_count(q.device)),)
        if causal:
            tile_order = causal_tile_order(preferred_tile_order(head_dim), batch * nheads_k,
                                           cdiv(seqlen_k, block_n), grid[0])
    # LSE/delta by TMA needs 16-byte aligned bases and row strides (Sq % 4 == 0 when contiguous).
    stats_tma = tma_aligned(lse, delta)
    # dQ pairs 8-byte aligned: the kernel assumes column stride 1; the other strides even.
    dq_v2 = dq_acc.data_ptr() % 8 == 0 and all(s % 2 == 0 for s in dq_acc.stride()[:3])
    # dK and dV by TMA stores where they have K's and V's dtypes and TMA can address them.
    dkdv_tma = dk.dtype == k.dtype and dv.dtype == v.dtype and tma_aligned(dk, dv)
    kernel, constexprs, options, reduce_cols = _kernel_spec(
        head_dim, block_m, block_n, num_stages, causal=LEFT_WINDOW.value if window_left >= 0 else causal,
        stats_tma=stats_tma, dq_tma=tma_aligned(dq_acc),
        dq_v2=dq_v2, num_warps=num_warps, warp_specialized=warp_specialized, persistent=persistent,
        tile_order=tile_order, dkdv_tma=dkdv_tma)
    dq_tma = constexprs["DQ_TMA"]
    if warp_specialized:
        _check_dq_quads(dq_tma, dq_acc, dq_acc)
    how = (block_m, block_n, stats_tma, dq_tma, reduce_cols, constexprs.get("DKDV_TMA", False))
    # (after the tensors: every argument fixed by the key)
    tail = (*lse.stride(), *delta.stride(), *dq_acc.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            seqlen_q, seqlen_k, nheads_k, nheads_q // nheads_k, diag, scale * LOG2E.value, scale,
            max(window_left, -1), *((None, None) if warp_specialized else ()))  # (ws: no cu_seqlens, not VARLEN)
    plan = launch_cache.make_plan(kernel, grid, *_tensor_args(q, k, v, do, lse, delta, dk, dv, dq_acc, *how), *tail,
                                  **constexprs, **options)
    return launch_cache.keep(_PLANS, key, plan, bwd_dkdv_ws_kernel if warp_specialized else bwd_dkdv_kernel, tail,
                             _plan_tensors)


def _launch_dkdv_varlen(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, *, causal: bool, align_bottom_right: bool, scale: float, block_m: int,
                        block_n: int, num_stages: int, warp_specialized: bool, persistent: bool,
                        window_left: int) -> launch_cache.Planned | None:
    """`launch_dkdv` of packed sequences (VARLEN; see bwd_dkdv_ws_kernel): (1, H, total, D) views,
    dK/dV by per-thread stores with batch strides 0, rows offset per sequence in the kernel. Its
    plan is keyed by metadata and max_seqlen_q/k: the prefix sums are read by the kernel only."""
    if persistent or not warp_specialized:
        raise ValueError("varlen dK/dV: the one-tile warp-specialized kernel only (warp_specialized=True, "
                         "persistent=False)")
    key = None
    if launch_cache.plans_enabled(bwd_dkdv_ws_kernel):
        key = ("varlen", *(x for t in (q, k, v, do, lse, delta, dk, dv, dq_acc) for x in (t.shape, t.stride())),
               q.dtype, dk.dtype, dv.dtype, dq_acc.data_ptr() % 16, cu_seqlens_q.shape, cu_seqlens_k.shape,
               max_seqlen_q, max_seqlen_k, q.get_device(), launch_cache.current_device(), id(SHAPES),
               VARLEN_GRID_ORDER, causal, align_bottom_right, scale, block_m, block_n, num_stages, window_left)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k)
            return planned
    batch = cu_seqlens_q.numel() - 1
    nheads_q, head_dim = q.shape[1], q.shape[2]
    nheads_k = k.shape[1]
    # LSE/delta by per-thread loads: a TMA copy of a sequence's rows starts at its first query,
    # whose fp32 address is 16-byte aligned only where cu_seqlens_q[b] % 4 == 0 (a misaligned
    # start faulted: "illegal instruction", H200, 2026-12-01; the prefix sums live on the device).
    stats_tma = False
    acc4 = dq_acc.permute(1, 0, 2)[None]
    kernel, constexprs, options, reduce_cols = _kernel_spec(  # (dq_v2: the kernel without warp specialization's)
        head_dim, block_m, block_n, num_stages, causal=LEFT_WINDOW.value if window_left >= 0 else causal,
        stats_tma=stats_tma, dq_tma=tma_aligned(acc4), dq_v2=False, num_warps=8, warp_specialized=True,
        dkdv_tma=False)
    _check_dq_quads(constexprs["DQ_TMA"], acc4, dq_acc)
    scalars = (max_seqlen_q, max_seqlen_k, nheads_k, nheads_q // nheads_k, int(align_bottom_right),
               scale * LOG2E.value, scale, max(window_left, -1))

    def arrange(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_q, cu_k):
        """The kernel's arguments (TMA descriptors' places: the (1, H, total, D) views they span)."""
        q4, k4, v4, do4, acc4 = (t.permute(1, 0, 2)[None] for t in (q, k, v, do, dq_acc))
        return (q4, k4, v4, do4, lse[None], delta[None], acc4, dk, dv, 0, lse.stride(0), lse.stride(1), 0,
                delta.stride(0), delta.stride(1), *acc4.stride()[:3], 0, dk.stride(1), dk.stride(0), 0, dv.stride(1),
                dv.stride(0), *scalars, cu_q, cu_k)

    q4, k4, v4, do4, lse3, delta3, acc4, *rest = arrange(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q,
                                                         cu_seqlens_k)
    args = _tensor_args(q4, k4, v4, do4, lse3, delta3, dk, dv, acc4, block_m, block_n, stats_tma,
                        constexprs["DQ_TMA"], reduce_cols, False)
    grid = (cdiv(max_seqlen_k, block_n) * batch * nheads_k,)
    plan = launch_cache.make_plan(kernel, grid, *args, *rest[2:], **{**constexprs, "VARLEN": True,
                                                                     "GRID_ORDER": VARLEN_GRID_ORDER}, **options)
    return launch_cache.keep(_PLANS, key, plan, kernel, (), arrange)


def _plan_tensors(q, k, v, do, lse, delta, dk, dv, dq_acc) -> tuple:
    """`_tensor_args` for a plan: each descriptor's tensor in its place."""
    return q, k, v, do, lse, delta, dq_acc, dk, dv


def _tensor_args(q, k, v, do, lse, delta, dk, dv, dq_acc, block_m, block_n, stats_tma, dq_tma, reduce_cols,
                 dkdv_tma) -> tuple:
    """The dK/dV kernels' leading arguments, those of the call's tensors (TMA descriptors where
    the launch uses TMA; a plan takes each descriptor's tensor in its place, `launch_cache.run_plan`)."""
    return (descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(do, block_m),
            _stats_descriptor(lse, block_m) if stats_tma else lse,
            _stats_descriptor(delta, block_m) if stats_tma else delta,
            descriptor(dq_acc, block_m, reduce_cols) if dq_tma else dq_acc,  # (rows past Sq: clipped)
            descriptor(dk, block_n) if dkdv_tma else dk, descriptor(dv, block_n) if dkdv_tma else dv)


_PLANS = launch_cache.plan_table()


def _check_dq_quads(dq_tma: bool, view, dq_acc) -> None:
    """The warp-specialized writer without DQ_TMA adds dQ in 16-byte quads: refuse a dq_acc (its
    kernel `view`) that they cannot address."""
    if not (dq_tma or dq_quads_aligned(view)):
        raise ValueError("dq_acc: the warp-specialized dK/dV kernel adds dQ in 16-byte quads; "
                         f"got data_ptr % 16 = {dq_acc.data_ptr() % 16}, strides {dq_acc.stride()}")


def dq_quads_aligned(dq_acc) -> bool:
    """dq_acc rows addressable as 16-byte quads (what the warp-specialized writer needs)."""
    return (dq_acc.stride(-1) == 1 and dq_acc.data_ptr() % 16 == 0
            and all(s % 4 == 0 for s in dq_acc.stride()[:3]))


@functools.cache
def _sm_count(device) -> int:
    """Multiprocessors of `device` (a torch.device): the persistent grid's size."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def ws_shared_bytes(head_dim, block_m, block_n, stages, dq_bufs, persistent=False, dkdv_staging=False) -> int:
    """Shared memory of `bwd_dkdv_ws_kernel` (bf16/fp16): K and V, the Q/dO/LSE/delta ring, dS^T,
    the fp32 dQ hand-over buffers; 444 bytes of barriers and alignment on top (as compiled).
    With 64 keys on 8 warps (D=256, dq_bufs 0) each warpgroup holds half the queries of P^T and
    dS^T: P^T gets a block_n x block_m buffer of its own (PS_SMEM; as compiled: 214364 bytes at
    2 stages) or their conversion to wgmma operands a scratch buffer (at most as large; 209996).
    persistent: PERSISTENT's kv_empty barrier, PERSISTENT_BARRIER_BYTES more as compiled;
    dkdv_staging: the persistent kernel's dK/dV staging buffers (DKDV_TMA)."""
    scratch = block_n * block_m * 2 if block_n < 128 else 0
    return (2 * block_n * head_dim * 2 + stages * (2 * block_m * head_dim * 2 + 2 * block_m * 4)
            + block_n * block_m * 2 + dq_bufs * block_m * head_dim * 4 + scratch + 444
            + (PERSISTENT_BARRIER_BYTES if persistent else 0) + (2 * block_n * head_dim * 2 if dkdv_staging else 0))


PERSISTENT_BARRIER_BYTES = 32  # kv_empty: one 8-byte mbarrier, as compiled (D 64/128/256: +32 bytes)
SMEM_PER_BLOCK = 232448  # sm_90's 227 KB of shared memory a block


def preferred_tile_order(head_dim: int) -> int:
    """The persistent causal key-tile order SHAPES gives `head_dim` (DEFAULT_TILE_ORDER if none)."""
    return SHAPES["gluon_ws"][head_dim].get("tile_order", DEFAULT_TILE_ORDER)


def _kernel_spec(head_dim, block_m, block_n, num_stages, *, causal, stats_tma, dq_tma, dq_v2, num_warps,
                 warp_specialized, persistent=False, tile_order=None, dkdv_tma=False):
    """(kernel, constexprs, launch options, dQ columns per reduce-add) of one launch, the
    kernel shape from SHAPES. dq_tma: whether TMA can address dq_acc (it is used where the
    shape says so). The warp-specialized launch's num_warps is the compute partition's 8;
    with the workers 12 warps start at 168 registers (WORKER_REGS). persistent: PERSISTENT,
    with causal tile order `tile_order` (None: `preferred_tile_order`; TILE_ORDER 0 without a
    mask or persistence)."""
    shape = SHAPES["gluon_ws" if warp_specialized else "gluon"][head_dim]
    dq_tma = bool(shape["dq_tma"]) and dq_tma
    common = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages,
                  STATS_TMA=stats_tma)
    if persistent and not warp_specialized:
        raise ValueError("persistent dK/dV: only the warp-specialized kernel (bwd_dkdv_ws_kernel)")
    if warp_specialized:  # the writer reduces the whole handed-over tile
        order = (preferred_tile_order(head_dim) if tile_order is None else tile_order) if persistent and causal else 0
        dkdv_tma = dkdv_tma and bool(shape.get("dkdv_tma", 1))
        if dkdv_tma and persistent:  # staging buffers of its own where they fit; not in pairs (attempt 55)
            dkdv_tma = order != 2 and ws_shared_bytes(head_dim, block_m, block_n, num_stages, shape["dq_bufs"],
                                                      True, True) <= SMEM_PER_BLOCK
        smem = ws_shared_bytes(head_dim, block_m, block_n, num_stages, shape["dq_bufs"], persistent,
                               dkdv_tma and persistent)
        if smem > SMEM_PER_BLOCK:  # (e.g. block_m 128 with 3 stages and 2 dQ buffers)
            raise ValueError(f"warp-specialized dK/dV: block_m={block_m} block_n={block_n} stages={num_stages} "
                             f"dq_bufs={shape['dq_bufs']} at head dim {head_dim} needs {smem} bytes of shared "
                             f"memory, more than {SMEM_PER_BLOCK}")
        alias = bool(shape.get("dq_alias"))  # (D=256: the reduce-adds are of dQ's column halves)
        constexprs = dict(common, DQ_BUFS=shape["dq_bufs"], DQ_COLS=shape["dq_cols"], DQ_TMA=dq_tma,
                          DQ_ALIAS=alias, DQ_EARLY=alias and bool(shape.get("dq_early")),
                          PS_SMEM=alias and bool(shape.get("ps_smem")), PERSISTENT=persistent, TILE_ORDER=order,
                          DKDV_TMA=dkdv_tma, VARLEN=False,
                          GRID_ORDER=SEQ_MAJOR.value if persistent else DENSE_GRID_ORDER)
        return (bwd_dkdv_ws_kernel, constexprs, {"num_warps": 8, "maxnreg": 168},
                shape["dq_cols"] if alias else head_dim)
    dq_cols = shape.get("dq_cols", dq_columns(head_dim))
    constexprs = dict(common, DQ_V2=dq_v2, DQ_COLS=dq_cols, DQ_TMA=dq_tma,
                      DQ_ALIAS=dq_tma and bool(shape.get("dq_alias")))
    return bwd_dkdv_kernel, constexprs, {"num_warps": num_warps}, dq_cols


@functools.cache
def _stats_layout():
    """Shared layout of an LSE/delta TMA block [1, 1, BLOCK_M] (fp32, unswizzled)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _stats_descriptor(t, block_m: int):
    """TMA descriptor of a (B, Hq, Sq) fp32 LSE/delta: one (b, h) row of block_m queries."""
    return fast_descriptor(t, [1, 1, block_m], _stats_layout())


def compile_spec(dtype: str, head_dim: int, block_m: int, block_n: int, num_stages: int, *,
                 causal: bool, stats_tma: bool = True, dq_v2: bool = True, num_warps: int = 8,
                 warp_specialized: bool = False, dq_tma: bool | None = None,
                 persistent: bool = False, tile_order: int | None = None,
                 dkdv_tma: bool = True, window: bool = False, varlen: bool = False) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `bwd_dkdv_kernel` (`bwd_dkdv_ws_kernel` when
    warp_specialized) as `launch_dkdv` calls it (with TMA-aligned LSE/delta and dq_acc unless
    told otherwise; dq_tma None: as SHAPES says; persistent: launch_dkdv(persistent=True), whose
    causal tile order is `tile_order`, None: `preferred_tile_order`; window: with causal, a sliding
    window (launch_dkdv's window_left >= 0, CAUSAL=LEFT_WINDOW); varlen: packed sequences (VARLEN,
    warp-specialized one-tile, dK/dV by stores))."""
    kernel, constexprs, options, reduce_cols = _kernel_spec(
        head_dim, block_m, block_n, num_stages, causal=LEFT_WINDOW.value if window and causal else causal,
        stats_tma=stats_tma and not varlen, dq_tma=True if dq_tma is None else dq_tma, dq_v2=dq_v2, num_warps=num_warps,
        warp_specialized=warp_specialized, persistent=persistent, tile_order=tile_order,
        dkdv_tma=dkdv_tma and not varlen)
    if warp_specialized:
        constexprs.update(VARLEN=varlen, GRID_ORDER=VARLEN_GRID_ORDER if varlen else constexprs["GRID_ORDER"])
    elif varlen:
        raise ValueError("varlen dK/dV: the warp-specialized kernel only")
    dq_type = descriptor_type("fp32", block_m, reduce_cols) if constexprs["DQ_TMA"] else "*fp32"
    dkdv_type = descriptor_type(dtype, block_n, head_dim) if constexprs.get("DKDV_TMA") else f"*{dtype}"

    def desc(rows):
        return descriptor_type(dtype, rows, head_dim)

    stats = f"tensordesc<fp32[1,1,{block_m}],{_stats_layout()!r}>" if constexprs["STATS_TMA"] else "*fp32"
    types = {"q_desc": desc(block_m), "k_desc": desc(block_n), "v_desc": desc(block_n),
             "do_desc": desc(block_m), "lse": stats, "delta": stats, "dq_acc": dq_type,
             "dk_ptr": dkdv_type, "dv_ptr": dkdv_type, "qk_scale": "fp32", "scale": "fp32"}
    # In the kernel's argument order; the other arguments are strides and sizes (i32).
    if varlen:
        types.update(cu_seqlens_q="*i32", cu_seqlens_k="*i32")
    elif warp_specialized:
        constexprs.update(cu_seqlens_q=None, cu_seqlens_k=None)
    signature = {name: types.get(name, "i32") for name in kernel.arg_names if name not in constexprs}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs, options
