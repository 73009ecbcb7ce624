"""The fp8-cache decode at D=64, 128 and 256: the Gluon decode (kernels/kvcache_gluon.py, the
registry's choice) against the Triton split-KV kernel on the same float8 cache (a registry without
the Gluon configs), fmha over a bf16 cache and SDPA's cuDNN backend over the same keys in bf16.
B=32 S=8192 and B=8 S=32768, Hq=32 Hk=8, bf16 queries, e4m3 cache with per-(batch, KV head)
descales; contiguous and pages of 64 (cuDNN has no paged row). GPU time of a CUDA-graph replay
(triton's do_bench_cudagraph), medians over alternating rounds; each row's ratios are the
reference's time (cuDNN, or the bf16 cache where cuDNN has no row) over the contender's.
Attempt 111 of docs/performance.md (`docs/runs/2026-12-02-session28/bench_d.log`).

    PYTHONPATH=src python tools/decode_head_dims_bench.py [ROUNDS] [OUT.json]
"""

import contextlib
import json
import sys

import torch
import triton

import fmha
from fmha.api import use_dispatcher
from fmha.bench.decode import DecodeShape, _call, _inputs
from fmha.dispatch.configs import Family
from fmha.kernels.launch import plan_tables


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    triton_only = fmha.Dispatcher(fmha.Registry(
        [c for c in fmha.default_registry() if not (c.family == Family.FWD_SPLITKV and c.algorithm.pipeline.is_gluon)],
        name="triton decode"))
    rows = []
    for head_dim in (64, 128, 256):
        for batch, seqlen in ((32, 8192), (8, 32768)):
            for page in (0, 64):
                args8, sdpa = _inputs(DecodeShape(batch, 32, 8, seqlen, head_dim, "bf16", page, True), "cuda")
                args16, _ = _inputs(DecodeShape(batch, 32, 8, seqlen, head_dim, "bf16", page, False), "cuda")
                contenders = {"cudnn": (_call("cudnn", args8, sdpa), None),
                              "fmha bf16 cache": (_call("fmha", args16, None), None),
                              "fp8 Triton": (_call("fmha", args8, None), triton_only),
                              "fp8 Gluon": (_call("fmha", args8, None), None)}
                if page:
                    del contenders["cudnn"]
                times: dict[str, list[float]] = {name: [] for name in contenders}
                for _ in range(rounds):
                    for name, (call, dispatcher) in contenders.items():
                        plan_tables.clear_plans()  # (a call plan keeps the kernel its first call chose)
                        with use_dispatcher(dispatcher) if dispatcher else contextlib.nullcontext():
                            if name.startswith("fp8"):
                                chosen = fmha.explain_kvcache(**args8).splitlines()[1]
                                assert ("_gluon_" in chosen) == (name == "fp8 Gluon"), chosen
                            call()  # (compiled before the capture)
                            times[name].append(triton.testing.do_bench_cudagraph(call, rep=100,
                                                                                 return_mode="median"))
                        plan_tables.clear_plans()
                median = {name: sorted(t)[rounds // 2] for name, t in times.items()}
                reference = median.get("cudnn", median["fmha bf16 cache"])
                print(f"D={head_dim:3d} B={batch:2d} S={seqlen:5d} {'paged(64)' if page else 'contiguous':10s} "
                      + "  ".join(f"{name} {ms * 1e3:6.1f} us ({reference / ms:.3f})" for name, ms in median.items()),
                      flush=True)
                rows.append(dict(D=head_dim, B=batch, S=seqlen, page_size=page, median_ms=median, times_ms=times))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=rounds, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
