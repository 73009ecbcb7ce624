"""Performance harness: fmha against cuDNN, FlashAttention-2 and FlexAttention on one GPU.

DESIGN.md "Performance protocol". Contenders, all in layout bhsd:

- "fmha": `fmha.attention`;
- "cudnn": `torch.nn.functional.scaled_dot_product_attention` under
  `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`;
- "flash": SDPA under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)` (FlashAttention-2);
- "flex": `torch.compile(flex_attention, dynamic=False)`, with a causal `BlockMask` from
  `create_block_mask` when causal (compiled once per shape, outside the timing).

Shapes are square (Sq = Sk), so SDPA's top-left `is_causal` and fmha's bottom-right
causal mask agree. The "features" suite's shapes add a sliding window or packed documents
(varlen): fmha takes `window` / `attention_varlen`, FlexAttention a block mask of the same rule,
and SDPA's backends the dense (S, S) boolean mask (their only way to it; flash refuses masks).
GQA shapes pass `enable_gqa=True` to SDPA and flex; when a backend refuses it, k/v are
expanded to Hq heads outside the timing and the measurement says so.

Method: for each shape, the inputs are built once (`torch.randn`), every contender is run
once to check that it works (an error makes it "n/a" with the error's first line, never
stops the run) and that its output agrees with the others, then for `rounds` rounds every
contender is timed with `triton.testing.do_bench(fn, warmup=25, rep=100,
return_mode="median")`, in an order that rotates each round; a contender's time is the
median over the rounds. Memory is released between shapes. After each timing, a few calls
are enqueued back to back without synchronizing to measure the host time a call
(`host_ms`); rows where it reaches 80% of the measured time are printed as host-bound.

Backward ("bwd"): the forward runs once with inputs that require grad, and the timed call
is `torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` on that retained graph,
so the time is the backward alone (dq, dk, dv, including any preprocessing kernels).
When a contender cannot run backward twice on one graph, the fallback is the time of a
full forward + backward minus the time of the forward (method "fwd_bwd_minus_fwd").

FLOPs follow FlashAttention: forward `4 * B * Hq * S * S * D` (halved when causal),
backward 2.5 x forward. The ratio "fmha/cudnn" is fmha's TFLOP/s over cuDNN's (> 1: fmha is
faster); the summary is its geometric mean over the shapes where both ran, per mode. For the
features suite the ratio is "fmha/flex" (`reference_contender`: cuDNN runs those rules as a dense
mask over every pair, FlexAttention as a block mask of the same rule).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONTENDERS: tuple[str, ...] = ("fmha", "cudnn", "flash", "flex")
MODES: tuple[str, ...] = ("fwd", "bwd")
BWD_FLOP_FACTOR = 2.5
DEFAULT_WARMUP_MS = 25
DEFAULT_REP_MS = 100


# ----------------------------------------------------------------------------------------
# Timing of one call (used by `fmha run` and `fmha.numpy_api` too).


def time_ms(fn: Callable[[], Any], *, device: str | torch.device, warmup: int = 1, repeat: int = 3) -> float:
    """Median time of `fn()` in milliseconds over `repeat` calls, after `warmup` calls.

    CUDA: each call between two `torch.cuda.Event`s (GPU time of the call). CPU:
    `time.perf_counter` around each call.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------
# Shapes, suites and FLOPs.


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: q (B, Hq, S, D), k and v (B, Hk, S, D), bhsd.

    Features (the "features" suite; both need causal): `window` > 0, a sliding window, each
    query sees its last `window` keys, itself included; `docs` > 0, varlen: the batch's one
    sequence packs `docs` documents (`doc_lengths`), causal within each, none across."""

    batch: int
    nhead_q: int
    nhead_k: int
    seqlen: int
    head_dim: int
    dtype: str = "bf16"  # a key of DTYPES
    causal: bool = False
    window: int = 0
    docs: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; accepted: {list(DTYPES)}")
        check_sizes(self, ("batch", "nhead_q", "nhead_k", "seqlen", "head_dim"))
        if self.window < 0 or self.docs < 0:
            raise ValueError(f"window={self.window} and docs={self.docs} must be >= 0")
        if (self.window or self.docs) and not self.causal:
            raise ValueError("window and docs are causal features: give causal=True with them")
        if self.window and self.docs:
            raise ValueError("a shape has either a window or docs, not both")
        if self.docs and (self.batch != 1 or self.seqlen < DOC_WEIGHT_SUM * self.docs):
            raise ValueError(f"docs={self.docs} needs batch=1 (got {self.batch}) and seqlen >= "
                             f"{DOC_WEIGHT_SUM * self.docs} (got {self.seqlen})")

    @property
    def gqa(self) -> bool:
        return self.nhead_q != self.nhead_k

    @property
    def label(self) -> str:
        heads = f"Hq={self.nhead_q} Hk={self.nhead_k}" if self.gqa else f"H={self.nhead_q}"
        return (f"{self.dtype} B={self.batch} {heads} S={self.seqlen} D={self.head_dim}"
                + (" causal" if self.causal else "") + (f" window={self.window}" if self.window else "")
                + (f" varlen docs={self.docs}" if self.docs else ""))

    def flops(self, mode: str) -> float:
        """FLOPs of one call in `mode` ("fwd" or "bwd"), FlashAttention convention: a causal
        square counts S * S / 2 pairs, the visible ones less half the diagonal; so too a window
        of W (S * W - W * (W - 1) / 2 visible) and the documents (sum(L * L) / 2)."""
        if not (self.window or self.docs):
            return flops(self.batch, self.nhead_q, self.seqlen, self.seqlen, self.head_dim,
                         causal=self.causal, mode=mode)
        if self.window:
            w = min(self.window, self.seqlen)
            pairs = self.seqlen * w - w * (w - 1) / 2 - self.seqlen / 2
        else:
            pairs = sum(n * n for n in doc_lengths(self.seqlen, self.docs)) / 2
        f = 4.0 * self.batch * self.nhead_q * pairs * self.head_dim
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported; accepted: {list(MODES)}")
        return f * BWD_FLOP_FACTOR if mode == "bwd" else f


# Document lengths of a varlen shape, in these proportions (cycled): long and short mixed.
DOC_WEIGHTS: tuple[int, ...] = (4, 1, 3, 2)
DOC_WEIGHT_SUM = sum(DOC_WEIGHTS)


def doc_lengths(seqlen: int, docs: int) -> list[int]:
    """`docs` document lengths summing to `seqlen`, in proportion to DOC_WEIGHTS cycled (the
    last takes the rounding): every one at least 1 where seqlen >= DOC_WEIGHT_SUM * docs."""
    weights = [DOC_WEIGHTS[i % len(DOC_WEIGHTS)] for i in range(docs)]
    lengths = [seqlen * w // sum(weights) for w in weights]
    lengths[-1] += seqlen - sum(lengths)
    return lengths


def check_sizes(shape: Any, names: Sequence[str]) -> None:
    """A benchmark shape's sizes `names` at least 1, and nhead_q a multiple of nhead_k."""
    for name in names:
        if getattr(shape, name) < 1:
            raise ValueError(f"{name}={getattr(shape, name)} must be >= 1")
    if shape.nhead_q % shape.nhead_k:
        raise ValueError(f"nhead_q={shape.nhead_q} is not a multiple of nhead_k={shape.nhead_k}")


def flops(batch: int, nhead_q: int, seqlen_q: int, seqlen_k: int, head_dim: int, *,
          causal: bool = False, mode: str = "fwd") -> float:
    """Forward: 4 * B * Hq * Sq * Sk * D, halved when causal; backward: 2.5 x forward."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; accepted: {list(MODES)}")
    f = 4.0 * batch * nhead_q * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * BWD_FLOP_FACTOR if mode == "bwd" else f


STANDARD_BHS: tuple[tuple[int, int, int], ...] = (
    (16, 16, 1024), (4, 16, 4096), (2, 16, 8192), (1, 16, 16384))
# (B, Hq, Hk, S) of the GQA shape of the standard suite.
STANDARD_GQA: tuple[int, int, int, int] = (4, 32, 8, 8192)


def standard_suite() -> list[Shape]:
    """The project's standard suite: bf16 and fp16; D = 64, 128, 256; causal and not;
    (B, H, S) in STANDARD_BHS plus the GQA shape B=4, Hq=32, Hk=8, S=8192 (60 shapes)."""
    shapes = []
    for dtype in ("bf16", "fp16"):
        for head_dim in (64, 128, 256):
            for causal in (False, True):
                for batch, nhead, seqlen in STANDARD_BHS:
                    shapes.append(Shape(batch, nhead, nhead, seqlen, head_dim, dtype, causal))
                b, hq, hk, s = STANDARD_GQA
                shapes.append(Shape(b, hq, hk, s, head_dim, dtype, causal))
    return shapes


def quick_suite() -> list[Shape]:
    """bf16, D=128, (B, H, S) = (4, 16, 4096), causal and not (2 shapes)."""
    return [Shape(4, 16, 16, 4096, 128, "bf16", causal) for causal in (False, True)]


def features_suite() -> list[Shape]:
    """bf16, D=128, causal, with a feature SDPA's cuDNN and flash backends have no fast path
    for (they take a dense boolean mask, or refuse it), FlexAttention a block mask: sliding
    windows of 1024 and 4096 keys, and packed documents (varlen, MHA and GQA 32:8)."""
    return [Shape(2, 16, 16, 8192, 128, "bf16", True, window=1024),
            Shape(1, 16, 16, 16384, 128, "bf16", True, window=4096),
            Shape(1, 16, 16, 16384, 128, "bf16", True, docs=8),
            Shape(1, 32, 8, 16384, 128, "bf16", True, docs=8)]


SUITES: dict[str, Callable[[], list[Shape]]] = {"standard": standard_suite, "quick": quick_suite,
                                                "features": features_suite}


# ----------------------------------------------------------------------------------------
# Contenders.


def _first_line(e: BaseException) -> str:
    """"Type: first line of the message", plus the first line of its cause if any (a
    Triton CompilationError's own first line is only a source position)."""

    def line(x: BaseException) -> str:
        text = str(x).strip().splitlines()
        return f"{type(x).__name__}: {text[0] if text else ''}".rstrip(": ")

    root = e
    while root.__cause__ is not None and root.__cause__ is not e:
        root = root.__cause__
    return line(e) + (f" (caused by {line(root)})" if root is not e else "")


_compiled_flex: Callable | None = None


def _flex() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _sdpa_call(backend_name: str, shape: Shape, gqa_native: bool, device: str = "cuda") -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    extra = {"enable_gqa": True} if shape.gqa and gqa_native else {}
    if shape.window or shape.docs:  # SDPA's only way to a window or documents: a dense mask
        extra["attn_mask"] = dense_mask(shape, device)

    def call(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=shape.causal and "attn_mask" not in extra, **extra)

    return call


def _mask_mod(shape: Shape, device: str | torch.device) -> Callable:
    """The feature's visibility rule, mask(b, h, i, j) -> bool tensor, as FlexAttention's
    mask_mod (and, over index grids, `dense_mask`)."""
    if shape.window:
        window = shape.window
        return lambda b, h, i, j: (i >= j) & (i - j < window)
    if shape.docs:
        lengths = torch.tensor(doc_lengths(shape.seqlen, shape.docs), device=device)
        doc = torch.repeat_interleave(torch.arange(shape.docs, device=device), lengths)
        return lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)
    return lambda b, h, i, j: i >= j


def dense_mask(shape: Shape, device: str | torch.device = "cuda") -> torch.Tensor:
    """The (S, S) boolean mask of a causal shape's visible pairs (True: attended)."""
    idx = torch.arange(shape.seqlen, device=device)
    return _mask_mod(shape, device)(None, None, idx[:, None], idx[None, :])


def _make_call(name: str, shape: Shape, gqa_native: bool = True, device: str = "cuda") -> Callable:
    """f(q, k, v) -> out for contender `name` (q (B, Hq, S, D), k/v (B, Hk or Hq, S, D))."""
    if name == "fmha":
        from ..api import attention, attention_varlen

        if shape.docs:  # the batch's one sequence as packed (total, H, D) tensors, varlen's own layout
            lengths = doc_lengths(shape.seqlen, shape.docs)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
            longest = max(lengths)

            def packed(q, k, v):
                return attention_varlen(q, k, v, cu, cu, longest, longest, causal=True).transpose(0, 1)[None]
            # The call takes packed copies (`_setup` makes them, untimed), as a varlen caller holds its
            # tensors: views of the bhsd ones would add three strided copies to every backward
            # (the gradients of the views, which FlexAttention on bhsd tensors does not pay).
            packed.prepare = lambda t: t[0].transpose(0, 1).contiguous()
            return packed
        if shape.window:  # the last `window` keys, the query's own included
            return lambda q, k, v: attention(q, k, v, window=(shape.window - 1, 0))
        return lambda q, k, v: attention(q, k, v, causal=shape.causal)
    if name == "cudnn":
        return _sdpa_call("CUDNN_ATTENTION", shape, gqa_native, device)
    if name == "flash":
        return _sdpa_call("FLASH_ATTENTION", shape, gqa_native, device)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _flex()
        mask = None
        if shape.causal:
            mask = create_block_mask(_mask_mod(shape, device), None, None, shape.seqlen, shape.seqlen,
                                     device=device)
        extra = {"enable_gqa": True} if shape.gqa and gqa_native else {}
        return lambda q, k, v: flex(q, k, v, block_mask=mask, **extra)
    raise ValueError(f"contender {name!r} is not known; accepted: {list(CONTENDERS)}")


@dataclass
class _Runner:
    """A contender set up for one (shape, mode): timed calls, or the reason it cannot run."""

    contender: str
    parts: list[tuple[float, Callable[[], Any]]]  # time = sum(sign * do_bench(fn))
    method: str = ""
    note: str = ""
    error: str | None = None
    out: torch.Tensor | None = None  # forward output, for the agreement check

    def measure(self, warmup_ms: float, rep_ms: float) -> float:
        from triton.testing import do_bench

        return sum(sign * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
                   for sign, fn in self.parts)

    def host_ms(self, measured_ms: float) -> float | None:
        """CPU time to enqueue one call of the timed function, over a few back-to-back calls
        without synchronizing: at or near `measured_ms`, the measurement was bound by the host
        (Python, launches), not by the GPU. A few calls (~5 ms of GPU work, 3-20 calls) keep
        the launch queue far from full, so the GPU does not slow them. None for a time made of
        several parts (fwd+bwd minus fwd), which no one call's host time compares to."""
        if len(self.parts) != 1:
            return None
        return host_ms_per_call(self.parts[0][1], calls=max(3, min(20, round(5.0 / max(measured_ms, 1e-3)))))


def host_ms_per_call(fn: Callable[[], Any], calls: int) -> float:
    """CPU time (ms) to enqueue one call of `fn`: `calls` calls back to back, timed without
    synchronizing (the GPU drained before and after). With few enough calls that the launch
    queue does not fill, no call waits for the GPU, so this is the host path alone."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _expand_kv(shape: Shape, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    group = shape.nhead_q // shape.nhead_k
    return k.repeat_interleave(group, 1).contiguous(), v.repeat_interleave(group, 1).contiguous()


def _setup(name: str, shape: Shape, mode: str, q, k, v, dout) -> _Runner:
    """Check that `name` runs `mode` on the inputs; return its timed calls or its error."""
    note = ""
    try:
        call = _make_call(name, shape)
        prepare = getattr(call, "prepare", None)  # (a contender's own layout of the inputs)
        if prepare is not None:
            q, k, v = prepare(q), prepare(k), prepare(v)
        try:
            return _setup_call(name, call, mode, q, k, v, dout, note)
        except Exception as e:
            if not shape.gqa or name == "fmha":
                raise
            # The backend refused enable_gqa: give it k/v with Hq heads (built untimed).
            note = f"k/v expanded to Hq heads ({_first_line(e)})"
            k, v = _expand_kv(shape, k, v)
            call = _make_call(name, shape, gqa_native=False)
            return _setup_call(name, call, mode, q, k, v, dout, note)
    except Exception as e:  # any failure makes this contender n/a, never stops the run
        return _Runner(name, [], note=note, error=_first_line(e))


def _setup_call(name: str, call: Callable, mode: str, q, k, v, dout, note: str) -> _Runner:
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return call(q, k, v)

        out = fwd()
        torch.cuda.synchronize()
        return _Runner(name, [(1.0, fwd)], method="forward", note=note, out=out)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = call(*leaves)
    grad = dout if dout.shape == out.shape else torch.randn_like(out)

    def bwd_retained():
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    try:
        bwd_retained()
        bwd_retained()  # a second backward on the same graph must work too
        torch.cuda.synchronize()
        return _Runner(name, [(1.0, bwd_retained)], method="grad_retained_graph", note=note)
    except Exception as e:
        reason = _first_line(e)

    def fwd_bwd():
        with torch.enable_grad():
            o = call(*leaves)
            return torch.autograd.grad(o, leaves, grad)

    def fwd_only():
        with torch.enable_grad():
            return call(*leaves)

    fwd_bwd()
    torch.cuda.synchronize()
    note = "; ".join(filter(None, [note, f"retained-graph backward failed ({reason})"]))
    return _Runner(name, [(1.0, fwd_bwd), (-1.0, fwd_only)], method="fwd_bwd_minus_fwd", note=note)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ----------------------------------------------------------------------------------------
# The suite.


def run_suite(shapes: Sequence[Shape], modes: Sequence[str] = MODES,
              contenders: Sequence[str] = CONTENDERS, rounds: int = 3, progress: bool = True, *,
              warmup_ms: float = DEFAULT_WARMUP_MS, rep_ms: float = DEFAULT_REP_MS,
              on_shape_done: Callable[[list[dict]], None] | None = None,
              console: Any = None) -> list[dict]:
    """Time every contender on every shape and mode; one dict per measurement.

    Each dict holds the shape's fields and label, "mode", "contender", "ok", "error"
    (first line, when not ok), "method", "note", "time_ms" (median over rounds),
    "times_ms" (one per round), "flops", "tflops", "wall_s" (seconds spent on this shape
    and mode, compilation included) and "max_abs_diff" (forward: largest
    |out - out of the reference contender|, cuDNN if it ran, else the first that did;
    "diff_against" names it). `on_shape_done(results_so_far)` runs after each shape
    (e.g. to write partial results). Needs CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("fmha bench needs a CUDA GPU; torch.cuda.is_available() is False")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported; accepted: {list(MODES)}")
    for name in contenders:
        if name not in CONTENDERS:
            raise ValueError(f"contender {name!r} is not known; accepted: {list(CONTENDERS)}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: list[dict] = []
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, disable=not progress)
    with bar:
        task = bar.add_task("bench", total=len(shapes) * len(modes) * (rounds + 1))
        for shape in shapes:
            results += _run_shape(shape, modes, contenders, rounds, warmup_ms, rep_ms, bar, task)
            if on_shape_done is not None:
                on_shape_done(results)
    return results


def _run_shape(shape: Shape, modes, contenders, rounds, warmup_ms, rep_ms, bar, task) -> list[dict]:
    if "flex" in contenders:
        from torch import _dynamo  # `import torch._dynamo` here would make `torch` a local name

        _dynamo.reset()  # one compile per shape; avoids the recompile limit
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = DTYPES[shape.dtype]

    def randn(*size):
        return torch.randn(size, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q = randn(shape.batch, shape.nhead_q, shape.seqlen, shape.head_dim)
    k = randn(shape.batch, shape.nhead_k, shape.seqlen, shape.head_dim)
    v = randn(shape.batch, shape.nhead_k, shape.seqlen, shape.head_dim)
    dout = randn(shape.batch, shape.nhead_q, shape.seqlen, shape.head_dim)
    rows = []
    try:
        for mode in modes:
            started = time.perf_counter()
            bar.update(task, description=f"{shape.label} {mode}: checking")
            runners = [_setup(name, shape, mode, q, k, v, dout) for name in contenders]
            bar.advance(task)
            times: dict[str, list[float]] = {r.contender: [] for r in runners}
            hosts: dict[str, list[float]] = {r.contender: [] for r in runners}
            errors: dict[str, str] = {}
            for round_ in range(rounds):
                bar.update(task, description=f"{shape.label} {mode}: round {round_ + 1}/{rounds}")
                order = runners[round_ % len(runners):] + runners[:round_ % len(runners)]
                for runner in order:
                    if runner.error is not None or runner.contender in errors:
                        continue
                    try:
                        times[runner.contender].append(runner.measure(warmup_ms, rep_ms))
                        host = runner.host_ms(times[runner.contender][-1])
                        if host is not None:
                            hosts[runner.contender].append(host)
                    except Exception as e:
                        errors[runner.contender] = _first_line(e)
                bar.advance(task)
            mode_rows = _rows(shape, mode, runners, times, errors, hosts)
            for row in mode_rows:  # wall time of setup (compiles included) and all rounds
                row["wall_s"] = time.perf_counter() - started
            rows += mode_rows
            del runners
    finally:
        del q, k, v, dout
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


def _rows(shape: Shape, mode: str, runners: list[_Runner], times: dict[str, list[float]],
          errors: dict[str, str], hosts: dict[str, list[float]] | None = None) -> list[dict]:
    outs = {r.contender: r.out for r in runners if r.out is not None}
    ref_name = "cudnn" if "cudnn" in outs else next(iter(outs), None)
    rows = []
    for r in runners:
        error = r.error or errors.get(r.contender)
        ok = error is None and bool(times[r.contender])
        t = statistics.median(times[r.contender]) if ok else None
        f = shape.flops(mode)
        diff = None
        if r.out is not None and ref_name is not None and r.out.shape == outs[ref_name].shape:
            diff = _max_abs_diff(r.out, outs[ref_name])
        rows.append({
            "shape": shape.label, **asdict(shape), "mode": mode, "contender": r.contender,
            "ok": ok, "error": error, "method": r.method, "note": r.note,
            "time_ms": t, "times_ms": times[r.contender], "flops": f,
            "tflops": f / (t * 1e-3) / 1e12 if ok and t > 0 else None,
            "max_abs_diff": diff, "diff_against": ref_name if diff is not None else None,
            "host_ms": statistics.median(hosts[r.contender]) if ok and hosts and hosts[r.contender] else None,
        })
    return rows


# ----------------------------------------------------------------------------------------
# Summaries and writers (plain functions of the result dicts: testable without a GPU).


def ratio_rows(results: Iterable[dict], num: str = "fmha", den: str = "cudnn") -> list[dict]:
    """One dict per (shape, mode), in order of appearance: "shape", "mode", "tflops"
    ({contender: TFLOP/s or None}), "errors" ({contender: first line}) and "ratio"
    (num's TFLOP/s over den's, None unless both ran)."""
    table: dict[tuple[str, str], dict] = {}
    for r in results:
        row = table.setdefault((r["shape"], r["mode"]),
                               {"shape": r["shape"], "mode": r["mode"], "tflops": {}, "errors": {}})
        row["tflops"][r["contender"]] = r["tflops"] if r["ok"] else None
        if not r["ok"]:
            row["errors"][r["contender"]] = r.get("error") or "no measurement"
    for row in table.values():
        a, b = row["tflops"].get(num), row["tflops"].get(den)
        row["ratio"] = a / b if a and b else None
    return list(table.values())


def host_bound_rows(results: Iterable[dict], fraction: float = 0.8) -> list[str]:
    """One line per measured row whose host time per call (`host_ms`, the CPU time to enqueue
    a call) is at least `fraction` of its measured time: there the host, not the GPU, set the
    number, and the row says little about the kernels (a slow or busy host)."""
    return [f"host-bound: {r['contender']} {r['mode']} {r['shape']}: {r['host_ms']:.3f} ms of host time a call, "
            f"{r['time_ms']:.3f} ms measured"
            for r in results if r.get("ok") and r.get("host_ms") and r["host_ms"] >= fraction * r["time_ms"]]


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values; None for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def reference_contender(results: Iterable[dict], contenders: Iterable[str] | None = None) -> str:
    """The contender fmha's ratios and geomeans are taken against: cuDNN, except for the features
    suite's shapes (sliding windows, packed documents), which SDPA's backends take only as a dense
    (S, S) mask, so that cuDNN computes every pair there: FlexAttention (a block mask of the same
    rule), when it is among the contenders (default: those in the results)."""
    results = list(results)
    contenders = set(contenders if contenders is not None else (r["contender"] for r in results))
    features = any(r.get("window") or r.get("docs") for r in results)
    return "flex" if features and "flex" in contenders else "cudnn"


def summary(results: Iterable[dict], num: str = "fmha", den: str | None = None) -> dict[str, dict]:
    """Per mode: {"geomean_ratio": geometric mean of num/den over the shapes where both
    ran (None if none), "shapes": how many shapes that is, "total": shapes measured, "against":
    den}. den None: `reference_contender(results)`."""
    results = list(results)
    den = den or reference_contender(results)
    rows = ratio_rows(results, num, den)
    out = {}
    for mode in dict.fromkeys(row["mode"] for row in rows):
        ratios = [row["ratio"] for row in rows if row["mode"] == mode and row["ratio"] is not None]
        out[mode] = {"geomean_ratio": geomean(ratios), "shapes": len(ratios),
                     "total": sum(1 for row in rows if row["mode"] == mode), "against": den}
    return out


def environment() -> dict[str, Any]:
    """Date, GPU and software versions, for the JSON output."""
    import numpy
    import triton

    from .. import __version__

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "numpy": numpy.__version__, "fmha": __version__,
        "cuda": torch.version.cuda, "gpu": None, "capability": None, "cudnn": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = "sm{}{}".format(*torch.cuda.get_device_capability())
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return env


def write_json(path: str | Path, results: list[dict], env: dict | None = None,
               settings: dict | None = None, summary_data: dict | None = None) -> None:
    """{"environment", "settings", "summary", "results"} as JSON (summary: `summary(results)`
    unless given, e.g. bench_decode.decode_summary)."""
    data = {"environment": env if env is not None else environment(), "settings": settings or {},
            "summary": summary(results) if summary_data is None else summary_data, "results": results}
    Path(path).write_text(json.dumps(data, indent=2))


CSV_FIELDS = ("shape", "dtype", "batch", "nhead_q", "nhead_k", "seqlen", "head_dim", "causal", "mode",
              "contender", "ok", "time_ms", "host_ms", "tflops", "flops", "method", "max_abs_diff", "note",
              "error")


def write_csv(path: str | Path, results: list[dict]) -> None:
    """One row per measurement, columns CSV_FIELDS."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow({key: r.get(key) for key in CSV_FIELDS})


def plot(path: str | Path, results: list[dict], title: str = "") -> None:
    """Grouped bars: TFLOP/s per shape (x) and contender (colour), one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ratio_rows(results)
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    n_shapes = max((sum(1 for row in rows if row["mode"] == m) for m in modes), default=1)
    fig_width = max(8.0, 0.45 * n_shapes * max(1, len(contenders)) / 2)
    fig, axes = plt.subplots(len(modes), 1, squeeze=False, figsize=(fig_width, 4.5 * len(modes)))
    width = 0.8 / max(1, len(contenders))
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        mode_rows = [row for row in rows if row["mode"] == mode]
        for i, name in enumerate(contenders):
            xs = [j + (i - (len(contenders) - 1) / 2) * width for j in range(len(mode_rows))]
            ys = [row["tflops"].get(name) or 0.0 for row in mode_rows]
            ax.bar(xs, ys, width=width, label=name)
            for x, row in zip(xs, mode_rows, strict=True):
                if name in row["tflops"] and not row["tflops"][name]:
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(mode_rows)))
        ax.set_xticklabels([row["shape"] for row in mode_rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title} {mode}".strip())
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_table(results: list[dict], contenders: Sequence[str] | None = None) -> Any:
    """A rich Table: shape, mode, TFLOP/s of each contender, fmha over the reference contender
    (`reference_contender`: cuDNN, FlexAttention for the features suite); geomean rows."""
    from rich.table import Table

    contenders = list(contenders or dict.fromkeys(r["contender"] for r in results))
    den = reference_contender(results, contenders)
    rows = ratio_rows(results, den=den)
    table = Table(title="TFLOP/s (median over rounds of do_bench medians)")
    table.add_column("shape")
    table.add_column("mode")
    for name in contenders:
        table.add_column(name, justify="right")
    table.add_column(f"fmha/{den}", justify="right")
    for row in rows:
        cells = [f"{row['tflops'][c]:.1f}" if row["tflops"].get(c) else "n/a" for c in contenders]
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        table.add_row(row["shape"], row["mode"], *cells, ratio)
    for mode, s in summary(results, den=den).items():
        g = f"{s['geomean_ratio']:.3f}" if s["geomean_ratio"] is not None else "-"
        table.add_row(f"geomean ({s['shapes']}/{s['total']} shapes)", mode, *[""] * len(contenders), g,
                      style="bold")
    return table


def na_reasons(results: Iterable[dict]) -> list[str]:
    """One line per distinct (contender, mode, error) among failed measurements."""
    seen: dict[tuple[str, str, str], int] = {}
    for r in results:
        if not r["ok"]:
            key = (r["contender"], r["mode"], r.get("error") or "no measurement")
            seen[key] = seen.get(key, 0) + 1
    return [f"{c} {m}: n/a on {n} shape(s): {e}" for (c, m, e), n in seen.items()]


# ----------------------------------------------------------------------------------------
# `fmha bench`.


def _contender_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown or text!r}; accepted: "
                                         f"{','.join(CONTENDERS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `fmha bench`."""
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="standard (60 shapes), quick (2) or features (4: sliding windows and varlen documents, "
                        "causal); default standard unless shape flags are given")
    g = p.add_argument_group("custom shape (instead of --suite)")
    g.add_argument("-b", "--batch", type=int, default=None, help="batch (default 4)")
    g.add_argument("--nhead-q", type=int, default=None, help="query heads (default 16)")
    g.add_argument("--nhead-k", type=int, default=None, help="key/value heads (default nhead-q)")
    g.add_argument("--seqlen", type=int, default=None, help="sequence length, q and k (default 4096)")
    g.add_argument("--hdim", type=int, default=None, help="head dim (default 128)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16")
    g.add_argument("--causal", action="store_true", default=None, help="causal mask")
    p.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both")
    p.add_argument("--contenders", type=_contender_list, default=list(CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, order rotated (default 3)")
    p.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS, help="do_bench warmup (ms)")
    p.add_argument("--rep-ms", type=float, default=DEFAULT_REP_MS, help="do_bench repetition time (ms)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every measurement (after each shape)")
    p.add_argument("--csv", metavar="FILE", default=None, help="write one row per measurement")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart of TFLOP/s")
    p.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="only shapes K, K+N, K+2N, ... (1-based) of the selection, to split a suite "
                        "over several runs; join the JSON files with --merge")
    p.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                   help="no timing: read JSON files of earlier runs, print the joint table and "
                        "write --json/--csv/--plot (no GPU needed)")
    p.add_argument("--decode", action="store_true",
                   help="the decode suite instead (fmha.attention_with_kvcache against SDPA cuDNN and flash: "
                        "one query token over 8k/32k cached keys, contiguous and paged, bf16 and float8 caches; "
                        "time and TB/s of K+V)")
    p.add_argument("--dry-run", action="store_true", help="list the shapes and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N (e.g. 2/4)") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= K <= N")
    return k, n


# The custom-shape flags of `fmha bench` (argparse destinations).
SHAPE_FLAGS = ("batch", "nhead_q", "nhead_k", "seqlen", "hdim", "dtype", "causal")


def shapes_from_args(args: argparse.Namespace) -> list[Shape]:
    """The shapes selected by `fmha bench` flags (ValueError on a conflict)."""
    custom = {name: getattr(args, name) for name in SHAPE_FLAGS}
    if any(value is not None for value in custom.values()):
        if args.suite is not None:
            raise ValueError("give either --suite or custom shape flags (-b, --nhead-q, --nhead-k, "
                             "--seqlen, --hdim, --dtype, --causal), not both")
        nhead_q = custom["nhead_q"] or 16
        shapes = [Shape(custom["batch"] or 4, nhead_q, custom["nhead_k"] or nhead_q,
                        custom["seqlen"] or 4096, custom["hdim"] or 128, custom["dtype"] or "bf16",
                        bool(custom["causal"]))]
    else:
        shapes = SUITES[args.suite or "standard"]()
    if getattr(args, "shard", None) is not None:
        k, n = args.shard
        shapes = shapes[k - 1::n]
    return shapes


def read_results(paths: Sequence[str | Path]) -> tuple[list[dict], dict]:
    """Results and environment (of the first file) from JSON files written by `write_json`.

    Raises ValueError naming the file when one cannot be read or is not such a file.
    """
    results: list[dict] = []
    env: dict = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            part = data["results"]
            if not isinstance(part, list) or not all(isinstance(r, dict) for r in part):
                raise TypeError("'results' is not a list of objects")
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"cannot read bench results from {path}: {type(e).__name__}: {e}") from None
        results += part
        env = env or data.get("environment", {})
    return results, env


def command(args: argparse.Namespace, console: Any) -> int:
    """`fmha bench`: 0 on success, 2 without CUDA or on bad arguments."""
    if args.merge:
        results, env = read_results(args.merge)
        _report(results, env, {"merged_from": list(args.merge)}, args, console,
                list(dict.fromkeys(r["contender"] for r in results)))
        return 0
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds} must be >= 1")
    if getattr(args, "decode", False):
        return _decode_command(args, console)
    shapes = shapes_from_args(args)
    modes = list(MODES) if args.mode == "both" else [args.mode]
    if args.dry_run:
        for shape in shapes:
            console.print(f"{shape.label}  fwd {shape.flops('fwd') / 1e12:.2f} TFLOP")
        console.print(f"{len(shapes)} shapes x modes {modes} x contenders {args.contenders}")
        return 0
    if not torch.cuda.is_available():
        print("error: fmha bench needs a CUDA GPU (torch.cuda.is_available() is False); "
              "benchmarks are not run through the CPU interpreter. Use `fmha run` on the "
              "CPU, or `fmha bench --dry-run` to list the shapes.", file=sys.stderr)
        return 2
    env = environment()
    settings = {"modes": modes, "contenders": args.contenders, "rounds": args.rounds,
                "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                "suite": args.suite, "shard": args.shard, "shapes": len(shapes),
                "do_bench_return_mode": "median",
                "bwd_method": "autograd.grad on a retained graph (fallback: fwd+bwd minus fwd)",
                "flops": "fwd 4*B*Hq*S*S*D (causal /2; windows and documents: their visible pairs "
                         "less half the diagonal), bwd 2.5x fwd"}
    console.print(f"fmha bench on {env['gpu']} ({env['capability']}), torch {env['torch']}, "
                  f"triton {env['triton']}, cuDNN {env['cudnn']}: {len(shapes)} shapes, modes {modes}, "
                  f"contenders {args.contenders}, {args.rounds} rounds")

    def partial(results: list[dict]) -> None:
        if args.json:
            write_json(args.json, results, env, {**settings, "complete": False})

    results = run_suite(shapes, modes, args.contenders, args.rounds, progress=not args.no_progress,
                        warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, on_shape_done=partial, console=console)
    _report(results, env, {**settings, "complete": True}, args, console, args.contenders)
    return 0


def _decode_command(args: argparse.Namespace, console: Any) -> int:
    """`fmha bench --decode` (bench_decode): the decode suite, its table and JSON."""
    from . import decode as bench_decode

    custom = any(getattr(args, name) is not None for name in SHAPE_FLAGS)
    if custom or args.suite is not None or args.shard is not None or args.csv or args.plot:
        raise ValueError("--decode runs its own suite: no --suite, shape flags, --shard, --csv or --plot with it")
    shapes = bench_decode.decode_suite()
    contenders = [c for c in args.contenders if c in bench_decode.DECODE_CONTENDERS]
    if args.dry_run:
        for shape in shapes:
            console.print(f"{shape.label}  {shape.kv_bytes('fmha') / 1e9:.2f} GB of K+V for fmha")
        console.print(f"{len(shapes)} decode shapes x contenders {contenders}")
        return 0
    if not torch.cuda.is_available():
        print("error: fmha bench --decode needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    env = environment()
    settings = {"suite": "decode", "contenders": contenders, "rounds": args.rounds, "warmup_ms": args.warmup_ms,
                "rep_ms": args.rep_ms, "do_bench_return_mode": "median",
                "bandwidth": "bytes of K and V each contender reads (float8 cache: 1 byte an element) over the time"}
    console.print(f"fmha bench --decode on {env['gpu']}: {len(shapes)} shapes, contenders {contenders}, "
                  f"{args.rounds} rounds" + (" (flex has no decode contender)" if "flex" in args.contenders else ""))
    results = bench_decode.run_decode_suite(
        shapes, contenders, args.rounds,
        timer=lambda fn: do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"),
        host_timer=lambda fn: host_ms_per_call(fn, calls=10))
    console.print(bench_decode.render_decode_table(results, contenders))
    for r in results:
        if not r["ok"]:
            console.print(f"n/a: {r['contender']} {r['shape']}: {r['error']}")
    for line in host_bound_rows(results):
        console.print(line)
    summary_data = bench_decode.decode_summary(results)
    console.print(f"geomean cuDNN time / fmha time: {summary_data['geomean_cudnn_over_fmha']}")
    if args.json:
        write_json(args.json, results, env, settings, summary_data)
        console.print(f"wrote {args.json}")
    return 0


def _report(results: list[dict], env: dict, settings: dict, args: argparse.Namespace, console: Any,
            contenders: Sequence[str]) -> None:
    """Print the table, the n/a reasons and notes; write the files asked for."""
    console.print(render_table(results, contenders))
    for line in na_reasons(results) + host_bound_rows(results):
        console.print(line)
    for r in results:
        if r["ok"] and r["note"]:
            console.print(f"note: {r['contender']} {r['mode']} {r['shape']}: {r['note']}")
    if args.json:
        write_json(args.json, results, env, settings)
        console.print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, results)
        console.print(f"wrote {args.csv}")
    if args.plot:
        plot(args.plot, results, title=str(env.get("gpu") or ""))
        console.print(f"wrote {args.plot}")


__all__ = ["Shape", "flops", "standard_suite", "quick_suite", "SUITES", "run_suite", "time_ms", "ratio_rows",
           "host_bound_rows", "host_ms_per_call", "geomean", "summary", "environment", "write_json",
           "write_csv", "plot", "render_table", "reference_contender", "na_reasons", "add_arguments",
           "shapes_from_args", "read_results", "command", "CONTENDERS", "MODES", "DTYPES"]
