"""Run one decode shape a few times, each call after a 256 MB fill (do_bench's cache flush), for
a profiler (ncu) to pick one call's kernel: fmha's split-KV kernel or SDPA cuDNN's (--backend
cudnn), to compare their DRAM traffic after a written flush (docs/performance.md, attempt 76).

    ncu --cache-control none --clock-control none --replay-mode application \
        -k regex:"splitkv_kernel|fort_native" --launch-skip 2 --launch-count 1 \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python tools/decode_profile_one.py [--backend cudnn] [--seqlen 8192 --batch 32] [--head-dim 128] [--flush read]

--flush read: the fill only reads the buffer (L2 left clean). --fp8-cache: fmha's cache in float8 e4m3
with per-(batch, KV head) descales (bf16 queries).
"""

from __future__ import annotations

import argparse

import torch
from decode_kernel_times import l2_fill  # (tools/ is this script's directory)

from fmha.bench.decode import DecodeShape, _call, _inputs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=0)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--backend", choices=("fmha", "cudnn"), default="fmha")
    p.add_argument("--flush", choices=("write", "read"), default="write")
    p.add_argument("--fp8-cache", action="store_true")
    a = p.parse_args()
    shape = DecodeShape(a.batch, 32, 8, a.seqlen, a.head_dim, page_size=a.page_size, fp8_cache=a.fp8_cache)
    fmha_args, sdpa_args = _inputs(shape, "cuda")
    call = _call(a.backend, fmha_args, sdpa_args)
    flush = l2_fill(a.flush)
    for _ in range(a.calls):
        flush()
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
