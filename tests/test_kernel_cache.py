"""Damaged Triton cache entries (fmha.kernels.launch.jit_cache): found, evicted, rebuilt, never trusted.

The entries are real: `fmha kernels build` compiles convert_dq for sm90 into an empty
cache (Triton ships ptxas; no GPU needed), then the tests damage one file the way an
interrupted copy would (truncate it) and check what Triton alone does and what fmha does.
Triton alone: its own FileCacheManager (the fixture sets it: importing fmha's launchers
installs fmha's checked manager in the process).
"""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import FileCacheManager

from fmha import Family, default_registry
from fmha.dispatch import precompile
from fmha.kernels.launch import jit_cache as kernel_cache

TARGET = GPUTarget("cuda", 90, 32)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One real sm90 build of convert_dq (fp32) into its own cache, built once per module."""
    root = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root / "triton-cache"))
        result = _build(root / "record.json")
    assert result.status == "built", result.message
    return root


@pytest.fixture
def triton_cache(tmp_path, monkeypatch, pristine):
    """A copy of the pristine cache and record for this test (workers inherit the cache
    through the environment); returns the cache directory, the record is beside it."""
    cache = tmp_path / "triton-cache"
    shutil.copytree(pristine / "triton-cache", cache)
    for group in cache.rglob("__grp__*.json"):  # groups name their files by absolute path
        group.write_text(group.read_text().replace(str(pristine / "triton-cache"), str(cache)))
    text = (pristine / "record.json").read_text().replace(str(pristine / "triton-cache"), str(cache))
    (tmp_path / "record.json").write_text(text)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setattr(triton.knobs.cache, "manager_class", FileCacheManager)  # Triton alone
    return cache


def _registry():
    return default_registry().filter(arch="sm90", family=Family.BWD_CONVERT_DQ)


def _build(record):
    (result,) = precompile.build(_registry(), "sm90", dtypes=["fp32"], jobs=1, progress=False,
                                 record_path=record)
    return result


def _entry(result) -> Path:
    (kernel,) = result.kernels
    assert kernel.entry is not None
    return Path(kernel.entry)


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _job():
    config = next(iter(_registry()))
    spec = precompile.FAMILY_KERNELS[Family.BWD_CONVERT_DQ]
    return precompile.make_job(spec, config, precompile.DType.FP32, "plain")


def _triton_compile(job):
    """What Triton alone does with the cache (no fmha checks)."""
    fn = precompile._kernel(precompile.FAMILY_KERNELS[Family.BWD_CONVERT_DQ])
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, kind) in enumerate(job.signature) if kind.startswith("*")}
    return triton.compile(ASTSource(fn, dict(job.signature), dict(job.constexprs), attrs), target=TARGET,
                          options={"num_warps": job.num_warps, "num_stages": job.num_stages})


def test_a_truncated_cubin_is_rebuilt_not_trusted(tmp_path, triton_cache):
    record = tmp_path / "record.json"
    cached = _build(record)
    assert cached.status == "cached", cached.message
    entry = _entry(cached)
    assert entry.parent == triton_cache and kernel_cache.entry_problems(entry) == []
    (cubin,) = entry.glob("*.cubin")
    whole = cubin.read_bytes()
    assert kernel_cache.elf_problems(whole) == []
    _truncate(cubin)

    # Triton alone hands the damaged binary back as a cache hit (it would fail at load time)
    hit = _triton_compile(_job())
    assert len(hit.asm["cubin"]) < len(whole)
    assert any("truncated" in p for p in kernel_cache.entry_problems(entry))

    # fmha's build does not trust its record: the damaged entry is evicted and rebuilt
    again = _build(record)
    assert again.status == "built", again.message
    assert "damaged Triton cache entry" in again.message and "truncated" in again.message
    assert kernel_cache.entry_problems(_entry(again)) == []
    assert next(_entry(again).glob("*.cubin")).read_bytes() == whole
    assert _build(record).status == "cached"


def test_a_truncated_metadata_json_crashes_triton_but_fmha_rebuilds(tmp_path, triton_cache):
    entry = _entry(_build(tmp_path / "record.json"))
    (meta,) = entry.glob("[!_]*.json")
    _truncate(meta)
    assert kernel_cache.entry_problems(entry)
    with pytest.raises(json.JSONDecodeError):  # Triton alone, every time
        _triton_compile(_job())
    # a build with another record: no record to distrust, the failure inside triton.compile is
    # what leads to the damaged entry
    result = _build(tmp_path / "other-record.json")
    assert result.status == "built", result.message
    assert "damaged Triton cache entry" in result.message and "not valid JSON" in result.message
    assert kernel_cache.entry_problems(_entry(result)) == []
    _triton_compile(_job())  # Triton is happy again


def test_a_recorded_build_whose_cache_entry_is_gone_is_rebuilt(tmp_path, triton_cache):
    record = tmp_path / "record.json"
    shutil.rmtree(_entry(_build(record)))
    result = _build(record)
    assert result.status == "built" and "is gone" in result.message
    assert kernel_cache.entry_problems(_entry(result)) == []


@pytest.mark.parametrize("damaged", ["metadata", "group"])
def test_guarded_launch_evicts_and_retries_once(tmp_path, triton_cache, damaged):
    """The runtime guard (what fmha's compiled launchers are wrapped in): a launch that
    fails on a damaged entry is retried after eviction; other failures pass through."""
    entry = _entry(_build(tmp_path / "record.json"))
    (file,) = entry.glob("__grp__*.json" if damaged == "group" else "[!_]*.json")
    _truncate(file)
    calls = []

    def launch_convert():
        calls.append(1)
        return _triton_compile(_job())  # as a first launch in a process would

    guarded = kernel_cache.guard_launch(launch_convert, precompile)
    with pytest.warns(kernel_cache.CorruptCacheWarning, match="unreadable group file|not valid JSON"):
        compiled = guarded()
    assert len(calls) == 2 and compiled.metadata.name == "convert_dq_kernel"
    assert kernel_cache.scan(triton_cache) == {}

    def broken():
        raise RuntimeError("not a cache problem")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="not a cache problem"):
            kernel_cache.guard_launch(broken, precompile)()


def test_elf_check_finds_truncation_anywhere(triton_cache):
    (cubin,) = triton_cache.rglob("*.cubin")
    data = cubin.read_bytes()
    assert kernel_cache.elf_problems(data) == []
    for keep in (10, 63, 64, len(data) // 3, len(data) - 1):
        assert kernel_cache.elf_problems(data[:keep]), keep
    assert kernel_cache.elf_problems(b"garbage" * 20)


@pytest.mark.parametrize("damaged", ["cubin", "metadata", "group"])
def test_the_checked_cache_manager_evicts_before_triton_loads(tmp_path, triton_cache, monkeypatch, damaged):
    """What fmha installs as Triton's cache manager: a damaged entry is never handed to the
    loader (a truncated cubin crashed the CUDA driver of an H200 host instead of failing)
    but evicted, with a warning, and the kernel compiled again."""
    entry = _entry(_build(tmp_path / "record.json"))
    whole = next(entry.glob("*.cubin")).read_bytes()
    (file,) = entry.glob({"cubin": "*.cubin", "metadata": "[!_]*.json", "group": "__grp__*.json"}[damaged])
    _truncate(file)
    monkeypatch.setattr(triton.knobs.cache, "manager_class", None)
    assert kernel_cache.install_checked_cache()
    assert triton.knobs.cache.manager_class is kernel_cache.checked_cache_manager()
    with pytest.warns(kernel_cache.CorruptCacheWarning, match="truncated|not valid JSON|unreadable group file"):
        compiled = _triton_compile(_job())
    assert compiled.asm["cubin"] == whole
    assert kernel_cache.scan(triton_cache) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _triton_compile(_job()).asm["cubin"] == whole  # a clean cache hit now


def test_a_configured_cache_manager_is_left_alone(monkeypatch):
    class Mine(FileCacheManager):
        pass

    monkeypatch.setattr(triton.knobs.cache, "manager_class", Mine)
    assert not kernel_cache.install_checked_cache()
    assert triton.knobs.cache.manager_class is Mine
