"""`Problem`: everything about one attention call that matters for choosing kernels.

Plain data (shapes, dtype, layout, features, arch), built by the API from tensors after
validation, or by hand (CLI, tests, `fmha kernels explain`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class DType(str, Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    FP64 = "fp64"  # interpreter only: for torch.autograd.gradcheck
    FP8_E4M3 = "fp8_e4m3"  # forward only, with descales (fmha.fp8)
    FP8_E5M2 = "fp8_e5m2"


class Feature(str, Enum):
    """Optional parts of the computation a kernel may or may not implement."""

    MASK = "mask"  # causal or sliding window
    SINK_TOKENS = "sink_tokens"
    BIAS = "bias"
    ALIBI = "alibi"
    SOFTCAP = "softcap"
    SINKS = "sinks"  # sink logits
    DROPOUT = "dropout"
    VARLEN = "varlen"
    SEQUSED_K = "seqused_k"
    GQA = "gqa"
    V_COLUMN_MAJOR = "v_column_major"
    DETERMINISTIC = "deterministic"  # bitwise reproducible backward
    PAGED_KV = "paged_kv"  # keys and values read through a block table
    FP8_KV_CACHE = "fp8_kv_cache"  # a float8 KV cache, dequantized as it is read (16/32-bit queries)


class MaskAlign(str, Enum):
    BOTTOM_RIGHT = "bottom_right"
    TOP_LEFT = "top_left"


@dataclass(frozen=True)
class Problem:
    """One attention problem. Sequence lengths are maxima for varlen problems."""

    batch: int
    nhead_q: int
    nhead_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim_qk: int
    head_dim_v: int
    dtype: DType = DType.BF16
    layout: str = "bhsd"
    arch: str = "cpu"
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # (left, right); causal already folded in
    mask_align: MaskAlign = MaskAlign.BOTTOM_RIGHT
    sink_size: int = 0
    bias: bool = False
    alibi: bool = False
    softcap: float = 0.0
    sinks: bool = False
    dropout_p: float = 0.0
    varlen: bool = False
    seqused_k: bool = False
    v_column_major: bool = False
    deterministic: bool = False
    paged_kv: bool = False
    # q/k/v base pointers and strides 16-byte aligned (TMA descriptors need it); the API
    # measures it, hand-built problems assume fresh tensors.
    tma_aligned: bool = True
    # float8: some q/k/v descale is per block along the sequence (fmha.fp8), not per
    # tensor or per (batch, head).
    fp8_block_descale: bool = False
    # the KV cache is float8 (attention_with_kvcache; `dtype` is the queries')
    kv_fp8: bool = False

    def __post_init__(self) -> None:
        if self.causal and self.window[1] != 0:
            object.__setattr__(self, "window", (self.window[0], 0))

    @property
    def features(self) -> frozenset[Feature]:
        f = {
            Feature.MASK: self.window != (-1, -1),
            Feature.SINK_TOKENS: self.sink_size > 0,
            Feature.BIAS: self.bias,
            Feature.ALIBI: self.alibi,
            Feature.SOFTCAP: self.softcap > 0,
            Feature.SINKS: self.sinks,
            Feature.DROPOUT: self.dropout_p > 0,
            Feature.VARLEN: self.varlen,
            Feature.SEQUSED_K: self.seqused_k,
            Feature.GQA: self.nhead_q != self.nhead_k,
            Feature.V_COLUMN_MAJOR: self.v_column_major,
            Feature.DETERMINISTIC: self.deterministic,
            Feature.PAGED_KV: self.paged_kv,
            Feature.FP8_KV_CACHE: self.kv_fp8,
        }
        return frozenset(k for k, on in f.items() if on)

    def flops_fwd(self) -> float:
        """FLOPs of the forward in the FlashAttention convention (causal halves it)."""
        flops = 2.0 * self.batch * self.nhead_q * self.seqlen_q * self.seqlen_k * (
            self.head_dim_qk + self.head_dim_v)
        return flops / 2 if self.causal else flops

    def with_(self, **changes) -> Problem:
        return replace(self, **changes)

    def describe(self) -> str:
        shape = (f"B={self.batch} Hq={self.nhead_q} Hk={self.nhead_k} "
                 f"Sq={self.seqlen_q} Sk={self.seqlen_k} Dqk={self.head_dim_qk} "
                 f"Dv={self.head_dim_v} {self.dtype.value} {self.layout} {self.arch}")
        extras = []
        if self.causal:
            extras.append(f"causal({self.mask_align.value})")
        elif self.window != (-1, -1):
            extras.append(f"window{self.window}({self.mask_align.value})")
        if self.sink_size:
            extras.append(f"sink_size={self.sink_size}")
        if self.softcap:
            extras.append(f"softcap={self.softcap}")
        if self.dropout_p:
            extras.append(f"dropout={self.dropout_p}")
        extras += [f.value for f in sorted(self.features, key=lambda f: f.value)
                   if f in (Feature.BIAS, Feature.ALIBI, Feature.SINKS, Feature.VARLEN,
                            Feature.SEQUSED_K, Feature.V_COLUMN_MAJOR, Feature.PAGED_KV,
                            Feature.FP8_KV_CACHE)]
        return shape + ("" if not extras else " " + " ".join(extras))
