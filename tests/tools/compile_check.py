"""Compile the kernels for sm_90 on a machine without a GPU (Triton ships ptxas).

Catches errors that only the compiler sees (types merging across branches, loop-carried
types, shared-memory budgets are NOT checked: that needs the device). Usage:
    PYTHONPATH=src python tests/tools/compile_check.py [kernel names, e.g. dq_kernel]
"""

from __future__ import annotations

import itertools
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fmha.kernels.triton import bwd, dropout, fwd, kvcache

TARGET = GPUTarget("cuda", 90, 32)


def signature(kernel, pointer_dtypes: dict[str, str], floats: set[str], constexprs: dict):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_dtypes:
            sig[name] = "*" + pointer_dtypes[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(kernel, pointers, floats, constexprs, num_warps, num_stages):
    src = ASTSource(kernel, signature(kernel, pointers, floats, constexprs), constexprs)
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.metadata.shared, compiled.n_regs if hasattr(compiled, "n_regs") else None


FLOATS = {"scale", "softcap", "dropout_p"}
NO_FP8 = {"FP8": False, "Q_BLOCK_DESCALE": False, "K_BLOCK_DESCALE": False, "V_BLOCK_DESCALE": False}


def check_fp8(flags: list[str]) -> int:
    """The fp8 forward at the registry's fp8 tiles: e4m3 and e5m2, no/all features, all
    descales per block or none."""
    failures = 0
    for dt, (bm, bn, w, s, d), on in itertools.product(
            ["fp8e4nv", "fp8e5"], [(128, 128, 8, 3, 64), (128, 128, 8, 3, 128), (128, 64, 8, 2, 256)],
            [False, True]):
        ptr = {n: dt for n in "QKV"} | {"O": "bf16"}
        ptr.update({n: "fp32" for n in ["LSE", "Bias", "Alibi", "Sinks", "QDescale", "KDescale", "VDescale"]})
        ptr.update({n: "i32" for n in ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"]})
        constexprs = {**dict.fromkeys(flags, on), "HAS_SINKS": on, "DOT_PRECISION": "ieee", "BLOCK_M": bm,
                      "BLOCK_N": bn, "BLOCK_DQK": d, "BLOCK_DV": d, "FP8": True,
                      "Q_BLOCK_DESCALE": on, "K_BLOCK_DESCALE": on, "V_BLOCK_DESCALE": on}
        t = time.time()
        try:
            shared, _ = compile_one(fwd.fwd_kernel, ptr, FLOATS, constexprs, w, s)
            print(f"ok   fwd_kernel       {dt} d{d} m{bm} n{bn} w{w} s{s} features={on} smem={shared} "
                  f"({time.time() - t:.1f}s)")
        except Exception as e:
            failures += 1
            print(f"FAIL fwd_kernel {dt} d{d} {constexprs}: {str(e)[:2000]}")
    return failures


def check_fp8_kvcache() -> int:
    """The split-KV kernel over float8 caches (dequantized on load, by inline PTX: FP8_ASM as on
    the GPU) with 16-bit queries."""
    failures = 0
    for qdt, kvdt, on in itertools.product(["bf16", "fp16"], ["fp8e4nv", "fp8e5"], [False, True]):
        ptr = {"Q": qdt, "K": kvdt, "V": kvdt, "O": "fp32" if on else qdt, "LSE": "fp32", "Alibi": "fp32",
               "Sinks": "fp32", "BlockTable": "i32", "KvIndptr": "i32", "CacheBatchIdx": "i32", "SeqlensK": "i32",
               "CuSeqlensQ": "i32", "KDescale": "fp32", "VDescale": "fp32"}
        constexprs = dict(PAGED=on, TABLE_INDPTR=False, PAGE_PER_TILE=on, IS_VARLEN=False,
                          HAS_CACHE_BATCH_IDX=False, ALIGN_BOTTOM_RIGHT=True, HAS_LEFT=on, HAS_RIGHT=True,
                          HAS_SINK_TOKENS=on, HAS_SOFTCAP=on, HAS_ALIBI=on, HAS_SINKS=on, SPLIT=on,
                          DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=64, BLOCK_DQK=128, BLOCK_DV=128, KV_FP8=True,
                          FP8_ASM=True, FP8_K_AT_DOT=True, PAGE_SHIFT=4 if on else -1, OFFSETS_32=on,
                          KV_SAME_STRIDES=on)
        try:
            shared, _ = compile_one(kvcache.splitkv_kernel, ptr, {"scale", "softcap"}, constexprs, 4, 3)
            print(f"ok   splitkv_kernel   q {qdt} cache {kvdt} features={on} smem={shared}")
        except Exception as e:
            failures += 1
            print(f"FAIL splitkv_kernel q {qdt} cache {kvdt} features={on}: {str(e)[:2000]}")
    return failures


def main() -> int:
    """Compile every kernel (or those named on the command line, e.g. dq_kernel)."""
    only = set(sys.argv[1:])
    failures = 0
    flags = ["IS_VARLEN", "HAS_SEQUSED_K", "ALIGN_BOTTOM_RIGHT", "HAS_LEFT", "HAS_RIGHT",
             "HAS_SINK_TOKENS", "HAS_SOFTCAP", "HAS_BIAS", "HAS_ALIBI", "HAS_DROPOUT"]
    combos = [dict.fromkeys(flags, False), dict.fromkeys(flags, True),
              {**dict.fromkeys(flags, False), "HAS_RIGHT": True, "ALIGN_BOTTOM_RIGHT": True}]
    for dt, (bm, bn, w, s, d) in itertools.product(
            ["bf16", "fp32"], [(128, 64, 8, 3, 128), (128, 32, 8, 2, 256), (64, 32, 4, 2, 64)]):
        for combo in combos:
            ptr = {n: dt for n in ["Q", "K", "V", "O", "dO", "dQ", "dK", "dV"]}
            ptr.update({n: "fp32" for n in ["LSE", "Delta", "dQacc", "dBias", "Bias", "Alibi", "Sinks",
                                            "dLSE", "dSinksRows"]})
            ptr.update({n: "i32" for n in ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"]})
            jobs = [
                (fwd.fwd_kernel, {**combo, "HAS_SINKS": combo["HAS_BIAS"], "DOT_PRECISION": "ieee",
                                  "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_DQK": d, "BLOCK_DV": d, **NO_FP8}),
                (bwd.dkdv_kernel, {**combo, "WRITE_DBIAS": combo["HAS_BIAS"], "DQ_ATOMIC": not combo["HAS_BIAS"],
                                   "DOT_PRECISION": "ieee", "BLOCK_M": bm // 2, "BLOCK_N": bn * 2 if d <= 128 else bn,
                                   "BLOCK_DQK": d, "BLOCK_DV": d}),
                (bwd.dq_kernel, {**combo, "DELTA_ONLY": False, "HAS_DLSE": False, "HAS_SINKS": False,
                                 "DOT_PRECISION": "ieee", "BLOCK_M": bm, "BLOCK_N": bn,
                                 "BLOCK_DQK": d, "BLOCK_DV": d}),
                # the exact delta pass (dbias / dsinks wanted)
                (bwd.dq_kernel, {**combo, "DELTA_ONLY": True, "HAS_DLSE": True, "HAS_SINKS": combo["HAS_BIAS"],
                                 "DOT_PRECISION": "ieee", "BLOCK_M": bm, "BLOCK_N": bn,
                                 "BLOCK_DQK": d, "BLOCK_DV": d}),
                (bwd.dot_do_o_kernel, {"IS_VARLEN": combo["IS_VARLEN"], "HAS_DLSE": True,
                                       "HAS_SINKS": combo["HAS_BIAS"], "ZERO_DQ": not combo["IS_VARLEN"],
                                       "BLOCK_M": 64, "BLOCK_DV": d, "BLOCK_DQK": d}),
            ]
            for kernel, constexprs in jobs:
                if only and kernel.fn.__name__ not in only:
                    continue
                t = time.time()
                try:
                    shared, _ = compile_one(kernel, ptr, FLOATS, constexprs, w, s)
                    print(f"ok   {kernel.fn.__name__:<16} {dt} d{d} m{bm} n{bn} w{w} s{s} "
                          f"{'delta-only ' if constexprs.get('DELTA_ONLY') else ''}"
                          f"flags={sum(v is True for v in combo.values())} smem={shared} "
                          f"({time.time() - t:.1f}s)")
                except Exception as e:  # report every failure, keep going
                    failures += 1
                    print(f"FAIL {kernel.fn.__name__} {dt} d{d} {constexprs}: {str(e)[:2000]}")
    if only:
        print(f"{failures} failures")
        return 1 if failures else 0
    failures += check_fp8(flags)
    failures += check_fp8_kvcache()
    shared, _ = compile_one(dropout.dropout_mask_kernel, {"Mask": "i8"}, {"dropout_p"},
                            {"BLOCK_M": 64, "BLOCK_N": 64}, 4, 1)
    print("ok   dropout_mask_kernel")
    shared, _ = compile_one(bwd.convert_dq_kernel, {"dQacc": "fp32", "dQ": "bf16"}, {"scale"},
                            {"BLOCK_R": 64, "BLOCK_D": 128}, 4, 1)
    print("ok   convert_dq_kernel")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
