"""Registry profiles (CK's receipts) and merging registries side by side."""

import pytest

import fmha
from fmha import Family, Registry, default_registry
from fmha.problem import DType


def test_profiles_keep_only_their_families_and_dtypes():
    reg = default_registry()
    assert {c.family for c in reg.profile("flash_fwd")} == {Family.FWD}
    assert {c.family for c in reg.profile("flash_bwd")} == {Family.BWD_DOT_DO_O, Family.BWD_DQ_DK_DV,
                                                            Family.BWD_CONVERT_DQ, Family.BWD_DQ}
    assert Family.FWD_SPLITKV in {c.family for c in reg.profile("inference")}
    assert Family.BWD_DQ_DK_DV not in {c.family for c in reg.profile("inference")}
    assert all(DType.FP32 in c.signature.dtypes for c in reg.profile("fp32"))
    assert len(reg.profile("all")) == len(reg)


def test_unknown_profile_names_the_accepted_ones():
    with pytest.raises(ValueError, match="profile='nope' is not known; accepted: .*flash_fwd"):
        default_registry().profile("nope")


def test_two_registries_side_by_side_each_with_its_dispatcher():
    reg = default_registry()
    latency = Registry([c for c in reg.profile("flash_fwd") if c.algorithm.block_m <= 64], name="latency")
    throughput = reg.profile("flash_fwd")
    problem = fmha.Problem(batch=1, nhead_q=8, nhead_k=8, seqlen_q=4096, seqlen_k=4096, head_dim_qk=128,
                           head_dim_v=128, dtype=DType.FP32, arch="sm90")
    a, _ = fmha.Dispatcher(latency).select(problem)
    b, _ = fmha.Dispatcher(throughput).select(problem)
    assert a.algorithm.block_m <= 64 and a in list(latency) and b in list(throughput)
    merged = latency.merged(throughput)
    assert len(merged) == len(throughput) and list(merged)[: len(latency)] == list(latency)
    assert Registry.from_json(merged.to_json()).name == merged.name


def test_cli_lists_a_profile(capsys):
    from fmha.cli import main
    assert main(["kernels", "list", "--profile", "inference", "--json"]) == 0
    import json
    families = {c["signature"]["family"] for c in json.loads(capsys.readouterr().out)}
    assert families == {"fwd", "fwd_splitkv", "splitkv_combine", "append_kv"}
