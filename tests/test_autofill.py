"""Config autofill (fmha.dispatch.autofill, `fmha kernels autofill`) and the rules configs obey."""

import json

import numpy as np
import pytest
import torch

import fmha
from fmha import ConfigError, Dispatcher, Family, KernelConfig, Registry, cli, reference
from fmha.dispatch.autofill import autofill, autofill_report
from fmha.dispatch.configs import CUDA_ARCHS, DENSE_FEATURES, KVCACHE_FEATURES
from fmha.problem import DType, Feature


def test_short_spec_completes_from_the_closest_stock_config():
    config, sources = autofill_report("fwd fp16 d128 m128n64")
    assert config.name == "fwd_fp16_d1-128_cuda_triton_m128n64w8s3"
    assert config.signature.archs == CUDA_ARCHS and config.signature.features == DENSE_FEATURES
    # warps and stages of the stock config with the same tile and head dim
    assert "fwd_fp16-bf16_d65-128_cuda_triton_m128n64w8s3" in sources["num_warps"]
    assert sources["tile"] == "given" and sources["dtypes"] == "given"
    assert "warning" not in sources


def test_keyword_arguments_and_spec_tokens_mean_the_same():
    a = autofill("bwd_dq_dk_dv bf16 d65-128 m64n128w8s2")
    b = autofill(family=Family.BWD_DQ_DK_DV, dtype="bf16", head_dim=(65, 128), tile="m64n128", num_warps=8,
                 num_stages=2)
    assert a == b and a.signature.head_dim_min == 65


def test_family_alone_gives_a_valid_config_that_round_trips_through_json():
    for family in Family:
        config = autofill(family=family.value)
        assert KernelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
        kv = family in (Family.FWD_SPLITKV, Family.SPLITKV_COMBINE, Family.APPEND_KV)
        assert config.signature.features == (KVCACHE_FEATURES if kv else DENSE_FEATURES)
    cpu = autofill("fwd cpu")
    assert cpu.signature.archs == ("cpu",) and DType.FP64 in cpu.signature.dtypes
    assert cpu.algorithm.num_stages == 1


def test_shared_memory_estimate_warns_for_a_tile_over_sm90():
    _, sources = autofill_report("fwd fp16 d256 m128n128s3")
    assert "exceeds sm90's 232448" in sources["warning"]


@pytest.mark.parametrize("spec, kwargs, rule", [
    ("fwd m100n64", {}, "block_m=100 must be a power of two in [16, 256]"),
    ("fwd m128n8", {}, "block_n=8 must be a power of two in [16, 256]"),
    ("fwd d300", {}, "head_dim_max <= 256"),
    ("fwd fp64 m16n16", {}, "fp64 runs in Triton's interpreter only"),
    ("fwd fp16 tf32", {}, "'tf32' applies to fp32 inputs only"),
    ("fwd_splitkv", {"features": ["paged_kv", "bias"]}, "fwd_splitkv cannot serve features ['bias']"),
    ("fwd", {"features": ["paged_kv"]}, "fwd cannot serve features ['paged_kv']"),
    ("fwd m64n64w3", {}, "num_warps=3 must be 1, 2, 4, 8 or 16"),
    ("fwd m64n64s9", {}, "num_stages=9 must be in [1, 8]"),
    ("", {}, "autofill needs a family"),
    ("fwd m128n64 zz", {}, "token 'zz' is not understood"),
    ("fwd fp16 fp32", {}, "gives the dtype twice"),
    ("fwd m64n64w4", {"num_warps": 8}, "num_warps is given both"),
    ("fwd", {"family": "fwd"}, "family is given both"),
    ("fwd sm91", {}, "arch 'sm91' is not known"),
    ("fwd cpu-sm90", {}, "cannot share a config with CUDA archs"),
])
def test_invalid_specs_are_refused_with_the_rule_they_break(spec, kwargs, rule):
    with pytest.raises(ConfigError) as e:
        autofill(spec, **kwargs)
    assert rule in str(e.value)


def test_the_new_rules_also_refuse_hand_built_and_imported_configs():
    good = autofill("fwd cpu fp32 d32 m16n16").to_dict()
    bad = json.loads(json.dumps(good))
    bad["signature"]["features"].append("paged_kv")
    bad.pop("name")
    with pytest.raises(ConfigError, match="family fwd cannot serve features \\['paged_kv'\\]"):
        KernelConfig.from_dict(bad)
    bad = json.loads(json.dumps(good))
    bad["algorithm"]["dot_precision"] = "tf32"
    bad["signature"]["dtypes"] = ["fp16"]
    bad.pop("name")
    with pytest.raises(ConfigError, match="'tf32' applies to fp32 inputs only"):
        KernelConfig.from_dict(bad)
    assert len(fmha.default_registry()) > 0  # the stock configs obey every rule


def test_an_autofilled_config_runs_and_is_correct_on_the_cpu():
    config = autofill("fwd cpu fp16 d32 m16n32")
    registry = Registry([config, *(c for c in fmha.default_registry() if c.family != Family.FWD)])
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 37, 24, generator=gen).half() for _ in range(3))
    with fmha.api.use_dispatcher(Dispatcher(registry)):
        assert config.name in fmha.explain(q, k, v, causal=True)
        out = fmha.attention(q, k, v, causal=True)
    ref, _ = reference.attention_fwd(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert np.abs(out.double().numpy() - ref).max() < 5e-3


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_autofill_prints_importable_json_and_writes_a_registry(capsys, tmp_path):
    out_file = tmp_path / "one.json"
    code, out, err = run(capsys, "kernels", "autofill", "fwd", "bf16", "d64", "m64n32", "--out", str(out_file))
    assert code == 0, err
    data = json.loads(out)
    config = KernelConfig.from_dict(data)
    assert config.name == data["name"] == "fwd_bf16_d1-64_cuda_triton_m64n32w4s3"
    assert data["filled"]["tile"] == "given" and "closest config" in data["filled"]["num_warps"]
    assert [c.name for c in Registry.load(out_file)] == [config.name]
    code, out, _ = run(capsys, "kernels", "autofill", "--family", "fwd_splitkv", "--dtype", "fp32", "--hdim", "128",
                       "--tile", "m16n64", "--features", "paged_kv", "gqa")
    assert code == 0
    assert json.loads(out)["signature"]["features"] == sorted([Feature.PAGED_KV.value, Feature.GQA.value])


def test_cli_autofill_refuses_an_invalid_config_naming_the_rule(capsys):
    code, out, err = run(capsys, "kernels", "autofill", "fwd", "m48n64")
    assert code == 2 and out == ""
    assert "error: invalid kernel config: algorithm.block_m=48 must be a power of two" in err
