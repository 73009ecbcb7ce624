"""Backward attention kernels: families `bwd_dot_do_o`, `bwd_dq_dk_dv`, `bwd_convert_dq`.

Stage 1 (`dot_do_o_kernel`): delta = rowsum(dO * O) - dlse per query row (dlse is the
gradient flowing into a returned LSE; it folds into delta because d lse / d s = P), and
the per-row share of d sinks; it also zeroes the fp32 dQ accumulator of stage 2's atomics
(one fill kernel less). When dbias or dsinks are wanted, stage 1 is instead `dq_kernel`
with DELTA_ONLY (`launch_delta`): delta = rowsum(P * dP) - dlse in fp32 from recomputed
tiles, because O is stored rounded to fp16/bf16 and rowsum(dO * O) then does not cancel
against the sum of P * dP that the dS row sums (dbias broadcast over keys, dsinks) depend on.
Stage 2 (`dkdv_kernel`): one program per (key block, batch, KV head) walks the query
blocks that can see its keys, for every query head of its group, recomputing P from the
saved LSE; dK and dV accumulate in registers (GQA sums inside the program, no atomics).
dQ either comes from a second pass (`dq_kernel`: one program per query block, no atomics,
bitwise deterministic) or is added by the same program into an fp32 buffer with atomics
(faster, order-dependent), then stage 3 (`convert_dq_kernel`) scales and casts it.
The elementwise-bias gradient is dS itself, written once per tile by stage 2.

Masks, soft-cap, bias, ALiBi and dropout come from `common`, shared with the forward.
"""

import triton
import triton.language as tl

from ..launch import cache as launch_cache
from ..launch.args import alibi_strides, bias_strides, cdiv, feature_flags, padded_dim, row_strides, seq_strides
from .common import LOG2E, dropout_keep, key_range, modify_logits, seq_bounds, visible


@triton.jit
def dot_do_o_kernel(
    O, dO, dLSE, LSE, Delta, dSinksRows, Sinks, cu_seqlens_q, dQacc,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    nheads_q, seqlen_q, head_dim_v, head_dim_qk,
    IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, ZERO_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DQK: tl.constexpr,
):
    """delta of BLOCK_M query rows of one head; with ZERO_DQ also zeroes those rows of the fp32
    dQ accumulator (which stage 2 adds into), so that it needs no fill kernel of its own."""
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // num_m
    pid_m = pid % num_m
    b = bh // nheads_q
    h = bh % nheads_q
    start_q, len_q, _, _ = seq_bounds(b, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q, seqlen_q, 0,
                                      IS_VARLEN, False)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    grow = (start_q + rows).to(tl.int64)
    b64 = b.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (offs_d[None, :] < head_dim_v)
    o = tl.load(O + b64 * stride_ob + h * stride_oh + grow[:, None] * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(Delta.dtype.element_ty)
    do = tl.load(dO + b64 * stride_dob + h * stride_doh + grow[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(Delta.dtype.element_ty)
    delta = tl.sum(o * do, 1)
    lrow = b64 * stride_lb + h * stride_lh + grow * stride_lm
    if HAS_DLSE:
        delta -= tl.load(dLSE + lrow, mask=row_ok, other=0.0)
    tl.store(Delta + lrow, delta, mask=row_ok)
    if HAS_SINKS:
        # d lse / d sink = P_sink and d o / d sink = -P_sink * o: d sink = -P_sink * delta.
        lse = tl.load(LSE + lrow, mask=row_ok, other=0.0)
        p_sink = tl.exp(tl.load(Sinks + h) - lse)
        tl.store(dSinksRows + lrow, -p_sink * delta, mask=row_ok)
    if ZERO_DQ:
        offs_k = tl.arange(0, BLOCK_DQK)
        tl.store(dQacc + b64 * stride_dqb + h * stride_dqh + grow[:, None] * stride_dqm + offs_k[None, :],
                 tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32), mask=row_ok[:, None] & (offs_k[None, :] < head_dim_qk))


@triton.jit
def _tile_probs(
    q, k, rows, cols, lse2, len_q, len_k, diag_offset, bias_ptrs,
    scale, softcap, alibi_slope, window_left, window_right, sink_size,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """P of one [BLOCK_M, BLOCK_N] tile from the saved LSE (log2 units), and the soft-cap tanh."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    t = s
    if HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI:
        s, t = modify_logits(s, rows, cols, diag_offset, bias_ptrs,
                             (rows[:, None] < len_q) & (cols[None, :] < len_k),
                             alibi_slope, softcap, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    vis = visible(rows, cols, len_q, len_k, diag_offset, window_left, window_right, sink_size,
                  HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
    p = tl.where(vis, tl.math.exp2(s * LOG2E - lse2[:, None]), 0.0)
    return p, t


@triton.jit
def _load_lse2(LSE, lrow, row_ok):
    # log2-domain LSE; rows that see nothing (lse = -inf) get +inf so that P = 0, not NaN.
    lse = tl.load(LSE + lrow, mask=row_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def query_range(n_lo, n_hi, len_q, diag_offset, window_left, window_right, sink_size,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Query rows [lo, hi) that can see some key in [n_lo, n_hi); lo is block aligned."""
    lo = 0
    hi = len_q
    sink_block = False
    if HAS_SINK_TOKENS:
        sink_block = n_lo < sink_size
    if not sink_block:
        if HAS_RIGHT:  # row i sees j only if j <= i + diag + right
            lo = tl.maximum(n_lo - diag_offset - window_right, 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        if HAS_LEFT:  # ... and j >= i + diag - left
            hi = tl.minimum(n_hi - 1 - diag_offset + window_left + 1, len_q)
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit(do_not_specialize=["window_left", "window_right", "sink_size", "seed", "offset"])
def dkdv_kernel(
    Q, K, V, dO, LSE, Delta, dQacc, dK, dV, dBias, Bias, Alibi,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_dbb, stride_dbh, stride_dbm,
    stride_alibib, stride_alibih,
    nheads_q, group_size, seqlen_q, seqlen_k, head_dim_qk, head_dim_v,
    scale, softcap, window_left, window_right, sink_size,
    dropout_p, seed, offset,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr, ALIGN_BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    nheads_k = nheads_q // group_size
    num_n = tl.cdiv(seqlen_k, BLOCK_N)
    pid = tl.program_id(0)
    bhk = pid // num_n
    pid_n = pid % num_n
    b = bhk // nheads_k
    hk = bhk % nheads_k
    start_q, len_q, start_k, len_k = seq_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K)
    n_lo = pid_n * BLOCK_N
    if n_lo >= len_k:
        return
    diag_offset = 0
    if ALIGN_BOTTOM_RIGHT:
        diag_offset = len_k - len_q
    b64 = b.to(tl.int64)
    cols = n_lo + tl.arange(0, BLOCK_N)
    col_ok = cols < len_k
    gcol = (start_k + cols).to(tl.int64)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    kmask = col_ok[:, None] & (offs_dq[None, :] < head_dim_qk)
    vmask = col_ok[:, None] & (offs_dv[None, :] < head_dim_v)
    k = tl.load(K + b64 * stride_kb + hk * stride_kh + gcol[:, None] * stride_kn + offs_dq[None, :],
                mask=kmask, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk * stride_vh + gcol[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, mask=vmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    n_hi = tl.minimum(n_lo + BLOCK_N, len_k)
    m_start, m_end = query_range(n_lo, n_hi, len_q, diag_offset, window_left, window_right,
                                 sink_size, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, BLOCK_M)
    for h in range(hk * group_size, hk * group_size + group_size):
        alibi_slope = 0.0
        if HAS_ALIBI:
            alibi_slope = tl.load(Alibi + b * stride_alibib + h * stride_alibih).to(tl.float32)
        bh = b * nheads_q + h
        for m0 in range(m_start, m_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < len_q
            grow = (start_q + rows).to(tl.int64)
            q = tl.load(Q + b64 * stride_qb + h * stride_qh + grow[:, None] * stride_qm + offs_dq[None, :],
                        mask=row_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0)
            do = tl.load(dO + b64 * stride_dob + h * stride_doh + grow[:, None] * stride_dom
                         + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v),
                         other=0.0)
            lrow = b64 * stride_lb + h * stride_lh + grow * stride_lm
            lse2 = _load_lse2(LSE, lrow, row_ok)
            delta = tl.load(Delta + lrow, mask=row_ok, other=0.0)
            bias_ptrs = (Bias + b64 * stride_biasb + h * stride_biash + rows[:, None] * stride_biasm
                         + cols[None, :] * stride_biasn)
            p, t = _tile_probs(q, k, rows, cols, lse2, len_q, len_k, diag_offset, bias_ptrs,
                               scale, softcap, alibi_slope, window_left, window_right, sink_size,
                               HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                               DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if HAS_DROPOUT:
                keep = dropout_keep(seed, offset, bh, rows, cols, dropout_p)
                inv_keep = 1.0 / (1.0 - dropout_p)
                p_dropped = tl.where(keep, p * inv_keep, 0.0)
                dp = tl.where(keep, dp * inv_keep, 0.0)
            else:
                p_dropped = p
            dv += tl.dot(tl.trans(p_dropped.to(do.dtype)), do, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            if WRITE_DBIAS:
                tl.store(dBias + b64 * stride_dbb + h * stride_dbh + rows[:, None].to(tl.int64) * stride_dbm
                         + cols[None, :], ds, mask=row_ok[:, None] & col_ok[None, :])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            ds_in = ds.to(q.dtype)
            dk += tl.dot(tl.trans(ds_in), q, input_precision=DOT_PRECISION)
            if DQ_ATOMIC:
                dq_part = tl.dot(ds_in, k, input_precision=DOT_PRECISION)
                tl.atomic_add(dQacc + b64 * stride_dqb + h * stride_dqh + grow[:, None] * stride_dqm
                              + offs_dq[None, :], dq_part,
                              mask=row_ok[:, None] & (offs_dq[None, :] < head_dim_qk), sem="relaxed")
    dk = dk * scale
    tl.store(dK + b64 * stride_dkb + hk * stride_dkh + gcol[:, None] * stride_dkn + offs_dq[None, :],
             dk.to(dK.dtype.element_ty), mask=kmask)
    tl.store(dV + b64 * stride_dvb + hk * stride_dvh + gcol[:, None] * stride_dvn + offs_dv[None, :],
             dv.to(dV.dtype.element_ty), mask=vmask)


@triton.jit
def _dq_inner(
    dq, dsum, q, do, lse2, delta, k_base, v_base, bias_base, rows, n_start, n_end,
    len_q, len_k, diag_offset, stride_kn, stride_vn, stride_vd, stride_biasn,
    head_dim_qk, head_dim_v, scale, softcap, alibi_slope, window_left, window_right, sink_size,
    dropout_p, seed, offset, bh,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DELTA_ONLY: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ += dS K over key columns [n_start, n_end); with DELTA_ONLY, dsum += rowsum(P * dP)
    instead (dq untouched)."""
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_start, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_dq[None, :],
                    mask=col_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
        p, t = _tile_probs(q, k, rows, cols, lse2, len_q, len_k, diag_offset,
                           bias_base + cols[None, :] * stride_biasn,
                           scale, softcap, alibi_slope, window_left, window_right, sink_size,
                           HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                           DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, offset, bh, rows, cols, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        if DELTA_ONLY:
            dsum += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += tl.dot(ds.to(q.dtype), k, input_precision=DOT_PRECISION)
    return dq, dsum


@triton.jit(do_not_specialize=["window_left", "window_right", "sink_size", "seed", "offset"])
def dq_kernel(
    Q, K, V, dO, LSE, Delta, dQ, Bias, Alibi, dLSE, dSinksRows, Sinks,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_alibib, stride_alibih,
    nheads_q, group_size, seqlen_q, seqlen_k, head_dim_qk, head_dim_v,
    scale, softcap, window_left, window_right, sink_size,
    dropout_p, seed, offset,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr, ALIGN_BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DELTA_ONLY: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of one query block (no atomics). With DELTA_ONLY it writes, instead of dQ, the exact
    delta = rowsum(P * dP) - dlse (fp32, from the P and dP that stage 2 recomputes, not from
    the rounded O) and the per-row d sinks shares: the stage-1 pass used when dbias or
    dsinks are wanted (their row sums cancel only with this delta)."""
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // num_m
    pid_m = pid % num_m
    if HAS_RIGHT:
        pid_m = num_m - 1 - pid_m
    b = bh // nheads_q
    h = bh % nheads_q
    hk = h // group_size
    start_q, len_q, start_k, len_k = seq_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K)
    m_lo = pid_m * BLOCK_M
    if m_lo >= len_q:
        return
    diag_offset = 0
    if ALIGN_BOTTOM_RIGHT:
        diag_offset = len_k - len_q
    b64 = b.to(tl.int64)
    rows = m_lo + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    grow = (start_q + rows).to(tl.int64)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qmask = row_ok[:, None] & (offs_dq[None, :] < head_dim_qk)
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + grow[:, None] * stride_qm + offs_dq[None, :],
                mask=qmask, other=0.0)
    do = tl.load(dO + b64 * stride_dob + h * stride_doh + grow[:, None] * stride_dom + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    lrow = b64 * stride_lb + h * stride_lh + grow * stride_lm
    lse2 = _load_lse2(LSE, lrow, row_ok)
    dsum = tl.zeros([BLOCK_M], dtype=Delta.dtype.element_ty)
    if DELTA_ONLY:
        delta = dsum
    else:
        delta = tl.load(Delta + lrow, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk * stride_kh + start_k.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk * stride_vh + start_k.to(tl.int64) * stride_vn
    bias_base = Bias + b64 * stride_biasb + h * stride_biash + rows[:, None] * stride_biasm
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b * stride_alibib + h * stride_alibih).to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    m_hi = tl.minimum(m_lo + BLOCK_M, len_q)
    lo, hi = key_range(m_lo, m_hi, len_k, diag_offset, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    if HAS_SINK_TOKENS:
        dq, dsum = _dq_inner(dq, dsum, q, do, lse2, delta, k_base, v_base, bias_base, rows, 0,
                       tl.minimum(sink_size, lo), len_q, len_k, diag_offset,
                       stride_kn, stride_vn, stride_vd, stride_biasn, head_dim_qk, head_dim_v,
                       scale, softcap, alibi_slope, window_left, window_right, sink_size,
                       dropout_p, seed, offset, bh,
                       HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                       HAS_DROPOUT, DELTA_ONLY, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    dq, dsum = _dq_inner(dq, dsum, q, do, lse2, delta, k_base, v_base, bias_base, rows, lo, hi,
                   len_q, len_k, diag_offset,
                   stride_kn, stride_vn, stride_vd, stride_biasn, head_dim_qk, head_dim_v,
                   scale, softcap, alibi_slope, window_left, window_right, sink_size,
                   dropout_p, seed, offset, bh,
                   HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                   HAS_DROPOUT, DELTA_ONLY, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    if HAS_SINK_TOKENS:  # sink tokens right of the window's last block
        main_end = lo + tl.cdiv(hi - lo, BLOCK_N) * BLOCK_N
        dq, dsum = _dq_inner(dq, dsum, q, do, lse2, delta, k_base, v_base, bias_base, rows, main_end,
                       tl.minimum(sink_size, len_k), len_q, len_k, diag_offset,
                       stride_kn, stride_vn, stride_vd, stride_biasn, head_dim_qk, head_dim_v,
                       scale, softcap, alibi_slope, window_left, window_right, sink_size,
                       dropout_p, seed, offset, bh,
                       HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
                       HAS_DROPOUT, DELTA_ONLY, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    if DELTA_ONLY:
        if HAS_DLSE:
            dsum -= tl.load(dLSE + lrow, mask=row_ok, other=0.0)
        tl.store(Delta + lrow, dsum, mask=row_ok)
        if HAS_SINKS:  # as in dot_do_o_kernel
            p_sink = tl.exp(tl.load(Sinks + h) - tl.load(LSE + lrow, mask=row_ok, other=0.0))
            tl.store(dSinksRows + lrow, -p_sink * dsum, mask=row_ok)
    else:
        dq = dq * scale
        tl.store(dQ + b64 * stride_dqb + h * stride_dqh + grow[:, None] * stride_dqm + offs_dq[None, :],
                 dq.to(dQ.dtype.element_ty), mask=qmask)


@triton.jit
def convert_dq_kernel(dQacc, dQ, n_rows, head_dim, scale,
                      stride_ar, stride_qr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ = scale * dQacc in the inputs' dtype; rows are (batch, head, seq) flattened."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < head_dim)
    r64 = rows[:, None].to(tl.int64)
    acc = tl.load(dQacc + r64 * stride_ar + offs_d[None, :], mask=mask, other=0.0)
    tl.store(dQ + r64 * stride_qr + offs_d[None, :], (acc * scale).to(dQ.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# Launchers. Tensors are kernel views: bhsd (dense) or packed (total, H, D) (varlen), as
# for the forward (see fwd.launch); lse/delta are (B, Hq, Sq) or (Hq, total_q).


def _dims(q, k, v):
    nheads_q, nheads_k = q.shape[1], k.shape[1]
    head_dim_qk, head_dim_v = q.shape[-1], v.shape[-1]
    return nheads_q, nheads_k, head_dim_qk, head_dim_v


def launch_dot_do_o(o, do, lse, delta, dq_acc=None, *, dlse=None, sinks=None, dsinks_rows=None,
                    cu_seqlens_q=None, batch: int, max_seqlen_q: int,
                    block_m: int, num_warps: int, num_stages: int, **_unused) -> launch_cache.Planned | None:
    """delta = rowsum(dO * O) (minus dlse; sinks' shares into dsinks_rows), and the fp32 dQ
    accumulator `dq_acc` (q's shape, in the kernels' layout) zeroed where given. Returns the
    launch plan it ran or made (the plain case), as fwd_gluon.launch: `Planned.launch(o, do, lse,
    delta, dq_acc)`, varlen `(o, do, lse, delta, dq_acc, cu_seqlens_q)` (keyed by metadata: the
    kernel reads the prefix sums)."""
    varlen = cu_seqlens_q is not None
    key = None  # a plan (launch_cache) for the plain case: no dlse, no sinks
    if dlse is None and sinks is None and dsinks_rows is None and launch_cache.plans_enabled(dot_do_o_kernel):
        key = (o.shape, o.stride(), do.stride(), lse.shape, lse.stride(), delta.stride(), o.dtype, do.dtype,
               o.data_ptr() % 16 == 0, do.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0,
               delta.data_ptr() % 16 == 0, launch_cache.current_device(), batch, max_seqlen_q, block_m, num_warps,
               num_stages, varlen,
               None if dq_acc is None else (dq_acc.shape, dq_acc.stride(), dq_acc.data_ptr() % 16 == 0))
        planned = _DOT_DO_O_PLANS.get(key)
        if planned is not None:
            planned.launch(o, do, lse, delta, dq_acc, *((cu_seqlens_q,) if varlen else ()))
            return planned
    nheads_q, head_dim_v = o.shape[1], o.shape[-1]
    grid = (cdiv(max_seqlen_q, block_m) * batch * nheads_q,)
    if grid[0] == 0:
        return None
    head_dim_qk = dq_acc.shape[-1] if dq_acc is not None else head_dim_v
    tail = (*seq_strides(o, varlen), *seq_strides(do, varlen), *row_strides(lse, varlen),
            *(seq_strides(dq_acc, varlen) if dq_acc is not None else (0, 0, 0)),
            nheads_q, max_seqlen_q, head_dim_v, head_dim_qk)
    plan = launch_cache.make_plan(dot_do_o_kernel, grid,
        o, do, dlse if dlse is not None else lse, lse, delta,
        dsinks_rows if dsinks_rows is not None else delta, sinks if sinks is not None else lse,
        cu_seqlens_q if varlen else lse, dq_acc if dq_acc is not None else delta, *tail,
        IS_VARLEN=varlen, HAS_DLSE=dlse is not None, HAS_SINKS=sinks is not None, ZERO_DQ=dq_acc is not None,
        BLOCK_M=block_m, BLOCK_DV=padded_dim(head_dim_v), BLOCK_DQK=padded_dim(head_dim_qk), num_warps=num_warps,
        num_stages=num_stages,
    )
    return launch_cache.keep(_DOT_DO_O_PLANS, key, plan, dot_do_o_kernel, tail, _dot_plan_tensors)


def _dot_plan_tensors(o, do, lse, delta, dq_acc=None, cu_seqlens_q=None) -> tuple:
    """dot_do_o_kernel's tensors in the plain case (no dlse or sinks: lse and delta in the unused
    places; lse in cu_seqlens_q's too where dense, delta in dq_acc's where it is not zeroed)."""
    return (o, do, lse, lse, delta, delta, lse, lse if cu_seqlens_q is None else cu_seqlens_q,
            delta if dq_acc is None else dq_acc)


_DOT_DO_O_PLANS = launch_cache.plan_table()
_CONVERT_DQ_PLANS = launch_cache.plan_table()


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, *, dq_acc=None, dbias=None,
                batch: int, max_seqlen_q: int, max_seqlen_k: int,
                cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                bias=None, alibi_slopes=None, scale: float, softcap: float,
                window: tuple[int, int], sink_size: int, align_bottom_right: bool,
                dropout_p: float, seed: int, offset: int,
                block_m: int, block_n: int, num_warps: int, num_stages: int, dot_precision: str) -> None:
    """dK, dV (and dQ into the fp32 `dq_acc` with atomics when given; dS into `dbias`)."""
    varlen = cu_seqlens_q is not None
    nheads_q, nheads_k, head_dim_qk, head_dim_v = _dims(q, k, v)
    grid = (cdiv(max_seqlen_k, block_n) * batch * nheads_k,)
    if grid[0] == 0:
        return
    dummy = delta
    dq_strides = seq_strides(dq_acc, varlen) if dq_acc is not None else (0, 0, 0)
    db_strides = dbias.stride()[:3] if dbias is not None else (0, 0, 0)
    dkdv_kernel[grid](
        q, k, v, do, lse, delta,
        dq_acc if dq_acc is not None else dummy, dk, dv,
        dbias if dbias is not None else dummy,
        bias if bias is not None else dummy, alibi_slopes if alibi_slopes is not None else dummy,
        cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
        seqused_k if seqused_k is not None else dummy,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen), v.stride(-1),
        *seq_strides(do, varlen), *row_strides(lse, varlen), *dq_strides,
        *seq_strides(dk, varlen), *seq_strides(dv, varlen),
        *bias_strides(bias), *db_strides, *alibi_strides(alibi_slopes),
        nheads_q, nheads_q // nheads_k, max_seqlen_q, max_seqlen_k, head_dim_qk, head_dim_v,
        scale, softcap, window[0], window[1], sink_size, dropout_p, seed, offset,
        **feature_flags(window, sink_size, softcap, bias, alibi_slopes, dropout_p,
                         align_bottom_right, cu_seqlens_q, seqused_k),
        WRITE_DBIAS=dbias is not None, DQ_ATOMIC=dq_acc is not None, DOT_PRECISION=dot_precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=padded_dim(head_dim_qk), BLOCK_DV=padded_dim(head_dim_v),
        num_warps=num_warps, num_stages=num_stages,
    )


def launch_dq(q, k, v, do, lse, delta, dq, *,
              batch: int, max_seqlen_q: int, max_seqlen_k: int,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
              bias=None, alibi_slopes=None, scale: float, softcap: float,
              window: tuple[int, int], sink_size: int, align_bottom_right: bool,
              dropout_p: float, seed: int, offset: int,
              block_m: int, block_n: int, num_warps: int, num_stages: int, dot_precision: str,
              delta_only: bool = False, dlse=None, sinks=None, dsinks_rows=None) -> None:
    """dQ without atomics: one program per query block (deterministic).

    delta_only=True (see `launch_delta`): `delta` is written, not read, and `dq` is unused.
    """
    varlen = cu_seqlens_q is not None
    nheads_q, nheads_k, head_dim_qk, head_dim_v = _dims(q, k, v)
    grid = (cdiv(max_seqlen_q, block_m) * batch * nheads_q,)
    if grid[0] == 0:
        return
    dummy = delta
    dq_kernel[grid](
        q, k, v, do, lse, delta, dq,
        bias if bias is not None else dummy, alibi_slopes if alibi_slopes is not None else dummy,
        dlse if dlse is not None else dummy, dsinks_rows if dsinks_rows is not None else dummy,
        sinks if sinks is not None else dummy,
        cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
        seqused_k if seqused_k is not None else dummy,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen), v.stride(-1),
        *seq_strides(do, varlen), *row_strides(lse, varlen), *seq_strides(dq, varlen),
        *bias_strides(bias), *alibi_strides(alibi_slopes),
        nheads_q, nheads_q // nheads_k, max_seqlen_q, max_seqlen_k, head_dim_qk, head_dim_v,
        scale, softcap, window[0], window[1], sink_size, dropout_p, seed, offset,
        **feature_flags(window, sink_size, softcap, bias, alibi_slopes, dropout_p,
                         align_bottom_right, cu_seqlens_q, seqused_k),
        DELTA_ONLY=delta_only, HAS_DLSE=dlse is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=padded_dim(head_dim_qk), BLOCK_DV=padded_dim(head_dim_v),
        num_warps=num_warps, num_stages=num_stages,
    )


def launch_delta(q, k, v, do, lse, delta, *, dlse=None, sinks=None, dsinks_rows=None, **kwargs) -> None:
    """Stage 1, exact: delta = rowsum(P * dP) - dlse in fp32 (and the d sinks row shares),
    from recomputed P and dP (the dQ pass's loop, with a row sum instead of dS K). Used
    instead of `launch_dot_do_o` when dbias or dsinks are wanted: rowsum(dO * O) uses O
    rounded to the inputs' dtype, so sum_j dS_ij = sum_j P_ij (dP_ij - delta_i) would not
    cancel (errors ~1e-3 in fp16, ~1e-2 in bf16 on dbias row sums and dsinks). Costs the
    QK^T and dO V^T matmuls once more; takes launch_dq's keyword arguments."""
    launch_dq(q, k, v, do, lse, delta, delta, delta_only=True, dlse=dlse, sinks=sinks,
              dsinks_rows=dsinks_rows, **kwargs)


def launch_convert_dq(dq_acc, dq, *, scale: float, block_m: int, num_warps: int,
                      **_unused) -> launch_cache.Planned | None:
    """dq (any dtype, contiguous) = scale * dq_acc (fp32, same shape, contiguous). Returns the
    launch plan it ran or made, as fwd_gluon.launch."""
    key = None
    if launch_cache.plans_enabled(convert_dq_kernel):
        key = (dq.shape, dq.dtype, dq_acc.dtype, dq_acc.data_ptr() % 16 == 0, dq.data_ptr() % 16 == 0,
               launch_cache.current_device(), scale, block_m, num_warps)
        planned = _CONVERT_DQ_PLANS.get(key)
        if planned is not None:
            planned.launch(dq_acc, dq)
            return planned
    head_dim = dq.shape[-1]
    n_rows = dq.numel() // max(head_dim, 1)
    if n_rows == 0:
        return None
    grid = (cdiv(n_rows, block_m),)
    tail = (n_rows, head_dim, scale, head_dim, head_dim)
    plan = launch_cache.make_plan(convert_dq_kernel, grid, dq_acc, dq, *tail,
                                  BLOCK_R=block_m, BLOCK_D=padded_dim(head_dim), num_warps=num_warps)
    return launch_cache.keep(_CONVERT_DQ_PLANS, key, plan, convert_dq_kernel, tail)
