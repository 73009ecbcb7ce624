"""`fmha kernels build` (fmha.dispatch.precompile): real sm90 compiles on a machine without a GPU.

Triton ships ptxas, so these compile for GPUTarget("cuda", 90, 32) on the CPU. Each test
gets an empty Triton cache and its own build record, so the kernels really compile; the
tests keep to a few configs (fp16 fwd, convert_dq) to stay well under two minutes.
"""

import json
import time

import pytest
import torch
import triton

import fmha
from fmha import Algorithm, DType, Family, KernelConfig, Registry, Signature, cli, default_registry
from fmha.dispatch import precompile


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    """An empty Triton cache for this test (workers inherit it through the environment)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    return tmp_path / "triton-cache"


def test_every_family_maps_to_its_kernel_with_every_argument_typed():
    assert set(precompile.FAMILY_KERNELS) == set(Family)
    for config in default_registry().filter(arch="sm90"):
        if config.algorithm.pipeline.is_gluon:  # their own jobs: test_gluon_dispatch.py
            continue
        spec = precompile.FAMILY_KERNELS[config.family]
        for dtype in config.signature.dtypes:
            for variant in spec.variants:
                job = precompile.make_job(spec, config, dtype, variant)
                kernel = precompile._kernel(spec)
                assert [name for name, _ in job.signature] == list(kernel.arg_names)
                constexprs = dict(job.constexprs)
                assert {name for name, kind in job.signature if kind == "constexpr"} == set(constexprs)
                head = max(16, triton.next_power_of_2(config.signature.head_dim_max))
                for name in ("BLOCK_DQK", "BLOCK_DV", "BLOCK_D"):
                    if name in constexprs:
                        assert constexprs[name] == head
                if "BLOCK_N" in constexprs:
                    assert constexprs["BLOCK_N"] == config.algorithm.block_n
                assert constexprs.get("HAS_RIGHT", False) == (variant == "causal")
    assert precompile.FAMILY_KERNELS[Family.BWD_CONVERT_DQ].variants == ("plain",)


def test_build_fwd_and_convert_dq_for_sm90_then_cached(tmp_path, triton_cache):
    record = tmp_path / "record.json"
    registry = Registry([c for c in default_registry() if not c.algorithm.pipeline.is_gluon])
    start = time.perf_counter()
    results = precompile.build(registry, "sm90", families=["fwd", Family.BWD_CONVERT_DQ], dtypes=["fp16"],
                               jobs=2, progress=False, record_path=record)
    first = time.perf_counter() - start
    expected = [c.name for c in registry.filter(arch="sm90", dtype=DType.FP16)
                if c.family in (Family.FWD, Family.BWD_CONVERT_DQ)]
    assert [r.config for r in results] == expected and len(expected) == 4
    for r in results:
        assert r.status == "built", r.message
        assert r.dtype == "fp16" and r.target == "cuda:90:32" and r.shared_limit == 232448
        variants = ["plain", "causal"] if r.family == "fwd" else ["plain"]
        assert [k.variant for k in r.kernels] == variants
        assert all(k.error is None and k.shared is not None and k.shared <= 232448 for k in r.kernels)
    assert all(r.shared > 0 for r in results if r.family == "fwd")
    assert any(triton_cache.rglob("*.cubin"))
    entries = json.loads(record.read_text())["entries"]
    assert len(entries) == 4
    for key in entries:
        assert f"|fp16|triton-{triton.__version__}|cuda:90:32|" in key

    start = time.perf_counter()
    again = precompile.build(registry, "sm90", families=["fwd", "bwd_convert_dq"], dtypes=["fp16"],
                             jobs=2, progress=False, record_path=record)
    assert time.perf_counter() - start < first / 4
    assert [r.status for r in again] == ["cached"] * 4
    assert [r.shared for r in again] == [r.shared for r in results]


def test_config_over_the_shared_memory_limit_fails_naming_config_and_need(tmp_path, triton_cache):
    # fp16, head dim 256, 256 x 256 tiles: q and k tiles alone are 2 x 128 KiB.
    bad = KernelConfig(Signature(Family.FWD, (DType.FP16,), ("sm90",), 256), Algorithm(256, 256, 8, 1))
    ok = default_registry().filter(arch="sm90", family=Family.BWD_CONVERT_DQ)
    record = tmp_path / "record.json"
    results = precompile.build(Registry([bad, *ok]), "sm90", dtypes=["fp16"], jobs=2, progress=False,
                               record_path=record)
    assert [r.status for r in results] == ["failed", "built"]
    failed = results[0]
    assert not failed.ok and failed.config == bad.name
    assert failed.shared > 232448
    assert bad.name in failed.message and f"needs {failed.shared} bytes of shared memory" in failed.message
    assert "sm90 limit of 232448 bytes" in failed.message and "cannot launch" in failed.message
    assert all(k.error for k in failed.kernels)
    # failures are not recorded (the next build tries again); the good config is
    entries = json.loads(record.read_text())["entries"]
    assert len(entries) == 1 and next(iter(entries)).startswith(next(iter(ok)).name + "|fp16|")


def test_a_compile_over_the_timeout_is_killed_and_reported(tmp_path, triton_cache):
    # fp32 with 256 x 256 tiles at head dim 256 takes Triton many minutes
    slow = KernelConfig(Signature(Family.FWD, (DType.FP32,), ("sm90",), 256), Algorithm(256, 256, 4, 1))
    start = time.perf_counter()
    (result,) = precompile.build(Registry([slow]), "sm90", jobs=2, progress=False, timeout=3,
                                 record_path=tmp_path / "record.json")
    assert time.perf_counter() - start < 60
    assert result.status == "failed" and slow.name in result.message
    assert "timed out after 3 s" in result.message
    with pytest.raises(ValueError, match="timeout=0"):
        precompile.build(Registry([slow]), "sm90", timeout=0, record_path=tmp_path / "record.json")


def test_compiler_errors_name_the_config(tmp_path, triton_cache, monkeypatch):
    spec = precompile.FAMILY_KERNELS[Family.BWD_CONVERT_DQ]
    broken = precompile.KernelSpec(spec.module, spec.kernel, {"dQacc": "fp32", "dQ": "io"},
                                   floats=spec.floats, constants={"BLOCK_D": 3},  # not a power of two
                                   from_config={"BLOCK_R": "block_m"})
    monkeypatch.setitem(precompile.FAMILY_KERNELS, Family.BWD_CONVERT_DQ, broken)
    registry = default_registry().filter(arch="sm90", family=Family.BWD_CONVERT_DQ)
    (result,) = precompile.build(registry, "sm90", dtypes=["fp32"], jobs=1, progress=False,
                                 record_path=tmp_path / "record.json")
    assert result.status == "failed"
    name = next(iter(registry)).name
    assert result.message.startswith(f"{name} [fp32, plain] (convert_dq_kernel): compile error:")
    assert "power of 2" in result.message or "power of two" in result.message


def test_fp64_is_skipped_and_the_interpreter_arch_refused(tmp_path):
    fp64 = KernelConfig(Signature(Family.FWD, (DType.FP64,), ("sm90",), 64), Algorithm(64, 64, 4, 1))
    (result,) = precompile.build(Registry([fp64]), "sm90", progress=False, record_path=tmp_path / "r.json")
    assert result.status == "skipped" and result.ok and "interpreter only" in result.message
    with pytest.raises(ValueError, match="interpreter"):
        precompile.build(default_registry(), "cpu", progress=False, record_path=tmp_path / "r.json")
    with pytest.raises(ValueError, match="not a CUDA arch"):
        precompile.build(default_registry(), "gfx942", progress=False, record_path=tmp_path / "r.json")


def test_cli_kernels_build_also_after_the_interpreter_ran(capsys, tmp_path, triton_cache):
    # Triton 3.6's interpreter leaves triton.language patched after nested @jit calls, which
    # breaks compiling in the same process: builds run in fresh worker processes.
    q = torch.randn(1, 1, 16, 16)
    fmha.attention(q, q, q, causal=True)
    argv = ["kernels", "build", "--arch", "sm90", "--family", "bwd_convert_dq", "--dtype", "bf16",
            "--jobs", "1", "--record", str(tmp_path / "record.json")]
    code = cli.main([*argv, "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bwd_convert_dq_" in out and "built" in out and "232448" in out
    code = cli.main([*argv, "--json"])
    out, _ = capsys.readouterr()
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["counts"]["cached"] == 1 and data["counts"]["built"] == 0
    assert data["results"][0]["status"] == "cached" and data["results"][0]["dtype"] == "bf16"


def test_gluon_fp8_forward_tiles_build_for_sm90_and_seqlen_q_is_not_specialized(tmp_path, triton_cache):
    """The registry's Gluon fp8 forward tiles (P through shared memory, 256 keys at D 64/128, 128 at
    D=256) and the V^T scratch copy they read compile for sm90 within the shared-memory limit. The
    forward kernel does not specialize seqlen_q: with seqlen_q == 1 folded in, Triton 3.6's ptxas
    dies with SIGSEGV on these kernels (a decode row of test_gpu_fp8.py found it;
    docs/performance.md attempt 83)."""
    from fmha.kernels.gluon import fwd as fwd_gluon

    assert [p.name for p in fwd_gluon.fwd_ws_kernel.params if p.do_not_specialize] == ["seqlen_q"]
    registry = Registry([c for c in default_registry() if c.algorithm.pipeline.is_gluon and c.family == Family.FWD
                         and DType.FP8_E4M3 in c.signature.dtypes])
    assert sorted((c.signature.head_dim_max, c.algorithm.block_n) for c in registry) == [(64, 256), (128, 256),
                                                                                         (256, 128)]
    results = precompile.build(registry, "sm90", families=["fwd"], dtypes=["fp8_e4m3"], jobs=2, progress=False,
                               record_path=tmp_path / "record.json")
    assert len(results) == 3
    configs = {c.name: c for c in registry}
    for r in results:
        assert r.status == "built", r.message
        config = configs[r.config]
        a = config.algorithm
        tile = (config.signature.head_dim_max, a.block_m, a.block_n, a.num_stages, 1)
        with_p, without_p = fwd_gluon.shared_bytes(*tile, p_smem=True), fwd_gluon.shared_bytes(*tile)
        assert [k.variant for k in r.kernels].count("vt") == 1  # the V^T scratch copy each call runs first
        for k in r.kernels:  # fwd_gluon.shared_bytes counts P's buffers (the persistent kernels' budget)
            if k.variant == "vt":
                assert k.error is None and k.kernel == "vt_kernel" and k.shared <= 232448, (k.variant, k.shared)
            else:
                assert k.error is None and without_p < k.shared <= with_p <= 232448, (k.variant, k.shared, with_p)


def test_the_split_kv_combine_builds_every_tile_its_launcher_picks(tmp_path, triton_cache):
    """The combine's launcher picks its tile from the partial count (kvcache.combine_tile) and, on
    sm90, waits for the split kernel (programmatic dependent launch): the build compiles those
    kernels, one per partial count it rounds to, not the config's block_m alone."""
    from fmha.kernels.triton import kvcache

    config = next(c for c in default_registry().filter(arch="sm90", dtype=DType.BF16)
                  if c.family == Family.SPLITKV_COMBINE)
    [result] = precompile.build(Registry([config]), "sm90", dtypes=["bf16"], jobs=2, progress=False,
                                record_path=tmp_path / "record.json")
    assert result.status == "built", result.message
    assert [k.variant for k in result.kernels] == ["parts1", "parts2", "parts4", "parts8", "parts16"]
    assert all(k.error is None for k in result.kernels)
    jobs = [job for _, job in precompile.combine_jobs(precompile.FAMILY_KERNELS[Family.SPLITKV_COMBINE], config,
                                                      DType.BF16, precompile.target_of("sm90"))]
    for parts, job in zip((1, 2, 4, 8, 16), jobs, strict=True):
        constexprs = dict(job.constexprs)
        rows, block_s = kvcache.combine_tile(parts, config.algorithm.block_m)
        assert (constexprs["BLOCK_M"], constexprs["BLOCK_S"], constexprs["WAIT_PRIOR"]) == (rows, block_s, kvcache.PDL)
