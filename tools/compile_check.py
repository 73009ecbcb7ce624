"""Compile the kernels for sm_90 on a machine without a GPU (Triton ships ptxas).

Catches errors that only the compiler sees (types merging across branches, loop-carried
types, shared-memory budgets are NOT checked: that needs the device). Usage:
    PYTHONPATH=src python tools/compile_check.py [kernel names, e.g. dq_kernel]
"""

from __future__ import annotations

import itertools
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fmha.kernels import bwd, dropout, fwd

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
                                  "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_DQK": d, "BLOCK_DV": d}),
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
                                       "HAS_SINKS": combo["HAS_BIAS"], "BLOCK_M": 64, "BLOCK_DV": d}),
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
