"""GPU tests of the tooling (`pytest -m gpu`): tuning with real timings, sweeps and stress on CUDA."""

import csv
import json
import secrets

import pytest
import torch

import fmha
from fmha import Dispatcher, Family, Registry, cli
from fmha.bench import tuner
from fmha.dispatch import tuning
from fmha.dispatch.autofill import autofill
from fmha.problem import DType, Problem

from attn_testing import check_attention, check_backward, make_qkv

pytestmark = pytest.mark.gpu


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _problem(arch, causal, **kw):
    return Problem(batch=2, nhead_q=8, nhead_k=8, seqlen_q=2048, seqlen_k=2048, head_dim_qk=128, head_dim_v=128,
                   dtype=DType.BF16, arch=arch, causal=causal, window=(-1, 0) if causal else (-1, -1), **kw)


def test_tune_times_real_candidates_and_the_dispatcher_runs_the_winner_correctly(tmp_path, rng):
    arch = cli.current_arch()
    stock = fmha.default_registry()
    # Two alternatives beside the stock d65-128 fwd config (autofilled; appended, so the
    # heuristic's first fit is still the stock one).
    extra = [autofill(f"fwd fp16-bf16 d65-128 {arch} {tile}") for tile in ("m64n64w4s3", "m128n32w4s2")]
    registry = Registry([*stock, *extra], name="stock+2")
    db = tuning.TuningDB(tmp_path / "tuning.json")
    problems = [_problem(arch, causal) for causal in (False, True)]
    results = tuner.tune(problems, [Family.FWD, Family.BWD_DQ_DK_DV], registry=registry, db=db,
                          timer=tuner.gpu_timer(warmup_ms=10, rep_ms=40))
    print(json.dumps([r.to_dict() for r in results], indent=1))
    for r in results:
        assert not r.errors, r.errors
        assert len(r.timings_ms) >= (3 if r.family == Family.FWD else 2)
        assert all(t > 0 for t in r.timings_ms.values())
        assert r.chosen == min(r.timings_ms, key=r.timings_ms.get)
    dispatcher = Dispatcher(registry, tuning=db)
    for prob, r in zip(problems, results[::2], strict=True):
        config, why = dispatcher.select(prob, Family.FWD)
        assert config.name == r.chosen and why.startswith("tuned:")
    with fmha.api.use_dispatcher(dispatcher):
        q, k, v = make_qkv(rng, batch=2, nhead_q=8, nhead_k=8, seqlen_q=2048, seqlen_k=2048, head_dim=128,
                           dtype=torch.bfloat16, device="cuda")
        assert "(tuned:" in fmha.explain(q, k, v, causal=True)
        check_attention(q, k, v, causal=True, truth="torch64")
        check_backward(q, k, v, causal=True, truth="torch64")


def test_cli_tune_writes_the_db_and_the_default_dispatcher_follows_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, "tune", "--profile", "pytorch", "--shapes", "2x8x2x1024x128:causal", "--dtype",
                         "fp16", "--json", str(tmp_path / "tune.json"), "--no-progress", "--rep-ms", "40")
    assert code == 0, out + err
    assert "fmha tune on" in out
    data = json.loads((tmp_path / "tuning.json").read_text())
    families = sorted(e["family"] for e in data["entries"].values())
    assert families == ["bwd_dq_dk_dv", "fwd"]
    prob = Problem(batch=2, nhead_q=8, nhead_k=2, seqlen_q=1024, seqlen_k=1024, head_dim_qk=128, head_dim_v=128,
                   dtype=DType.FP16, arch=cli.current_arch(), causal=True, window=(-1, 0))
    fresh = Dispatcher(tuning=tuning.TuningDB())  # the default path, under FMHA_CACHE_DIR
    assert fresh.select(prob, Family.FWD)[1].startswith("tuned:")
    assert fresh.select(prob, Family.BWD_DQ_DK_DV)[1].startswith("tuned:")


def test_cli_sweep_on_cuda(capsys, tmp_path):
    path = tmp_path / "s.csv"
    code, out, err = run(capsys, "sweep", "seqlen", "--values", "256", "1000", "4096", "--device", "cuda",
                         "-b", "2", "--nhead-q", "16", "--nhead-k", "4", "--hdim-q", "128", "--causal",
                         "--csv", str(path), "--plot", str(tmp_path / "s.png"), "--no-progress")
    assert code == 0, out + err
    rows = list(csv.DictReader(path.open()))
    assert [r["ok"] for r in rows] == ["True"] * 3
    assert all(r["check"].startswith("ok: ") and float(r["tflops"]) > 0 for r in rows)


@pytest.mark.parametrize("count, flags", [("6", []), ("3", ["--backward"]), ("3", ["--random-tiles"])])
def test_cli_stress_on_cuda(capsys, count, flags):
    seed = secrets.randbits(20)
    print(f"stress seed={seed}")
    code, out, err = run(capsys, "stress", "--device", "cuda", "--count", count, "--seed", str(seed),
                         "--time-budget", "40", "--no-progress", "--failures-only", *flags)
    print(out)
    assert code == 0, out + err


@pytest.mark.parametrize("contenders", ["fmha,cudnn", "fmha,cudnn,flash,flex"])
def test_cli_bench_on_cuda_with_and_without_flex(capsys, tmp_path, contenders):
    """A small custom shape through `fmha bench`: every contender times, JSON rows are ok,
    and fmha's forward agrees with cuDNN's."""
    out = tmp_path / "bench.json"
    code, text, err = run(capsys, "bench", "-b", "1", "--nhead-q", "4", "--seqlen", "512", "--hdim", "64",
                          "--contenders", contenders, "--rounds", "1", "--json", str(out), "--no-progress")
    assert code == 0, text + err
    rows = json.loads(out.read_text())["results"]
    assert {r["contender"] for r in rows} == set(contenders.split(","))
    assert all(r["ok"] for r in rows), [r.get("error") for r in rows]
    fmha_fwd = next(r for r in rows if r["contender"] == "fmha" and r["mode"] == "fwd")
    assert fmha_fwd["max_abs_diff"] < 2e-2
