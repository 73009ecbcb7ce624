"""The `fmha` command line: run, numerics, info, kernels (list/explain/build/export/import), bench.

    fmha run -b 2 --nhead-q 8 --seqlen-q 1024 --hdim-q 128 --dtype bf16 --causal
    fmha run --demo
    fmha numerics --causal --device cpu
    fmha info
    fmha kernels list --arch sm90
    fmha kernels explain --seqlen-q 4096 --hdim-q 128 --dtype bf16 --arch sm90
    fmha kernels build --arch sm90 --jobs 8
    fmha kernels export registry.json ; fmha kernels import registry.json
    fmha bench --suite quick --json bench.json
    fmha kernels autofill fwd fp16 d128 m128n64
    fmha sweep seqlen --causal --csv sweep.csv --plot sweep.png
    fmha stress --count 50 --seed 1 --time-budget 600
    fmha tune --profile flash_fwd --shapes 4x16x4096x128 4x16x4096x128:causal

Exit codes: 0 success; 1 a validation failed (`run`), a check of the study failed
(`numerics`), no kernel fits (`kernels explain`) or a config failed to build (`kernels
build`); 2 bad arguments, an error from fmha ("error: ..." on stderr, no traceback), a
refused registry file, or `bench` without a GPU. `sweep` and `stress` exit 1 when a point
or case fails its check; `tune` exits 2 without a GPU (unless --dry-run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import reference
from ..api import attention, get_dispatcher, problem_of
from ..bench import suite as bench
from ..bench import tuner
from ..dispatch import precompile, tuning
from ..dispatch.autofill import SPEC_FORMS, autofill_report
from ..dispatch.configs import (
    CPU,
    CUDA_ARCHS,
    KVCACHE_FAMILIES,
    ConfigError,
    Family,
    KernelConfig,
)
from ..dispatch.dispatcher import Dispatcher, NoKernelError
from ..dispatch.registry import PROFILES, Registry
from ..problem import DType, Feature, MaskAlign, Problem
from ..testing import numerics, numerics_study, sweeps

# Sizes `fmha run` / `fmha kernels explain` use for flags not given: small for the CPU
# interpreter, realistic on a GPU.
SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"batch": 1, "nhead_q": 2, "seqlen_q": 64, "hdim_q": 64},
    "cuda": {"batch": 2, "nhead_q": 8, "seqlen_q": 2048, "hdim_q": 128},
}
# Validation of a large problem runs on a subset of it (batch 0, then one KV-head group)
# so that the float64 truth of (B, Hq, Sq, Sk) scores stays under this many elements.
VALIDATION_MAX_SCORES = 2**28


# ----------------------------------------------------------------------------------------
# Problems from flags.


@dataclass(frozen=True)
class RunSpec:
    """One problem for `fmha run` (q (B, Hq, Sq, Dq), k (B, Hk, Sk, Dq), v (B, Hk, Sk, Dv))."""

    title: str
    batch: int
    nhead_q: int
    nhead_k: int
    seqlen_q: int
    seqlen_k: int
    hdim_q: int
    hdim_v: int
    dtype: str = "fp16"
    layout: str = "bhsd"
    causal: bool = False
    mask_align: str = "bottom_right"
    window: tuple[int, int] = (-1, -1)
    sink_size: int = 0
    softcap: float = 0.0
    bias: str = "none"  # "none", "elementwise" or "alibi"
    sinks: bool = False
    dropout: float = 0.0
    seed: int = 0

    def check(self) -> None:
        """ValueError for combinations the flags alone cannot refuse."""
        if self.nhead_q % self.nhead_k:
            raise ValueError(f"--nhead-q {self.nhead_q} is not a multiple of --nhead-k {self.nhead_k}")

    def problem(self, arch: str) -> Problem:
        """The Problem the API would build for these inputs on `arch` (dense, row-major v)."""
        self.check()
        window = (self.window[0], 0) if self.causal else tuple(self.window)
        return Problem(
            batch=self.batch, nhead_q=self.nhead_q, nhead_k=self.nhead_k, seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k, head_dim_qk=self.hdim_q, head_dim_v=self.hdim_v,
            dtype=DType(self.dtype), layout=self.layout, arch=arch, causal=self.causal, window=window,
            mask_align=MaskAlign(self.mask_align), sink_size=self.sink_size,
            bias=self.bias == "elementwise", alibi=self.bias == "alibi", softcap=float(self.softcap),
            sinks=self.sinks, dropout_p=float(self.dropout),
        )


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be >= {lo}")
        return value

    parse.__name__ = f"int>={lo}"
    return parse


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def _probability(text: str) -> float:
    value = _nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1)")
    return value


def _add_problem_flags(p: argparse.ArgumentParser) -> None:
    cpu, cuda = SIZE_DEFAULTS["cpu"], SIZE_DEFAULTS["cuda"]

    def sized(key: str) -> str:
        return f"(default {cuda[key]} on CUDA, {cpu[key]} on the CPU)"

    g = p.add_argument_group("problem")
    g.add_argument("-b", "--batch", type=_int_at_least(1), default=None, help=f"batch {sized('batch')}")
    g.add_argument("--nhead-q", type=_int_at_least(1), default=None, help=f"query heads {sized('nhead_q')}")
    g.add_argument("--nhead-k", type=_int_at_least(1), default=None, help="key/value heads (default nhead-q)")
    g.add_argument("--seqlen-q", type=_int_at_least(0), default=None,
                   help=f"query length {sized('seqlen_q')}")
    g.add_argument("--seqlen-k", type=_int_at_least(0), default=None, help="key length (default seqlen-q)")
    g.add_argument("--hdim-q", type=_int_at_least(1), default=None, help=f"q/k head dim {sized('hdim_q')}")
    g.add_argument("--hdim-v", type=_int_at_least(1), default=None, help="v head dim (default hdim-q)")
    g.add_argument("--dtype", choices=list(bench.DTYPES), default="fp16")
    g.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd")
    g.add_argument("--causal", action="store_true", help="causal mask (window (left, 0))")
    g.add_argument("--mask-align", choices=[m.value for m in MaskAlign], default="bottom_right",
                   help="diagonal of causal/window masks (top_left is SDPA's is_causal)")
    g.add_argument("--window", nargs=2, type=_int_at_least(-1), metavar=("LEFT", "RIGHT"), default=(-1, -1),
                   help="sliding window, -1 unbounded")
    g.add_argument("--sink-size", type=_int_at_least(0), default=0, help="first keys always visible")
    g.add_argument("--softcap", type=_nonneg_float, default=0.0, help="soft-cap of the logits (0: off)")
    g.add_argument("--bias", choices=["none", "elementwise", "alibi"], default="none",
                   help="elementwise: random fp32 (1, Hq, Sq, Sk); alibi: slopes 2^(-8(h+1)/Hq)")
    g.add_argument("--sinks", action="store_true", help="random fp32 per-head sink logits")
    g.add_argument("--dropout", type=_probability, default=0.0, metavar="P", help="dropout probability")
    g.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the inputs and of dropout")


def _spec_from_args(args: argparse.Namespace, on_cpu: bool, title: str = "fmha run") -> RunSpec:
    d = SIZE_DEFAULTS["cpu" if on_cpu else "cuda"]
    batch = args.batch if args.batch is not None else d["batch"]
    nhead_q = args.nhead_q if args.nhead_q is not None else d["nhead_q"]
    seqlen_q = args.seqlen_q if args.seqlen_q is not None else d["seqlen_q"]
    hdim_q = args.hdim_q if args.hdim_q is not None else d["hdim_q"]
    return RunSpec(
        title=title, batch=batch, nhead_q=nhead_q,
        nhead_k=args.nhead_k if args.nhead_k is not None else nhead_q,
        seqlen_q=seqlen_q, seqlen_k=args.seqlen_k if args.seqlen_k is not None else seqlen_q,
        hdim_q=hdim_q, hdim_v=args.hdim_v if args.hdim_v is not None else hdim_q,
        dtype=args.dtype, layout=args.layout, causal=args.causal, mask_align=args.mask_align,
        window=tuple(args.window), sink_size=args.sink_size, softcap=args.softcap, bias=args.bias,
        sinks=args.sinks, dropout=args.dropout, seed=args.seed,
    )


def demo_specs(on_cpu: bool, seed: int = 0) -> list[RunSpec]:
    """`fmha run --demo`: plain; causal GQA in bshd; window + soft-cap + sinks + sink tokens.

    Small on the CPU (the interpreter), realistic on a GPU.
    """
    if on_cpu:
        return [
            RunSpec("plain", 1, 2, 2, 64, 64, 64, 64, "fp16", seed=seed),
            RunSpec("causal GQA, bshd", 1, 4, 2, 48, 64, 32, 32, "fp16", layout="bshd", causal=True,
                    seed=seed),
            RunSpec("window + softcap + sinks", 1, 2, 2, 64, 64, 64, 64, "fp16", window=(16, 4), sink_size=4,
                    softcap=20.0, sinks=True, seed=seed),
        ]
    return [
        RunSpec("plain", 4, 16, 16, 4096, 4096, 128, 128, "bf16", seed=seed),
        RunSpec("causal GQA, bshd", 4, 32, 8, 4096, 4096, 128, 128, "bf16", layout="bshd", causal=True,
                seed=seed),
        RunSpec("window + softcap + sinks", 2, 16, 16, 4096, 4096, 128, 128, "bf16", window=(1024, 0),
                sink_size=4, softcap=30.0, sinks=True, seed=seed),
    ]


# ----------------------------------------------------------------------------------------
# `fmha run`.


def _inputs(spec: RunSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Random normal q, k, v in the spec's layout and the keyword arguments of the call."""
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    dtype = bench.DTYPES[spec.dtype]

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    def shaped(h: int, s: int, d: int) -> tuple[int, ...]:
        return (spec.batch, h, s, d) if spec.layout == "bhsd" else (spec.batch, s, h, d)

    q = randn(*shaped(spec.nhead_q, spec.seqlen_q, spec.hdim_q))
    k = randn(*shaped(spec.nhead_k, spec.seqlen_k, spec.hdim_q))
    v = randn(*shaped(spec.nhead_k, spec.seqlen_k, spec.hdim_v))
    kwargs: dict[str, Any] = dict(
        layout=spec.layout, causal=spec.causal, window=tuple(spec.window), mask_align=spec.mask_align,
        sink_size=spec.sink_size, softcap=spec.softcap, dropout_p=spec.dropout, seed=spec.seed,
    )
    if spec.bias == "elementwise":
        kwargs["bias"] = randn(1, spec.nhead_q, spec.seqlen_q, spec.seqlen_k, dt=torch.float32)
    elif spec.bias == "alibi":
        kwargs["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / spec.nhead_q)
                                               for h in range(spec.nhead_q)], device=device)
    if spec.sinks:
        kwargs["sinks"] = randn(spec.nhead_q, dt=torch.float32)
    return q, k, v, kwargs


def _to_np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().double().cpu().numpy()


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> dict[str, Any]:
    """Check `fmha.attention(q, k, v, **kwargs)` against a float64 truth (2x rule).

    Truth: `fmha.reference` (numpy) on the CPU, `numerics.torch_attention` in float64 on a
    GPU; baseline: `numerics.torch_attention` in the inputs' dtype. Large problems are
    checked on batch 0 (and one KV-head group) only; "scope" says which part.
    Returns {"truth", "baseline", "scope", "comparisons": [Comparison], "ok"}.
    """
    want_mask = kwargs.get("dropout_p", 0) > 0
    o, lse, *rest = attention(q, k, v, return_lse=True, return_dropout_mask=want_mask, **kwargs)
    mask = rest[0] if want_mask else None
    bhsd = kwargs["layout"] == "bhsd"
    qb, kb, vb, ob = (t if bhsd else t.transpose(1, 2) for t in (q, k, v, o))
    bias, alibi, sinks = kwargs.get("bias"), kwargs.get("alibi_slopes"), kwargs.get("sinks")
    batch, nhead_q, seqlen_q, _ = qb.shape
    nhead_k, seqlen_k = kb.shape[1], kb.shape[2]
    scope = "all"
    if batch > 1 and batch * nhead_q * seqlen_q * seqlen_k > VALIDATION_MAX_SCORES:
        qb, kb, vb, ob, lse = qb[:1], kb[:1], vb[:1], ob[:1], lse[:1]
        bias = bias[:1] if bias is not None else None
        alibi = alibi[:1] if alibi is not None and alibi.dim() == 2 else alibi
        mask = mask[:1] if mask is not None else None
        batch, scope = 1, "batch 0"
    if nhead_k > 1 and nhead_q * seqlen_q * seqlen_k > VALIDATION_MAX_SCORES:
        g = nhead_q // nhead_k
        qb, kb, vb, ob, lse = qb[:, :g], kb[:, :1], vb[:, :1], ob[:, :g], lse[:, :g]
        bias = bias[:, :g] if bias is not None and bias.shape[1] > 1 else bias
        alibi = alibi[..., :g] if alibi is not None else None
        sinks = sinks[:g] if sinks is not None else None
        mask = mask[:, :g] if mask is not None else None
        nhead_q, scope = g, f"batch 0, query heads 0..{g - 1} (KV head 0)"
    if batch * nhead_q * seqlen_q * seqlen_k > VALIDATION_MAX_SCORES:
        return {"truth": None, "baseline": None, "scope": "skipped (problem too large to validate)",
                "comparisons": [], "ok": True}
    extra = {key: kwargs[key]
             for key in ("causal", "window", "mask_align", "sink_size", "softcap", "dropout_p")}
    tensors = {"bias": bias, "alibi_slopes": alibi, "sinks": sinks}
    if q.device.type == "cpu":
        truth = "fmha.reference (numpy float64)"
        ref_o, ref_lse = reference.attention_fwd(
            _to_np(qb), _to_np(kb), _to_np(vb), dropout_mask=None if mask is None else mask.cpu().numpy(),
            **extra, **{key: _to_np(t) for key, t in tensors.items() if t is not None})
        ref_o, ref_lse = torch.from_numpy(np.asarray(ref_o)), torch.from_numpy(np.asarray(ref_lse))
    else:
        truth = "numerics.torch_attention (float64, on the GPU)"
        ref_o, ref_lse = numerics.torch_attention(qb, kb, vb, compute_dtype=torch.float64,
                                                  dropout_mask=mask, **extra, **tensors)
    base_o, base_lse = numerics.torch_attention(qb, kb, vb, dropout_mask=mask, **extra, **tensors)
    comparisons = [numerics.compare("o", ob, ref_o, base_o, q.dtype),
                   numerics.compare("lse", lse, ref_lse, base_lse, torch.float32)]
    return {"truth": truth, "baseline": f"numerics.torch_attention ({str(q.dtype).removeprefix('torch.')})",
            "scope": scope, "comparisons": comparisons, "ok": all(c.ok for c in comparisons)}


def run_one(spec: RunSpec, device: torch.device, *, warmup: int, repeat: int, check: bool) -> dict[str, Any]:
    """Run, time and (if `check`) validate one problem; a JSON-ready report."""
    spec.check()
    q, k, v, kwargs = _inputs(spec, device)
    problem = problem_of(q, k, v, **kwargs)
    plan = get_dispatcher().plan_forward(problem)
    with torch.no_grad():
        elapsed = bench.time_ms(lambda: attention(q, k, v, **kwargs), device=device, warmup=warmup,
                                repeat=repeat)
        result = validate(q, k, v, kwargs) if check else None
    report: dict[str, Any] = {
        "title": spec.title, "device": str(device), "problem": problem.describe(),
        "problem_fields": asdict(problem), "flops": problem.flops_fwd(),
        "plan": [{"family": launch.family.value, "config": launch.config.name, "why": launch.why}
                 for launch in plan.launches],
        "kernel": plan.config(Family.FWD).name, "time_ms": elapsed,
        "tflops": problem.flops_fwd() / (elapsed * 1e-3) / 1e12 if elapsed > 0 else None,
        "warmup": warmup, "repeat": repeat, "validation": None, "ok": True,
    }
    if result is not None:
        report["validation"] = {
            **{key: result[key] for key in ("truth", "baseline", "scope", "ok")},
            "comparisons": [{"name": c.name, "error": c.error, "baseline_error": c.baseline_error,
                             "bound": c.bound, "ok": c.ok, "text": str(c)} for c in result["comparisons"]],
        }
        report["ok"] = result["ok"]
    return report


def _render_report(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=report["title"], show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("problem", report["problem"])
    table.add_row("device", report["device"])
    table.add_row("plan", "\n".join(f"{i + 1}. {p['family']}: {p['config']} ({p['why']})"
                                    for i, p in enumerate(report["plan"])))
    table.add_row("time", f"{report['time_ms']:.3f} ms (median of {report['repeat']}, "
                          f"{report['warmup']} warmup)")
    tflops = report["tflops"]
    table.add_row("TFLOP/s", "-" if tflops is None else f"{tflops:.4g}  ({report['flops']:.4g} FLOP)")
    val = report["validation"]
    if val is None:
        table.add_row("validation", "skipped (--no-validate)")
    else:
        table.add_row("truth", f"{val['truth']}; scope: {val['scope']}")
        table.add_row("baseline", f"{val['baseline']}; bound = 2 x baseline error + slack")
        for c in val["comparisons"]:
            table.add_row(f"check {c['name']}", c["text"], style=None if c["ok"] else "red")
        table.add_row("verdict", "ok" if val["ok"] else "FAILED", style="green" if val["ok"] else "red")
    return table


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available (torch.cuda.is_available() "
                         "is False); use --device cpu or auto")
    return torch.device(choice)


def _cmd_run(args: argparse.Namespace, console: Any) -> int:
    device = _device(args.device)
    on_cpu = device.type == "cpu"
    specs = demo_specs(on_cpu, args.seed) if args.demo else [_spec_from_args(args, on_cpu)]
    warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 3)
    repeat = args.repeat if args.repeat is not None else (2 if on_cpu else 20)
    reports = []
    for spec in specs:
        reports.append(run_one(spec, device, warmup=warmup, repeat=repeat, check=not args.no_validate))
        if not args.json:
            console.print(_render_report(reports[-1]))
    ok = all(r["ok"] for r in reports)
    if args.json:
        print(json.dumps({"ok": ok, "device": str(device), "results": reports}, indent=2, default=str))
    elif not ok:
        console.print("validation FAILED", style="red")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------
# `fmha info`.


def current_arch() -> str:
    """"sm90" etc. for the current CUDA device, "cpu" without CUDA."""
    if not torch.cuda.is_available():
        return CPU
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def _triton_cache_dir() -> str:
    return precompile.triton_cache_dir()


def info() -> dict[str, Any]:
    """Device, arch and versions, as `fmha info` prints them."""
    import ml_dtypes
    import triton

    from .. import __version__

    data: dict[str, Any] = {}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        data["device"] = torch.cuda.get_device_name()
        data["arch"] = current_arch()
        data["memory"] = f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"
    else:
        data["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        data["arch"] = "cpu (Triton interpreter)"
    numpy_ok = tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 3)
    data.update({
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "numpy": np.__version__ + ("" if numpy_ok else " (the CPU interpreter needs numpy < 2.3)"),
        "ml_dtypes": ml_dtypes.__version__, "fmha": __version__,
        "CUDA": torch.version.cuda or "none (CPU build of torch)",
        "cuDNN": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "triton cache": _triton_cache_dir(),
        "FMHA_DEBUG": os.environ.get("FMHA_DEBUG", "0"),
    })
    return data


def _cmd_info(args: argparse.Namespace, console: Any) -> int:
    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.table import Table

    table = Table(title="fmha info", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in data.items():
        table.add_row(key, str(value))
    console.print(table)
    return 0


# ----------------------------------------------------------------------------------------
# `fmha kernels ...`.


def _registry(args: argparse.Namespace) -> Registry:
    path = getattr(args, "registry", None)
    registry = get_dispatcher().registry if path is None else _load_registry(path)
    profile = getattr(args, "profile", None)
    return registry if profile is None else registry.profile(profile)


def _load_registry(path: str) -> Registry:
    """Registry.load, with every way a file can be bad turned into a ConfigError."""
    try:
        return Registry.load(path)
    except ConfigError as e:
        raise ConfigError(f"registry file {path} is refused: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read registry file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"registry file {path} is refused: malformed ({type(e).__name__}: {e})") from None


def _archs_text(archs: Sequence[str]) -> str:
    return "cuda (all)" if tuple(archs) == CUDA_ARCHS else ",".join(archs)


def _config_row(c: KernelConfig) -> list[str]:
    s, a = c.signature, c.algorithm
    return [c.name, c.family.value, ",".join(d.value for d in s.dtypes), f"{s.head_dim_min}-{s.head_dim_max}",
            _archs_text(s.archs), f"{a.block_m}x{a.block_n}", str(a.num_warps), str(a.num_stages)]


def _cmd_kernels_list(args: argparse.Namespace, console: Any) -> int:
    registry = _registry(args)
    family = Family(args.family) if args.family else None
    dtype = DType(args.dtype) if args.dtype else None
    configs = list(registry.filter(arch=args.arch, family=family, dtype=dtype))
    if args.json:
        print(json.dumps([c.to_dict() for c in configs], indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"registry {registry.name!r}: {len(configs)} of {len(registry)} configs")
    table.add_column("name", no_wrap=True)
    for column in ("family", "dtypes", "head dims", "archs", "tile (MxN)", "warps", "stages"):
        table.add_column(column, overflow="fold")
    for c in configs:
        table.add_row(*_config_row(c))
    console.print(table)
    return 0


def _cmd_kernels_explain(args: argparse.Namespace, console: Any) -> int:
    arch = args.arch or current_arch()
    problem = _spec_from_args(args, arch == CPU, title="explain").problem(arch)
    family = Family(args.family)
    if family in KVCACHE_FAMILIES:  # as attention_with_kvcache builds it: bshd, key counts on the device
        problem = problem.with_(layout="bshd", seqused_k=True, paged_kv=args.paged_kv, kv_fp8=args.fp8_kv_cache)
    elif args.paged_kv or args.fp8_kv_cache:
        raise ValueError(f"--paged-kv and --fp8-kv-cache describe a KV cache: use them with a KV-cache --family "
                         f"({', '.join(sorted(f.value for f in KVCACHE_FAMILIES))}), not {family.value}")
    dispatcher = Dispatcher(_registry(args)) if args.registry else get_dispatcher()
    console.print(dispatcher.explain(problem, family), soft_wrap=True)
    try:
        dispatcher.select(problem, family)
    except NoKernelError:
        return 1
    return 0


def _statistics_text(registry: Registry) -> str:
    lines = [f"registry {registry.name!r}: {len(registry)} configs"]
    for key, counts in registry.statistics().items():
        lines.append(f"  {key}: " + ", ".join(f"{name}={n}" for name, n in sorted(counts.items())))
    return "\n".join(lines)


def _cmd_kernels_export(args: argparse.Namespace, console: Any) -> int:
    registry = _registry(args)
    try:
        Path(args.file).write_text(registry.to_json())
    except OSError as e:
        raise ConfigError(f"cannot write {args.file}: {e.strerror or e}") from None
    console.print(f"wrote {args.file}", soft_wrap=True)
    console.print(_statistics_text(registry), soft_wrap=True)
    return 0


def _cmd_kernels_import(args: argparse.Namespace, console: Any) -> int:
    registry = _load_registry(args.file)
    console.print(f"{args.file}: valid", soft_wrap=True)
    console.print(_statistics_text(registry), soft_wrap=True)
    for c in registry:
        console.print(f"  {c.name}", soft_wrap=True)
    return 0


# ----------------------------------------------------------------------------------------
# `fmha numerics`.


def _cmd_numerics(args: argparse.Namespace, console: Any) -> int:
    result = numerics_study.run_study(
        batch=args.batch, nhead_q=args.nhead_q, nhead_k=args.nhead_k, seqlen_q=args.seqlen_q,
        seqlen_k=args.seqlen_k, hdim_q=args.hdim_q, hdim_v=args.hdim_v, causal=args.causal,
        device=args.device, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for table in numerics_study.render(result):
            console.print(table)
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------------
# `fmha kernels build`.


def _cmd_kernels_build(args: argparse.Namespace, console: Any) -> int:
    registry = _registry(args)
    arch = args.arch or precompile.current_arch()
    results = precompile.build(registry, arch, families=args.family, dtypes=args.dtype, jobs=args.jobs,
                               progress=not args.no_progress and not args.json, record_path=args.record,
                               timeout=args.timeout)
    counts = {status: sum(r.status == status for r in results)
              for status in ("built", "cached", "failed", "skipped")}
    ok = counts["failed"] == 0
    if args.json:
        print(json.dumps({"ok": ok, "arch": arch, "counts": counts,
                          "record": str(args.record or precompile.default_record_path()),
                          "results": [r.to_dict() for r in results]}, indent=2))
        return 0 if ok else 1
    from rich.table import Table

    limit = results[0].shared_limit if results else precompile.shared_memory_limit(arch)
    table = Table(title=f"fmha kernels build: registry {registry.name!r} for {arch} "
                        f"(shared memory limit {limit} bytes)", title_justify="left")
    table.add_column("config", no_wrap=True)
    table.add_column("dtype")
    table.add_column("status")
    table.add_column("shared (bytes)", justify="right")
    table.add_column("compile s", justify="right")
    table.add_column("message", overflow="fold")
    styles = {"built": "green", "cached": None, "failed": "red", "skipped": "yellow"}
    for r in results:
        shared = "-" if r.shared is None else str(r.shared)
        seconds = "-" if r.status in ("cached", "skipped") else f"{r.seconds:.1f}"
        message = r.message.split(": ", 1)[-1] if r.status == "skipped" else r.message
        table.add_row(r.config, r.dtype, r.status, shared, seconds, message, style=styles[r.status])
    console.print(table)
    console.print(", ".join(f"{n} {status}" for status, n in counts.items()) +
                  f"; record: {args.record or precompile.default_record_path()}", soft_wrap=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------
# `fmha kernels autofill`.


def _cmd_kernels_autofill(args: argparse.Namespace, console: Any) -> int:
    config, sources = autofill_report(
        " ".join(args.spec) or None, family=args.family, dtype=args.dtype, head_dim=args.hdim, tile=args.tile,
        arch=args.arch, num_warps=args.warps, num_stages=args.stages, features=args.features,
        registry=_registry(args) if args.registry else None)
    print(json.dumps({**config.to_dict(), "filled": sources}, indent=2))
    if args.out:
        try:
            Registry([config], name="autofill").save(args.out)
        except OSError as e:
            raise ConfigError(f"cannot write {args.out}: {e.strerror or e}") from None
        print(f"wrote {args.out} (a registry of this one config)", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------
# `fmha sweep`, `fmha stress` and `fmha tune`: the end of each.


def _finish(console: Any, table: Any, *, ok: bool, notes: Sequence[tuple[str, str | None, bool]] = (),
            outputs: Sequence[tuple[str | None, Callable[[str], None] | dict]] = (),
            summary: tuple[str, str | None] | None = None) -> int:
    """Print `table`, then each note (text, style, soft_wrap); write each output whose path is
    given (a dict is written as indented JSON, else called with the path) and say "wrote
    PATH"; print the summary line (text, style). Returns the exit code: 0 if `ok`, else 1."""
    console.print(table)
    for text, style, soft_wrap in notes:
        console.print(text, style=style, soft_wrap=soft_wrap)
    for path, write in outputs:
        if path:
            if isinstance(write, dict):
                Path(path).write_text(json.dumps(write, indent=2, default=str))
            else:
                write(path)
            console.print(f"wrote {path}", soft_wrap=True)
    if summary is not None:
        console.print(summary[0], style=summary[1])
    return 0 if ok else 1


def _cmd_sweep(args: argparse.Namespace, console: Any) -> int:
    device = _device(args.device)
    on_cpu = device.type == "cpu"
    base = _spec_from_args(args, on_cpu, title="sweep")
    values = args.values or list(sweeps.DEFAULT_VALUES["cpu" if on_cpu else "cuda"][args.axis])
    from rich.progress import Progress

    with Progress(console=console, disable=args.no_progress, transient=True) as bar:
        task = bar.add_task(f"sweep {args.axis}", total=len(values))
        rows = sweeps.sweep(args.axis, values, base, device, validate=not args.no_validate, warmup=args.warmup,
                            repeat=args.repeat, progress=lambda text: bar.update(task, advance=1, description=text))
    settings = {"axis": args.axis, "values": values, "base": asdict(base), "device": str(device),
                "validate": not args.no_validate}
    failed = [r for r in rows if not r["ok"]]
    return _finish(console, sweeps.sweep_table(rows), ok=not failed,
                   outputs=[(args.csv, lambda p: sweeps.write_csv(p, rows)),
                            (args.json, lambda p: sweeps.write_json(p, rows, settings)),
                            (args.plot, lambda p: sweeps.plot(p, rows))],
                   summary=(f"{len(failed)} of {len(rows)} points FAILED", "red") if failed else None)


def _cmd_stress(args: argparse.Namespace, console: Any) -> int:
    device = _device(args.device)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("stress", total=args.count)
        rows = sweeps.stress(args.count, args.seed, device, time_budget=args.time_budget, backward=args.backward,
                             random_tiles=args.random_tiles,
                             progress=lambda text: bar.update(task, advance=1, description=text))
    failed = [r for r in rows if not r["ok"]]
    notes = []
    if len(rows) < args.count:
        notes.append((f"time budget of {args.time_budget:g} s reached: {len(rows)} of {args.count} cases ran",
                      None, False))
    notes += [(f"case {r['index']} FAILED ({r['error'] or r['check']}); the forward of it: "
               f"fmha run --device {device.type} {r['flags']}", "red", True) for r in failed]
    return _finish(console, sweeps.stress_table(rows, failures_only=args.failures_only), ok=not failed,
                   notes=notes,
                   outputs=[(args.json, {"ok": not failed, "seed": args.seed, "count": args.count, "ran": len(rows),
                                         "device": str(device), "rows": rows})],
                   summary=(f"stress (seed {args.seed}): {len(rows) - len(failed)} of {len(rows)} cases ok",
                            "red" if failed else "green"))


# ----------------------------------------------------------------------------------------
# `fmha tune`.


def _tune_shape(text: str) -> tuple[int, int, int, int, int, bool]:
    """"BxHxSxD" or "BxHqxHkxSxD", optionally ":causal" -> (B, Hq, Hk, S, D, causal)."""
    body, _, suffix = text.partition(":")
    try:
        numbers = [int(x) for x in body.lower().split("x")]
    except ValueError:
        numbers = []
    if len(numbers) not in (4, 5) or min(numbers, default=0) < 1 or suffix not in ("", "causal"):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BxHxSxD or BxHqxHkxSxD with an optional "
                                         f"':causal' (e.g. 4x16x4096x128:causal)")
    if len(numbers) == 4:
        numbers.insert(2, numbers[1])
    b, hq, hk, seqlen, d = numbers
    if hq % hk:
        raise argparse.ArgumentTypeError(f"shape {text!r}: Hq={hq} is not a multiple of Hk={hk}")
    return b, hq, hk, seqlen, d, suffix == "causal"


TUNE_DEFAULT_SHAPES = tuple(f"{16384 // s}x16x{s}x{d}{c}" for d in (64, 128, 256) for s in (1024, 4096, 16384)
                            for c in ("", ":causal"))


def _cmd_tune(args: argparse.Namespace, console: Any) -> int:
    registry = _registry(args)
    if args.family:
        families = [Family(f) for f in args.family]
    else:
        profile_families = PROFILES[args.profile or "flash_fwd"][0]
        families = [f for f in tuner.TUNABLE_FAMILIES if profile_families is None or f in profile_families]
    if not families:
        raise ValueError(f"profile {args.profile!r} has no tunable family; tunable: "
                         f"{[f.value for f in tuner.TUNABLE_FAMILIES]}")
    arch = args.arch or (current_arch() if torch.cuda.is_available() else precompile.DEFAULT_ARCH)
    shapes = args.shapes or [_tune_shape(s) for s in TUNE_DEFAULT_SHAPES]
    problems = [Problem(b, hq, hk, seqlen, seqlen, d, d, dtype=DType(dtype), arch=arch, causal=causal,
                        window=(-1, 0) if causal else (-1, -1), deterministic=args.deterministic)
                for dtype in args.dtype for b, hq, hk, seqlen, d, causal in shapes]
    db = tuning.TuningDB(args.db)
    plan = [(p, f, tuner.candidates(registry, p, f)) for p in problems for f in families
            if f != Family.BWD_DQ or p.deterministic]
    if args.dry_run:
        for problem, family, configs in plan:
            console.print(f"{family.value} {problem.describe()}: {len(configs)} candidate(s)", soft_wrap=True)
            for c in configs:
                console.print(f"    {c.name}", soft_wrap=True)
        console.print(f"{len(plan)} (problem, family) pairs, {sum(len(c) for _, _, c in plan)} timings; "
                      f"DB {db.path} (not written: --dry-run)", soft_wrap=True)
        return 0
    if not torch.cuda.is_available():
        print("error: fmha tune needs a CUDA GPU (torch.cuda.is_available() is False): it times kernels, and "
              "the CPU interpreter's timings mean nothing for a GPU. Use `fmha tune --dry-run` to list the "
              "problems and candidates.", file=sys.stderr)
        return 2
    if arch != current_arch():
        raise ValueError(f"--arch {arch} is not this GPU's arch ({current_arch()}): tuning times this GPU")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.no_progress) as bar:
        task = bar.add_task("tune", total=sum(len(c) for _, _, c in plan))
        results = tuner.tune(problems, families, registry=registry, db=db,
                              timer=tuner.gpu_timer(args.warmup_ms, args.rep_ms),
                              progress=lambda n, text: bar.update(task, advance=n, description=text[:80]))
    from rich.table import Table

    table = Table(title=f"fmha tune on {tuning.device_name(arch)}: DB {db.path}", title_justify="left")
    for column in ("family", "problem", "chosen", "ms", "candidates (ms)"):
        table.add_column(column, overflow="fold")
    for r in results:
        chosen_ms = r.timings_ms.get(r.chosen) if r.chosen else None
        others = ", ".join(f"{n.split('_triton_')[-1]}={'failed' if t is None else f'{t:.4g}'}"
                           for n, t in r.timings_ms.items())
        table.add_row(r.family.value, r.problem.describe(), r.chosen or "none ran",
                      "-" if chosen_ms is None else f"{chosen_ms:.4g}", others,
                      style=None if r.chosen else "red")
    return _finish(console, table, ok=all(r.chosen for r in results),
                   notes=[(f"{name} failed on {r.problem.describe()}: {error}", None, True)
                          for r in results for name, error in r.errors.items()],
                   outputs=[(args.json, {"gpu": tuning.device_name(arch), "db": str(db.path),
                                         "results": [r.to_dict() for r in results]})])


# ----------------------------------------------------------------------------------------
# The parser and main.


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `fmha` (each subcommand sets `func`)."""
    parser = argparse.ArgumentParser(prog="fmha", description="Fused multi-head attention kernels (Triton) "
                                     "with a CK-style kernel dispatcher.")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run, time and validate one problem (or --demo)",
                       description="Run fmha.attention on random normal inputs, time it and check it "
                                   "against a float64 truth. Exit code 1 if the check fails.")
    _add_problem_flags(p)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-validate", action="store_true", help="skip the check against float64")
    p.add_argument("--repeat", type=_int_at_least(1), default=None, help="timed calls (default 20 on "
                   "CUDA, 2 on the CPU)")
    p.add_argument("--warmup", type=_int_at_least(0), default=None, help="untimed calls first (default 3 "
                   "on CUDA, 1 on the CPU)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--demo", action="store_true", help="three fixed problems (small on the CPU); "
                   "problem flags are ignored")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("numerics", help="fp16 vs bf16 study: input quantization, CK's tolerance check of "
                       "o/dq/dk/dv, fp16 vs bf16",
                       description="The study of CK's bf16 backward example. On float64 random normal "
                       "Q, K, V, dO: (a) the error of rounding them to fp16 and bf16; (b) fmha.attention "
                       "forward + backward in each dtype against fmha.reference in float64 on the rounded "
                       "inputs, checked as CK does (allclose with rtol = atol = 1.6e-2 for fp16, 2.0e-2 for "
                       "bf16, 3.2e-2 for bf16 above head dim 128: |x - ref| <= atol + rtol * |ref| for every "
                       "element of o, dq, dk, dv); (c) fp16 vs bf16. Exit code 1 if any check fails.")
    g = p.add_argument_group("problem")
    cpu, cuda = numerics_study.STUDY_DEFAULTS["cpu"], numerics_study.STUDY_DEFAULTS["cuda"]

    def study_default(key: str) -> str:
        return f"(default {cpu[key]} on the CPU, {cuda[key]} on CUDA)"

    g.add_argument("-b", "--batch", type=_int_at_least(1), default=None,
                   help=f"batch {study_default('batch')}")
    g.add_argument("--nhead-q", type=_int_at_least(1), default=None,
                   help=f"query heads {study_default('nhead_q')}")
    g.add_argument("--nhead-k", type=_int_at_least(1), default=None, help="key/value heads (default nhead-q)")
    g.add_argument("--seqlen-q", type=_int_at_least(0), default=None,
                   help=f"query length {study_default('seqlen_q')}")
    g.add_argument("--seqlen-k", type=_int_at_least(0), default=None, help="key length (default seqlen-q)")
    g.add_argument("--hdim-q", type=_int_at_least(1), default=None,
                   help=f"q/k head dim {study_default('hdim_q')}")
    g.add_argument("--hdim-v", type=_int_at_least(1), default=None, help="v head dim (default hdim-q)")
    g.add_argument("--causal", action="store_true", help="causal mask (bottom-right)")
    g.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the random normal inputs")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where fmha runs (cuda: the compiled kernels; cpu: Triton's interpreter)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_numerics)

    p = sub.add_parser("info", help="device, arch, versions, Triton cache directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("kernels", help="the kernel registry: list, explain, build, export, import")
    ks = p.add_subparsers(dest="kernels_command", required=True, metavar="ACTION")
    k = ks.add_parser("list", help="the registry's configs")
    k.add_argument("--arch", default=None, help="only configs for this arch (sm90, cpu, ...)")
    k.add_argument("--family", choices=[f.value for f in Family], default=None)
    k.add_argument("--dtype", choices=[d.value for d in DType], default=None)
    k.add_argument("--registry", metavar="FILE", default=None, help="a registry JSON instead of the default")
    k.add_argument("--profile", choices=sorted(PROFILES), default=None, help="only a named subset (CK's receipts)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_kernels_list)
    k = ks.add_parser("explain", help="which config of a family a problem gets, and why the others are refused",
                      description="Exit code 1 when no config fits.")
    _add_problem_flags(k)
    k.add_argument("--arch", default=None, help="arch of the problem (default: the current device's, "
                   "cpu without CUDA)")
    k.add_argument("--family", choices=[f.value for f in Family], default=Family.FWD.value,
                   help="the kernel family (default fwd); the KV-cache families take the problem as a decode "
                        "or prefill over a cache of seqlen-k keys")
    k.add_argument("--paged-kv", action="store_true", help="KV-cache families: a paged cache")
    k.add_argument("--fp8-kv-cache", action="store_true", help="KV-cache families: a float8 cache")
    k.add_argument("--registry", metavar="FILE", default=None, help="a registry JSON instead of the default")
    k.set_defaults(func=_cmd_kernels_explain)
    k = ks.add_parser("build", help="compile the registry's kernels for a CUDA arch, in parallel",
                      description="Compile every config that runs on the arch, for each dtype of its "
                                  "signature, plain and causal (no GPU needed: Triton ships ptxas). Configs "
                                  "already in the build record are reported cached. A kernel that needs more "
                                  "shared memory than the arch allows is reported failed. Exit code 1 if "
                                  "any config fails.")
    k.add_argument("--arch", default=None, help=f"CUDA arch to build for (default: the current device's, "
                   f"{precompile.DEFAULT_ARCH} without CUDA)")
    k.add_argument("--family", action="append", choices=[f.value for f in Family], default=None,
                   help="only this family (repeat for several)")
    k.add_argument("--dtype", action="append", choices=[d.value for d in DType], default=None,
                   help="only this dtype (repeat for several)")
    k.add_argument("--jobs", "-j", type=_int_at_least(1), default=None,
                   help=f"parallel compiler processes (default: the number of CPUs, {os.cpu_count()})")
    k.add_argument("--registry", metavar="FILE", default=None, help="a registry JSON instead of the default")
    k.add_argument("--profile", choices=sorted(PROFILES), default=None, help="only a named subset (CK's receipts)")
    k.add_argument("--record", metavar="FILE", default=None,
                   help=f"the build record (default: {precompile.RECORD_NAME} in Triton's cache dir)")
    k.add_argument("--timeout", type=_nonneg_float, default=None, metavar="S",
                   help="seconds one kernel may take to compile before it is killed and reported failed "
                        "(default: no limit)")
    k.add_argument("--no-progress", action="store_true", help="no progress bar")
    k.add_argument("--json", action="store_true", help="machine-readable output")
    k.set_defaults(func=_cmd_kernels_build)
    k = ks.add_parser("export", help="write the registry as JSON")
    k.add_argument("file", metavar="FILE")
    k.set_defaults(func=_cmd_kernels_export)
    k = ks.add_parser("import", help="read and validate a registry JSON, print its statistics")
    k.add_argument("file", metavar="FILE")
    k.set_defaults(func=_cmd_kernels_import)

    k = ks.add_parser("autofill", help="complete a short spec (family, dtype, head dims, tile) to a full "
                      "config and print its JSON",
                      description="Complete a short spec to a full, valid kernel config and print its JSON "
                      "(importable; 'filled' says where each default came from). Spec tokens: "
                      + "; ".join(SPEC_FORMS) + ". Example: fmha kernels autofill fwd fp16 d128 m128n64. "
                      "An invalid config is refused with the rule it breaks (exit code 2).")
    k.add_argument("spec", nargs="*", help="spec tokens, e.g. fwd fp16-bf16 d128 m128n64w8s3")
    k.add_argument("--family", choices=[f.value for f in Family], default=None)
    k.add_argument("--dtype", action="append", choices=[d.value for d in DType], default=None,
                   help="a dtype of the signature (repeat for several)")
    k.add_argument("--hdim", type=_int_at_least(1), default=None, help="largest head dim served")
    k.add_argument("--tile", default=None, help="m<block_m>n<block_n>[w<warps>][s<stages>], e.g. m128n64")
    k.add_argument("--arch", default=None, help="cuda (every CUDA arch, default), cpu, sm90, sm80-sm90")
    k.add_argument("--warps", type=_int_at_least(1), default=None)
    k.add_argument("--stages", type=_int_at_least(1), default=None)
    k.add_argument("--features", nargs="+", choices=[f.value for f in Feature], default=None,
                   help="the features served (default: everything the family serves)")
    k.add_argument("--registry", metavar="FILE", default=None,
                   help="take defaults from this registry JSON instead of the stock one")
    k.add_argument("--out", metavar="FILE", default=None, help="also write a registry JSON of this config")
    k.set_defaults(func=_cmd_kernels_autofill)

    p = sub.add_parser("sweep", help="run the dispatcher's kernel over a range of one size, timed and checked",
                       description="One problem per value of AXIS (the other sizes from the problem flags), "
                       "each through fmha.attention with the kernel the dispatcher selects: timed (CUDA events "
                       "on a GPU; the interpreter's wall time on the CPU) and checked against a float64 truth "
                       "(the whole problem, or batch 0 / one KV-head group when large, skipped when still too "
                       "large). Exit code 1 if a point fails.")
    p.add_argument("axis", choices=sweeps.AXES)
    p.add_argument("--values", nargs="+", type=_int_at_least(1), default=None,
                   help="values of the axis (default: " + "; ".join(
                       f"{axis} {list(sweeps.DEFAULT_VALUES['cuda'][axis])} on CUDA, "
                       f"{list(sweeps.DEFAULT_VALUES['cpu'][axis])} on the CPU" for axis in sweeps.AXES) + ")")
    _add_problem_flags(p)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-validate", action="store_true", help="skip the checks against float64")
    p.add_argument("--repeat", type=_int_at_least(1), default=None, help="timed calls per point (default 10 on "
                   "CUDA, 1 on the CPU)")
    p.add_argument("--warmup", type=_int_at_least(0), default=None, help="untimed calls first (default 3 on "
                   "CUDA, 0 on the CPU)")
    p.add_argument("--csv", metavar="FILE", default=None)
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--plot", metavar="FILE.png", default=None, help="TFLOP/s (GPU) or ms (CPU) per value")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("stress", help="many random problems, each checked against float64",
                       description="Random problems (dtype, shapes, GQA, layout, causal/window/alignment, sink "
                       "tokens, soft-cap, bias or ALiBi, sink logits, dropout, input seed) from --seed, each "
                       "run through fmha.attention and checked against a float64 truth. Small on the CPU. "
                       "Exit code 1 if any case fails; each failure prints the `fmha run` flags that "
                       "reproduce it.")
    p.add_argument("--count", type=_int_at_least(1), default=20, help="cases (default 20)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--time-budget", type=_nonneg_float, default=None, metavar="S",
                   help="start no new case after S seconds (default: no limit)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backward", action="store_true", help="also check dq, dk, dv (the deterministic backward "
                   "for cases with an odd input seed)")
    p.add_argument("--random-tiles", action="store_true", help="run each forward with a random fwd config "
                   "(tile, warps, stages) instead of the dispatcher's choice")
    p.add_argument("--failures-only", action="store_true", help="table rows for failed cases only")
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_stress)

    p = sub.add_parser("tune", help="time the candidate configs of a family on this GPU; write the tuning DB",
                       description="For each problem (shapes x dtypes) and tunable family of the profile, time "
                       "every config of the registry that serves it (triton.testing.do_bench median) and record "
                       "the fastest in the tuning DB, which the dispatcher then follows ('tuned: ...' in "
                       "explain). Needs a CUDA GPU, except --dry-run. Exit code 1 if no candidate ran for "
                       "some problem.")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="registry profile: its configs are the candidates, its tunable families are tuned "
                        f"({', '.join(f.value for f in tuner.TUNABLE_FAMILIES)}; default flash_fwd)")
    p.add_argument("--family", action="append", choices=[f.value for f in tuner.TUNABLE_FAMILIES], default=None,
                   help="tune this family (repeat for several) instead of the profile's")
    p.add_argument("--shapes", nargs="+", type=_tune_shape, default=None, metavar="BxHxSxD[:causal]",
                   help="B x H x S x D or B x Hq x Hk x S x D, ':causal' for a causal mask (default: D 64, "
                        "128, 256 x S 1024, 4096, 16384 with B*S = 16384, H 16, causal and not)")
    p.add_argument("--dtype", nargs="+", choices=["fp16", "bf16", "fp32"], default=["bf16"])
    p.add_argument("--deterministic", action="store_true", help="deterministic backward problems (bwd_dq)")
    p.add_argument("--arch", default=None, help="arch of the problems (default: this GPU's; sm90 for --dry-run "
                   "without CUDA)")
    p.add_argument("--registry", metavar="FILE", default=None, help="candidates from this registry JSON "
                   "(its choices are followed by a dispatcher with this registry)")
    p.add_argument("--db", metavar="FILE", default=None,
                   help=f"the tuning DB (default: {tuning.DB_NAME} in ${tuning.ENV_CACHE_DIR} or ~/.cache/fmha)")
    p.add_argument("--warmup-ms", type=_nonneg_float, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep-ms", type=_nonneg_float, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write every timing as JSON")
    p.add_argument("--dry-run", action="store_true", help="list problems and candidates; time nothing, write nothing")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("bench", help="fmha against cuDNN, FlashAttention-2 and FlexAttention (GPU)",
                       description=(bench.__doc__ or "").split("\n\n")[0])
    bench.add_arguments(p)
    p.set_defaults(func=bench.command)
    return parser


def _console() -> Any:
    from rich.console import Console

    # Markup off: messages contain brackets (lists of archs, dtypes) that are not markup.
    return Console(markup=False, highlight=False, width=None if sys.stdout.isatty() else 160)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fmha` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, message on stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.func(args, _console())
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        # ValueError covers NoKernelError and ConfigError; RuntimeError covers an interpreter
        # that cannot run (numpy too new) and CUDA out-of-memory.
        if args.traceback:
            raise
        kind = "" if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: "
        print(f"error: {kind}{e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
