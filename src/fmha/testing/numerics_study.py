"""`fmha numerics`: the fp16 / bf16 study of CK's bf16 backward example.

For one problem, draw float64 Q, K, V and dO (random normal), and for each of fp16 and
bf16:

(a) quantization: the error of Q, K, V, dO rounded to that dtype, against the float64
    values (max abs and relative error);
(b) accuracy of the kernels: run `fmha.attention` forward and backward in that dtype (on
    the chosen device: CUDA runs the compiled kernels, the CPU runs them through Triton's
    interpreter) and compare o, dq, dk, dv against `fmha.reference` in float64 on the
    *rounded* inputs, so that only the kernels' own error is measured. The check is CK's:
    allclose with rtol = atol = tol, i.e. elementwise |x - ref| <= atol + rtol * |ref|,
    with tol = 1.6e-2 for fp16, 2.0e-2 for bf16 with head dim <= 128 and 3.2e-2 above
    (head dim = max(hdim_q, hdim_v));
(c) the difference between the fp16 and bf16 results, and each one's error against the
    float64 truth of the unrounded inputs (quantization plus kernel error).

`run_study(...)` returns a JSON-ready dict; `render(result)` gives rich tables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .. import reference
from ..api import attention

DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
TENSORS = ("q", "k", "v", "do")
OUTPUTS = ("o", "dq", "dk", "dv")
CHECK_TEXT = ("CK's check: allclose with rtol = atol = tol, i.e. |x - ref| <= atol + rtol * |ref| "
              "for every element; ref = fmha.reference (numpy float64) on the rounded inputs")

# Problem sizes for flags not given: small for the CPU interpreter, larger on a GPU (the
# float64 reference runs in numpy on the host either way).
STUDY_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"batch": 2, "nhead_q": 4, "seqlen_q": 128, "hdim_q": 64},
    "cuda": {"batch": 2, "nhead_q": 8, "seqlen_q": 1024, "hdim_q": 128},
}


def ck_tolerance(dtype: str, hdim_q: int, hdim_v: int) -> float:
    """rtol = atol of CK's backward example: fp16 1.6e-2; bf16 2.0e-2, or 3.2e-2 above head dim 128."""
    if dtype == "fp16":
        return 1.6e-2
    if dtype == "bf16":
        return 3.2e-2 if max(hdim_q, hdim_v) > 128 else 2.0e-2
    raise ValueError(f"dtype {dtype!r} has no CK tolerance; accepted: fp16, bf16")


@dataclass(frozen=True)
class Check:
    """One tensor against its reference under CK's allclose rule."""

    name: str
    dtype: str
    max_abs: float  # max |x - ref|
    relative: float  # reference.relative_error: ||x - ref|| / ||ref||
    rtol: float
    atol: float
    worst: float  # max |x - ref| / (atol + rtol |ref|); <= 1 passes
    mismatches: int  # elements over the bound (NaN counts)
    size: int

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def check_allclose(name: str, dtype: str, x: Any, ref: Any, tol: float) -> Check:
    """CK's check of `x` against `ref`: |x - ref| <= tol + tol * |ref| elementwise."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"{name}: shape {x.shape} does not match the reference's {ref.shape}")
    diff = np.abs(x - ref)
    bound = tol + tol * np.abs(ref)
    with np.errstate(invalid="ignore"):
        bad = ~(diff <= bound)  # NaN fails
    ratio = np.where(np.isnan(diff), np.inf, diff / bound)
    return Check(name=name, dtype=dtype, max_abs=reference.max_abs_error(x, ref),
                 relative=reference.relative_error(x, ref), rtol=tol, atol=tol,
                 worst=float(ratio.max()) if ratio.size else 0.0, mismatches=int(bad.sum()), size=int(x.size))


def _errors(x: Any, ref: Any) -> dict[str, float]:
    return {"max_abs": reference.max_abs_error(x, ref), "relative": reference.relative_error(x, ref)}


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when available, else the CPU; "cuda" without CUDA is a ValueError."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available; use cpu or auto")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"device {name!r} is not supported; accepted: cpu, cuda, auto")
    return torch.device(name)


def _run_fmha(inputs: dict[str, np.ndarray], dtype: torch.dtype, device: torch.device,
              causal: bool) -> dict[str, np.ndarray]:
    """o, dq, dk, dv of fmha.attention in `dtype` on `device`, as float64 host arrays."""
    q, k, v = (torch.from_numpy(inputs[n]).to(dtype).to(device).requires_grad_() for n in ("q", "k", "v"))
    do = torch.from_numpy(inputs["do"]).to(dtype).to(device)
    o = attention(q, k, v, causal=causal)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return {name: t.detach().double().cpu().numpy() for name, t in zip(OUTPUTS, (o, dq, dk, dv), strict=True)}


def _reference(inputs: dict[str, np.ndarray], causal: bool) -> dict[str, np.ndarray]:
    """o, dq, dk, dv of fmha.reference in float64."""
    o, _ = reference.attention_fwd(inputs["q"], inputs["k"], inputs["v"], causal=causal)
    grads = reference.attention_bwd(inputs["q"], inputs["k"], inputs["v"], inputs["do"], causal=causal)
    return {"o": o, "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"]}


def run_study(*, batch: int | None = None, nhead_q: int | None = None, nhead_k: int | None = None,
              seqlen_q: int | None = None, seqlen_k: int | None = None, hdim_q: int | None = None,
              hdim_v: int | None = None, causal: bool = False, device: str | torch.device = "cpu",
              seed: int = 0) -> dict[str, Any]:
    """The study for one problem (sizes not given: STUDY_DEFAULTS of the device); JSON-ready.

    Returns {"problem", "device", "seed", "check", "truth", "dtypes": {dtype: {"tolerance",
    "quantization": {tensor: {max_abs, relative}}, "checks": {output: Check dict},
    "vs_exact_inputs": {output: {max_abs, relative}}, "ok"}}, "fp16_vs_bf16": {output:
    {max_abs, relative}}, "ok"}. "ok" is False if any check fails.
    """
    dev = resolve_device(device)
    d = STUDY_DEFAULTS["cpu" if dev.type == "cpu" else "cuda"]
    batch = d["batch"] if batch is None else batch
    nhead_q = d["nhead_q"] if nhead_q is None else nhead_q
    nhead_k = nhead_q if nhead_k is None else nhead_k
    seqlen_q = d["seqlen_q"] if seqlen_q is None else seqlen_q
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    hdim_q = d["hdim_q"] if hdim_q is None else hdim_q
    hdim_v = hdim_q if hdim_v is None else hdim_v
    for name, value in (("batch", batch), ("nhead_q", nhead_q), ("nhead_k", nhead_k), ("hdim_q", hdim_q),
                        ("hdim_v", hdim_v)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    if nhead_q % nhead_k:
        raise ValueError(f"nhead_q={nhead_q} is not a multiple of nhead_k={nhead_k}")

    rng = np.random.default_rng(seed)
    exact = {
        "q": rng.standard_normal((batch, nhead_q, seqlen_q, hdim_q)),
        "k": rng.standard_normal((batch, nhead_k, seqlen_k, hdim_q)),
        "v": rng.standard_normal((batch, nhead_k, seqlen_k, hdim_v)),
        "do": rng.standard_normal((batch, nhead_q, seqlen_q, hdim_v)),
    }
    truth_exact = _reference(exact, causal)
    per_dtype: dict[str, Any] = {}
    results: dict[str, dict[str, np.ndarray]] = {}
    for name, dtype in DTYPES.items():
        tol = ck_tolerance(name, hdim_q, hdim_v)
        rounded = {t: torch.from_numpy(x).to(dtype).double().numpy() for t, x in exact.items()}
        out = _run_fmha(exact, dtype, dev, causal)
        truth = _reference(rounded, causal)
        checks = {o: check_allclose(o, name, out[o], truth[o], tol) for o in OUTPUTS}
        results[name] = out
        per_dtype[name] = {
            "tolerance": tol,
            "quantization": {t: _errors(rounded[t], exact[t]) for t in TENSORS},
            "checks": {o: c.to_dict() for o, c in checks.items()},
            "vs_exact_inputs": {o: _errors(out[o], truth_exact[o]) for o in OUTPUTS},
            "ok": all(c.ok for c in checks.values()),
        }
    return {
        "problem": {"batch": batch, "nhead_q": nhead_q, "nhead_k": nhead_k, "seqlen_q": seqlen_q,
                    "seqlen_k": seqlen_k, "hdim_q": hdim_q, "hdim_v": hdim_v, "causal": causal},
        "device": str(dev),
        "seed": seed,
        "check": CHECK_TEXT,
        "truth": "fmha.reference.attention_fwd/attention_bwd (numpy float64)",
        "dtypes": per_dtype,
        "fp16_vs_bf16": {o: _errors(results["bf16"][o], results["fp16"][o]) for o in OUTPUTS},
        "ok": all(entry["ok"] for entry in per_dtype.values()),
    }


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3e}"


def render(result: dict[str, Any]) -> list[Any]:
    """Rich tables of a `run_study` result: quantization, checks, fp16 vs bf16, verdict."""
    from rich.table import Table

    p = result["problem"]
    title = (f"B={p['batch']} Hq={p['nhead_q']} Hk={p['nhead_k']} Sq={p['seqlen_q']} Sk={p['seqlen_k']} "
             f"Dq={p['hdim_q']} Dv={p['hdim_v']}{' causal' if p['causal'] else ''} on {result['device']}, "
             f"seed {result['seed']}")
    dtypes = list(result["dtypes"])

    quant = Table(title=f"(a) input quantization vs float64 - {title}", title_justify="left")
    quant.add_column("tensor")
    for dt in dtypes:
        quant.add_column(f"{dt} max abs", justify="right")
        quant.add_column(f"{dt} relative", justify="right")
    for t in TENSORS:
        row = [t]
        for dt in dtypes:
            e = result["dtypes"][dt]["quantization"][t]
            row += [_fmt(e["max_abs"]), _fmt(e["relative"])]
        quant.add_row(*row)

    checks = Table(title="(b) fmha vs float64 reference on the rounded inputs", title_justify="left",
                   caption=result["check"], caption_justify="left")
    for column in ("dtype", "tensor", "max abs", "relative", "tol (rtol=atol)", "worst err/bound",
                   "mismatches", "verdict"):
        checks.add_column(column, justify="left" if column in ("dtype", "tensor", "verdict") else "right")
    for dt in dtypes:
        for o in OUTPUTS:
            c = result["dtypes"][dt]["checks"][o]
            checks.add_row(dt, o, _fmt(c["max_abs"]), _fmt(c["relative"]), f"{c['rtol']:.1e}",
                           f"{c['worst']:.3f}", f"{c['mismatches']}/{c['size']}",
                           "pass" if c["ok"] else "FAIL", style=None if c["ok"] else "red")

    diff = Table(title="(c) fp16 vs bf16, and each vs float64 on the unrounded inputs", title_justify="left")
    for column in ("tensor", "|bf16 - fp16| max", "bf16 vs fp16 relative",
                   *(f"{dt} vs exact relative" for dt in dtypes)):
        diff.add_column(column, justify="left" if column == "tensor" else "right")
    for o in OUTPUTS:
        e = result["fp16_vs_bf16"][o]
        diff.add_row(o, _fmt(e["max_abs"]), _fmt(e["relative"]),
                     *(_fmt(result["dtypes"][dt]["vs_exact_inputs"][o]["relative"]) for dt in dtypes))

    verdict = Table(show_header=False, title="verdict", title_justify="left")
    verdict.add_column("what", style="bold")
    verdict.add_column("value")
    for dt in dtypes:
        ok = result["dtypes"][dt]["ok"]
        verdict.add_row(dt, "pass" if ok else "FAIL", style="green" if ok else "red")
    verdict.add_row("all", "pass" if result["ok"] else "FAIL", style="green" if result["ok"] else "red")
    return [quant, checks, diff, verdict]
