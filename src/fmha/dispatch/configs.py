"""Kernel configurations as data: what a kernel can serve (signature) and how it runs
(algorithm). A config has a stable, readable name and a JSON form.

The signature's `refusals(problem)` answers, in sentences, why a config cannot serve a
problem (xFormers' `not_supported_reasons`); an empty list means it can.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from ..problem import DType, Feature, Problem


class Family(str, Enum):
    """Kernel families, as in CK's FMHA dispatcher. A plan is a list of launches of these."""

    FWD = "fwd"
    DROPOUT_MASK = "dropout_mask"
    BWD_DOT_DO_O = "bwd_dot_do_o"
    BWD_DQ_DK_DV = "bwd_dq_dk_dv"  # dK/dV, and dQ added (atomics or TMA reduce-add) into an fp32 buffer
    BWD_CONVERT_DQ = "bwd_convert_dq"  # that buffer to dQ
    BWD_DQ = "bwd_dq"  # dQ without atomics (deterministic backward)
    FWD_SPLITKV = "fwd_splitkv"  # attention over a (paged) KV cache, keys split across programs
    SPLITKV_COMBINE = "splitkv_combine"  # merge partial (o, lse); also fmha.merge_states
    APPEND_KV = "append_kv"  # new keys/values into the cache, RoPE on the way


class Pipeline(str, Enum):
    """How a kernel is written. `triton`: plain Triton with pointer loads (any strides).
    `gluon_ws`: Gluon for Hopper, warp-specialized (TMA producer warp, two wgmma consumer
    warpgroups), see kernels/fwd_gluon.py (the dK/dV of kernels/bwd_gluon.py: a loader warp,
    two wgmma warpgroups, two writer warps issuing dQ's TMA reduce-add); `gluon_ws_pingpong`:
    the same with the consumer warpgroups taking turns on the tensor cores (FlashAttention-3's
    ping-pong). `gluon`:
    Gluon for Hopper, TMA + wgmma, software-pipelined without warp specialization
    (kernels/bwd_gluon.py)."""

    TRITON = "triton"
    GLUON = "gluon"
    GLUON_WS = "gluon_ws"
    GLUON_WS_PINGPONG = "gluon_ws_pingpong"

    @property
    def is_gluon(self) -> bool:
        return self != Pipeline.TRITON


# CUDA archs the plain Triton kernels compile for; "cpu" is Triton's interpreter.
CUDA_ARCHS = ("sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm120")
CPU = "cpu"
ALL_FEATURES = frozenset(Feature)
# What the dense kernels serve (everything but a paged or float8 cache) and what the KV-cache kernel serves.
DENSE_FEATURES = ALL_FEATURES - {Feature.PAGED_KV, Feature.FP8_KV_CACHE}
KVCACHE_FEATURES = frozenset({Feature.MASK, Feature.SINK_TOKENS, Feature.ALIBI, Feature.SOFTCAP,
                              Feature.SINKS, Feature.GQA, Feature.PAGED_KV, Feature.SEQUSED_K,
                              Feature.FP8_KV_CACHE})
# The KV-cache families serve KVCACHE_FEATURES; the others DENSE_FEATURES.
KVCACHE_FAMILIES = frozenset({Family.FWD_SPLITKV, Family.SPLITKV_COMBINE, Family.APPEND_KV})


class ConfigError(ValueError):
    """A config (or its JSON) breaks a rule; the message names the rule."""


@dataclass(frozen=True)
class Signature:
    """Which problems a config can serve."""

    family: Family
    dtypes: tuple[DType, ...]
    archs: tuple[str, ...]
    head_dim_max: int
    head_dim_min: int = 1
    features: frozenset[Feature] = DENSE_FEATURES
    head_dims: tuple[int, ...] = ()  # if set: Dqk == Dv, one of these (fixed-size tiles)
    sliding_window: bool = True  # False: of the masks, causal only (either alignment)
    left_window: bool = False  # with sliding_window False: also windows (left, 0), causal with a left edge
    needs_tma: bool = False  # TMA loads: 16-byte aligned strides, no empty batch or sequence
    fp8_block_descale: bool = True  # False: fp8 descales per tensor or per (batch, head) only
    # > 0: the default selection passes over this config for problems without a mask and more
    # keys than this (a measured speed preference, not a limit of the kernel: it still fits,
    # a tuning database may still choose it, and it serves when nothing else fits).
    max_unmasked_seqlen_k: int = 0
    # True: the default selection passes over this config for float8 KV caches (measured slower
    # there than the next fitting config; a speed preference as max_unmasked_seqlen_k).
    slower_for_fp8_cache: bool = False
    # True: a decode kernel over float8 KV caches only (kernels/kvcache_gluon.py): the queries of a
    # (sequence, KV head) in one 16-row tile (seqlen_q x query heads per KV head <= 16), no packed
    # varlen queries.
    fp8_decode: bool = False

    def refusals(self, problem: Problem) -> list[str]:
        reasons = []
        if problem.arch not in self.archs:
            reasons.append(f"arch {problem.arch} not in {list(self.archs)}")
        if problem.dtype not in self.dtypes:
            reasons.append(f"dtype {problem.dtype.value} not in {[d.value for d in self.dtypes]}")
        head_dim = max(problem.head_dim_qk, problem.head_dim_v)
        if not self.head_dim_min <= head_dim <= self.head_dim_max:
            reasons.append(
                f"head dim {head_dim} outside [{self.head_dim_min}, {self.head_dim_max}]")
        missing = problem.features - self.features
        if missing:
            reasons.append(f"features not supported: {sorted(f.value for f in missing)}")
        if self.head_dims and not (problem.head_dim_qk == problem.head_dim_v
                                   and problem.head_dim_qk in self.head_dims):
            reasons.append(f"head dims (qk {problem.head_dim_qk}, v {problem.head_dim_v}) are not "
                           f"equal and one of {list(self.head_dims)}")
        if not self.sliding_window and problem.window not in ((-1, -1), (-1, 0)) \
                and not (self.left_window and problem.window[0] >= 0 and problem.window[1] == 0):
            reasons.append(f"window {problem.window}: only causal masks"
                           + (" and windows (left, 0)" if self.left_window else ", no sliding window"))
        if self.needs_tma:
            if not problem.tma_aligned:
                reasons.append("q/k/v strides or base pointers are not 16-byte aligned (TMA needs it)")
            empty = [name for name in ("batch", "seqlen_q", "seqlen_k") if getattr(problem, name) == 0]
            if empty:  # (e.g. the backward of seqlen_q == 0 still has keys to zero)
                reasons.append(f"{' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} 0 "
                               f"(a TMA descriptor needs a non-empty tensor)")
        if not self.fp8_block_descale and problem.fp8_block_descale:
            reasons.append("fp8 descales per block: this kernel takes one per tensor or per (batch, head)")
        if self.fp8_decode:
            if not problem.kv_fp8:
                reasons.append("a float8 KV cache only")
            rows = problem.seqlen_q * (problem.nhead_q // max(problem.nhead_k, 1))
            if problem.varlen:
                reasons.append("packed varlen queries: one tile of query rows a (sequence, KV head) only")
            elif rows > 16:
                reasons.append(f"{problem.seqlen_q} queries x {problem.nhead_q // max(problem.nhead_k, 1)} query "
                               f"heads per KV head = {rows} rows: at most 16 (one 16-row tile)")
        return reasons

    def passed_over(self, problem: Problem) -> str:
        """Why the default (first-fit) selection prefers a later fitting config for `problem`
        ("" if it does not): a speed preference, unlike `refusals`."""
        if self.max_unmasked_seqlen_k and problem.window == (-1, -1) \
                and problem.seqlen_k > self.max_unmasked_seqlen_k:
            return (f"no mask and seqlen_k {problem.seqlen_k} > {self.max_unmasked_seqlen_k}: "
                    f"measured slower there than the next config")
        if self.slower_for_fp8_cache and problem.kv_fp8:
            return "float8 KV cache: measured slower there than the next config"
        return ""


@dataclass(frozen=True)
class Algorithm:
    """How a config runs: tile sizes, warps, software-pipelining depth, pipeline variant.
    persistent (the Gluon forward; the warp-specialized Gluon dK/dV): one
    program per SM walks the CTA (key) tiles instead of one program per tile, so a tile's
    epilogue overlaps the next tile's loads."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pipeline: Pipeline = Pipeline.TRITON
    dot_precision: str = "ieee"  # for fp32 inputs: "ieee" (exact fp32) or "tf32"
    persistent: bool = False
    # KV-cache attention: programs of this kernel an SM runs at once, for the split policy (0: the
    # policy's own programs_per_sm)
    programs_per_sm: int = 0


@dataclass(frozen=True)
class KernelConfig:
    signature: Signature
    algorithm: Algorithm
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for rule in _rule_violations(self):
            raise ConfigError(f"invalid kernel config: {rule}")

    @property
    def family(self) -> Family:
        return self.signature.family

    @property
    def name(self) -> str:
        s, a = self.signature, self.algorithm
        arch = "cpu" if s.archs == (CPU,) else "cuda" if s.archs == CUDA_ARCHS else "-".join(s.archs)
        dtypes = "-".join(d.value for d in s.dtypes)
        return (f"{s.family.value}_{dtypes}_d{s.head_dim_min}-{s.head_dim_max}_{arch}_"
                f"{a.pipeline.value}_m{a.block_m}n{a.block_n}w{a.num_warps}s{a.num_stages}"
                + ("" if a.dot_precision == "ieee" else f"_{a.dot_precision}")
                + ("_persistent" if a.persistent else ""))

    def to_dict(self) -> dict[str, Any]:
        s = asdict(self.signature)
        s["family"] = self.signature.family.value
        s["dtypes"] = [d.value for d in self.signature.dtypes]
        s["archs"] = list(self.signature.archs)
        s["features"] = sorted(f.value for f in self.signature.features)
        a = asdict(self.algorithm)
        a["pipeline"] = self.algorithm.pipeline.value
        return {"name": self.name, "signature": s, "algorithm": a, "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelConfig:
        try:
            s, a = dict(data["signature"]), dict(data["algorithm"])
            signature = Signature(
                family=Family(s.pop("family")),
                dtypes=tuple(DType(d) for d in s.pop("dtypes")),
                archs=tuple(s.pop("archs")),
                features=frozenset(Feature(f) for f in s.pop("features")),
                head_dims=tuple(s.pop("head_dims", ())),
                **s,
            )
            algorithm = Algorithm(**{**a, "pipeline": Pipeline(a.get("pipeline", "triton"))})
            config = cls(signature, algorithm, notes=data.get("notes", ""))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed kernel config {data.get('name', data)!r}: {e!r}") from e
        if "name" in data and data["name"] != config.name:
            raise ConfigError(f"config name {data['name']!r} does not match its fields "
                              f"(they give {config.name!r})")
        return config


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _rule_violations(config: KernelConfig) -> list[str]:
    s, a = config.signature, config.algorithm
    rules = []
    if not s.dtypes:
        rules.append("signature.dtypes is empty")
    if not s.archs:
        rules.append("signature.archs is empty")
    if not 1 <= s.head_dim_min <= s.head_dim_max <= 256:
        rules.append(f"head dims need 1 <= head_dim_min <= head_dim_max <= 256, "
                     f"got {s.head_dim_min}..{s.head_dim_max}")
    for name in ("block_m", "block_n"):
        value = getattr(a, name)
        if not (_is_pow2(value) and 16 <= value <= 256):
            rules.append(f"algorithm.{name}={value} must be a power of two in [16, 256]")
    if a.num_warps not in (1, 2, 4, 8, 16):
        rules.append(f"algorithm.num_warps={a.num_warps} must be 1, 2, 4, 8 or 16")
    if not 1 <= a.num_stages <= 8:
        rules.append(f"algorithm.num_stages={a.num_stages} must be in [1, 8]")
    if a.dot_precision not in ("ieee", "tf32"):
        rules.append(f"algorithm.dot_precision={a.dot_precision!r} must be 'ieee' or 'tf32'")
    if a.dot_precision == "tf32" and DType.FP32 not in s.dtypes:
        rules.append("algorithm.dot_precision='tf32' applies to fp32 inputs only; the dtypes have no fp32")
    if a.programs_per_sm < 0:
        rules.append(f"algorithm.programs_per_sm={a.programs_per_sm} must be >= 0")
    rules += _gluon_rule_violations(s, a)
    # KV-cache configs with VARLEN serve batch prefill (packed queries against the cache).
    served = KVCACHE_FEATURES | {Feature.VARLEN} if s.family in KVCACHE_FAMILIES else DENSE_FEATURES
    extra = s.features - served
    if extra:
        rules.append(f"family {s.family.value} cannot serve features {sorted(f.value for f in extra)} "
                     f"(it serves {sorted(f.value for f in served)})")
    return rules


def _gluon_rule_violations(s: Signature, a: Algorithm) -> list[str]:
    """The Hopper Gluon kernels' fixed shapes (kernels/fwd_gluon.py, bwd_gluon.py): an edited
    config outside them is refused here instead of failing in the compiler."""
    rules = []
    if a.persistent and not (
            (s.family == Family.FWD and a.pipeline not in (Pipeline.TRITON, Pipeline.GLUON))
            or (s.family == Family.BWD_DQ_DK_DV and a.pipeline == Pipeline.GLUON_WS)):
        rules.append(f"persistent: only the Gluon forward and the warp-specialized Gluon dK/dV kernel have a "
                     f"persistent kernel, got family {s.family.value} pipeline {a.pipeline.value}")
    if not a.pipeline.is_gluon:
        return rules
    if s.archs != ("sm90",):
        rules.append(f"pipeline {a.pipeline.value} runs on sm90 only, got archs {list(s.archs)}")
    if s.family == Family.FWD:
        if a.block_m not in (128, 192) or a.num_warps != 4:
            rules.append(f"pipeline {a.pipeline.value}: the forward's query tile is two or three consumer "
                         f"warpgroups (block_m 128 or 192, num_warps 4), got block_m={a.block_m} "
                         f"num_warps={a.num_warps}")
        if a.block_n < 32:
            rules.append(f"pipeline {a.pipeline.value}: block_n={a.block_n} must be >= 32")
    elif s.family == Family.BWD_DQ_DK_DV:
        if a.pipeline == Pipeline.GLUON_WS:
            # block_m 128 (D=64 only): 128-query stages worked in two 64-query halves
            # (bwd_gluon._ws_compute_m128); at D=128 its stages and dQ buffer leave no room.
            # D=256: 64 keys, dQ staged in the consumed Q/dO stage (bwd_gluon._ws_compute_d256);
            # a third 64 KB stage does not fit (2 stages: 214 KB).
            d = s.head_dim_max
            tile_128_keys = a.block_n == 128 and d in (64, 128) and (
                a.block_m == 64 or (a.block_m == 128 and d == 64 and a.num_stages <= 3))
            tile_d256 = d == 256 and (a.block_m, a.block_n) == (64, 64) and a.num_stages <= 2
            if a.num_warps != 8 or not (tile_128_keys or tile_d256):
                rules.append(f"pipeline {a.pipeline.value}: the warp-specialized Gluon dK/dV kernel runs 64 queries "
                             f"against 128 keys on 8 compute warps (block_m 64, block_n 128, num_warps 8) at head "
                             f"dim 64 or 128, or at head dim 64 128 queries (block_m 128, at most 3 stages), or at "
                             f"head dim 256 64 queries against 64 keys (block_m 64, block_n 64, at most 2 stages), "
                             f"got head dim {d} block_m={a.block_m} block_n={a.block_n} num_warps={a.num_warps} "
                             f"stages={a.num_stages}")
        elif (a.block_m != 64 or (a.block_n, a.num_warps) not in ((64, 4), (64, 8), (128, 8))
                or a.pipeline != Pipeline.GLUON):
            rules.append(f"pipeline {a.pipeline.value}: the Gluon dK/dV kernel runs 64 queries against 64 keys "
                         f"on 4 or 8 warps or 128 keys on 8 (block_m 64, block_n/num_warps 64/4, 64/8 or 128/8, "
                         f"pipeline gluon or, at 128 keys, gluon_ws)")
    elif s.family == Family.FWD_SPLITKV:
        if not (s.fp8_decode and s.head_dims in ((64,), (128,), (256,)) and (a.block_m, a.num_warps) == (16, 1)
                and a.block_n >= 16 and a.block_n * s.head_dims[0] in (2048, 4096) and 2 <= a.num_stages <= 4
                and a.pipeline == Pipeline.GLUON):
            rules.append(f"pipeline {a.pipeline.value}: the Gluon decode kernel serves float8 caches at head dim "
                         f"64, 128 or 256 (signature fp8_decode, head_dims one of them) with one warp a 16-row tile "
                         f"of 2 or 4 KB of keys (block_n >= 16, block_n x head dim 2048 or 4096) and "
                         f"2-4 stages (block_m 16, num_warps 1, pipeline gluon), got head_dims {list(s.head_dims)} "
                         f"fp8_decode={s.fp8_decode} block_m={a.block_m} block_n={a.block_n} num_warps={a.num_warps} "
                         f"stages={a.num_stages} pipeline {a.pipeline.value}")
    else:
        rules.append(f"pipeline {a.pipeline.value}: no Gluon kernel for family {s.family.value}")
    return rules


def padded_head_dim(d: int) -> int:
    """The head-dim tile the kernels use for head dim `d`: next power of two, at least 16."""
    p = 16
    while p < d:
        p *= 2
    return p


def shared_memory_estimate(config: KernelConfig, dtype: DType | None = None) -> int | None:
    """Bytes of shared memory the plain `fwd` kernel of `config` is expected to need: the q
    tile plus `num_stages` buffers of the k and v tiles (what Triton's software pipeline
    keeps in flight). An estimate: `fmha kernels build` measures it. None for other families."""
    if config.family != Family.FWD:
        return None
    a = config.algorithm
    width = {DType.FP16: 2, DType.BF16: 2, DType.FP32: 4, DType.FP64: 8}[dtype or config.signature.dtypes[0]]
    d = padded_head_dim(config.signature.head_dim_max)
    return width * (a.block_m * d + a.num_stages * a.block_n * 2 * d)
