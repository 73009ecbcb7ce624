"""Forward attention kernel (family `fwd`): dense and varlen, every forward feature.

One kernel, features as `tl.constexpr` flags (a feature that is off costs nothing):
window/causal masks in both alignments, sink tokens, soft-cap, additive bias, ALiBi,
sink logits, dropout, GQA, varlen with `seqused_k`. Head dims are padded to a power of
two inside the kernel (masked loads), never by copying. Any strides; the last dimension
of q/k is contiguous, v may be column-major (its head-dim stride is a parameter).

Online softmax in the log2 domain (exp2 with log2(e) folded into the scale), fp32
accumulators, output in the input dtype, LSE in natural log.

FP8 (`FP8=True`, q/k/v float8 e4m3/e5m2): real values are `x_fp8 * descale`. The q and k
descales fold into the logit scale (a scalar per program, or a row / column vector when
they are given per block of the sequence); P is quantized to e4m3 as `exp2(s - m + 8)`,
i.e. P * 256 in [0, 256] (FlashAttention 3's offset), the 256 leaves through the row sum;
the v descale multiplies the output (per block of keys: it scales P's columns, by its
ratio to the tile's largest descale, and the tile's product by that largest descale).
The output is written in O's dtype (bf16, fp16 or fp32). With FP8=False none of this is
traced: the 16/32-bit kernels compile to the same code as without it.
"""

import torch
import triton
import triton.language as tl

from ..launch.args import (
    alibi_strides,
    bias_strides,
    cdiv,
    descale_views,
    feature_flags,
    padded_dim,
    row_strides,
    seq_strides,
)
from .common import LN2, LOG2E, dropout_keep, key_range, modify_logits, seq_bounds, visible


@triton.jit
def _fwd_inner(
    acc, m_i, l_i, q,
    k_base, v_base, bias_base,
    rows, n_start, n_end,
    len_q, len_k, diag_offset,
    stride_kn, stride_vn, stride_vd, stride_biasn,
    head_dim_qk, head_dim_v,
    scale, softcap, alibi_slope, window_left, window_right, sink_size,
    dropout_p, seed, offset, bh,
    kd_base, vd_base, stride_kdblk, stride_vdblk, descale_block,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    FP8: tl.constexpr = False, K_BLOCK_DESCALE: tl.constexpr = False,
    V_BLOCK_DESCALE: tl.constexpr = False,
):
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_start, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = tl.load(
            k_base + cols[:, None] * stride_kn + offs_dq[None, :],
            mask=col_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0,
        )
        if FP8:
            qk = tl.dot(q, tl.trans(k))
            if K_BLOCK_DESCALE:  # one descale per key column (scale holds q's and the constants)
                qk = qk * tl.load(kd_base + (cols // descale_block) * stride_kdblk, mask=col_ok, other=0.0)[None, :]
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI:
            s, _ = modify_logits(
                qk * scale, rows, cols, diag_offset,
                bias_base + cols[None, :] * stride_biasn,
                (rows[:, None] < len_q) & col_ok[None, :],
                alibi_slope, softcap, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
            )
            s = s * LOG2E
        else:
            s = qk * (scale * LOG2E)
        vis = visible(rows, cols, len_q, len_k, diag_offset, window_left, window_right,
                      sink_size, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if FP8:  # P * 256 (exact: a power of two), so that e4m3 keeps small probabilities
            p = tl.math.exp2(s - (m_safe[:, None] - 8.0))
        else:
            p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, offset, bh, rows, cols, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
            mask=col_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0,
        )
        if FP8:
            if V_BLOCK_DESCALE:
                vd = tl.load(vd_base + (cols // descale_block) * stride_vdblk, mask=col_ok, other=0.0)
                vd_max = tl.max(vd, 0)
                vd_max = tl.where(vd_max > 0.0, vd_max, 1.0)
                pv = tl.dot((p * (vd / vd_max)[None, :]).to(tl.float8e4nv), v)
                acc = acc * alpha[:, None] + pv * vd_max
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Per-call scalars that would otherwise trigger Triton's value specialisation (==1, %16).
@triton.jit(do_not_specialize=["window_left", "window_right", "sink_size", "seed", "offset"])
def fwd_kernel(
    Q, K, V, O, LSE, Bias, Alibi, Sinks,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    QDescale, KDescale, VDescale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_alibib, stride_alibih,
    stride_qdb, stride_qdh, stride_qdblk, stride_kdb, stride_kdh, stride_kdblk,
    stride_vdb, stride_vdh, stride_vdblk,
    nheads_q, group_size, seqlen_q, seqlen_k, head_dim_qk, head_dim_v,
    scale, softcap, window_left, window_right, sink_size,
    dropout_p, seed, offset, q_descale_group, descale_block,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr, ALIGN_BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    FP8: tl.constexpr, Q_BLOCK_DESCALE: tl.constexpr, K_BLOCK_DESCALE: tl.constexpr,
    V_BLOCK_DESCALE: tl.constexpr,
):
    # 1-d grid (no 65535 limit on batch * heads); the longest row blocks of a masked
    # problem (the last ones under causal) start first, which balances the tail.
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

    rows = m_lo + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    grow = (start_q + rows).to(tl.int64)  # global row in the (possibly packed) tensor

    q = tl.load(
        Q + b64 * stride_qb + h * stride_qh + grow[:, None] * stride_qm + offs_dq[None, :],
        mask=row_ok[:, None] & (offs_dq[None, :] < head_dim_qk), other=0.0,
    )
    k_base = K + b64 * stride_kb + hk * stride_kh + start_k.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk * stride_vh + start_k.to(tl.int64) * stride_vn
    # Absent optional tensors arrive as a dummy pointer with zero strides.
    bias_base = Bias + b64 * stride_biasb + h * stride_biash + rows[:, None] * stride_biasm
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b * stride_alibib + h * stride_alibih).to(tl.float32)

    # FP8: descales of this (batch, head); q's may be one per row, k's/v's one per column.
    kd_base = KDescale + b64 * stride_kdb + hk * stride_kdh
    vd_base = VDescale + b64 * stride_vdb + hk * stride_vdh
    v_descale = 1.0
    if FP8:
        qd_base = QDescale + b64 * stride_qdb + (h // q_descale_group) * stride_qdh
        if Q_BLOCK_DESCALE:
            qd = tl.load(qd_base + (rows // descale_block) * stride_qdblk, mask=row_ok, other=0.0)
            scale = scale * qd[:, None]
        else:
            scale = scale * tl.load(qd_base)
        if not K_BLOCK_DESCALE:
            scale = scale * tl.load(kd_base)
        if not V_BLOCK_DESCALE:
            v_descale = tl.load(vd_base)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    m_hi = tl.minimum(m_lo + BLOCK_M, len_q)
    lo, hi = key_range(m_lo, m_hi, len_k, diag_offset, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    if HAS_SINK_TOKENS:
        # Sink tokens left of the window; `lo` is block aligned, so no block repeats.
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, k_base, v_base, bias_base, rows, 0, tl.minimum(sink_size, lo),
            len_q, len_k, diag_offset, stride_kn, stride_vn, stride_vd, stride_biasn,
            head_dim_qk, head_dim_v, scale, softcap, alibi_slope,
            window_left, window_right, sink_size, dropout_p, seed, offset, bh,
            kd_base, vd_base, stride_kdblk, stride_vdblk, descale_block,
            HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
            HAS_DROPOUT, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            FP8, K_BLOCK_DESCALE, V_BLOCK_DESCALE,
        )
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, bias_base, rows, lo, hi,
        len_q, len_k, diag_offset, stride_kn, stride_vn, stride_vd, stride_biasn,
        head_dim_qk, head_dim_v, scale, softcap, alibi_slope,
        window_left, window_right, sink_size, dropout_p, seed, offset, bh,
        kd_base, vd_base, stride_kdblk, stride_vdblk, descale_block,
        HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
        HAS_DROPOUT, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        FP8, K_BLOCK_DESCALE, V_BLOCK_DESCALE,
    )
    if HAS_SINK_TOKENS:
        # Sink tokens right of the window's last block (rows the window shows few or no keys).
        main_end = lo + tl.cdiv(hi - lo, BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, k_base, v_base, bias_base, rows, main_end, tl.minimum(sink_size, len_k),
            len_q, len_k, diag_offset, stride_kn, stride_vn, stride_vd, stride_biasn,
            head_dim_qk, head_dim_v, scale, softcap, alibi_slope,
            window_left, window_right, sink_size, dropout_p, seed, offset, bh,
            kd_base, vd_base, stride_kdblk, stride_vdblk, descale_block,
            HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
            HAS_DROPOUT, DOT_PRECISION, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            FP8, K_BLOCK_DESCALE, V_BLOCK_DESCALE,
        )

    if FP8:  # P was scaled by 256: so are the row sum and acc
        l_i = l_i * (1.0 / 256.0)
        acc = acc * (v_descale / 256.0)

    if HAS_SINKS:
        # The sink logit joins the denominator only (SPEC step 5).
        sink = tl.load(Sinks + h) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.math.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)

    tl.store(
        O + b64 * stride_ob + h * stride_oh + grow[:, None] * stride_om + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v),
    )
    tl.store(LSE + b64 * stride_lb + h * stride_lh + grow * stride_lm, lse, mask=row_ok)


def launch(
    q, k, v, o, lse, *,
    batch: int, max_seqlen_q: int, max_seqlen_k: int,
    cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
    bias=None, alibi_slopes=None, sinks=None,
    scale: float, softcap: float, window: tuple[int, int], sink_size: int,
    align_bottom_right: bool, dropout_p: float, seed: int, offset: int,
    block_m: int, block_n: int, num_warps: int, num_stages: int, dot_precision: str,
    q_descale=None, k_descale=None, v_descale=None, descale_block: int = 0,
) -> None:
    """Launch the forward kernel.

    Dense: q/k/v/o are bhsd views (B, H, S, D) with any strides, lse (B, Hq, Sq).
    Varlen: q/k/v/o are packed (total, H, D), lse (Hq, total_q), cu_seqlens int32.
    bias is already broadcast (by view, zero strides) to 4 dims; alibi_slopes to (B or 1, Hq).
    FP8 (q/k/v float8): q/k/v_descale are fp32 3-d views (B, H, blocks) with zero strides
    where they broadcast; q_descale's H is Hq or Hk; blocks > 1 (or descale_block > 0 with
    a stride) means one descale per `descale_block` positions of the sequence.
    """
    varlen = cu_seqlens_q is not None
    nheads_q, nheads_k = q.shape[1], k.shape[1]
    head_dim_qk, head_dim_v = q.shape[-1], v.shape[-1]
    dummy = o
    left, right = window
    grid = (cdiv(max_seqlen_q, block_m) * batch * nheads_q,)
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8:  # an absent descale is 1 (kept per device: no fill kernel a call)
        q_descale, k_descale, v_descale = descale_views((q_descale, k_descale, v_descale), q.device)
    descales = [d if d is not None else dummy for d in (q_descale, k_descale, v_descale)]
    descale_strides = [d.stride() if d is not None else (0, 0, 0) for d in (q_descale, k_descale, v_descale)]
    block_flags = [d is not None and d.shape[2] > 1 for d in (q_descale, k_descale, v_descale)]
    q_descale_group = 1 if q_descale is None or q_descale.shape[1] == nheads_q else nheads_q // nheads_k
    fwd_kernel[grid](
        q, k, v, o, lse,
        bias if bias is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        sinks if sinks is not None else dummy,
        cu_seqlens_q if varlen else dummy,
        cu_seqlens_k if varlen else dummy,
        seqused_k if seqused_k is not None else dummy,
        *descales,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen), v.stride(-1),
        *seq_strides(o, varlen), *row_strides(lse, varlen), *bias_strides(bias), *alibi_strides(alibi_slopes),
        *descale_strides[0], *descale_strides[1], *descale_strides[2],
        nheads_q, nheads_q // nheads_k, max_seqlen_q, max_seqlen_k, head_dim_qk, head_dim_v,
        scale, softcap, left, right, sink_size, dropout_p, seed, offset, q_descale_group, max(descale_block, 1),
        **feature_flags(window, sink_size, softcap, bias, alibi_slopes, dropout_p, align_bottom_right,
                        cu_seqlens_q, seqused_k),
        HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=padded_dim(head_dim_qk), BLOCK_DV=padded_dim(head_dim_v),
        FP8=fp8, Q_BLOCK_DESCALE=block_flags[0], K_BLOCK_DESCALE=block_flags[1], V_BLOCK_DESCALE=block_flags[2],
        num_warps=num_warps, num_stages=num_stages,
    )
