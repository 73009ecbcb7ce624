"""Decode bandwidth on a GPU: fmha.attention_with_kvcache (contiguous, paged through a
block table with pages of 16/64/256 in shuffled order and 16 in order, FlashInfer-style
indptr tables; contiguous and pages of 16 also with the addressing of before, as an A/B
control) against SDPA cuDNN and SDPA flash, plus variants of the split-KV kernel (BLOCK_N, warps, stages) and forced
split counts (block table and indptr tables alike), so one run shows which config and
split policy to keep.

Bandwidth = bytes of K and V in the cache (full caches: B * S * Hk * D * 2 tensors) over
the median time. Contenders are measured in alternating rounds (each round runs every
contender once), and each fmha output is checked against SDPA's. Three times per
contender, because a decode step's kernels (~250 us here) are as short as the Python
that launches them:
- `us`: eager calls under triton's do_bench. When the host path of a call is slower than
  its kernels, this measures the host (do_bench's events wait for the launch);
- `graph_us`: the same call captured in a CUDA graph and replayed: the GPU time alone;
- `host_us`: wall time per call of back-to-back eager calls without synchronising (the
  GPU queue absorbs them): the host path, launches included.
A row with host_us close to us is host-bound. Writes JSON:

    PYTHONPATH=src python tools/decode_bench.py --out $OUT/decode_bench.json [--quick] [--no-graph]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.dispatch.configs import CUDA_ARCHS, KVCACHE_FEATURES, Algorithm, Family, KernelConfig, Signature
from fmha.kernels.triton import kvcache as kvcache_kernels
from fmha.problem import DType, Problem

DEVICE = "cuda"
SHAPES = [(32, 32, 8, 8192, 128), (8, 32, 8, 32768, 128)]  # (B, Hq, Hk, Sk, D), bf16, Sq = 1
DEFAULT_TILE = (64, 4, 3)  # the registry's decode config: BLOCK_N, warps, stages
TILES = [DEFAULT_TILE, (64, 4, 4), (32, 4, 4), (128, 4, 3), (128, 8, 3)]
PAGES = (16, 64, 256)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
LEGACY = " legacy addressing"  # cache kinds also run with the addressing of before (A/B control)


@contextlib.contextmanager
def legacy_addressing():
    """Launches with the older addressing: int64 row offsets, a key's page by an
    integer division by the run-time page size, K and V row offsets computed apart. The same
    kernel source, so the pair times the addressing alone."""
    saved = kvcache_kernels._paging, kvcache_kernels._offsets_fit_int32, kvcache_kernels._same_strides

    def paging(*args):
        return {**saved[0](*args), "PAGE_SHIFT": -1}

    kvcache_kernels._paging = paging
    kvcache_kernels._offsets_fit_int32 = lambda *caches: False
    kvcache_kernels._same_strides = lambda k_cache, v_cache: False
    try:
        yield
    finally:
        kvcache_kernels._paging, kvcache_kernels._offsets_fit_int32, kvcache_kernels._same_strides = saved


def dispatcher_for(tile) -> fmha.Dispatcher:
    """The default registry with a decode config of this tile first (first fit picks it)."""
    block_n, warps, stages = tile
    variant = KernelConfig(Signature(Family.FWD_SPLITKV, (DType.FP16, DType.BF16), CUDA_ARCHS, 128, 1,
                                     KVCACHE_FEATURES), Algorithm(16, block_n, warps, stages))
    return fmha.Dispatcher(fmha.Registry([variant], name="bench").merged(fmha.default_registry()))


def heuristic_splits(dispatcher, B, Hq, Hk, S, D, paged) -> int:
    problem = Problem(batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=1, seqlen_k=S, head_dim_qk=D, head_dim_v=D,
                      arch="sm90", seqused_k=True, paged_kv=paged)
    config, _ = dispatcher.select(problem, Family.FWD_SPLITKV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return dispatcher.num_splits(problem, sms, config.algorithm.block_m, config.algorithm.block_n)


def contenders(B, Hq, Hk, S, D, quick: bool):
    """(name, tile, cache kind, forced splits or 0, fn-builder) of one shape."""
    q = torch.randn(B, 1, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    kc = torch.randn(B, S, Hk, D, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.randn(B, S, Hk, D, device=DEVICE, dtype=torch.bfloat16)
    seqlens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    caches = {"contiguous": dict(k_cache=kc, v_cache=vc, cache_seqlens=seqlens)}
    for page in PAGES:
        n = B * S // page
        table = torch.randperm(n, device=DEVICE).int().reshape(B, S // page)  # shuffled pages
        kp = torch.empty(n, page, Hk, D, device=DEVICE, dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        kp[table.long()] = kc.reshape(B, S // page, page, Hk, D)  # same keys, scattered
        vp[table.long()] = vc.reshape(B, S // page, page, Hk, D)
        caches[f"paged({page})"] = dict(k_cache=kp, v_cache=vp, cache_seqlens=seqlens, block_table=table)
        if page == 16:  # the same pages in order: the cost of scattering apart from the paging itself
            in_order = torch.arange(n, device=DEVICE, dtype=torch.int32).reshape(B, S // page)
            caches["paged(16) in order"] = dict(k_cache=kc.reshape(n, page, Hk, D), v_cache=vc.reshape(n, page, Hk, D),
                                               cache_seqlens=seqlens, block_table=in_order)
        if page == 64:
            caches["indptr(64)"] = dict(
                k_cache=kp, v_cache=vp, kv_indices=table.reshape(-1).contiguous(),
                kv_indptr=torch.arange(0, B * (S // page) + 1, S // page, device=DEVICE, dtype=torch.int32),
                kv_last_page_len=torch.full((B,), page, dtype=torch.int32, device=DEVICE))
    for kind in ("contiguous", "paged(16)"):
        caches[kind + LEGACY] = caches[kind]
    runs = []
    for kind in caches:  # the default tile, every cache kind
        runs.append((DEFAULT_TILE, kind, 0))
    tiles = TILES[:2] if quick else TILES
    for tile in tiles[1:]:
        for kind in ("contiguous", "paged(64)", "indptr(64)"):
            runs.append((tile, kind, 0))
    for splits in (SPLITS[:4] if quick else SPLITS):
        for kind in ("contiguous", "paged(64)", "indptr(64)"):
            runs.append((DEFAULT_TILE, kind, splits))
    qs, kq, vq = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qs, kq, vq, enable_gqa=True)
        return fn
    return q, caches, runs, {"sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                             "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def fmha_fn(q, cache, splits, legacy: bool = False):
    def fn():
        with legacy_addressing() if legacy else contextlib.nullcontext():
            return fmha.attention_with_kvcache(q, **cache, num_splits=splits)
    return fn


def timed(entry) -> float:
    """Median ms of one contender, with its dispatcher installed (outside the timed calls)."""
    fmha.set_dispatcher(entry.get("dispatcher"))
    try:
        return triton.testing.do_bench(entry["fn"], warmup=10, rep=40, return_mode="median")
    finally:
        fmha.set_dispatcher(None)


def host_us(entry, calls: int = 30) -> float:
    """Host time per call: back-to-back calls without synchronising (the GPU's queue takes
    them), after a synchronise; the wall time until the last call returns."""
    fmha.set_dispatcher(entry.get("dispatcher"))
    try:
        fn = entry["fn"]
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6
    finally:
        fmha.set_dispatcher(None)


def graphed(entry):
    """The contender captured in a CUDA graph (its dispatcher installed while capturing):
    the replay runs its kernels with no Python in between."""
    fmha.set_dispatcher(entry.get("dispatcher"))
    try:
        fn = entry["fn"]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    finally:
        fmha.set_dispatcher(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer variants (a smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"{device}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    report = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "shapes": []}
    for B, Hq, Hk, S, D in SHAPES:
        t0 = time.time()
        q, caches, runs, baselines = contenders(B, Hq, Hk, S, D, args.quick)
        kv_bytes = 2 * B * S * Hk * D * 2
        truth = baselines["sdpa cudnn"]().transpose(1, 2)
        entries = {}
        for name, fn in baselines.items():
            entries[name] = dict(name=name, fn=fn)
        for tile, kind, splits in runs:
            fn, dispatcher = fmha_fn(q, caches[kind], splits, kind.endswith(LEGACY)), dispatcher_for(tile)
            used = splits or heuristic_splits(dispatcher, B, Hq, Hk, S, D, not kind.startswith("contiguous"))
            name = f"fmha {kind} n{tile[0]}w{tile[1]}s{tile[2]} splits={'auto' if not splits else splits}"
            fmha.set_dispatcher(dispatcher)
            try:
                err = float((fn().float() - truth.float()).abs().max())
            except Exception as e:  # a variant that cannot run (e.g. shared memory) is reported, not fatal
                print(f"{name}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                entries[name] = dict(name=name, error=str(e)[:500])
                continue
            finally:
                fmha.set_dispatcher(None)
            entries[name] = dict(name=name, fn=fn, dispatcher=dispatcher, kind=kind, block_n=tile[0],
                                 warps=tile[1], stages=tile[2], splits=splits or "auto", splits_used=used,
                                 max_abs_diff_vs_cudnn=err)
        graphs = {}
        for name, entry in entries.items():
            if "fn" in entry and not args.no_graph:
                try:
                    graphs[name] = graphed(entry)
                except Exception as e:  # reported; the eager timings still run
                    entry["graph_error"] = str(e)[:500]
                    print(f"{name}: graph capture failed: {str(e).splitlines()[0][:200]}", flush=True)
        times: dict[str, list[float]] = {}
        graph_times: dict[str, list[float]] = {}
        host_times: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # alternate contenders
            for name, entry in entries.items():
                if "fn" not in entry:
                    continue
                try:
                    ms = timed(entry)
                    host_times.setdefault(name, []).append(host_us(entry))
                except Exception as e:
                    entry.pop("fn")
                    entry["error"] = str(e)[:500]
                    print(f"{name}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                times.setdefault(name, []).append(ms)
                if name in graphs:
                    graph_times.setdefault(name, []).append(
                        triton.testing.do_bench(graphs[name].replay, warmup=10, rep=40, return_mode="median"))
        rows = []
        for name, entry in entries.items():
            entry.pop("fn", None)
            entry.pop("dispatcher", None)
            if name in times:
                ms = statistics.median(times[name])
                entry.update(us=ms * 1e3, tb_per_s=kv_bytes / ms / 1e9, rounds_us=[t * 1e3 for t in times[name]])
            if name in host_times:
                entry["host_us"] = statistics.median(host_times[name])
            if name in graph_times:
                gms = statistics.median(graph_times[name])
                entry.update(graph_us=gms * 1e3, graph_tb_per_s=kv_bytes / gms / 1e9)
            rows.append(entry)
        del graphs
        cudnn_us = entries["sdpa cudnn"].get("us")
        fmha_rows = [r for r in rows if r["name"].startswith("fmha") and "us" in r]
        best = {}
        for kind in caches:
            of_kind = [r for r in fmha_rows if r["kind"] == kind]
            if of_kind:
                b = min(of_kind, key=lambda r: r["us"])
                best[kind] = dict(name=b["name"], us=b["us"], tb_per_s=b["tb_per_s"],
                                  vs_cudnn=(cudnn_us / b["us"]) if cudnn_us else None)
                auto = [r for r in of_kind if r["splits"] == "auto" and r["block_n"] == DEFAULT_TILE[0]
                        and (r["warps"], r["stages"]) == DEFAULT_TILE[1:]]
                if auto:  # what a user gets: the default tile and num_splits=0
                    best[kind]["default"] = dict(name=auto[0]["name"], us=auto[0]["us"],
                                                 graph_us=auto[0].get("graph_us"), host_us=auto[0].get("host_us"),
                                                 vs_cudnn=(cudnn_us / auto[0]["us"]) if cudnn_us else None)
        shape = dict(B=B, Hq=Hq, Hk=Hk, Sk=S, D=D, dtype="bf16", kv_bytes=kv_bytes)
        report["shapes"].append(dict(shape=shape, results=rows, best_per_cache=best, seconds=time.time() - t0))
        print(f"\nB={B} Hq={Hq} Hk={Hk} S={S} D={D}  ({time.time() - t0:.0f} s)")
        print(f"  {'contender':<48} {'eager':>11} {'':>11} {'graph':>11} {'host':>9}  (us: time per call)")
        for r in sorted(rows, key=lambda r: r.get("us", float("inf"))):
            if "us" in r:
                graph = f"{r['graph_us']:8.1f} us" if "graph_us" in r else f"{'-':>11}"
                host = f"{r['host_us']:6.1f} us" if "host_us" in r else f"{'-':>9}"
                bound = " host-bound" if r.get("host_us", 0) >= 0.8 * r["us"] else ""
                extra = f" used={r['splits_used']} diff={r['max_abs_diff_vs_cudnn']:.1e}" if "splits_used" in r else ""
                print(f"  {r['name']:<48} {r['us']:8.1f} us {r['tb_per_s']:6.2f} TB/s {graph} {host}{bound}{extra}")
        for kind, b in best.items():
            print(f"  best {kind:<12} {b['name']}: {b['tb_per_s']:.2f} TB/s, x{b['vs_cudnn'] or 0:.2f} of cuDNN")
            if "default" in b:
                d = b["default"]
                graph = f"{d['graph_us']:.1f} us" if d["graph_us"] is not None else "-"
                host = f"{d['host_us']:.1f} us" if d["host_us"] is not None else "-"
                print(f"       default (num_splits=0): {d['us']:.1f} us, x{d['vs_cudnn'] or 0:.2f} of cuDNN, "
                      f"graph {graph}, host {host}")
        del q, caches, runs, baselines
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
