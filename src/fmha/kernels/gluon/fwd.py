"""Forward attention for Hopper in Gluon (family `fwd`, pipeline `gluon_ws`).

FlashAttention-3's structure, written with Gluon's Hopper primitives:

- warp specialization: one producer warp issues TMA loads of Q and of K/V tiles into a ring
  of shared-memory stages (mbarriers `k_ready`/`v_ready` per stage; `k_empty` released once
  S is computed, `v_empty` once P V is); two consumer warpgroups each own 64 query rows of
  the CTA's 128-row tile and share every K/V stage;
- wgmma (`warpgroup_mma`) with Q and K/V in shared memory and P from registers, or (`P_SMEM`, every
  fp8 kernel) from shared memory: two buffers a warpgroup, so that no P registers are held by a
  product in flight or across the key loop's back edge (longer key tiles fit, and ptxas no longer
  waits for P(j-1) V(j-1) before the softmax of S(j));
- intra-warpgroup overlap: S(j) = Q K(j)^T and O += P(j-1) V(j-1) are issued together, the
  softmax of S(j) runs while P(j-1) V(j-1) is still on the tensor cores;
- ping-pong (optional, `PINGPONG`): the two consumer warpgroups take turns issuing their
  matrix products (an mbarrier per warpgroup), so one's softmax hides under the other's
  products.
- persistent (optional, `PERSISTENT`, `launch(persistent=True)`; the registry's choice at
  D=64 and, without a mask, at D 128/256): one program per SM walks CTA tiles in a snake
  round robin (`_my_tile`), the K/V ring and the ping-pong turns carried across tiles, Q
  freed per warpgroup (`q_empty`) so the next tile's Q and first K/V load under this tile's
  last products and O store. For short sequences, where the one-tile grid pays its prologue
  and epilogue per 128 rows. Under causal the tiles go in pairs of a head's longest and
  shortest row tile (`TILE_ORDER` 2, see `_my_tile`).

Scope (the dispatcher checks it, see registry.py): fp16/bf16, Dqk == Dv in {64, 128, 256},
bhsd or bshd views with 16-byte aligned strides (TMA), no mask or causal in either
alignment, and (one tile a program) sliding windows (left, 0) (`HAS_LEFT`) and packed varlen
sequences (`VARLEN`), GQA/MQA, LSE.
Everything else runs on the Triton kernel (fwd.py).
Out-of-range rows and keys: TMA zero-fills loads and clips stores; keys past the end are
masked to -inf in the last tile.
"""

from __future__ import annotations

import functools

import torch
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
from ..launch.args import cdiv, descale_views
from . import fp8_vt
from .common import acc_layout, descriptor, descriptor_type, tma_aligned
from .persistent_schedule import causal_tile_order

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
LOG2E_C = gl.constexpr(LOG2E)
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
# Per-SM limits (Hopper): the opt-in shared memory of one program, and the register file.
SMEM_PER_SM, REGS_PER_SM = 232448, 65536


def shared_bytes(head_dim: int, block_m: int, block_n: int, num_stages: int, elem: int = 2,
                 o_buffer: bool = False, p_smem: bool = False) -> int:
    """Shared memory of `fwd_ws_kernel`: Q, the K/V ring, the persistent kernel's own O buffer
    (`o_buffer`), P's two buffers a warpgroup (`p_smem`), and 1 KB for the barriers and the
    compiler's padding (the compiled kernels use 200-400 bytes there)."""
    tiles = block_m * head_dim * (2 if o_buffer else 1) + 2 * num_stages * block_n * head_dim
    tiles += 2 * block_m * block_n if p_smem else 0
    return tiles * elem + 1024


def persistent_o_buffer(head_dim: int, block_m: int, block_n: int, num_stages: int, elem: int = 2,
                        p_smem: bool = False) -> bool:
    """Whether the persistent kernel can stage O in its own buffer (constexpr O_BUF): then the
    next tile's Q loads while this tile's O is stored; otherwise O is staged in Q's buffer and
    the next Q waits for the store. D 64/128 fit, D 256 (64 KB of Q) does not."""
    return shared_bytes(head_dim, block_m, block_n, num_stages, elem, True, p_smem) <= SMEM_PER_SM


def programs_per_sm(head_dim: int, block_m: int, block_n: int, num_stages: int, elem: int = 2,
                    o_buffer: bool = False, p_smem: bool = False) -> int:
    """How many persistent programs fit on one SM, by shared memory and by registers (a
    program: BLOCK_M / 64 consumer warpgroups and the producer's, at maxnreg registers). 1 for
    every current configuration: the registers (168 x 384 or 128 x 512 threads) allow one."""
    warps = 4 * (block_m // 64 + 1)
    by_regs = REGS_PER_SM // (registers(block_m)[0] * 32 * warps)
    by_smem = SMEM_PER_SM // shared_bytes(head_dim, block_m, block_n, num_stages, elem, o_buffer, p_smem)
    return max(1, min(by_regs, by_smem))


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
# fp8: P is rounded to e4m3 as P * 2**8 (fmha.fp8.P_SCALE; 256 < e4m3's 448), cancelled by l.
P_LOG2_SCALE = gl.constexpr(8)
# Lazy O rescale (constexpr RESCALE_TAU > 0, FlashAttention-4's trick; fp16/bf16 only): the
# running max m used as the exponent reference is only moved when a row's max grew by more than
# tau (log2 units of the scaled logits), so P = exp2(s - m_ref) <= 2**tau and most iterations
# skip O *= alpha. fp8 keeps tau 0: its P must stay under e4m3's 448 = 2**8.8 after the 2**8
# shift, so tau <= 0.8, and that measured no gain (attempt 33).
TAU_HALF = 8.0
# P through shared memory (constexpr P_SMEM, `_attend`): every fp8 kernel (H200, 2026-12-01, attempt 83:
# +9% at D=128 with the same tile, +17-20% with the longer key tiles it makes room for). P_SMEM_16: the
# 16-bit kernels too (see attempt 84 in docs/performance.md). Both are switches for A/B runs.
P_SMEM_FP8 = True
P_SMEM_16 = False
# fp8 P is stored with its keys permuted within blocks of 32 (`_p_operand`), V^T's likewise.
KEY_PERM_BLOCK = gl.constexpr(32)


def p_through_smem(fp8: bool, varlen: bool = False) -> bool:
    """Whether `launch` and `compile_spec` build the kernel with P_SMEM (varlen: never)."""
    return (P_SMEM_FP8 if fp8 else P_SMEM_16) and not varlen


# Q from registers for S = Q K^T (constexpr Q_REGS, `_attend`): the fp8 kernel at D=128, whose S
# then reads only K from shared memory (H200, 2026-12-01, attempt 98: causal +2.3-2.9%, full
# +0.1-1.2%, outputs bitwise equal; D=64 0.99-1.00, so not there; at D=256 Q's 64 registers a
# thread leave ptxas too few: it spills and serializes the products). A switch for A/B runs.
FP8_Q_REGS = True


def q_in_registers(fp8: bool, head_dim: int) -> bool:
    """Whether `launch` and `compile_spec` build the kernel with Q_REGS."""
    return fp8 and FP8_Q_REGS and head_dim == 128


def default_rescale_tau(head_dim: int, persistent: bool, fp8: bool) -> float:
    """launch's RESCALE_TAU when the caller gives none. H200, 2026-11-30 (attempt 33, B=4 H=16
    S=4096 bf16, tau 8 against always rescaling): one tile a program +4-10% at every head dim;
    persistent +4-11% at D=256, -6..+2% at D 64/128 (where it is left off)."""
    if fp8:
        return 0.0
    return TAU_HALF if (not persistent or head_dim == 256) else 0.0


@gluon.jit
def _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, window_left, CAUSAL: gl.constexpr,
                 HAS_LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(b, h, hk, first row of the CTA tile, first key tile, number of key tiles) of this program.

    1-d grid, heads outermost; under causal the longest row tiles start first.
    """
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    pid = gl.program_id(0)
    return _coords(pid // num_m, num_m - 1 - pid % num_m, seqlen_q, seqlen_k, nheads_q, group, diag,
                   window_left, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)


@gluon.jit
def _varlen_tile(max_seqlen_q, nheads_q, group, bottom_right, window_left, cu_seqlens, CAUSAL: gl.constexpr,
                 HAS_LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """`_tile_coords` of a varlen launch (VARLEN): the grid covers max_seqlen_q's row tiles of every
    (sequence, head); sequence b's queries start at q0 = cu_seqlens_q[b] and its keys at
    k0 = cu_seqlens_k[b] (cu_seqlens: the two pointers).
    Returns (b, h, hk, first row, first key tile, number of key tiles, q0, k0, seqlen_q, seqlen_k,
    diag) with rows and keys relative to the sequence; first row >= seqlen_q: no rows (the program
    has nothing to do)."""
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    num_m = gl.cdiv(max_seqlen_q, BLOCK_M)
    pid = gl.program_id(0)
    bh = pid // num_m
    b = bh // nheads_q
    q0 = gl.load(cu_seqlens_q + b)
    seqlen_q = gl.load(cu_seqlens_q + b + 1) - q0
    k0 = gl.load(cu_seqlens_k + b)
    seqlen_k = gl.load(cu_seqlens_k + b + 1) - k0
    diag = (seqlen_k - seqlen_q) * bottom_right
    b, h, hk, row0, lo, n_tiles = _coords(bh, num_m - 1 - pid % num_m, seqlen_q, seqlen_k, nheads_q, group, diag,
                                          window_left, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)
    return b, h, hk, row0, lo, n_tiles, q0, k0, seqlen_q, seqlen_k, diag


@gluon.jit
def _coords(bh, pid_m, seqlen_q, seqlen_k, nheads_q, group, diag, window_left, CAUSAL: gl.constexpr,
            HAS_LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(b, h, hk, first row, first key tile, number of key tiles) of row tile `pid_m` of (batch,
    head) `bh`. HAS_LEFT (a window (window_left, 0)): the key tiles left of every row's window
    are skipped."""
    b = bh // nheads_q
    h = bh % nheads_q
    row0 = pid_m * BLOCK_M
    hi = seqlen_k
    if CAUSAL:
        last_row = gl.minimum(row0 + BLOCK_M, seqlen_q) - 1
        hi = gl.maximum(gl.minimum(hi, last_row + diag + 1), 0)
    end = gl.cdiv(hi, BLOCK_N)
    lo = 0
    if HAS_LEFT:  # the first row's first visible key; a tile before `end` (rows with no key: masked)
        lo = gl.minimum(gl.maximum(row0 + diag - window_left, 0) // BLOCK_N, gl.maximum(end - 1, 0))
    # At least one tile, so that every partition runs the same (possibly fully masked) loop.
    n_tiles = gl.maximum(end - lo, 1)
    return b, h, h // group, row0, lo, n_tiles


# Persistent schedule (PERSISTENT): program p of P runs the CTA tiles t(k) = k * P + slot(k),
# slot(k) = p in even rounds k and P - 1 - p in odd ones (a snake: who got the heavier tiles of
# one round gets the lighter ones of the next), while t(k) < number of tiles. Tile order:
# without a mask heads outermost as in the one-tile grid; under causal by TILE_ORDER:
#   0 (LPT): the longest row tiles of all heads first (every head's K/V streams at once);
#   1 (heads): heads outermost as in the one-tile grid (a head's row tiles together);
#   2 (pairs): units of two tiles handed out by the snake (program p runs the units
#      u(j) = j * P + slot(j), tiles k = 2j and 2j + 1): a head's longest and shortest row tile,
#      then its second longest and second shortest, ... (equal cost under causal: balanced
#      without LPT), heads outermost in blocks of two heads whose middle row tiles (odd number
#      of row tiles) form one more unit (`_pair_tile`); tools/persistent_schedule_sim.py.
# Every partition of a program walks the same sequence.
@gluon.jit
def _my_tile_count(num_tiles, CAUSAL: gl.constexpr, TILE_ORDER: gl.constexpr):
    """How many tiles this program runs: every round but the last is full."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if CAUSAL and TILE_ORDER == 2:  # units of two tiles; the last one is single if num_tiles is odd
        num_units = gl.cdiv(num_tiles, 2)
        last = gl.cdiv(num_units, nprog) - 1
        slot = pid + (last & 1) * (nprog - 1 - 2 * pid)
        mine = last + (slot < num_units - last * nprog).to(gl.int32)
        return 2 * mine - ((num_tiles & 1) * (slot == num_units - 1 - last * nprog).to(gl.int32))
    else:
        last = gl.cdiv(num_tiles, nprog) - 1
        slot = pid + (last & 1) * (nprog - 1 - 2 * pid)
        return last + (slot < num_tiles - last * nprog).to(gl.int32)


@gluon.jit
def _pair_tile(t, num_bh, num_m):
    """(bh, pid_m) of position t of TILE_ORDER 2: unit t // 2, its first or second tile."""
    u = t // 2
    second = t % 2
    half = num_m // 2
    block = u // num_m  # a block of two heads: 2 * num_m tiles, num_m units
    r = u % num_m
    bh = 2 * block
    pid_m = half  # the middle row tiles of the block's two heads (odd num_m), one unit
    if r < half:  # head 2 * block, its (r-th longest, r-th shortest) row tiles
        pid_m = num_m - 1 - r + second * (2 * r + 1 - num_m)
    elif (bh + 1 < num_bh) & (r < 2 * half):
        bh += 1
        pid_m = num_m - 1 - (r - half) + second * (2 * (r - half) + 1 - num_m)
    else:
        bh += second
    return bh, pid_m


@gluon.jit
def _my_tile(k, num_bh, seqlen_q, seqlen_k, nheads_q, group, diag, window_left, CAUSAL: gl.constexpr,
             HAS_LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILE_ORDER: gl.constexpr):
    """`_coords` of this program's k-th tile (k < _my_tile_count)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if CAUSAL and TILE_ORDER == 2:
        num_m = gl.cdiv(seqlen_q, BLOCK_M)
        j = k // 2
        u = j * nprog + pid + (j & 1) * (nprog - 1 - 2 * pid)
        bh, pid_m = _pair_tile(2 * u + (k & 1), num_bh, num_m)
    else:
        t = k * nprog + pid + (k & 1) * (nprog - 1 - 2 * pid)
        num_m = gl.cdiv(seqlen_q, BLOCK_M)
        if CAUSAL and TILE_ORDER == 0:
            bh = t % num_bh
            pid_m = num_m - 1 - t // num_bh
        else:
            bh = t // num_m
            pid_m = num_m - 1 - t % num_m
    return _coords(bh, pid_m, seqlen_q, seqlen_k, nheads_q, group, diag, window_left, CAUSAL, HAS_LEFT,
                   BLOCK_M, BLOCK_N)


@gluon.jit
def _softmax_update(s, m_i, l_i, rows, n0, seqlen_k, diag, window_left, qk_scale, row_lo,
                    CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, NEG_SCALE: gl.constexpr, BLOCK_N: gl.constexpr,
                    P_SHIFT: gl.constexpr, TAU: gl.constexpr = 0.0):
    """Online softmax on one raw S tile. m is kept in raw (unscaled) units so that
    p = exp2(s * scale - m * scale) is one FMA per element; that needs scale >= 0, so a
    negative scale is applied as -S times |scale|. P_SHIFT > 0 gives p * 2**P_SHIFT (fp8:
    P in [0, 256] before its e4m3 rounding). Returns (p, m, l, alpha, grew).

    TAU > 0 (lazy rescale): m is the reference max of the exponents, moved to the running max
    only in rows whose max grew by more than TAU (scaled log2 units); elsewhere alpha is 1 and
    m stays, so p <= 2**TAU (times 2**P_SHIFT). `grew`: the rows that moved (TAU = 0: unused)."""
    if NEG_SCALE:
        s = -s
    need_mask = n0 + BLOCK_N > seqlen_k
    if CAUSAL:
        need_mask = need_mask | (n0 + BLOCK_N - 1 > row_lo + diag)
    if HAS_LEFT:  # keys left of the last row's window edge
        need_mask = need_mask | (n0 < row_lo + WG_ROWS - 1 + diag - window_left)
    if need_mask:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        ok = cols[None, :] < seqlen_k
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + diag)
        if HAS_LEFT:
            ok = ok & (cols[None, :] >= rows[:, None] + diag - window_left)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    if TAU > 0:
        # NaN (both -inf: a row with no visible key yet) compares False: the reference stays.
        m_old = m_i * qk_scale
        grew = m_new * qk_scale - m_old > TAU
        m_new = gl.where(grew, m_new, m_i)
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.where(grew, gl.exp2(m_old - m_scaled), 1.0)
    else:
        grew = m_new != m_new  # unused without TAU
        m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_scaled)
    if P_SHIFT:
        p = gl.exp2(s * qk_scale - (m_scaled - P_SHIFT)[:, None])
    else:
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha, grew


@gluon.jit
def _v_operand(v_smem, stage, FP8: gl.constexpr):
    """V(stage) as the B operand [keys, D] of P V (fp8: the K-major view of its V^T tile)."""
    if FP8:
        return v_smem.index(stage).permute((1, 0))
    else:
        return v_smem.index(stage)


@gluon.jit
def _p_operand(p, p_dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P (wgmma accumulator layout, fp32) in the A operand's register layout, as P_SMEM stores it.
    FP8: its keys permuted within each 32 (FlashAttention-3's trick, attempt 29): the accumulator
    gives thread t = lane % 4 the columns c = 16h + 8j + 2t + e of a 32-key block, the e4m3 k32 A
    fragment wants a = 16h + 4t + 2j + e; renaming c to a is free in registers, and the store is
    then a plain stmatrix. V^T's keys are permuted the same way on the host (`_transposed(v,
    key_perm=True)`), so P[:, perm] V[perm] = P V. 16-bit: the accumulator's layout is the A
    fragment's already."""
    p = p.to(p_dtype)
    if FP8:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        gl.static_assert(N % KEY_PERM_BLOCK == 0, "the key permutation: BLOCK_N a multiple of 32")
        p = p.reshape([M, N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([M, N])
    return gl.convert_layout(p, p_layout, assert_trivial=True)  # a compile error if it moved data


@gluon.jit
def _logit_scale(qk_scale, b, h, hk, descales, FP8: gl.constexpr):
    """The logit scale of head (b, h): fp8's q and k descales fold into it (descales are > 0)."""
    if FP8:
        (qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh,
         vd_ptr, stride_vdb, stride_vdh) = descales
        qk_scale = gl.maximum(qk_scale * gl.load(qd_ptr + b * stride_qdb + (h // qd_group) * stride_qdh)
                              * gl.load(kd_ptr + b * stride_kdb + hk * stride_kdh), TINY_SCALE)
    return qk_scale


@gluon.jit
def _any_row(grew):
    """Whether any row of the warpgroup's 64 moved its reference max: one flag for the branch
    around O *= alpha (a reduction over the warpgroup's four warps)."""
    return gl.max(grew.to(gl.int32), 0) > 0


@gluon.jit
def _attend(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, q_free, p_smem, rows, row_lo, lo,
            n_tiles, it, seqlen_k, diag, window_left, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr,
            HAS_LEFT: gl.constexpr, NEG_SCALE: gl.constexpr,
            PINGPONG: gl.constexpr, FP8: gl.constexpr, RELEASE_Q: gl.constexpr, RELEASE_V: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
            TAU: gl.constexpr, P_SMEM: gl.constexpr, Q_REGS: gl.constexpr = False):
    """(O unnormalized, m, l) of one warpgroup's 64 query rows over key tiles lo .. lo + n_tiles - 1.

    Ring position g = it + j holds key tile lo + j (`it`: ring uses before this CTA tile, 0 in the
    one-tile grid). RELEASE_Q: arrive on q_free once Q is read by no later product; RELEASE_V
    (persistent): hand back the last V stage too, which the one-tile grid never reuses.

    TAU > 0 (RESCALE_TAU): m is a reference max that moves only where a row's max grew by more
    than TAU (`_softmax_update`); O *= alpha runs under a branch taken when some row of the
    warpgroup moved (`_any_row`), since alpha is exactly 1 in the others. O and l share the
    reference in every row, so O / l is the softmax as with TAU = 0.

    P_SMEM: the softmax of S(j) stores P(j) (`_p_operand`) to this warpgroup's shared buffer
    2 * WG + j % 2 of `p_smem`, which P(j) V(j) reads; the buffer was last read by P(j-2) V(j-2),
    complete before iteration j-1 ended.

    Q_REGS: Q is loaded once into registers (the A operand of S = Q K^T), so that each S reads
    only K from shared memory."""
    s_layout: gl.constexpr = acc_layout(WG_ROWS, BLOCK_N, 4, 32 if FP8 else 16)
    o_layout: gl.constexpr = acc_layout(WG_ROWS, HEAD_DIM, 4, 32 if FP8 else 16)
    # P from registers: 32 bits of consecutive k per register (2 halves or 4 bytes).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    p_dtype: gl.constexpr = gl.float8e4nv if FP8 else q_tile.dtype
    P_SHIFT: gl.constexpr = P_LOG2_SCALE if FP8 else 0
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)

    if Q_REGS:
        q_op = q_tile.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4 if FP8 else 2))
    else:
        q_op = q_tile
    # Tile 0: S only (there is no P yet).
    first = it % STAGES
    mbarrier.wait(k_ready.index(first), (it // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), it & 1)
    s = warpgroup_mma(q_op, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(first), count=1)
    p, m_i, l_i, alpha, grew = _softmax_update(s, m_i, l_i, rows, lo * BLOCK_N, seqlen_k, diag, window_left,
                                               qk_scale, row_lo, CAUSAL, HAS_LEFT, NEG_SCALE, BLOCK_N, P_SHIFT, TAU)
    if P_SMEM:
        p_smem.index(2 * WG).store(_p_operand(p, p_dtype, p_layout, FP8))
        fence_async_shared()
    if TAU > 0:
        rescale = gl.to_tensor(False)  # O is still zero
    for j in range(1, n_tiles):
        g = it + j
        stage = g % STAGES
        prev = (g - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (g // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), g & 1)
        s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # While S(j) runs: bring O to tile j-1's running max, then O += P(j-1) V(j-1).
        if TAU > 0:
            if rescale:
                acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
        else:
            acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
        # (The V wait stays after P's conversion on the register path: moved above it, one bf16
        # kernel's spills grew, 176 -> 196 bytes.)
        if P_SMEM:
            mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_smem.index(2 * WG + (j - 1) % 2), _v_operand(v_smem, prev, FP8), acc,
                                is_async=True)
        else:
            p_op = gl.convert_layout(p.to(p_dtype), p_layout)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, _v_operand(v_smem, prev, FP8), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)
        # S(j) completes first (groups retire in order); its softmax overlaps P(j-1) V(j-1).
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, m_i, l_i, alpha, grew = _softmax_update(s, m_i, l_i, rows, (lo + j) * BLOCK_N, seqlen_k, diag,
                                                   window_left, qk_scale, row_lo, CAUSAL, HAS_LEFT, NEG_SCALE,
                                                   BLOCK_N, P_SHIFT, TAU)
        if P_SMEM:
            p_smem.index(2 * WG + j % 2).store(_p_operand(p, p_dtype, p_layout, FP8))
            fence_async_shared()
        if TAU > 0:
            rescale = _any_row(grew)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
    if RELEASE_Q:  # every S of this tile is complete: Q may be overwritten
        mbarrier.arrive(q_free, count=1)
    g_last = it + n_tiles - 1
    last = g_last % STAGES
    if TAU > 0:
        if rescale:
            acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
    else:
        acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
    if P_SMEM:
        mbarrier.wait(v_ready.index(last), (g_last // STAGES) & 1)
        acc = warpgroup_mma(p_smem.index(2 * WG + (n_tiles - 1) % 2), _v_operand(v_smem, last, FP8), acc,
                            is_async=True)
    else:
        p_op = gl.convert_layout(p.to(p_dtype), p_layout)
        mbarrier.wait(v_ready.index(last), (g_last // STAGES) & 1)
        acc = warpgroup_mma(p_op, _v_operand(v_smem, last, FP8), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if RELEASE_V:
        mbarrier.arrive(v_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _with_sink(acc, m_i, l_i, h, qk_scale, sinks_ptr, P_SHIFT: gl.constexpr):
    """(acc, l, lse) with head h's sink logit in the denominator. In log2 units the rows' terms
    sum to l * 2**(m * qk_scale - P_SHIFT) and the sink adds 2**sink; both are taken relative to
    their maximum M, so neither can overflow: l' = l * 2**(r) + 2**(sink - M) with r = m * qk_scale
    - P_SHIFT - M, acc' = acc * 2**r (acc / l' is then O). An empty row (m = -inf, l = 0) gets
    l' = 1, acc' = 0 and LSE = the sink logit; a sink of -inf (no sink) leaves the row as it was."""
    o_layout: gl.constexpr = acc.type.layout
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    sink = gl.load(sinks_ptr + h).to(gl.float32) * LOG2E_C
    rows_max = m_i * qk_scale - P_SHIFT  # -inf for an empty row
    top = gl.maximum(rows_max, sink)
    top = gl.where(top == float("-inf"), 0.0, top)  # (no row term and no sink: l stays 0)
    rows_share = gl.exp2(rows_max - top)
    l_new = l_i * rows_share + gl.exp2(sink - top)
    empty = l_new == 0.0
    l_new = gl.where(empty, 1.0, l_new)
    lse = gl.where(empty, float("-inf"), (top + gl.log2(l_new)) * LN2)
    acc = acc * gl.convert_layout(rows_share, orow_layout)[:, None]
    return acc, l_new, lse


@gluon.jit
def _epilogue(acc, m_i, l_i, rows, row_lo, b, h, hk, qk_scale, o_tile, o_desc, o_ptr, stride_ob, stride_oh,
              stride_om, lse_ptr, stride_lb, stride_lh, stride_lm, seqlen_q, descales, sinks_ptr,
              O_TMA: gl.constexpr, FP8: gl.constexpr, WAIT_BEFORE: gl.constexpr, HEAD_DIM: gl.constexpr,
              HAS_SINKS: gl.constexpr):
    """Normalize O, store it and the LSE. Empty rows (all keys masked) give 0 and LSE -inf.

    HAS_SINKS: head h's sink logit (fp32, natural-log units, `sinks_ptr[h]`) joins the softmax's
    denominator only (`_with_sink`); an empty row then gives O = 0 and LSE = the sink logit.

    O_TMA: O is staged in `o_tile` and stored by TMA; WAIT_BEFORE: the previous store from
    `o_tile` is waited for before it is overwritten and this one is left in flight (the caller
    waits before exiting), otherwise this store is waited for (`o_tile` is free on return)."""
    P_SHIFT: gl.constexpr = P_LOG2_SCALE if FP8 else 0
    o_layout: gl.constexpr = acc.type.layout
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    if HAS_SINKS:
        acc, l_i, lse = _with_sink(acc, m_i, l_i, h, qk_scale, sinks_ptr, P_SHIFT)
        l_safe = l_i  # (> 0: the sink's share is)
    else:
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i * qk_scale + gl.log2(l_safe) - P_SHIFT) * LN2)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + h * stride_lh + rows * stride_lm, lse,
             mask=rows < seqlen_q)
    if FP8:  # the v descale multiplies the output
        (qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh,
         vd_ptr, stride_vdb, stride_vdh) = descales
        v_descale = gl.load(vd_ptr + b * stride_vdb + hk * stride_vdh)
        out = acc * gl.convert_layout(v_descale / l_safe, orow_layout)[:, None]
    else:
        out = acc / gl.convert_layout(l_safe, orow_layout)[:, None]
    if O_TMA:
        if WAIT_BEFORE:
            tma.store_wait(0)
        o_tile.store(out.to(o_tile.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row_lo, 0], o_tile.reshape([1, 1, WG_ROWS, HEAD_DIM]))
        if not WAIT_BEFORE:
            tma.store_wait(0)
    else:  # another output dtype (fp32 partial results of ring attention) or alignment
        o_rows = row_lo + gl.arange(0, WG_ROWS, layout=orow_layout)
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(o_ptr + b.to(gl.int64) * stride_ob + h * stride_oh + o_rows[:, None] * stride_om + o_cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(o_rows < seqlen_q)[:, None])


@gluon.jit
def _consumer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr,
              NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr,
              PINGPONG: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr, O_BUF: gl.constexpr,
              TILE_ORDER: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              TAU: gl.constexpr, P_SMEM: gl.constexpr, Q_REGS: gl.constexpr, HAS_SINKS: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om, lse_ptr, stride_lb, stride_lh,
     stride_lm, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
     seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale, descales, q_empty, o_smem, window_left, cu_seqlens,
     p_smem, sinks_ptr) = args
    s_layout: gl.constexpr = acc_layout(WG_ROWS, BLOCK_N, 4, 32 if FP8 else 16)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_tile = q_smem.index(WG)
    if PERSISTENT:
        # Q of tile k arrives on q_bar[WG] (phase k & 1) and is freed on q_empty[WG]: after the
        # last S of the tile, or after the O store when O is staged in Q's buffer (not O_BUF).
        # `it` counts this program's ring uses so far: see fwd_ws_kernel for the phases.
        num_bh = q_desc.shape[0] * nheads_q
        num_tiles = gl.cdiv(seqlen_q, BLOCK_M) * num_bh
        it = 0
        for k in range(_my_tile_count(num_tiles, CAUSAL, TILE_ORDER)):
            b, h, hk, row0, lo, n_tiles = _my_tile(k, num_bh, seqlen_q, seqlen_k, nheads_q, group, diag,
                                                   window_left, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N, TILE_ORDER)
            tile_scale = _logit_scale(qk_scale, b, h, hk, descales, FP8)
            row_lo = row0 + WG * WG_ROWS
            rows = row_lo + gl.arange(0, WG_ROWS, layout=row_layout)
            mbarrier.wait(q_bar.index(WG), k & 1)
            acc, m_i, l_i = _attend(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                    q_empty.index(WG), p_smem, rows, row_lo, lo, n_tiles, it, seqlen_k, diag,
                                    window_left, tile_scale, WG, CAUSAL, HAS_LEFT, NEG_SCALE, PINGPONG, FP8,
                                    O_BUF or not O_TMA, True, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, TAU, P_SMEM,
                                    Q_REGS)
            if O_BUF:
                o_tile = o_smem.index(WG)
            else:
                o_tile = q_tile
            _epilogue(acc, m_i, l_i, rows, row_lo, b, h, hk, tile_scale, o_tile, o_desc, o_ptr, stride_ob,
                      stride_oh, stride_om, lse_ptr, stride_lb, stride_lh, stride_lm, seqlen_q, descales,
                      sinks_ptr, O_TMA, FP8, O_BUF, HEAD_DIM, HAS_SINKS)
            if O_TMA and not O_BUF:  # O was staged in Q's buffer and its store has read it
                mbarrier.arrive(q_empty.index(WG), count=1)
            it += n_tiles
        if O_BUF:
            tma.store_wait(0)
    else:
        live = True
        if VARLEN:  # o and lse: batch strides 0, rows from the sequence's first query q0
            b, h, hk, row0, lo, n_tiles, q0, k0, seqlen_q, seqlen_k, diag = _varlen_tile(
                seqlen_q, nheads_q, group, diag, window_left, cu_seqlens, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)
            live = row0 < seqlen_q
            o_ptr += q0.to(gl.int64) * stride_om
            lse_ptr += q0.to(gl.int64) * stride_lm
        else:
            b, h, hk, row0, lo, n_tiles = _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, window_left,
                                                       CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)
        if live:
            qk_scale = _logit_scale(qk_scale, b, h, hk, descales, FP8)
            row_lo = row0 + WG * WG_ROWS
            rows = row_lo + gl.arange(0, WG_ROWS, layout=row_layout)
            mbarrier.wait(q_bar, 0)
            acc, m_i, l_i = _attend(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, q_bar,
                                    p_smem, rows, row_lo, lo, n_tiles, 0, seqlen_k, diag, window_left, qk_scale, WG,
                                    CAUSAL, HAS_LEFT, NEG_SCALE, PINGPONG, FP8, False, False, BLOCK_M, BLOCK_N,
                                    HEAD_DIM, STAGES, TAU, P_SMEM, Q_REGS)
            # (With O_TMA, Q is no longer read: its buffer stages O for the TMA store.)
            _epilogue(acc, m_i, l_i, rows, row_lo, b, h, hk, qk_scale, q_tile, o_desc, o_ptr, stride_ob, stride_oh,
                      stride_om, lse_ptr, stride_lb, stride_lh, stride_lm, seqlen_q, descales, sinks_ptr, O_TMA, FP8,
                      False, HEAD_DIM, HAS_SINKS)


@gluon.jit
def _consumer0(args, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr, NEG_SCALE: gl.constexpr,
               O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, PERSISTENT: gl.constexpr, O_BUF: gl.constexpr,
              TILE_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, TAU: gl.constexpr,
               P_SMEM: gl.constexpr, Q_REGS: gl.constexpr, HAS_SINKS: gl.constexpr):
    _consumer(args, 0, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF, TILE_ORDER,
              BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, TAU, P_SMEM, Q_REGS, HAS_SINKS)


@gluon.jit
def _consumer1(args, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr, NEG_SCALE: gl.constexpr,
               O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, PERSISTENT: gl.constexpr, O_BUF: gl.constexpr,
              TILE_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, TAU: gl.constexpr,
               P_SMEM: gl.constexpr, Q_REGS: gl.constexpr, HAS_SINKS: gl.constexpr):
    _consumer(args, 1, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF, TILE_ORDER,
              BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, TAU, P_SMEM, Q_REGS, HAS_SINKS)


@gluon.jit
def _consumer2(args, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr, NEG_SCALE: gl.constexpr,
               O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
               FP8: gl.constexpr, PERSISTENT: gl.constexpr, O_BUF: gl.constexpr,
              TILE_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, TAU: gl.constexpr,
               P_SMEM: gl.constexpr, Q_REGS: gl.constexpr, HAS_SINKS: gl.constexpr):
    _consumer(args, 2, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF, TILE_ORDER,
              BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, TAU, P_SMEM, Q_REGS, HAS_SINKS)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hk, j, g, k0,
             FP8: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Key tile j of head (b, hk) into ring position g (stage g % STAGES, its use g // STAGES);
    its rows start at key k0 + j * BLOCK_N (k0: a varlen sequence's first key, else 0)."""
    stage = g % STAGES
    # A fresh mbarrier counts as having completed the phase before phase 0.
    mbarrier.wait(k_empty.index(stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, k0 + j * BLOCK_N, 0], k_ready.index(stage),
                                    k_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))
    mbarrier.wait(v_empty.index(stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    if FP8:  # V^T: (D, keys) tiles
        tma.async_copy_global_to_shared(v_desc, [b, hk, 0, j * BLOCK_N], v_ready.index(stage),
                                        v_smem.index(stage).reshape([1, 1, HEAD_DIM, BLOCK_N]))
    else:
        tma.async_copy_global_to_shared(v_desc, [b, hk, k0 + j * BLOCK_N, 0], v_ready.index(stage),
                                        v_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr, NEG_SCALE: gl.constexpr,
              O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
              FP8: gl.constexpr, PERSISTENT: gl.constexpr, O_BUF: gl.constexpr,
              TILE_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om, lse_ptr, stride_lb, stride_lh,
     stride_lm, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
     seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale, descales, q_empty, o_smem, window_left, cu_seqlens,
     p_smem, sinks_ptr) = args
    if PERSISTENT:
        num_bh = q_desc.shape[0] * nheads_q
        num_tiles = gl.cdiv(seqlen_q, BLOCK_M) * num_bh
        it = 0
        for k in range(_my_tile_count(num_tiles, CAUSAL, TILE_ORDER)):
            b, h, hk, row0, lo, n_tiles = _my_tile(k, num_bh, seqlen_q, seqlen_k, nheads_q, group, diag,
                                                   window_left, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N, TILE_ORDER)
            # Key tile lo first: its stage frees before this tile's Q buffers do (they wait for
            # the previous tile's last S, or its O store), so it is in flight meanwhile.
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hk, lo, it, 0,
                     FP8, BLOCK_N, HEAD_DIM, STAGES)
            for wg in gl.static_range(BLOCK_M // WG_ROWS):
                mbarrier.wait(q_empty.index(wg), (k & 1) ^ 1)
                mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [b, h, row0 + wg * WG_ROWS, 0], q_bar.index(wg),
                                                q_smem.index(wg).reshape([1, 1, WG_ROWS, HEAD_DIM]))
            for j in range(1, n_tiles):
                _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hk, lo + j, it + j,
                         0, FP8, BLOCK_N, HEAD_DIM, STAGES)
            it += n_tiles
    else:
        q0 = 0
        k0 = 0
        live = True
        if VARLEN:  # rows and keys of sequence b from q0 and k0 of the packed (1, H, total, D) views
            b, h, hk, row0, lo, n_tiles, q0, k0, seqlen_q, seqlen_k, diag = _varlen_tile(
                seqlen_q, nheads_q, group, diag, window_left, cu_seqlens, CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)
            live = row0 < seqlen_q
            b = 0
        else:
            b, h, hk, row0, lo, n_tiles = _tile_coords(seqlen_q, seqlen_k, nheads_q, group, diag, window_left,
                                                       CAUSAL, HAS_LEFT, BLOCK_M, BLOCK_N)
        if live:
            mbarrier.expect(q_bar, (BLOCK_M // WG_ROWS) * q_desc.block_type.nbytes)
            for wg in gl.static_range(BLOCK_M // WG_ROWS):
                tma.async_copy_global_to_shared(q_desc, [b, h, q0 + row0 + wg * WG_ROWS, 0], q_bar,
                                                q_smem.index(wg).reshape([1, 1, WG_ROWS, HEAD_DIM]))
            for j in range(n_tiles):
                _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hk, lo + j, j, k0,
                         FP8, BLOCK_N, HEAD_DIM, STAGES)


# seqlen_q is not specialized: with seqlen_q == 1 folded in, ptxas (Triton 3.6's, sm_90a) dies with SIGSEGV
# on the P_SMEM kernels (seen on the H200 and on this CPU's ptxas, 2026-12-01).
@gluon.jit(do_not_specialize=["seqlen_q"])
def fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, stride_ob, stride_oh, stride_om,
                  lse_ptr, stride_lb, stride_lh, stride_lm,
                  seqlen_q, seqlen_k, nheads_q, group, diag, qk_scale,
                  qd_ptr, stride_qdb, stride_qdh, qd_group, kd_ptr, stride_kdb, stride_kdh,
                  vd_ptr, stride_vdb, stride_vdh, window_left, cu_seqlens_q, cu_seqlens_k, sinks_ptr,
                  CAUSAL: gl.constexpr, NEG_SCALE: gl.constexpr, O_TMA: gl.constexpr, PINGPONG: gl.constexpr,
                  FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  PERSISTENT: gl.constexpr, O_BUF: gl.constexpr, TILE_ORDER: gl.constexpr = 2,
                  RESCALE_TAU: gl.constexpr = 0.0, HAS_LEFT: gl.constexpr = False, VARLEN: gl.constexpr = False,
                  P_SMEM: gl.constexpr = False, Q_REGS: gl.constexpr = False, HAS_SINKS: gl.constexpr = False):
    """HAS_SINKS: sink logits, one fp32 a query head at `sinks_ptr` (None without), in the softmax's
    denominator only (`_with_sink`).
    RESCALE_TAU > 0: the lazy O rescale (`_attend`; 0: O is rescaled on every key tile).
    HAS_LEFT (with CAUSAL): a sliding window (window_left, 0), key j visible to row i when
    i + diag - window_left <= j <= i + diag; the key tiles left of a CTA tile's windows are not
    loaded (`_coords`).
    VARLEN (one tile a program, fp16/bf16, O by per-thread stores): q/k/v/o are packed sequences
    as (1, H, total, D) views, o and lse with batch strides 0; sequence b's rows are
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (keys: cu_seqlens_k), seqlen_q / seqlen_k are the
    longest sequences (the grid covers seqlen_q's row tiles for every sequence: programs past their
    sequence's end do nothing), and diag is 1 for bottom-right alignment, 0 for top-left
    (`_varlen_tile`). A CTA tile's rows past its sequence's end (the next sequence's) are computed
    but not stored; its keys past the end are masked as the last tile's always are.
    P_SMEM: P V reads P from shared memory (`_attend`; fp8: keys permuted, V^T likewise).
    Q_REGS: S = Q K^T reads Q from registers, loaded once a tile (`_attend`, `q_in_registers`).
    PERSISTENT: a grid of at most one program per SM, each running CTA tiles in turn (see
    `_my_tile`); O_BUF (with PERSISTENT and O_TMA): O is staged in its own buffer instead of
    Q's, so the next tile's Q loads while this tile's O is stored (`persistent_o_buffer`).

    Barrier phases. Ring position g (this program's g-th key tile over all its CTA tiles;
    g = j in the one-tile grid) uses stage g % STAGES for the (g // STAGES)-th time: k_ready /
    v_ready complete one phase per use (expect + TMA bytes), so consumers wait parity
    (g // STAGES) & 1; k_empty / v_empty complete one phase per use when all NUM_WG warpgroups
    have arrived, and the producer's use u waits for the release of use u - 1, parity
    (u & 1) ^ 1 (u = 0: the phase before phase 0, complete on a fresh barrier). Every use is
    released (persistent: the last V stage of a tile too), so the counts never drift, and no
    side runs more than one phase ahead (the producer waits for each release, the consumers
    for each load), which is what a parity wait can tell apart. Persistent Q: q_bar[wg] and
    q_empty[wg] complete one phase per CTA tile k: consumers wait parity k & 1, the producer
    (k & 1) ^ 1. Ping-pong `turn[wg]` completes one phase per key tile (the other warpgroup's
    arrive after its products; warpgroup 0's first from the init), so its parity is g & 1 over
    the tiles too: all warpgroups run the same key tiles, a tile boundary changes nothing."""
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    gl.static_assert(BLOCK_M == NUM_WG * WG_ROWS and NUM_WG >= 2 and NUM_WG <= 3,
                     "two or three consumer warpgroups of 64 rows each")
    gl.static_assert(not O_BUF or (PERSISTENT and O_TMA), "O_BUF: a persistent kernel's TMA-stored O")
    gl.static_assert(RESCALE_TAU >= 0, "RESCALE_TAU: a threshold in log2 units, >= 0")
    gl.static_assert(RESCALE_TAU == 0 or not FP8, "RESCALE_TAU: fp16/bf16 only (e4m3 P would overflow)")
    gl.static_assert(CAUSAL or not HAS_LEFT, "HAS_LEFT: a window (window_left, 0), so with CAUSAL")
    gl.static_assert(not (VARLEN and (PERSISTENT or FP8 or O_TMA)), "VARLEN: one tile a program, 16-bit, O by stores")
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
    if P_SMEM:  # two P buffers a warpgroup
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG, WG_ROWS, BLOCK_N], p_layout)
    else:
        p_smem = k_smem  # (unused)
    if O_BUF:
        o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_ROWS, HEAD_DIM], tile_layout)
    else:
        o_smem = q_smem  # (unused)
    if PERSISTENT:  # one Q barrier pair per warpgroup: each frees and gets its Q rows on its own
        q_bar = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    else:
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    if PERSISTENT:
        for wg in gl.static_range(NUM_WG):
            mbarrier.init(q_bar.index(wg), count=1)
            mbarrier.init(q_empty.index(wg), count=1)
    else:
        mbarrier.init(q_bar, count=1)
        q_empty = q_bar  # (unused)
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
             stride_vdh), q_empty, o_smem, window_left, (cu_seqlens_q, cu_seqlens_k), p_smem, sinks_ptr)
    # (The constexpr arguments are spelled out per partition: a tuple variable would not keep them constexpr.)
    if NUM_WG == 3:  # FA3's 192-row tile for small head dims: a third warpgroup hides more softmax
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                          TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, RESCALE_TAU, P_SMEM, Q_REGS,
                          HAS_SINKS)),
            (_consumer1, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                          TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, RESCALE_TAU, P_SMEM, Q_REGS,
                          HAS_SINKS)),
            (_consumer2, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                          TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, RESCALE_TAU, P_SMEM, Q_REGS,
                          HAS_SINKS)),
            (_producer, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                         TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                          TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, RESCALE_TAU, P_SMEM, Q_REGS,
                          HAS_SINKS)),
            (_consumer1, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                          TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, RESCALE_TAU, P_SMEM, Q_REGS,
                          HAS_SINKS)),
            (_producer, (args, CAUSAL, HAS_LEFT, VARLEN, NEG_SCALE, O_TMA, PINGPONG, FP8, PERSISTENT, O_BUF,
                         TILE_ORDER, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _transposed(v, key_perm: bool = False):
    """V^T as a (B, Hk, D, Sk) view of a buffer whose rows are padded to 16 bytes (TMA); the
    descriptor's extent is Sk, so TMA zero-fills the keys past the end.

    key_perm (the P_SMEM kernels' fp8 P, `_p_operand`): (B, Hk, D, Sk rounded up to 32), the keys of
    each block of 32 in the order P's A fragment gives them: position a = 16h + 4t + 2j + e holds
    key c = 16h + 8j + 2t + e. The keys past Sk are zeros in the buffer (the extent covers them: a
    key of the last block may sit past Sk), so the masked P = 0 meets a finite V."""
    batch, heads, seqlen, head_dim = v.shape
    if not key_perm:
        padded = -(-seqlen // 16) * 16
        vt = v.new_empty((batch, heads, head_dim, padded))[..., :seqlen]
    else:
        vt = v.new_empty((batch, heads, head_dim, -(-seqlen // KEY_PERM_BLOCK.value) * KEY_PERM_BLOCK.value))
    if v.is_cuda:  # a Triton copy: torch's strided copy of the permutation ran at 330 GB/s (attempt 95)
        fp8_vt.launch_vt(v.view(torch.uint8), vt.view(torch.uint8), key_perm=key_perm)
    else:
        _transposed_by_torch(v, vt, key_perm)
    return vt


def _transposed_by_torch(v, vt, key_perm: bool) -> None:
    """`_transposed`'s copy by torch's strided copies (CPU tensors, and the reference of the GPU
    test of `fp8_vt`)."""
    batch, heads, seqlen, head_dim = v.shape
    src, dst = v.view(torch.uint8), vt.view(torch.uint8)
    if not key_perm:
        dst.copy_(src.transpose(2, 3))  # a byte copy: any fp8 view
        return
    block = KEY_PERM_BLOCK.value
    full = seqlen - seqlen % block

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


def launch(q, k, v, o, lse, *, causal: bool, align_bottom_right: bool, scale: float,
           block_m: int, block_n: int, num_stages: int, pingpong: bool = True,
           descales: tuple | None = None, persistent: bool = False, tile_order: int | None = None,
           rescale_tau: float | None = None, window_left: int = -1, cu_seqlens_q=None, cu_seqlens_k=None,
           max_seqlen_q: int = 0, max_seqlen_k: int = 0, sinks=None) -> launch_cache.Planned | None:
    """q/k/v: (B, H, S, D) views with 16-byte aligned strides; o: (B, Hq, Sq, D) view of any
    float dtype and strides (a TMA store when it is q's dtype and aligned); lse: (B, Hq, Sq) fp32.

    float8 e4m3 q/k/v: `descales` = (q, k, v) fp32 views (B|1, H|1, 1) (fmha.fp8.check_descales;
    q's H is Hq or Hk, None is 1); V is transposed into a scratch buffer first (fp8 wgmma
    reads its B operand K-major), one extra pass over V.

    persistent: one program per SM (`programs_per_sm`) walks the CTA tiles (fwd_ws_kernel's
    PERSISTENT), instead of one program per tile. tile_order (TILE_ORDER, persistent and causal
    only): 0 LPT over all heads, 1 heads outermost, 2 pairs of row tiles (see `_my_tile`); None:
    `default_tile_order`, pairs where heads outermost would unbalance the programs
    (persistent_schedule.causal_tile_order).

    rescale_tau: the kernel's RESCALE_TAU (lazy O rescale, log2 units, fp16/bf16 only); None:
    `default_rescale_tau`.

    window_left >= 0 (with causal): the sliding window (window_left, 0), each row's keys from
    window_left before its diagonal to the diagonal (HAS_LEFT); -1: none.

    sinks: fp32 (Hq,) sink logits (HAS_SINKS, fp16/bf16), in the softmax's denominator only. A
    call with sinks keeps no plan (its tensor is not among a plan's arguments).

    cu_seqlens_q/k (int32 (B + 1,) prefix sums; one tile a program, fp16/bf16): packed sequences
    (VARLEN), q/k/v/o (total, H, D), lse (Hq, total_q), max_seqlen_q/k the longest sequences;
    masks align per sequence.

    Returns the launch plan this call ran or made (None: none): `Planned.launch(q, k, v, o, lse)`
    repeats it for inputs of the same metadata and the same scalar arguments (fp8:
    `Planned.launch(q, k, v, o, lse, q_descale, k_descale, v_descale)`, the descales as views of
    the plan's metadata, `descale_views`; the plan copies V^T first, `_plan_args_fp8`)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    varlen = cu_seqlens_q is not None
    if varlen:
        return _launch_varlen(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, align_bottom_right=align_bottom_right, scale=scale, block_m=block_m,
                              block_n=block_n, num_stages=num_stages, pingpong=pingpong, persistent=persistent,
                              descales=descales, rescale_tau=rescale_tau, window_left=window_left,
                              sinks=sinks)
    if sinks is not None and fp8:
        raise ValueError("sinks: the fp16/bf16 kernel only (float8 inputs take the Triton kernel)")
    if fp8:
        descales = descale_views(descales, q.device)
    key = None
    if sinks is None and launch_cache.plans_enabled(fwd_ws_kernel):
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(), lse.shape,
               lse.stride(), q.dtype, o.dtype, o.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0,
               q.get_device(), launch_cache.current_device(), causal, align_bottom_right, scale, block_m, block_n,
               num_stages, pingpong, persistent, tile_order, rescale_tau, window_left,
               # fp8: the descales' metadata (their strides and q's head group are kernel arguments)
               tuple((d.shape, d.stride(), d.data_ptr() % 16 == 0) for d in descales) if fp8 else None)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k, v, o, lse, *(descales if fp8 else ()))
            return planned
    if window_left >= 0 and not causal:
        raise ValueError(f"window_left={window_left} needs causal=True: the window is (window_left, 0)")
    batch, nheads_q, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    diag = seqlen_k - seqlen_q if align_bottom_right else 0
    grid = (cdiv(seqlen_q, block_m) * batch * nheads_q,)
    maxnreg, consumer_regs, producer_regs = registers(block_m)
    o_tma = o.dtype == q.dtype and tma_aligned(o)
    tau = float(default_rescale_tau(head_dim, persistent, fp8) if rescale_tau is None else rescale_tau)
    check_rescale_tau(tau, fp8)
    p_smem = p_through_smem(fp8)
    o_buf = False
    if persistent:
        elem = q.element_size()
        o_buf = o_tma and persistent_o_buffer(head_dim, block_m, block_n, num_stages, elem, p_smem)
        device = q.device.index if q.device.index is not None else torch.cuda.current_device()
        per_sm = programs_per_sm(head_dim, block_m, block_n, num_stages, elem, o_buf, p_smem)
        grid = (min(grid[0], _sm_count(device) * per_sm),)
    if tile_order is None:
        row_tiles = cdiv(seqlen_q, block_m)
        tile_order = default_tile_order(head_dim, row_tiles)
        if persistent and causal:
            tile_order = causal_tile_order(tile_order, batch * nheads_q, row_tiles, grid[0])
    scalars = (seqlen_q, seqlen_k, nheads_q, nheads_q // nheads_k, diag, max(abs(scale) * LOG2E, TINY_SCALE.value))
    if fp8:
        qd_group = nheads_q // descales[0].shape[1] if descales[0].shape[1] > 1 else 1
        fp8_args = _fp8_args(*descales, qd_group=qd_group)
    else:
        fp8_args = (None, 0, 0, 1, None, 0, 0, None, 0, 0)
    # (after the tensors: every argument fixed by the key; fp8: the descales are the call's tensors, so
    # a plan's tail starts after them)
    tail = (max(window_left, -1), None, None, sinks)  # (no cu_seqlens: not VARLEN)
    if not fp8:
        tail = (*scalars, *fp8_args, *tail)
    plan = launch_cache.make_plan(
        fwd_ws_kernel, grid, *_tensor_args(q, k, v, o, lse, block_n, o_tma, fp8, fp8 and p_smem),
        *((*scalars, *fp8_args) if fp8 else ()), *tail,
        CAUSAL=causal, NEG_SCALE=scale < 0, O_TMA=o_tma, PINGPONG=pingpong, FP8=fp8, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        PERSISTENT=persistent, O_BUF=o_buf, TILE_ORDER=tile_order if persistent and causal else 0,
        RESCALE_TAU=tau, HAS_LEFT=window_left >= 0, VARLEN=False, P_SMEM=p_smem, Q_REGS=q_in_registers(fp8, head_dim),
        HAS_SINKS=sinks is not None, num_warps=4, maxnreg=maxnreg,
    )
    if fp8:  # (O never by TMA: its dtype is not q's)
        arrange = functools.partial(_plan_args_fp8, key_perm=p_smem, scalars=scalars, qd_group=qd_group)
    else:
        arrange = _plan_tensors_o_tma if o_tma else _plan_tensors_no_o_tma
    return launch_cache.keep(_PLANS, key, plan, fwd_ws_kernel, tail, arrange)


def _launch_varlen(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   causal: bool, align_bottom_right: bool, scale: float, block_m: int, block_n: int,
                   num_stages: int, pingpong: bool, persistent: bool, descales, rescale_tau: float | None,
                   window_left: int, sinks=None) -> launch_cache.Planned | None:
    """`launch` of packed sequences (VARLEN; see fwd_ws_kernel): (1, H, total, D) views of q/k/v,
    o and lse addressed with batch stride 0 and rows offset per sequence in the kernel. Its plan is
    keyed by metadata and max_seqlen_q/k: the prefix sums are read by the kernel, not the launch."""
    key = None
    if sinks is None and launch_cache.plans_enabled(fwd_ws_kernel):
        key = ("varlen", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(),
               lse.shape, lse.stride(), q.dtype, o.dtype, cu_seqlens_q.shape, cu_seqlens_k.shape, max_seqlen_q,
               max_seqlen_k, q.get_device(), launch_cache.current_device(), causal, align_bottom_right, scale,
               block_m, block_n, num_stages, pingpong, persistent, descales is None, rescale_tau, window_left)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
            return planned
    if persistent or q.dtype == torch.float8_e4m3fn or descales is not None:
        raise ValueError("varlen: the one-tile fp16/bf16 kernel only (persistent=False, no fp8 descales)")
    if window_left >= 0 and not causal:
        raise ValueError(f"window_left={window_left} needs causal=True: the window is (window_left, 0)")
    batch = cu_seqlens_q.numel() - 1
    nheads_q, head_dim = q.shape[1], q.shape[2]
    nheads_k = k.shape[1]
    grid = (cdiv(max_seqlen_q, block_m) * batch * nheads_q,)
    maxnreg, consumer_regs, producer_regs = registers(block_m)
    tau = float(default_rescale_tau(head_dim, False, False) if rescale_tau is None else rescale_tau)
    check_rescale_tau(tau, False)
    # (after o and lse: every argument fixed by the key but the prefix sums)
    scalars = (max_seqlen_q, max_seqlen_k, nheads_q, nheads_q // nheads_k, int(align_bottom_right),
               max(abs(scale) * LOG2E, TINY_SCALE.value), None, 0, 0, 1, None, 0, 0, None, 0, 0, max(window_left, -1))

    def arrange(q, k, v, o, lse, cu_q, cu_k):
        """The kernel's arguments (TMA descriptors' places: the (1, H, total, D) views they span)."""
        q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (q, k, v))  # (o: per-thread stores, its own strides)
        return (q4, k4, v4, q4, o, 0, o.stride(1), o.stride(0), lse, 0, lse.stride(0), lse.stride(1), *scalars,
                cu_q, cu_k, sinks)

    q4, k4, v4, *rest = arrange(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    q_desc = descriptor(q4, WG_ROWS.value)
    plan = launch_cache.make_plan(
        fwd_ws_kernel, grid, q_desc, descriptor(k4, block_n), descriptor(v4, block_n), q_desc, *rest[1:],
        CAUSAL=causal, NEG_SCALE=scale < 0, O_TMA=False, PINGPONG=pingpong, FP8=False, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, PERSISTENT=False, O_BUF=False, TILE_ORDER=0, RESCALE_TAU=tau,
        HAS_LEFT=window_left >= 0, VARLEN=True, P_SMEM=p_through_smem(False, varlen=True), Q_REGS=False,
        HAS_SINKS=sinks is not None, num_warps=4, maxnreg=maxnreg)
    return launch_cache.keep(_PLANS, key, plan, fwd_ws_kernel, (), arrange)


def _tensor_args(q, k, v, o, lse, block_n: int, o_tma: bool, fp8: bool, key_perm: bool = False) -> tuple:
    """fwd_ws_kernel's leading arguments, those of the call's tensors: the TMA descriptors
    (fp8: of V transposed into a scratch buffer, its keys permuted with `key_perm`), O and LSE
    with their strides."""
    q_desc = descriptor(q, WG_ROWS.value)
    return (q_desc, descriptor(k, block_n),
            descriptor(_transposed(v, key_perm), q.shape[3], block_n) if fp8 else descriptor(v, block_n),
            descriptor(o, WG_ROWS.value) if o_tma else q_desc,  # unused without O_TMA
            o, *o.stride()[:3], lse, *lse.stride())


def _plan_tensors_o_tma(q, k, v, o, lse) -> tuple:
    """`_tensor_args` (not fp8, O by TMA) for a plan: each descriptor's tensor in its place."""
    return (q, k, v, o, o, *o.stride()[:3], lse, *lse.stride())


def _plan_tensors_no_o_tma(q, k, v, o, lse) -> tuple:
    """The same without O by TMA (q's descriptor in O's unused place)."""
    return (q, k, v, q, o, *o.stride()[:3], lse, *lse.stride())


def _plan_args_fp8(q, k, v, o, lse, qd, kd, vd, *, key_perm: bool, scalars: tuple, qd_group: int) -> tuple:
    """An fp8 plan's leading arguments (`Planned.launch(q, k, v, o, lse, qd, kd, vd)`): V^T copied
    from the call's V (`_transposed`) in V's descriptor place, q's in O's unused one, then the
    scalars the key fixes and the call's descale views with their strides (`descale_views`: None
    is 1)."""
    qd, kd, vd = descale_views((qd, kd, vd), q.device)
    return (q, k, _transposed(v, key_perm), q, o, *o.stride()[:3], lse, *lse.stride(), *scalars,
            *_fp8_args(qd, kd, vd, qd_group=qd_group))


def _fp8_args(qd, kd, vd, *, qd_group: int) -> tuple:
    """fwd_ws_kernel's descale arguments: each view with its (batch, head) strides, q's head group."""
    return (qd, qd.stride(0), qd.stride(1), qd_group, kd, kd.stride(0), kd.stride(1), vd, vd.stride(0), vd.stride(1))


_PLANS = launch_cache.plan_table()


def default_tile_order(head_dim: int, row_tiles: int) -> int:
    """The persistent causal kernel's TILE_ORDER for `row_tiles` query tiles a head: heads
    outermost (1) at D=128 with at most 8 row tiles (S <= 1024 at block_m 128: 423 / 396 and
    429 / 402 TFLOP/s against pairs in two H200 runs, B=16 H=16 S=1024), pairs (2) elsewhere
    (heads outermost lost 3-7% at S=1024 D 64/256 and 5-25% at 4k-16k; attempts 32 and 41)."""
    return 1 if head_dim == 128 and row_tiles <= 8 else 2


def check_rescale_tau(tau: float, fp8: bool) -> None:
    """RESCALE_TAU's range: >= 0, and 0 for fp8 (see `default_rescale_tau`)."""
    if not tau >= 0 or (fp8 and tau != 0):
        raise ValueError(f"rescale_tau={tau}: needs tau >= 0" + (", and 0 for fp8" if fp8 else ""))


def compile_spec(dtype: str, head_dim: int, block_m: int, block_n: int, num_stages: int, *,
                 causal: bool, pingpong: bool, persistent: bool = False, tile_order: int = 2,
                 rescale_tau: float | None = None, window: bool = False,
                 varlen: bool = False, sinks: bool = False) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `fwd_ws_kernel` as `launch` calls it, for an
    ahead-of-time compile (fmha kernels build) without a GPU. dtype: "fp16", "bf16" or
    "fp8e4nv" (bf16 output). persistent: the kernel `launch(..., persistent=True)` runs.
    rescale_tau: the RESCALE_TAU constexpr (None: `default_rescale_tau`, as launch). window: the
    kernel of a sliding window (HAS_LEFT; with causal). varlen: the packed-sequence kernel (VARLEN,
    one tile a program, 16-bit, O by per-thread stores). sinks: the kernel with sink logits
    (HAS_SINKS, 16-bit)."""
    fp8 = dtype == "fp8e4nv"

    def desc(rows, cols=head_dim):
        return descriptor_type(dtype, rows, cols)

    out = "bf16" if fp8 else dtype
    types = {"q_desc": desc(WG_ROWS.value), "k_desc": desc(block_n),
             "v_desc": desc(head_dim, block_n) if fp8 else desc(block_n),
             "o_desc": desc(WG_ROWS.value), "o_ptr": f"*{out}", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    maxnreg, consumer_regs, producer_regs = registers(block_m)
    p_smem = p_through_smem(fp8, varlen)
    constexprs = dict(CAUSAL=causal, NEG_SCALE=False, O_TMA=not (fp8 or varlen), PINGPONG=pingpong, FP8=fp8,
                      BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=num_stages,
                      CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, PERSISTENT=persistent,
                      O_BUF=persistent and not fp8 and persistent_o_buffer(head_dim, block_m, block_n, num_stages,
                                                                           p_smem=p_smem),
                      TILE_ORDER=tile_order if persistent and causal else 0, HAS_LEFT=window, VARLEN=varlen,
                      P_SMEM=p_smem, Q_REGS=q_in_registers(fp8, head_dim) and not varlen)
    tau = float(default_rescale_tau(head_dim, persistent, fp8) if rescale_tau is None else rescale_tau)
    check_rescale_tau(tau, fp8)
    constexprs["RESCALE_TAU"] = tau
    if fp8:
        types.update(qd_ptr="*fp32", kd_ptr="*fp32", vd_ptr="*fp32")
    else:
        constexprs.update(qd_ptr=None, kd_ptr=None, vd_ptr=None)
    if varlen:
        types.update(cu_seqlens_q="*i32", cu_seqlens_k="*i32")
    else:
        constexprs.update(cu_seqlens_q=None, cu_seqlens_k=None)
    if sinks:
        types.update(sinks_ptr="*fp32")
        constexprs.update(HAS_SINKS=True)
    else:
        constexprs.update(sinks_ptr=None, HAS_SINKS=False)
    # In the kernel's argument order; the other arguments are strides and sizes (i32).
    signature = {name: types.get(name, "i32") for name in fwd_ws_kernel.arg_names if name not in constexprs}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs, {"num_warps": 4, "maxnreg": maxnreg}
