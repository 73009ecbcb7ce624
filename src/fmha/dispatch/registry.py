"""`Registry`: an ordered set of kernel configs, filterable, exportable to JSON.

Order matters: the rule-based selector takes the first config that fits (CK's first
fit), so the stock registry lists narrow, fast configs before general ones.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..problem import DType, Feature
from .configs import (
    CPU,
    CUDA_ARCHS,
    DENSE_FEATURES,
    KVCACHE_FEATURES,
    Algorithm,
    ConfigError,
    Family,
    KernelConfig,
    Pipeline,
    Signature,
)

FORMAT_VERSION = 1


class Registry:
    def __init__(self, configs: Iterable[KernelConfig] = (), name: str = "custom") -> None:
        self.name = name
        self._configs: dict[str, KernelConfig] = {}
        for config in configs:
            self.register(config)

    def register(self, config: KernelConfig) -> KernelConfig:
        if config.name in self._configs:
            raise ConfigError(f"registry {self.name!r} already has a config named {config.name!r}")
        self._configs[config.name] = config
        return config

    def __iter__(self) -> Iterator[KernelConfig]:
        return iter(self._configs.values())

    def __len__(self) -> int:
        return len(self._configs)

    def __getitem__(self, name: str) -> KernelConfig:
        try:
            return self._configs[name]
        except KeyError:
            raise KeyError(f"no config named {name!r} in registry {self.name!r}") from None

    def filter(self, *, arch: str | None = None, family: Family | None = None,
               dtype: DType | None = None) -> Registry:
        """A new registry with the configs that run on `arch`, of `family`, for `dtype`."""
        keep = [c for c in self
                if (arch is None or arch in c.signature.archs)
                and (family is None or c.family == family)
                and (dtype is None or dtype in c.signature.dtypes)]
        return Registry(keep, name=f"{self.name}[filtered]")

    def profile(self, name: str) -> Registry:
        """The configs of a named profile (CK's "receipts"): see PROFILES."""
        if name not in PROFILES:
            raise ValueError(f"profile={name!r} is not known; accepted: {sorted(PROFILES)}")
        families, dtypes = PROFILES[name]
        keep = [c for c in self if (families is None or c.family in families)
                and (dtypes is None or set(c.signature.dtypes) & dtypes)]
        return Registry(keep, name=f"{self.name}[{name}]")

    def merged(self, other: Registry, name: str | None = None) -> Registry:
        """This registry's configs, then those of `other` that it lacks (first fit keeps ours first)."""
        return Registry([*self, *(c for c in other if c.name not in self._configs)],
                        name=name or f"{self.name}+{other.name}")

    def statistics(self) -> dict[str, dict[str, int]]:
        return {
            "by_family": dict(Counter(c.family.value for c in self)),
            "by_dtype": dict(Counter(d.value for c in self for d in c.signature.dtypes)),
            "by_pipeline": dict(Counter(c.algorithm.pipeline.value for c in self)),
        }

    def to_json(self) -> str:
        data = {"format_version": FORMAT_VERSION, "name": self.name,
                "statistics": self.statistics(), "configs": [c.to_dict() for c in self]}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Registry:
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"registry JSON is not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
            raise ConfigError("registry JSON must be an object with a 'configs' list")
        if data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ConfigError(f"registry JSON format_version {data['format_version']} is not "
                              f"supported (this fmha reads {FORMAT_VERSION})")
        configs = []
        for i, entry in enumerate(data["configs"]):
            if not isinstance(entry, dict):
                raise ConfigError(f"registry JSON configs[{i}] is not an object")
            configs.append(KernelConfig.from_dict(entry))
        return cls(configs, name=str(data.get("name", "imported")))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Registry:
        return cls.from_json(Path(path).read_text())


_BWD = frozenset({Family.BWD_DOT_DO_O, Family.BWD_DQ_DK_DV, Family.BWD_CONVERT_DQ, Family.BWD_DQ})
_KVCACHE = frozenset({Family.FWD_SPLITKV, Family.SPLITKV_COMBINE, Family.APPEND_KV})
# Named subsets (CK's receipts): (families or None for all, dtypes or None for all).
PROFILES: dict[str, tuple[frozenset | None, frozenset | None]] = {
    "flash_fwd": (frozenset({Family.FWD}), None),
    "flash_bwd": (_BWD, None),
    "pytorch": (frozenset({Family.FWD, Family.DROPOUT_MASK}) | _BWD, None),  # training through autograd
    "inference": (frozenset({Family.FWD}) | _KVCACHE, None),
    "fp32": (None, frozenset({DType.FP32})),
    "all": (None, None),
}


def _config(family, dtypes, archs, head_dim_max, block_m, block_n, warps, stages, head_dim_min=1,
            features=DENSE_FEATURES, **signature):
    return KernelConfig(
        Signature(family, dtypes, archs, head_dim_max, head_dim_min, features, **signature),
        Algorithm(block_m, block_n, warps, stages),
    )


_GLUON_FEATURES = frozenset({Feature.MASK, Feature.GQA})


def _gluon_config(family, head_dim, block_m, block_n, warps, stages, pipeline, notes,
                  features=_GLUON_FEATURES, dtypes=(DType.FP16, DType.BF16), persistent=False,
                  max_unmasked_seqlen_k=0, left_window=False):
    """A Hopper Gluon config: fp16/bf16 (or fp8 e4m3 for the forward, with descales per tensor
    or per (batch, head)), one head dim (Dqk == Dv), causal or no mask, TMA.
    Forward (kernels/fwd_gluon.py): 128-row tiles, 4 warps in the config (the producer warp
    and the second consumer warpgroup are added). dK/dV (kernels/bwd_gluon.py): 128 keys
    (D 64/128) or 64 keys (D=256) x 64 queries (128 at D=64, warp-specialized), 8 warps, dQ
    by TMA reduce-add or atomics (so not for deterministic problems)."""
    return KernelConfig(
        Signature(family, dtypes, ("sm90",), head_dim, head_dim, features,
                  head_dims=(head_dim,), sliding_window=False, left_window=left_window, needs_tma=True,
                  fp8_block_descale=False, max_unmasked_seqlen_k=max_unmasked_seqlen_k),
        Algorithm(block_m, block_n, warps, stages, pipeline=pipeline, persistent=persistent), notes=notes)


def _family_configs(family, rows):
    return [_config(family, *row) for row in rows]


def default_registry() -> Registry:
    """The stock configs: CUDA (tuned on an H200) first, then the interpreter's."""
    half = (DType.FP16, DType.BF16)
    fp32 = (DType.FP32,)
    every = half + fp32
    cuda, cpu = CUDA_ARCHS, (CPU,)
    with_fp64 = every + (DType.FP64,)  # fp64 runs in the interpreter only (gradcheck)
    fp8 = (DType.FP8_E4M3, DType.FP8_E5M2)
    fp8_archs = tuple(a for a in CUDA_ARCHS if a not in ("sm80", "sm86", "sm87"))
    # Rows: (dtypes, archs, head_dim_max, block_m, block_n, warps, stages[, head_dim_min]).
    # The interpreter's tiles are small so that small test problems cross tile borders.
    # Gluon (Hopper) first: 0.90-1.02x cuDNN where plain Triton reaches 0.48-0.80x (H200,
    # 2026-11-30, docs/performance.md). Ping-pong helped at D=128/256 and cost 2-3% at D=64.
    pp, ws = Pipeline.GLUON_WS_PINGPONG, "FA3-style warp-specialized forward"
    fwd_features = _GLUON_FEATURES | {Feature.DETERMINISTIC}  # the forward has no atomics
    # The 16-bit forward adds sink logits in its epilogue (fwd_gluon's HAS_SINKS); the dK/dV
    # kernels need nothing for them (P comes from the LSE, which holds the sink; dsinks and the
    # exact delta are stage 1's, a Triton kernel).
    fwd16_features = fwd_features | {Feature.SINKS}
    # Persistent (one program per SM walking the CTA tiles) first: it measured faster (H200,
    # 2026-11-30, attempts 27 and 32): D=64 +4-17%, D 128/256 without a mask +2-19%, causal
    # D 128/256 +1-16% with tiles in pairs of a head's longest and shortest row tile (the
    # earlier LPT order over all heads was 3-13% slower than one tile a program there).
    # Except at D 64/128 without a mask beyond 4096 keys: there the one-tile kernel with the
    # lazy rescale (which the persistent ones at D 64/128 lose from) ran 1-4% faster (H200,
    # 2026-11-30, two runs of tools/bench_gluon.py --variants , --tau 8; attempt 37).
    long_unmasked = 4096
    # The one-tile configs also take sliding windows (left, 0) (fwd_gluon's HAS_LEFT: the key tiles
    # left of a row tile's windows are not loaded); the persistent ones refuse windows (their causal
    # tile orders balance the causal triangle's row tiles, which a window makes equal).
    # The one-tile 16-bit configs also take varlen (fwd_gluon's VARLEN: packed sequences, rows
    # offset per sequence in the kernel, O by per-thread stores).
    one_tile = fwd16_features | {Feature.VARLEN}
    configs = [
        # (D=64 persistent at 2 stages: 1.004-1.013x of 3 over the persistent rows in two H200
        # runs, causal S 4096/8192 +1-2%, attempt 61; the one-tile kernel keeps 3: 2 lost 1-4%)
        _gluon_config(Family.FWD, 64, 128, 128, 4, 2, Pipeline.GLUON_WS, ws + ", persistent", fwd16_features,
                      persistent=True, max_unmasked_seqlen_k=long_unmasked),
        _gluon_config(Family.FWD, 64, 128, 128, 4, 3, Pipeline.GLUON_WS, ws, one_tile, left_window=True),
        _gluon_config(Family.FWD, 128, 128, 128, 4, 2, pp, ws + ", ping-pong, persistent", fwd16_features,
                      persistent=True, max_unmasked_seqlen_k=long_unmasked),
        _gluon_config(Family.FWD, 128, 128, 128, 4, 2, pp, ws + ", ping-pong", one_tile, left_window=True),
        _gluon_config(Family.FWD, 256, 128, 64, 4, 2, pp, ws + ", ping-pong, persistent", fwd16_features,
                      persistent=True),
        _gluon_config(Family.FWD, 256, 128, 64, 4, 2, pp, ws + ", ping-pong", one_tile, left_window=True),
    ]
    configs += _family_configs(Family.FWD, [
        (half, cuda, 64, 128, 64, 4, 3),
        # m128 n128 w8 s3 ran plain attention as fast (455/329 TFLOP/s, H200 2026-11-29) but
        # needs 288 KB of shared memory with bias or dropout: over the 227 KB limit.
        (half, cuda, 128, 128, 64, 8, 3, 65),
        (half, cuda, 256, 128, 32, 8, 2, 129),
        (fp32, cuda, 128, 64, 32, 4, 2),
        (fp32, cuda, 256, 32, 32, 4, 1, 129),
        (with_fp64, cpu, 256, 32, 16, 4, 1),
    ])
    # FP8 forward (fmha.fp8): tl.dot on float8 needs sm89+; tiles not tuned on a GPU yet
    # (tools/fp8_bench.py --sweep compares candidates).
    # FP8 forward in Gluon (Hopper): the same kernel with fp8 wgmma, P V reading P from shared
    # memory (fwd_gluon's P_SMEM), which leaves room for the longer key tiles: D=64 n256, D=128 n256
    # and D=256 n128 ran 1.13x / 1.29x / 1.41x our bf16 forward where the n128 / n128 / n64 tiles with
    # P in registers ran 0.93x / 1.10x / 1.17x (H200, 2026-12-01, attempt 83; ping-pong was 0-2%
    # slower, 2026-11-30); whole calls, those ratios include a slow torch copy of V^T that attempt 95
    # replaced: D=128 / D=256 now 1.43x / 1.57x.
    e4m3, ws8 = (DType.FP8_E4M3,), "FA3-style warp-specialized fp8 forward (V transposed first, P via shared memory)"
    configs += [_gluon_config(Family.FWD, d, 128, n, 4, st, Pipeline.GLUON_WS, ws8, fwd_features, e4m3)
                for d, n, st in ((64, 256, 2), (128, 256, 2), (256, 128, 2))]
    configs += _family_configs(Family.FWD, [
        (fp8, fp8_archs, 64, 128, 128, 8, 3),
        (fp8, fp8_archs, 128, 128, 128, 8, 3, 65),
        (fp8, fp8_archs, 256, 128, 64, 8, 2, 129),
        (fp8, cpu, 256, 32, 16, 4, 1),
    ])
    configs += _family_configs(Family.DROPOUT_MASK, [
        (fp8, fp8_archs, 256, 64, 64, 4, 1), (fp8, cpu, 256, 32, 32, 4, 1)])
    configs += _family_configs(Family.DROPOUT_MASK, [
        (every, cuda, 256, 64, 64, 4, 1), (with_fp64, cpu, 256, 32, 32, 4, 1)])
    configs += _family_configs(Family.BWD_DOT_DO_O, [
        (every, cuda, 256, 64, 16, 4, 1), (with_fp64, cpu, 256, 32, 16, 4, 1)])
    # dK/dV: block_n is the program's key tile, block_m the query tile it loops over.
    bwd_notes = "FA3-style backward: wgmma, TMA ring, dQ by TMA reduce-add (D=256: atomics)"
    ws_bwd = "FA3-style warp-specialized backward: loader warp, dQ by TMA reduce-add from a writer warp"
    # Both kernels at every head dim, the faster first (H200, 2026-11-30: warp specialization
    # +16-25% at D=64, attempt 22; with dQ by TMA reduce-add, 3 stages and one dQ buffer it
    # leads at D=128 too, attempt 25); `fmha tune` times both. D=64: 128-query stages in two
    # 64-query halves (bwd_gluon._ws_compute_m128), 1.00x cuDNN where m64 ran 0.885x (attempt 31).
    # D=64 persistent (one program per SM walking the key tiles, the next tile's K/V loaded
    # under the dK/dV stores): dK/dV kernel GPU time -5.4% full, -9.2% causal at B=16 S=1024
    # and -7.1% causal at B=4 S=4096 (H200, 2026-11-30, attempt 43); at D 128/256 it measured
    # 0.98-1.00x of the one-tile kernel, so they stay one-tile.
    m128_halves = ws_bwd + ", 128-query stages in two halves"
    # The one-tile dK/dV configs also take sliding windows (left, 0) (bwd_gluon's LEFT_WINDOW: a key
    # tile's loop ends at the last query tile whose windows reach it); the persistent one refuses them.
    # The one-tile warp-specialized ones also take varlen (VARLEN: packed sequences, rows offset per
    # sequence in the kernel, dK/dV by per-thread stores).
    bwd_features = _GLUON_FEATURES | {Feature.SINKS}
    lw = dict(left_window=True, features=bwd_features)
    ws_varlen = dict(lw, features=bwd_features | {Feature.VARLEN})
    configs += [_gluon_config(Family.BWD_DQ_DK_DV, 64, 128, 128, 8, 2, Pipeline.GLUON_WS,
                              m128_halves + ", persistent", bwd_features, persistent=True),
                _gluon_config(Family.BWD_DQ_DK_DV, 64, 128, 128, 8, 2, Pipeline.GLUON_WS, m128_halves, **ws_varlen),
                _gluon_config(Family.BWD_DQ_DK_DV, 64, 64, 128, 8, 3, Pipeline.GLUON, bwd_notes, **lw),
                _gluon_config(Family.BWD_DQ_DK_DV, 128, 64, 128, 8, 3, Pipeline.GLUON_WS, ws_bwd, **ws_varlen),
                _gluon_config(Family.BWD_DQ_DK_DV, 128, 64, 128, 8, 2, Pipeline.GLUON, bwd_notes, **lw),
                # D=256: 64 keys (dK and dV take 128 registers a thread), dQ in two halves;
                # warp-specialized with dQ staged in the consumed Q/dO stage, 1.06x cuDNN where
                # the other ran 0.945x (H200, 2026-11-30, attempt 36).
                _gluon_config(Family.BWD_DQ_DK_DV, 256, 64, 64, 8, 2, Pipeline.GLUON_WS,
                              ws_bwd + ", dQ halves staged in the consumed Q/dO stage", **ws_varlen),
                _gluon_config(Family.BWD_DQ_DK_DV, 256, 64, 64, 8, 2, Pipeline.GLUON, bwd_notes, **lw)]
    configs += _family_configs(Family.BWD_DQ_DK_DV, [
        # H200, 2026-11-29: m32 n64 w4 s3 runs 256/223 TFLOP/s (m64 n128 w8 s2: 152/116), but
        # with block_m=32 dK is not bitwise reproducible run to run even without atomics
        # (errors stay within the 2x bound): not for deterministic problems.
        (half, cuda, 128, 32, 64, 4, 3, 1, DENSE_FEATURES - {Feature.DETERMINISTIC}),
        (half, cuda, 128, 64, 128, 8, 2),
        (half, cuda, 256, 32, 64, 8, 1, 129),
        (fp32, cuda, 128, 32, 64, 4, 1),
        (fp32, cuda, 256, 16, 32, 4, 1, 129),
        (with_fp64, cpu, 256, 16, 32, 4, 1),
    ])
    configs += _family_configs(Family.BWD_DQ, [
        (half, cuda, 128, 64, 64, 4, 2),
        (half, cuda, 256, 64, 32, 8, 1, 129),
        (fp32, cuda, 128, 64, 32, 4, 1),
        (fp32, cuda, 256, 32, 16, 4, 1, 129),
        (with_fp64, cpu, 256, 32, 16, 4, 1),
    ])
    configs += _family_configs(Family.BWD_CONVERT_DQ, [
        (every, cuda, 256, 64, 16, 4, 1), (with_fp64, cpu, 256, 32, 16, 4, 1)])
    # KV cache: decode tiles are short in queries (block_m 16) and long in keys. Packed
    # varlen queries (batch prefill: prefill chunks with decode rows) take the configs that
    # list VARLEN, with longer query tiles (first fit: the decode configs refuse varlen).
    kv = KVCACHE_FEATURES
    kv_varlen = kv | {Feature.VARLEN}
    # A float8 cache takes 128-key tiles (the same bytes a tile as the 16-bit cache's 64): 1.39x
    # (8k keys) and 1.43x (32k) the bf16 cache's decode, where 64-key tiles ran 1.22x and 1.31x and
    # 128 keys with 4 stages or 256 keys 0.82-1.14x (H200, 2026-11-30, attempts 57-58,
    # docs/performance.md).
    # Hopper, a float8 cache, the queries of a (sequence, KV head) in one 16-row tile (a decode step,
    # or a few speculative tokens): the one-warp Gluon decode (kernels/kvcache_gluon.py), every mask
    # and score feature of the KV-cache path,
    # 1.79x the bf16 cache's decode where the Triton kernel ran 1.52x (H200, 2026-12-02, attempt 106),
    # as fast over pages of 64 keys (1 key: 5% slower; attempt 107); best at about four one-warp
    # programs an SM (512 programs at B=32 8k and B=8 32k keys).
    # D=64 takes 32-key tiles too (64 keys: 0.81-0.98x of them; 4 stages: 0.96-1.07x), D=256 16 keys (the
    # same 4 KB as D=128's); 1.29-1.32x (D=64) and 1.71-1.90x (D=256) the Triton kernel's speed over a
    # float8 cache, 2 or 8 programs an SM slower or no faster (attempt 111).
    configs += [KernelConfig(
        Signature(Family.FWD_SPLITKV, half, ("sm90",), d, d, kv, head_dims=(d,), needs_tma=True, fp8_decode=True),
        Algorithm(16, block_n, 1, 3, pipeline=Pipeline.GLUON, programs_per_sm=4),
        notes="one-warp decode over a float8 cache: K/V by cp.async, straight into mma operands")
        for d, block_n in ((128, 32), (64, 32), (256, 16))]
    # A 16-bit cache takes 64-key tiles at D 65-128 (0.99x cuDNN's decode at D=128) and 128-key tiles at
    # D <= 64, the same bytes a tile: at D=64 those ran 1.02-1.04x the 64-key tiles at 8k and 32k keys, 1.06-1.08x
    # over pages of 64, 0.98-0.99x at B=128 with 2k keys (4 stages of 64 keys: 1.02-1.04x overall; H200,
    # 2026-12-02, attempt 113). cuDNN stays 1.03-1.08x ahead at D=64.
    configs += [_config(Family.FWD_SPLITKV, half, cuda, 128, 16, 64, 4, 3, 65, kv, slower_for_fp8_cache=True),
                _config(Family.FWD_SPLITKV, half, cuda, 128, 16, 128, 4, 3, 1, kv)]
    configs += _family_configs(Family.FWD_SPLITKV, [
        (half, cuda, 256, 16, 32, 4, 2, 129, kv),
        (fp32, cuda, 256, 16, 32, 4, 2, 1, kv),
        (half, cuda, 128, 64, 64, 4, 2, 1, kv_varlen),
        (half, cuda, 256, 64, 32, 4, 2, 129, kv_varlen),
        (fp32, cuda, 256, 32, 32, 4, 1, 1, kv_varlen),
        (every, cpu, 256, 16, 16, 4, 1, 1, kv_varlen),
    ])
    configs += _family_configs(Family.SPLITKV_COMBINE, [
        (every, cuda, 256, 32, 16, 4, 1, 1, kv_varlen), (every, cpu, 256, 16, 16, 4, 1, 1, kv_varlen)])
    configs += _family_configs(Family.APPEND_KV, [
        (every, cuda, 256, 16, 16, 4, 1, 1, kv_varlen), (every, cpu, 256, 16, 16, 4, 1, 1, kv_varlen)])
    return Registry(configs, name="default")
