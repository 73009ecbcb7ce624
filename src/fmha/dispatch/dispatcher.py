"""`Dispatcher`: from a `Problem` to a plan of kernel launches.

`supports(config, problem)` gives the reasons a config is refused (empty: it fits);
`select(problem, family)` picks one config (the tuning database's choice when it has one
for the problem, else first fit in registry order, as CK does, or a pluggable heuristic);
`plan_*` lists the launches of a call; `explain` prints the decision with every
candidate and its reasons.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..problem import Problem
from .configs import Family, KernelConfig
from .registry import Registry, default_registry
from .tuning import TuningDB

Heuristic = Callable[[Problem, Sequence[KernelConfig]], KernelConfig]


class NoKernelError(ValueError):
    """No config in the registry serves the problem; the message lists every refusal."""


@dataclass(frozen=True)
class Launch:
    family: Family
    config: KernelConfig
    why: str  # why this config was chosen, for explain()


@dataclass(frozen=True)
class Plan:
    problem: Problem
    launches: tuple[Launch, ...]

    def config(self, family: Family) -> KernelConfig:
        return next(launch.config for launch in self.launches if launch.family == family)

    def describe(self) -> str:
        lines = [f"problem: {self.problem.describe()}"]
        lines += [f"  {i + 1}. {launch.family.value:<15} {launch.config.name}  ({launch.why})"
                  for i, launch in enumerate(self.launches)]
        return "\n".join(lines)


@dataclass(frozen=True)
class SplitPolicy:
    """How many key splits a KV-cache call gets when it asks for num_splits=0
    (flash-decoding; FlashAttention's wave-efficiency rule). JSON: to_dict / from_dict.

    programs_per_sm: programs of the split-KV kernel one SM runs at once (decode tiles
        fit two on an H100/H200); a GPU has sm_count * programs_per_sm slots.
    fill: with at least fill * slots programs without splitting, do not split.
    min_tiles_per_split: every split reads at least this many key tiles.
    max_splits: at most this many splits (the kernel accepts up to 128).
    efficiency: take the fewest splits whose wave efficiency (programs / slots, over the
        waves rounded up) is within this fraction of the best.
    """

    programs_per_sm: int = 2
    fill: float = 0.8
    min_tiles_per_split: int = 4
    max_splits: int = 128
    efficiency: float = 0.85

    def __post_init__(self) -> None:
        if not (isinstance(self.programs_per_sm, int) and self.programs_per_sm >= 1):
            raise ValueError(f"SplitPolicy.programs_per_sm={self.programs_per_sm!r} must be an int >= 1")
        if not (isinstance(self.min_tiles_per_split, int) and self.min_tiles_per_split >= 1):
            raise ValueError(f"SplitPolicy.min_tiles_per_split={self.min_tiles_per_split!r} must be an int >= 1")
        if not (isinstance(self.max_splits, int) and 1 <= self.max_splits <= 128):
            raise ValueError(f"SplitPolicy.max_splits={self.max_splits!r} must be an int in [1, 128]")
        for name in ("fill", "efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"SplitPolicy.{name}={value!r} must be a number in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SplitPolicy:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"SplitPolicy has no field(s) {sorted(unknown)}; accepted: {sorted(known)}")
        return cls(**data)

    def splits(self, programs: int, key_tiles: int, sm_count: int) -> int:
        """Splits for `programs` programs (batch x KV heads x query tiles), each over
        `key_tiles` key tiles, on `sm_count` multiprocessors."""
        slots = sm_count * self.programs_per_sm
        if programs <= 0 or programs >= self.fill * slots:
            return 1
        limit = max(1, min(self.max_splits, key_tiles // self.min_tiles_per_split))

        def efficiency(s: int) -> float:
            waves = programs * s / slots
            return waves / math.ceil(waves)

        best = max(efficiency(s) for s in range(1, limit + 1))
        return next(s for s in range(1, limit + 1) if efficiency(s) >= self.efficiency * best)


@functools.lru_cache(maxsize=4096)
def _cached_splits(policy: SplitPolicy, programs: int, key_tiles: int, sm_count: int) -> int:
    # The policy's search costs ~50 us of Python; decode calls repeat a few shapes.
    return policy.splits(programs, key_tiles, sm_count)


def split_keys(problem: Problem) -> int:
    """The keys a row block of a KV-cache problem reads, as the split policy counts them:
    seqlen_k, or with a window's left edge at most left + seqlen_q + right + sink_size."""
    left, right = problem.window
    if left < 0:
        return problem.seqlen_k
    return min(problem.seqlen_k, left + problem.seqlen_q + max(right, 0) + problem.sink_size)


class Dispatcher:
    def __init__(self, registry: Registry | None = None, heuristic: Heuristic | None = None,
                 tuning: TuningDB | None = None, split_policy: SplitPolicy | None = None):
        """`tuning`: a tuning database whose choices win over the heuristic (None: not used).
        `split_policy`: the split-KV heuristic for num_splits=0 (default SplitPolicy())."""
        self.registry = registry if registry is not None else default_registry()
        self.heuristic = heuristic
        self.tuning = tuning
        self.split_policy = split_policy if split_policy is not None else SplitPolicy()

    @staticmethod
    def supports(config: KernelConfig, problem: Problem) -> list[str]:
        """Reasons `config` cannot serve `problem`; an empty list means it can."""
        return config.signature.refusals(problem)

    def candidates(self, problem: Problem, family: Family) -> list[KernelConfig]:
        return [c for c in self.registry if c.family == family and not self.supports(c, problem)]

    def select(self, problem: Problem, family: Family = Family.FWD) -> tuple[KernelConfig, str]:
        """The config for `family`, and a sentence saying why it was chosen ("tuned: ..."
        for a tuning-database choice, "heuristic: ..." otherwise)."""
        fits = self.candidates(problem, family)
        if not fits:
            raise NoKernelError(self._refusal_report(problem, family))
        tuned, note = (None, "") if self.tuning is None else self.tuning.lookup(problem, family, self.registry)
        if tuned is not None:
            return tuned.config, f"tuned: {tuned.describe()}"
        note = f"; {note}" if note else ""
        if self.heuristic is not None:
            chosen = self.heuristic(problem, fits)
            if chosen not in fits:
                raise NoKernelError(f"heuristic chose {getattr(chosen, 'name', chosen)!r}, which "
                                    f"is not among the fitting configs {[c.name for c in fits]}")
            return chosen, f"heuristic: {getattr(self.heuristic, '__name__', 'custom')}{note}"
        # The first fit that no measured preference passes over (else simply the first fit).
        chosen = next((c for c in fits if not c.signature.passed_over(problem)), fits[0])
        skipped = fits.index(chosen)
        note = f"; {skipped} passed over before it{note}" if skipped else note
        return chosen, f"heuristic: first fit of {len(fits)} in registry {self.registry.name!r}{note}"

    def plan_forward(self, problem: Problem, *, return_dropout_mask: bool = False) -> Plan:
        families = [Family.FWD] + ([Family.DROPOUT_MASK] if return_dropout_mask else [])
        return self._plan(problem, families)

    def plan_backward(self, problem: Problem, *, exact_delta: bool = False) -> Plan:
        """Three stages; dQ by atomics + convert, or by its own pass when deterministic.

        exact_delta (dbias or dsinks wanted): stage 1 is the dQ kernel in its delta mode
        (rowsum(P * dP) from recomputed tiles) instead of bwd_dot_do_o (rowsum(dO * O))."""
        first = Family.BWD_DQ if exact_delta else Family.BWD_DOT_DO_O
        last = Family.BWD_DQ if problem.deterministic else Family.BWD_CONVERT_DQ
        plan = self._plan(problem, [first, Family.BWD_DQ_DK_DV, last])
        if exact_delta:
            delta = plan.launches[0]
            why = f"delta = rowsum(P * dP) for dbias/dsinks; {delta.why}"
            plan = Plan(problem, (Launch(delta.family, delta.config, why),) + plan.launches[1:])
        return plan

    def plan_kvcache(self, problem: Problem, *, append: bool, num_splits: int) -> Plan:
        """Append new keys/values (and RoPE) if asked, attention over the cache, merge splits."""
        families = ([Family.APPEND_KV] if append else []) + [Family.FWD_SPLITKV]
        if num_splits > 1:
            families.append(Family.SPLITKV_COMBINE)
        return self._plan(problem, families)

    def num_splits(self, problem: Problem, sm_count: int, block_m: int, block_n: int, programs_per_sm: int = 0) -> int:
        """Split-KV count for a KV-cache problem by `self.split_policy`. Programs are
        batch x KV heads x packed query tiles (the query heads of one KV head share a tile);
        the keys are seqlen_k (a capacity or an estimate: lengths stay on the device), or with a
        window's left edge at most left + seqlen_q + right + sink_size (the kernels split the
        keys a window shows, not the whole cache).
        programs_per_sm: the kernel's (its config's `Algorithm.programs_per_sm`) instead of the
        policy's, when > 0."""
        group = problem.nhead_q // problem.nhead_k
        programs = problem.batch * problem.nhead_k * -(-(problem.seqlen_q * group) // block_m)
        policy = self.split_policy
        if programs_per_sm and programs_per_sm != policy.programs_per_sm:
            policy = replace(policy, programs_per_sm=programs_per_sm)
        return _cached_splits(policy, programs, -(-split_keys(problem) // block_n), sm_count)

    def _plan(self, problem: Problem, families: Sequence[Family]) -> Plan:
        launches = []
        for family in families:
            config, why = self.select(problem, family)
            launches.append(Launch(family, config, why))
        return Plan(problem, tuple(launches))

    def explain(self, problem: Problem, family: Family = Family.FWD) -> str:
        """Every config of `family` with its verdict, and the choice."""
        lines = [f"problem: {problem.describe()}", f"family: {family.value}"]
        for config in self.registry:
            if config.family != family:
                continue
            reasons = self.supports(config, problem)
            verdict = "fits" if not reasons else "refused: " + "; ".join(reasons)
            passed_over = "" if reasons else config.signature.passed_over(problem)
            if passed_over:
                verdict += f", passed over by the default selection: {passed_over}"
            lines.append(f"  {config.name}: {verdict}")
        try:
            config, why = self.select(problem, family)
            lines.append(f"selected: {config.name} ({why})")
        except NoKernelError:
            lines.append("selected: none (no config fits)")
        return "\n".join(lines)

    def _refusal_report(self, problem: Problem, family: Family) -> str:
        lines = [f"no {family.value} kernel in registry {self.registry.name!r} serves "
                 f"{problem.describe()}"]
        configs = [c for c in self.registry if c.family == family]
        if not configs:
            lines.append(f"  (the registry has no {family.value} configs)")
        lines += [f"  {c.name}: " + "; ".join(self.supports(c, problem)) for c in configs]
        return "\n".join(lines)


_default: Dispatcher | None = None


def default_dispatcher() -> Dispatcher:
    global _default
    if _default is None:
        _default = Dispatcher(tuning=TuningDB())  # tuning.json in $FMHA_CACHE_DIR or ~/.cache/fmha
    return _default
