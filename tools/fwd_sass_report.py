"""Compile the Gluon forward (kernels/fwd_gluon.py) for sm_90 without a GPU, as compile_spec
builds it, and report per registry tile (bf16 and fp8): registers, ptxas spills, stack, shared
memory, local loads/stores (LDL/STL) and, in the SASS, either the memory instructions of the
kernel's main loop (tools/gluon_sass_report.py's counts) or, with --opcodes, the opcode counts
of the consumer's key-tile loop and the forward branches inside it.

    PYTHONPATH=src python tools/fwd_sass_report.py [--hdims 128,256] [--causal|--full] [--only bf16|fp8]
        [--one-tile|--persistent] [--tau T] [--set NAME=V+NAME=V] [--opcodes] [--stl]
        [--module FILE] [--dump DIR] [--json PATH]

Default: the persistent kernel (compile_spec(..., persistent=True)) of every registry tile, causal
and not; --one-tile: the one-tile-per-program kernel instead (--persistent: the default, accepted).
--hdims: only these head dims. --only bf16|fp8: only that dtype's tiles.
--tau T: RESCALE_TAU of the bf16 kernels (default: fwd_gluon.default_rescale_tau); fp8 keeps 0
(check_rescale_tau refuses anything else). --set RESCALE_TAU=T is the same.
--set: other constexprs changed (e.g. --set TILE_ORDER=1), on every tile.
--opcodes: the table of FMUL FFMA FADD MUFU F2FP FSEL FSETP GMMA BAR SHFL STS LDS BRA in the
    consumer's key-tile loop (the innermost predicated backward branch of the SASS around an
    HGMMA/QGMMA; inside the persistent kernel's tile loop) and its "regions": per forward branch
    inside that loop, the instructions (FMULs) it jumps over (the masked-tile code; with RESCALE_TAU
    the O rescale). Without it: REDG LDG ... LDL STL GMMA BAR BRA in the backward branch around the
    most HGMMA/QGMMA (for the persistent kernel, its tile loop). `@!PT` padding is left out of both.
--stl: print every LDL/STL line with the nearest preceding HGMMA / BAR / branch label.
--module FILE: another version of kernels/fwd_gluon.py (e.g. `git show main:src/fmha/kernels/fwd_gluon.py
    > /tmp/fwd_main.py`). --dump DIR keeps PTX, SASS and cubin per tile. --json PATH: every row,
    both loops' counts included ("loop", "key_loop").
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).parent))
from gluon_sass_report import (  # noqa: E402
    COUNTED,
    assignments,
    compile_sass,
    dump_dir,
    finish,
    load_module,
    loop_counts,
    option,
    print_row,
    table_header,
)

from fmha.kernels.gluon import fwd as _working  # noqa: E402

fwd_gluon = _working
# (dtype, head_dim, block_m, block_n, stages, pingpong): the registry's Gluon forward tiles (of the
# persistent kernel, this report's default; D=64's one-tile kernel has 3 stages).
VARIANTS = [("bf16", 64, 128, 128, 2, False), ("bf16", 128, 128, 128, 2, True), ("bf16", 256, 128, 64, 2, True),
            ("fp8e4nv", 128, 128, 256, 2, False), ("fp8e4nv", 256, 128, 128, 2, False)]
MEMORY = [name if name != "HGMMA" else "GMMA" for name in COUNTED]
OPCODES = ["FMUL", "FFMA", "FADD", "MUFU", "F2FP", "FSEL", "FSETP", "GMMA", "BAR", "SHFL", "STS", "LDS", "BRA"]
WIDTH = 46


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
        elif op.startswith(("HGMMA", "QGMMA", "BAR", "SYNCS", "BRA", "WARPGROUP", "EXIT", "USETMAXREG")):
            last = f"{m.group(1)} {op}"
    return out


def compile_variant(dtype, head_dim, block_m, block_n, stages, pingpong, causal, persistent, tau, changes, dump):
    """One tile's row; tau: RESCALE_TAU (None: compile_spec's default; a --module from before
    RESCALE_TAU takes none), changes: other constexprs."""
    kw = {"rescale_tau": tau} if tau is not None else {}
    signature, constexprs, options = fwd_gluon.compile_spec(dtype, head_dim, block_m, block_n, stages, causal=causal,
                                                            pingpong=pingpong, persistent=persistent, **kw)
    constexprs.update(changes)
    for name in changes:
        signature[name] = "constexpr"
    tag = "".join(f"_{k}{v}" for k, v in changes.items())
    name = (f"{dtype}_d{head_dim}_n{block_n}s{stages}{'_pp' if pingpong else ''}"
            f"_{'persist' if persistent else 'onetile'}_{'causal' if causal else 'full'}"
            + (f"_tau{constexprs['RESCALE_TAU']:g}" if "RESCALE_TAU" in constexprs else "") + tag)
    sass, fields = compile_sass(GluonASTSource(fwd_gluon.fwd_ws_kernel, signature, constexprs, None), options,
                                name, dump)
    return {"variant": name, **fields, "ldl": sass.count("LDL"), "stl": sass.count("STL"),
            "loop": loop_counts(sass, MEMORY), "key_loop": loop_counts(sass, OPCODES, innermost=True, regions=True),
            "local_sites": local_sites(sass)}


def main() -> int:
    global fwd_gluon
    if "--module" in sys.argv:
        fwd_gluon = load_module(option("--module"), "_fwd_gluon_report")
    if "--one-tile" in sys.argv and "--persistent" in sys.argv:
        sys.exit("--one-tile or --persistent, not both")
    persistent = "--one-tile" not in sys.argv
    variants = [v for v in VARIANTS if v[0].startswith(option("--only", default=""))]
    if "--hdims" in sys.argv:
        hdims = {int(d) for d in option("--hdims").split(",")}
        variants = [v for v in variants if v[1] in hdims]
    causals = [True] if "--causal" in sys.argv else [False] if "--full" in sys.argv else [False, True]
    changes = assignments(option("--set")) if "--set" in sys.argv else {}
    tau = changes.pop("RESCALE_TAU", None)
    tau = option("--tau", float, tau)
    dump = dump_dir()
    opcodes = "--opcodes" in sys.argv
    counted, loop_key = (OPCODES, "key_loop") if opcodes else (MEMORY, "loop")
    print(table_header(WIDTH, counted, ("STL", "LDL")) + (" | branch regions" if opcodes else ""))
    rows = []
    for v in variants:
        for causal in causals:
            t0 = time.time()
            fp8 = v[0] == "fp8e4nv"
            row = compile_variant(*v, causal, persistent, None if fp8 else tau, changes, dump)
            rows.append(row)
            loop = row[loop_key]
            tail = " | " + " ".join(loop.get("regions", [])) if opcodes else ""
            print_row(row, WIDTH, loop, counted, (row["stl"], row["ldl"]), f"{tail}  ({time.time() - t0:.0f}s)",
                      row["local_sites"] if "--stl" in sys.argv else ())
    return finish(rows)


if __name__ == "__main__":
    sys.exit(main())
