"""The Gluon fp8 decode (kernels/kvcache_gluon.py) against the Triton split-KV kernel on the same
calls, with masks, score features and several query rows a sequence: B=32 Hq=32 Hk=8 D=128, 8192
cached keys in an e4m3 cache with per-(batch, KV head) descales, bf16 queries. Cases: one query;
2 and 4 queries under a causal mask (speculative tokens); a window of 4096 keys with 4 sink
tokens; soft-cap 30 with ALiBi and sink logits. The two kernels alternate within each round (the
Triton one through a registry without the Gluon config; call plans forgotten around each switch).
Two times a call, medians over the rounds: the GPU's (the call captured in a CUDA graph and
replayed, triton's do_bench_cudagraph) and the eager call's (do_bench: where the host path is
slower than the kernels, as for calls with ALiBi or sink logits, which take no call plan, this
is the host's). Each case asserts which kernel explain names.

    PYTHONPATH=src python tools/decode_features_bench.py [ROUNDS] [OUT.json]
"""

import contextlib
import json
import sys

import torch
import triton

import fmha
from fmha.api import use_dispatcher
from fmha.dispatch.configs import Family
from fmha.kernels.launch import plan_tables

B, Hq, Hk, D, S = 32, 32, 8, 128, 8192


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    kc, vc = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kd, vd = (c.float().abs().amax(dim=(1, 3)) / 448 for c in (kc, vc))
    k8, v8 = ((c.float() / d[:, None, :, None]).to(torch.float8_e4m3fn) for c, d in ((kc, kd), (vc, vd)))
    seqlens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    slopes = torch.rand(B, Hq, device="cuda") * 0.05
    sinks = torch.randn(Hq, device="cuda")
    cases = {"plain, 1 query": (1, {}), "causal, 2 queries": (2, dict(causal=True)),
             "causal, 4 queries": (4, dict(causal=True)),
             "window 4096 + 4 sink tokens": (1, dict(window=(4095, 0), sink_size=4)),
             "soft-cap + ALiBi + sink logits": (1, dict(softcap=30.0, alibi_slopes=slopes, sinks=sinks))}
    queries = {name: torch.randn(B, sq, Hq, D, device="cuda", dtype=torch.bfloat16) for name, (sq, _) in cases.items()}
    triton_only = fmha.Dispatcher(fmha.Registry(
        [c for c in fmha.default_registry() if not (c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon)],
        name="triton decode"))
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(rounds):
        for name, (_, kw) in cases.items():
            args = dict(cache_seqlens=seqlens, k_descale=kd, v_descale=vd, **kw)
            q = queries[name]
            for kernel in ("gluon", "triton"):
                plan_tables.clear_plans()
                with use_dispatcher(triton_only) if kernel == "triton" else contextlib.nullcontext():
                    chosen = fmha.explain_kvcache(q, k8, v8, **args).splitlines()[1]
                    assert ("_gluon_" in chosen) == (kernel == "gluon"), chosen
                    def call():
                        return fmha.attention_with_kvcache(q, k8, v8, **args)
                    call()  # (compiled before the capture)
                    times.setdefault((name, kernel, "graph"), []).append(
                        triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median"))
                    times.setdefault((name, kernel, "eager"), []).append(
                        triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
                plan_tables.clear_plans()
    rows = []
    for name in cases:
        row = dict(case=name)
        for mode in ("graph", "eager"):
            g, t = (sorted(times[(name, kernel, mode)])[rounds // 2] for kernel in ("gluon", "triton"))
            print(f"{name:<32} {mode:<5} Gluon {g * 1e3:7.1f} us  Triton {t * 1e3:7.1f} us  Triton / Gluon "
                  f"{t / g:.3f}")
            row.update({f"gluon_{mode}_ms": g, f"triton_{mode}_ms": t,
                        f"gluon_{mode}_times_ms": times[(name, "gluon", mode)],
                        f"triton_{mode}_times_ms": times[(name, "triton", mode)]})
        rows.append(row)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=rounds, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
