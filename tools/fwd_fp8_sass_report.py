"""Compile the Gluon fp8 forward (kernels/fwd_gluon.py, FP8=True) for sm_90 without a GPU and
report, per registry tile and P_PERM (P's keys permuted instead of a layout conversion of P):
registers, ptxas spills, shared memory, and the main loop's instruction counts in the SASS
(SHFL and PRMT: the conversion of P; F2FP: the e4m3 rounding; QGMMA: fp8 wgmma; MUFU: exp2).

    PYTHONPATH=src python tools/fwd_fp8_sass_report.py [--causal] [--dump DIR] [--json PATH]
                                                       [--module FILE]

The specialization is `compile_spec`'s (strides and sizes plain i32), as `fmha kernels build`
compiles it. The main loop is the shortest backward branch that encloses QGMMA instructions
(one consumer warpgroup's loop); counts leave out `@!PT` padding. --module FILE compiles
another version of kernels/fwd_gluon.py (e.g. `git show main:src/fmha/kernels/fwd_gluon.py`),
with its own P_PERM when it has one.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import triton
from gluon_sass_report import BIN, TARGET, load_module, loop_counts
from triton import knobs
from triton.experimental.gluon._runtime import GluonASTSource

from fmha.kernels import fwd_gluon

# (head_dim, block_n, stages): the registry's fp8 Gluon forward tiles (block_m 128).
TILES = [(64, 128, 3), (128, 128, 2), (256, 64, 3)]
COUNTED = ["SHFL", "PRMT", "F2FP", "QGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "LDL", "STL", "BAR"]


def compile_tile(module, head_dim: int, block_n: int, stages: int, causal: bool, p_perm: bool | None,
                 dump: Path | None) -> dict:
    kw = {} if p_perm is None else {"p_perm": p_perm}
    signature, constexprs, options = module.compile_spec("fp8e4nv", head_dim, 128, block_n, stages,
                                                         causal=causal, pingpong=False, **kw)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(GluonASTSource(module.fwd_ws_kernel, signature, constexprs), target=TARGET,
                                  options=options)
    name = f"d{head_dim}_n{block_n}_s{stages}_{'causal' if causal else 'full'}_pperm{constexprs.get('P_PERM', 0):d}"
    cubin = Path(f"/tmp/{name}.cubin") if dump is None else dump / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    if dump is not None:
        (dump / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (dump / f"{name}.sass").write_text(sass)
    else:
        cubin.unlink()

    def field(pattern, text):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    ptxas = log.getvalue()
    return {"variant": name, "registers": field(r"REG:(\d+)", res),
            "spill_stores": field(r"(\d+) bytes spill stores", ptxas),
            "spill_loads": field(r"(\d+) bytes spill loads", ptxas), "shared": compiled.metadata.shared,
            "loop": loop_counts(sass, COUNTED, innermost=True)}


def main() -> int:
    module = fwd_gluon
    if "--module" in sys.argv:
        module = load_module(sys.argv[sys.argv.index("--module") + 1])
    causal = "--causal" in sys.argv
    dump = Path(sys.argv[sys.argv.index("--dump") + 1]) if "--dump" in sys.argv else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    has_p_perm = "p_perm" in module.compile_spec.__code__.co_varnames
    rows = []
    print(f"{'variant':<32} {'regs':>4} {'spill st/ld':>11} {'smem':>6}  loop: " + " ".join(COUNTED) + " total")
    for tile in TILES:
        for p_perm in ((False, True) if has_p_perm else (None,)):
            t0 = time.time()
            row = compile_tile(module, *tile, causal, p_perm, dump)
            rows.append(row)
            loop = row["loop"]
            print(f"{row['variant']:<32} {row['registers']:>4} {row['spill_stores']:>5}/{row['spill_loads']:<5} "
                  f"{row['shared']:>6}  " + " ".join(f"{loop.get(n, '-')}" for n in COUNTED)
                  + f" {loop.get('total', '-')}  ({time.time() - t0:.0f}s)", flush=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
