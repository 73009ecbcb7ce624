"""Compile the Gluon forward (kernels/fwd_gluon.py) for sm_90 without a GPU and report, per
registry tile: registers, ptxas spills, shared memory and the opcode counts of the consumer's
main loop in the SASS (FMUL, FFMA, MUFU, F2FP, HGMMA/QGMMA, BAR, BRA, total), as compile_spec builds it.

    PYTHONPATH=src python tools/gluon_fwd_sass_report.py [--tau T] [--persistent]
                                                         [--only bf16|fp8] [--module FILE] [--dump DIR]

--tau T: RESCALE_TAU of the bf16 kernels (default: fwd_gluon.default_rescale_tau; fp8 keeps 0).
--module FILE: another version of kernels/fwd_gluon.py (e.g. `git show main:src/fmha/kernels/fwd_gluon.py`).
The main loop is the innermost backward branch of the SASS that encloses HGMMA instructions
(the key-tile loop of one consumer partition); `@!PT` padding is left out.
"regions" lists the forward branches inside the loop: instructions (FMULs) each jumps over
(the masked-tile code; with RESCALE_TAU the O rescale).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from fmha.kernels import fwd_gluon as _working

fwd_gluon = _working
TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# (dtype, head_dim, block_n, stages, pingpong): the registry's Gluon forward tiles.
VARIANTS = [("bf16", 64, 128, 3, False), ("bf16", 128, 128, 2, True), ("bf16", 256, 64, 2, True),
            ("fp8e4nv", 128, 128, 2, False), ("fp8e4nv", 256, 64, 3, False)]
COUNTED = ["FMUL", "FFMA", "FADD", "MUFU", "F2FP", "FSEL", "FSETP", "GMMA", "BAR", "SHFL", "STS", "LDS", "BRA"]
_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("fmha.kernels._fwd_gluon_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def loop_counts(sass: str) -> dict:
    instrs = [(int(m.group(1), 16), m.group(3), m.group(4), (m.group(2) or "").strip())
              for m in map(_LINE.search, sass.splitlines()) if m]
    best = None
    for addr, op, operands, pred in instrs:
        if op.startswith("BRA") and (target := re.match(r"\s*(?:`\()?(0x[0-9a-f]+)", operands)):
            start = int(target.group(1), 16)
            if start < addr and pred and any(start <= a <= addr and o.startswith(("HGMMA", "QGMMA"))
                                             for a, o, _, _ in instrs):
                if best is None or addr - start < best[1] - best[0]:
                    best = (start, addr)
    if best is None:
        return {}
    counts = collections.Counter()
    body = [(a, o, ops, p) for a, o, ops, p in instrs if best[0] <= a <= best[1] and p != "@!PT"]
    for _, op, _, _ in body:
        counts["GMMA" if op.startswith(("HGMMA", "QGMMA")) else op.split(".")[0]] += 1
        counts["total"] += 1
    # forward branches inside the loop: how many instructions (and FMULs) each jumps over
    regions = []
    for addr, op, operands, _ in body:
        if op.startswith("BRA") and (target := re.match(r"\s*(?:`\()?(0x[0-9a-f]+)", operands)):
            end = int(target.group(1), 16)
            if addr < end <= best[1]:
                region = [o.split(".")[0] for a, o, _, _ in body if addr < a < end]
                regions.append(f"{len(region)}({region.count('FMUL')} FMUL)")
    out = {name: counts[name] for name in COUNTED + ["total"]}
    out["regions"] = regions
    return out


def compile_variant(dtype, head_dim, block_n, stages, pingpong, causal, persistent, tau, dump):
    kw = {"rescale_tau": tau} if tau is not None else {}
    signature, constexprs, options = fwd_gluon.compile_spec(dtype, head_dim, 128, block_n, stages, causal=causal,
                                                            pingpong=pingpong, persistent=persistent, **kw)
    src = GluonASTSource(fwd_gluon.fwd_ws_kernel, signature, constexprs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=TARGET, options=options)
    ptxas = log.getvalue()
    name = (f"{dtype}_d{head_dim}_n{block_n}s{stages}{'_pp' if pingpong else ''}{'_persist' if persistent else ''}"
            f"_{'causal' if causal else 'full'}" + (f"_tau{tau:g}" if tau else ""))
    tmp = Path(tempfile.mkdtemp())
    cubin = (dump or tmp) / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    if dump is not None:
        (dump / f"{name}.sass").write_text(sass)
        (dump / f"{name}.ptx").write_text(compiled.asm["ptx"])

    def field(pattern, text):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    return {"variant": name, "registers": field(r"REG:(\d+)", res),
            "spill_stores": field(r"(\d+) bytes spill stores", ptxas),
            "spill_loads": field(r"(\d+) bytes spill loads", ptxas),
            "shared": compiled.metadata.shared, "loop": loop_counts(sass),
            "warnings": [line.strip() for line in ptxas.splitlines() if "warning" in line.lower()]}


def main() -> int:
    global fwd_gluon
    argv = sys.argv[1:]
    if "--module" in argv:
        fwd_gluon = load_module(argv[argv.index("--module") + 1])
    tau = float(argv[argv.index("--tau") + 1]) if "--tau" in argv else None
    persistent = "--persistent" in argv
    dump = Path(argv[argv.index("--dump") + 1]) if "--dump" in argv else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    print(f"{'variant':<40} {'regs':>4} {'spill st/ld':>11} {'smem':>6}  loop: " + " ".join(COUNTED)
          + " total | branch regions")
    for dtype, d, n, st, pp in VARIANTS:
        if only and not dtype.startswith(only):
            continue
        for causal in (False, True):
            t = None if dtype == "fp8e4nv" else tau
            row = compile_variant(dtype, d, n, st, pp, causal, persistent, t, dump)
            loop = row["loop"]
            print(f"{row['variant']:<40} {row['registers']:>4} {row['spill_stores']!s:>5}/{row['spill_loads']!s:<5} "
                  f"{row['shared']:>6}  " + " ".join(f"{loop.get(c, '-')}" for c in COUNTED)
                  + f" {loop.get('total', '-')} | " + " ".join(loop.get("regions", [])),
                  flush=True)
            for w in row["warnings"]:
                print("    ptxas:", w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
