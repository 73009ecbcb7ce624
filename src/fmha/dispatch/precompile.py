"""`fmha kernels build`: compile a registry's kernels ahead of use, in parallel (CK-style).

For every config of a registry that runs on a CUDA arch, the config's kernel is compiled
with `triton.compile(ASTSource(...), target=GPUTarget(...))` for each dtype of its
signature and a representative feature set: "plain" (every feature off) and, for the
kernels that mask, "causal" (bottom-right diagonal); the split-KV combine, whose launcher
picks its tile by partial count, compiles each of those tiles ("parts1" .. "parts16",
`kvcache.combine_variants`). No GPU is needed: Triton ships
ptxas, so a machine without CUDA builds for sm90 (or any arch given).

What a config compiles to is data: `FAMILY_KERNELS` maps each family to its kernel
(module, function), the element types of the kernel's pointer arguments, its float
arguments, its feature flags, and which `tl.constexpr` comes from which field of the
config (block sizes, head-dim tile, dot precision). Head dims compile with
`BLOCK_DQK = BLOCK_DV = next_power_of_two(head_dim_max)` (at least 16). fp64 is
interpreter-only and never compiled.

Compilation runs in `jobs` fresh Python worker processes (Triton's front end holds the
GIL, so threads would not run in parallel), with a rich progress bar. Each compiled kernel
reports the shared memory it needs; a kernel that needs more than the target allows
(232448 bytes on sm90) cannot launch, so it is reported failed. That check runs right
after Triton's LLVM-IR stage (through `knobs.runtime.add_stages_inspection_hook`), so an
oversized kernel fails in seconds instead of going through ptxas.

A small JSON record (by default `fmha_build_record.json` in Triton's cache directory)
remembers what was built, keyed by config name, dtype, Triton version, target and a
fingerprint of the kernel source and compile arguments; entries found there are
reported "cached" and not compiled again. Triton's own cache keeps the binaries; the
record names each kernel's cache entry, and a recorded build whose entry is gone or
damaged (fmha.kernels.launch.jit_cache.entry_problems: unreadable JSON, truncated cubin) is compiled
again, as is a kernel that Triton's cache hands back damaged (Triton itself does not look).

Limitation: Triton's runtime specialises each launch on its arguments (16-byte
divisibility of integers, value 1, 64-bit integers), which this build cannot know in
advance; it marks pointers 16-byte aligned (as torch allocations are) and leaves integers
unspecialised, so a later launch may still compile its own variant. The build proves that
every config compiles for the target and fits its shared memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import queue
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..problem import DType, Feature
from .configs import CPU, Family, KernelConfig, Pipeline
from .registry import Registry

RECORD_NAME = "fmha_build_record.json"
RECORD_FORMAT = 1
DEFAULT_ARCH = "sm90"  # the build target on a machine without CUDA

# Largest shared memory one block may use (opt-in maximum, bytes), per arch.
SHARED_MEMORY_LIMITS: dict[str, int] = {
    "sm80": 166912, "sm86": 101376, "sm87": 166912, "sm89": 101376,
    "sm90": 232448, "sm100": 232448, "sm103": 232448, "sm120": 101376,
}

# Element types of the config's dtype in Triton signatures.
TRITON_TYPES: dict[DType, str] = {DType.FP16: "fp16", DType.BF16: "bf16", DType.FP32: "fp32",
                                   DType.FP8_E4M3: "fp8e4nv", DType.FP8_E5M2: "fp8e5"}
# float8 forward: only q/k/v are fp8; the output (and the launcher's dummy, o) is bf16, the
# descales fp32 (an absent one is a tensor of 1).
_FP8_OPERANDS = ("Q", "K", "V")
_FP8_DESCALES = ("QDescale", "KDescale", "VDescale")

# Flags of the attention kernels (fwd, dkdv, dq); all off is "plain".
_ATTENTION_FLAGS = ("IS_VARLEN", "HAS_SEQUSED_K", "ALIGN_BOTTOM_RIGHT", "HAS_LEFT", "HAS_RIGHT",
                    "HAS_SINK_TOKENS", "HAS_SOFTCAP", "HAS_BIAS", "HAS_ALIBI", "HAS_DROPOUT")
# causal=True is window (-1, 0) with the bottom-right diagonal (the default alignment).
_CAUSAL = ("ALIGN_BOTTOM_RIGHT", "HAS_RIGHT")
IO = "io"  # a pointer whose element type is the config's dtype


@dataclass(frozen=True)
class KernelSpec:
    """How a family's config becomes one `triton.compile` call per dtype and variant.

    `pointers` maps pointer arguments to their element type (`IO`: the config's dtype;
    optional tensors get the type of the dummy the launcher passes when they are absent).
    Other arguments are fp32 if in `floats`, else i32. `flags` are boolean constexprs, all
    False in the "plain" variant; `causal` lists those switched on for the "causal" variant
    (empty: the kernel does not mask, one variant only). `constants` are fixed constexprs;
    `from_config` maps constexprs to "block_m", "block_n", "head_dim" or "dot_precision".
    """

    module: str
    kernel: str
    pointers: Mapping[str, str]
    floats: frozenset[str] = frozenset()
    flags: tuple[str, ...] = ()
    causal: tuple[str, ...] = ()
    constants: Mapping[str, Any] = field(default_factory=dict)
    from_config: Mapping[str, str] = field(default_factory=dict)

    @property
    def variants(self) -> tuple[str, ...]:
        return ("plain", "causal") if self.causal else ("plain",)


_TRITON_KERNELS = __package__.rsplit(".", 1)[0] + ".kernels.triton"  # (the families' Triton modules)
_ATTN_FLOATS = frozenset({"scale", "softcap", "dropout_p"})
_TILES = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_DQK": "head_dim", "BLOCK_DV": "head_dim",
          "DOT_PRECISION": "dot_precision"}

FAMILY_KERNELS: dict[Family, KernelSpec] = {
    Family.FWD: KernelSpec(
        "fwd", "fwd_kernel",
        pointers={**dict.fromkeys(("Q", "K", "V", "O"), IO), "LSE": "fp32",
                  # absent optional tensors: the launcher passes o
                  **dict.fromkeys(("Bias", "Alibi", "Sinks", "cu_seqlens_q", "cu_seqlens_k",
                                   "seqused_k") + _FP8_DESCALES, IO)},
        floats=_ATTN_FLOATS, flags=_ATTENTION_FLAGS + ("HAS_SINKS",), causal=_CAUSAL, from_config=_TILES,
        constants=dict.fromkeys(("FP8", "Q_BLOCK_DESCALE", "K_BLOCK_DESCALE", "V_BLOCK_DESCALE"), False)),
    Family.DROPOUT_MASK: KernelSpec(
        "dropout", "dropout_mask_kernel", pointers={"Mask": "u8"}, floats=frozenset({"dropout_p"}),
        from_config={"BLOCK_M": "block_m", "BLOCK_N": "block_n"}),
    Family.BWD_DOT_DO_O: KernelSpec(
        "bwd", "dot_do_o_kernel",
        pointers={"O": IO, "dO": IO,
                  **dict.fromkeys(("dLSE", "LSE", "Delta", "dSinksRows", "Sinks", "cu_seqlens_q", "dQacc"), "fp32")},
        flags=("IS_VARLEN", "HAS_DLSE", "HAS_SINKS"),
        constants={"ZERO_DQ": True},  # the dense atomic backward's stage 1 zeroes the dQ accumulator
        from_config={"BLOCK_M": "block_m", "BLOCK_DV": "head_dim", "BLOCK_DQK": "head_dim"}),
    Family.BWD_DQ_DK_DV: KernelSpec(
        "bwd", "dkdv_kernel",
        pointers={**dict.fromkeys(("Q", "K", "V", "dO", "dK", "dV"), IO),
                  # absent optional tensors: the launcher passes delta (fp32)
                  **dict.fromkeys(("LSE", "Delta", "dQacc", "dBias", "Bias", "Alibi", "cu_seqlens_q",
                                   "cu_seqlens_k", "seqused_k"), "fp32")},
        floats=_ATTN_FLOATS, flags=_ATTENTION_FLAGS + ("WRITE_DBIAS",), causal=_CAUSAL,
        constants={"DQ_ATOMIC": True},  # the default (non-deterministic) backward
        from_config=_TILES),
    Family.BWD_DQ: KernelSpec(
        "bwd", "dq_kernel",
        pointers={**dict.fromkeys(("Q", "K", "V", "dO", "dQ"), IO),
                  **dict.fromkeys(("LSE", "Delta", "Bias", "Alibi", "dLSE", "dSinksRows", "Sinks",
                                   "cu_seqlens_q", "cu_seqlens_k", "seqused_k"), "fp32")},
        # DELTA_ONLY (the exact stage 1 for dbias/dsinks) compiles on first use
        floats=_ATTN_FLOATS, flags=_ATTENTION_FLAGS + ("DELTA_ONLY", "HAS_DLSE", "HAS_SINKS"),
        causal=_CAUSAL, from_config=_TILES),
    Family.BWD_CONVERT_DQ: KernelSpec(
        "bwd", "convert_dq_kernel", pointers={"dQacc": "fp32", "dQ": IO}, floats=frozenset({"scale"}),
        from_config={"BLOCK_R": "block_m", "BLOCK_D": "head_dim"}),
    # KV cache. "plain" is one split over a contiguous cache (SPLIT: fp32 partial outputs).
    Family.FWD_SPLITKV: KernelSpec(
        "kvcache", "splitkv_kernel",
        pointers={**dict.fromkeys(("Q", "K", "V", "O"), IO), "LSE": "fp32",
                  # absent optional tensors: the launcher passes seqlens_k (int32)
                  **dict.fromkeys(("Alibi", "Sinks", "BlockTable", "KvIndptr", "CacheBatchIdx", "SeqlensK",
                                   "CuSeqlensQ", "KDescale", "VDescale"), "i32")},
        floats=frozenset({"scale", "softcap"}),
        flags=("PAGED", "TABLE_INDPTR", "PAGE_PER_TILE", "HAS_CACHE_BATCH_IDX", "IS_VARLEN",
               "ALIGN_BOTTOM_RIGHT", "HAS_LEFT", "HAS_RIGHT", "HAS_SINK_TOKENS", "HAS_SOFTCAP", "HAS_ALIBI",
               "HAS_SINKS", "SPLIT"),
        # the usual cache: offsets fit in int32, K and V strided alike (the launcher checks)
        constants={"PAGE_SHIFT": -1, "OFFSETS_32": True, "KV_SAME_STRIDES": True},
        causal=_CAUSAL, from_config=_TILES),
    Family.SPLITKV_COMBINE: KernelSpec(
        "kvcache", "combine_kernel",
        pointers={"Opart": "fp32", "LSEpart": "fp32", "O": IO, "LSE": "fp32", "Sinks": "fp32"},
        flags=("HAS_SINKS",), from_config={"BLOCK_M": "block_m", "BLOCK_D": "head_dim"}),
    Family.APPEND_KV: KernelSpec(
        "kvcache", "rotary_append_kernel",
        pointers={"Src": IO, "Dst": IO,
                  # without rotary tables the launcher passes the int32 positions as Cos/Sin
                  **dict.fromkeys(("Cos", "Sin", "BlockTable", "KvIndptr", "CacheBatchIdx", "Base",
                                   "CuSeqlens"), "i32")},
        flags=("PAGED", "TABLE_INDPTR", "HAS_CACHE_BATCH_IDX", "IS_VARLEN", "ROTATE", "INTERLEAVED",
               "DST_AT_BASE"),
        from_config={"BLOCK_T": "block_m", "BLOCK_D": "head_dim"}),
}


# ----------------------------------------------------------------------------------------
# Targets.


def target_of(arch: str) -> Any:
    """`GPUTarget("cuda", capability, 32)` for an arch name such as "sm90" or "sm100"."""
    from triton.backends.compiler import GPUTarget

    match = re.fullmatch(r"sm_?(\d+)a?", arch.strip().lower())
    if match is None:
        raise ValueError(f"arch {arch!r} is not a CUDA arch; accepted: smXY, e.g. sm90 "
                         f"(arch {CPU!r} is Triton's interpreter and needs no build)")
    return GPUTarget("cuda", int(match.group(1)), 32)


def current_arch() -> str:
    """The current CUDA device's arch ("sm90", ...), or DEFAULT_ARCH without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def shared_memory_limit(arch: str) -> int:
    """Bytes of shared memory a block may use on `arch` (the device's own value if it is that arch)."""
    import torch

    if torch.cuda.is_available() and current_arch() == arch:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        optin = getattr(props, "shared_memory_per_block_optin", 0)
        if optin:
            return int(optin)
    if arch not in SHARED_MEMORY_LIMITS:
        raise ValueError(f"no shared-memory limit known for arch {arch!r}; "
                         f"known: {sorted(SHARED_MEMORY_LIMITS)}")
    return SHARED_MEMORY_LIMITS[arch]


def triton_cache_dir() -> str:
    """Triton's on-disk cache directory (TRITON_CACHE_DIR, or ~/.triton/cache)."""
    from ..kernels.launch import jit_cache as kernel_cache

    return str(kernel_cache.cache_dir())


def default_record_path() -> Path:
    return Path(triton_cache_dir()) / RECORD_NAME


# ----------------------------------------------------------------------------------------
# Compile jobs.


@dataclass(frozen=True)
class CompileJob:
    """One `triton.compile` call: plain data, sent to a worker process."""

    module: str  # fmha.kernels.triton.<module>
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    language: str = "triton"  # or "gluon"
    maxnreg: int | None = None


@dataclass
class KernelBuild:
    """One compiled kernel of a config: its variant, shared memory and compile time."""

    variant: str
    kernel: str
    shared: int | None = None  # bytes; None when the compiler failed before knowing
    seconds: float = 0.0
    error: str | None = None
    entry: str | None = None  # its Triton cache directory
    repaired: str | None = None  # a damaged cache entry found, evicted and rebuilt


@dataclass
class BuildResult:
    """What happened to one (config, dtype): "built", "cached", "failed" or "skipped"."""

    config: str
    family: str
    dtype: str
    target: str
    status: str
    kernels: list[KernelBuild] = field(default_factory=list)
    message: str = ""
    shared_limit: int = 0

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    @property
    def shared(self) -> int | None:
        """The most shared memory any of the config's kernels needs (bytes)."""
        values = [k.shared for k in self.kernels if k.shared is not None]
        return max(values) if values else None

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kernels)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ok=self.ok, shared=self.shared, seconds=self.seconds)
        return data


def _config_value(config: KernelConfig, source: str) -> Any:
    if source == "head_dim":
        return max(16, 1 << (config.signature.head_dim_max - 1).bit_length())
    if source in ("block_m", "block_n", "dot_precision"):
        return getattr(config.algorithm, source)
    raise ValueError(f"unknown config field {source!r} in FAMILY_KERNELS")


def make_job(spec: KernelSpec, config: KernelConfig, dtype: DType, variant: str,
             overrides: Mapping[str, Any] | None = None) -> CompileJob:
    """The compile call for `config` at `dtype` in `variant`; ValueError if the spec does not fit
    the kernel (a constexpr without a value, a name the kernel does not have). `overrides`:
    constexprs set last (the tiles a launcher derives from the config, e.g. the combine's)."""
    kernel = _kernel(spec)
    io_type = TRITON_TYPES[dtype]
    names = list(kernel.arg_names)
    params = {p.name: p for p in kernel.params}
    values: dict[str, Any] = dict.fromkeys(spec.flags, False)
    if variant == "causal":
        values.update(dict.fromkeys(spec.causal, True))
    values.update(spec.constants)
    fp8 = dtype in (DType.FP8_E4M3, DType.FP8_E5M2)
    if fp8 and "FP8" in values:
        values["FP8"] = True
    values.update({name: _config_value(config, source) for name, source in spec.from_config.items()})
    values.update(overrides or {})
    unknown = sorted((set(values) | set(spec.pointers) | spec.floats) - set(names))
    if unknown:
        raise ValueError(f"FAMILY_KERNELS names arguments {unknown} that {spec.kernel} does not have")
    signature, constexprs = [], []
    for name in names:
        param = params[name]
        if param.is_constexpr:
            if name in values:
                value = values[name]
            elif param.has_default:
                value = param.default
            else:
                raise ValueError(f"constexpr {name} of {spec.kernel} has no value in FAMILY_KERNELS")
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        elif name in spec.pointers:
            element = spec.pointers[name]
            if element == IO:
                element = io_type if not fp8 or name in _FP8_OPERANDS else "bf16"
            if fp8 and name in _FP8_DESCALES:
                element = "fp32"
            signature.append((name, "*" + element))
        elif param.has_default and param.default is None:  # optional, absent: Triton makes None a constexpr
            signature.append((name, "constexpr"))
            constexprs.append((name, None))
        else:
            signature.append((name, "fp32" if name in spec.floats else "i32"))
    a = config.algorithm
    return CompileJob(f"{_TRITON_KERNELS}.{spec.module}", spec.kernel, tuple(signature),
                      tuple(constexprs), a.num_warps, a.num_stages)


def combine_jobs(spec: KernelSpec, config: KernelConfig, dtype: DType, target: Any) -> list[tuple[str, CompileJob]]:
    """The split-KV combine's compile calls: the tiles its launcher picks by partial count
    (kvcache.combine_variants: rows a program and partials read at once from the config's block_m,
    and the wait for the split kernel where it chains by programmatic dependent launch)."""
    from ..kernels.triton import kvcache

    return [(name, make_job(spec, config, dtype, "plain", constexprs))
            for name, constexprs in kvcache.combine_variants(config.algorithm.block_m, target.arch // 10)]


def gluon_jobs(config: KernelConfig, dtype: DType) -> list[tuple[str, CompileJob]]:
    """The compile calls of a Gluon config, plain and causal (and for the persistent forward at
    D=128 causal_short: its tile order for <= 8 row tiles a head; for the persistent dK/dV at
    D=64 causal_pairs: the order where heads outermost would not balance; where the config takes
    them, window: a sliding window (left, 0), and varlen: packed causal sequences): the forward
    (kernels/fwd_gluon.py) or the dK/dV backward with dQ added into an fp32 buffer
    (kernels/bwd_gluon.py)."""
    from ..kernels.gluon import bwd as bwd_gluon
    from ..kernels.gluon import fp8_vt
    from ..kernels.gluon import fwd as fwd_gluon
    from ..kernels.gluon import kvcache as kvcache_gluon
    from ..kernels.gluon.persistent_schedule import PAIRS

    a = config.algorithm
    if config.family == Family.FWD_SPLITKV:  # the fp8 decode: partial outputs (split) or final, e4m3/e5m2 caches
        jobs = []
        for cache, split, page in (("fp8e4nv", True, 0), ("fp8e4nv", False, 0), ("fp8e5", True, 0),
                                   ("fp8e5", False, 0), ("fp8e4nv", True, 64), ("fp8e4nv", True, 16)):
            signature, constexprs, options = kvcache_gluon.compile_spec(TRITON_TYPES[dtype], a.block_n, a.num_stages,
                                                                        cache=cache, split=split, page_size=page,
                                                                        head_dim=config.signature.head_dims[0])
            jobs.append((f"{'e4m3' if cache == 'fp8e4nv' else 'e5m2'}_{'split' if split else 'final'}"
                         + (f"_page{page}" if page else ""),
                         CompileJob(kvcache_gluon.__name__, "decode_fp8_kernel", tuple(signature.items()),
                                    tuple(constexprs.items()), options["num_warps"], 1, "gluon")))
        return jobs
    head_dim = config.signature.head_dim_max
    variants = ["plain", "causal"] if Feature.MASK in config.signature.features else ["plain"]
    # The persistent causal forward's tile order for short problems, where it differs from the
    # long problems' one (fwd_gluon.default_tile_order): a kernel of its own.
    short_order = fwd_gluon.default_tile_order(head_dim, 1)
    if config.family == Family.FWD and a.persistent and "causal" in variants \
            and short_order != fwd_gluon.default_tile_order(head_dim, 1 << 20):
        variants.append("causal_short")
    # The persistent causal dK/dV: its preferred order (heads at D=64) and pairs, which a launch
    # runs where heads would unbalance the programs (persistent_schedule.causal_tile_order).
    if config.family == Family.BWD_DQ_DK_DV and a.persistent and "causal" in variants \
            and bwd_gluon.preferred_tile_order(head_dim) != PAIRS:
        variants.append("causal_pairs")
    if "causal" in variants and config.signature.left_window and not a.persistent:
        variants.append("window")
    if Feature.VARLEN in config.signature.features and not a.persistent:  # (persistent kernels take neither)
        variants.append("varlen")
    jobs = []
    for variant in variants:
        args = (TRITON_TYPES[dtype], head_dim, a.block_m, a.block_n, a.num_stages)
        kinds = dict(window=variant == "window", varlen=variant == "varlen")
        if config.family == Family.FWD:
            module, kernel = fwd_gluon, "fwd_ws_kernel"
            signature, constexprs, options = fwd_gluon.compile_spec(
                *args, causal=variant != "plain", pingpong=a.pipeline == Pipeline.GLUON_WS_PINGPONG,
                persistent=a.persistent, **({"tile_order": short_order} if variant == "causal_short" else {}),
                **kinds)
        elif config.family == Family.BWD_DQ_DK_DV:
            ws = a.pipeline == Pipeline.GLUON_WS
            module, kernel = bwd_gluon, "bwd_dkdv_ws_kernel" if ws else "bwd_dkdv_kernel"
            signature, constexprs, options = bwd_gluon.compile_spec(
                *args, causal=variant != "plain", num_warps=a.num_warps, warp_specialized=ws,
                persistent=a.persistent, **({"tile_order": PAIRS} if variant == "causal_pairs" else {}), **kinds)
        else:
            raise ValueError(f"no Gluon kernel for family {config.family.value}")
        jobs.append((variant, CompileJob(module.__name__, kernel, tuple(signature.items()),
                                         tuple(constexprs.items()), options["num_warps"], 1, "gluon",
                                         options.get("maxnreg"))))
    if config.family == Family.FWD and dtype in (DType.FP8_E4M3, DType.FP8_E5M2):
        # the V^T scratch copy each fp8 call runs first (kernels/fp8_vt.py)
        signature, constexprs, options = fp8_vt.compile_spec(fwd_gluon.p_through_smem(True))
        jobs.append(("vt", CompileJob(fp8_vt.__name__, "vt_kernel", tuple(signature.items()),
                                      tuple(constexprs.items()), options["num_warps"], 1)))
    return jobs


def _kernel(spec: KernelSpec) -> Any:
    return getattr(importlib.import_module(f"{_TRITON_KERNELS}.{spec.module}"), spec.kernel)


class SharedMemoryExceeded(RuntimeError):
    """Raised inside Triton's pipeline when a kernel's shared memory is over the limit."""

    def __init__(self, shared: int, limit: int) -> None:
        super().__init__(f"needs {shared} bytes of shared memory, limit {limit}")
        self.shared = shared
        self.limit = limit


@contextlib.contextmanager
def _shared_memory_guard(limit: int) -> Iterator[None]:
    """Stop Triton's pipeline right after the LLVM-IR stage (where shared memory is allocated)
    when a kernel needs more than `limit` bytes: ptxas would only waste time on it."""
    from triton import knobs

    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend: Any, stages: dict, options: Any, language: Any, capability: Any) -> None:
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_llir = stages.get("llir")
        if make_llir is None:
            return

        def checked(src: Any, metadata: dict) -> Any:
            out = make_llir(src, metadata)
            shared = metadata.get("shared")
            if isinstance(shared, int) and shared > limit:
                raise SharedMemoryExceeded(shared, limit)
            return out

        stages["llir"] = checked

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous


def first_lines(text: str, lines: int = 8, chars: int = 1200) -> str:
    """The first non-empty `lines` lines of a compiler message, at most `chars` characters."""
    kept = [line.rstrip() for line in text.splitlines() if line.strip()][:lines]
    out = "\n".join(kept)
    return out if len(out) <= chars else out[: chars - 3] + "..."


def _compile_checked(job: CompileJob, target: Any, limit: int) -> tuple[Any, str | None]:
    """triton.compile, not trusting Triton's cache: a damaged entry (see fmha.kernels.launch.jit_cache)
    is evicted and the kernel compiled again, once. Returns (compiled, what was repaired)."""
    import triton
    from triton.compiler import ASTSource

    from ..kernels.launch import jit_cache as kernel_cache

    fn = getattr(importlib.import_module(job.module), job.kernel)
    signature = dict(job.signature)
    pointers = [i for i, (_, kind) in enumerate(job.signature) if kind.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}  # torch allocations are aligned
    options = {"num_warps": job.num_warps, "num_stages": job.num_stages}
    source = ASTSource
    if job.language == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource
        options = {"num_warps": job.num_warps, "maxnreg": job.maxnreg}

    def compile_once() -> Any:
        with _shared_memory_guard(limit):
            return triton.compile(source(fn, signature, dict(job.constexprs), attrs), target=target,
                                  options=options)

    repaired = None
    try:
        compiled = compile_once()
    except SharedMemoryExceeded:
        raise
    except Exception:  # a damaged metadata or group file fails inside triton.compile
        damaged = kernel_cache.scan()
        if not damaged:
            raise
        repaired = "; ".join(f"{e}: {', '.join(p)}" for e, p in damaged.items())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kernel_cache.CorruptCacheWarning)
            kernel_cache.evict(damaged, "compiled again")
        compiled = compile_once()
    entry = _entry_of(compiled)
    problems = kernel_cache.entry_problems(entry) if entry is not None else []
    if problems:  # a cache hit on a damaged binary: Triton does not look
        repaired = f"{entry}: {', '.join(problems)}"
        shutil.rmtree(entry, ignore_errors=True)
        compiled = compile_once()
    return compiled, repaired


def _entry_of(compiled: Any) -> Path | None:
    """The Triton cache directory a compiled kernel was stored in (or loaded from)."""
    paths = list(getattr(compiled, "metadata_group", {}).values())
    return Path(paths[0]).parent if paths else None


def compile_job(job: CompileJob, target: Any, limit: int) -> dict[str, Any]:
    """Compile one job (what a worker process runs); never raises.

    Returns {"shared": bytes or None, "seconds": float, "error": str or None, "entry": the
    Triton cache directory, "repaired": what damaged cache entry was rebuilt, or None}; a
    kernel over the shared-memory limit comes back with its need in "shared" and no error.
    """
    start = time.perf_counter()
    try:
        compiled, repaired = _compile_checked(job, target, limit)
        shared = int(compiled.metadata.shared)
        entry = _entry_of(compiled)
        return {"shared": shared, "seconds": time.perf_counter() - start, "error": None,
                "entry": None if entry is None else str(entry), "repaired": repaired}
    except SharedMemoryExceeded as e:
        return {"shared": e.shared, "seconds": time.perf_counter() - start, "error": None}
    except Exception as e:  # report the compiler's message, keep building the others
        return {"shared": None, "seconds": time.perf_counter() - start,
                "error": first_lines(f"{type(e).__name__}: {e}")}


# ----------------------------------------------------------------------------------------
# Worker processes. Each is a fresh `python -c` that imports fmha and compiles the jobs it
# reads from stdin (one JSON line each), answering one RESULT line each. Fresh processes,
# not multiprocessing: no fork of a threaded torch process, and no re-import of the
# caller's __main__ (a script calling build() needs no `if __name__ == "__main__"` guard).

_RESULT = "FMHA-BUILD-RESULT "
_READY = "FMHA-BUILD-READY"
_WORKER_CODE = "from fmha.dispatch.precompile import worker_main; worker_main()"


def _job_to_json(job: CompileJob, target: Any, limit: int, cache_dir: str | None) -> str:
    return json.dumps({"job": asdict(job), "target": [target.backend, target.arch, target.warp_size],
                       "limit": limit, "cache_dir": cache_dir})


def worker_main() -> None:
    """Entry point of a worker process: compile the jobs read from stdin until EOF."""
    import triton
    from triton.backends.compiler import GPUTarget

    out = sys.stdout
    sys.stdout = sys.stderr  # anything the compiler prints stays off the result channel
    out.write(_READY + "\n")  # imports done: compile timeouts start counting from here
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        data = json.loads(line)
        raw = data["job"]
        job = CompileJob(raw["module"], raw["kernel"], tuple(tuple(x) for x in raw["signature"]),
                         tuple(tuple(x) for x in raw["constexprs"]), raw["num_warps"], raw["num_stages"],
                         raw.get("language", "triton"), raw.get("maxnreg"))
        if data["cache_dir"]:  # the parent's Triton cache, also if it was set in code, not by env
            triton.knobs.cache.dir = data["cache_dir"]
        outcome = compile_job(job, GPUTarget(*data["target"]), data["limit"])
        out.write(_RESULT + json.dumps(outcome) + "\n")
        out.flush()


class _Worker:
    """One worker process, restarted if it dies."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.log: Any = None

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            package_root = str(Path(__file__).resolve().parent.parent)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else []))
            if self.log is not None:
                self.log.close()
            self.log = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
            for line in self.proc.stdout:  # wait until it has imported triton and fmha
                if line.startswith(_READY):
                    break
        return self.proc

    def run(self, request: str, timeout: float | None = None) -> dict[str, Any]:
        proc = self._start()
        start = time.perf_counter()
        try:
            proc.stdin.write(request + "\n")
            proc.stdin.flush()
            while True:
                if timeout is not None:
                    left = timeout - (time.perf_counter() - start)
                    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                        self.kill()
                        return {"shared": None, "seconds": time.perf_counter() - start,
                                "error": f"timed out after {timeout:g} s (compiler process killed)"}
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(_RESULT):
                    return json.loads(line[len(_RESULT):])
        except (BrokenPipeError, OSError):
            pass
        code = proc.wait()
        self.log.seek(0)
        tail = "\n".join(self.log.read().splitlines()[-6:])
        return {"shared": None, "seconds": 0.0,
                "error": first_lines(f"worker process exited with code {code}\n{tail}")}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the worker exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.log is not None:
            self.log.close()
            self.log = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _run_in_workers(jobs: list[CompileJob], target: Any, limit: int, cache_dir: str | None,
                    workers: int, timeout: float | None) -> Iterator[tuple[CompileJob, dict[str, Any]]]:
    """Compile `jobs` in `workers` processes; yield (job, outcome) as each finishes."""
    todo: queue.Queue[CompileJob] = queue.Queue()
    for job in jobs:
        todo.put(job)
    finished: queue.Queue[tuple[CompileJob, dict[str, Any]]] = queue.Queue()
    pool = [_Worker() for _ in range(workers)]
    stop = threading.Event()

    def feed(worker: _Worker) -> None:  # threads only wait on pipes: the GIL is free
        while not stop.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            finished.put((job, worker.run(_job_to_json(job, target, limit, cache_dir), timeout)))

    threads = [threading.Thread(target=feed, args=(w,), daemon=True) for w in pool]
    for thread in threads:
        thread.start()
    try:
        for _ in jobs:
            yield finished.get()
    except BaseException:
        stop.set()
        for worker in pool:
            worker.kill()
        raise
    finally:
        for thread in threads:
            thread.join(timeout=30)
        for worker in pool:
            worker.close()


# ----------------------------------------------------------------------------------------
# The record of what was built.


def _read_record(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"build record {path} is unreadable ({e}); building everything again",
                      stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format_version") != RECORD_FORMAT \
            or not isinstance(data.get("entries"), dict):
        warnings.warn(f"build record {path} has an unknown format; building everything again", stacklevel=3)
        return {}
    return data["entries"]


def _write_record(path: Path, entries: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps({"format_version": RECORD_FORMAT, "entries": entries}, indent=1))
    os.replace(tmp, path)


def _target_text(target: Any) -> str:
    return f"{target.backend}:{target.arch}:{target.warp_size}"


def record_key(config: KernelConfig, dtype: DType, target: Any, jobs: Sequence[CompileJob]) -> str:
    """Config name, dtype, Triton version, target, and a fingerprint of the kernels' source
    (Triton's `cache_key`, which covers the functions they call) and compile arguments."""
    import triton

    digest = hashlib.sha256()
    for job in jobs:
        fn = getattr(importlib.import_module(job.module), job.kernel)
        digest.update(f"{fn.cache_key}|{job!r}".encode())
    return (f"{config.name}|{dtype.value}|triton-{triton.__version__}|{_target_text(target)}"
            f"|{digest.hexdigest()[:16]}")


# ----------------------------------------------------------------------------------------
# The build.


@dataclass
class _Entry:
    config: KernelConfig
    dtype: DType
    variants: list[tuple[str, CompileJob]]
    key: str
    result: BuildResult


def _stale(item: _Entry, recorded: Mapping[str, Any]) -> bool:
    """True (and item.result.message says why) when a recorded build cannot be trusted: a
    kernel's Triton cache entry is not named, is gone, or is damaged (then it is evicted)."""
    from ..kernels.launch import jit_cache as kernel_cache

    why = []
    for kernel in recorded.get("kernels", []):
        entry = kernel.get("entry") if isinstance(kernel, dict) else None
        if not entry:
            why.append(f"{kernel.get('variant') if isinstance(kernel, dict) else kernel}: the record "
                       f"does not name its Triton cache entry")
        elif not Path(entry).is_dir():
            why.append(f"{entry}: Triton cache entry is gone")
        else:
            problems = kernel_cache.entry_problems(Path(entry))
            if problems:
                why.append(f"{entry}: damaged Triton cache entry ({', '.join(problems)}), evicted")
                shutil.rmtree(entry, ignore_errors=True)
    if why:
        item.result.message = "recorded build not trusted, compiled again: " + "; ".join(why)
    return bool(why)


def _as_enums(values: Iterable[Any] | None, enum: Any, what: str) -> set[Any] | None:
    if values is None:
        return None
    out = set()
    for value in values:
        try:
            out.add(enum(value))
        except ValueError:
            raise ValueError(f"{what} {value!r} is not one of {[e.value for e in enum]}") from None
    return out


def _plan(registry: Registry, arch: str, target: Any, limit: int, families: set[Family] | None,
          dtypes: set[DType] | None) -> list[_Entry | BuildResult]:
    """One entry per (config, dtype) to build, or a finished BuildResult (skipped, failed)."""
    out: list[_Entry | BuildResult] = []
    target_text = _target_text(target)
    for config in registry.filter(arch=arch):
        if families is not None and config.family not in families:
            continue
        for dtype in config.signature.dtypes:
            if dtypes is not None and dtype not in dtypes:
                continue
            result = BuildResult(config.name, config.family.value, dtype.value, target_text, "failed",
                                 shared_limit=limit)
            if dtype == DType.FP64:
                result.status = "skipped"
                result.message = f"{config.name} [{dtype.value}]: {dtype.value} runs in the interpreter only"
                out.append(result)
                continue
            if dtype not in TRITON_TYPES:
                result.message = (f"{config.name} [{dtype.value}]: no Triton element type for dtype "
                                  f"{dtype.value} in precompile.TRITON_TYPES")
                out.append(result)
                continue
            spec = FAMILY_KERNELS.get(config.family)
            if spec is None and not config.algorithm.pipeline.is_gluon:
                result.message = f"{config.name} [{dtype.value}]: no kernel is mapped to family " \
                                 f"{config.family.value} in FAMILY_KERNELS"
                out.append(result)
                continue
            try:
                if config.algorithm.pipeline.is_gluon:
                    variants = gluon_jobs(config, dtype)
                elif config.family == Family.SPLITKV_COMBINE:
                    variants = combine_jobs(spec, config, dtype, target)
                else:
                    variants = [(variant, make_job(spec, config, dtype, variant)) for variant in spec.variants]
                key = record_key(config, dtype, target, [job for _, job in variants])
            except Exception as e:
                result.message = f"{config.name} [{dtype.value}]: {first_lines(f'{type(e).__name__}: {e}')}"
                out.append(result)
                continue
            out.append(_Entry(config, dtype, variants, key, result))
    return out


def _finish(entry: _Entry, outcomes: Mapping[CompileJob, dict[str, Any]], arch: str, limit: int) -> None:
    """Fill entry.result from the outcomes of its jobs."""
    result = entry.result
    problems: list[str] = []
    notes: list[str] = [result.message] if result.message else []
    for variant, job in entry.variants:
        outcome = outcomes[job]
        built = KernelBuild(variant, job.kernel, outcome["shared"], outcome["seconds"], outcome["error"],
                            outcome.get("entry"), outcome.get("repaired"))
        result.kernels.append(built)
        where = f"{entry.config.name} [{entry.dtype.value}, {variant}] ({job.kernel})"
        if built.repaired:
            notes.append(f"{where}: damaged Triton cache entry rebuilt ({built.repaired})")
        if built.error is not None:
            problems.append(f"{where}: compile error:\n{built.error}")
        elif built.shared is not None and built.shared > limit:
            built.error = f"needs {built.shared} bytes of shared memory, over the {arch} limit of {limit}"
            problems.append(f"{where}: needs {built.shared} bytes of shared memory, more than the {arch} "
                            f"limit of {limit} bytes; it cannot launch (use smaller block_m/block_n, "
                            f"fewer stages or a smaller head_dim_max)")
    result.status = "failed" if problems else "built"
    result.message = "\n".join(problems + notes)


def build(registry: Registry, arch: str | None = None, families: Iterable[Family | str] | None = None,
          dtypes: Iterable[DType | str] | None = None, jobs: int | None = None, progress: bool = True,
          record_path: str | Path | None = None,
          on_result: Callable[[BuildResult], None] | None = None,
          timeout: float | None = None) -> list[BuildResult]:
    """Compile every config of `registry` that runs on `arch`, for each of its dtypes.

    Args:
        registry: the configs; those whose signature lists `arch` are built.
        arch: a CUDA arch ("sm90", ...); default: the current device's, sm90 without CUDA.
        families, dtypes: only these (Family/DType or their values); default all.
        jobs: worker processes (default: the number of CPUs). Compiles never run in this
            process: Triton's interpreter, once used, leaves patches that break compiling.
        progress: show a rich progress bar (on stderr).
        record_path: the JSON record of what was built (default: in Triton's cache dir).
        on_result: called with each BuildResult as it is decided.
        timeout: seconds one kernel may take to compile; its worker process is killed after
            that and the kernel reported failed (default: no limit).

    Returns one BuildResult per (config, dtype), in registry order: "built", "cached"
    (found in the record), "failed" (message names the config and gives the compiler's
    first lines or the shared-memory need) or "skipped" (fp64: interpreter only).
    """
    arch = arch or current_arch()
    if arch == CPU:
        raise ValueError(f"arch {CPU!r} is Triton's interpreter: its kernels need no build; "
                         f"give a CUDA arch such as sm90")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a number of seconds > 0 (or None: no limit)")
    target = target_of(arch)
    limit = shared_memory_limit(arch)
    record_file = Path(record_path) if record_path is not None else default_record_path()
    planned = _plan(registry, arch, target, limit, _as_enums(families, Family, "family"),
                    _as_enums(dtypes, DType, "dtype"))
    record = _read_record(record_file)
    results: list[BuildResult] = []
    pending: list[_Entry] = []
    for item in planned:
        if isinstance(item, BuildResult):  # skipped, or failed before compiling
            results.append(item)
        elif item.key in record and not _stale(item, record[item.key]):
            item.result.status = "cached"
            item.result.kernels = [KernelBuild(k["variant"], k["kernel"], k.get("shared"), entry=k.get("entry"))
                                   for k in record[item.key].get("kernels", [])]
            results.append(item.result)
        else:
            results.append(item.result)
            pending.append(item)
            continue
        if on_result is not None:
            on_result(results[-1])

    unique: dict[CompileJob, list[_Entry]] = {}  # identical compile calls run once
    for entry in pending:
        for job in dict.fromkeys(job for _, job in entry.variants):
            unique.setdefault(job, []).append(entry)
    outcomes: dict[CompileJob, dict[str, Any]] = {}
    remaining = {id(entry): len({job for _, job in entry.variants}) for entry in pending}

    def done(job: CompileJob, outcome: dict[str, Any]) -> None:
        outcomes[job] = outcome
        for entry in unique[job]:
            remaining[id(entry)] -= 1
            if remaining[id(entry)] == 0:
                _finish(entry, outcomes, arch, limit)
                if entry.result.status == "built":
                    # re-read first: another build may have added entries meanwhile
                    entries = {**_read_record(record_file), entry.key: {
                        "config": entry.config.name, "dtype": entry.dtype.value,
                        "target": _target_text(target),
                        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "kernels": [{"variant": k.variant, "kernel": k.kernel, "shared": k.shared,
                                     "entry": k.entry} for k in entry.result.kernels]}}
                    _write_record(record_file, entries)
                if on_result is not None:
                    on_result(entry.result)

    if unique:
        cache_dir = triton_cache_dir()
        workers = max(1, min(jobs or os.cpu_count() or 1, len(unique)))
        with _progress(progress, len(unique), arch) as advance:
            for job, outcome in _run_in_workers(list(unique), target, limit, cache_dir, workers, timeout):
                done(job, outcome)
                advance(job)
    return results


@contextlib.contextmanager
def _progress(show: bool, total: int, arch: str) -> Iterator[Callable[[CompileJob], None]]:
    if not show:
        yield lambda job: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"compiling for {arch}", total=total)

        def advance(job: CompileJob) -> None:
            bar.update(task, advance=1, description=f"compiling for {arch}: {job.kernel} done")

        yield advance
