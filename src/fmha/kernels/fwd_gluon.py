"""Forward attention for Hopper in Gluon (family `fwd`, pipeline `gluon_ws`).

FlashAttention-3's structure, written with Gluon's Hopper primitives:

- warp specialization: one producer warp issues TMA loads of Q and of K/V tiles into a ring
  of shared-memory stages (mbarriers `k_ready`/`v_ready` per stage; `k_empty` released once
  S is computed, `v_empty` once P V is); two consumer warpgroups each own 64 query rows of
  the CTA's 128-row tile and share every K/V stage;
- wgmma (`warpgroup_mma`) with Q and K/V in shared memory and P from registers;
- intra-warpgroup overlap: S(j) = Q K(j)^T and O += P(j-1) V(j-1) are issued together, the
  softmax of S(j) runs while P(j-1) V(j-1) is still on the tensor cores;
- ping-pong (optional, `PINGPONG`): the two consumer warpgroups take turns issuing their
  matrix products (an mbarrier per warpgroup), so one's softmax hides under the other's
  products.

Scope (the dispatcher checks it, see registry.py): fp16/bf16, Dqk == Dv in {64, 128, 256},
bhsd or bshd views with 16-byte aligned strides (TMA), no mask or causal in either
alignment, GQA/MQA, LSE. Everything else runs on the Triton kernel (fwd.py).
Out-of-range rows and keys: TMA zero-fills loads and clips stores; keys past the end are
masked to -inf in the last tile.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import launch_cache
from .gluon_common import acc_layout, descriptor, descriptor_type, tma_aligned

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
# scale 0 would give -inf * 0 = NaN on masked keys; 1e-30 changes no logit by an fp32 ulp.
TINY_SCALE = gl.constexpr(1e-30)
# Registers per thread: 3 warpgroups start at MAXNREG (168 * 384 threads fit 64K); the
# producer gives its share to the consumers (setmaxnreg), as FlashAttention-3 does.
MAXNREG, CONSUMER_REGS, PRODUCER_REGS = 168, 240, 24
# With three consumer warpgroups (192-row tiles) 16 warps start at 128 and the consumers take
# 160 (384 * 160 + 128 * 24 fit 64K).
REGS_192 = (128, 160, 24)


def registers(block_m: int) -> tuple[int, int, int]:
    """(maxnreg at launch, consumer and producer registers after setmaxnreg) for a row tile."""
    return REGS_192 if block_m == 192 else (MAXNREG, CONSUMER_REGS, PRODUCER_REGS)
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
# fp8: P is rounded to e4m3 as P * 2**8 (fmha.fp8.P_SCALE; 256 < e4m3's 448), cancelled by l.
P_LOG2_SCALE = gl.constexpr(8)
# fp8: P enters P V with its keys permuted within blocks of 32 (FlashAttention-3's trick, see
# `_p_operand`), V^T's keys the same way (`_transposed`), instead of a layout conversion of P
# (shuffles and byte permutes on the softmax's critical path). `launch`'s and `compile_spec`'s
# default; False keeps the conversion (A/B measurement: tools/fp8_bench.py --p-perm-ab).
P_PERM = True
KEY_PERM_BLOCK = gl.constexpr(32)


@gluon.jit
def _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(b, h, hk, first row of the CTA tile, number of key tiles) of this program.

    1-d grid, heads outermost; under causal the longest row tiles start first.
    """
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    pid = gl.program_id(0)
    bh = pid // num_m
    pid_m = num_m - 1 - pid % num_m
    b = bh // nheads_q
    h = bh % nheads_q
    row0 = pid_m * BLOCK_M
    hi = seqlen_k
    if CAUSAL:
        last_row = gl.minimum(row0 + BLOCK_M, seqlen_q) - 1
        hi = gl.maximum(gl.minimum(hi, last_row + diag + 1), 0)
    # At least one tile, so that every partition runs the same (possibly fully masked) loop.
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    return b, h, h // group, row0, n_tiles


@gluon.jit
def _softmax_update(s, m_i, l_i, rows, n0, seqlen_k, diag, qk_scale, row_lo,
                    CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, BLOCK_N: gl.constexpr,
                    P_SHIFT: gl.constexpr):
    """Online softmax on one raw S tile. m is kept in raw (unscaled) units so that
    p = exp2(s * scale - m * scale) is one FMA per element; that needs scale >= 0, so a
    negative scale is applied as -S times |scale|. P_SHIFT > 0 gives p * 2**P_SHIFT (fp8:
    P in [0, 256] before its e4m3 rounding). Returns (p, m, l, alpha)."""
    if NEG_SCALE:
        s = -s
    need_mask = n0 + BLOCK_N > seqlen_k
    if CAUSAL:
        need_mask = need_mask | (n0 + BLOCK_N - 1 > row_lo + diag)
    if need_mask:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        ok = cols[None, :] < seqlen_k
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + diag)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    if P_SHIFT:
        p = gl.exp2(s * qk_scale - (m_scaled - P_SHIFT)[:, None])
    else:
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _v_operand(v_smem, stage, FP8: gl.constexpr):
    """V(stage) as the B operand [keys, D] of P V (fp8: the K-major view of its V^T tile)."""
    if FP8:
        return v_smem.index(stage).permute((1, 0))
    else:
        return v_smem.index(stage)


@gluon.jit
def _p_operand(p, p_dtype: gl.constexpr, p_layout: gl.constexpr, P_PERM: gl.constexpr):
    """P (wgmma accumulator layout, fp32) as the register A operand of P V.

    P_PERM (fp8): within each 32 keys, the accumulator gives thread t = lane % 4 the columns
    c = 16h + 8j + 2t + e (h, j, e in {0, 1}) and the e4m3 k32 A fragment wants a = 16h + 4t +
    2j + e: the same count per thread. Renaming column c to a (a reshape and permute, free in
    registers) turns P into P[:, key_perm] already in the A layout, so the conversion is a
    register renaming instead of shuffles and byte permutes; V^T's keys are permuted the same
    way on the host (`_transposed`), so P[:, key_perm] V[key_perm] = P V."""
    p = p.to(p_dtype)
    if P_PERM:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        gl.static_assert(N % KEY_PERM_BLOCK == 0, "P_PERM: BLOCK_N a multiple of 32")
        p = p.reshape([M, N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([M, N])
        return gl.convert_layout(p, p_layout, assert_trivial=True)  # a compile error if it moved data
    else:
        return gl.convert_layout(p, p_layout)


@gluon.jit
def _consumer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr,
              PINGPONG: gl.constexpr, FP8: gl.constexpr, P_PERM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om, lse_ptr, stride_lb, stride_lh,
     stride_lm, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
     seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale, descales) = args
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = acc_layout(WG_ROWS, BLOCK_N, 4, 32 if FP8 else 16)
    o_layout: gl.constexpr = acc_layout(WG_ROWS, HEAD_DIM, 4, 32 if FP8 else 16)
    # P from registers: 32 bits of consecutive k per register (2 halves or 4 bytes).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    p_dtype: gl.constexpr = gl.float8e4nv if FP8 else dtype
    P_SHIFT: gl.constexpr = P_LOG2_SCALE if FP8 else 0
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    b, h, hk, row0, n_tiles = _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, CAUSAL, BLOCK_M, BLOCK_N)
    if FP8:  # q and k descales fold into the logit scale (descales are > 0)
        (qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh,
         vd_ptr, stride_vdb, stride_vdh) = descales
        qk_scale = gl.maximum(qk_scale * gl.load(qd_ptr + b * stride_qdb + (h // qd_group) * stride_qdh)
                              * gl.load(kd_ptr + b * stride_kdb + hk * stride_kdh), TINY_SCALE)
    row_lo = row0 + WG * WG_ROWS
    rows = row_lo + gl.arange(0, WG_ROWS, layout=row_layout)
    q_tile = q_smem.index(WG)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    # Tile 0: S only (there is no P yet).
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, rows, 0, seqlen_k, diag, qk_scale, row_lo,
                                         CAUSAL, NEG_SCALE, BLOCK_N, P_SHIFT)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), j & 1)
        s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # While S(j) runs: bring O to tile j-1's running max, then O += P(j-1) V(j-1).
        acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
        p_op = _p_operand(p, p_dtype, p_layout, P_PERM)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, _v_operand(v_smem, prev, FP8), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)
        # S(j) completes first (groups retire in order); its softmax overlaps P(j-1) V(j-1).
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, rows, j * BLOCK_N, seqlen_k, diag, qk_scale,
                                             row_lo, CAUSAL, NEG_SCALE, BLOCK_N, P_SHIFT)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
    last = (n_tiles - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
    p_op = _p_operand(p, p_dtype, p_layout, P_PERM)
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, _v_operand(v_smem, last, FP8), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    # Epilogue: empty rows (all keys masked) give 0 and LSE -inf.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i * qk_scale + gl.log2(l_safe) - P_SHIFT) * LN2)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + h * stride_lh + rows * stride_lm, lse,
             mask=rows < seqlen_q)
    if FP8:  # the v descale multiplies the output
        v_descale = gl.load(vd_ptr + b * stride_vdb + hk * stride_vdh)
        out = acc * gl.convert_layout(v_descale / l_safe, orow_layout)[:, None]
    else:
        out = acc / gl.convert_layout(l_safe, orow_layout)[:, None]
    if O_TMA:
        q_tile.store(out.to(dtype))  # Q is no longer read: its buffer stages O for the TMA store
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row_lo, 0], q_tile.reshape([1, 1, WG_ROWS, HEAD_DIM]))
        tma.store_wait(0)
    else:  # another output dtype (fp32 partial results of ring attention) or alignment
        o_rows = row_lo + gl.arange(0, WG_ROWS, layout=orow_layout)
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(o_ptr + b.to(gl.int64) * stride_ob + h * stride_oh + o_rows[:, None] * stride_om + o_cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(o_rows < seqlen_q)[:, None])


@gluon.jit
def _consumer0(args, CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, P_PERM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    _consumer(args, 0, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def _consumer1(args, CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, P_PERM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    _consumer(args, 1, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def _consumer2(args, CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, P_PERM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    _consumer(args, 2, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
              FP8: gl.constexpr, P_PERM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om, lse_ptr, stride_lb, stride_lh,
     stride_lm, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
     seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale, descales) = args
    b, h, hk, row0, n_tiles = _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, CAUSAL, BLOCK_M, BLOCK_N)
    mbarrier.expect(q_bar, (BLOCK_M // WG_ROWS) * q_desc.block_type.nbytes)
    for wg in gl.static_range(BLOCK_M // WG_ROWS):
        tma.async_copy_global_to_shared(q_desc, [b, h, row0 + wg * WG_ROWS, 0], q_bar,
                                        q_smem.index(wg).reshape([1, 1, WG_ROWS, HEAD_DIM]))
    for j in range(n_tiles):
        stage = j % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(k_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(stage),
                                        k_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))
        mbarrier.wait(v_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        if FP8:  # V^T: (D, keys) tiles
            tma.async_copy_global_to_shared(v_desc, [b, hk, 0, j * BLOCK_N], v_ready.index(stage),
                                            v_smem.index(stage).reshape([1, 1, HEAD_DIM, BLOCK_N]))
        else:
            tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(stage),
                                            v_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))


@gluon.jit
def fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om,
                  lse_ptr, stride_lb, stride_lh, stride_lm,
                  seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale,
                  qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh,
                  vd_ptr, stride_vdb, stride_vdh,
                  CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
                  FP8: gl.constexpr, P_PERM: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    gl.static_assert(BLOCK_M == NUM_WG * WG_ROWS and NUM_WG >= 2 and NUM_WG <= 3,
                     "two or three consumer warpgroups of 64 rows each")
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_ROWS, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    if FP8:  # fp8 wgmma reads B K-major: V^T tiles
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], dtype)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)  # every consumer warpgroup releases a stage
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    for wg in gl.static_range(NUM_WG):
        mbarrier.init(turn.index(wg), count=1)
    mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first (then round robin)

    args = (q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om, lse_ptr, stride_lb,
            stride_lh, stride_lm, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
            seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale,
            (qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh, vd_ptr, stride_vdb,
             stride_vdh))
    # (The constexpr arguments are spelled out per partition: a tuple variable would not keep them constexpr.)
    if NUM_WG == 3:  # FA3's 192-row tile for small head dims: a third warpgroup hides more softmax
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
            (_consumer1, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
            (_consumer2, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
            (_producer, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
            (_consumer1, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
            (_producer, (args, CAUSAL, NEG_SCALE, O_TMA, PINGPONG, FP8, P_PERM, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _transposed(v, key_perm: bool = False):
    """V^T as a (B, Hk, D, Sk) view of a buffer whose rows are padded to 16 bytes (TMA); the
    descriptor's extent is Sk, so TMA zero-fills the keys past the end.

    key_perm (the kernel's P_PERM): (B, Hk, D, Sk rounded up to 32), the keys of each block of
    32 in the order P's A fragment gives them: position a = 16h + 4t + 2j + e holds key
    c = 16h + 8j + 2t + e. The keys past Sk are zeros in the buffer (the extent covers them: a
    key of the last block may sit past Sk), so the masked P = 0 meets a finite V."""
    batch, heads, seqlen, head_dim = v.shape
    if not key_perm:
        padded = -(-seqlen // 16) * 16
        vt = v.new_empty((batch, heads, head_dim, padded))[..., :seqlen]
        vt.view(torch.uint8).copy_(v.view(torch.uint8).transpose(2, 3))  # a byte copy: any fp8 view
        return vt
    block = KEY_PERM_BLOCK.value
    full = seqlen - seqlen % block
    vt = v.new_empty((batch, heads, head_dim, full + (block if full < seqlen else 0)))
    src, dst = v.view(torch.uint8), vt.view(torch.uint8)

    def permuted_copy(dst, src):  # dst (B, Hk, D, n * 32) <- src (B, Hk, n * 32, D), keys permuted
        n = src.shape[2] // block
        dst.view(batch, heads, head_dim, n, 2, 4, 2, 2).copy_(  # (h, t, j, e) <- (h, j, t, e)
            src.reshape(batch, heads, n, 2, 2, 4, 2, head_dim).permute(0, 1, 7, 2, 3, 5, 4, 6))

    if full:
        permuted_copy(dst[..., :full], src[:, :, :full])
    if full < seqlen:  # the last, partial block through a zero-padded copy
        tail = torch.zeros((batch, heads, block, head_dim), dtype=torch.uint8, device=v.device)
        tail[:, :, :seqlen - full] = src[:, :, full:]
        permuted_copy(dst[..., full:], tail)
    return vt


def launch(q, k, v, o, lse, *, causal: bool, align_bottom_right: bool, scale: float,
           block_m: int, block_n: int, num_stages: int, pingpong: bool = True,
           descales: tuple | None = None, p_perm: bool | None = None) -> None:
    """q/k/v: (B, H, S, D) views with 16-byte aligned strides; o: (B, Hq, Sq, D) view of any
    float dtype and strides (a TMA store when it is q's dtype and aligned); lse: (B, Hq, Sq) fp32.

    float8 e4m3 q/k/v: `descales` = (q, k, v) fp32 views (B|1, H|1, 1) (fmha.fp8.check_descales;
    q's H is Hq or Hk, None is 1); V is transposed into a scratch buffer first (fp8 wgmma
    reads its B operand K-major), one extra pass over V. p_perm (fp8; default `P_PERM`): the
    keys of P and of V^T permuted within blocks of 32 instead of a layout conversion of P."""
    batch, nheads_q, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    diag = seqlen_k - seqlen_q if align_bottom_right else 0
    grid = (triton.cdiv(seqlen_q, block_m) * batch * nheads_q,)
    maxnreg, consumer_regs, producer_regs = registers(block_m)
    q_desc = descriptor(q, WG_ROWS.value)
    o_tma = o.dtype == q.dtype and tma_aligned(o)
    fp8 = q.dtype == torch.float8_e4m3fn
    p_perm = fp8 and (P_PERM if p_perm is None else p_perm)
    if fp8:
        v_desc = descriptor(_transposed(v, p_perm), head_dim, block_n)
        descales = descales or (None, None, None)
        if None in descales:  # an absent descale is 1
            one = torch.ones((1, 1, 1), dtype=torch.float32, device=q.device)
            descales = tuple(one if d is None else d for d in descales)
        qd, kd, vd = descales
        qd_group = nheads_q // qd.shape[1] if qd.shape[1] > 1 else 1
        fp8_args = (qd, qd.stride(0), qd.stride(1), qd_group, kd, kd.stride(0), kd.stride(1),
                    vd, vd.stride(0), vd.stride(1))
    else:
        v_desc = descriptor(v, block_n)
        fp8_args = (None, 0, 0, 1, None, 0, 0, None, 0, 0)
    launch_cache.launch(fwd_ws_kernel, grid,
        q_desc, descriptor(k, block_n), v_desc,
        descriptor(o, WG_ROWS.value) if o_tma else q_desc,  # unused without O_TMA
        o, *o.stride()[:3], lse, *lse.stride(),
        seqlen_q, seqlen_k, nheads_q, nheads_q // nheads_k, diag, max(abs(scale) * LOG2E, TINY_SCALE.value),
        *fp8_args,
        CAUSAL=causal, NEG_SCALE=scale < 0, O_TMA=o_tma, PINGPONG=pingpong, FP8=fp8, P_PERM=p_perm,
        BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4, maxnreg=maxnreg,
    )


def compile_spec(dtype: str, head_dim: int, block_m: int, block_n: int, num_stages: int, *,
                 causal: bool, pingpong: bool, p_perm: bool | None = None) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `fwd_ws_kernel` as `launch` calls it, for an
    ahead-of-time compile (fmha kernels build) without a GPU. dtype: "fp16", "bf16" or
    "fp8e4nv" (bf16 output); p_perm as `launch`'s."""
    fp8 = dtype == "fp8e4nv"
    p_perm = fp8 and (P_PERM if p_perm is None else p_perm)

    def desc(rows, cols=head_dim):
        return descriptor_type(dtype, rows, cols)

    out = "bf16" if fp8 else dtype
    types = {"q_desc": desc(WG_ROWS.value), "k_desc": desc(block_n),
             "v_desc": desc(head_dim, block_n) if fp8 else desc(block_n),
             "o_desc": desc(WG_ROWS.value), "o_ptr": f"*{out}", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    maxnreg, consumer_regs, producer_regs = registers(block_m)
    constexprs = dict(CAUSAL=causal, NEG_SCALE=False, O_TMA=not fp8, PINGPONG=pingpong, FP8=fp8, P_PERM=p_perm,
                      BLOCK_M=block_m,
                      BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages, CONSUMER_REGS=consumer_regs,
                      PRODUCER_REGS=producer_regs)
    if fp8:
        types.update(qd_ptr="*fp32", kd_ptr="*fp32", vd_ptr="*fp32")
    else:
        constexprs.update(qd_ptr=None, kd_ptr=None, vd_ptr=None)
    # In the kernel's argument order; the other arguments are strides and sizes (i32).
    signature = {name: types.get(name, "i32") for name in fwd_ws_kernel.arg_names if name not in constexprs}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs, {"num_warps": 4, "maxnreg": maxnreg}
