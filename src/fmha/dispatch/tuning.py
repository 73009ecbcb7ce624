"""Tuning database: measured best kernel configs per (GPU, problem bucket), persisted as JSON.

    key   = (gpu, family, dtype, padded head dims, feature set, sequence-length bucket)
    value = chosen config name + the timing of every candidate, fmha and Triton versions

`fmha tune` benchmarks the candidate configs of a family on this GPU and records the
fastest; `Dispatcher.select` then takes the recorded choice for a problem with that key
(when the config is still in its registry and serves the problem), and `explain()` says
"tuned: ...". Everything else falls back to the heuristic (first fit).

The file is `tuning.json` in the cache directory (env `FMHA_CACHE_DIR`, default
`~/.cache/fmha`). Several threads and processes may share it: writers hold an exclusive
`fcntl.flock` on `tuning.json.lock` (plus a process-local lock) while they read, merge and
write, and a write goes to a temporary file that `os.replace` moves over the old one, so a
reader sees the old or the new file, never half of one. A file that is not valid JSON, has
another schema version, or whose checksum does not match its entries is not trusted: it is
ignored with a warning, and the next write moves it aside (`tuning.json.corrupt-<time>`) and
starts afresh. An entry is stale, and ignored, when its config is not in the dispatcher's
registry or it was measured with another fmha or Triton version.

Buckets: head dims are padded as the kernels pad them (next power of two, at least 16);
sequence lengths go to the next power of two (at least 16) of Sq and of Sk separately, so a
decode problem (Sq=1) never shares an entry with a prefill problem.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..problem import Problem
from .configs import CPU, Family, KernelConfig

SCHEMA_VERSION = 1
DB_NAME = "tuning.json"
ENV_CACHE_DIR = "FMHA_CACHE_DIR"
# Families `fmha tune` can time (through fmha.attention forward or backward).

# A timer: milliseconds of one call of `problem` run with `config` (for its family).


class TuningDBWarning(UserWarning):
    """The tuning database file is corrupt or of another schema; it is ignored."""


def cache_dir() -> Path:
    """`$FMHA_CACHE_DIR`, or `~/.cache/fmha`."""
    env = os.environ.get(ENV_CACHE_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fmha"


def default_path() -> Path:
    return cache_dir() / DB_NAME


def _pow2_at_least(x: int, lo: int = 16) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


@lru_cache(maxsize=16)
def device_name(arch: str) -> str:
    """The GPU name a problem on `arch` runs on: the current CUDA device's name when its arch
    is `arch`, "cpu" for the interpreter, else the arch itself."""
    if arch == CPU:
        return "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if f"sm{major}{minor}" == arch:
                return torch.cuda.get_device_name()
    except Exception:  # no usable CUDA: the arch is the best name there is
        pass
    return arch


@dataclass(frozen=True)
class TuningKey:
    gpu: str
    family: str
    dtype: str
    head_dims: tuple[int, int]  # padded (qk, v)
    features: tuple[str, ...]  # sorted Feature values
    seqlen_bucket: tuple[int, int]  # (next pow2 of Sq, of Sk), at least 16

    @classmethod
    def of(cls, problem: Problem, family: Family, gpu: str | None = None) -> TuningKey:
        return cls(
            gpu=gpu if gpu is not None else device_name(problem.arch),
            family=family.value, dtype=problem.dtype.value,
            head_dims=(_pow2_at_least(problem.head_dim_qk), _pow2_at_least(problem.head_dim_v)),
            features=tuple(sorted(f.value for f in problem.features)),
            seqlen_bucket=(_pow2_at_least(problem.seqlen_q), _pow2_at_least(problem.seqlen_k)),
        )

    def text(self) -> str:
        """The key as one string (the JSON object key)."""
        return (f"{self.gpu}|{self.family}|{self.dtype}|d{self.head_dims[0]}x{self.head_dims[1]}|"
                f"{'+'.join(self.features) or 'plain'}|sq{self.seqlen_bucket[0]}-sk{self.seqlen_bucket[1]}")


def versions() -> dict[str, str]:
    """The versions an entry is valid for: fmha and Triton."""
    import triton

    from .. import __version__

    return {"fmha": __version__, "triton": triton.__version__}


def _checksum(entries: dict) -> str:
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class TunedChoice:
    """A usable DB entry for a problem: the config and the measurement behind it."""

    config: KernelConfig
    key: str
    time_ms: float | None
    candidates: int

    def describe(self) -> str:
        t = "" if self.time_ms is None else f", {self.time_ms:.4g} ms"
        return f"fastest of {self.candidates} measured{t} (tuning DB key {self.key})"


class TuningDB:
    """A tuning database file. Reads are cached and refreshed when the file changes."""

    _locks: dict[str, threading.Lock] = {}
    _locks_guard = threading.Lock()

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self._cache: tuple[Any, dict] | None = None  # (file stamp, entries)
        self._warned: set[Any] = set()
        self.problem: str | None = None  # why the file was not trusted, if it was not

    # -- reading -------------------------------------------------------------------------

    def _stamp(self) -> Any:
        try:
            st = self.path.stat()
        except OSError:  # missing, or a directory that cannot be searched: no DB
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _parse(self, text: bytes) -> tuple[dict, str | None]:
        """(entries, None) for a good file; ({}, reason) for one that is not trusted."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
            return {}, f"not valid JSON ({type(e).__name__}: {e})"
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            return {}, "not an object with an 'entries' object"
        if data.get("schema_version") != SCHEMA_VERSION:
            return {}, (f"schema_version {data.get('schema_version')!r}, this fmha reads "
                        f"{SCHEMA_VERSION}")
        if data.get("checksum") != _checksum(data["entries"]):
            return {}, "checksum does not match its entries (edited or partly written)"
        if not all(isinstance(v, dict) and isinstance(v.get("config"), str) for v in data["entries"].values()):
            return {}, "an entry lacks a 'config' name"
        return data["entries"], None

    def entries(self) -> dict[str, dict]:
        """Every entry, by key text ({} when the file is missing or not trusted)."""
        stamp = self._stamp()
        if stamp is None:
            self._cache, self.problem = (None, {}), None
            return {}
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        try:
            text = self.path.read_bytes()
        except OSError as e:
            entries, reason = {}, f"cannot be read ({e.strerror or e})"
        else:
            entries, reason = self._parse(text)
        self.problem = reason
        if reason is not None and stamp not in self._warned:
            self._warned.add(stamp)
            warnings.warn(f"tuning DB {self.path} is ignored: {reason}; it will be rebuilt by the next "
                          f"`fmha tune`", TuningDBWarning, stacklevel=3)
        self._cache = (stamp, entries)
        return entries

    def get(self, key: TuningKey) -> dict | None:
        return self.entries().get(key.text())

    def lookup(self, problem: Problem, family: Family, registry: Any) -> tuple[TunedChoice | None, str]:
        """The tuned config for `problem` if the DB has a usable one, and a note on why not.

        `registry` is the dispatcher's (configs are looked up by name). Returns (None, note)
        when there is no entry or it is stale; note is "" when there is simply no entry.
        """
        key = TuningKey.of(problem, family)
        entry = self.get(key)
        if entry is None:
            return None, ""
        name = entry["config"]
        current = versions()
        for what in ("fmha", "triton"):
            if entry.get(what) != current[what]:
                return None, (f"tuned entry for {name} ignored: measured with {what} {entry.get(what)}, "
                              f"this is {current[what]}")
        try:
            config = registry[name]
        except KeyError:
            return None, f"tuned entry ignored: config {name} is not in registry {registry.name!r}"
        refusals = config.signature.refusals(problem)
        if config.family != family or refusals:
            return None, f"tuned entry {name} ignored: it does not serve this problem ({'; '.join(refusals)})"
        timings = entry.get("timings_ms") if isinstance(entry.get("timings_ms"), dict) else {}
        return TunedChoice(config, key.text(), timings.get(name), len(timings)), ""

    # -- writing -------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive access across threads (a lock per path) and processes (flock)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with TuningDB._locks_guard:
            lock = TuningDB._locks.setdefault(str(self.path.resolve()), threading.Lock())
        with lock:
            fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    import fcntl
                except ImportError:  # not POSIX: the process-local lock is all there is
                    fcntl = None
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing releases the flock

    def update(self, new_entries: dict[str, dict]) -> None:
        """Merge entries (by key text) into the file, atomically, under the lock."""
        with self.locked():
            entries: dict[str, dict] = {}
            if self.path.exists():
                try:
                    text = self.path.read_bytes()
                except OSError:
                    text = b""
                entries, reason = self._parse(text)
                if reason is not None:
                    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S%f")
                    aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
                    os.replace(self.path, aside)
                    warnings.warn(f"tuning DB {self.path} was not trusted ({reason}); moved it to {aside} "
                                  f"and started a new one", TuningDBWarning, stacklevel=2)
            entries = {**entries, **new_entries}
            data = {"schema_version": SCHEMA_VERSION, "checksum": _checksum(entries), "entries": entries}
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self._cache = None

    def record(self, problem: Problem, family: Family, timings_ms: dict[str, float | None],
               gpu: str | None = None) -> dict:
        """Record the fastest of `timings_ms` (config name -> ms; None: it failed) for the
        key of `problem`; returns the entry. ValueError if no candidate has a time."""
        ok = {name: t for name, t in timings_ms.items() if t is not None and t == t and t > 0}
        if not ok:
            raise ValueError(f"no candidate ran for {problem.describe()} ({family.value}): {timings_ms}")
        key = TuningKey.of(problem, family, gpu)
        entry = {
            "config": min(ok, key=ok.__getitem__), "timings_ms": timings_ms, "gpu": key.gpu,
            "family": key.family, "dtype": key.dtype, "head_dims": list(key.head_dims),
            "features": list(key.features), "seqlen_bucket": list(key.seqlen_bucket),
            "problem": problem.describe(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **versions(),
        }
        self.update({key.text(): entry})
        return entry


__all__ = ["SCHEMA_VERSION", "TunedChoice", "TuningDB", "TuningDBWarning", "TuningKey", "cache_dir", "default_path",
           "device_name", "versions"]
