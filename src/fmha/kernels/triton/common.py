"""Small @triton.jit helpers shared by the forward and backward kernels.

Everything that defines *what* attention computes at one (row, column) lives here once:
the visibility mask, the logit modifications (soft-cap, bias, ALiBi) and the dropout
keep decision. Forward and backward call the same functions, so they cannot disagree.

Only relative imports inside `fmha.kernels`: the package is also loaded a second time,
interpreted, for CPU tensors (see `fmha.kernels.launch.loader`).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def seq_bounds(
    b,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_k,
    seqlen_q,
    seqlen_k,
    IS_VARLEN: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr,
):
    """(start_q, len_q, start_k, len_k) of batch b: dense problems start at 0."""
    if IS_VARLEN:
        start_q = tl.load(cu_seqlens_q + b)
        len_q = tl.load(cu_seqlens_q + b + 1) - start_q
        start_k = tl.load(cu_seqlens_k + b)
        len_k = tl.load(cu_seqlens_k + b + 1) - start_k
    else:
        start_q = 0
        len_q = seqlen_q
        start_k = 0
        len_k = seqlen_k
    if HAS_SEQUSED_K:
        len_k = tl.load(seqused_k + b)
    return start_q, len_q, start_k, len_k


@triton.jit
def key_range(
    m_lo,
    m_hi,
    len_k,
    diag_offset,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key columns [lo, hi) that rows [m_lo, m_hi) can see through the window.

    lo is rounded down to a BLOCK_N boundary; blocks outside the range are never
    touched (sink tokens, visible through `sink_size`, are handled by the caller).
    """
    lo = 0
    hi = len_k
    if HAS_LEFT:
        lo = tl.maximum(m_lo + diag_offset - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_hi - 1 + diag_offset + window_right + 1, len_k)
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit
def visible(
    rows,
    cols,
    len_q,
    len_k,
    diag_offset,
    window_left,
    window_right,
    sink_size,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SINK_TOKENS: tl.constexpr,
):
    """Boolean [BLOCK_M, BLOCK_N]: column j visible to row i (SPEC step 4), in bounds."""
    r = rows[:, None]
    c = cols[None, :]
    in_window = (r >= 0) & (c >= 0)
    if HAS_LEFT:
        in_window = in_window & (c >= r + diag_offset - window_left)
    if HAS_RIGHT:
        in_window = in_window & (c <= r + diag_offset + window_right)
    if HAS_SINK_TOKENS:
        in_window = in_window | (c < sink_size)
    return in_window & (c < len_k) & (r < len_q)


@triton.jit
def tanh(x):
    # tanh through exp, written so that large |x| saturates to +-1 instead of NaN
    # (exp overflow gives inf, 2 / inf = 0); the interpreter has no libdevice.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def modify_logits(
    s,
    rows,
    cols,
    diag_offset,
    bias_ptrs,
    bias_mask,
    alibi_slope,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """SPEC steps 2-3 on scaled logits s (fp32): soft-cap, then bias and ALiBi.

    Returns (modified logits, tanh of the capped argument or None): the backward needs
    the tanh for the soft-cap chain rule.
    """
    t = s
    if HAS_SOFTCAP:
        t = tanh(s / softcap)
        s = softcap * t
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=bias_mask, other=0.0)
    if HAS_ALIBI:
        dist = tl.abs(rows[:, None] + diag_offset - cols[None, :]).to(tl.float32)
        s -= alibi_slope * dist
    return s, t


@triton.jit
def dropout_keep(seed, offset, bh, rows, cols, dropout_p):
    """Keep decision of each (row, column) of query head bh = b * Hq + h.

    A pure function of (seed, offset, b, h, i, j): one Philox call with counters
    (j // 4, i, bh, offset) and key `seed` gives four words, one for each of the columns
    4 * (j // 4) + t; word t becomes a uniform float in [0, 1). Needs BLOCK_N % 4 == 0 and
    tiles starting at multiples of 4 (always true: tiles start at multiples of BLOCK_N).
    """
    BLOCK_M: tl.constexpr = rows.shape[0]
    BLOCK_N: tl.constexpr = cols.shape[0]
    quads = tl.reshape(cols, (BLOCK_N // 4, 4))
    col4 = tl.max(quads, 1) // 4  # j // 4 for each group of four columns
    c0 = (col4[None, :] + 0 * rows[:, None]).to(tl.uint32)
    c1 = (rows[:, None] + 0 * col4[None, :]).to(tl.uint32)
    c2 = (c0 * 0 + bh).to(tl.uint32)
    c3 = (c0 * 0 + offset).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [BLOCK_M, BLOCK_N // 4, 2, 2]
    words = tl.reshape(words, (BLOCK_M, BLOCK_N))  # column 4g + 2a + b <- word 2a + b of group g
    return tl.uint_to_uniform_float(words) >= dropout_p
