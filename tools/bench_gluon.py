"""Gluon forward variants vs the Triton forward vs SDPA cuDNN/flash, side by side.

B=4, H=16, S 4096/8192, D 64/128/256, bf16, causal and not (plus the GQA shape 4x32/8 at
8192). Contenders alternate within each round; the median over rounds is reported.

    PYTHONPATH=src python tools/bench_gluon.py [--rounds N] [--quick] [--hdims 64,128]   (writes $OUT/bench_gluon.json)
        [--persistent]   each Gluon variant also as the persistent kernel (name suffix _persist)
        [--first-only]   only the registry's Gluon variant per head dim (the first of GLUON_VARIANTS)
        [--tau T]        each Gluon variant also with the lazy O rescale RESCALE_TAU=T (suffix _tauT)
        [--no-baselines] leave out Triton, cuDNN and flash (diffs then against the first Gluon variant)
    Lazy rescale side by side, under 3 minutes on an H200:
        python tools/bench_gluon.py --quick --first-only --tau 8 --no-baselines
        [--short]        short sequences instead: B=16 H=16 S=1024 (and GQA 16x32/8 at D 128), plus
                         B=4 H=16 S=8192 D=128 as a long control
        [--variants [lpt,heads]]  the persistent kernel's other causal tile orders (fwd_gluon.launch's
                         tile_order 0 / 1) side by side with the one-tile kernel, the persistent
                         kernel as it is (_persist: pairs) and cuDNN, registry tile only, no Triton/FA2:
                         causal B=16 H=16 S=1024 D 64/128/256, B=4 H=16 S=8192 D=128,
                         B=1 H=16 S=16384 D=128 and B=4 Hq=32 Hk=8 S=4096 D=256 (GQA); without a
                         mask S=1024 D 128/256 (the orders are the same there).
                         Names: _persist_lpt (longest row tiles of all heads first), _persist_heads
                         (heads outermost).
        [--suite-full]   with --variants: the standard suite's shapes without a mask instead
                         (one-tile against persistent where no tile order applies; with --tau 8
                         each also at the other rescale setting)
"""

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fmha.kernels.gluon import fwd as fwd_gluon
from fmha.kernels.triton import fwd

# (block_n, stages, pingpong[, block_m]) per head dim; the first is the registry's choice (D=64: of the
# one-tile kernel; the persistent one has 2 stages, attempt 61).
GLUON_VARIANTS = {
    64: [(128, 3, False), (64, 3, False, 192), (64, 4, False, 192), (64, 3, True, 192),
         (64, 3, False), (64, 4, False)],  # m128 n64: less of a diagonal key tile masked (causal, short)
    128: [(128, 2, True), (128, 2, False), (64, 3, True)],
    256: [(64, 2, True), (64, 2, False), (32, 4, True)],
}
TRITON_TILE = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (128, 32, 8, 2)}


# (B, Hq, Hk, S) of the standard suite (fmha bench).
SUITE_SHAPES = [(16, 16, 16, 1024), (4, 16, 16, 4096), (2, 16, 16, 8192), (1, 16, 16, 16384), (4, 32, 8, 8192)]
PERSISTENT_VARIANTS = {"lpt": {"tile_order": 0}, "heads": {"tile_order": 1}}


def variant_contenders(q, k, v, causal, variants, tau=0.0):
    """The registry's Gluon tile: one-tile, persistent, each other causal tile order, each also
    with RESCALE_TAU=tau (suffix _tau); cuDNN."""
    b, hq, s, d = q.shape
    scale = 1 / math.sqrt(d)
    bn, st, pp, *m = GLUON_VARIANTS[d][0]
    bm = m[0] if m else 128
    name = f"gluon_m{bm}n{bn}s{st}{'_pp' if pp else ''}"
    calls = {}
    runs = [("", False, {}), ("_persist", True, {})]
    runs += [(f"_persist_{v}", True, PERSISTENT_VARIANTS[v]) for v in variants
             if causal or not PERSISTENT_VARIANTS[v].get("tile_order")]
    if tau:
        runs += [(suffix + f"_tau{tau:g}", persist, {**extra, "rescale_tau": tau}) for suffix, persist, extra in runs]
    runs = [(suffix, persist, {"rescale_tau": 0.0, **extra}) for suffix, persist, extra in runs]
    for suffix, persist, extra in runs:
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
        calls[name + suffix] = (lambda o=o, lse=lse, persist=persist, extra=extra: fwd_gluon.launch(
            q, k, v, o, lse, causal=causal, align_bottom_right=True, scale=scale, block_m=bm, block_n=bn,
            num_stages=st, pingpong=pp, persistent=persist, **extra)), o
    out = {}

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out["o"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                        enable_gqa=hq != k.shape[1])
    calls["cudnn"] = call, out
    return calls


def contenders(q, k, v, causal, persistent=False, first_only=False, tau=0.0, baselines=True):
    b, hq, s, d = q.shape
    hk = k.shape[1]
    scale = 1 / math.sqrt(d)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
    calls = {}
    for bn, st, pp, *m in GLUON_VARIANTS[d][:1] if first_only else GLUON_VARIANTS[d]:
        bm = m[0] if m else 128
        name = f"gluon_m{bm}n{bn}s{st}{'_pp' if pp else ''}"
        for persist in (False, True) if persistent else (False,):
            for t in (0.0, tau) if tau else (0.0,):
                out = o if not t else torch.empty_like(q)
                calls[name + ("_persist" if persist else "") + (f"_tau{t:g}" if t else "")] = (
                    lambda bn=bn, st=st, pp=pp, bm=bm, persist=persist, t=t, out=out:
                    fwd_gluon.launch(q, k, v, out, lse, causal=causal, align_bottom_right=True, scale=scale,
                                     block_m=bm, block_n=bn, num_stages=st, pingpong=pp, persistent=persist,
                                     rescale_tau=t if tau else None)), out
    if not baselines:
        return calls
    bm, bn, w, st = TRITON_TILE[d]
    o2 = torch.empty_like(q)
    lse2 = torch.empty_like(lse)
    calls["triton"] = (lambda: fwd.launch(
        q, k, v, o2, lse2, batch=b, max_seqlen_q=s, max_seqlen_k=s, scale=scale, softcap=0.0,
        window=(-1, 0) if causal else (-1, -1), sink_size=0, align_bottom_right=True, dropout_p=0.0,
        seed=0, offset=0, block_m=bm, block_n=bn, num_warps=w, num_stages=st, dot_precision="ieee")), o2
    extra = {"enable_gqa": True} if hq != hk else {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        out = {}

        def call(backend=backend, out=out):
            with sdpa_kernel(backend):
                out["o"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)
        calls[name] = call, out
    return calls


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    quick = "--quick" in sys.argv
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    hdims = [int(x) for x in sys.argv[sys.argv.index("--hdims") + 1].split(",")] if "--hdims" in sys.argv \
        else [64, 128, 256]
    persistent, first_only = "--persistent" in sys.argv, "--first-only" in sys.argv
    tau = float(sys.argv[sys.argv.index("--tau") + 1]) if "--tau" in sys.argv else 0.0
    baselines = "--no-baselines" not in sys.argv
    variants = None
    if "--variants" in sys.argv:
        i = sys.argv.index("--variants") + 1
        variants = [v for v in sys.argv[i].split(",") if v] if i < len(sys.argv) and not sys.argv[i].startswith("--") \
            else list(PERSISTENT_VARIANTS)  # "--variants ,": none, the one-tile and persistent kernels only
        shapes = [(16, 16, 16, 1024, d, True) for d in hdims]
        shapes += [(4, 16, 16, 8192, 128, True), (1, 16, 16, 16384, 128, True)] if 128 in hdims else []
        shapes += [(4, 32, 8, 4096, 256, True)] if 256 in hdims else []
        shapes += [(16, 16, 16, 1024, d, False) for d in hdims if d != 64 or tau]
        if tau:  # the suite's long shapes too: where the rescale's cost shows
            shapes += [(2, 16, 16, 8192, d, c) for d in hdims for c in (False, True)]
        if "--suite-full" in sys.argv:  # instead: the standard suite's rows without a mask
            shapes = [(b, hq, hk, s, d, False) for d in hdims for b, hq, hk, s in SUITE_SHAPES]
    elif "--short" in sys.argv:
        shapes = [(16, 16, 16, 1024, d, c) for d in hdims for c in (False, True)]
        shapes += [(16, 32, 8, 1024, 128, c) for c in (False, True) if 128 in hdims]
        shapes += [(4, 16, 16, 8192, 128, c) for c in (False, True) if 128 in hdims]
    else:
        shapes = [(4, 16, 16, s, d, c) for s in ((4096,) if quick else (4096, 8192)) for d in hdims
                  for c in (False, True)]
        shapes += [(4, 32, 8, 8192, 128, c) for c in (False, True) if 128 in hdims]
    rows = []
    for b, hq, hk, s, d, causal in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        calls = variant_contenders(q, k, v, causal, variants, tau) if variants is not None else \
            contenders(q, k, v, causal, persistent, first_only, tau, baselines)
        flops = 4.0 * b * hq * s * s * d / (2 if causal else 1)
        times = {name: [] for name in calls}
        errors = {}
        for name, (fn, _) in calls.items():  # compile + correctness against cuDNN
            try:
                fn()
            except Exception as e:  # a variant that does not fit (shared memory) is reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        torch.cuda.synchronize()
        first = "cudnn" if "cudnn" in calls else next(iter(calls))
        ref = calls[first][1]["o"].float() if first == "cudnn" else calls[first][1].float()
        diffs = {}
        for name, (_fn, res) in calls.items():
            if name in errors:
                continue
            got = res["o"] if isinstance(res, dict) else res
            diffs[name] = (got.float() - ref).abs().max().item()
        for _ in range(rounds):
            for name, (fn, _) in calls.items():
                if name not in errors:
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        med = {name: statistics.median(t) for name, t in times.items() if t}
        row = {"shape": f"B={b} Hq={hq} Hk={hk} S={s} D={d} {'causal' if causal else 'full'}",
               "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in med.items()},
               "max_abs_diff_vs_cudnn": diffs, "errors": errors}
        best = max((n for n in row["tflops"] if n.startswith("gluon")), key=row["tflops"].get, default=None)
        row["best_gluon"] = best
        rows.append(row)
        cud = row["tflops"].get("cudnn")
        line = " ".join(f"{n}={t:.0f}" for n, t in sorted(row["tflops"].items(), key=lambda x: -x[1]))
        print(f"{row['shape']}: {line} | best {best} {row['tflops'][best] / cud:.3f}x cudnn"
              if best and cud else f"{row['shape']}: {line}", flush=True)
        if variants is not None:
            base = next((n for n in row["tflops"] if n.startswith("gluon")), None)
            if base:
                print("   vs one-tile " + " ".join(f"{n[len(base):] or 'one_tile'}={t / row['tflops'][base]:.3f}"
                                                 for n, t in row["tflops"].items() if n.startswith(base)), flush=True)
        if tau:
            suffix, tf = f"_tau{tau:g}", row["tflops"]
            ratios = {n: tf[n] / tf[n.removesuffix(suffix)]
                      for n in tf if n.endswith(suffix) and n.removesuffix(suffix) in tf}
            print("   tau/always:", {n: round(r, 3) for n, r in ratios.items()}, flush=True)
        if errors:
            print("   errors:", errors, flush=True)
        bad = {n: e for n, e in diffs.items() if e > 0.02}
        if bad:
            print("   LARGE DIFF vs cudnn:", bad, flush=True)
        (out_dir / "bench_gluon.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "rows": rows}, indent=1))
    gm = {}
    keys = ["best_gluon", "gluon_default", "gluon_default_persist", "triton", "flash"]
    if variants is not None:  # geomean over the causal rows per contender (the name after the tile's)
        per = {}
        for r in rows:
            t = r["tflops"]
            base = next((n for n in t if n.startswith("gluon")), None)
            if r["shape"].endswith("causal") and base and "cudnn" in t:
                for n, x in t.items():
                    if n.startswith(base):
                        per.setdefault("causal" + (n[len(base):] or "_one_tile"), []).append(x / t["cudnn"])
        gm.update({k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in per.items()})
    for key in keys:
        vals = []
        for r in rows:
            t = r["tflops"]
            if key == "best_gluon":
                name = r["best_gluon"]
            elif key == "gluon_default":
                name = next((n for n in t if n.startswith("gluon") and not n.endswith("_persist")), None)
            elif key == "gluon_default_persist":
                name = next((n for n in t if n.startswith("gluon") and n.endswith("_persist")), None)
            else:
                name = key
            if name in t and "cudnn" in t:
                vals.append(t[name] / t["cudnn"])
        if vals:
            gm[key] = math.exp(sum(map(math.log, vals)) / len(vals))
    print("geomean vs cudnn:", {k: round(v, 3) for k, v in gm.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
