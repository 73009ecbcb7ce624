"""The attention kernel work as `torch.library` custom ops (`fmha::fwd`, `fmha::bwd`,
`fmha::fwd_fp8`, `fmha::dropout_mask`) with fake implementations, so torch.compile traces
each call as one opaque op; their bodies (forward, the three backward stages), the autograd
wiring, and the plain-eager shortcut that runs an op's body without torch's dispatch."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch.utils import _python_dispatch

from .. import fp8 as F8
from .. import validation as V
from ..dispatch.configs import Family, KernelConfig
from ..dispatch.dispatcher import Plan
from ..dispatch.state import get_dispatcher, on_dispatcher_change
from ..kernels.launch.loader import family_module
from ..kernels.launch.plan_tables import clear_plans, keep_plan, plan_table
from ..problem import Problem
from .prepare import (
    Prepared,
    algo_kwargs,
    algorithm_args,
    alloc_like,
    arch_of,
    device_guard,
    kernel_args,
    kernel_view,
    launch_dkdv,
    launch_forward,
    prepare_call,
    prepared_views,
    stats_dtype,
    tensor_meta,
    tma_aligned,
)

Tensor = torch.Tensor



@functools.lru_cache(maxsize=4096)
def plan_forward(problem: Problem, return_dropout_mask: bool) -> Plan:
    return get_dispatcher().plan_forward(problem, return_dropout_mask=return_dropout_mask)


# ----------------------------------------------------------------------------------------
# The kernel work as custom ops (opaque to torch.compile, with fake implementations).


def prepare_op(q: Tensor, k: Tensor, v: Tensor, values: tuple) -> Prepared:
    """`prepare_call` for an op's flattened arguments, given in `OP_ARGS` order (`prepare_call`'s own
    order after q, k, v: passed positionally, a dict of keywords costs ~2 us a call)."""
    return prepare_call(q, k, v, *values)


@torch.library.custom_op("fmha::fwd", mutates_args=())
def fwd_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Returns (o in q's layout and dtype, lse (B, Hq, Sq) or (Hq, total_q))."""
    return fwd_body(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                     softcap, dropout_p, seed, offset, deterministic)[:2]


def fwd_body(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
              max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
              softcap, dropout_p, seed, offset, deterministic) -> tuple[Tensor, Tensor, Prepared]:
    """`fwd_op`'s work: (o, lse, and the call's Prepared, which the eager autograd path keeps
    for the backward)."""
    prep = prepare_call(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                    max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                    softcap, dropout_p, seed, offset, deterministic)
    o, lse = run_forward(prep, plan_forward(prep.problem, False).config(Family.FWD), q, v.shape[-1], layout, sinks,
                          kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset))
    return o, lse, prep


def run_forward(prep: Prepared, config: KernelConfig, q: Tensor, head_dim_v: int, layout: str,
                 sinks: Tensor | None, kernel_args: dict) -> tuple[Tensor, Tensor]:
    """The forward's outputs (o in q's layout, lse), allocated and computed by `config`."""
    o, o_view, lse = alloc_like(q, head_dim_v, prep.problem.varlen, layout)
    if o.numel() or lse.numel():
        launch_forward(prep, config, o_view, lse, sinks, kernel_args)
    return o, lse


@fwd_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
      max_seqlen_k, layout, *scalars):
    o, _, lse = alloc_like(q, v.shape[-1], cu_seqlens_q is not None, layout)
    return o, lse


@torch.library.custom_op("fmha::bwd", mutates_args=())
def bwd_op(
    do: Tensor, dlse: Tensor | None, o: Tensor, lse: Tensor, want_dbias: bool, want_dsinks: bool,
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv in the inputs' layouts; dbias in bias' shape or empty; dsinks or empty).

    With dbias or dsinks wanted, stage 1 computes delta exactly (`launch_delta`, one more
    QK^T and dO V^T pass) instead of from the rounded O (`launch_dot_do_o`)."""
    dq, dk, dv, dbias, dsinks = bwd_body(
        do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
        window_right, mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic)
    return (dq, dk, dv, q.new_empty(0) if dbias is None else dbias,
            q.new_empty(0) if dsinks is None else dsinks)


@dataclass(frozen=True)
class BackwardLaunches:
    """The backward plan's configs as its launchers' arguments, built once per plan (the
    plan lookups and argument dicts cost ~8 us a call). The dicts are only ever unpacked."""
    stage1: dict  # launch_delta's (the BWD_DQ config) when exact_delta, else launch_dot_do_o's
    dkdv: KernelConfig
    dq: dict | None  # launch_dq's, deterministic only
    convert: dict | None  # launch_convert_dq's, otherwise


@functools.lru_cache(maxsize=4096)
def backward_launches(problem: Problem, exact_delta: bool) -> BackwardLaunches:
    plan = plan_backward(problem, exact_delta)
    stage1 = plan.config(Family.BWD_DQ if exact_delta else Family.BWD_DOT_DO_O)
    dq = plan.config(Family.BWD_DQ) if problem.deterministic else None
    convert = None if problem.deterministic else plan.config(Family.BWD_CONVERT_DQ)
    return BackwardLaunches(algo_kwargs(stage1), plan.config(Family.BWD_DQ_DK_DV),
                             None if dq is None else algo_kwargs(dq), None if convert is None else algo_kwargs(convert))


def bwd_body(do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q,
              cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
              window_right, mask_align, sink_size, softcap, dropout_p, seed, offset, deterministic,
              forward: tuple[Problem, float] | None = None, plans: dict | None = None):
    """`bwd_op`'s work, with None for a dbias or dsinks not wanted (the op returns empty
    tensors for them; the eager backward, which calls this directly, allocates nothing).

    forward: the forward's (Problem, scale) for these very tensors (the eager autograd path
    keeps them: saved tensors cannot change without autograd refusing them), so they are not
    validated and described again. plans: where a forward call plan keeps this backward's plans
    (`ForwardPlan.backward`), else `BACKWARD_PLANS`."""
    if dlse is not None and (dlse.stride() != lse.stride() or dlse.dtype != lse.dtype):
        # The kernels read dlse with lse's strides; the gradient of e.g. lse.sum() is an
        # expanded (stride 0) view, which they would read past its one element.
        dlse = torch.empty_like(lse).copy_(dlse)
    if forward is not None:
        prep = prepared_views(forward[0], q, k, v, forward[1])
    else:
        prep = prepare_call(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, layout, scale, causal, window_left, window_right, mask_align, sink_size,
                        softcap, dropout_p, seed, offset, deterministic)
    problem = prep.problem
    want_dsinks = want_dsinks and sinks is not None
    exact_delta = want_dbias or want_dsinks
    plan_key = planned = None
    if (forward is not None and problem.arch != "cpu" and dlse is None and not exact_delta and seqused_k is None
            and not problem.deterministic and bias is None and alibi_slopes is None
            and sinks is None):  # (the interpreter's kernels take no plans)
        if plans is not None:  # (a forward call plan's own table: its key fixes q, k, v and so o, lse)
            table, plan_key = plans, tensor_meta(do)
        else:
            table = BACKWARD_PLANS
            plan_key = (forward, tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(o), tensor_meta(do),
                        tensor_meta(lse))
        planned = table.get(plan_key)
        if planned is not None and not planned.runnable(planned.dot, planned.dkdv, planned.convert):
            planned = None
    launches = None if planned is not None else backward_launches(problem, exact_delta)
    kernels = family_module("triton.bwd", interpreted=q.device.type == "cpu")
    varlen = problem.varlen
    # dq, dk, dv: their inputs' shapes and dtypes, contiguous in the user's layout; delta and
    # the dQ accumulator in the stats dtype (stats_dtype), delta shaped like lse. The *_like
    # forms parse no shape or dtype arguments: ~2 us less a tensor than new_empty/zeros.
    contiguous, stats = torch.contiguous_format, stats_dtype(q)
    dq, dk, dv = (torch.empty_like(t, memory_format=contiguous) for t in (q, k, v))
    dq_view, dk_view, dv_view = (kernel_view(t, prep) for t in (dq, dk, dv))
    delta = torch.empty_like(lse, dtype=stats, memory_format=contiguous)
    if seqused_k is not None:  # keys past seqused_k belong to no program: their gradient is 0
        dk.zero_()
        dv.zero_()
    dsinks_rows = torch.empty_like(delta) if want_dsinks else None
    dbias_full = None
    if want_dbias:
        dbias_full = torch.zeros((problem.batch, problem.nhead_q, problem.seqlen_q, problem.seqlen_k),
                                 dtype=stats, device=q.device)
    o_view, do_view = kernel_view(o, prep), kernel_view(do, prep)
    if planned is not None:  # (a plain eager backward again: its three launches' plans)
        dq_acc, zeroed = dq_accumulator(dq, stats, exact_delta, varlen)
        dq_acc_view = kernel_view(dq_acc, prep)
        cu_q, cu_k = ((cu_seqlens_q,), (cu_seqlens_q, cu_seqlens_k)) if varlen else ((), ())  # (the kernels read them)
        planned.dot.launch(o_view, do_view, lse, delta, None if zeroed else dq_acc_view, *cu_q)
        planned.dkdv.launch(prep.q, prep.k, prep.v, do_view.contiguous() if planned.do_copied else do_view, lse,
                            delta, dk_view, dv_view, dq_acc_view, *cu_k)
        planned.convert.launch(dq_acc, dq)
    else:
        shared = kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset)
        dot = dq_acc = dq_acc_view = None
        zeroed = True
        if not problem.deterministic:  # dQ by atomics into an fp32 accumulator
            dq_acc, zeroed = dq_accumulator(dq, stats, exact_delta, varlen)
            dq_acc_view = kernel_view(dq_acc, prep)
        with device_guard(q):
            if exact_delta:
                kernels.launch_delta(prep.q, prep.k, prep.v, do_view, lse, delta, dlse=dlse,
                                     sinks=sinks if want_dsinks else None, dsinks_rows=dsinks_rows,
                                     **shared, **launches.stage1)
            else:
                dot = kernels.launch_dot_do_o(o_view, do_view, lse, delta, None if zeroed else dq_acc_view,
                                              dlse=dlse, **shared, **launches.stage1)
            if problem.deterministic:
                kernels.launch_dkdv(prep.q, prep.k, prep.v, do_view, lse, delta, dk_view, dv_view,
                                    dbias=dbias_full, **shared, **algo_kwargs(launches.dkdv))
                kernels.launch_dq(prep.q, prep.k, prep.v, do_view, lse, delta, dq_view, **shared, **launches.dq)
            else:
                dkdv = launch_dkdv(prep, launches.dkdv, do_view, lse, delta, dk_view, dv_view,
                                    dq_acc_view, dbias_full, shared)
                convert = kernels.launch_convert_dq(dq_acc, dq, scale=prep.scale, **launches.convert)
                if plan_key is not None and dot is not None and dkdv is not None and convert is not None:
                    keep_plan(table, plan_key, BackwardPlan(dot, dkdv, convert, not tma_aligned(do_view)))
    if problem.seqlen_k == 1 and sinks is None and dlse is None:
        # Softmax over a single key: dS = P (dP - delta) is exactly 0 (delta = P dP), so dq, dk
        # and dbias are 0. The kernels form dP and delta in two different summation orders
        # (and delta from the rounded O), which left noise where the answer is exactly 0
        # (fp32 2.4e-5 against a 2e-5 bound; fp16 with dropout 2.3e-3 against 2e-4).
        dq.zero_()
        dk.zero_()
        if dbias_full is not None:
            dbias_full.zero_()
    dbias = None
    if want_dbias:
        dbias = reduce_to(dbias_full, bias).to(bias.dtype)
    dsinks = None
    if want_dsinks:  # per-row shares (B, Hq, Sq) or (Hq, total_q), summed per head
        head_axis = 0 if varlen else 1
        dsinks = dsinks_rows.sum(dim=tuple(i for i in range(dsinks_rows.dim()) if i != head_axis))
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dbias, dsinks


def dq_accumulator(dq: Tensor, stats: torch.dtype, exact_delta: bool, varlen: bool) -> tuple[Tensor, bool]:
    """The fp32 dQ accumulator of the atomic backward, and whether it is zeroed already. The dense
    dot(dO, O) kernel zeroes it (one fill kernel less); the exact-delta pass does not, and a varlen
    batch's rows past cu_seqlens_q[-1] belong to no dot(dO, O) program (their dQ must read 0)."""
    if exact_delta or varlen:
        return torch.zeros_like(dq, dtype=stats, memory_format=torch.contiguous_format), True
    return torch.empty_like(dq, dtype=stats, memory_format=torch.contiguous_format), False


class BackwardPlan:
    """A plain eager backward (no dlse, bias, ALiBi, sinks or seqused_k, not deterministic; the
    Gluon dK/dV; dense or varlen, whose launches take the call's cu_seqlens) repeated for inputs of
    the same metadata after the same forward problem: the launch plans of its three launches
    (dot(dO, O), dK/dV, the dQ convert; `launch_cache.Planned`) and whether dO is copied for TMA
    first."""

    __slots__ = ("dot", "dkdv", "convert", "do_copied", "runnable")

    def __init__(self, dot, dkdv, convert, do_copied: bool) -> None:
        from ..kernels.launch.cache import runnable  # (Triton is loaded by now: it ran these)

        self.dot, self.dkdv, self.convert, self.do_copied, self.runnable = dot, dkdv, convert, do_copied, runnable


BACKWARD_PLANS = plan_table()


def reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """Sum a (B, Hq, Sq, Sk) gradient over the dimensions `like` broadcasts."""
    lead = grad.dim() - like.dim()
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


@bwd_op.register_fake
def _(do, dlse, o, lse, want_dbias, want_dsinks, q, k, v, bias, alibi_slopes, sinks, *rest):
    dbias = torch.empty_like(bias) if want_dbias else q.new_empty(0)
    dsinks = torch.empty_like(sinks) if want_dsinks and sinks is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dsinks


def direct_op(op, tensors, *, grad_free: bool = True, autograd: type | None = None):
    """`op` itself when torch's dispatcher has something to do for this call, else its Python
    body: the custom-op dispatch costs about 70-90 us per call (tools/host_overhead.py),
    which is most of the host path of a small problem. The body is used only in plain eager
    mode: not while torch.compile traces, no dispatch mode (fake tensors, flop counters),
    torch-function mode or torch.func transform active, plain tensors on the CPU or a GPU.
    A call autograd has to record (grad_free, grad mode on, an input requiring grad) takes
    `autograd.apply` where given: a plain torch.autograd.Function around the same body and
    backward, without the custom op's autograd wrapper (whose argument handling alone cost
    ~200 us a call at 23 arguments, `torch._library.utils.fill_defaults`). Otherwise the
    registered op runs."""
    if not plain_eager():
        return op
    grad = grad_free and torch.is_grad_enabled()
    recorded = False
    for t in tensors:
        if t is not None:
            if type(t) is not Tensor:
                return op
            recorded = recorded or (grad and t.requires_grad)
    if recorded:
        return op if autograd is None else autograd.apply
    return op._init_fn


def plain_eager() -> bool:
    """Plain eager mode: not while torch.compile traces, no dispatch mode (fake tensors, flop
    counters), torch-function mode or torch.func transform active."""
    return not (torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def setup_backward_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused lse (or o) gives None, not a zeros tensor
    q, k, v, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k = inputs[:9]
    ctx.save_for_backward(q, k, v, *output, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k)
    ctx.scalars = inputs[9:]


def attention_backward(ctx, grad_o, grad_lse):
    """The backward of `fwd_op` (registered) and of `EagerAttention`."""
    q, k, v, o, lse, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k = ctx.saved_tensors
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    want_dsinks = sinks is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbias, dsinks = run_backward(grad_o, grad_lse, o, lse, want_dbias, want_dsinks,
                                              (q, k, v, bias, alibi_slopes, sinks, cu_q, cu_k, seqused_k),
                                              ctx.scalars, getattr(ctx, "fmha_forward", None))
    return (dq, dk, dv, dbias if want_dbias else None, None,
            dsinks if want_dsinks else None) + (None,) * (len(ctx.scalars) + 3)


def run_backward(grad_o, grad_lse, o, lse, want_dbias: bool, want_dsinks: bool, tensors: tuple, scalars: tuple,
                  forward: tuple[Problem, float] | None, plans: dict | None = None) -> tuple:
    """The backward of a forward on `tensors` (q, k, v and the 6 optional tensors, `OP_ARGS`
    order) with op `scalars`: `bwd_op`, or in plain eager mode its body itself, with what the
    eager forward kept (`forward`, `plans`: see `bwd_body`) and without the op's empty
    placeholders for an unwanted dbias / dsinks (None there). No double backward."""
    if grad_o is None:  # only lse was used
        grad_o = torch.zeros_like(o)
    op = direct_op(bwd_op, (grad_o, grad_lse, o, lse, *tensors), grad_free=False)
    args = (grad_o.contiguous() if grad_o.stride(-1) != 1 else grad_o, grad_lse, o, lse, want_dbias,
            want_dsinks, *tensors, *scalars)
    if op is bwd_op._init_fn:
        return bwd_body(*args, forward=forward, plans=plans)
    return op(*args)


fwd_op.register_autograd(attention_backward, setup_context=setup_backward_context)


class EagerAttention(torch.autograd.Function):
    """`fwd_op` with its registered backward for plain eager autograd calls (`direct_op`): the
    same body, context and backward, recorded by autograd directly."""

    @classmethod
    def apply(cls, *args):
        """`Function.apply` less its binding of the arguments to forward's signature through
        `inspect` (~35 us a call, a third of the call): forward takes *args, so the binding
        changes nothing. Under torch.func transforms (which `direct_op` already routes to the
        op) `Function.apply` itself runs."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)[:2]
        # Dead torch.func wrappers unwrapped, as Function.apply does (only tensors can be).
        args = tuple(unwrap_if_dead(a) if type(a) is Tensor else a for a in args)
        return super(torch.autograd.Function, cls).apply(*args)[:2]  # (the C++ apply it ends in)

    @staticmethod
    def forward(*args):
        # A third, non-tensor output (dropped by `apply`) hands the validated Problem and
        # scale to setup_context, for the backward (`bwd_body`'s `forward`).
        o, lse, prep = fwd_body(*args)
        return o, lse, (prep.problem, prep.scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        setup_backward_context(ctx, inputs, output[:2])
        ctx.fmha_forward = output[2]

    @staticmethod
    def backward(ctx, grad_o, grad_lse, _):
        return attention_backward(ctx, grad_o, grad_lse)


unwrap_if_dead = torch._C._functorch.unwrap_if_dead  # (what Function.apply unwraps with)


@torch.library.custom_op("fmha::fwd_fp8", mutates_args=())
def fwd_fp8_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    seqused_k: Tensor | None, q_descale: Tensor | None, k_descale: Tensor | None,
    v_descale: Tensor | None, descale_block_size: int | None, out_dtype: torch.dtype,
    max_seqlen_q: int, max_seqlen_k: int, layout: str,
    scale: float | None, causal: bool, window_left: int, window_right: int, mask_align: str,
    sink_size: int, softcap: float, dropout_p: float, seed: int, offset: int, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Forward of float8 q/k/v with descales (fmha.fp8): (o in out_dtype, lse fp32). No autograd."""
    prep, views = prepare_fp8(q, k, v, (bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                         max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left,
                                         window_right, mask_align, sink_size, softcap, dropout_p, seed,
                                         offset, deterministic),
                               (q_descale, k_descale, v_descale), descale_block_size)
    plan = plan_forward(prep.problem, False)
    o, o_view, lse = alloc_like(q, v.shape[-1], prep.problem.varlen, layout, dtype=out_dtype)
    if o.numel() or lse.numel():
        launch_forward(prep, plan.config(Family.FWD), o_view, lse, sinks,
                        kernel_args(prep, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, seed, offset),
                        fp8_descales=views, descale_block=descale_block_size or 0)
    return o, lse


DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")  # (the order of the descales tuples below)


def prepare_fp8(q: Tensor, k: Tensor, v: Tensor, values: tuple, descales: tuple,
                 descale_block_size: int | None) -> tuple[Prepared, dict]:
    """`prepare_op` of a float8 call, its descales checked (`fmha.fp8.check_descales`): the
    Prepared, its Problem marked when a descale is per block, and the descales' kernel views."""
    prep = prepare_op(q, k, v, values)
    p = prep.problem
    views = F8.check_descales(q, dict(zip(DESCALE_NAMES, descales, strict=True)),
                              batch=p.batch, nhead_q=p.nhead_q, nhead_k=p.nhead_k, seqlen_q=p.seqlen_q,
                              seqlen_k=p.seqlen_k, block_size=descale_block_size, varlen=p.varlen)
    block_descale = any(d is not None and d.shape[2] > 1 for d in views.values())
    return replace(prep, problem=p.with_(fp8_block_descale=block_descale)), views


@fwd_fp8_op.register_fake
def _(q, k, v, bias, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, q_descale, k_descale,
      v_descale, descale_block_size, out_dtype, max_seqlen_q, max_seqlen_k, layout, *scalars):
    o, _, lse = alloc_like(q, v.shape[-1], cu_seqlens_q is not None, layout, dtype=out_dtype)
    return o, lse


def check_fp8_call(q, k, v, q_descale, k_descale, v_descale, descale_block_size, out_dtype, return_dropout_mask):
    """Checks of the fp8 arguments that need no shapes; returns the output dtype."""
    fp8 = F8.is_fp8(q)
    if not fp8:
        given = [n for n, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                                ("descale_block_size", descale_block_size)) if d is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given but q.dtype={q.dtype}; descales are for "
                             f"float8 inputs ({', '.join(map(str, F8.FP8_DTYPES))})")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype={out_dtype} differs from q.dtype={q.dtype}; a different output "
                             f"dtype is for float8 inputs only")
        return None
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in F8.OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype!r} is not supported for float8 inputs; accepted: "
                        f"{', '.join(map(str, F8.OUT_DTYPES))}")
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                       for t in (q, k, v, q_descale, k_descale, v_descale)):
        raise NotImplementedError("fmha has no backward for float8 inputs: q/k/v (or their descales) "
                                  "require grad; run the fp8 forward under torch.no_grad() or detach "
                                  "them, or use bf16/fp16 inputs for training")
    return out_dtype


@torch.library.custom_op("fmha::dropout_mask", mutates_args=())
def dropout_mask_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, layout: str, dropout_p: float, seed: int, offset: int,
) -> Tensor:
    """The boolean keep mask (B, Hq, Sq, Sk) the forward draws (testing and inspection)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, nhead_q, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q, max_seqlen_k
    else:
        qv, kv = (t.transpose(1, 2) if layout == "bshd" else t for t in (q, k))
        batch, nhead_q, seqlen_q, seqlen_k = qv.shape[0], qv.shape[1], qv.shape[2], kv.shape[2]
    mask = torch.ones((batch, nhead_q, seqlen_q, seqlen_k), dtype=torch.uint8, device=q.device)
    if dropout_p > 0 and mask.numel():
        problem = Problem(batch=batch, nhead_q=nhead_q, nhead_k=nhead_q, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
                          dtype=V.check_dtype("q", q, allow_fp8=True), arch=arch_of(q.device),
                          dropout_p=dropout_p)
        config = plan_forward(problem, True).config(Family.DROPOUT_MASK)
        kernels = family_module("triton.dropout", interpreted=q.device.type == "cpu")
        with device_guard(q):
            kernels.launch(mask, dropout_p=dropout_p, seed=seed, offset=offset, **algorithm_args(config))
    return mask.view(torch.bool)


@dropout_mask_op.register_fake
def _(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, layout, dropout_p, seed, offset):
    if cu_seqlens_q is not None:
        shape = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k)
    elif layout == "bshd":
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    else:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return q.new_empty(shape, dtype=torch.bool)


@functools.lru_cache(maxsize=4096)
def plan_backward(problem: Problem, exact_delta: bool = False) -> Plan:
    return get_dispatcher().plan_backward(problem, exact_delta=exact_delta)


@on_dispatcher_change
def forget_plans() -> None:
    """What was planned with the previous dispatcher: the plan caches and the launchers' and
    call plans' tables (which hold configs of the dispatcher's)."""
    plan_forward.cache_clear()
    plan_backward.cache_clear()
    backward_launches.cache_clear()
    clear_plans()

