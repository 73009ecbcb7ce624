"""A/B of a switch of the Gluon forward (a module constant of fwd_gluon, e.g. P_SMEM_16, P_SMEM_FP8 or
FP8_Q_REGS), at each of its values, side by side with SDPA cuDNN
(16-bit rows) or fmha's bf16 forward (fp8 rows: D=64, 128 and 256, full and causal).
Contenders alternate in rotated order each round (`fmha.bench.suite`'s protocol); each fmha time is
`do_bench`'s median of one forward call (launch plans cleared on each switch). Also the largest
difference of each value's fmha output (and LSE) from the first value's, every row.

    PYTHONPATH=src python tools/bench_fwd_switch.py --switch NAME [--values 0,1,2] [--rounds 3] [--json F]
        [--only d64|fp8|other]

--values: the switch's values, the first the reference (default: True,False for a boolean).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from triton.testing import do_bench

import fmha
from fmha.bench import suite as bench
from fmha.bench.suite import Shape
from fmha.kernels.gluon import fwd as fwd_gluon
from fmha.kernels.launch import plan_tables

D64 = [Shape(16, 16, 16, 1024, 64, "bf16", c) for c in (False, True)] + \
      [Shape(4, 16, 16, 4096, 64, "bf16", c) for c in (False, True)] + \
      [Shape(2, 16, 16, 8192, 64, "bf16", c) for c in (False, True)] + \
      [Shape(1, 16, 16, 16384, 64, "bf16", c) for c in (False, True)] + \
      [Shape(4, 32, 8, 8192, 64, "bf16", c) for c in (False, True)]
OTHER = [Shape(16, 16, 16, 1024, 128, "bf16", False), Shape(2, 16, 16, 8192, 128, "bf16", False),
         Shape(4, 32, 8, 8192, 128, "bf16", False), Shape(16, 16, 16, 1024, 256, "bf16", False)]
FP8 = [(4, 16, 8192, d, c) for d in (64, 128, 256) for c in (False, True)]


SWITCH = ""
VALUES: list = [True, False]


def switched(value) -> None:
    setattr(fwd_gluon, SWITCH, value)
    plan_tables.clear_plans()  # (a plan keeps the switch it was made with)


def alternate(calls: dict, rounds: int) -> dict[str, float]:
    """Median ms per contender; calls: name -> (the switch's value or None, fn)."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            on, fn = calls[name]
            if on is not None:
                switched(on)
            times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    switched(VALUES[-1])
    return {n: statistics.median(t) for n, t in times.items()}


def differences(fn) -> dict[str, tuple[float, float]]:
    """Per value after the first: (max |O - O_first|, max |LSE - LSE_first|) of one call
    returning (o, lse)."""
    outs = []
    for value in VALUES:
        switched(value)
        o, lse = fn()
        outs.append((o.float(), lse.float()))
    switched(VALUES[-1])
    (o0, l0) = outs[0]
    return {str(v): (float((o - o0).abs().max()), float((lse - l0).abs().max()))
            for v, (o, lse) in zip(VALUES[1:], outs[1:])}


def dense_row(shape: Shape, rounds: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen, device="cuda")
                     .to(bench.DTYPES[shape.dtype]) for h in (shape.nhead_q, shape.nhead_k, shape.nhead_k,
                                                              shape.nhead_q))
    fmha_fn = bench._setup("fmha", shape, "fwd", q, k, v, dout).parts[0][1]
    cudnn = bench._setup("cudnn", shape, "fwd", q, k, v, dout)
    calls = {str(v): (v, fmha_fn) for v in VALUES}
    if cudnn.error is None:
        calls["cudnn"] = (None, cudnn.parts[0][1])
    ms = alternate(calls, rounds)
    diffs = differences(lambda: fmha.attention(q, k, v, causal=shape.causal, return_lse=True))
    return {"shape": shape.label, "against": "cudnn", "ms": ms,
            "tflops": {n: shape.flops("fwd") / t / 1e9 for n, t in ms.items()}, "max_diff": diffs}


def fp8_row(b: int, h: int, s: int, d: int, causal: bool, rounds: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, k, v))

    def fp8_call(lse=False):
        return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, return_lse=lse)

    calls = {str(v): (v, fp8_call) for v in VALUES}
    calls["bf16"] = (None, lambda: fmha.attention(q, k, v, causal=causal))
    ms = alternate(calls, rounds)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    diffs = differences(lambda: fp8_call(True))
    return {"shape": f"fp8 e4m3 B={b} H={h} S={s} D={d}{' causal' if causal else ''}", "against": "bf16",
            "ms": ms, "tflops": {n: flops / t / 1e9 for n, t in ms.items()}, "max_diff": diffs}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--switch", required=True, help="a module constant of fwd_gluon")
    parser.add_argument("--values", help="comma-separated values, the first the reference (default True,False)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--only", choices=["d64", "fp8", "other"])
    args = parser.parse_args()
    global SWITCH, VALUES
    SWITCH = args.switch
    current = getattr(fwd_gluon, SWITCH, None)
    if not isinstance(current, (bool, int)):
        parser.error(f"fwd_gluon.{SWITCH} is not a boolean or integer switch")
    if args.values:
        VALUES = [type(current)(int(v)) if v.isdigit() else v == "True" for v in args.values.split(",")]
    work = ([("dense", s) for s in D64] if args.only in (None, "d64") else []) + \
           ([("fp8", s) for s in FP8] if args.only in (None, "fp8") else []) + \
           ([("dense", s) for s in OTHER] if args.only in (None, "other") else [])
    rows = []
    names = [str(v) for v in VALUES]
    for kind, shape in work:
        row = dense_row(shape, args.rounds) if kind == "dense" else fp8_row(*shape, args.rounds)
        rows.append(row)
        t, ms, against = row["tflops"], row["ms"], row["against"]
        ref = ms.get(against, float("nan"))
        cols = "  ".join(f"{n} {t[n]:6.1f} ({ref / ms[n]:.3f})" for n in names)
        gains = "  ".join(f"{n}/{names[0]} {ms[names[0]] / ms[n]:.3f}" for n in names[1:])
        diffs = "  ".join(f"{n}: dO {d[0]:.1e} dLSE {d[1]:.1e}" for n, d in row["max_diff"].items())
        print(f"{row['shape']:48s} {cols}  {against} {t.get(against, float('nan')):6.1f} | {gains} | {diffs}",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "switch": SWITCH, "values": names,
                           "rounds": args.rounds, "rows": rows}, f, indent=1)
    for n in names[1:]:
        ratios = [r["ms"][names[0]] / r["ms"][n] for r in rows]
        if ratios:
            print(f"geomean speed of {SWITCH}={n} over {SWITCH}={names[0]}: "
                  f"{statistics.geometric_mean(ratios):.4f} over {len(ratios)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
