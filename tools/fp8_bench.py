"""FP8 forward vs our bf16 forward on a GPU, side by side (contenders alternate each round).

B=4, H=16, S=8192, D=128 and 256, causal and not; TFLOP/s in the FlashAttention
convention (4 * B * H * S^2 * D, halved for causal), medians of triton's do_bench medians.
Contenders: fmha bf16, fmha fp8 e4m3 with per-(batch, head) descales (the registry's
choice: the Gluon kernel on Hopper), the Triton fp8 kernel, and with --sweep a few other
Gluon fp8 tiles (each through a one-config registry ahead of the default one) so the
registry's fp8 rows can be tuned from one run. Also checks the fp8 output against bf16,
and times decode (B=32, Hq=32, Hk=8, S=8192; B=8, S=32768) over a bf16 cache and over an fp8 cache.

    PYTHONPATH=src python tools/fp8_bench.py OUT.json [--rounds 3] [--sweep] [--persistent] [--quick]
                                                      [--decode-only]

--persistent: also the registry's fp8 Gluon tile as the persistent kernel (one program per SM,
tiles in pairs under causal), which the registry does not choose for fp8; --quick: no Triton
fp8 contender and no decode; --decode-only: the decode rows alone. The decode rows include the
fp8 cache converted by Triton's own `.to` ("(Triton cvt)", kvcache.FP8_ASM off) and
with K's conversion on the load's layout too ("(K on load layout)", kvcache.FP8_K_AT_DOT off),
and with the products in bf16 ("(bf16 products)", kvcache.FP8_F16_DOTS off); the registry's fp8
decode is the Gluon one (kernels/kvcache_gluon.py) where it applies, these switches are the Triton kernel's
("Triton ..." rows: the registry without the Gluon decode), and the fp8 cache in shuffled pages of 1, 16, 64
and 256 keys (block table) and 64 (FlashInfer/SGLang tables), and pages of 64 on the Triton kernel.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
import triton

import fmha
from fmha.api import use_dispatcher
from fmha.dispatch.configs import Algorithm, Family, KernelConfig, Pipeline, Signature
from fmha.dispatch.registry import _gluon_config
from fmha.kernels.launch import plan_tables
from fmha.kernels.triton import kvcache
from fmha.problem import DType

FP8 = (DType.FP8_E4M3, DType.FP8_E5M2)
PP, WS = Pipeline.GLUON_WS_PINGPONG, Pipeline.GLUON_WS
# Gluon (block_n, stages, pipeline) candidates per head dim besides the registry's default.
SWEEP = {128: [(256, 2, PP), (128, 2, WS)], 256: [(128, 2, PP), (64, 3, WS)]}
TRITON_TILE = {128: (128, 128, 8, 3), 256: (128, 64, 8, 2)}  # the registry's Triton fp8 rows


def dispatcher_with(first: KernelConfig, name: str) -> fmha.Dispatcher:
    return fmha.Dispatcher(fmha.Registry([first]).merged(fmha.default_registry(), name=name))


def gluon_candidate(head_dim: int, block_n: int, stages: int, pipeline: Pipeline) -> KernelConfig:
    return _gluon_config(Family.FWD, head_dim, 128, block_n, 4, stages, pipeline, "sweep",
                         dtypes=(DType.FP8_E4M3,))


FP8_TILE = {64: (256, 2), 128: (256, 2), 256: (128, 2)}  # the registry's Gluon fp8 (block_n, stages) per head dim


def persistent_candidate(head_dim: int) -> KernelConfig:
    block_n, stages = FP8_TILE[head_dim]
    return _gluon_config(Family.FWD, head_dim, 128, block_n, 4, stages, WS, "persistent fp8",
                         dtypes=(DType.FP8_E4M3,), persistent=True)


def triton_candidate(head_dim: int) -> KernelConfig:
    arch = "sm{}{}".format(*torch.cuda.get_device_capability())
    return KernelConfig(Signature(Family.FWD, FP8, (arch,), head_dim), Algorithm(*TRITON_TILE[head_dim]))


B, H, S = 4, 16, 8192  # the fp8 benchmark shape


def issue_inputs(head_dim: int) -> tuple:
    """((q, k, v) bf16 (B, H, S, head_dim) of the benchmark's shape, seeded by head_dim, and their e4m3
    quantizations ((q8, q_descale), ...) with per-(batch, head) descales)."""
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    qkv = tuple(torch.randn(B, H, S, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    return qkv, tuple(fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in qkv)


def main() -> int:
    args = sys.argv[1:]
    out = args[0] if args and not args[0].startswith("--") else "fp8_bench.json"
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 3
    sweep, persistent, quick = "--sweep" in args, "--persistent" in args, "--quick" in args
    decode_only = "--decode-only" in args
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(env)
    results = []
    for D in () if decode_only else (128, 256):
        (q, k, v), ((q8, qd), (k8, kd), (v8, vd)) = issue_inputs(D)
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            runs = {"bf16": (None, lambda: fmha.attention(q, k, v, causal=causal))}

            def fp8_call():
                return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)
            runs["fp8_e4m3"] = (None, fp8_call)
            if not quick:
                runs["fp8_e4m3 triton"] = (dispatcher_with(triton_candidate(D), "triton"), fp8_call)
            if persistent:
                runs["fp8_e4m3 persistent"] = (dispatcher_with(persistent_candidate(D), "persistent"), fp8_call)
            if sweep:
                for n, st, pipe in SWEEP[D]:
                    runs[f"fp8_e4m3 gluon n{n}s{st} {pipe.value}"] = (
                        dispatcher_with(gluon_candidate(D, n, st, pipe), f"n{n}s{st}{pipe.value}"), fp8_call)
            times: dict[str, list[float]] = {}
            errors: dict[str, str] = {}
            for _ in range(rounds):
                for name, (dispatcher, fn) in runs.items():
                    if name in errors:
                        continue
                    fmha.set_dispatcher(dispatcher)
                    try:
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                        times.setdefault(name, []).append(ms)
                    except Exception as e:  # a tile that does not fit (shared memory) is reported, not fatal
                        errors[name] = str(e).splitlines()[0][:200]
                    finally:
                        fmha.set_dispatcher(None)
            ref = runs["bf16"][1]().float()
            got = fp8_call().float()
            rel = float((got - ref).norm() / ref.norm())
            bf16_ms = sorted(times["bf16"])[len(times["bf16"]) // 2]
            for name in runs:
                row = dict(B=B, H=H, S=S, D=D, causal=causal, contender=name)
                if name in errors:
                    row["error"] = errors[name]
                else:
                    ms = sorted(times[name])[len(times[name]) // 2]
                    row.update(ms=ms, tflops=flops / ms / 1e9, speedup_vs_bf16=bf16_ms / ms,
                               times_ms=times[name])
                if name == "fp8_e4m3":
                    row["rel_l2_diff_vs_bf16_output"] = rel
                results.append(row)
                print(f"D={D} causal={causal!s:<5} {name:<28} " + (
                    f"ERROR {row['error']}" if "error" in row else
                    f"{row['ms']:7.3f} ms {row['tflops']:7.1f} TFLOP/s  x{row['speedup_vs_bf16']:.2f} vs bf16"))
            print(f"   fp8 vs bf16 output: relative L2 difference {rel:.4f}")
            with open(out, "w") as f:
                json.dump(dict(env=env, results=results), f, indent=2)
    if not quick:
        results.extend(decode(rounds))
    with open(out, "w") as f:
        json.dump(dict(env=env, results=results), f, indent=2)
    return 0


def decode(rounds: int) -> list[dict]:
    """Decode (one query token) over a bf16 cache and over an fp8 e4m3 cache: K+V bytes/s, at
    B=32 S=8192 and B=8 S=32768."""
    return [row for B, S in ((32, 8192), (8, 32768)) for row in decode_shape(rounds, B, S)]


def decode_shape(rounds: int, B: int, S: int) -> list[dict]:
    rows = []
    Hq, Hk, D = 32, 8, 128
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kd, vd = (c.float().abs().amax(dim=(1, 3)) / 448 for c in (kc, vc))
    k8, v8 = ((c.float() / d[:, None, :, None]).to(torch.float8_e4m3fn) for c, d in ((kc, kd), (vc, vd)))
    seqlens = torch.full((B,), S, dtype=torch.int32, device="cuda")

    def fp8_decode():
        return fmha.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)

    def fp8_paged(page, indptr=False):  # the same keys in shuffled pages (block table or FlashInfer tables)
        n = B * S // page
        table = torch.randperm(n, device="cuda").int().reshape(B, S // page)
        kp, vp = (torch.empty(n, page, Hk, D, device="cuda", dtype=c.dtype) for c in (k8, v8))
        kp[table.long()] = k8.reshape(B, S // page, page, Hk, D)
        vp[table.long()] = v8.reshape(B, S // page, page, Hk, D)
        index = (dict(kv_indices=table.reshape(-1).contiguous(),
                      kv_indptr=torch.arange(0, n + 1, S // page, device="cuda", dtype=torch.int32),
                      kv_last_page_len=torch.full((B,), page, dtype=torch.int32, device="cuda"))
                 if indptr else dict(block_table=table, cache_seqlens=seqlens))
        return lambda: fmha.attention_with_kvcache(q, kp, vp, k_descale=kd, v_descale=vd, **index)

    triton_only = fmha.Dispatcher(fmha.Registry(
        [c for c in fmha.default_registry() if not (c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon)],
        name="triton decode"))

    @contextlib.contextmanager
    def switched(switches):  # kvcache's module switches ("triton": the registry without the Gluon decode);
        switches = dict(switches)  # a plan keeps the switches it was made with: forgotten around them
        triton = switches.pop("triton", False)
        saved = {name: getattr(kvcache, name) for name in switches}
        for name, value in switches.items():
            setattr(kvcache, name, value)
        plan_tables.clear_plans()
        try:
            if triton:
                with use_dispatcher(triton_only):
                    yield
            else:
                yield
        finally:
            for name, value in saved.items():
                setattr(kvcache, name, value)
            plan_tables.clear_plans()

    def bf16_decode():
        return fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

    # name: (call, bytes an element, kvcache switches)
    runs = {"decode bf16 cache": (bf16_decode, 2, {}),
            "decode fp8 cache": (fp8_decode, 1, {}),
            "decode fp8 cache (Triton kernel)": (fp8_decode, 1, dict(triton=True)),
            "decode fp8 cache (Triton, bf16 products)": (fp8_decode, 1, dict(triton=True, FP8_F16_DOTS=False)),
            "decode fp8 cache (Triton, K on load layout)": (fp8_decode, 1, dict(triton=True, FP8_K_AT_DOT=False)),
            "decode fp8 cache (Triton cvt)": (fp8_decode, 1, dict(triton=True, FP8_ASM=False)),
            **{f"decode fp8 cache paged({page})": (fp8_paged(page), 1, {}) for page in (1, 16, 64, 256)},
            "decode fp8 cache indptr(64)": (fp8_paged(64, indptr=True), 1, {}),
            "decode fp8 cache paged(64) (Triton kernel)": (fp8_paged(64), 1, dict(triton=True))}
    times: dict[str, list[float]] = {}
    outputs = {}
    for _ in range(rounds):
        for name, (fn, _, switches) in runs.items():
            with switched(switches):
                times.setdefault(name, []).append(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                          return_mode="median"))
                outputs[name] = fn()
    bf16_ms = sorted(times["decode bf16 cache"])[rounds // 2]
    diff = float((outputs["decode fp8 cache"].float() - outputs["decode bf16 cache"].float()).abs().max())
    for other in ("decode fp8 cache (Triton kernel)", "decode fp8 cache (Triton cvt)", "decode fp8 cache paged(1)",
                  "decode fp8 cache indptr(64)"):
        diff_other = (outputs["decode fp8 cache"].float() - outputs[other].float()).abs()
        print(f"B={B} S={S} fp8 cache: max |difference| from {other!r}: {float(diff_other.max()):.3g} (the sums in "
              "another order; the tests bound each against the float64 truth)")
    for name, (_, elem, _) in runs.items():
        ms = sorted(times[name])[rounds // 2]
        tbs = 2 * B * S * Hk * D * elem / ms / 1e9
        rows.append(dict(B=B, Hq=Hq, Hk=Hk, S=S, D=D, contender=name, ms=ms, kv_tb_per_s=tbs,
                         speedup_vs_bf16=bf16_ms / ms, times_ms=times[name], max_abs_diff_fp8_vs_bf16=diff))
        print(f"B={B} S={S} {name:<42} {ms * 1e3:8.1f} us {tbs:6.2f} TB/s of K+V  x{bf16_ms / ms:.2f} vs bf16 cache")
    return rows


if __name__ == "__main__":
    sys.exit(main())
