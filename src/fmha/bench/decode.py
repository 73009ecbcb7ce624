"""`fmha bench --decode`: decode steps (one query token a sequence) over a KV cache, fmha's
`attention_with_kvcache` against SDPA's cuDNN and FlashAttention-2 backends, side by side.

A decode step reads the whole cache once, so its speed is a bandwidth: bytes of K and V read
over the median time of a call. fmha reads its own cache (contiguous, or paged through a
block table of shuffled pages; 16-bit or float8 e4m3 with per-(batch, KV head) descales); the
SDPA contenders read the same keys as a 16-bit (B, Hk, S, D) view of the contiguous cache. The
ratio is a speed ratio, cuDNN's time over fmha's, so a float8 cache's fewer bytes count.
Contenders alternate within each round; each fmha output is checked against SDPA's.
`tools/decode_bench.py` has the finer controls (tiles, forced splits, CUDA-graph replays).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .suite import check_sizes

DECODE_CONTENDERS: tuple[str, ...] = ("fmha", "cudnn", "flash")


@dataclass(frozen=True)
class DecodeShape:
    """One decode problem: q (B, 1, Hq, D) over a cache of seqlen_k keys a sequence."""

    batch: int
    nhead_q: int
    nhead_k: int
    seqlen_k: int
    head_dim: int
    dtype: str = "bf16"  # the queries' and the 16-bit cache's: bf16 or fp16
    page_size: int = 0  # 0: a contiguous cache; else pages of this many keys, shuffled
    fp8_cache: bool = False  # fmha's cache in float8 e4m3 (SDPA still reads the 16-bit keys)

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp16"):
            raise ValueError(f"dtype={self.dtype!r} is not supported for decode; accepted: ['bf16', 'fp16']")
        check_sizes(self, ("batch", "nhead_q", "nhead_k", "seqlen_k", "head_dim"))
        if self.page_size < 0 or (self.page_size and self.seqlen_k % self.page_size):
            raise ValueError(f"page_size={self.page_size} must be 0 or divide seqlen_k={self.seqlen_k}")

    @property
    def label(self) -> str:
        cache = f"paged({self.page_size})" if self.page_size else "contiguous"
        return (f"decode {self.dtype} B={self.batch} Hq={self.nhead_q} Hk={self.nhead_k} S={self.seqlen_k} "
                f"D={self.head_dim} {cache}" + (" fp8 cache" if self.fp8_cache else ""))

    def kv_bytes(self, contender: str) -> int:
        """Bytes of K and V that `contender` reads in one call."""
        element = 1 if self.fp8_cache and contender == "fmha" else 2
        return 2 * self.batch * self.seqlen_k * self.nhead_k * self.head_dim * element


def decode_suite() -> list[DecodeShape]:
    """The decode shapes of the inference issue (B=32 at 8k keys, B=8 at 32k; Hq=32, Hk=8,
    D=128, bf16), each over a contiguous cache and pages of 64, in bf16 and float8."""
    return [DecodeShape(batch, 32, 8, seqlen, 128, "bf16", page, fp8)
            for batch, seqlen in ((32, 8192), (8, 32768)) for fp8 in (False, True) for page in (0, 64)]


def _inputs(shape: DecodeShape, device: str | torch.device) -> tuple[dict, Any]:
    """(fmha's keyword arguments besides q, and the SDPA contenders' (q, k, v) in bhsd) with
    q under "q"."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    b, s, hk, d = shape.batch, shape.seqlen_k, shape.nhead_k, shape.head_dim

    def randn(*size):
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, kc, vc = randn(b, 1, shape.nhead_q, d), randn(b, s, hk, d), randn(b, s, hk, d)
    args: dict[str, Any] = {"cache_seqlens": torch.full((b,), s, dtype=torch.int32, device=device)}
    caches = (kc, vc)
    if shape.fp8_cache:  # per-(batch, KV head) descales: the cache holds x / descale
        descales = [c.float().abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max for c in caches]
        caches = tuple((c.float() / dd[:, None, :, None]).to(torch.float8_e4m3fn)
                       for c, dd in zip(caches, descales, strict=True))
        args.update(k_descale=descales[0], v_descale=descales[1])
        # SDPA reads the float8 cache's values, dequantized to q's dtype
        kc, vc = ((c.float() * dd[:, None, :, None]).to(dtype) for c, dd in zip(caches, descales, strict=True))
    if shape.page_size:
        pages = b * s // shape.page_size
        table = torch.randperm(pages, generator=gen, device=device).int().reshape(b, -1)
        paged = []
        for c in caches:
            p = torch.empty((pages, shape.page_size, hk, d), dtype=c.dtype, device=device)
            p[table.long()] = c.reshape(b, -1, shape.page_size, hk, d)
            paged.append(p)
        caches = tuple(paged)
        args["block_table"] = table
    args.update(q=q, k_cache=caches[0], v_cache=caches[1])
    return args, (q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))


def _call(name: str, fmha_args: dict, sdpa_args: tuple) -> Callable[[], torch.Tensor]:
    """A call of contender `name`, returning (B, 1, Hq, D)."""
    if name == "fmha":
        from ..kvcache import attention_with_kvcache

        return lambda: attention_with_kvcache(**fmha_args)
    if name in ("cudnn", "flash"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call():
            with sdpa_kernel(backend):
                return sdpa(*sdpa_args, enable_gqa=True).transpose(1, 2)
        return call
    raise ValueError(f"contender {name!r} has no decode call; accepted: {list(DECODE_CONTENDERS)}")


def run_decode_suite(shapes: Sequence[DecodeShape], contenders: Sequence[str] = DECODE_CONTENDERS,
                     rounds: int = 3, *, timer: Callable[[Callable[[], Any]], float],
                     device: str | torch.device = "cuda",
                     host_timer: Callable[[Callable[[], Any]], float] | None = None) -> list[dict]:
    """Time every contender on every shape, alternating within each round; one dict per
    (shape, contender): the shape's fields and label, "mode" ("decode"), "contender", "ok",
    "error", "time_ms" (median over rounds), "times_ms", "kv_bytes", "tb_per_s", "max_abs_diff"
    (against cuDNN's output if it ran, else the first contender's), "diff_against" and "host_ms"
    (median of `host_timer(fn)` after each round, the host time a call; None without one).
    `timer(fn)` gives one round's milliseconds (`triton.testing.do_bench` on the GPU);
    `host_timer`: `bench.host_ms_per_call` there, so that `bench.host_bound_rows` can tell
    which rows measured the host path rather than the kernels."""
    rows = []
    for shape in shapes:
        fmha_args, sdpa_args = _inputs(shape, device)
        calls, outs, errors = {}, {}, {}
        for name in contenders:
            try:  # a contender that cannot run is reported, never stops the run
                calls[name] = _call(name, fmha_args, sdpa_args)
                outs[name] = calls[name]()
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                calls.pop(name, None)
        times: dict[str, list[float]] = {name: [] for name in calls}
        hosts: dict[str, list[float]] = {name: [] for name in calls}
        for round_ in range(rounds):
            names = list(calls)
            for name in names[round_ % max(len(names), 1):] + names[:round_ % max(len(names), 1)]:
                times[name].append(timer(calls[name]))
                if host_timer is not None:
                    hosts[name].append(host_timer(calls[name]))
        ref = "cudnn" if "cudnn" in outs else next(iter(outs), None)
        for name in contenders:
            ok = name in times and bool(times[name])
            t = statistics.median(times[name]) if ok else None
            diff = float((outs[name].float() - outs[ref].float()).abs().max()) if ok and ref is not None else None
            rows.append({"shape": shape.label, **asdict(shape), "mode": "decode", "contender": name, "ok": ok,
                         "error": errors.get(name), "time_ms": t, "times_ms": times.get(name, []),
                         "kv_bytes": shape.kv_bytes(name),
                         "tb_per_s": shape.kv_bytes(name) / (t * 1e-3) / 1e12 if ok and t > 0 else None,
                         "max_abs_diff": diff, "diff_against": ref if diff is not None else None,
                         "host_ms": statistics.median(hosts[name]) if ok and hosts[name] else None})
        del fmha_args, sdpa_args, calls, outs
    return rows


def decode_summary(results: Sequence[dict]) -> dict:
    """{"geomean_cudnn_over_fmha": geometric mean over the shapes where both ran of cuDNN's time
    over fmha's (None if none), "shapes": how many, "total": shapes in the results}."""
    by_shape: dict[str, dict[str, dict]] = {}
    for r in results:
        by_shape.setdefault(r["shape"], {})[r["contender"]] = r
    ratios = [rows["cudnn"]["time_ms"] / rows["fmha"]["time_ms"] for rows in by_shape.values()
              if rows.get("fmha", {}).get("ok") and rows.get("cudnn", {}).get("ok")]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    return {"geomean_cudnn_over_fmha": geomean, "shapes": len(ratios), "total": len(by_shape)}


def render_decode_table(results: Sequence[dict], contenders: Sequence[str] = DECODE_CONTENDERS) -> Any:
    """A rich Table: per shape each contender's time (us) and TB/s of K+V, and fmha's speed
    against cuDNN (cuDNN's time over fmha's)."""
    from rich.table import Table

    table = Table(title="decode: us a call (TB/s of K+V)")
    table.add_column("shape")
    for name in contenders:
        table.add_column(name, justify="right")
    table.add_column("cudnn/fmha time", justify="right")
    by_shape: dict[str, dict[str, dict]] = {}
    for r in results:
        by_shape.setdefault(r["shape"], {})[r["contender"]] = r
    for label, rows in by_shape.items():
        cells = []
        for name in contenders:
            r = rows.get(name)
            cells.append("n/a" if r is None or not r["ok"] else f"{r['time_ms'] * 1e3:.1f} ({r['tb_per_s']:.2f})")
        fmha, cudnn = rows.get("fmha"), rows.get("cudnn")
        speed = (f"{cudnn['time_ms'] / fmha['time_ms']:.3f}" if fmha and cudnn and fmha["ok"] and cudnn["ok"]
                 else "")
        table.add_row(label, *cells, speed)
    return table


__all__ = ["DecodeShape", "decode_suite", "run_decode_suite", "decode_summary", "render_decode_table",
           "DECODE_CONTENDERS"]
