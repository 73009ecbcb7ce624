"""Checks of Triton's on-disk kernel cache: corrupted entries are found, evicted, rebuilt.

Triton 3.6 trusts what it finds in its cache directory (TRITON_CACHE_DIR, default
~/.triton/cache; one directory per compiled kernel, named by a hash of the source and
options, holding `__grp__<name>.json`, `<name>.json` (metadata), `<name>.cubin` and the
IRs). Its own writes are atomic (temp file + rename), but an entry can still be damaged
from outside: a copy of the cache interrupted half-way, a full disk, a broken network
file system. What Triton does then (read in triton/compiler/compiler.py and
runtime/cache.py, and reproduced by tests/test_kernel_cache.py):

- a truncated or garbled `__grp__*.json` or `<name>.json`: `json.JSONDecodeError` out of
  `triton.compile` (the kernel's first launch in a process), every time, until the entry
  is removed by hand;
- a truncated `.cubin`: `triton.compile` returns it as a cache hit without looking; the
  first launch fails in `cuModuleLoadData` ("device kernel image is invalid"), or on some
  drivers crashes the process (a segmentation fault, seen on an H200 host on 2026-11-30),
  and the broken kernel stays in the process' in-memory cache. `fmha kernels build`
  reported such a kernel "built" or "cached".

fmha therefore checks entries itself (`entry_problems`: JSON parses, the group's files
exist, the binary is a complete ELF file): at run time before Triton loads one
(`checked_cache_manager()`, installed as Triton's cache manager when fmha wraps its
launchers, unless another manager is configured), and where a kernel is compiled or
launched (`precompile` and `guard_launch`, for the rest); a damaged entry is evicted with a
warning and its kernel compiled again, once. A binary damaged without changing its length
(a flipped bit) passes these checks; Triton keeps no checksum to catch that.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class CorruptCacheWarning(UserWarning):
    """A damaged Triton cache entry was removed and its kernel compiled again."""


def cache_dir() -> Path:
    """Triton's cache directory (TRITON_CACHE_DIR or ~/.triton/cache)."""
    try:
        import triton

        directory = triton.knobs.cache.dir
        if directory:
            return Path(directory)
    except Exception:  # a Triton without knobs.cache.dir
        pass
    return Path(os.path.expanduser("~")) / ".triton" / "cache"


def elf_problems(data: bytes) -> list[str]:
    """Why `data` is not a complete ELF file (cubin/hsaco); empty if it looks whole.

    Checks the magic, the header, that the section header table and every section with
    file contents lie inside the file (a truncated file fails this).
    """
    if len(data) < 64:
        return [f"{len(data)} bytes: shorter than an ELF header"]
    if data[:4] != b"\x7fELF":
        return ["no ELF magic number"]
    if data[4] != 2 or data[5] not in (1, 2):
        return [f"unexpected ELF class/byte order ({data[4]}, {data[5]}); expected a 64-bit ELF"]
    endian = "<" if data[5] == 1 else ">"
    e_phoff, e_shoff = struct.unpack_from(endian + "QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from(endian + "HHHH", data, 0x36)
    end = e_shoff + e_shentsize * e_shnum
    if e_shnum == 0 or e_shentsize < 64 or end > len(data):
        return [f"section header table ends at byte {end} (file has {len(data)} bytes): truncated"]
    if e_phoff + e_phentsize * e_phnum > len(data):
        return [f"program header table ends at byte {e_phoff + e_phentsize * e_phnum} "
                f"(file has {len(data)} bytes): truncated"]
    problems = []
    for i in range(e_shnum):
        base = e_shoff + i * e_shentsize
        sh_type, = struct.unpack_from(endian + "I", data, base + 4)
        sh_offset, sh_size = struct.unpack_from(endian + "QQ", data, base + 0x18)
        if sh_type != 8 and sh_offset + sh_size > len(data):  # 8: SHT_NOBITS (no file contents)
            problems.append(f"section {i} ends at byte {sh_offset + sh_size} (file has {len(data)} bytes): "
                            f"truncated")
            break
    return problems


def entry_problems(entry: Path) -> list[str]:
    """Why a Triton cache entry (one hash directory) cannot be trusted; empty if it can.

    Only complete entries are judged: a directory without a `__grp__*.json` is one Triton
    has not finished writing (or a foreign one) and is left alone.
    """
    problems: list[str] = []
    for group in sorted(entry.glob("__grp__*.json")):
        try:
            children = json.loads(group.read_text())["child_paths"]
            if not isinstance(children, dict):
                raise TypeError("child_paths is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{group.name}: unreadable group file ({type(e).__name__}: {e})")
            continue
        for name, path in children.items():
            file = Path(path)  # absolute: Triton reads what the group names, even in another directory
            if not file.exists():
                problems.append(f"{name}: listed in {group.name} but missing")
                continue
            problems += [f"{name}: {p}" for p in file_problems(file)]
    return problems


def file_problems(file: Path) -> list[str]:
    """Problems of one file of an entry, by its kind (metadata JSON, binary, IR text)."""
    try:
        data = file.read_bytes()
    except OSError as e:
        return [f"unreadable ({e})"]
    suffix = file.suffix
    if suffix == ".json":
        try:
            metadata = json.loads(data)
        except ValueError as e:
            return [f"not valid JSON ({e})"]
        if not isinstance(metadata, dict) or "name" not in metadata or "target" not in metadata:
            return ["metadata without 'name' or 'target'"]
        return []
    if suffix in (".cubin", ".hsaco"):
        return elf_problems(data)
    if not data:
        return ["empty"]
    return []


def scan(directory: Path | str | None = None) -> dict[Path, list[str]]:
    """Every damaged entry under `directory` (default: Triton's cache), with its problems."""
    root = Path(directory) if directory is not None else cache_dir()
    if not root.is_dir():
        return {}
    bad = {}
    for entry in sorted(p for p in root.iterdir() if p.is_dir()):
        problems = entry_problems(entry)
        if problems:
            bad[entry] = problems
    return bad


def evict(entries: Iterable[Path], why: str) -> list[Path]:
    """Remove damaged entries, with one CorruptCacheWarning each; returns those removed."""
    removed = []
    for entry in entries:
        problems = entry_problems(entry)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        warnings.warn(f"Triton cache entry {entry} is damaged ({'; '.join(problems) or 'unreadable'}): "
                      f"removed; {why}", CorruptCacheWarning, stacklevel=3)
    return removed


def evict_damaged(directory: Path | str | None = None, why: str = "its kernel compiles again") -> list[Path]:
    """Scan the cache and evict every damaged entry; returns the entries removed."""
    return evict(scan(directory), why)


def clear_jit_caches(functions: Iterable[Any]) -> None:
    """Forget the kernels Triton keeps in memory for these JITFunctions (so that a kernel
    loaded from a damaged entry is looked up, and compiled, again)."""
    for fn in functions:
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            caches.clear()


def jit_functions(module: Any) -> list[Any]:
    """The `@triton.jit` kernels defined in a module."""
    from triton.runtime.jit import JITFunction

    return [v for v in vars(module).values() if isinstance(v, JITFunction)]


@functools.cache
def checked_cache_manager() -> type:
    """`CheckedFileCacheManager`, defined on first use (fmha imports Triton lazily)."""
    from triton.runtime.cache import FileCacheManager

    class CheckedFileCacheManager(FileCacheManager):
        """Triton's file cache, checking a kernel's entry before handing it out: a damaged one
        is evicted (with a CorruptCacheWarning) and reported missing, so Triton compiles the
        kernel again instead of loading a binary that may fail or crash the driver."""

        def get_group(self, filename: str):
            entry = Path(self.cache_dir)
            if (entry / f"__grp__{filename}").exists() and entry_problems(entry):
                evict([entry], why="Triton compiles its kernel again")
                os.makedirs(entry, exist_ok=True)  # where Triton writes the new entry
                return None
            return super().get_group(filename)

    return CheckedFileCacheManager


def install_checked_cache() -> bool:
    """Make `checked_cache_manager()` Triton's cache manager (in this process only), unless
    another manager is configured (TRITON_CACHE_MANAGER or `triton.knobs.cache`); True if
    it is the one in use."""
    import triton

    current = triton.knobs.cache.manager_class
    if current is None:
        triton.knobs.cache.manager_class = checked_cache_manager()  # a class sets no env variable
        return True
    return current is checked_cache_manager()


def guard_launch(launch: F, module: Any) -> F:
    """`launch` (a kernel launcher of `module`), retried once after evicting damaged cache
    entries if it fails while any exist. Errors with an intact cache pass through. Also
    installs the checked cache manager (`install_checked_cache`), which catches damaged
    entries before Triton loads them."""
    install_checked_cache()

    @functools.wraps(launch)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return launch(*args, **kwargs)
        except Exception:
            if not evict_damaged(why=f"{launch.__name__} compiles its kernel again"):
                raise
        clear_jit_caches(jit_functions(module))
        return launch(*args, **kwargs)

    return guarded  # type: ignore[return-value]
