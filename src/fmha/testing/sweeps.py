"""Sweeps and stress tests of the dispatcher-selected kernels (CK examples 07 and 29-32).

- `sweep(axis, values, base, device)`: one problem per value of `axis` (seqlen, batch,
  nhead or hdim; the rest from `base`), each run through `fmha.attention` with the kernel
  the dispatcher selects, timed (CUDA events on a GPU, wall time in the interpreter) and,
  where affordable, checked against a float64 truth (`fmha.cli.validate`: whole problem,
  else batch 0 / one KV-head group, else skipped). `write_csv`, `write_json` and `plot`
  save the rows; `sweep_table` renders them.
- `stress(count, seed, device)`: `count` random problems (dtype, shapes, GQA, layout,
  masks, sink tokens, soft-cap, bias/ALiBi, sink logits, dropout, seed), each validated;
  `stress_table` summarises them. Each row carries the `fmha run` flags that reproduce it.

On the CPU the problems are small (Triton's interpreter); on a GPU they are realistic.
"""

from __future__ import annotations

import contextlib
import csv
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..api import use_dispatcher

if TYPE_CHECKING:  # cli imports this module; the functions below import cli when they run
    from ..cli import RunSpec

AXES: tuple[str, ...] = ("seqlen", "batch", "nhead", "hdim")
# Values of each axis when none are given.
DEFAULT_VALUES: dict[str, dict[str, tuple[int, ...]]] = {
    "cuda": {"seqlen": (512, 1024, 2048, 4096, 8192, 16384), "batch": (1, 2, 4, 8, 16, 32),
             "nhead": (1, 2, 4, 8, 16, 32, 64), "hdim": (32, 64, 80, 96, 128, 160, 192, 256)},
    "cpu": {"seqlen": (16, 33, 64), "batch": (1, 2, 3), "nhead": (1, 2, 4), "hdim": (16, 40, 64)},
}


def _cli() -> Any:
    from .. import cli

    return cli


def base_spec(on_cpu: bool, **fields: Any) -> RunSpec:
    """The problem a sweep varies: `fmha run`'s defaults for the device, then `fields`."""
    d = _cli().SIZE_DEFAULTS["cpu" if on_cpu else "cuda"]
    spec = _cli().RunSpec("sweep", d["batch"], d["nhead_q"], d["nhead_q"], d["seqlen_q"], d["seqlen_q"],
                          d["hdim_q"], d["hdim_q"], "fp16" if on_cpu else "bf16")
    return replace(spec, **fields)


def point(base: RunSpec, axis: str, value: int) -> RunSpec:
    """`base` with `axis` set to `value` (seqlen: Sq = Sk; nhead: Hq, and Hk keeping the
    base's group size when it divides; hdim: Dq = Dv)."""
    if axis == "seqlen":
        return replace(base, seqlen_q=value, seqlen_k=value, title=f"seqlen={value}")
    if axis == "batch":
        return replace(base, batch=value, title=f"batch={value}")
    if axis == "nhead":
        group = base.nhead_q // base.nhead_k
        nhead_k = value // group if value % group == 0 and value >= group else value
        return replace(base, nhead_q=value, nhead_k=nhead_k, title=f"nhead={value}")
    if axis == "hdim":
        return replace(base, hdim_q=value, hdim_v=value, title=f"hdim={value}")
    raise ValueError(f"axis={axis!r} is not supported; accepted: {list(AXES)}")


def _check_text(validation: dict | None) -> str:
    if validation is None:
        return "not validated"
    if not validation["comparisons"]:
        return validation["scope"]
    worst = max(validation["comparisons"], key=lambda c: c["error"] / c["bound"] if c["bound"] else 0)
    verdict, relation = ("ok", "<=") if validation["ok"] else ("FAILED", ">")
    scope = "" if validation["scope"] == "all" else f" on {validation['scope']}"
    return f"{verdict}: {worst['name']} err {worst['error']:.2e} {relation} {worst['bound']:.2e}{scope}"


def sweep(axis: str, values: Sequence[int], base: RunSpec, device: str | torch.device, *,
          validate: bool = True, warmup: int | None = None, repeat: int | None = None,
          progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run, time and check one problem per value; one row per point.

    Row: axis, value, problem, kernel (the fwd config), why (the dispatcher's reason),
    time_ms, tflops, check (text), validation (dict or None), ok, error (an exception's
    first line: the point failed to run). A failing point never stops the sweep.
    """
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not supported; accepted: {list(AXES)}")
    if not values:
        raise ValueError("values is empty; give at least one value to sweep over")
    for value in values:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"sweep value {value!r} of {axis} must be an int >= 1")
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    warmup = warmup if warmup is not None else (0 if on_cpu else 3)
    repeat = repeat if repeat is not None else (1 if on_cpu else 10)
    rows = []
    for i, value in enumerate(values):
        spec = point(base, axis, value)
        if on_cpu and i == 0 and warmup == 0:  # the interpreter's first call pays its setup: untimed
            _cli().run_one(replace(spec, batch=1, nhead_q=spec.nhead_k, seqlen_q=min(spec.seqlen_q, 16),
                                   seqlen_k=min(spec.seqlen_k, 16)), device, warmup=0, repeat=1, check=False)
        row: dict[str, Any] = {"axis": axis, "value": value, "spec": asdict(spec), "device": str(device)}
        try:
            report = _cli().run_one(spec, device, warmup=warmup, repeat=repeat, check=validate)
        except Exception as e:  # report the point, go on with the sweep
            row.update(problem=spec.title, kernel=None, why=None, time_ms=None, tflops=None, validation=None,
                       check="error", ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0]}")
        else:
            fwd = report["plan"][0]
            row.update(problem=report["problem"], kernel=fwd["config"], why=fwd["why"],
                       time_ms=report["time_ms"], tflops=report["tflops"], validation=report["validation"],
                       check=_check_text(report["validation"]), ok=report["ok"], error=None)
        rows.append(row)
        if progress is not None:
            progress(f"{axis}={value}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


CSV_FIELDS = ("axis", "value", "problem", "kernel", "why", "time_ms", "tflops", "check", "ok", "error")


def write_csv(path: str | Path, rows: Sequence[dict], fields: Sequence[str] = CSV_FIELDS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key) for key in fields})


def write_json(path: str | Path, rows: Sequence[dict], settings: dict | None = None) -> None:
    from ..bench.suite import environment

    data = {"environment": environment(), "settings": settings or {}, "ok": all(r["ok"] for r in rows),
            "rows": list(rows)}
    Path(path).write_text(json.dumps(data, indent=2, default=str))


def plot(path: str | Path, rows: Sequence[dict], title: str = "") -> None:
    """TFLOP/s (GPU) or milliseconds (CPU) against the swept value; failed points in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = any(str(r["device"]).startswith("cuda") for r in rows)
    metric, label = ("tflops", "TFLOP/s") if on_gpu else ("time_ms", "ms (Triton interpreter)")
    fig, ax = plt.subplots(figsize=(7, 4))
    ran = [r for r in rows if r.get(metric) is not None]
    ax.plot([r["value"] for r in ran], [r[metric] for r in ran], marker="o", label="fmha")
    bad = [r for r in ran if not r["ok"]]
    if bad:
        ax.scatter([r["value"] for r in bad], [r[metric] for r in bad], color="red", zorder=3,
                   label="validation failed")
    for r in rows:
        if r.get(metric) is None:
            ax.axvline(r["value"], color="red", alpha=0.3)
    axis = rows[0]["axis"] if rows else ""
    if len({r["value"] for r in rows}) > 1 and max(r["value"] for r in rows) / min(r["value"] for r in rows) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(axis)
    ax.set_ylabel(label)
    ax.set_title(title or f"fmha sweep over {axis}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_table(rows: Sequence[dict]) -> Any:
    from rich.table import Table

    axis = rows[0]["axis"] if rows else "value"
    table = Table(title=f"fmha sweep over {axis}", title_justify="left")
    table.add_column(axis, justify="right")
    table.add_column("kernel (dispatcher's choice)", overflow="fold")
    table.add_column("ms", justify="right")
    on_gpu = any(str(r["device"]).startswith("cuda") for r in rows)
    if on_gpu:
        table.add_column("TFLOP/s", justify="right")
    table.add_column("check", overflow="fold")
    for r in rows:
        ms = "-" if r["time_ms"] is None else f"{r['time_ms']:.4g}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.4g}"
        check = r["check"] if r["error"] is None else r["error"]
        cells = [str(r["value"]), r["kernel"] or "-", ms] + ([tf] if on_gpu else []) + [check]
        table.add_row(*cells, style=None if r["ok"] else "red")
    return table


# ----------------------------------------------------------------------------------------
# Stress.


# Backward validation holds a few float64 (B, Hq, Sq, Sk) tensors: scope it below this many scores.
BACKWARD_MAX_SCORES = 2**25


def validate_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, *,
                      deterministic: bool = False, seed: int = 0) -> dict[str, Any]:
    """dq, dk, dv of `fmha.attention(q, k, v, **kwargs)` against a float64 truth (2x rule).

    A random dO (from `seed`); truth: `fmha.reference.attention_bwd` on the CPU, torch
    autograd through `numerics.torch_attention` in float64 on a GPU; baseline: the same
    autograd in the inputs' dtype. Bias, ALiBi slopes and sink logits are constants here
    (their gradients are not checked). Large problems are checked on batch 0 (then one
    KV-head group), as `fmha.cli.validate` does. Returns {"scope", "comparisons", "ok"}.
    """
    import numpy as np

    from .. import reference
    from ..api import attention
    from . import numerics

    want_mask = kwargs.get("dropout_p", 0) > 0
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    result = attention(*leaves, return_dropout_mask=want_mask, deterministic=deterministic, **kwargs)
    o, mask = (result[0], result[1]) if want_mask else (result, None)
    gen = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=q.device, dtype=torch.float32).to(o.dtype)
    ours = torch.autograd.grad(o, leaves, do)
    bhsd = kwargs["layout"] == "bhsd"
    qb, kb, vb, dob, *ours = (t.detach() if bhsd else t.detach().transpose(1, 2) for t in (q, k, v, do, *ours))
    bias, alibi, sinks = kwargs.get("bias"), kwargs.get("alibi_slopes"), kwargs.get("sinks")
    batch, nhead_q, seqlen_q, _ = qb.shape
    nhead_k, seqlen_k = kb.shape[1], kb.shape[2]
    scope = "all"

    def cut(t, b=None, h=None):
        return None if t is None else t[: b or t.shape[0], : h or t.shape[1]]

    if batch > 1 and batch * nhead_q * seqlen_q * seqlen_k > BACKWARD_MAX_SCORES:
        qb, kb, vb, dob, mask = (cut(t, 1) for t in (qb, kb, vb, dob, mask))
        ours = [cut(t, 1) for t in ours]
        bias = bias[:1] if bias is not None else None
        alibi = alibi[:1] if alibi is not None and alibi.dim() == 2 else alibi
        batch, scope = 1, "batch 0"
    if nhead_k > 1 and batch * nhead_q * seqlen_q * seqlen_k > BACKWARD_MAX_SCORES:
        g = nhead_q // nhead_k
        qb, dob, mask = (cut(t, None, g) for t in (qb, dob, mask))
        kb, vb = (cut(t, None, 1) for t in (kb, vb))
        ours = [cut(ours[0], None, g), cut(ours[1], None, 1), cut(ours[2], None, 1)]
        bias = bias[:, :g] if bias is not None and bias.shape[1] > 1 else bias
        alibi = alibi[..., :g] if alibi is not None else None
        sinks = sinks[:g] if sinks is not None else None
        nhead_q, scope = g, f"batch 0, query heads 0..{g - 1} (KV head 0)" if scope != "all" else \
            f"query heads 0..{g - 1} (KV head 0)"
    if batch * nhead_q * seqlen_q * seqlen_k > BACKWARD_MAX_SCORES:
        return {"scope": "skipped (problem too large to validate)", "comparisons": [], "ok": True}
    extra = {key: kwargs[key] for key in ("causal", "window", "mask_align", "sink_size", "softcap", "dropout_p")}
    tensors = {"bias": bias, "alibi_slopes": alibi, "sinks": sinks}
    names = ("dq", "dk", "dv")
    if q.device.type == "cpu":
        def np64(t):
            return t.detach().double().numpy()

        ref = reference.attention_bwd(np64(qb), np64(kb), np64(vb), np64(dob),
                                      dropout_mask=None if mask is None else mask.numpy(), **extra,
                                      **{key: np64(t) for key, t in tensors.items() if t is not None})
        truth = [torch.from_numpy(np.asarray(ref[n])) for n in names]
    else:
        leaves64 = [t.double().requires_grad_(True) for t in (qb, kb, vb)]
        o64, _ = numerics.torch_attention(*leaves64, compute_dtype=torch.float64, dropout_mask=mask, **extra,
                                          **tensors)
        truth = list(torch.autograd.grad(o64, leaves64, dob.double()))
    base_leaves = [t.clone().requires_grad_(True) for t in (qb, kb, vb)]
    with torch.enable_grad():
        base_o, _ = numerics.torch_attention(*base_leaves, dropout_mask=mask, **extra, **tensors)
        base = torch.autograd.grad(base_o, base_leaves, dob)
    comparisons = [numerics.compare(n, x, t, b, q.dtype) for n, x, t, b in zip(names, ours, truth, base, strict=True)]
    return {"scope": scope, "comparisons": comparisons, "ok": all(c.ok for c in comparisons)}


def random_spec(rng: random.Random, on_cpu: bool, index: int = 0) -> RunSpec:
    """A random problem: dtype, shapes (GQA), layout, masks, sink tokens, soft-cap,
    bias or ALiBi, sink logits, dropout and an input seed. Small on the CPU."""
    cli = _cli()
    dtype = rng.choice(["fp16", "bf16", "fp32"])
    if on_cpu:
        batch, nhead_k, group = rng.randint(1, 2), rng.randint(1, 2), rng.choice([1, 1, 2, 3])
        seqlen_q, seqlen_k = rng.choice([1, 7, 16, 23, 32, 40]), rng.choice([1, 9, 16, 31, 48])
        hdim_q = rng.choice([8, 16, 24, 32, 40, 64])
        hdim_v = hdim_q if rng.random() < 0.7 else rng.choice([8, 16, 32, 48])
    else:
        batch, nhead_k, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        seqlen_q = rng.choice([1, 17, 128, 255, 1024, 2048, 4001])
        seqlen_k = seqlen_q if rng.random() < 0.5 else rng.choice([1, 64, 513, 2048, 4096])
        hdim_q = rng.choice([32, 64, 80, 96, 128, 160, 192, 256])
        hdim_v = hdim_q if rng.random() < 0.8 else rng.choice([64, 128, 256])
    causal = rng.random() < 0.3
    window = (-1, -1)
    if not causal and rng.random() < 0.25:
        window = (rng.choice([-1, 0, 3, 16]), rng.choice([-1, 0, 5, 16]))
    masked = causal or window != (-1, -1)
    bias = rng.choice(["none", "none", "elementwise", "alibi"])
    return cli.RunSpec(
        title=f"case {index}", batch=batch, nhead_q=nhead_k * group, nhead_k=nhead_k, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, hdim_q=hdim_q, hdim_v=hdim_v, dtype=dtype, layout=rng.choice(["bhsd", "bshd"]),
        causal=causal, mask_align=rng.choice(["bottom_right", "top_left"]), window=window,
        sink_size=rng.choice([1, 4]) if masked and rng.random() < 0.3 else 0,
        softcap=rng.choice([5.0, 20.0, 50.0]) if rng.random() < 0.2 else 0.0, bias=bias,
        sinks=rng.random() < 0.2, dropout=rng.choice([0.1, 0.3]) if rng.random() < 0.2 else 0.0,
        seed=rng.randrange(2**31),
    )


def run_flags(spec: RunSpec) -> str:
    """The `fmha run` flags that rebuild the problem and inputs of `spec`."""
    flags = [f"-b {spec.batch}", f"--nhead-q {spec.nhead_q}", f"--nhead-k {spec.nhead_k}",
             f"--seqlen-q {spec.seqlen_q}", f"--seqlen-k {spec.seqlen_k}", f"--hdim-q {spec.hdim_q}",
             f"--hdim-v {spec.hdim_v}", f"--dtype {spec.dtype}", f"--layout {spec.layout}",
             f"--mask-align {spec.mask_align}", f"--seed {spec.seed}"]
    if spec.causal:
        flags.append("--causal")
    if tuple(spec.window) != (-1, -1):
        flags.append(f"--window {spec.window[0]} {spec.window[1]}")
    if spec.sink_size:
        flags.append(f"--sink-size {spec.sink_size}")
    if spec.softcap:
        flags.append(f"--softcap {spec.softcap:g}")
    if spec.bias != "none":
        flags.append(f"--bias {spec.bias}")
    if spec.sinks:
        flags.append("--sinks")
    if spec.dropout:
        flags.append(f"--dropout {spec.dropout:g}")
    return " ".join(flags)


def random_tile_config(rng: random.Random, spec: RunSpec, on_cpu: bool) -> Any:
    """A random valid `fwd` config (autofilled) that serves `spec`: block_m, block_n in
    16..128 (CPU: 16..64), warps 4 or 8, stages 1..3 (CPU: 1), its estimated shared memory
    within 160 KB on CUDA (room for a bias tile)."""
    from ..dispatch.autofill import autofill
    from ..dispatch.configs import shared_memory_estimate

    arch = "cpu" if on_cpu else "cuda"
    while True:
        if on_cpu:
            tile = f"m{rng.choice([16, 32, 64])}n{rng.choice([16, 32, 64])}w4s1"
        else:
            tile = (f"m{rng.choice([16, 32, 64, 128])}n{rng.choice([16, 32, 64, 128])}"
                    f"w{rng.choice([4, 8])}s{rng.choice([1, 2, 3])}")
        config = autofill(family="fwd", dtype=spec.dtype, head_dim=max(spec.hdim_q, spec.hdim_v), tile=tile,
                          arch=arch)
        if on_cpu or shared_memory_estimate(config) <= 160 * 1024:
            return config


def stress(count: int, seed: int, device: str | torch.device, *, time_budget: float | None = None,
           backward: bool = False, random_tiles: bool = False,
           progress: Callable[[str], None] | None = None) -> list[dict]:
    """Validate `count` random problems (from `seed`) against the float64 truth: the
    forward (o, lse), and with `backward` also dq, dk, dv (`validate_backward`; cases with
    an odd input seed ask for the deterministic backward). With `random_tiles`, each
    forward runs a random fwd config (`random_tile_config`) instead of the dispatcher's
    choice; on CUDA a config the GPU cannot launch (Triton's OutOfResources) makes the case
    "skipped", not failed. The problems do not depend on `backward` or `random_tiles`.

    Starts no new case after `time_budget` seconds (the first always runs; the rows say how
    many ran). Row:
    index, problem, kernel, flags (`fmha run` flags that reproduce it), check, ok, error,
    seconds.
    """
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"time_budget={time_budget} must be a number of seconds > 0 (or None: no limit)")
    cli = _cli()
    device = torch.device(device)
    rng = random.Random(seed)
    start = time.monotonic()
    rows = []
    for index in range(count):
        if index and time_budget is not None and time.monotonic() - start > time_budget:
            break  # the first case always runs
        spec = random_spec(rng, device.type == "cpu", index)
        row: dict[str, Any] = {"index": index, "spec": asdict(spec), "flags": run_flags(spec), "kernel": None,
                               "problem": None, "check": None, "validation": None, "ok": False, "error": None}
        t0 = time.monotonic()
        forced = contextlib.nullcontext()
        try:
            spec.check()
            if random_tiles:
                from ..bench.tuner import registry_forcing
                from ..dispatch.dispatcher import Dispatcher

                tile = random_tile_config(random.Random(spec.seed), spec, device.type == "cpu")
                forced = use_dispatcher(Dispatcher(registry_forcing(cli.get_dispatcher().registry, tile)))
            q, k, v, kwargs = cli._inputs(spec, device)
            problem = cli.problem_of(q, k, v, **kwargs)
            row["problem"] = problem.describe()
            with forced, torch.no_grad():
                row["kernel"] = cli.get_dispatcher().plan_forward(problem).config(cli.Family.FWD).name
                result = cli.validate(q, k, v, kwargs)
            comparisons = list(result["comparisons"])
            if backward:
                deterministic = spec.seed % 2 == 1
                row["deterministic"] = deterministic
                back = validate_backward(q, k, v, kwargs, deterministic=deterministic, seed=spec.seed)
                comparisons += back["comparisons"]
                result = {"scope": result["scope"] if back["scope"] == result["scope"] else
                          f"forward: {result['scope']}; backward: {back['scope']}", "ok": result["ok"] and back["ok"]}
            validation = {**{key: result[key] for key in ("scope", "ok")},
                          "comparisons": [{"name": c.name, "error": c.error, "bound": c.bound, "ok": c.ok}
                                          for c in comparisons]}
            row.update(validation=validation, check=_check_text(validation), ok=result["ok"])
        except Exception as e:  # a crash is a failure of this case, not of the run
            first = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
            if random_tiles and type(e).__name__ == "OutOfResources":
                row.update(check=f"skipped: the random config does not fit this GPU ({first})", ok=True, skipped=True)
            else:
                row.update(check="error", error=first)
        row["seconds"] = time.monotonic() - t0
        rows.append(row)
        if progress is not None:
            progress(f"case {index}: {'ok' if row['ok'] else 'FAILED'}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def stress_table(rows: Sequence[dict], failures_only: bool = False) -> Any:
    from rich.table import Table

    failed = sum(not r["ok"] for r in rows)
    skipped = sum(bool(r.get("skipped")) for r in rows)
    table = Table(title=f"fmha stress: {len(rows)} cases, {len(rows) - failed - skipped} ok, {failed} failed"
                        + (f", {skipped} skipped" if skipped else ""), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("problem", overflow="fold")
    table.add_column("kernel", overflow="fold")
    table.add_column("check", overflow="fold")
    table.add_column("s", justify="right")
    for r in rows:
        if failures_only and r["ok"]:
            continue
        table.add_row(str(r["index"]), r["problem"] or r["flags"], r["kernel"] or "-", r["error"] or r["check"],
                      f"{r['seconds']:.1f}", style=None if r["ok"] else "red")
    return table


__all__ = ["AXES", "DEFAULT_VALUES", "base_spec", "point", "sweep", "write_csv", "write_json", "plot",
           "sweep_table", "random_spec", "random_tile_config", "run_flags", "stress", "stress_table",
           "validate_backward"]
