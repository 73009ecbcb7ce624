"""Building blocks for fmha.distributed (ring attention): the kernels on one block of keys,
into caller-owned (fp32) buffers, no autograd. The caller maps global positions onto the
block's top-left window (and ALiBi onto a bias); soft-cap and GQA as usual."""

from __future__ import annotations

import torch

from ..dispatch.configs import Family
from .attention import plan_backward, plan_forward
from .prepare import Prepared, device_guard, kernel_args, kernel_view, launch_dkdv, launch_forward, prepare_call

Tensor = torch.Tensor



# ----------------------------------------------------------------------------------------
# Building blocks for fmha.distributed (ring attention): the kernels on one block of keys,
# into caller-owned (fp32) buffers, no autograd. The caller maps global positions onto the
# block's top-left window (and ALiBi onto a bias); soft-cap and GQA as usual.


def block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes) -> Prepared:
    """The block's mask is `window` aligned top-left (row i sees i - left .. i + right)."""
    return prepare_call(q, k, v, bias, alibi_slopes, None, None, None, None, 0, 0, layout, scale, False,
                    window[0], window[1], "top_left", 0, softcap, 0.0, 0, 0, False)


def block_forward(q, k, v, o, lse, *, layout, scale, window, softcap, bias=None,
                   alibi_slopes=None) -> None:
    """o (q's layout, any float dtype) and lse (B, Hq, Sq) of q over this block of keys.

    Every tensor may be a strided view (a slice along the sequence); nothing is copied.
    bias (broadcastable to (B, Hq, Sq, Sk)) and alibi_slopes as in `attention`.
    """
    prep = block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes)
    config = plan_forward(prep.problem, False).config(Family.FWD)
    launch_forward(prep, config, kernel_view(o, prep), lse, None,
                    kernel_args(prep, bias, alibi_slopes, None, None, None, 0, 0))


def block_backward(q, k, v, do, lse, delta, dq_acc, dk, dv, *, layout, scale, window,
                    softcap, bias=None, alibi_slopes=None) -> None:
    """Gradients of one block of keys, given the rows' final (merged) lse and delta.

    lse, delta: (B, Hq, Sq) fp32, delta = rowsum(dO * O) (minus dlse). dk/dv (k's/v's
    layout, fp32 for accumulation) are overwritten; the unscaled dQ is added into the fp32
    dq_acc (q's layout) with atomics: the caller multiplies by the scale once at the end.
    """
    prep = block_prepare(q, k, v, layout, scale, window, softcap, bias, alibi_slopes)
    config = plan_backward(prep.problem).config(Family.BWD_DQ_DK_DV)
    with device_guard(q):
        launch_dkdv(prep, config, kernel_view(do, prep), lse, delta, kernel_view(dk, prep),
                     kernel_view(dv, prep), kernel_view(dq_acc, prep), None,
                     kernel_args(prep, bias, alibi_slopes, None, None, None, 0, 0))
