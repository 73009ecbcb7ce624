"""Sweeps and stress (fmha.testing.sweeps, `fmha sweep`, `fmha stress`) on the CPU interpreter, small sizes."""

import csv
import json
import random
from dataclasses import replace

import pytest
import torch

import fmha
from fmha import cli
from fmha.problem import Feature
from fmha.testing import sweeps

TINY = ["--device", "cpu", "-b", "1", "--nhead-q", "2", "--nhead-k", "1", "--hdim-q", "16", "--seqlen-q", "16"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_point_sets_the_swept_size_and_keeps_the_rest():
    base = sweeps.base_spec(True, nhead_q=8, nhead_k=2, causal=True)
    assert (sweeps.point(base, "seqlen", 33).seqlen_q, sweeps.point(base, "seqlen", 33).seqlen_k) == (33, 33)
    assert sweeps.point(base, "nhead", 12).nhead_k == 3  # the group size (4) is kept
    assert sweeps.point(base, "nhead", 2).nhead_k == 2  # not divisible: no GQA
    hd = sweeps.point(base, "hdim", 40)
    assert (hd.hdim_q, hd.hdim_v, hd.causal) == (40, 40, True)
    with pytest.raises(ValueError, match="axis='depth' is not supported; accepted"):
        sweeps.point(base, "depth", 3)


def test_cli_sweep_checks_each_point_and_writes_csv_json_and_png(capsys, tmp_path):
    paths = {ext: tmp_path / f"s.{ext}" for ext in ("csv", "json", "png")}
    code, out, err = run(capsys, "sweep", "seqlen", "--values", "9", "24", *TINY, "--causal", "--layout", "bshd",
                         "--csv", str(paths["csv"]), "--json", str(paths["json"]), "--plot", str(paths["png"]),
                         "--no-progress")
    assert code == 0, out + err
    assert "fmha sweep over seqlen" in out and "fwd_fp16-bf16-fp32-fp64_d1-256_cpu" in out
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [r["value"] for r in rows] == ["9", "24"]
    assert all(r["ok"] == "True" and r["check"].startswith("ok: ") for r in rows)
    assert "Sq=24 Sk=24" in rows[1]["problem"] and "causal" in rows[1]["problem"]
    assert rows[0]["why"].startswith("heuristic: first fit")
    data = json.loads(paths["json"].read_text())
    assert data["ok"] is True and data["settings"]["axis"] == "seqlen"
    assert all(c["error"] <= c["bound"] for r in data["rows"] for c in r["validation"]["comparisons"])
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_reports_a_failing_point_and_exits_1(capsys, monkeypatch):
    real = cli.run_one

    def flaky(spec, *args, **kwargs):
        if spec.hdim_q == 24:
            raise RuntimeError("kernel exploded")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(cli, "run_one", flaky)
    code, out, _ = run(capsys, "sweep", "hdim", "--values", "16", "24", *TINY, "--no-validate", "--no-progress")
    assert code == 1
    assert "RuntimeError: kernel exploded" in out and "1 of 2 points FAILED" in out


def test_random_specs_are_valid_reproducible_and_cover_every_feature():
    rng = random.Random(3)
    specs = [sweeps.random_spec(rng, True, i) for i in range(300)]
    again = random.Random(3)
    assert specs == [sweeps.random_spec(again, True, i) for i in range(300)]
    features = set()
    for spec in specs:
        features |= spec.problem("cpu").features
        assert spec.seqlen_q <= 48 and spec.seqlen_k <= 48 and spec.hdim_q <= 64
    assert {Feature.MASK, Feature.SINK_TOKENS, Feature.BIAS, Feature.ALIBI, Feature.SOFTCAP, Feature.SINKS,
            Feature.DROPOUT, Feature.GQA} <= features
    assert {s.dtype for s in specs} == {"fp16", "bf16", "fp32"} and {s.layout for s in specs} == {"bhsd", "bshd"}
    assert {s.mask_align for s in specs} == {"bottom_right", "top_left"}
    flags = sweeps.run_flags(replace(specs[0], causal=True, window=(3, 0), softcap=5.0, dropout=0.1, sinks=True))
    args = cli.build_parser().parse_args(["run", *flags.split()])
    assert cli._spec_from_args(args, True) == replace(specs[0], title="fmha run", causal=True, window=(3, 0),
                                                      softcap=5.0, dropout=0.1, sinks=True)


def test_cli_stress_validates_random_cases(capsys, tmp_path):
    out_file = tmp_path / "stress.json"
    code, out, err = run(capsys, "stress", "--device", "cpu", "--count", "3", "--seed", "5", "--json",
                         str(out_file), "--no-progress")
    assert code == 0, out + err
    assert "fmha stress: 3 cases, 3 ok, 0 failed" in out and "3 of 3 cases ok" in out
    data = json.loads(out_file.read_text())
    assert data["ran"] == 3 and data["ok"] is True
    assert all(r["validation"]["comparisons"] and r["ok"] for r in data["rows"])


def test_cli_stress_exits_1_on_a_failed_check_and_prints_how_to_reproduce(capsys, monkeypatch):
    def wrong(q, k, v, kwargs):
        return {"scope": "all", "ok": False, "comparisons": [], "truth": None, "baseline": None}

    monkeypatch.setattr(cli, "validate", wrong)
    code, out, _ = run(capsys, "stress", "--device", "cpu", "--count", "2", "--seed", "1", "--no-progress")
    assert code == 1
    assert "0 of 2 cases ok" in out and "the forward of it: fmha run --device cpu -b " in out


def test_stress_time_budget_stops_after_the_first_case(capsys):
    code, out, _ = run(capsys, "stress", "--device", "cpu", "--count", "50", "--time-budget", "0.001",
                       "--no-progress")
    assert code == 0
    assert "time budget of 0.001 s reached: 1 of 50 cases ran" in out
    with pytest.raises(ValueError, match="count=0 must be >= 1"):
        sweeps.stress(0, 0, "cpu")


@pytest.mark.parametrize("wrong", [False, True])
def test_validate_backward_checks_dq_dk_dv_and_catches_a_wrong_gradient(monkeypatch, wrong):
    spec = cli.RunSpec("bwd", 1, 2, 1, 12, 20, 16, 16, "fp16", layout="bshd", causal=True, bias="alibi",
                       dropout=0.2, seed=4)
    q, k, v, kwargs = cli._inputs(spec, torch.device("cpu"))
    if wrong:  # o * 1.01: dv (and dq, dk) off by about 1%
        real = fmha.api.attention
        monkeypatch.setattr(fmha.api, "attention", lambda *a, **kw: _scaled(real(*a, **kw)))
    result = sweeps.validate_backward(q, k, v, kwargs, deterministic=True, seed=1)
    assert [c.name for c in result["comparisons"]] == ["dq", "dk", "dv"] and result["scope"] == "all"
    assert result["ok"] is not wrong, [str(c) for c in result["comparisons"]]


def _scaled(result):
    return (result[0] * 1.01, *result[1:]) if isinstance(result, tuple) else result * 1.01


def test_stress_with_random_tiles_runs_other_configs_correctly():
    rows = sweeps.stress(2, 2, "cpu", random_tiles=True)
    stock = {c.name for c in fmha.default_registry()}
    assert all(r["ok"] and r["kernel"] not in stock and "_cpu_triton_m" in r["kernel"] for r in rows), rows
    plain = sweeps.stress(1, 2, "cpu")
    assert plain[0]["problem"] == rows[0]["problem"] and plain[0]["kernel"] in stock  # same problems
    assert fmha.get_dispatcher() is fmha.dispatch.dispatcher.default_dispatcher()  # restored
