"""Autofill (CK's dispatcher `autofill`): a short spec such as "fwd fp16-bf16 d128 m128n64"
completed to a full, valid `KernelConfig`, the defaults taken from the nearest stock config.
An authoring helper: `fmha kernels autofill` prints its report."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ..problem import DType, Feature
from .configs import (
    CPU,
    CUDA_ARCHS,
    DENSE_FEATURES,
    KVCACHE_FAMILIES,
    KVCACHE_FEATURES,
    Algorithm,
    ConfigError,
    Family,
    KernelConfig,
    Pipeline,
    Signature,
    padded_head_dim,
    shared_memory_estimate,
)
from .registry import default_registry

_TILE = re.compile(r"m(\d+)n(\d+)(?:w(\d+))?(?:s(\d+))?")
_HEAD_DIMS = re.compile(r"(?:d|hdim)(\d+)(?:-(\d+))?")
_DTYPE_ALIASES = {"half": (DType.FP16, DType.BF16), "all": (DType.FP16, DType.BF16, DType.FP32)}
SPEC_FORMS = ("a family (fwd, bwd_dq_dk_dv, ...)", "dtypes (fp16, fp16-bf16, half, fp32, all)",
              "head dims (d128: 1..128, d65-128)", "a tile (m128n64, optionally w8 warps, s3 stages)",
              "an arch (cuda: every CUDA arch, sm90, sm80-sm90, cpu)", "tf32 (fp32 dot precision)")


def _parse_spec(spec: str) -> dict[str, Any]:
    """Tokens of a spec such as "fwd fp16-bf16 d128 m128n64" (separated by spaces, ':' or ',')."""
    out: dict[str, Any] = {}
    families = {f.value: f for f in Family}
    for token in re.split(r"[\s:,]+", spec.strip().lower()):
        if not token:
            continue
        if token in families:
            key, value = "family", families[token]
        elif token in _DTYPE_ALIASES or all(t in {d.value for d in DType} for t in token.split("-")):
            key, value = "dtype", _DTYPE_ALIASES.get(token) or tuple(DType(t) for t in token.split("-"))
        elif m := _HEAD_DIMS.fullmatch(token):
            key = "head_dim"
            value = (int(m.group(1)), int(m.group(2))) if m.group(2) else int(m.group(1))
        elif m := _TILE.fullmatch(token):
            key, value = "tile", token
        elif token == "cuda" or re.fullmatch(r"(sm\d+|cpu)(-(sm\d+|cpu))*", token):
            key, value = "arch", token
        elif token in ("tf32", "ieee"):
            key, value = "dot_precision", token
        else:
            raise ConfigError(f"autofill spec token {token!r} is not understood; accepted: "
                              + "; ".join(SPEC_FORMS))
        if key in out:
            raise ConfigError(f"autofill spec {spec!r} gives the {key} twice")
        out[key] = value
    return out


def _archs_of(arch: str | Sequence[str]) -> tuple[str, ...]:
    names = arch.split("-") if isinstance(arch, str) else list(arch)
    if list(names) == ["cuda"]:
        return CUDA_ARCHS
    for name in names:
        if name not in CUDA_ARCHS and name != CPU:
            raise ConfigError(f"arch {name!r} is not known; accepted: cuda, {CPU}, {', '.join(CUDA_ARCHS)}")
    if CPU in names and len(names) > 1:
        raise ConfigError(f"arch {CPU!r} (Triton's interpreter) cannot share a config with CUDA archs: {names}")
    return tuple(names)


def autofill(spec: str | None = None, *, family: Family | str | None = None,
             dtype: DType | str | Sequence[DType | str] | None = None,
             head_dim: int | tuple[int, int] | None = None, tile: str | None = None,
             arch: str | Sequence[str] | None = None, num_warps: int | None = None,
             num_stages: int | None = None, features: Sequence[Feature | str] | None = None,
             dot_precision: str | None = None, registry: Any = None) -> KernelConfig:
    """A full `KernelConfig` from a short spec; see `autofill_report` (this returns its config)."""
    return autofill_report(spec, family=family, dtype=dtype, head_dim=head_dim, tile=tile, arch=arch,
                           num_warps=num_warps, num_stages=num_stages, features=features,
                           dot_precision=dot_precision, registry=registry)[0]


def autofill_report(spec: str | None = None, *, family: Family | str | None = None,
                    dtype: DType | str | Sequence[DType | str] | None = None,
                    head_dim: int | tuple[int, int] | None = None, tile: str | None = None,
                    arch: str | Sequence[str] | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, features: Sequence[Feature | str] | None = None,
                    dot_precision: str | None = None,
                    registry: Any = None) -> tuple[KernelConfig, dict[str, str]]:
    """Complete a short spec to a valid config, and say where each filled-in field came from.

    `spec` is a string of tokens, e.g. "fwd fp16-bf16 d128 m128n64" (see SPEC_FORMS); the
    keyword arguments give the same fields (a field given both ways is an error). Only the
    family is required. Defaults: arch "cuda" (every CUDA arch); dtypes fp16+bf16 on CUDA,
    fp16+bf16+fp32+fp64 on the CPU (fp16+bf16+fp32 for the KV-cache families); head dims
    1..256 (`head_dim=128` is 1..128, `(65, 128)` is 65..128); features: everything the
    family serves; dot precision "ieee". Tile, warps and stages come from the closest
    config of the same family in `registry` (default: the stock registry; closest = same
    arch kind, a shared dtype, and the least log2 distance of block_m, block_n (when the
    tile is given) and padded head dim; registry order breaks ties), and a rule
    (4 warps, 8 for tiles of 128 x 64 x 128 and more; 2 stages on CUDA, 1 on the CPU) when
    it has none.

    Returns (config, sources): sources maps each field to "given" or how it was filled,
    and "warning" to a note when the estimated shared memory of a CUDA `fwd` config exceeds
    sm90's 227 KB. Raises ConfigError naming the rule a field breaks.
    """
    parsed = _parse_spec(spec) if spec else {}
    given = {"family": family, "dtype": dtype, "head_dim": head_dim, "tile": tile, "arch": arch,
             "dot_precision": dot_precision}
    for key, value in given.items():
        if value is not None:
            if key in parsed:
                raise ConfigError(f"autofill: {key} is given both in the spec {spec!r} and as an argument")
            parsed[key] = value
    sources: dict[str, str] = {}
    if parsed.get("family") is None:
        raise ConfigError("autofill needs a family; accepted: " + ", ".join(f.value for f in Family))
    try:
        fam = Family(parsed["family"])
    except ValueError:
        raise ConfigError(f"family {parsed['family']!r} is not known; accepted: "
                          + ", ".join(f.value for f in Family)) from None
    sources["family"] = "given"
    archs = _archs_of(parsed.get("arch", "cuda"))
    sources["archs"] = "given" if "arch" in parsed else "default: every CUDA arch"
    on_cpu = archs == (CPU,)
    kv = fam in KVCACHE_FAMILIES
    if "dtype" in parsed:
        raw = parsed["dtype"]
        raw = [raw] if isinstance(raw, (str, DType)) else list(raw)
        try:
            dtypes = tuple(dict.fromkeys(DType(d) for d in raw))
        except ValueError:
            raise ConfigError(f"dtype {parsed['dtype']!r} is not known; accepted: "
                              + ", ".join(d.value for d in DType)) from None
        sources["dtypes"] = "given"
    else:
        dtypes = ((DType.FP16, DType.BF16, DType.FP32) + (() if kv else (DType.FP64,)) if on_cpu
                  else (DType.FP16, DType.BF16))
        sources["dtypes"] = f"default for {'the CPU' if on_cpu else 'CUDA'}"
    hd = parsed.get("head_dim")
    if hd is None:
        hd_min, hd_max = 1, 256
        sources["head_dims"] = "default: 1..256"
    else:
        hd_min, hd_max = (1, int(hd)) if isinstance(hd, int) else (int(hd[0]), int(hd[1]))
        sources["head_dims"] = f"given (the kernel's head-dim tile is {padded_head_dim(hd_max)})"
    if features is None:
        feats = KVCACHE_FEATURES if kv else DENSE_FEATURES
        sources["features"] = f"default: everything {fam.value} serves"
    else:
        try:
            feats = frozenset(Feature(f) for f in features)
        except ValueError:
            raise ConfigError(f"features {list(features)!r} name an unknown feature; accepted: "
                              + ", ".join(f.value for f in Feature)) from None
        sources["features"] = "given"
    warps = stages = None
    block = None
    if parsed.get("tile") is not None:
        m = _TILE.fullmatch(str(parsed["tile"]).lower())
        if m is None:
            raise ConfigError(f"tile {parsed['tile']!r} is not understood; accepted: m<block_m>n<block_n>"
                              f"[w<warps>][s<stages>], e.g. m128n64 or m128n64w8s3")
        block = (int(m.group(1)), int(m.group(2)))
        warps = int(m.group(3)) if m.group(3) else None
        stages = int(m.group(4)) if m.group(4) else None
        sources["tile"] = "given"
    for name, value, current in (("num_warps", num_warps, warps), ("num_stages", num_stages, stages)):
        if value is not None and current is not None:
            raise ConfigError(f"autofill: {name} is given both in the tile and as an argument")
    warps = num_warps if num_warps is not None else warps
    stages = num_stages if num_stages is not None else stages
    if warps is not None:
        sources["num_warps"] = "given"
    if stages is not None:
        sources["num_stages"] = "given"
    if block is None or warps is None or stages is None:
        nearest = _nearest_config(registry, fam, archs, dtypes, hd_max, block)
        if nearest is not None:
            a = nearest.algorithm
            where = f"from {nearest.name} (closest config of the registry)"
            if block is None:
                block, sources["tile"] = (a.block_m, a.block_n), where
            if warps is None:
                warps, sources["num_warps"] = a.num_warps, where
            if stages is None:
                stages, sources["num_stages"] = a.num_stages, where
        else:
            if block is None:
                block = (16, 16) if on_cpu else (64, 64)
                sources["tile"] = "rule (no config of this family in the registry)"
            if warps is None:
                big = block[0] * block[1] * padded_head_dim(hd_max) >= 128 * 64 * 128
                warps, sources["num_warps"] = (8 if big and not on_cpu else 4), "rule (tile size)"
            if stages is None:
                stages, sources["num_stages"] = (1 if on_cpu else 2), "rule (CPU: 1, CUDA: 2)"
    precision = parsed.get("dot_precision", "ieee")
    sources["dot_precision"] = "given" if "dot_precision" in parsed else "default: ieee"
    config = KernelConfig(Signature(fam, dtypes, archs, hd_max, hd_min, feats),
                          Algorithm(block[0], block[1], warps, stages, Pipeline.TRITON, precision),
                          notes="autofilled")
    if DType.FP64 in dtypes and archs != (CPU,):
        # A hand-built config may list fp64 for CUDA (`fmha kernels build` skips it); autofill
        # does not make configs with parts that can never run.
        raise ConfigError(f"invalid kernel config: fp64 runs in Triton's interpreter only: a config with fp64 "
                          f"must have archs ['{CPU}'], got {list(archs)}")
    estimate = shared_memory_estimate(config, DType.FP32 if DType.FP32 in dtypes else dtypes[0])
    if estimate is not None and not on_cpu and estimate > _SM90_SHARED:
        sources["warning"] = (f"estimated shared memory {estimate} bytes (q tile + {stages} stages of k/v "
                              f"tiles) exceeds sm90's {_SM90_SHARED}; check with `fmha kernels build`")
    return config, sources


_SM90_SHARED = 232448


def _nearest_config(registry: Any, family: Family, archs: tuple[str, ...], dtypes: tuple[DType, ...],
                    head_dim_max: int, block: tuple[int, int] | None) -> KernelConfig | None:
    """The config of `registry` whose defaults autofill takes (see `autofill_report`)."""
    if registry is None:
        registry = default_registry()
    on_cpu = archs == (CPU,)
    pool = [c for c in registry if c.family == family and (c.signature.archs == (CPU,)) == on_cpu
            and set(c.signature.dtypes) & set(dtypes)]
    if not pool:
        return None

    def log2(x: int) -> float:
        return math.log2(max(1, x))

    def distance(c: KernelConfig) -> float:
        a = c.algorithm
        tile = 0.0 if block is None else abs(log2(a.block_m) - log2(block[0])) + abs(log2(a.block_n) - log2(block[1]))
        return tile + abs(log2(padded_head_dim(c.signature.head_dim_max)) - log2(padded_head_dim(head_dim_max)))

    return min(pool, key=distance)
