"""Probe for issue 5 (docs/performance.md, Next item 4): does a decode kernel that copies its K/V
tiles by TMA (device-side tensor descriptors, one box a tile) read the cache faster than the
16-byte cp.async copies of `kvcache.splitkv_kernel`, which sits 1% behind cuDNN in the cold
(written flush) timing?

The probe kernel is the plain decode only (bf16/fp16, one query token, GQA packed into the
tile's rows, no masks or features), contiguous or paged with a page per tile. A contiguous
cache gets a descriptor per program bounded by the sequence's key count (TMA fills the rows past
it with zeros); a paged one a descriptor over all pages' rows, V's rows past the key count zeroed
in registers on the last tile. Its output is checked against fmha's before timing.

GPU times from torch's profiler (`decode_kernel_times.profiled`), medians over rounds of medians;
contenders alternate each round (cuDNN, fmha, the probe tiles), each call after a 256 MB fill
(do_bench's written flush), a read flush, or warm.

    PYTHONPATH=src python tools/decode_tma_probe.py [--rounds 3] [--calls 50]
        [--tiles 64:4:3,128:4:3] [--flush write,read,warm] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from decode_kernel_times import dispatcher_for, kernel_count, l2_fill, profiled  # (tools/: the script's directory)

import fmha
from fmha.bench.decode import DecodeShape, _call, _inputs
from fmha.kvcache import attention_with_kvcache

LOG2E = 1.4426950408889634
SHAPES = [DecodeShape(32, 32, 8, 8192, 128), DecodeShape(32, 32, 8, 8192, 128, page_size=128),
          DecodeShape(8, 32, 8, 32768, 128), DecodeShape(32, 32, 8, 8192, 128, page_size=64)]


@triton.jit
def tma_decode_kernel(Q, K, V, O, SeqlensK, BlockTable,
                      stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_ob, stride_oh,
                      stride_btb, page_size, cache_rows, nheads_k, group_size, scale_log2,
                      PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // nheads_k
    hk = pid % nheads_k
    len_k = tl.load(SeqlensK + b)
    r = tl.arange(0, BLOCK_M)
    row_ok = r < group_size
    h = hk * group_size + r
    d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if PAGED:
        k_desc = tl.make_tensor_descriptor(K + hk * stride_kh, shape=[cache_rows, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V + hk * stride_kh, shape=[cache_rows, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, D])
    else:
        k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + hk * stride_kh, shape=[len_k, D],
                                           strides=[stride_kn, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V + b64 * stride_kb + hk * stride_kh, shape=[len_k, D],
                                           strides=[stride_kn, 1], block_shape=[BLOCK_N, D])
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    page_next = 0
    if PAGED:
        page_next = tl.load(BlockTable + b64 * stride_btb)
    for n0 in range(0, len_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        row = n0
        if PAGED:
            page = page_next
            nxt = n0 + BLOCK_N
            page_next = tl.load(BlockTable + b64 * stride_btb + nxt // page_size, mask=nxt < len_k, other=0)
            row = page * page_size + n0 % page_size
        k = k_desc.load([row, 0])
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row, 0])
        if PAGED:
            v = tl.where(col_ok[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + b64 * stride_ob + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])


def probe_call(args: dict, tile: tuple[int, int, int]):
    """A function running the probe kernel on fmha's decode arguments (q, caches, block_table)."""
    block_n, warps, stages = tile
    q, kc, vc = args["q"], args["k_cache"], args["v_cache"]
    seqlens, table = args["cache_seqlens"], args.get("block_table")
    b, _, hq, d = q.shape
    hk = kc.shape[2]
    o = torch.empty_like(q)
    paged = table is not None
    if paged:
        assert kc.stride(0) == kc.shape[1] * kc.stride(1) and kc.shape[1] % block_n == 0
    grid = (b * hk,)

    def run():
        tma_decode_kernel[grid](q, kc, vc, o, seqlens, table if paged else seqlens,
                                q.stride(0), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
                                o.stride(0), o.stride(2), table.stride(0) if paged else 0,
                                kc.shape[1] if paged else 1, kc.shape[0] * kc.shape[1], hk, hq // hk,
                                d ** -0.5 * LOG2E, PAGED=paged, BLOCK_M=16, BLOCK_N=block_n, D=d,
                                num_warps=warps, num_stages=stages)
        return o
    return run


def timed(fn, calls: int, kind: str) -> tuple[float, float]:
    """(median span, median kernel time) in us of a call of fn: span from the flush's end (or the
    call's first kernel's start, warm) to the call's last kernel's end; kernel time the sum of the
    call's kernels (`decode_kernel_times.profiled`)."""
    flush = l2_fill(kind) if kind != "warm" else None
    per_kernel, spans = profiled(fn, calls, flush, kernel_count(flush) if flush is not None else 0)
    kernels = [sum(v[i] for k, v in per_kernel.items() if k != "gap") for i in range(calls)]
    return statistics.median(spans), statistics.median(kernels)


def head_major(fmha_args: dict, sdpa_args: tuple) -> tuple[dict, tuple]:
    """The same contiguous caches stored head-major, (B, Hk, S, D) (FlashInfer's HND), as
    (B, S, Hk, D) views: each (batch, KV head) a contiguous stream; SDPA gets them contiguous."""
    kc, vc = (fmha_args[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("k_cache", "v_cache"))
    return dict(fmha_args, k_cache=kc, v_cache=vc), (sdpa_args[0], kc.transpose(1, 2), vc.transpose(1, 2))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--tiles", default="64:4:3,64:4:4,64:4:5,128:4:2,128:8:2")
    parser.add_argument("--fmha-tiles", default="", help="fmha with this decode tile first (cp.async)")
    parser.add_argument("--shapes", default="", help="caches to run: contiguous, paged(64), paged(128)")
    parser.add_argument("--flush", default="write,read")
    parser.add_argument("--head-major", action="store_true", help="contiguous caches stored (B, Hk, S, D)")
    parser.add_argument("--json")
    args = parser.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",") if t]
    fmha_tiles = [tuple(int(v) for v in t.split(":")) for t in args.fmha_tiles.split(",") if t]
    shapes = [s for s in SHAPES if s.label.split(" D=128 ")[1] in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for shape in shapes:
        fmha_args, sdpa_args = _inputs(shape, "cuda")
        if args.head_major:
            fmha_args, sdpa_args = head_major(fmha_args, sdpa_args)
        ref = attention_with_kvcache(**fmha_args)
        runs = {"cudnn": (None, _call("cudnn", fmha_args, sdpa_args)),
                "fmha": (None, lambda: attention_with_kvcache(**fmha_args))}
        for tile in fmha_tiles:
            runs[f"fmha n{tile[0]}w{tile[1]}s{tile[2]}"] = (dispatcher_for(tile),
                                                            lambda: attention_with_kvcache(**fmha_args))
        for tile in tiles:
            if (shape.page_size and shape.page_size % tile[0]) or shape.batch * shape.nhead_k < 132:
                continue  # (the probe has no split-KV: fewer programs than SMs would be no test)
            fn = probe_call(fmha_args, tile)
            err = (fn().float() - ref.float()).abs().max().item()
            print(f"{shape.label} probe n{tile[0]}w{tile[1]}s{tile[2]}: max |probe - fmha| {err:.2e}", flush=True)
            if err > 2e-2:
                raise SystemExit("probe output differs from fmha's")
            runs[f"tma n{tile[0]}w{tile[1]}s{tile[2]}"] = (None, fn)
        for kind in args.flush.split(","):
            names = list(runs)
            spans = {n: [] for n in names}
            kernels = {n: [] for n in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    dispatcher, fn = runs[name]
                    fmha.set_dispatcher(dispatcher)
                    span, kernel = timed(fn, args.calls, kind)
                    spans[name].append(span)
                    kernels[name].append(kernel)
            base = statistics.median(spans["cudnn"])
            for name in names:
                t, k = statistics.median(spans[name]), statistics.median(kernels[name])
                tb = shape.kv_bytes("cudnn") / t / 1e6
                rows.append({"shape": shape.label, "flush": kind, "contender": name, "span_us": t, "kernel_us": k,
                             "tbps": tb})
                print(f"{shape.label:58s} {kind:5s} {name:16s} span {t:7.1f} us (kernels {k:7.1f})  {tb:5.2f} TB/s"
                      f"  cuDNN/this {base / t:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "calls": args.calls, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
