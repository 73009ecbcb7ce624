"""Dropout keep mask (family `dropout_mask`): writes the keep decisions of the forward.

For testing and inspection only: the attention kernels draw the same decisions in
registers (`common.dropout_keep`) and never materialise this mask.
"""

import triton
import triton.language as tl

from ..launch.args import cdiv
from .common import dropout_keep


@triton.jit(do_not_specialize=["seed", "offset"])
def dropout_mask_kernel(
    Mask, stride_mb, stride_mh, stride_mm,
    nheads, seqlen_q, seqlen_k, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // nheads
    h = bh % nheads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, offset, bh, rows, cols, dropout_p)
    ptrs = (Mask + b.to(tl.int64) * stride_mb + h * stride_mh
            + rows[:, None].to(tl.int64) * stride_mm + cols[None, :])
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))


def launch(mask, *, dropout_p: float, seed: int, offset: int,
           block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
    """mask: uint8 (B, H, Sq, Sk), contiguous last dim; filled with 1 = keep."""
    batch, nheads, seqlen_q, seqlen_k = mask.shape
    grid = (cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n), batch * nheads)
    dropout_mask_kernel[grid](
        mask, mask.stride(0), mask.stride(1), mask.stride(2),
        nheads, seqlen_q, seqlen_k, dropout_p, seed, offset,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
