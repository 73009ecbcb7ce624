"""Compile the Gluon forward (kernels/fwd_gluon.py) for sm_90 without a GPU and report, per
registry variant: registers, ptxas spills, stack, shared memory, the main loop's memory
instructions (tools/gluon_sass_report.py's counts) and where the local loads/stores (LDL/STL)
sit in the SASS.

    PYTHONPATH=src python tools/fwd_sass_report.py [--hdims 128,256] [--causal|--full]
        [--one-tile] [--set NAME=V+NAME=V] [--module FILE] [--dump DIR] [--json PATH] [--stl]

Default: the persistent kernel (compile_spec(..., persistent=True)) of the registry's ping-pong
tile per head dim, causal and not. --one-tile: the one-tile-per-program kernel instead.
--set: constexprs changed (e.g. --set TILE_ORDER=1). --module FILE: another version of
kernels/fwd_gluon.py (e.g. `git show main:src/fmha/kernels/fwd_gluon.py > /tmp/fwd_main.py`).
--stl: print every LDL/STL line with the nearest preceding HGMMA / BAR / branch label.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).parent))
from gluon_sass_report import BIN, COUNTED, loop_counts  # noqa: E402

from fmha.kernels import fwd_gluon as _working  # noqa: E402

fwd_gluon = _working
TARGET = GPUTarget("cuda", 90, 32)
# (head_dim, block_m, block_n, stages, pingpong): the registry's Gluon forward configs.
VARIANTS = [(64, 128, 128, 3, False), (128, 128, 128, 2, True), (256, 128, 64, 2, True)]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("fmha.kernels._fwd_gluon_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def local_sites(sass: str) -> list[str]:
    """Every LDL/STL with the last HGMMA/BAR/SYNCS/branch seen before it (a position hint)."""
    out, last = [], ""
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if not m:
            continue
        text = m.group(2).strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0]
        if op.startswith(("LDL", "STL")):
            out.append(f"{m.group(1)}  {text:<48} after {last}")
        elif op.startswith(("HGMMA", "BAR", "SYNCS", "BRA", "WARPGROUP", "EXIT", "USETMAXREG")):
            last = f"{m.group(1)} {op}"
    return out


def compile_variant(head_dim, block_m, block_n, stages, pingpong, causal, persistent, changes, dump):
    signature, constexprs, options = fwd_gluon.compile_spec("bf16", head_dim, block_m, block_n, stages,
                                                            causal=causal, pingpong=pingpong, persistent=persistent)
    constexprs.update(changes)
    for name in changes:
        signature[name] = "constexpr"
    src = GluonASTSource(fwd_gluon.fwd_ws_kernel, signature, constexprs, None)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=TARGET, options=options)
    ptxas = log.getvalue()
    tag = "".join(f"_{k}{v}" for k, v in changes.items())
    name = f"d{head_dim}_{'persist' if persistent else 'onetile'}_{'causal' if causal else 'full'}{tag}"
    tmp = Path(tempfile.mkdtemp())
    cubin = (dump or tmp) / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    if dump is not None:
        (dump / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (dump / f"{name}.sass").write_text(sass)

    def field(pattern, text):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    return {"variant": name, "registers": field(r"REG:(\d+)", res), "stack": field(r"STACK:(\d+)", res),
            "spill_stores": field(r"(\d+) bytes spill stores", ptxas),
            "spill_loads": field(r"(\d+) bytes spill loads", ptxas), "shared": compiled.metadata.shared,
            "ldl": sass.count("LDL"), "stl": sass.count("STL"),
            "loop": loop_counts(sass), "local_sites": local_sites(sass),
            "warnings": [line.strip() for line in ptxas.splitlines()
                         if "warning" in line.lower() or re.search(r"\(C\d{4}\)", line)]}


def main() -> int:
    global fwd_gluon
    if "--module" in sys.argv:
        fwd_gluon = load_module(sys.argv[sys.argv.index("--module") + 1])
    variants = VARIANTS
    if "--hdims" in sys.argv:
        hdims = {int(d) for d in sys.argv[sys.argv.index("--hdims") + 1].split(",")}
        variants = [v for v in variants if v[0] in hdims]
    causals = [True] if "--causal" in sys.argv else [False] if "--full" in sys.argv else [False, True]
    persistent = "--one-tile" not in sys.argv
    changes = {}
    if "--set" in sys.argv:
        changes = {k: int(v) for k, v in (kv.split("=") for kv in sys.argv[sys.argv.index("--set") + 1].split("+"))}
    dump = Path(sys.argv[sys.argv.index("--dump") + 1]) if "--dump" in sys.argv else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    rows = []
    print(f"{'variant':<40} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6} {'STL':>4} {'LDL':>4}  loop: "
          + " ".join(COUNTED) + " total")
    for v in variants:
        for causal in causals:
            t0 = time.time()
            row = compile_variant(*v, causal, persistent, changes, dump)
            rows.append(row)
            loop = row["loop"]
            print(f"{row['variant']:<40} {row['registers']:>4} {row['spill_stores']!s:>5}/{row['spill_loads']!s:<5} "
                  f"{row['stack']:>5} {row['shared']:>6} {row['stl']:>4} {row['ldl']:>4}  "
                  + " ".join(f"{loop.get(n, '-')}" for n in COUNTED)
                  + f" {loop.get('total', '-')}  ({time.time() - t0:.0f}s)", flush=True)
            if "--stl" in sys.argv:
                for site in row["local_sites"]:
                    print("    " + site)
            for warning in row["warnings"]:
                print(f"    ptxas: {warning}", flush=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
