"""Kernel configurations as data: what a kernel can serve (signature) and how it runs
(algorithm). A config has a stable, readable name and a JSON form.

The signature's `refusals(problem)` answers, in sentences, why a config cannot serve a
problem (xFormers' `not_supported_reasons`); an empty list means it can.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from .problem import DType, Feature, Problem


class Family(str, Enum):
    """Kernel families, as in CK's FMHA dispatcher. A plan is a list of launches of these."""

    FWD = "fwd"
    DROPOUT_MASK = "dropout_mask"
    BWD_DOT_DO_O = "bwd_dot_do_o"
    BWD_DQ_DK_DV = "bwd_dq_dk_dv"  # dK/dV, and dQ by atomics into an fp32 buffer
    BWD_CONVERT_DQ = "bwd_convert_dq"  # that buffer to dQ
    BWD_DQ = "bwd_dq"  # dQ without atomics (deterministic backward)
    FWD_SPLITKV = "fwd_splitkv"  # attention over a (paged) KV cache, keys split across programs
    SPLITKV_COMBINE = "splitkv_combine"  # merge partial (o, lse); also fmha.merge_states
    APPEND_KV = "append_kv"  # new keys/values into the cache, RoPE on the way


class Pipeline(str, Enum):
    """How a kernel is written. `triton`: plain Triton with pointer loads (any strides).
    `gluon_ws`: Gluon for Hopper, warp-specialized (TMA producer warp, two wgmma consumer
    warpgroups), see kernels/fwd_gluon.py; `gluon_ws_pingpong`: the same with the consumer
    warpgroups taking turns on the tensor cores (FlashAttention-3's ping-pong). `gluon`:
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
# What the dense kernels serve (everything but a paged cache) and what the KV-cache kernel serves.
DENSE_FEATURES = ALL_FEATURES - {Feature.PAGED_KV}
KVCACHE_FEATURES = frozenset({Feature.MASK, Feature.SINK_TOKENS, Feature.ALIBI, Feature.SOFTCAP,
                              Feature.SINKS, Feature.GQA, Feature.PAGED_KV, Feature.SEQUSED_K})


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
    needs_tma: bool = False  # TMA loads: 16-byte aligned strides, non-empty keys

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
        if not self.sliding_window and problem.window not in ((-1, -1), (-1, 0)):
            reasons.append(f"window {problem.window}: only causal masks, no sliding window")
        if self.needs_tma and not problem.tma_aligned:
            reasons.append("q/k/v strides or base pointers are not 16-byte aligned (TMA needs it)")
        if self.needs_tma and problem.seqlen_k == 0:
            reasons.append("seqlen_k is 0 (a TMA descriptor needs a non-empty tensor)")
        return reasons


@dataclass(frozen=True)
class Algorithm:
    """How a config runs: tile sizes, warps, software-pipelining depth, pipeline variant."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pipeline: Pipeline = Pipeline.TRITON
    dot_precision: str = "ieee"  # for fp32 inputs: "ieee" (exact fp32) or "tf32"


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
                + ("" if a.dot_precision == "ieee" else f"_{a.dot_precision}"))

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
    return rules
