"""Forward call plans: a plain `attention` call repeated with inputs of the same metadata
skips validation and planning (FlashInfer's plan/run split, made implicit): the first call
runs the full path and keeps a plan keyed by the inputs' metadata and scalars; later calls
with the same key run the plan's launches directly."""

from __future__ import annotations

import torch

from .. import fp8 as F8
from .. import validation as V
from ..dispatch.configs import Family
from ..kernels.launch.plan_tables import keep_plan, plan_table
from .attention import DESCALE_NAMES, plan_forward, prepare_fp8, prepare_op, run_backward
from .prepare import alloc_like, kernel_args, launch_forward, op_scalars, prepared_views, tensor_meta

Tensor = torch.Tensor



# ----------------------------------------------------------------------------------------
# Forward call plans: a plain `attention` call repeated with inputs of the same metadata.

REAL_TYPES = (float, int)


def keep_forward_plan(key, q, k, v, op_scalar_args: tuple, cu_seqlens=(None, None)) -> None:
    """After the full path validated a plain call: its forward plan under `key` (None: no plan),
    the op's scalars from `op_scalars(*op_scalar_args)`. Not for float8 inputs (their own op)."""
    if key is not None and not F8.is_fp8(q):
        keep_plan(FORWARD_PLANS, key, ForwardPlan(q, k, v, op_scalars(*op_scalar_args), cu_seqlens))


def plain_tensors(q, k, v, nones: tuple, return_dropout_mask) -> bool:
    """Plain tensors q, k, v, every optional argument in `nones` None, no dropout mask asked for:
    what every call plan needs."""
    return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and all(x is None for x in nones)
            and not return_dropout_mask)


def plain_call(q, k, v, nones: tuple, return_dropout_mask) -> bool:
    """A call a forward plan may serve: `plain_tensors` (`nones`: optional tensors, float8
    arguments, the seed), not float8 (`plain_fp8_call`)."""
    return plain_tensors(q, k, v, nones, return_dropout_mask) and not F8.is_fp8(q)


def plain_fp8_call(q, k, v, nones: tuple, descales: tuple, descale_block_size, out_dtype,
                    return_dropout_mask) -> bool:
    """A float8 call an fp8 forward plan may serve: `plain_tensors` of float8 q, k, v, plain tensors
    or None for the descales, an int or None descale_block_size, a dtype or None out_dtype, and
    nothing that requires grad (the full path refuses that)."""
    return (plain_tensors(q, k, v, nones, return_dropout_mask) and F8.is_fp8(q)
            and all(d is None or type(d) is Tensor for d in descales)
            and (descale_block_size is None or type(descale_block_size) is int)
            and (out_dtype is None or type(out_dtype) is torch.dtype)
            and not any(t is not None and t.requires_grad for t in (q, k, v, *descales)))


def plain_scalars(layout, scale, causal, window, mask_align, sink_size, softcap, dropout_p, offset,
                   deterministic) -> bool:
    """Scalars of the types a forward plan's key tells apart (bools as bools, ints as ints, a
    float or None scale), and no dropout: equal keys then mean calls validation treats alike."""
    return (type(scale) is float or scale is None) and type(causal) is bool and type(window) is tuple \
        and len(window) == 2 and type(window[0]) is int and type(window[1]) is int and type(sink_size) is int \
        and type(softcap) in REAL_TYPES and type(dropout_p) in REAL_TYPES and dropout_p == 0 and type(offset) is int \
        and type(deterministic) is bool and type(layout) is str and type(mask_align) is str


class ForwardPlan:
    """What a validated plain `attention` or `attention_varlen` call (no optional tensors, no
    dropout, not float8) repeats for inputs of the same metadata and the same scalars (the
    calls' keys; varlen's: cu_seqlens' metadata, and their values where validation reads them):
    the op's normalized scalars, and its forward's problem, kernel config and launcher
    arguments. A call autograd records goes through `PlannedAttention`, whose backward keeps
    its own plans per dO metadata; otherwise the forward runs at once. Checks, description and
    dispatch ran for the call that made the plan; a later call of the same key would pass them
    alike."""

    __slots__ = ("scalars", "problem", "scale", "config", "kernel_args", "head_dim_v", "layout", "runnable",
                 "launched", "backward_plans")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scalars: tuple,
                 cu_seqlens: tuple[Tensor | None, Tensor | None] = (None, None)) -> None:
        prep = prepare_op(q, k, v, (None, None, None, *cu_seqlens, None) + scalars)
        self.scalars, self.problem, self.scale = scalars, prep.problem, prep.scale
        self.config = plan_forward(prep.problem, False).config(Family.FWD)
        self.kernel_args = kernel_args(prep, None, None, *cu_seqlens, None, scalars[11], scalars[12])
        self.head_dim_v, self.layout = v.shape[-1], scalars[2]
        self.runnable = None
        if self.config.algorithm.pipeline.is_gluon:
            from ..kernels.launch.cache import runnable  # (Triton is loaded by now: it ran this config)

            self.runnable = runnable
        self.launched = None  # the Gluon launcher's own plan (fwd_gluon.launch), once it ran
        self.backward_plans: dict = {}  # dO's metadata -> BackwardPlan (`bwd_body`)

    def run(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None = None,
            cu_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """o, lse of q, k, v (and a varlen call's cu_seqlens_q/k)."""
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return PlannedAttention.apply(self, q, k, v, cu_q, cu_k)
        return self.forward(q, k, v, cu_q, cu_k)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None = None,
                cu_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """o, lse: the forward's body as the plan keeps it."""
        o, o_view, lse = alloc_like(q, self.head_dim_v, cu_q is not None, self.layout)
        if not (o.numel() or lse.numel()):
            return o, lse
        prep = prepared_views(self.problem, q, k, v, self.scale)
        if self.launched is not None and self.runnable(self.launched):
            if cu_q is None:
                self.launched.launch(prep.q, prep.k, prep.v, o_view, lse)
            else:
                self.launched.launch(prep.q, prep.k, prep.v, o_view, lse, cu_q, cu_k)
            return o, lse
        kernel_args = self.kernel_args if cu_q is None else {**self.kernel_args, "cu_seqlens_q": cu_q,
                                                             "cu_seqlens_k": cu_k}
        launched = launch_forward(prep, self.config, o_view, lse, None, kernel_args)
        if self.runnable is not None:
            self.launched = launched
        return o, lse

    def backward(self, grad_o, grad_lse, q, k, v, cu_q, cu_k, o, lse) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of the forward this plan ran on q, k, v (cu_seqlens_q/k, o, lse), as `attention_backward`."""
        if len(self.backward_plans) >= 16:  # (dO's metadata: a few variants at most)
            self.backward_plans.clear()
        return run_backward(grad_o, grad_lse, o, lse, False, False, (q, k, v, None, None, None, cu_q, cu_k, None),
                             self.scalars, (self.problem, self.scale), self.backward_plans)[:3]


class PlannedAttention(torch.autograd.Function):
    """A forward call plan's call that autograd records (`ForwardPlan.run`): the plan's forward
    body, and its backward (`ForwardPlan.backward`). Only in plain eager mode (plans are)."""

    @classmethod
    def apply(cls, *args):
        """`Function.apply` less its argument binding through `inspect` (as `EagerAttention.apply`)."""
        return super(torch.autograd.Function, cls).apply(*args)

    @staticmethod
    def forward(plan, q, k, v, cu_q, cu_k):
        return plan.forward(q, k, v, cu_q, cu_k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # an unused lse (or o) gives None, not a zeros tensor
        ctx.save_for_backward(*inputs[1:], *output)
        ctx.plan = inputs[0]

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        return (None, *ctx.plan.backward(grad_o, grad_lse, *ctx.saved_tensors), None, None)


class Fp8ForwardPlan:
    """What a validated float8 `attention` call (descales and out_dtype given or not, no other
    optional tensor, no dropout, nothing requiring grad) repeats for inputs and descales of the
    same metadata and the same scalars: the problem, kernel config and launcher arguments of
    `fwd_fp8_op`, and the Gluon launcher's own plan once it ran. Per call: the descales' kernel
    views (`fp8.descale_view`) and, where `fp8.check_descales` reads them (CPU tensors, debug
    mode), their values. Shapes, dtypes and devices passed the full path's checks for the call
    that made the plan; a call of the same key passes them alike."""

    __slots__ = ("problem", "scale", "config", "kernel_args", "head_dim_v", "layout", "out_dtype",
                 "descale_block", "runnable", "launched")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, descales: tuple, descale_block_size: int | None,
                 out_dtype: torch.dtype | None, scalars: tuple) -> None:
        prep, _ = prepare_fp8(q, k, v, (None,) * 6 + scalars, descales, descale_block_size)
        self.problem, self.scale = prep.problem, prep.scale
        self.config = plan_forward(self.problem, False).config(Family.FWD)
        self.kernel_args = kernel_args(prep, None, None, None, None, None, scalars[11], scalars[12])
        self.head_dim_v, self.layout = v.shape[-1], scalars[2]
        self.out_dtype = out_dtype or torch.bfloat16
        self.descale_block = descale_block_size or 0
        self.runnable = None
        if self.config.algorithm.pipeline.is_gluon:
            from ..kernels.launch.cache import runnable  # (Triton is loaded by now: it ran this config)

            self.runnable = runnable
        self.launched = None  # the Gluon launcher's own plan (fwd_gluon.launch), once it ran

    def run(self, q: Tensor, k: Tensor, v: Tensor, descales: tuple) -> tuple[Tensor, Tensor]:
        """o (out_dtype), lse of q, k, v with these descales (None: 1)."""
        for name, d in zip(DESCALE_NAMES, descales, strict=True):
            F8.check_descale_values(name, d)
        views = tuple(F8.descale_view(d) for d in descales)
        o, o_view, lse = alloc_like(q, self.head_dim_v, False, self.layout, dtype=self.out_dtype)
        if not (o.numel() or lse.numel()):
            return o, lse
        prep = prepared_views(self.problem, q, k, v, self.scale)
        if self.launched is not None and self.runnable(self.launched):
            self.launched.launch(prep.q, prep.k, prep.v, o_view, lse, *views)
            return o, lse
        launched = launch_forward(prep, self.config, o_view, lse, None, self.kernel_args,
                                   fp8_descales=dict(zip(DESCALE_NAMES, views, strict=True)),
                                   descale_block=self.descale_block)
        if self.runnable is not None:
            self.launched = launched
        return o, lse


FORWARD_PLANS = plan_table()  # (forgotten with the launchers' plans: plan_tables.clear_plans)


def varlen_plan_key(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, *scalars) -> tuple | None:
    """An `attention_varlen` call plan's key: the metadata and scalars, and the cu_seqlens values
    where validation reads them (CPU tensors: a repeated call must pass the same checks); None in
    debug mode off the CPU (validation then reads device values every call: no plan)."""
    values = None
    if cu_q.dim() != 1 or cu_k.dim() != 1:  # (refused by the full path)
        return None
    if cu_q.device.type == "cpu":
        values = (tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    elif V.debug_enabled():
        return None
    return ("varlen", tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(cu_q), tensor_meta(cu_k), values,
            max_seqlen_q, max_seqlen_k, *scalars)
