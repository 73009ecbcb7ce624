"""The Hopper Gluon forward on the CPU side: registry entries, dispatch rules and their
reasons, TMA alignment detection, and a real sm90 compile of the kernel (Triton ships
ptxas). Its numerics run on the GPU: tests/test_gpu_gluon.py."""

import functools
import re
from pathlib import Path

import pytest
import torch

from fmha import DType, Family, Registry, api, default_registry
from fmha.dispatch import precompile
from fmha.dispatch.configs import Pipeline
from fmha.dispatch.dispatcher import Dispatcher
from fmha.ops import prepare
from fmha.problem import MaskAlign, Problem


def _problem(**kw):
    base = dict(batch=2, nhead_q=8, nhead_k=2, seqlen_q=1000, seqlen_k=1533, head_dim_qk=128,
                head_dim_v=128, dtype=DType.BF16, arch="sm90")
    return Problem(**{**base, **kw})


def _fwd_config(problem):
    return Dispatcher(default_registry()).plan_forward(problem).config(Family.FWD)


def _explain_line(problem, family, config_name_part):
    """The line of `explain` that judges the config whose name contains `config_name_part`."""
    text = Dispatcher(default_registry()).explain(problem, family)
    return next(line for line in text.splitlines() if config_name_part in line)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", list(MaskAlign))
def test_sm90_half_precision_problems_get_the_gluon_kernel(head_dim, causal, align):
    config = _fwd_config(_problem(head_dim_qk=head_dim, head_dim_v=head_dim, causal=causal, mask_align=align))
    assert config.algorithm.pipeline.is_gluon
    assert config.signature.head_dims == (head_dim,)


@pytest.mark.parametrize("change,reason", [
    (dict(window=(128, 64)), "only causal masks"),
    (dict(window=(-1, 64)), "only causal masks"),
    (dict(tma_aligned=False), "16-byte aligned"),
    (dict(head_dim_qk=96, head_dim_v=96), "one of [128]"),
    (dict(head_dim_v=64), "are not equal"),
    (dict(seqlen_k=0), "seqlen_k is 0"),
    (dict(bias=True), "features not supported: ['bias']"),
    (dict(softcap=30.0), "features not supported: ['softcap']"),
    (dict(arch="sm80"), "arch sm80 not in ['sm90']"),
    (dict(dtype=DType.FP32), "dtype fp32 not in"),
])
def test_other_problems_fall_back_to_triton_and_explain_says_why(change, reason):
    problem = _problem(**change)
    config = _fwd_config(problem)
    assert config.algorithm.pipeline == Pipeline.TRITON
    gluon_line = _explain_line(problem, Family.FWD, "d128-128_sm90_gluon")
    assert "refused" in gluon_line and reason in gluon_line, gluon_line


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (127, 0)])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_sink_logits_get_the_gluon_forward_and_backward(head_dim, window, dtype):
    """Sink logits (gpt-oss) stay on the Hopper kernels: the forward adds them in its epilogue
    (HAS_SINKS) and the dK/dV kernel reads them through the LSE; float8 inputs with sinks take
    the Triton forward, and explain says why."""
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, window=window, sinks=True, dtype=dtype)
    dispatcher = Dispatcher(default_registry())
    assert dispatcher.plan_forward(problem).config(Family.FWD).algorithm.pipeline.is_gluon
    assert dispatcher.plan_backward(problem).config(Family.BWD_DQ_DK_DV).algorithm.pipeline.is_gluon
    fp8 = problem.with_(dtype=DType.FP8_E4M3)
    assert dispatcher.plan_forward(fp8).config(Family.FWD).algorithm.pipeline == Pipeline.TRITON
    fp8_gluon = next(c for c in default_registry() if c.family == Family.FWD and c.algorithm.pipeline.is_gluon
                     and DType.FP8_E4M3 in c.signature.dtypes and c.signature.head_dims == (head_dim,))
    assert "features not supported: ['sinks']" in " ".join(fp8_gluon.signature.refusals(fp8))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(0, 0), (127, 0), (1000, 0)])
@pytest.mark.parametrize("family", [Family.FWD, Family.BWD_DQ_DK_DV])
def test_sliding_windows_left_of_the_diagonal_get_the_one_tile_gluon_kernels(head_dim, window, family):
    """A window (left, 0) runs on the one-tile Gluon forward (HAS_LEFT) and dK/dV (LEFT_WINDOW);
    the persistent configs (the forward's at every head dim, the dK/dV's at D=64) refuse it and
    explain says so."""
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, window=window)
    dispatcher = Dispatcher(default_registry())
    plan = dispatcher.plan_forward(problem) if family == Family.FWD else dispatcher.plan_backward(problem)
    config = plan.config(family)
    assert config.algorithm.pipeline.is_gluon and not config.algorithm.persistent
    assert config.signature.left_window and not config.signature.refusals(problem)
    persistent = [line for line in dispatcher.explain(problem, family).splitlines()
                  if f"d{head_dim}-{head_dim}_sm90_gluon" in line and "persistent" in line]
    assert bool(persistent) == (family == Family.FWD or head_dim == 64), persistent
    for line in persistent:
        assert "refused" in line and "no sliding window" in line, line


@pytest.mark.parametrize("window", [(100, 50), (-1, 3), (0, 1)])
def test_windows_with_a_right_edge_keep_the_triton_backward(window):
    problem = _problem(window=window)
    config = Dispatcher(default_registry()).plan_backward(problem).config(Family.BWD_DQ_DK_DV)
    assert config.algorithm.pipeline == Pipeline.TRITON
    line = _explain_line(problem, Family.BWD_DQ_DK_DV, "d128-128_sm90_gluon_ws")
    assert "refused" in line and "windows (left, 0)" in line, line


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(100, 0))])
def test_varlen_gets_the_one_tile_gluon_kernels(head_dim, mask):
    """Packed sequences run on the one-tile Gluon forward and warp-specialized dK/dV (VARLEN); the
    persistent configs refuse them and explain says why; with seqused_k, or in fp8, the Triton
    forward; deterministic, the Triton backward."""
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, varlen=True, **mask)
    config = _fwd_config(problem)
    assert config.algorithm.pipeline.is_gluon and not config.algorithm.persistent
    persistent = next(line for line in Dispatcher(default_registry()).explain(problem, Family.FWD).splitlines()
                      if f"d{head_dim}-{head_dim}_sm90_gluon" in line and "persistent" in line)
    assert "refused" in persistent and "varlen" in persistent, persistent
    for other in (problem.with_(seqused_k=True), problem.with_(dtype=DType.FP8_E4M3)):
        assert _fwd_config(other).algorithm.pipeline == Pipeline.TRITON
    dispatcher = Dispatcher(default_registry())
    dkdv = dispatcher.plan_backward(problem).config(Family.BWD_DQ_DK_DV)
    assert dkdv.algorithm.pipeline == Pipeline.GLUON_WS and not dkdv.algorithm.persistent
    for other in (problem.with_(seqused_k=True), problem.with_(deterministic=True)):
        assert dispatcher.plan_backward(other).config(Family.BWD_DQ_DK_DV).algorithm.pipeline == Pipeline.TRITON


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_e4m3_with_tensor_or_head_descales_gets_the_gluon_kernel(head_dim):
    config = _fwd_config(_problem(dtype=DType.FP8_E4M3, head_dim_qk=head_dim, head_dim_v=head_dim, causal=True))
    assert config.algorithm.pipeline.is_gluon and config.signature.dtypes == (DType.FP8_E4M3,)


@pytest.mark.parametrize("change,reason", [
    (dict(fp8_block_descale=True), "fp8 descales per block"),
    (dict(dtype=DType.FP8_E5M2), "dtype fp8_e5m2 not in ['fp8_e4m3']"),
])
def test_fp8_problems_the_gluon_kernel_does_not_take_run_on_triton(change, reason):
    problem = _problem(**{"dtype": DType.FP8_E4M3, **change})
    assert _fwd_config(problem).algorithm.pipeline == Pipeline.TRITON
    line = _explain_line(problem, Family.FWD, "fp8_e4m3_d128-128_sm90_gluon")
    assert "refused" in line and reason in line, line


def test_explain_sees_per_block_fp8_descales():
    q = torch.randn(1, 2, 256, 128).to(torch.float8_e4m3fn)
    per_head, per_block = torch.ones(1, 2), torch.ones(1, 2, 2)
    assert not api.problem_of(q, q, q, k_descale=per_head).fp8_block_descale
    assert api.problem_of(q, q, q, k_descale=per_block, descale_block_size=128).fp8_block_descale


def test_explain_takes_attention_varlen_arguments():
    """explain/problem_of with cu_seqlens_q/k and max_seqlen_q/k describe the attention_varlen call
    (packed (total, H, D) tensors), refuse what attention_varlen refuses, and name the backward
    when q requires grad."""
    q = torch.randn(300, 4, 64, requires_grad=True)
    k = v = torch.randn(500, 2, 64)
    cu_q, cu_k = torch.tensor([0, 100, 300], dtype=torch.int32), torch.tensor([0, 200, 500], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=300, causal=True)
    problem = api.problem_of(q, k, v, **kw)
    assert problem.varlen and (problem.batch, problem.seqlen_q, problem.seqlen_k) == (2, 200, 300)
    text = api.explain(q, k, v, **kw)
    assert "B=2 Hq=4 Hk=2 Sq=200 Sk=300" in text and "varlen" in text and "bwd_dq_dk_dv" in text, text
    assert api.problem_of(q, k, v, **kw, seqused_k=torch.tensor([150, 300], dtype=torch.int32)).seqused_k
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        api.explain(q, k, v, **{**kw, "cu_seqlens_k": torch.tensor([0, 200], dtype=torch.int32)})


def test_deterministic_problems_keep_the_gluon_forward():
    assert _fwd_config(_problem(deterministic=True, causal=True)).algorithm.pipeline.is_gluon


def test_registry_json_round_trip_keeps_gluon_fields():
    registry = default_registry()
    again = Registry.from_json(registry.to_json())
    assert [c.to_dict() for c in again] == [c.to_dict() for c in registry]
    gluon = [c for c in again if c.algorithm.pipeline.is_gluon]
    assert {c.signature.head_dims for c in gluon} == {(64,), (128,), (256,)}
    assert all(c.signature.needs_tma for c in gluon)
    # the dense Gluon kernels mask causally (or windows (left, 0)); the fp8 decode takes any window
    decode = [c for c in gluon if c.family == Family.FWD_SPLITKV]
    assert decode and all(c.signature.fp8_decode and c.signature.sliding_window for c in decode)
    assert not any(c.signature.sliding_window for c in gluon if c.family != Family.FWD_SPLITKV)
    # half precision D=128, 256: persistent and one program per tile
    assert registry.statistics()["by_pipeline"]["gluon_ws_pingpong"] == 4
    assert any(c.algorithm.persistent for c in again)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_forward_where_it_measured_faster(head_dim, causal):
    """The persistent Gluon forward at every head dim, with and without a mask; explain names it."""
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, causal=causal)
    config = _fwd_config(problem)
    assert config.algorithm.pipeline.is_gluon and config.algorithm.persistent, config.name
    assert config.name.endswith("_persistent")
    assert "_persistent" in _explain_line(problem, Family.FWD, f"d{head_dim}-{head_dim}_sm90_gluon_ws")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_k,window", [(4096, (-1, -1)), (4097, (-1, -1)), (16384, (-1, -1)),
                                             (16384, (-1, 0))])
def test_long_unmasked_forward_takes_one_tile_at_d64_d128(head_dim, seqlen_k, window):
    """Without a mask and beyond 4096 keys the one-tile kernel (lazy rescale) measured 1-4% faster
    than the persistent one at D 64/128 (attempt 37): the default selection passes over the
    persistent config there, and explain and the plan's reason say so.
    Causal problems and D=256 keep the persistent kernel at every length."""
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, seqlen_q=seqlen_k, seqlen_k=seqlen_k,
                       causal=window == (-1, 0))
    config = _fwd_config(problem)
    one_tile = head_dim in (64, 128) and window == (-1, -1) and seqlen_k > 4096
    assert config.algorithm.pipeline.is_gluon and config.algorithm.persistent != one_tile, config.name
    line = _explain_line(problem, Family.FWD, f"d{head_dim}-{head_dim}_sm90_gluon_ws")
    assert line.endswith(": fits" if not one_tile else "passed over by the default selection: no mask and "
                         f"seqlen_k {seqlen_k} > 4096: measured slower there than the next config"), line
    why = Dispatcher(default_registry()).select(problem, Family.FWD)[1]
    assert ("; 1 passed over before it" in why) == one_tile, why


def test_passed_over_config_still_fits_and_serves_alone():
    """The long-unmasked preference is not a refusal: the persistent config still fits (so a
    tuning database can time and choose it) and serves when it is the only one."""
    problem = _problem(head_dim_qk=128, head_dim_v=128, seqlen_q=8192, seqlen_k=8192)
    persistent = next(c for c in default_registry() if c.family == Family.FWD and c.algorithm.persistent
                      and c.signature.head_dims == (128,))
    assert not Dispatcher.supports(persistent, problem) and persistent.signature.passed_over(problem)
    assert persistent in Dispatcher(default_registry()).candidates(problem, Family.FWD)
    config, why = Dispatcher(Registry([persistent])).select(problem, Family.FWD)
    assert config == persistent and "passed over" not in why, why


def _bwd_gluon_config(head_dim, pipeline=Pipeline.GLUON_WS):
    return next(c for c in default_registry() if c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline == pipeline
                and c.signature.head_dims == (head_dim,))


def test_persistent_is_refused_outside_the_gluon_forward_and_ws_backward():
    """persistent: the Gluon forward, and the warp-specialized Gluon dK/dV kernel (bwd_gluon's
    PERSISTENT, every head dim); not the Triton kernels or the plain Gluon dK/dV kernel."""
    import dataclasses

    from fmha.dispatch.configs import Algorithm, ConfigError, KernelConfig

    for head_dim in (64, 128, 256):
        config = _bwd_gluon_config(head_dim)
        made = KernelConfig(config.signature, dataclasses.replace(config.algorithm, persistent=True))
        assert "_gluon_ws_" in made.name and made.name.endswith("_persistent"), made.name
        plain = _bwd_gluon_config(head_dim, Pipeline.GLUON)
        with pytest.raises(ConfigError, match="persistent"):
            KernelConfig(plain.signature, dataclasses.replace(plain.algorithm, persistent=True))
    triton_bwd = next(c for c in default_registry() if c.family == Family.BWD_DQ_DK_DV
                      and not c.algorithm.pipeline.is_gluon)
    with pytest.raises(ConfigError, match="persistent"):
        KernelConfig(triton_bwd.signature, dataclasses.replace(triton_bwd.algorithm, persistent=True))
    triton = next(c for c in default_registry() if c.family == Family.FWD and not c.algorithm.pipeline.is_gluon)
    with pytest.raises(ConfigError, match="persistent"):
        KernelConfig(triton.signature, Algorithm(128, 64, 4, 3, persistent=True))
    # The registry: persistent first at D=64 only, where it measured faster (attempt 43), with
    # its one-tile twin second; one program per key tile at D 128/256.
    gluon_bwd = [c for c in default_registry() if c.family == Family.BWD_DQ_DK_DV and c.algorithm.pipeline.is_gluon]
    assert [c.algorithm.persistent for c in gluon_bwd if c.signature.head_dims == (64,)] == [True, False, False]
    assert not any(c.algorithm.persistent for c in gluon_bwd if c.signature.head_dims != (64,))


def test_persistent_backward_compile_spec():
    """bwd_gluon.compile_spec(persistent=True) gives the kernel launch_dkdv(persistent=True)
    runs: PERSISTENT, the causal tile order from SHAPES (D=64 heads, 1; else the default, pairs),
    0 without a mask;
    one kv_empty mbarrier more shared memory, still within 227 KB for the registry's tiles."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    for head_dim, block_m, block_n, stages in ((64, 128, 128, 2), (128, 64, 128, 3), (256, 64, 64, 2)):
        spec = functools.partial(bwd_gluon.compile_spec, "bf16", head_dim, block_m, block_n, stages,
                                 warp_specialized=True)
        for causal in (False, True):
            assert spec(causal=causal)[1]["PERSISTENT"] is False and spec(causal=causal)[1]["TILE_ORDER"] == 0
            signature, constexprs, options = spec(causal=causal, persistent=True)
            assert constexprs["PERSISTENT"] is True
            # dK/dV by TMA stores: staging buffers of its own fit next to D=64's tile only
            assert constexprs["DKDV_TMA"] is (head_dim == 64) and spec(causal=causal)[1]["DKDV_TMA"] is True
            pairs = spec(causal=causal, persistent=True, tile_order=2)[1]
            assert pairs["DKDV_TMA"] is (head_dim == 64 and not causal)  # (TILE_ORDER 2 only under causal)
            assert (bwd_gluon.ws_shared_bytes(head_dim, block_m, block_n, stages, bwd_gluon.SHAPES["gluon_ws"][
                head_dim]["dq_bufs"], True, True) <= bwd_gluon.SMEM_PER_BLOCK) is (head_dim == 64)
            order = bwd_gluon.SHAPES["gluon_ws"][head_dim].get("tile_order", bwd_gluon.DEFAULT_TILE_ORDER)
            assert constexprs["TILE_ORDER"] == (order if causal else 0)
            assert signature["PERSISTENT"] == "constexpr" and options == {"num_warps": 8, "maxnreg": 168}
        dq_bufs = bwd_gluon.SHAPES["gluon_ws"][head_dim]["dq_bufs"]
        assert bwd_gluon.ws_shared_bytes(head_dim, block_m, block_n, stages, dq_bufs, True) <= 232448
    with pytest.raises(ValueError, match="persistent"):
        bwd_gluon.compile_spec("bf16", 128, 64, 128, 2, causal=False, persistent=True)  # not warp-specialized


def _key_tile_of(order, t, num_bh, num_n, sim):
    """(bh, key tile index) of position t: bwd_gluon._my_key_tile transcribed (order 1: also no mask)."""
    if order == 0:
        return t % num_bh, t // num_bh
    if order == 1:
        return t // num_n, t % num_n
    bh, longest_last = sim.pair_tile(t, num_bh, num_n)
    return bh, num_n - 1 - longest_last


def test_persistent_backward_key_tile_schedule():
    """The persistent dK/dV kernel's programs (fwd_gluon's snake count/positions, transcribed in
    tests/tools/persistent_schedule_sim.py and checked there) together run every key tile exactly once
    in each order; the pairs order puts a head's key tiles i and n-1-i (causal work ~ n-i and
    i+1) in one unit, the longer first."""
    import importlib.util

    path = Path(__file__).parent / "tools" / "persistent_schedule_sim.py"
    spec = importlib.util.spec_from_file_location("_schedule_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    for num_bh in range(1, 8):
        for num_n in range(1, 9):
            tiles = num_bh * num_n
            for order in (0, 1, 2):
                for nprog in (1, 2, 5, 7, 132):
                    seen = []
                    for pid in range(nprog):
                        for k in range(sim.kernel_count(tiles, nprog, pid, order == 2)):
                            t = sim.kernel_position(k, nprog, pid, order == 2)
                            seen.append(_key_tile_of(order, t, num_bh, num_n, sim))
                    assert sorted(seen) == [(b, n) for b in range(num_bh) for n in range(num_n)], (
                        num_bh, num_n, order, nprog)
            for u in range(tiles // 2):
                (b0, n0), (b1, n1) = (_key_tile_of(2, 2 * u + i, num_bh, num_n, sim) for i in (0, 1))
                if b0 == b1 and n0 != n1:
                    assert n0 < n1 and n0 + n1 == num_n - 1, (num_bh, num_n, u)


def test_persistent_backward_barrier_protocol():
    """tests/tools/bwd_persistent_protocol_sim.py: the persistent dK/dV kernel's waits and arrives
    (transcribed) under random interleavings: no deadlock, no buffer overwritten while read; and
    without the compute warps' barrier before kv_empty, key tiles without queries do hang."""
    import subprocess
    import sys

    sim = Path(__file__).parent / "tools" / "bwd_persistent_protocol_sim.py"
    out = subprocess.run([sys.executable, sim], capture_output=True, text=True).stdout
    assert "failures 0" in out, out
    out = subprocess.run([sys.executable, sim, "--no-kv-barrier"], capture_output=True, text=True).stdout
    assert "DEADLOCK" in out and "failures 0" not in out, out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gluon_ws_persistent_backward_compiles_for_sm90(tmp_path, monkeypatch, head_dim, dtype):
    """The persistent warp-specialized dK/dV kernel (registry tile made persistent: D=64 m128 s2,
    D=128 m64 s3, D=256 m64n64 s2), plain and causal: fits the shared memory (one mbarrier more
    than the one-tile kernel), compute warpgroups at 240 registers, dQ by TMA reduce-add, no
    atomics; it reads the grid size (the tile loop's stride), which the one-tile kernel never does.
    D=64's causal_pairs variant is TILE_ORDER 2, its causal one 1."""
    import dataclasses

    from fmha.dispatch.configs import KernelConfig
    from fmha.kernels.gluon import bwd as bwd_gluon

    config = _bwd_gluon_config(head_dim)
    config = KernelConfig(config.signature, dataclasses.replace(config.algorithm, persistent=True))
    kernels = _built_for_sm90(config, tmp_path, monkeypatch, dtype=dtype)
    # (D=64 prefers heads outermost: its pairs order, for shapes where heads would not balance, too)
    assert [k.variant for k in kernels] == ["plain", "causal"] + (["causal_pairs"] if head_dim == 64 else [])
    a = config.algorithm
    # (D=64: dK/dV by TMA stores through staging buffers of its own, attempt 55)
    smem = bwd_gluon.ws_shared_bytes(head_dim, a.block_m, a.block_n, a.num_stages,
                                     bwd_gluon.SHAPES["gluon_ws"][head_dim]["dq_bufs"], True, head_dim == 64)
    for kernel in kernels:
        ptx = _ptx(kernel)
        assert kernel.shared <= smem, (kernel.shared, smem)  # (the estimate is exact at m64, 48 bytes over at m128)
        # the dK/dV stores (not in pairs order: attempt 55 measured it slower)
        assert ("cp.async.bulk.tensor.4d.global.shared::cta" in ptx) is (head_dim == 64
                                                                        and kernel.variant != "causal_pairs")
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240\b", ptx)
        assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
        assert "red.global" not in ptx and "atom.global" not in ptx
        assert "%nctaid.x" in ptx
    from fmha.dispatch import precompile

    orders = {v: dict(job.constexprs)["TILE_ORDER"] for v, job in precompile.gluon_jobs(config, dtype)}
    assert orders == {"plain": 0, "causal": bwd_gluon.preferred_tile_order(head_dim), "causal_pairs": 2} \
        if head_dim == 64 else {"plain": 0, "causal": 2}


def test_tma_alignment_detection():
    x = torch.randn(2, 4, 64, 128, dtype=torch.bfloat16)
    assert prepare.tma_aligned(x, x.transpose(1, 2))
    assert not prepare.tma_aligned(torch.randn(2, 4, 64, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte rows
    shifted = torch.randn(x.numel() + 1, dtype=torch.bfloat16)[1:].view(x.shape)  # base 2 bytes off
    assert not prepare.tma_aligned(shifted)
    assert not prepare.tma_aligned(torch.ones(1, 1, 1, 64, dtype=torch.bfloat16).expand(2, 4, 64, 64))
    q = torch.randn(2, 4, 64, 64, dtype=torch.bfloat16)
    assert api.problem_of(q, q, q).tma_aligned


def _tma_aligned_by_definition(t) -> bool:
    """tma_aligned's rule, written plainly (its implementation is tuned for the launch path)."""
    size = t.element_size()
    if t.stride(-1) != 1 or (t.device.type != "meta" and t.data_ptr() % 16):
        return False
    return all((stride * size) % 16 == 0 and not (extent > 1 and stride <= 0)
               for extent, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_tma_alignment_rule_on_views(dtype):
    from fmha.kernels.gluon.common import tma_aligned

    base = torch.randn(8192).to(dtype)
    for offset in (0, 1, 2, 4, 8, 16):
        for shape in [(2, 3, 5, 8), (1, 4, 16, 64), (2, 2, 4, 3), (3, 1, 7, 16), (1, 1, 1, 1), (5,), (2, 8), (1, 16)]:
            t = base[offset:offset + torch.Size(shape).numel()].view(shape)
            views = [t, t[..., :1], torch.empty(shape, dtype=dtype, device="meta"), t.unsqueeze(0).expand(3, *shape)]
            if len(shape) >= 2:
                views += [t.transpose(0, 1), t.transpose(-1, -2)]
            if shape[0] == 1:
                views.append(t.expand(2, *shape[1:]))
            for view in views:
                assert tma_aligned(view) == _tma_aligned_by_definition(view), (offset, shape, view.stride())
            assert tma_aligned(t, views[1]) == (_tma_aligned_by_definition(t) and _tma_aligned_by_definition(views[1]))


def _built_for_sm90(config, tmp_path, monkeypatch, dtype="bf16"):
    """The kernels of `config` compiled ahead of time for sm90 (Triton's ptxas, no GPU),
    each within the shared-memory limit."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    results = precompile.build(Registry([config]), "sm90", dtypes=[dtype], jobs=2, progress=False,
                               record_path=tmp_path / "record.json")
    assert [r.status for r in results] == ["built"], results[0].message
    # (fp8: the V^T copy, "vt", built without the runtime's stride specialization needs none)
    assert all(0 < k.shared <= 232448 or (k.variant == "vt" and k.shared == 0) for k in results[0].kernels)
    return results[0].kernels


def test_gluon_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    config = next(c for c in default_registry() if c.algorithm.pipeline.is_gluon
                  and c.signature.head_dims == (64,))
    kernels = _built_for_sm90(config, tmp_path, monkeypatch)
    assert [k.variant for k in kernels] == ["plain", "causal"]


@pytest.mark.parametrize("change,reason", [
    (dict(seqlen_q=0), "seqlen_q is 0"), (dict(batch=0), "batch is 0"),
    (dict(seqlen_q=0, seqlen_k=0), "seqlen_q and seqlen_k are 0"),
])
def test_empty_problems_take_the_triton_backward(change, reason):
    """A backward with no queries still zeroes dK/dV, but TMA cannot describe an empty q."""
    problem = _problem(**change)
    config = Dispatcher(default_registry()).plan_backward(problem).config(Family.BWD_DQ_DK_DV)
    assert config.algorithm.pipeline == Pipeline.TRITON
    line = _explain_line(problem, Family.BWD_DQ_DK_DV, "d128-128_sm90_gluon")
    assert "refused" in line and reason in line, line


@pytest.mark.parametrize("head_dim,pipeline", [(64, Pipeline.GLUON_WS), (128, Pipeline.GLUON_WS),
                                               (256, Pipeline.GLUON_WS)])
def test_sm90_half_precision_backward_gets_the_gluon_dkdv_kernel(head_dim, pipeline):
    problem = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, causal=True)
    config = Dispatcher(default_registry()).plan_backward(problem).config(Family.BWD_DQ_DK_DV)
    assert config.algorithm.pipeline == pipeline and config.signature.head_dims == (head_dim,)


def _ptx(kernel) -> str:
    return next(Path(kernel.entry).glob("*.ptx")).read_text()


@pytest.mark.parametrize("head_dim,pipeline", [(64, Pipeline.GLUON_WS), (128, Pipeline.GLUON_WS),
                                               (128, Pipeline.GLUON)])
def test_gluon_backward_compiles_for_sm90_with_dq_by_tma_reduce(tmp_path, monkeypatch, head_dim, pipeline):
    """Warp-specialized: loader warp, two writer warps and 8 compute warps, 12 warps at 168
    registers, the workers at 24 (the whole register file when the compute warpgroups take
    240). Both kernels add dQ by TMA reduce-add, no atomics."""
    config = next(c for c in default_registry() if c.algorithm.pipeline == pipeline
                  and c.family == Family.BWD_DQ_DK_DV and c.signature.head_dims == (head_dim,))
    for kernel in _built_for_sm90(config, tmp_path, monkeypatch):
        ptx = _ptx(kernel)
        assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
        assert "red.global" not in ptx and "atom.global" not in ptx


def _ws_d64_config(**change):
    import dataclasses

    from fmha.dispatch.configs import KernelConfig

    config = next(c for c in default_registry() if c.algorithm.pipeline == Pipeline.GLUON_WS
                  and c.family == Family.BWD_DQ_DK_DV and c.signature.head_dims == (64,))
    return KernelConfig(config.signature, dataclasses.replace(config.algorithm, **change), notes=config.notes)


@pytest.mark.parametrize("stages,dq_bufs", [(2, 2), (3, 1)])
def test_gluon_ws_d64_m128_backward_compiles_for_sm90(tmp_path, monkeypatch, stages, dq_bufs):
    """The 128-query warp-specialized D=64 dK/dV kernel (block_m 128: two 64-query halves a
    stage, one 128 x 64 dQ hand-over) fits in 227 KB; 3 stages only with one dQ buffer."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    shapes = {p: {d: dict(sh) for d, sh in by_dim.items()} for p, by_dim in bwd_gluon.SHAPES.items()}
    shapes["gluon_ws"][64]["dq_bufs"] = dq_bufs
    monkeypatch.setattr(bwd_gluon, "SHAPES", shapes)
    for kernel in _built_for_sm90(_ws_d64_config(block_m=128, num_stages=stages), tmp_path, monkeypatch):
        assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in _ptx(kernel)


def test_gluon_ws_m128_limits():
    """block_m 128 only at D=64 and at most 3 stages; 3 stages with two dQ buffers exceed 227 KB
    (refused when the launch is built, since SHAPES is not part of the config)."""
    from fmha.dispatch.configs import ConfigError
    from fmha.kernels.gluon import bwd as bwd_gluon

    _ws_d64_config(block_m=128, num_stages=2)
    with pytest.raises(ConfigError, match="block_m 128"):
        _ws_d64_config(block_m=128, num_stages=4)
    with pytest.raises(ConfigError, match="block_m 128"):
        _ws_d64_config(block_m=128, block_n=64)
    with pytest.raises(ValueError, match="shared memory"):
        bwd_gluon.compile_spec("bf16", 64, 128, 128, 3, causal=False, warp_specialized=True)
    assert bwd_gluon.compile_spec("bf16", 64, 128, 128, 2, causal=False, warp_specialized=True)[1]["BLOCK_M"] == 128

def test_gluon_d256_backward_compiles_for_sm90(tmp_path, monkeypatch):
    """64 keys x 64 queries with dQ formed in two column halves: fits the shared memory."""
    config = next(c for c in default_registry() if c.algorithm.pipeline.is_gluon
                  and c.family == Family.BWD_DQ_DK_DV and c.signature.head_dims == (256,))
    _built_for_sm90(config, tmp_path, monkeypatch)


def _ws_d256_config(**change):
    """The registry's warp-specialized D=256 dK/dV config, optionally edited."""
    import dataclasses

    from fmha.dispatch.configs import KernelConfig

    config = next(c for c in default_registry() if c.algorithm.pipeline == Pipeline.GLUON_WS
                  and c.family == Family.BWD_DQ_DK_DV and c.signature.head_dims == (256,))
    return KernelConfig(config.signature, dataclasses.replace(config.algorithm, **change), notes=config.notes)


# SHAPES["gluon_ws"][256] changes: the default (P^T and dS^T from shared memory), dQ by the
# writer's red.v4 (dq_acc TMA cannot address), P^T/dS^T converted to register operands with
# dQ's second half issued early.
D256_WS_SHAPES = {"default": {}, "atomics": {"dq_tma": 0}, "convert_early": {"ps_smem": 0, "dq_early": 1}}


@pytest.mark.parametrize("shape", list(D256_WS_SHAPES))
def test_gluon_ws_d256_backward_compiles_for_sm90(tmp_path, monkeypatch, shape):
    """The warp-specialized D=256 dK/dV kernel (64 keys x 64 queries, 2 stages, dQ staged in
    the consumed Q/dO stage: bwd_gluon._ws_compute_d256) fits in 227 KB without dQ buffers,
    and adds dQ in two column halves by TMA reduce-add (or red.v4 where TMA cannot)."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    shapes = {p: {d: dict(sh) for d, sh in by_dim.items()} for p, by_dim in bwd_gluon.SHAPES.items()}
    shapes["gluon_ws"][256].update(D256_WS_SHAPES[shape])
    monkeypatch.setattr(bwd_gluon, "SHAPES", shapes)
    kernels = _built_for_sm90(_ws_d256_config(), tmp_path, monkeypatch)
    assert [k.variant for k in kernels] == ["plain", "causal", "window", "varlen"]
    for kernel in kernels:
        ptx = _ptx(kernel)
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240\b", ptx)  # the compute warpgroups
        if shape == "atomics":
            assert "red.relaxed.gpu.global.add.v4.f32" in ptx and "cp.reduce.async.bulk" not in ptx
        else:
            assert ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add") >= 2  # the two halves
            assert "red.global" not in ptx and "atom.global" not in ptx


def test_gluon_ws_d256_limits():
    """At D=256 the warp-specialized kernel takes 64 x 64 tiles and at most 2 stages (a third
    64 KB Q/dO stage needs 280 KB); its launch passes dQ's 128-column halves to the TMA."""
    from fmha.dispatch.configs import ConfigError
    from fmha.kernels.gluon import bwd as bwd_gluon

    _ws_d256_config()
    for change in (dict(num_stages=3), dict(block_n=128), dict(block_m=128), dict(num_warps=4)):
        with pytest.raises(ConfigError, match="head dim 256 64 queries against 64 keys"):
            _ws_d256_config(**change)
    with pytest.raises(ValueError, match="shared memory"):
        bwd_gluon.compile_spec("bf16", 256, 64, 64, 3, causal=False, warp_specialized=True)
    signature, constexprs, options = bwd_gluon.compile_spec("bf16", 256, 64, 64, 2, causal=True,
                                                            warp_specialized=True)
    assert constexprs["DQ_ALIAS"] and constexprs["PS_SMEM"] and not constexprs["DQ_EARLY"]
    assert constexprs["DQ_COLS"] == 128 and "[1,1,64,128]" in signature["dq_acc"]
    assert options == {"num_warps": 8, "maxnreg": 168}
    assert bwd_gluon.ws_shared_bytes(256, 64, 64, 2, 0) <= 232448 < bwd_gluon.ws_shared_bytes(256, 64, 64, 3, 0)
    # The 128-key kernels keep their hand-over buffers.
    assert not bwd_gluon.compile_spec("bf16", 128, 64, 128, 3, causal=False, warp_specialized=True)[1]["DQ_ALIAS"]


def test_gluon_ws_d256_leads_the_registry():
    """The warp-specialized D=256 backward comes first (measured 1.06x cuDNN, the other 0.945x);
    the kernel without warp specialization stays as the second choice."""
    problem = _problem(head_dim_qk=256, head_dim_v=256, causal=True)
    ranked = [c for c in default_registry() if c.family == Family.BWD_DQ_DK_DV and c.signature.head_dims == (256,)
              and c.algorithm.pipeline.is_gluon]
    assert [c.algorithm.pipeline for c in ranked] == [Pipeline.GLUON_WS, Pipeline.GLUON]
    config = Dispatcher(default_registry()).plan_backward(problem).config(Family.BWD_DQ_DK_DV)
    assert config == ranked[0]


def test_gluon_fp8_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    """The fp8 variant (QGMMA, V^T tiles, P in e4m3 from registers) compiles ahead of time."""
    config = next(c for c in default_registry() if c.algorithm.pipeline.is_gluon
                  and c.signature.dtypes == (DType.FP8_E4M3,) and c.signature.head_dims == (128,))
    _built_for_sm90(config, tmp_path, monkeypatch, dtype="fp8_e4m3")


@pytest.mark.parametrize("family,change,message", [
    (Family.FWD, dict(block_m=16), "block_m 128 or 192"),
    (Family.FWD, dict(num_warps=8), "num_warps 4"),
    (Family.BWD_DQ_DK_DV, dict(block_n=32), "64 queries against 128 keys on 8 compute warps"),
    (Family.BWD_DQ_DK_DV, dict(pipeline=Pipeline.GLUON_WS_PINGPONG), "64 queries against 64 keys"),
    (Family.FWD_SPLITKV, dict(block_n=64), r"2 or 4 KB of keys \(block_n >= 16"),  # 8 KB at D=128
    (Family.FWD_SPLITKV, dict(num_warps=4), "num_warps 1"),
])
def test_gluon_configs_outside_the_kernels_shapes_are_refused(family, change, message):
    """An edited Gluon config (e.g. from an exported registry) is refused when loaded, not
    at compile time (the kernel's static_assert)."""
    import dataclasses

    from fmha.dispatch.configs import ConfigError, KernelConfig

    config = next(c for c in default_registry() if c.algorithm.pipeline.is_gluon and c.family == family
                  and not c.algorithm.persistent)
    with pytest.raises(ConfigError, match=message):
        KernelConfig(config.signature, dataclasses.replace(config.algorithm, **change))


def test_persistent_forward_compile_spec():
    """fwd_gluon.compile_spec(persistent=True) gives the kernel launch(persistent=True) runs: O
    in its own buffer where shared memory allows (D 64/128), in Q's at D 256 and never for fp8
    (bf16 output from registers); one program per SM (the registers allow no second)."""
    from fmha.kernels.gluon import fwd as fwd_gluon

    def constexprs(*args, **kw):
        return fwd_gluon.compile_spec(*args, causal=True, **kw)[1]

    assert constexprs("bf16", 64, 128, 128, 3, pingpong=False)["PERSISTENT"] is False
    assert constexprs("bf16", 64, 128, 128, 3, pingpong=False)["O_BUF"] is False
    for d, n, st, pp, o_buf in ((64, 128, 3, False, True), (128, 128, 2, True, True), (256, 64, 2, True, False)):
        c = constexprs("bf16", d, 128, n, st, pingpong=pp, persistent=True)
        assert c["PERSISTENT"] is True and c["O_BUF"] is o_buf, (d, c)
        assert fwd_gluon.programs_per_sm(d, 128, n, st, o_buffer=o_buf) == 1
        assert fwd_gluon.shared_bytes(d, 128, n, st, o_buffer=o_buf) <= fwd_gluon.SMEM_PER_SM
    assert constexprs("fp8e4nv", 128, 128, 128, 2, pingpong=False, persistent=True)["O_BUF"] is False
    assert fwd_gluon.programs_per_sm(64, 192, 64, 3) == 1


def test_persistent_causal_tile_order():
    """fwd_gluon's causal tile order (TILE_ORDER) reaches only the persistent causal kernel and
    defaults to pairs of row tiles (2); the schedule simulation's transcription of the kernel's
    tile count and positions walks every tile once (tests/tools/persistent_schedule_sim.py --check)."""
    import subprocess
    import sys
    from pathlib import Path

    from fmha.kernels.gluon import fwd as fwd_gluon

    spec = functools.partial(fwd_gluon.compile_spec, "bf16", 128, 128, 128, 2, pingpong=True)
    assert spec(causal=True, persistent=True)[1]["TILE_ORDER"] == 2
    assert spec(causal=True, persistent=True, tile_order=1)[1]["TILE_ORDER"] == 1
    assert spec(causal=True, tile_order=1)[1]["TILE_ORDER"] == 0  # one tile per program: nothing to order
    assert spec(causal=False, persistent=True)[1]["TILE_ORDER"] == 0  # heads outermost, as without persistence
    sim = Path(__file__).parent / "tools" / "persistent_schedule_sim.py"
    out = subprocess.run([sys.executable, sim, "--check"], capture_output=True, text=True, check=True).stdout
    assert "check: ok" in out, out


def test_short_causal_d128_takes_heads_outermost():
    """launch's default tile order (attempt 41): heads outermost at D=128 with <= 8 row tiles a
    head, pairs elsewhere; `fmha kernels build` compiles that order as its own variant."""
    from fmha.dispatch import precompile
    from fmha.kernels.gluon import fwd as fwd_gluon

    assert [fwd_gluon.default_tile_order(128, n) for n in (1, 8, 9, 64)] == [1, 1, 2, 2]
    assert {fwd_gluon.default_tile_order(d, n) for d in (64, 256) for n in (1, 8, 64)} == {2}
    for config in default_registry():
        if config.family != Family.FWD or not config.algorithm.pipeline.is_gluon:
            continue
        jobs = dict(precompile.gluon_jobs(config, config.signature.dtypes[0]))
        short = config.algorithm.persistent and config.signature.head_dims == (128,)
        # (the one-tile 16-bit configs also build their window and varlen kernels, fp8 its V^T copy)
        fp8 = DType.FP8_E4M3 in config.signature.dtypes
        one_tile_16 = not config.algorithm.persistent and not fp8
        assert list(jobs) == ["plain", "causal"] + (["causal_short"] if short else []) + (
            ["window", "varlen"] if one_tile_16 else []) + (["vt"] if fp8 else []), config.name
        jobs.pop("vt", None)
        orders = {v: dict(job.constexprs)["TILE_ORDER"] for v, job in jobs.items()}
        assert orders == ({"plain": 0, "causal": 2, "causal_short": 1} if short
                          else {"plain": 0, "causal": 2} if config.algorithm.persistent
                          else dict.fromkeys(jobs, 0)), config.name
        for variant, job in jobs.items():
            constexprs = dict(job.constexprs)
            assert (constexprs["HAS_LEFT"], constexprs["VARLEN"]) == (variant == "window", variant == "varlen")


def _window_query_tiles(n0, seqlen_q, seqlen_k, diag, window_left, block_m, block_n):
    """bwd_gluon._key_tile's query-tile range [m_start, m_start + n_m) of the key tile at n0 under
    CAUSAL=LEFT_WINDOW, transcribed (C integer division of non-negative operands)."""
    m_start = max(n0 - diag, 0) // block_m
    last = min(n0 + block_n, seqlen_k) - 1 - diag + window_left
    m_end = min(-(-seqlen_q // block_m), max(last + block_m, 0) // block_m)
    return m_start, max(m_end - m_start, 0)


@pytest.mark.parametrize("block_m,block_n", [(64, 128), (128, 128), (64, 64)])
def test_window_backward_visits_exactly_the_query_tiles_that_see_a_key_tile(block_m, block_n):
    """Every query tile with a query that sees a key of the tile (i + diag - left <= j <= i + diag)
    is in the range, and the range's first and last tiles do see one (no wasted tiles at either
    end): Sq < Sk, Sq > Sk (diag < 0: rows with no key), windows inside a tile and over many."""
    for seqlen_q, seqlen_k in ((300, 700), (700, 300), (513, 513), (1, 1000)):
        for diag in (seqlen_k - seqlen_q, 0):
            for left in (0, 1, 63, 100, 1000):
                for n0 in range(0, seqlen_k, block_n):
                    keys = range(n0, min(n0 + block_n, seqlen_k))
                    seen = sorted({i // block_m for i in range(seqlen_q)  # [i + diag - left, i + diag] meets keys
                                   if i + diag - left <= keys[-1] and i + diag >= keys[0]})
                    start, count = _window_query_tiles(n0, seqlen_q, seqlen_k, diag, left, block_m, block_n)
                    visited = list(range(start, start + count))
                    assert set(seen) <= set(visited), (seqlen_q, seqlen_k, diag, left, n0, seen, visited)
                    if seen:
                        assert visited[0] == seen[0] and visited[-1] == seen[-1], (seen, visited)


def test_window_backward_compile_spec_and_refusals():
    """compile_spec(window=True) is the kernel launch_dkdv(window_left=...) runs (CAUSAL=LEFT_WINDOW,
    window_left a runtime i32); a window without causal, or on the persistent kernel, is refused
    before anything is launched."""
    from fmha.kernels.gluon import bwd as bwd_gluon

    for ws in (False, True):
        signature, constexprs, _ = bwd_gluon.compile_spec("bf16", 128, 64, 128, 2 if not ws else 3, causal=True,
                                                          warp_specialized=ws, window=True)
        assert constexprs["CAUSAL"] == bwd_gluon.LEFT_WINDOW.value and signature["window_left"] == "i32"
        plain = bwd_gluon.compile_spec("bf16", 128, 64, 128, 3, causal=True, warp_specialized=ws)[1]
        assert plain["CAUSAL"] is True
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(1, 2, 256, device="meta")
    args = (q, q, q, q, lse, lse, q, q, q.float())
    common = dict(align_bottom_right=True, scale=0.1, block_m=64, block_n=128, num_stages=3, warp_specialized=True)
    with pytest.raises(ValueError, match="window_left=5.*causal=True"):
        bwd_gluon.launch_dkdv(*args, causal=False, window_left=5, **common)
    with pytest.raises(ValueError, match="window_left=5.*persistent=True"):
        bwd_gluon.launch_dkdv(*args, causal=True, persistent=True, window_left=5, **common)


def test_gluon_window_backward_compiles_for_sm90(tmp_path):
    """The warp-specialized D=128 dK/dV kernel with a window (CAUSAL=LEFT_WINDOW) builds for sm_90
    within the shared memory (in a fresh process, as precompile's workers: this one may have run
    Triton's interpreter)."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json
from fmha.dispatch import precompile
from fmha.kernels.gluon import bwd as bwd_gluon
sig, cx, opt = bwd_gluon.compile_spec("bf16", 128, 64, 128, 3, causal=True, warp_specialized=True, window=True)
job = precompile.CompileJob(bwd_gluon.__name__, "bwd_dkdv_ws_kernel", tuple(sig.items()), tuple(cx.items()),
                            opt["num_warps"], 1, "gluon", opt["maxnreg"])
print(json.dumps(precompile.compile_job(job, precompile.target_of("sm90"), 232448)))
"""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is None and 0 < result["shared"] <= 232448, result
    ptx = next(Path(result["entry"]).glob("*.ptx")).read_text()
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
