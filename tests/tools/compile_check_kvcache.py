"""Compile the KV-cache kernels (split-KV attention, rotary append) for sm_90 without a GPU.

Covers the addressing modes (contiguous, block table per key row, one page id per tile,
kv_indptr tables), varlen queries (batch prefill) and the feature flags, at the tile
shapes of the registry's CUDA configs and of the bench variants; prints the shared memory
each needs (an sm_90 block may use 232448 bytes) and whether the K/V loads are software
pipelined (cp.async in the PTX). Integer arguments that Triton's runtime would see as
multiples of 16 (strides, head dims, page size) are marked so, as at run time; without
that the head-dim masks keep the loads scalar and nothing is pipelined. Usage:
    PYTHONPATH=src python tests/tools/compile_check_kvcache.py
"""

from __future__ import annotations

import sys
import time

import triton
from compile_check import TARGET, signature
from triton.compiler import ASTSource

from fmha.kernels.triton import kvcache

SMEM_LIMIT = 232448
FEATURES = ("ALIGN_BOTTOM_RIGHT", "HAS_LEFT", "HAS_RIGHT", "HAS_SINK_TOKENS", "HAS_SOFTCAP", "HAS_ALIBI",
            "HAS_SINKS")
# (dtype, block_m, block_n, warps, stages, head_dim)
TILES = [("bf16", 16, 64, 4, 3, 128), ("bf16", 16, 64, 4, 4, 128), ("bf16", 16, 128, 4, 3, 128),
         ("bf16", 16, 128, 8, 3, 128), ("bf16", 16, 32, 4, 4, 128), ("bf16", 16, 32, 4, 2, 256),
         ("bf16", 64, 64, 4, 2, 128), ("bf16", 64, 32, 4, 2, 256), ("fp32", 16, 32, 4, 2, 256),
         ("fp32", 32, 32, 4, 1, 256)]
# addressing: (PAGED, TABLE_INDPTR, PAGE_PER_TILE, HAS_CACHE_BATCH_IDX)
MODES = {"contiguous": (False, False, False, True), "paged rows": (True, False, False, False),
         "paged tiles": (True, False, True, False), "indptr tiles": (True, True, True, False),
         "indptr rows": (True, True, False, False)}


def compiled_with_runtime_divisibility(kernel, pointers, floats, constexprs, warps, stages):
    """The kernel compiled for sm_90 with the arguments a launch sees as multiples of 16 marked so
    (pointers, page size, head dims, the tensors' strides; not ALiBi's or the fp8 descales')."""
    sig = signature(kernel, pointers, floats, constexprs)
    descale_strides = ("stride_kdb", "stride_kdh", "stride_vdb", "stride_vdh")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name in pointers or name in ("page_size", "head_dim_qk", "head_dim_v", "head_dim")
             or (name.startswith("stride_") and "alibi" not in name and name not in descale_strides)}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=TARGET,
                          options={"num_warps": warps, "num_stages": stages})


def compile_with_runtime_divisibility(kernel, pointers, floats, constexprs, warps, stages):
    """(shared memory, cp.async instructions in the PTX) of `compiled_with_runtime_divisibility`."""
    compiled = compiled_with_runtime_divisibility(kernel, pointers, floats, constexprs, warps, stages)
    ptx = compiled.asm["ptx"]
    return compiled.metadata.shared, ptx.count("cp.async.cg") + ptx.count("cp.async.ca")


def splitkv_jobs():
    for dt, bm, bn, w, s, d in TILES:
        for mode, (paged, indptr, per_tile, batch_idx) in MODES.items():
            if mode in ("indptr rows", "contiguous") and (dt, bm, bn, w, s) != TILES[0][:5]:
                continue  # same code paths as "paged rows" / the paged modes: once is enough
            for varlen, features, split in ((False, False, True), (bm >= 32, True, False)):
                # pages of 16 (a shift) in the row modes; the usual cache: int32 offsets, K/V alike
                constexprs = dict(PAGED=paged, TABLE_INDPTR=indptr, PAGE_PER_TILE=per_tile,
                                  PAGE_SHIFT=4 if paged and not per_tile else -1, OFFSETS_32=True,
                                  KV_SAME_STRIDES=True, FP8_ASM=False, FP8_K_AT_DOT=False, F16_DOTS=False,
                                  HAS_CACHE_BATCH_IDX=batch_idx, IS_VARLEN=varlen, SPLIT=split, KV_FP8=False,
                                  LAUNCH_DEPENDENTS=split,  # (sm_90: the combine follows by PDL)
                                  DOT_PRECISION="ieee", BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQK=d, BLOCK_DV=d,
                                  **dict.fromkeys(FEATURES, features))
                out = "fp32" if split else dt
                pointers = {"Q": dt, "K": dt, "V": dt, "O": out, "LSE": "fp32", "Alibi": "fp32", "Sinks": "fp32",
                            **dict.fromkeys(("BlockTable", "KvIndptr", "CacheBatchIdx", "SeqlensK", "CuSeqlensQ",
                                             "KDescale", "VDescale"), "i32")}
                label = f"splitkv {dt} m{bm} n{bn} w{w} s{s} d{d} {mode} varlen={varlen} features={features}"
                yield label, kvcache.splitkv_kernel, pointers, {"scale", "softcap"}, constexprs, w, s


def append_jobs():
    for paged, indptr, varlen, rotate in ((True, False, False, True), (True, True, True, True),
                                          (False, False, True, False), (True, True, False, False)):
        constexprs = dict(PAGED=paged, TABLE_INDPTR=indptr, HAS_CACHE_BATCH_IDX=not paged, IS_VARLEN=varlen,
                          ROTATE=rotate, INTERLEAVED=False, DST_AT_BASE=True, BLOCK_T=16, BLOCK_D=128)
        pointers = {"Src": "bf16", "Dst": "bf16", "Cos": "fp32", "Sin": "fp32",
                    **dict.fromkeys(("BlockTable", "KvIndptr", "CacheBatchIdx", "Base", "CuSeqlens"), "i32")}
        label = f"rotary_append paged={paged} indptr={indptr} varlen={varlen} rotate={rotate}"
        yield label, kvcache.rotary_append_kernel, pointers, set(), constexprs, 4, 1


def main() -> int:
    failures = 0
    for label, kernel, pointers, floats, constexprs, warps, stages in [*splitkv_jobs(), *append_jobs()]:
        t = time.time()
        try:
            shared, async_copies = compile_with_runtime_divisibility(kernel, pointers, floats, constexprs, warps,
                                                                     stages)
            over = shared > SMEM_LIMIT
            failures += over
            print(f"{'OVER' if over else 'ok  '} {label} smem={shared} cp.async={async_copies} "
                  f"({time.time() - t:.1f}s)", flush=True)
        except Exception as e:  # report every failure, keep going
            failures += 1
            print(f"FAIL {label}: {str(e)[:2000]}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
