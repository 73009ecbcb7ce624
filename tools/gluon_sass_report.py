"""Compile the Gluon backward (kernels/bwd_gluon.py) for sm_90 without a GPU and report, per
registry variant: registers, ptxas spills, stack/local memory, shared memory, and the memory
instructions of the main loop in the SASS (REDG, LDG, LDS/LDSM, STS/STSM, local LDL/STL).

Two specializations per variant:
  spec    what `compile_spec` gives (precompile): strides and sizes as plain i32;
  launch  what `launch_dkdv` gives the JIT for B=4 H=16 S=4096 bhsd tensors (16-byte aligned
          pointers, strides and sizes divisible by 16 marked so, unit strides and group=1 constexpr),
          through the JIT's own argument specialization on meta tensors.

    PYTHONPATH=src python tools/gluon_sass_report.py [--spec|--launch] [--seqlen S] [--group G]
                                                     [--ws [--persistent]] [--dtype fp16] [--hdims 64,128]
                                                     [--variants D:M:N:S,...] [--window W]
                                                     [--shape k=v+k=v]
                                                     [--module FILE] [--dump DIR] [--json PATH]

--seqlen S: the launch problem's sequence length (e.g. 4095: no TMA for LSE/delta, no divisibility).
--group G: query heads per KV head (16 query heads).
--ws: the warp-specialized kernel (pipeline gluon_ws, its registry configs and the D=256 tile) instead;
    its "regs" column is the launch's 168 (the partitions `setmaxnreg` 240 / 24), so a column
    "rmax" adds the highest register the SASS uses + 1 (the compute warpgroups' need of 240).
--persistent (with --ws): the persistent kernel (launch_dkdv(persistent=True), 132 SMs for the launch grid).
--dtype fp16: fp16 instead of bf16 (--module: a version with the same launch_sources arguments).
--hdims: only these head dims.
--window W: the causal rows with the sliding window (W, 0) instead (LEFT_WINDOW; spec: compile_spec(window=True)).
--variants D:M:N:S,...: these (head_dim, block_m, block_n, stages) instead of the registry's,
    e.g. --ws --variants 64:128:128:2 (the 128-query warp-specialized tile).
--shape k=v+k=v: the pipeline's kernel shape (`bwd_gluon.SHAPES`) changed so at every head dim,
    as bench_gluon_bwd's variants do, e.g. --ws --hdims 64 --shape dq_bufs=1.
--module FILE: compile another version of kernels/bwd_gluon.py, e.g. the committed one:
    git show HEAD:src/fmha/kernels/bwd_gluon.py > /tmp/bwd_head.py; ... --module /tmp/bwd_head.py
--dump DIR keeps PTX and SASS per variant. The main loop is the backward branch of the SASS
that encloses the most HGMMA instructions; counts leave out `@!PT` (never issued) padding.
ptxas warnings and coded notes (e.g. C7512/C7514: wgmma serialized, C7517: warpgroup.wait
injected) are listed under each row. tools/fwd_sass_report.py (the forward) uses this file's
compile, loop-count and table helpers.
"""

from __future__ import annotations

import collections
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

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from fmha.kernels.gluon import bwd as _committed_or_working

bwd_gluon = _committed_or_working
TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
GMMA = ("HGMMA", "QGMMA")  # warpgroup MMAs: 16-bit, fp8
# (head_dim, block_m, block_n, stages): the registry's Gluon backward configs.
VARIANTS = [(64, 64, 128, 3), (128, 64, 128, 2), (256, 64, 64, 2)]
# pipeline gluon_ws; D=256: `_ws_compute_d256` (docs/kernels.md, "Backward at D=256")
WS_VARIANTS = [(64, 64, 128, 3), (128, 64, 128, 3), (256, 64, 64, 2)]
COUNTED = ["REDG", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STSM", "LDL", "STL", "HGMMA", "BAR", "BRA"]
_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def load_module(path: str, name: str = "_bwd_gluon_report"):
    """Another version of a kernels/ module (here bwd_gluon.py), imported inside the fmha.kernels package."""
    spec = importlib.util.spec_from_file_location(f"fmha.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def launch_sources(head_dim: int, block_m: int, block_n: int, stages: int, causal: bool,
                   batch: int = 4, heads: int = 16, seqlen: int = 4096, group: int = 1, ws: bool = False,
                   persistent: bool = False, elem: str = "bf16", window_left: int = -1):
    """(signature, constexprs, attrs) the JIT derives from `launch_dkdv`'s arguments (meta tensors
    of `elem`; persistent: an H200's 132 SMs)."""
    def t(*shape, dtype=torch.float16 if elem == "fp16" else torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    q, do = (t(batch, heads, seqlen, head_dim) for _ in range(2))
    k, v, dk, dv = (t(batch, heads // group, seqlen, head_dim) for _ in range(4))
    lse, delta = t(batch, heads, seqlen, dtype=torch.float32), t(batch, heads, seqlen, dtype=torch.float32)
    dq_acc = t(batch, heads, seqlen, head_dim, dtype=torch.float32)
    recorded = {}
    kernel_name = "bwd_dkdv_ws_kernel" if ws else "bwd_dkdv_kernel"

    class Recorder:
        arg_names = getattr(bwd_gluon, kernel_name).arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.update(args=args, kwargs=kwargs)

    kernel, sm_count = getattr(bwd_gluon, kernel_name), getattr(bwd_gluon, "_sm_count", None)
    setattr(bwd_gluon, kernel_name, Recorder())
    bwd_gluon._sm_count = lambda device: 132
    try:
        bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, dk, dv, dq_acc, causal=causal, align_bottom_right=False,
                              scale=head_dim ** -0.5, block_m=block_m, block_n=block_n, num_stages=stages,
                              warp_specialized=ws, **({"persistent": True} if persistent else {}),
                              **({"window_left": window_left} if window_left >= 0 else {}))
    finally:
        setattr(bwd_gluon, kernel_name, kernel)
        bwd_gluon._sm_count = sm_count
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*recorded["args"], **recorded["kwargs"])
    options = {k: v for k, v in recorded["kwargs"].items() if k in ("num_warps", "maxnreg")}
    _, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, None)
    return signature, constexprs, attrs, options


def option(name: str, convert=str, default=None):
    """The command line's value after `name`, converted; default when `name` is not given."""
    return convert(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def assignments(text: str) -> dict:
    """"k=v+k=v" -> {k: v}, each v an int where it reads as one, else a float."""
    pairs = (kv.split("=") for kv in text.split("+"))
    return {k: int(v) if re.fullmatch(r"-?\d+", v) else float(v) for k, v in pairs}


def instructions(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, opcode, operands, predicate) of every SASS instruction."""
    return [(int(m.group(1), 16), m.group(3), m.group(4), (m.group(2) or "").strip())
            for m in map(_LINE.search, sass.splitlines()) if m]


def _branch_target(op: str, operands: str) -> int | None:
    target = re.match(r"\s*(?:`\()?(0x[0-9a-f]+)", operands) if op.startswith("BRA") else None
    return int(target.group(1), 16) if target else None


def main_loop(instrs: list, innermost: bool = False) -> tuple[int, int] | None:
    """(first, last address) of the backward branch that encloses the most HGMMA/QGMMA instructions
    (the first such branch when none does); innermost: the shortest predicated backward branch
    that encloses one (a forward consumer's key-tile loop, inside the persistent tile loop)."""
    best, best_gmma = None, -1
    for addr, op, operands, pred in instrs:
        start = _branch_target(op, operands)
        if start is None or start >= addr:
            continue
        n = sum(1 for a, o, _, _ in instrs if start <= a <= addr and o.startswith(GMMA))
        if not innermost and n > best_gmma:
            best, best_gmma = (start, addr), n
        elif innermost and pred and n and (best is None or addr - start < best[1] - best[0]):
            best = (start, addr)
    return best


def loop_counts(sass: str, counted: list[str] = COUNTED, innermost: bool = False, regions: bool = False) -> dict:
    """Opcode counts (`counted` and "total") inside `main_loop`, leaving out `@!PT` (never issued:
    ptxas padding); "GMMA" counts HGMMA and QGMMA together. regions: also "regions", per forward
    branch inside the loop the instructions (FMULs) it jumps over, e.g. "64(64 FMUL)"."""
    instrs = instructions(sass)
    loop = main_loop(instrs, innermost)
    if loop is None:
        return {}
    body = [(a, o, ops, p) for a, o, ops, p in instrs if loop[0] <= a <= loop[1] and p != "@!PT"]
    counts = collections.Counter()
    for _, op, _, _ in body:
        counts[op.split(".")[0]] += 1
        counts["GMMA"] += op.startswith(GMMA)
        counts["total"] += 1
    out = {name: counts[name] for name in counted + ["total"]}
    if regions:
        out["regions"] = []
        for addr, op, operands, _ in body:
            end = _branch_target(op, operands)
            if end is not None and addr < end <= loop[1]:
                region = [o.split(".")[0] for a, o, _, _ in body if addr < a < end]
                out["regions"].append(f"{len(region)}({region.count('FMUL')} FMUL)")
    return out


def compile_sass(src, options: dict, name: str, dump: Path | None) -> tuple[str, dict]:
    """triton.compile of `src` for TARGET (ptxas -v's log captured): (SASS, fields) where fields
    are registers, stack, local (bytes), spill_stores, spill_loads (bytes), shared and the ptxas
    warnings and coded notes. dump: keeps `name`.cubin/.ptx/.sass there."""
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=TARGET, options=options)
    ptxas = log.getvalue()
    cubin = Path(tempfile.mkdtemp()) / f"{name}.cubin" if dump is None else dump / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    if dump is not None:
        (dump / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (dump / f"{name}.sass").write_text(sass)
    else:
        cubin.unlink()
        cubin.parent.rmdir()

    def field(pattern, text):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    return sass, {"registers": field(r"REG:(\d+)", res), "stack": field(r"STACK:(\d+)", res),
                  "local": field(r"LOCAL:(\d+)", res), "spill_stores": field(r"(\d+) bytes spill stores", ptxas),
                  "spill_loads": field(r"(\d+) bytes spill loads", ptxas), "shared": compiled.metadata.shared,
                  "warnings": [line.strip() for line in ptxas.splitlines()
                               if "warning" in line.lower() or re.search(r"\(C\d{4}\)", line)]}


def table_header(width: int, counted: list[str], middle: tuple[str, ...] = ()) -> str:
    """The header of `table_row`'s table."""
    return (f"{'variant':<{width}} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6} "
            + "".join(f"{m:>4} " for m in middle) + " loop: " + " ".join(counted + ["total"]))


def print_row(row: dict, width: int, loop: dict, counted: list[str], middle: tuple = (), tail: str = "",
              notes: list[str] = ()) -> None:
    """variant, registers, spills, stack, shared memory, the `middle` values, `loop`'s counts and
    `tail`; then the `notes` and the ptxas warnings, a line each."""
    print(f"{row['variant']:<{width}} {row['registers']:>4} {row['spill_stores']!s:>5}/{row['spill_loads']!s:<5} "
          f"{row['stack']!s:>5} {row['shared']:>6} " + "".join(f"{m:>4} " for m in middle) + " "
          + " ".join(f"{loop.get(n, '-')}" for n in counted + ["total"]) + tail, flush=True)
    for line in [*notes, *(f"ptxas: {w}" for w in row["warnings"])]:
        print(f"    {line}", flush=True)


def dump_dir() -> Path | None:
    """--dump DIR, made."""
    dump = option("--dump", Path)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    return dump


def finish(rows: list[dict]) -> int:
    """--json PATH: the rows written there."""
    if "--json" in sys.argv:
        Path(option("--json")).write_text(json.dumps(rows, indent=1))
    return 0


def compile_variant(head_dim, block_m, block_n, stages, causal, mode, dump: Path | None, seqlen: int,
                    group: int, ws: bool = False, persistent: bool = False, dtype: str = "bf16",
                    window_left: int = -1) -> dict:
    more = {"persistent": True} if persistent else {}  # (--module: a version without the argument)
    if mode == "spec":
        window = {"window": True} if window_left >= 0 and causal else {}
        signature, constexprs, options = bwd_gluon.compile_spec(dtype, head_dim, block_m, block_n, stages,
                                                                causal=causal, warp_specialized=ws, **more, **window)
        attrs = None
    else:
        window = {"window_left": window_left} if window_left >= 0 and causal else {}
        signature, constexprs, attrs, options = launch_sources(head_dim, block_m, block_n, stages, causal,
                                                               seqlen=seqlen, group=group, ws=ws, elem=dtype, **more,
                                                               **window)
    kernel = bwd_gluon.bwd_dkdv_ws_kernel if ws else bwd_gluon.bwd_dkdv_kernel
    tile = f"_m{block_m}" if block_m != 64 else ""
    name = (f"{'ws_' if ws else ''}{'p_' if persistent else ''}d{head_dim}{tile}_s{stages}"
            f"_{('window' if window else 'causal') if causal else 'full'}_{mode}"
            f"{'' if dtype == 'bf16' else '_' + dtype}")
    sass, fields = compile_sass(GluonASTSource(kernel, signature, constexprs, attrs), options, name, dump)
    return {"variant": name, **fields, "max_register": max_register(sass), "loop": loop_counts(sass)}


def max_register(sass: str) -> int:
    """The highest general register the SASS names, + 1 (under `setmaxnreg`, what the partition
    that uses the most registers needs)."""
    return 1 + max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1)


def main() -> int:
    global bwd_gluon
    if "--module" in sys.argv:
        bwd_gluon = load_module(option("--module"))
    seqlen, group = option("--seqlen", int, 4096), option("--group", int, 1)
    modes = ["spec"] if "--spec" in sys.argv else ["launch"] if "--launch" in sys.argv else ["spec", "launch"]
    dump = dump_dir()
    ws = "--ws" in sys.argv
    persistent = "--persistent" in sys.argv
    dtype = option("--dtype", str, "bf16")
    variants = WS_VARIANTS if ws else VARIANTS
    if "--variants" in sys.argv:
        variants = [tuple(map(int, v.split(":"))) for v in option("--variants").split(",")]
    if "--hdims" in sys.argv:
        hdims = {int(d) for d in option("--hdims").split(",")}
        variants = [v for v in variants if v[0] in hdims]
    if "--shape" in sys.argv:
        changes = assignments(option("--shape"))
        pipeline = "gluon_ws" if ws else "gluon"
        bwd_gluon.SHAPES = {**bwd_gluon.SHAPES, pipeline: {d: {**shape, **changes}
                                                           for d, shape in bwd_gluon.SHAPES[pipeline].items()}}
    rows = []
    print(table_header(24, COUNTED) + ("  rmax" if ws else ""))
    for (head_dim, block_m, block_n, stages), causal, mode in (
            (v, c, m) for v in variants for c in (False, True) for m in modes):
        t0 = time.time()
        row = compile_variant(head_dim, block_m, block_n, stages, causal, mode, dump, seqlen, group, ws,
                              persistent, dtype, option("--window", int, -1))
        rows.append(row)
        rmax = f"  {row['max_register']:>4}" if ws else ""
        print_row(row, 24, row["loop"], COUNTED, tail=f"{rmax}  ({time.time() - t0:.0f}s)")
    return finish(rows)


if __name__ == "__main__":
    sys.exit(main())
