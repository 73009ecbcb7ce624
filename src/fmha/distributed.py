"""Context-parallel ring attention over torch.distributed (`fmha.distributed`).

Each rank of a process group holds one slice of the sequence (queries, keys and values of
the same tokens). The key/value slices travel around the ring (rank r sends to r+1 and
receives from r-1) with asynchronous point-to-point transfers while each rank runs fmha's
forward kernel on the block it holds; the partial results merge through their natural-log
LSE. The backward runs fmha's dK/dV/dQ kernel per block with the final (merged) LSE, and
the dK/dV accumulators travel around the ring with the blocks until they are back home.

Causal attention with contiguous slices leaves rank 0 almost idle (it sees one block)
while the last rank sees all of them. With `zigzag=True` the sequence is cut into
2 * world equal chunks and rank r holds chunks r and 2*world-1-r (`zigzag_shard`): every
rank then does the same work at every step.

    o = ring_attention(q_local, k_local, v_local, causal=True, zigzag=True)

Sliding windows work: each (query chunk, key chunk) pair is trimmed so that the global
window becomes a top-left window of the block. ALiBi works: native within a chunk, and
across chunks (where i - j has one sign) as a broadcast column bias plus a shift of the
block's LSE. Soft-cap and sink logits (added once, in the final merge) work. Bias, sink
tokens, dropout and packed varlen inputs are refused with NotImplementedError.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from . import validation as V
from .ops.ring_blocks import block_backward, block_forward

Tensor = torch.Tensor

# NVLink multicast (NVLS) stays off in every process this project starts (see the docs).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """Set NO_MULTICAST_ENV in this process; call it before init_process_group."""
    os.environ.update(NO_MULTICAST_ENV)


# ----------------------------------------------------------------------------------------
# Zigzag layout helpers (plain tensor functions, no communication).


def _check_zigzag_args(x, world_size: int, dim: int, what: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of {x.dim()} dimensions")
    dim %= x.dim()
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"{what} has length {x.shape[dim]} along dim {dim}, which is not a multiple "
                         f"of 2 * world_size = {2 * world_size}")
    return dim


def zigzag_shard(x: Tensor, rank: int, world_size: int, *, dim: int = 2) -> Tensor:
    """Rank `rank`'s zigzag slice of the full sequence `x` along `dim` (a new tensor).

    The sequence is cut into 2 * world_size equal chunks; the slice is chunk `rank`
    followed by chunk `2 * world_size - 1 - rank`. dim: 2 for bhsd, 1 for bshd.
    """
    dim = _check_zigzag_args(x, world_size, dim, "x")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an int in [0, {world_size})")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(x: Tensor, world_size: int, *, dim: int = 2) -> Tensor:
    """The full sequence from the ranks' zigzag slices concatenated in rank order along `dim`
    (e.g. the result of an all_gather): the inverse of `zigzag_shard` over all ranks."""
    dim = _check_zigzag_args(x, world_size, dim, "x")
    pieces = x.chunk(2 * world_size, dim)  # rank r's slice is pieces 2r, 2r+1
    order = [None] * (2 * world_size)
    for r in range(world_size):
        order[r] = pieces[2 * r]
        order[2 * world_size - 1 - r] = pieces[2 * r + 1]
    return torch.cat(order, dim)


# ----------------------------------------------------------------------------------------
# The ring: one exchange = send to the next rank, receive from the previous one.


class _Ring:
    def __init__(self, group, communicate: bool = True):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.communicate = communicate
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
        """Start sending `tensors` (contiguous) to the next rank and receiving the previous
        rank's into new buffers; returns (buffers, works). `communicate=False` (benchmarks:
        compute without communication) hands the same tensors back."""
        if not self.communicate or self.world == 1:
            return tensors, []
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


_FULL, _CAUSAL = (-1, -1), (-1, 0)


def _blocks(rank: int, src: int, world: int, seqlen: int, window: tuple[int, int], zigzag: bool,
            by_chunk: bool = False):
    """(query rows, key columns, top-left window, positions) of the local work against rank
    `src`'s keys; positions (first row's and first column's global positions, chunk
    distance) only chunk by chunk.

    `window` is the global mask (left, right), causal = (-1, 0). Plain and causal masks
    use whole slices (few launches); other windows, and `by_chunk`, go chunk by chunk
    (`_window_blocks`).
    """
    full = slice(None)
    if by_chunk or window not in (_FULL, _CAUSAL):
        return _window_blocks(rank, src, world, seqlen, window, zigzag)
    if window == _FULL:
        return [(full, full, _FULL, None)]
    if src == rank:  # the diagonal block: local order is global order in both layouts
        return [(full, full, _CAUSAL, None)]
    if not zigzag:  # contiguous slices: earlier ranks fully visible, later ones not at all
        return [(full, full, _FULL, None)] if src < rank else []
    half = seqlen // 2
    if src < rank:  # all our rows see src's first chunk, none its second
        return [(full, slice(0, half), _FULL, None)]
    return [(slice(half, None), full, _FULL, None)]  # only our second chunk sees src, all of it


def _chunks(rank: int, world: int, seqlen: int, zigzag: bool) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the chunks of a rank's slice."""
    if zigzag:
        c = seqlen // 2
        return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]
    return [(0, rank * seqlen, seqlen)]


def _window_blocks(rank: int, src: int, world: int, seqlen: int, window: tuple[int, int], zigzag: bool):
    """A global window on each (query chunk, key chunk) pair, as a top-left window.

    Row i and column j of a pair are global rows qs + i and columns ks + j, so the global
    window (left, right) is `i + d - left <= j <= i + d + right` with d = qs - ks. The
    kernels only know d = 0, so the pair is trimmed instead: the first `a` columns (left
    of every row's window) and the first `b` rows (which see nothing) are dropped, which
    moves the diagonal to e = d - a + b, and the block runs with the window
    (left - e, right + e). a and b are chosen so that both stay >= 0 when bounded; the
    trimmed block then always has a visible pair, at its top-left corner.
    """
    left, right = window
    blocks = []
    for qlo, qs, lq in _chunks(rank, world, seqlen, zigzag):
        for klo, ks, lk in _chunks(src, world, seqlen, zigzag):
            d = qs - ks
            a = max(0, d - left) if left >= 0 else 0
            b = max(0, -(right + d - a)) if right >= 0 else 0
            nq, nk, e = lq - b, lk - a, d - a + b
            if nq <= 0 or nk <= 0:
                continue
            bl = left - e if left >= 0 and nq - 1 > left - e else -1  # -1: never binding
            br = right + e if right >= 0 and right + e < nk - 1 else -1
            blocks.append((slice(qlo + b, qlo + lq), slice(klo + a, klo + lk), (bl, br), (qs + b, ks + a, d)))
    return blocks


def _alibi_block(slopes: Tensor | None, pos, nq: int, nk: int):
    """(kernel alibi_slopes, bias, lse row shift) that put ALiBi on one chunk pair.

    Within one chunk (distance 0, no trimming) the kernel's own ALiBi is exact. Across two
    chunks the sign of i - j is the same for every pair, so -slope * |i - j| splits into a
    column term (a broadcast bias (B|1, Hq, 1, nk), 0 at the nearest key) and a row term
    that does not change the block's probabilities, only its LSE: the caller adds it to
    the block's lse (forward) and subtracts it from the final lse it passes (backward).
    """
    if slopes is None:
        return None, None, None
    qpos, kpos, distance = pos
    if distance == 0:
        return slopes, None, None
    sign = 1.0 if distance > 0 else -1.0
    ref = kpos + nk - 1 if distance > 0 else kpos  # the key nearest to the query chunk
    sl = (slopes if slopes.dim() == 2 else slopes[None]).float()
    cols = torch.arange(nk, device=slopes.device, dtype=torch.float32) + (kpos - ref)
    rows = torch.arange(nq, device=slopes.device, dtype=torch.float32) + (qpos - ref)
    return None, sl[:, :, None, None] * (sign * cols), sl[:, :, None] * (-sign * rows)


def _seq(t: Tensor, layout: str, sl: slice) -> Tensor:
    return t[:, :, sl] if layout == "bhsd" else t[:, sl]


def _bhsd(t: Tensor, layout: str) -> Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


def _merge_into(out: Tensor, lse: Tensor, o_blk: Tensor, lse_blk: Tensor) -> None:
    """out, lse (fp32, bhsd views) <- the LSE merge of (out, lse) and (o_blk, lse_blk)."""
    m = torch.maximum(lse, lse_blk)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows empty in both: weights 0
    w_old, w_blk = torch.exp(lse - m), torch.exp(lse_blk - m)
    total = w_old + w_blk
    norm = torch.where(total == 0, torch.ones_like(total), total)
    out.mul_((w_old / norm).unsqueeze(-1)).add_(o_blk * (w_blk / norm).unsqueeze(-1))
    lse.copy_(m + torch.log(total))  # log(0) = -inf: still empty


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, alibi, group, layout, scale, window, zigzag, softcap, communicate):
        ring = _Ring(group, communicate)
        kw = dict(layout=layout, scale=scale, softcap=softcap)
        seqlen = q.shape[2] if layout == "bhsd" else q.shape[1]
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32)  # q's layout
        o_blk = torch.empty_like(out)
        lse = torch.full(_bhsd(q, layout).shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        lse_blk = torch.empty_like(lse)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(ring.world):
            works = []
            if step + 1 < ring.world:
                nxt, works = ring.start(kv)
            src = (ring.rank - step) % ring.world
            for rows, cols, blk_window, pos in _blocks(ring.rank, src, ring.world, seqlen, window, zigzag,
                                                       alibi is not None):
                qb, kb, vb = _seq(q, layout, rows), _seq(kv[0], layout, cols), _seq(kv[1], layout, cols)
                slopes, bias, shift = _alibi_block(alibi, pos, lse[:, :, rows].shape[-1], _bhsd(kb, layout).shape[2])
                block_forward(qb, kb, vb, _seq(o_blk, layout, rows), lse_blk[:, :, rows], window=blk_window,
                               bias=bias, alibi_slopes=slopes, **kw)
                if shift is not None:
                    lse_blk[:, :, rows] += shift
                _merge_into(_bhsd(_seq(out, layout, rows), layout), lse[:, :, rows],
                            _bhsd(_seq(o_blk, layout, rows), layout), lse_blk[:, :, rows])
            if step + 1 < ring.world:
                ring.wait(works)
                kv = nxt
        if sinks is not None:  # the sink logit joins every row's denominator once
            final = torch.logaddexp(lse, sinks.float()[None, :, None])
            _bhsd(out, layout).mul_(torch.exp(lse - final).unsqueeze(-1))
            lse = final
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, sinks, alibi)
        ctx.args = (group, layout, scale, window, zigzag, softcap, communicate)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks, alibi = ctx.saved_tensors
        group, layout, scale, window, zigzag, softcap, communicate = ctx.args
        ring = _Ring(group, communicate)
        kw = dict(layout=layout, scale=scale, softcap=softcap)
        seqlen = q.shape[2] if layout == "bhsd" else q.shape[1]
        do = do.contiguous() if do.stride(-1) != 1 else do
        # (B, Hq, S), contiguous: the kernel reads delta with the strides of the lse it is given
        delta = (_bhsd(do, layout).float() * _bhsd(o, layout).float()).sum(-1).contiguous()
        if dlse is not None:  # d lse / d s_ij = p_ij: it enters like -delta (SPEC section 2)
            delta = delta - dlse
        dsinks = None
        if sinks is not None:  # d lse / d sink = p_sink; this rank's rows only
            dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_shifted = torch.empty_like(delta) if alibi is not None else None
        kv = [k.contiguous(), v.contiguous()]
        acc, acc_works = None, []
        for step in range(ring.world):
            works = []
            if step + 1 < ring.world:
                nxt, works = ring.start(kv)
            src = (ring.rank - step) % ring.world
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            written = []  # key ranges whose dk/dv this step already holds
            for rows, cols, blk_window, pos in _blocks(ring.rank, src, ring.world, seqlen, window, zigzag,
                                                       alibi is not None):
                span = range(seqlen)[cols]
                slopes, bias, shift = _alibi_block(alibi, pos, len(range(seqlen)[rows]), len(span))
                blk_lse = lse[:, :, rows]
                if shift is not None:  # into a buffer shaped like delta: the kernel reads both with lse's strides
                    blk_lse = torch.sub(blk_lse, shift, out=lse_shifted[:, :, rows])
                dk_out, dv_out = _seq(dk, layout, cols), _seq(dv, layout, cols)
                shared = any(span.start < stop and start < span.stop for start, stop in written)
                if shared:  # the kernel overwrites its block's dk/dv: add through a temporary
                    dk_out, dv_out = torch.empty_like(dk_out), torch.empty_like(dv_out)
                block_backward(_seq(q, layout, rows), _seq(kv[0], layout, cols), _seq(kv[1], layout, cols),
                                _seq(do, layout, rows), blk_lse, delta[:, :, rows], _seq(dq_acc, layout, rows),
                                dk_out, dv_out, window=blk_window, bias=bias, alibi_slopes=slopes, **kw)
                if shared:
                    _seq(dk, layout, cols).add_(dk_out)
                    _seq(dv, layout, cols).add_(dv_out)
                written.append((span.start, span.stop))
            if acc is not None:  # the accumulators of this block from the ranks before us
                ring.wait(acc_works)
                dk.add_(acc[0])
                dv.add_(acc[1])
            # Send them on to the next rank; after the last step they reach their owner.
            acc, acc_works = ring.start([dk, dv])
            if step + 1 < ring.world:
                ring.wait(works)
                kv = nxt
        ring.wait(acc_works)
        dq = (dq_acc * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)).to(q.dtype)
        return (dq, acc[0].to(k.dtype), acc[1].to(v.dtype), dsinks) + (None,) * 8


def _not_implemented(name: str, value, why: str):
    raise NotImplementedError(f"ring_attention does not support {name}={value!r}: {why}")


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, *,
    layout: str = "bhsd", scale: float | None = None, causal: bool = False, zigzag: bool = False,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None, bias: Tensor | None = None, sink_size: int = 0,
    dropout_p: float = 0.0, return_lse: bool = False,
):
    """Attention over a sequence split across the ranks of `group`, differentiable.

    Args:
        q: this rank's slice, (B, Hq, S, Dqk) for layout "bhsd" or (B, S, Hq, Dqk) for
            "bshd"; fp16/bf16/fp32. Every rank passes the same shapes.
        k, v: the same tokens' keys and values, (B, Hk, S, D) or (B, S, Hk, D); Hq must be
            a multiple of Hk (GQA/MQA).
        group: the ring (default: the whole world); ranks in group order hold consecutive
            slices (zigzag=False) or zigzag slices (zigzag=True, see `zigzag_shard`).
        scale, softcap: as in `fmha.attention`. causal, window: over the global sequence
            (S * world tokens; queries and keys have the same positions, so both mask
            alignments coincide). causal is window (-1, 0); windows go chunk by chunk.
        zigzag: the slices are in zigzag order (rank r: chunks r and 2W-1-r of 2W); S must
            be even. Balances causal work; also valid (and irrelevant) without causal.
        sinks: fp32 (Hq,) sink logits, added once to the merged denominator. Its gradient
            is this rank's share: reduce it over the group as for any replicated weight.
        alibi_slopes: fp32 (Hq,) or (B, Hq), as in `fmha.attention` (global positions).
        bias, sink_size, dropout_p: refused (NotImplementedError) unless at their defaults:
            the per-block kernels cannot see absolute positions for them.
        return_lse: also return lse (B, Hq, S) fp32 of this rank's rows (differentiable).

    Returns: o in q's layout and dtype (this rank's rows), then lse if asked for.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 3:
            _not_implemented(f"{name} of shape", tuple(t.shape),
                             "packed varlen inputs (total, H, D) are not implemented; pass dense "
                             "(B, H, S, D) or (B, S, H, D) slices")
        V.check_tensor(name, t, 4)
    layout = V.check_layout(layout)
    V.check_dtype("q", q)
    V.check_same(("q", "k", "v"), (q, k, v))
    window = V.check_scalars(scale=scale, softcap=softcap, window=window, sink_size=sink_size,
                             dropout_p=dropout_p, causal=causal)
    for name, value, given in (("bias", bias, bias is not None), ("sink_size", sink_size, sink_size != 0),
                               ("dropout_p", dropout_p, dropout_p != 0)):
        if given:
            shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor) else value
            _not_implemented(name, shown, "it depends on absolute token positions, which the per-block "
                             "kernels do not see")
    if not isinstance(zigzag, bool):
        raise TypeError(f"zigzag={zigzag!r} must be a bool")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse={return_lse!r} must be a bool")
    for name, t in (("k", k), ("v", v), ("sinks", sinks)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all tensors must be on one device")
    qv, kv, vv = (_bhsd(t, layout) for t in (q, k, v))
    for name, t in (("k", kv), ("v", vv)):
        if t.shape[0] != qv.shape[0] or t.shape[2] != qv.shape[2]:
            raise ValueError(f"{name} has batch {t.shape[0]} and seqlen {t.shape[2]} but q has batch "
                             f"{qv.shape[0]} and seqlen {qv.shape[2]}; ring attention is self-attention "
                             "over the same tokens, the local slices must match")
    V.check_heads(qv.shape[1], kv.shape[1], vv.shape[1])
    if kv.shape[-1] != qv.shape[-1]:
        raise ValueError(f"k has head dim {kv.shape[-1]} but q has {qv.shape[-1]}; they must match")
    V.check_sinks(sinks, qv.shape[1], q.device, q.dtype)
    V.check_alibi(alibi_slopes, qv.shape[0], qv.shape[1], q.device)
    if zigzag and qv.shape[2] % 2:
        raise ValueError(f"zigzag=True needs an even local seqlen (two equal chunks), got {qv.shape[2]}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.check_last_dim_contiguous(name, t)
    o, lse = _RingAttention.apply(q, k, v, sinks, alibi_slopes, group, layout, None if scale is None else float(scale),
                                  window, zigzag, float(softcap), True)
    return (o, lse) if return_lse else o


__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "disable_nvlink_multicast",
           "NO_MULTICAST_ENV"]
