"""Compile the Gluon backward (kernels/bwd_gluon.py) for sm_90 without a GPU and report, per
registry variant: registers, ptxas spills, stack/local memory, shared memory, and the memory
instructions of the main loop in the SASS (REDG, LDG, LDS/LDSM, STS/STSM, local LDL/STL).

Two specializations per variant:
  spec    what `compile_spec` gives (precompile): strides and sizes as plain i32;
  launch  what `launch_dkdv` gives the JIT for B=4 H=16 S=4096 bhsd tensors (16-byte aligned
          pointers, strides and sizes divisible by 16 marked so, unit strides and group=1 constexpr),
          through the JIT's own argument specialization on meta tensors.

    PYTHONPATH=src python tools/gluon_sass_report.py [--spec|--launch] [--seqlen S] [--group G]
                                                     [--ws] [--hdims 64,128] [--variants D:M:N:S,...]
                                                     [--shape k=v+k=v]
                                                     [--module FILE] [--dump DIR] [--json PATH]

--seqlen S: the launch problem's sequence length (e.g. 4095: no TMA for LSE/delta, no divisibility).
--group G: query heads per KV head (16 query heads).
--ws: the warp-specialized kernel (pipeline gluon_ws, its registry configs) instead.
--hdims: only these head dims.
--variants D:M:N:S,...: these (head_dim, block_m, block_n, stages) instead of the registry's,
    e.g. --ws --variants 64:128:128:2 (the 128-query warp-specialized tile).
--shape k=v+k=v: the pipeline's kernel shape (`bwd_gluon.SHAPES`) changed so at every head dim,
    as bench_gluon_bwd's variants do, e.g. --ws --hdims 64 --shape dq_bufs=1.
--module FILE: compile another version of kernels/bwd_gluon.py, e.g. the committed one:
    git show HEAD:src/fmha/kernels/bwd_gluon.py > /tmp/bwd_head.py; ... --module /tmp/bwd_head.py
--dump DIR keeps PTX and SASS per variant. The main loop is the backward branch of the SASS
that encloses the most HGMMA instructions; counts leave out `@!PT` (never issued) padding.
ptxas warnings and coded notes (e.g. C7512/C7514: wgmma serialized, C7517: warpgroup.wait
injected) are listed under each row.
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

from fmha.kernels import bwd_gluon as _committed_or_working

bwd_gluon = _committed_or_working
TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# (head_dim, block_m, block_n, stages): the registry's Gluon backward configs.
VARIANTS = [(64, 64, 128, 3), (128, 64, 128, 2)]
WS_VARIANTS = [(64, 64, 128, 3), (128, 64, 128, 3)]  # pipeline gluon_ws
COUNTED = ["REDG", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STSM", "LDL", "STL", "HGMMA", "BAR", "BRA"]
_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def load_module(path: str):
    """Another version of kernels/bwd_gluon.py, imported inside the fmha.kernels package."""
    spec = importlib.util.spec_from_file_location("fmha.kernels._bwd_gluon_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def launch_sources(head_dim: int, block_m: int, block_n: int, stages: int, causal: bool,
                   batch: int = 4, heads: int = 16, seqlen: int = 4096, group: int = 1, ws: bool = False):
    """(signature, constexprs, attrs) the JIT derives from `launch_dkdv`'s arguments (meta tensors)."""
    def t(*shape, dtype=torch.bfloat16):
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

    kernel = getattr(bwd_gluon, kernel_name)
    setattr(bwd_gluon, kernel_name, Recorder())
    try:
        bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, dk, dv, dq_acc, causal=causal, align_bottom_right=False,
                              scale=head_dim ** -0.5, block_m=block_m, block_n=block_n, num_stages=stages,
                              warp_specialized=ws)
    finally:
        setattr(bwd_gluon, kernel_name, kernel)
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*recorded["args"], **recorded["kwargs"])
    options = {k: v for k, v in recorded["kwargs"].items() if k in ("num_warps", "maxnreg")}
    _, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, None)
    return signature, constexprs, attrs, options


def loop_counts(sass: str) -> dict:
    """Opcode counts inside the backward branch that encloses the most HGMMA instructions."""
    instrs = [(int(m.group(1), 16), m.group(3), m.group(4), (m.group(2) or "").strip())
              for m in map(_LINE.search, sass.splitlines()) if m]
    best, best_hgmma = None, -1
    for addr, op, operands, _ in instrs:
        if op.startswith("BRA") and (target := re.match(r"\s*(?:`\()?(0x[0-9a-f]+)", operands)):
            start = int(target.group(1), 16)
            if start < addr:
                n = sum(1 for a, o, _, _ in instrs if start <= a <= addr and o.startswith("HGMMA"))
                if n > best_hgmma:
                    best, best_hgmma = (start, addr), n
    counts = collections.Counter()
    if best is None:
        return {}
    for addr, op, _, pred in instrs:
        if best[0] <= addr <= best[1] and pred != "@!PT":  # @!PT: never issued (ptxas padding)
            counts[op.split(".")[0]] += 1
            counts["total"] += 1
    return {name: counts[name] for name in COUNTED + ["total"]}


def compile_variant(head_dim, block_m, block_n, stages, causal, mode, dump: Path | None, seqlen: int,
                    group: int, ws: bool = False) -> dict:
    if mode == "spec":
        signature, constexprs, options = bwd_gluon.compile_spec("bf16", head_dim, block_m, block_n, stages,
                                                                causal=causal, warp_specialized=ws)
        attrs = None
    else:
        signature, constexprs, attrs, options = launch_sources(head_dim, block_m, block_n, stages, causal,
                                                               seqlen=seqlen, group=group, ws=ws)
    kernel = bwd_gluon.bwd_dkdv_ws_kernel if ws else bwd_gluon.bwd_dkdv_kernel
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=TARGET, options=options)
    ptxas = log.getvalue()
    tile = f"_m{block_m}" if block_m != 64 else ""
    name = f"{'ws_' if ws else ''}d{head_dim}{tile}_s{stages}_{'causal' if causal else 'full'}_{mode}"
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

    return {"variant": name, "registers": field(r"REG:(\d+)", res), "stack": field(r"STACK:(\d+)", res),
            "local": field(r"LOCAL:(\d+)", res), "spill_stores": field(r"(\d+) bytes spill stores", ptxas),
            "spill_loads": field(r"(\d+) bytes spill loads", ptxas), "shared": compiled.metadata.shared,
            "loop": loop_counts(sass),
            "warnings": [line.strip() for line in ptxas.splitlines()
                         if "warning" in line.lower() or re.search(r"\(C\d{4}\)", line)]}


def main() -> int:
    global bwd_gluon
    if "--module" in sys.argv:
        bwd_gluon = load_module(sys.argv[sys.argv.index("--module") + 1])
    seqlen = int(sys.argv[sys.argv.index("--seqlen") + 1]) if "--seqlen" in sys.argv else 4096
    group = int(sys.argv[sys.argv.index("--group") + 1]) if "--group" in sys.argv else 1
    modes = ["spec"] if "--spec" in sys.argv else ["launch"] if "--launch" in sys.argv else ["spec", "launch"]
    dump = Path(sys.argv[sys.argv.index("--dump") + 1]) if "--dump" in sys.argv else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    ws = "--ws" in sys.argv
    variants = WS_VARIANTS if ws else VARIANTS
    if "--variants" in sys.argv:
        variants = [tuple(map(int, v.split(":"))) for v in sys.argv[sys.argv.index("--variants") + 1].split(",")]
    if "--hdims" in sys.argv:
        hdims = {int(d) for d in sys.argv[sys.argv.index("--hdims") + 1].split(",")}
        variants = [v for v in variants if v[0] in hdims]
    if "--shape" in sys.argv:
        changes = {k: int(v) for k, v in (kv.split("=") for kv in sys.argv[sys.argv.index("--shape") + 1].split("+"))}
        pipeline = "gluon_ws" if ws else "gluon"
        bwd_gluon.SHAPES = {**bwd_gluon.SHAPES, pipeline: {d: {**shape, **changes}
                                                           for d, shape in bwd_gluon.SHAPES[pipeline].items()}}
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    rows = []
    print(f"{'variant':<24} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}  loop: "
          + " ".join(COUNTED) + " total")
    for (head_dim, block_m, block_n, stages), causal, mode in (
            (v, c, m) for v in variants for c in (False, True) for m in modes):
        t0 = time.time()
        row = compile_variant(head_dim, block_m, block_n, stages, causal, mode, dump, seqlen, group, ws)
        rows.append(row)
        loop = row["loop"]
        print(f"{row['variant']:<24} {row['registers']:>4} {row['spill_stores']:>5}/{row['spill_loads']:<5} "
              f"{row['stack']:>5} {row['shared']:>6}  " + " ".join(f"{loop.get(n, '-')}" for n in COUNTED)
              + f" {loop.get('total', '-')}  ({time.time() - t0:.0f}s)", flush=True)
        for warning in row["warnings"]:
            print(f"    ptxas: {warning}", flush=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
