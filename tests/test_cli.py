"""The `fmha` command line, called through `fmha.cli.main` (CPU: Triton's interpreter)."""

import json

import pytest
import torch

import fmha
from fmha import Family, Problem, Registry, cli
from fmha.problem import DType

TINY = ["--device", "cpu", "-b", "1", "--nhead-q", "2", "--seqlen-q", "24", "--seqlen-k", "40",
        "--hdim-q", "32", "--repeat", "1", "--warmup", "0"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extra", [[], ["--causal"], ["--causal", "--layout", "bshd", "--dtype", "fp32"]])
def test_run_prints_problem_plan_time_and_validation(capsys, extra):
    code, out, err = run(capsys, "run", *TINY, *extra)
    assert code == 0, out + err
    assert "B=1 Hq=2 Hk=2 Sq=24 Sk=40 Dqk=32" in out
    assert "TFLOP/s" in out and "ms" in out
    assert "o: max error" in out and "lse: max error" in out
    assert "FAIL" not in out
    assert ("causal(bottom_right)" in out) == ("--causal" in extra)


def test_run_json_with_alibi_is_machine_readable(capsys):
    code, out, _ = run(capsys, "run", *TINY, "--causal", "--bias", "alibi", "--nhead-q", "4",
                       "--nhead-k", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ok"] is True and len(data["results"]) == 1
    report = data["results"][0]
    assert "alibi" in report["problem"] and "causal" in report["problem"]
    assert report["problem_fields"]["nhead_k"] == 2
    assert report["time_ms"] > 0 and report["tflops"] > 0
    expected = fmha.get_dispatcher().plan_forward(Problem(**{
        **report["problem_fields"], "dtype": DType.FP16, "window": tuple(report["problem_fields"]["window"]),
        "mask_align": fmha.MaskAlign(report["problem_fields"]["mask_align"])}))
    assert report["kernel"] == expected.config(Family.FWD).name
    checks = report["validation"]["comparisons"]
    assert [c["name"] for c in checks] == ["o", "lse"]
    assert all(c["ok"] and c["error"] <= c["bound"] for c in checks)


def test_run_with_every_feature_flag(capsys):
    code, out, err = run(capsys, "run", *TINY, "--bias", "elementwise", "--window", "8", "2",
                         "--mask-align", "top_left", "--sink-size", "3", "--softcap", "5", "--sinks",
                         "--dropout", "0.2", "--seed", "3", "--json")
    assert code == 0, err
    report = json.loads(out)["results"][0]
    for word in ("window(8, 2)(top_left)", "sink_size=3", "softcap=5.0", "dropout=0.2", "bias", "sinks"):
        assert word in report["problem"]


def test_run_no_validate_skips_the_check(capsys):
    code, out, _ = run(capsys, "run", *TINY, "--no-validate", "--json")
    assert code == 0
    assert json.loads(out)["results"][0]["validation"] is None


def test_run_exits_1_when_validation_fails(capsys, monkeypatch):
    real = cli.attention

    def broken(*args, **kwargs):
        result = real(*args, **kwargs)
        if isinstance(result, tuple):
            return (result[0] + 0.5, *result[1:])
        return result + 0.5

    monkeypatch.setattr(cli, "attention", broken)
    code, out, _ = run(capsys, "run", *TINY)
    assert code == 1
    assert "FAIL" in out


def test_demo_runs_three_problems(capsys):
    code, out, err = run(capsys, "run", "--demo", "--device", "cpu", "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert len(results) == 3
    assert "causal" in results[1]["problem"] and "bshd" in results[1]["problem"]
    assert "Hq=4 Hk=2" in results[1]["problem"]
    assert all(word in results[2]["problem"] for word in ("window", "softcap", "sinks"))
    assert all(r["validation"]["ok"] for r in results)


@pytest.mark.parametrize("argv,message", [
    (["run", "--device", "cpu", "--nhead-q", "5", "--nhead-k", "2"], "not a multiple"),
    (["run", "--device", "cpu", "--hdim-q", "300", "--no-validate"], "head dim"),
])
def test_errors_from_fmha_are_one_line_messages_with_exit_code_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["run", "--dtype", "fp64"], ["run", "-b", "0"], ["run", "--dropout", "1.5"],
                                  ["nonsense"], ["kernels"], ["run", "--window", "3"]])
def test_bad_flags_get_argparse_messages(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "usage: fmha" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_run_on_cuda_without_cuda_is_refused(capsys):
    code, _, err = run(capsys, "run", "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err


def test_info_lists_device_versions_and_cache(capsys):
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("device", "arch", "python", "torch", "triton", "numpy", "fmha", "CUDA", "cuDNN",
                "triton cache"):
        assert key in data
    assert data["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert data["arch"] == "cpu (Triton interpreter)"
    code, out, _ = run(capsys, "info")
    assert code == 0 and "triton cache" in out


def test_kernels_list_shows_and_filters_the_registry(capsys):
    registry = fmha.get_dispatcher().registry
    code, out, _ = run(capsys, "kernels", "list")
    assert code == 0
    first = next(iter(registry))
    assert first.name in out
    code, out, _ = run(capsys, "kernels", "list", "--arch", "cpu", "--family", "fwd", "--json")
    assert code == 0
    configs = json.loads(out)
    assert configs and all("cpu" in c["signature"]["archs"] and c["signature"]["family"] == "fwd"
                           for c in configs)
    assert len(configs) == len(registry.filter(arch="cpu", family=Family.FWD))


def test_kernels_explain_names_the_selected_config(capsys):
    code, out, _ = run(capsys, "kernels", "explain", "--arch", "sm90", "--dtype", "bf16", "-b", "2",
                       "--nhead-q", "16", "--seqlen-q", "4096", "--hdim-q", "128", "--causal")
    assert code == 0
    problem = Problem(batch=2, nhead_q=16, nhead_k=16, seqlen_q=4096, seqlen_k=4096, head_dim_qk=128,
                      head_dim_v=128, dtype=DType.BF16, arch="sm90", causal=True, window=(-1, 0))
    config, _ = fmha.get_dispatcher().select(problem, Family.FWD)
    assert f"selected: {config.name}" in out
    assert "refused" in out


def test_kernels_explain_any_family(capsys):
    """--family: the KV-cache families take the problem as attention_with_kvcache builds it (bshd,
    key counts on the device, --paged-kv, --fp8-kv-cache); the float8 cache's decode is the Gluon
    one at D=64, 128 and 256 on sm90 and elsewhere (D=96) skips the 64-key Triton tile. The cache flags with a dense
    family are refused (exit 2)."""
    decode = ["--arch", "sm90", "--dtype", "bf16", "-b", "32", "--nhead-q", "32", "--nhead-k", "8", "--seqlen-q", "1",
              "--seqlen-k", "8192", "--hdim-q", "128"]
    code, out, _ = run(capsys, "kernels", "explain", "--family", "fwd_splitkv", "--fp8-kv-cache", "--paged-kv",
                       *decode)
    assert code == 0 and "family: fwd_splitkv" in out and "fp8_kv_cache paged_kv seqused_k" in out
    assert "selected: fwd_splitkv_fp16-bf16_d128-128_sm90_gluon_m16n32w1s3" in out
    code, out, _ = run(capsys, "kernels", "explain", "--family", "fwd_splitkv", "--fp8-kv-cache", "--paged-kv",
                       *decode[:-1], "96")
    assert code == 0 and "selected: fwd_splitkv_fp16-bf16_d1-128_cuda_triton_m16n128w4s3" in out
    assert "passed over by the default selection: float8 KV cache" in out
    for head_dim, tile in (("64", "d64-64_sm90_gluon_m16n32w1s3"), ("256", "d256-256_sm90_gluon_m16n16w1s3")):
        code, out, _ = run(capsys, "kernels", "explain", "--family", "fwd_splitkv", "--fp8-kv-cache", *decode[:-1],
                           head_dim)
        assert code == 0 and f"selected: fwd_splitkv_fp16-bf16_{tile}" in out, out
    code, out, _ = run(capsys, "kernels", "explain", "--family", "fwd_splitkv", *decode)
    assert code == 0 and "selected: fwd_splitkv_fp16-bf16_d65-128_cuda_triton_m16n64w4s3" in out
    code, out, _ = run(capsys, "kernels", "explain", "--family", "bwd_dq_dk_dv", "--arch", "sm90", "--dtype", "bf16",
                       "--hdim-q", "128")
    assert code == 0 and "family: bwd_dq_dk_dv" in out and "selected: bwd_dq_dk_dv" in out
    code, _, err = run(capsys, "kernels", "explain", "--fp8-kv-cache")
    assert code == 2 and "KV-cache --family" in err


def test_kernels_explain_exits_1_when_nothing_fits(capsys):
    code, out, _ = run(capsys, "kernels", "explain", "--arch", "cpu", "--hdim-q", "300")
    assert code == 1
    assert "selected: none" in out and "head dim 300" in out


def test_kernels_export_import_round_trip(capsys, tmp_path):
    path = tmp_path / "registry.json"
    code, out, _ = run(capsys, "kernels", "export", str(path))
    assert code == 0 and "by_family" in out
    original = fmha.get_dispatcher().registry
    assert [c.name for c in Registry.load(path)] == [c.name for c in original]
    code, out, _ = run(capsys, "kernels", "import", str(path))
    assert code == 0
    assert "valid" in out and f"{len(original)} configs" in out
    code, out, _ = run(capsys, "kernels", "list", "--registry", str(path), "--json")
    assert code == 0 and len(json.loads(out)) == len(original)


def _exported(tmp_path, capsys) -> dict:
    path = tmp_path / "good.json"
    assert cli.main(["kernels", "export", str(path)]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


@pytest.mark.parametrize("case,message", [
    ("not_json", "not valid JSON"),
    ("block_m_24", "block_m=24"),
    ("not_an_object", "'configs' list"),
    ("missing_field", "malformed"),
    ("missing_file", "cannot read"),
])
def test_kernels_import_refuses_bad_files_with_exit_code_2(capsys, tmp_path, case, message):
    data = _exported(tmp_path, capsys)
    path = tmp_path / "bad.json"
    if case == "not_json":
        path.write_text('{"configs": [')
    elif case == "block_m_24":
        data["configs"][0]["algorithm"]["block_m"] = 24
        path.write_text(json.dumps(data))
    elif case == "not_an_object":
        path.write_text("[1, 2]")
    elif case == "missing_field":
        del data["configs"][0]["signature"]["dtypes"]
        path.write_text(json.dumps(data))
    code, out, err = run(capsys, "kernels", "import", str(path))
    assert code == 2
    assert err.startswith("error:") and message in err
    assert "Traceback" not in err
