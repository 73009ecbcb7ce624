"""Tuning: time every candidate config of a family for a set of problems and record the
fastest in the tuning database (`fmha.dispatch.tuning.TuningDB`). `fmha tune` drives it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..dispatch.configs import Family, KernelConfig
from ..dispatch.registry import Registry
from ..dispatch.tuning import TuningDB
from ..problem import Problem

TUNABLE_FAMILIES: tuple[Family, ...] = (Family.FWD, Family.BWD_DQ_DK_DV, Family.BWD_DQ)
Timer = Callable[[KernelConfig, Problem], float]



def candidates(registry: Any, problem: Problem, family: Family) -> list[KernelConfig]:
    return [c for c in registry if c.family == family and not c.signature.refusals(problem)]


def registry_forcing(registry: Any, config: KernelConfig) -> Any:
    """`registry` with `config` as the only config of its family."""
    return Registry([config, *(c for c in registry if c.family != config.family)],
                    name=f"{registry.name}[force {config.name}]")


def runner(config: KernelConfig, problem: Problem, device: str = "cuda", seed: int = 0) -> tuple[Callable, Any]:
    """(fn, dispatcher): `fn()` runs `problem` on random inputs (dense, bhsd) through
    `fmha.attention` -- the forward for `fwd`, the backward alone (autograd.grad on a
    retained graph) for the backward families -- when called inside
    `fmha.api.use_dispatcher(dispatcher)`, whose registry has `config` as the only config
    of its family (the current dispatcher's registry supplies the other families)."""
    import torch

    from ..api import attention, get_dispatcher, problem_of, use_dispatcher
    from ..dispatch.dispatcher import Dispatcher

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
             "fp64": torch.float64}[problem.dtype.value]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    b, sq, sk = problem.batch, problem.seqlen_q, problem.seqlen_k
    q = randn(b, problem.nhead_q, sq, problem.head_dim_qk)
    k = randn(b, problem.nhead_k, sk, problem.head_dim_qk)
    v = randn(b, problem.nhead_k, sk, problem.head_dim_v)
    kwargs: dict[str, Any] = dict(
        causal=problem.causal, window=problem.window, mask_align=problem.mask_align.value,
        sink_size=problem.sink_size, softcap=problem.softcap, dropout_p=problem.dropout_p,
        deterministic=problem.deterministic)
    if problem.alibi:
        kwargs["alibi_slopes"] = randn(problem.nhead_q, dt=torch.float32).abs()
    if problem.bias:
        kwargs["bias"] = randn(1, problem.nhead_q, sq, sk, dt=torch.float32)
    if problem.sinks:
        kwargs["sinks"] = randn(problem.nhead_q, dt=torch.float32)
    built = problem_of(q, k, v, **kwargs)
    if built != problem:
        diff = {f: (getattr(problem, f), getattr(built, f)) for f in problem.__dataclass_fields__
                if getattr(problem, f) != getattr(built, f)}
        raise ValueError(f"cannot time {problem.describe()}: the inputs it builds (dense, bhsd, on {device}) "
                         f"give another problem; (wanted, built) by field: {diff}")
    dispatcher = Dispatcher(registry_forcing(get_dispatcher().registry, config))
    if config.family == Family.FWD:
        def fn():
            with torch.no_grad():
                return attention(q, k, v, **kwargs)
        return fn, dispatcher
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with use_dispatcher(dispatcher):
        out = attention(*leaves, **kwargs)
    dout = torch.randn_like(out)

    def fn():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return fn, dispatcher


def gpu_timer(warmup_ms: float = 25, rep_ms: float = 100) -> Timer:
    """A timer: `triton.testing.do_bench`'s median (ms) of `runner(config, problem)` on CUDA."""

    def time_config(config: KernelConfig, problem: Problem) -> float:
        import torch
        from triton.testing import do_bench

        from ..api import use_dispatcher

        if not torch.cuda.is_available():
            raise RuntimeError("timing a kernel config needs a CUDA GPU")
        fn, dispatcher = runner(config, problem, "cuda")
        with use_dispatcher(dispatcher):
            fn()
            torch.cuda.synchronize()
            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return time_config


@dataclass
class TuneResult:
    problem: Problem
    family: Family
    timings_ms: dict[str, float | None]
    errors: dict[str, str]
    chosen: str | None

    def to_dict(self) -> dict:
        return {"problem": self.problem.describe(), "family": self.family.value, "timings_ms": self.timings_ms,
                "errors": self.errors, "chosen": self.chosen}


def tune(problems: Sequence[Problem], families: Sequence[Family], *, registry: Any, db: TuningDB | None,
         timer: Timer, progress: Any = None, gpu: str | None = None) -> list[TuneResult]:
    """Time every candidate config of each family for each problem with `timer`, record the
    fastest in `db` (if given) and return the results. A candidate that raises is recorded
    with time None and its error; a problem where none ran is reported, not recorded.

    `progress(advance_by, description)` is called after each timing (a progress bar)."""
    for family in families:
        if family not in TUNABLE_FAMILIES:
            raise ValueError(f"family {family.value!r} cannot be tuned; accepted: "
                             f"{[f.value for f in TUNABLE_FAMILIES]}")
    results = []
    for problem in problems:
        for family in families:
            if family == Family.BWD_DQ and not problem.deterministic:
                continue  # bwd_dq only runs in the deterministic backward
            timings: dict[str, float | None] = {}
            errors: dict[str, str] = {}
            for config in candidates(registry, problem, family):
                try:
                    timings[config.name] = float(timer(config, problem))
                except Exception as e:  # a config that fails is not chosen, never stops the run
                    timings[config.name] = None
                    errors[config.name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
                if progress is not None:
                    progress(1, f"{family.value} {problem.describe()}")
            chosen = None
            if any(t is not None for t in timings.values()):
                entry = (db.record(problem, family, timings, gpu=gpu) if db is not None else
                         {"config": min((n for n, t in timings.items() if t is not None), key=timings.__getitem__)})
                chosen = entry["config"]
            results.append(TuneResult(problem, family, timings, errors, chosen))
    return results


__all__ = ["TUNABLE_FAMILIES", "Timer", "TuneResult", "candidates", "gpu_timer", "registry_forcing", "runner", "tune"]
