"""The tuning database (fmha.dispatch.tuning) and the dispatcher following it (CPU; timings are injected)."""

import json
import multiprocessing
import threading
import warnings

import numpy as np
import pytest
import torch

import fmha
from fmha import Dispatcher, Family, Problem, Registry, cli, reference
from fmha.bench import tuner
from fmha.dispatch import tuning
from fmha.dispatch.autofill import autofill
from fmha.dispatch.tuning import TuningDB, TuningDBWarning, TuningKey
from fmha.problem import DType

STOCK = fmha.default_registry()
CPU_FWD = next(c for c in STOCK if c.family == Family.FWD and c.signature.archs == ("cpu",))
# A second interpreter fwd config, so that there is something to choose between.
OTHER_FWD = autofill("fwd cpu fp16-bf16-fp32-fp64 m16n32")
REGISTRY = Registry([*STOCK, OTHER_FWD], name="two-cpu-fwd")


def problem(seqlen=64, head_dim=64, **kw):
    return Problem(batch=1, nhead_q=2, nhead_k=2, seqlen_q=seqlen, seqlen_k=seqlen, head_dim_qk=head_dim,
                   head_dim_v=head_dim, dtype=DType.FP16, arch="cpu", **kw)


def fake_timer(fast):
    """Timings (ms) that make `fast` the fastest config."""

    def timer(config, prob):
        return 1.0 if config.name == fast else 5.0 + len(config.name) % 3

    return timer


def test_record_round_trips_through_a_new_reader(tmp_path):
    db = TuningDB(tmp_path / "tuning.json")
    p = problem(seqlen=100, causal=True)
    entry = db.record(p, Family.FWD, {CPU_FWD.name: 3.0, OTHER_FWD.name: 2.0})
    assert entry["config"] == OTHER_FWD.name
    fresh = TuningDB(tmp_path / "tuning.json")
    got = fresh.get(TuningKey.of(p, Family.FWD))
    assert got["config"] == OTHER_FWD.name
    assert got["timings_ms"] == {CPU_FWD.name: 3.0, OTHER_FWD.name: 2.0}
    assert got["fmha"] == fmha.__version__ and got["seqlen_bucket"] == [128, 128]
    assert got["features"] == ["mask"] and got["gpu"] == "cpu"
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert data["schema_version"] == tuning.SCHEMA_VERSION and len(data["entries"]) == 1


def test_keys_bucket_head_dims_and_separate_decode_from_prefill():
    key = TuningKey.of(problem(seqlen=100, head_dim=72), Family.FWD)
    assert key == TuningKey.of(problem(seqlen=128, head_dim=128), Family.FWD)  # same padded dims, same bucket
    assert key != TuningKey.of(problem(seqlen=129, head_dim=72), Family.FWD)
    decode = problem().with_(seqlen_q=1)
    assert TuningKey.of(decode, Family.FWD) != TuningKey.of(problem(), Family.FWD)
    assert TuningKey.of(problem(), Family.FWD) != TuningKey.of(problem(), Family.BWD_DQ_DK_DV)
    assert TuningKey.of(problem(), Family.FWD) != TuningKey.of(problem(causal=True), Family.FWD)


def test_default_path_follows_fmha_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path / "c"))
    assert tuning.default_path() == tmp_path / "c" / "tuning.json"
    assert TuningDB().path == tmp_path / "c" / "tuning.json"


def test_record_refuses_when_no_candidate_ran(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    with pytest.raises(ValueError, match="no candidate ran"):
        db.record(problem(), Family.FWD, {CPU_FWD.name: None})
    assert not (tmp_path / "t.json").exists()


def _write_many(path, tag, n):
    db = TuningDB(path)
    for i in range(n):
        db.record(problem(seqlen=16 * 2 ** (i % 4), head_dim=16 * (1 + i // 4)).with_(nhead_q=2),
                  Family.FWD, {CPU_FWD.name: float(i + 1)}, gpu=f"gpu-{tag}")


def _entry_keys(path):
    data = json.loads(path.read_text())
    assert data["checksum"] == tuning._checksum(data["entries"])
    return set(data["entries"])


def test_concurrent_threads_lose_no_entry(tmp_path):
    path = tmp_path / "tuning.json"
    threads = [threading.Thread(target=_write_many, args=(path, f"t{t}", 8)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = _entry_keys(path)
    assert len(keys) == 6 * 8
    assert not list(tmp_path.glob("*.tmp"))


def test_concurrent_processes_lose_no_entry(tmp_path):
    path = tmp_path / "tuning.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(path, f"p{p}", 8)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(_entry_keys(path)) == 4 * 8


@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "schema"])
def test_a_damaged_file_is_ignored_with_a_warning_and_rebuilt(tmp_path, damage):
    path = tmp_path / "tuning.json"
    db = TuningDB(path)
    p = problem()
    db.record(p, Family.FWD, {CPU_FWD.name: 3.0, OTHER_FWD.name: 1.0})
    text = path.read_text()
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "checksum":  # an entry edited by hand, checksum left as it was
        path.write_text(text.replace(OTHER_FWD.name, CPU_FWD.name, 1))
    else:
        data = json.loads(text)
        data["schema_version"] = 999
        path.write_text(json.dumps(data))
    reader = TuningDB(path)
    with pytest.warns(TuningDBWarning, match="ignored"):
        assert reader.entries() == {}
    dispatcher = Dispatcher(REGISTRY, tuning=reader)
    config, why = dispatcher.select(p)
    assert config == CPU_FWD and why.startswith("heuristic: first fit")
    with pytest.warns(TuningDBWarning, match="moved it to"):
        reader.record(p, Family.FWD, {OTHER_FWD.name: 2.0})
    assert len(list(tmp_path.glob("tuning.json.corrupt-*"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningDB(path).get(TuningKey.of(p, Family.FWD))["config"] == OTHER_FWD.name


def test_stale_entries_are_ignored_and_explain_says_why(tmp_path):
    path = tmp_path / "tuning.json"
    db = TuningDB(path)
    p = problem()
    db.record(p, Family.FWD, {OTHER_FWD.name: 1.0, CPU_FWD.name: 2.0})
    # The config is not in the dispatcher's registry (the stock one lacks OTHER_FWD).
    stock = Dispatcher(STOCK, tuning=db)
    config, why = stock.select(p)
    assert config == CPU_FWD
    assert why.startswith("heuristic:") and "not in registry" in why
    # Another Triton version measured it: rewrite the entry (with a valid checksum).
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["triton"] = "0.0.1"
    data["checksum"] = tuning._checksum(data["entries"])
    path.write_text(json.dumps(data))
    config, why = Dispatcher(REGISTRY, tuning=TuningDB(path)).select(p)
    assert config == CPU_FWD and "measured with triton 0.0.1" in why


def test_an_entry_whose_config_does_not_serve_the_problem_is_ignored(tmp_path):
    db = TuningDB(tmp_path / "tuning.json")
    narrow = autofill("fwd cpu fp32 d16 m16n16")  # fp32 only
    registry = Registry([*STOCK, narrow])
    p = problem(head_dim=16)
    db.update({TuningKey.of(p, Family.FWD).text(): {"config": narrow.name, "timings_ms": {narrow.name: 1.0},
                                                      **tuning.versions()}})
    config, why = Dispatcher(registry, tuning=db).select(p)
    assert config == CPU_FWD and "does not serve this problem" in why and "dtype fp16" in why


def test_dispatcher_follows_the_tuned_choice_and_explain_says_tuned(tmp_path):
    db = TuningDB(tmp_path / "tuning.json")
    tuned_problem, other_problem = problem(seqlen=40, causal=True), problem(seqlen=300)
    results = tuner.tune([tuned_problem], [Family.FWD], registry=REGISTRY, db=db,
                          timer=fake_timer(OTHER_FWD.name))
    assert [r.chosen for r in results] == [OTHER_FWD.name]
    assert set(results[0].timings_ms) == {CPU_FWD.name, OTHER_FWD.name}
    dispatcher = Dispatcher(REGISTRY, tuning=db)
    config, why = dispatcher.select(tuned_problem)
    assert config == OTHER_FWD and why.startswith("tuned: fastest of 2 measured, 1 ms")
    assert f"selected: {OTHER_FWD.name} (tuned:" in dispatcher.explain(tuned_problem)
    # Another bucket has no entry: the heuristic (first fit) decides, and says so.
    assert f"selected: {CPU_FWD.name} (heuristic: first fit" in dispatcher.explain(other_problem)
    # Without a DB the heuristic decides the tuned problem too.
    assert Dispatcher(REGISTRY).select(tuned_problem)[0] == CPU_FWD


def test_fmha_attention_runs_the_tuned_config_correctly(tmp_path):
    db = TuningDB(tmp_path / "tuning.json")
    gen = torch.Generator().manual_seed(20261130)
    q, k, v = (torch.randn(1, 2, n, 32, generator=gen).half() for n in (40, 40, 40))
    prob = fmha.problem_of(q, k, v, causal=True)
    tuner.tune([prob], [Family.FWD], registry=REGISTRY, db=db, timer=fake_timer(OTHER_FWD.name))
    with fmha.api.use_dispatcher(Dispatcher(REGISTRY, tuning=db)):
        assert f"{OTHER_FWD.name}  (tuned:" in fmha.explain(q, k, v, causal=True)
        out = fmha.attention(q, k, v, causal=True)
    ref, _ = reference.attention_fwd(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert np.abs(out.double().numpy() - ref).max() < 5e-3


def test_tune_keeps_going_past_a_failing_candidate(tmp_path):
    db = TuningDB(tmp_path / "tuning.json")

    def timer(config, prob):
        if config == OTHER_FWD:
            raise RuntimeError("out of resources: shared memory")
        return 2.5

    (result,) = tuner.tune([problem()], [Family.FWD], registry=REGISTRY, db=db, timer=timer)
    assert result.chosen == CPU_FWD.name and result.timings_ms[OTHER_FWD.name] is None
    assert "out of resources" in result.errors[OTHER_FWD.name]
    with pytest.raises(ValueError, match="cannot be tuned; accepted"):
        tuner.tune([problem()], [Family.APPEND_KV], registry=REGISTRY, db=db, timer=timer)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cli_tune_refuses_without_a_gpu_and_dry_run_lists_candidates(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, "tune", "--shapes", "2x8x1024x128")
    assert code == 2 and "fmha tune needs a CUDA GPU" in err and "--dry-run" in err
    code, out, err = run(capsys, "tune", "--dry-run", "--shapes", "2x8x2x1024x128:causal", "--profile", "pytorch",
                         "--deterministic")
    assert code == 0, err
    assert "fwd B=2 Hq=8 Hk=2 Sq=1024" in out and "bwd_dq_dk_dv" in out and "bwd_dq " in out
    assert "fwd_fp16-bf16_d65-128_cuda_triton_m128n64w8s3" in out
    assert not (tmp_path / "tuning.json").exists()
    code, _, err = run(capsys, "tune", "--dry-run", "--shapes", "2x8x3x1024x128")
    assert code == 2 and "not a multiple" in err


def test_cli_tune_prints_the_table_and_errors_and_writes_json(capsys, tmp_path, monkeypatch):
    """The output of a tuning run, with a GPU and its timer faked (one candidate fails)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "current_arch", lambda: "sm90")
    monkeypatch.setattr(tuning, "device_name", lambda arch: "FakeGPU")

    def gpu_timer(warmup_ms, rep_ms, fail=lambda name: "triton" in name):
        def timer(config, prob):
            if fail(config.name):
                raise RuntimeError("out of resources: shared memory\nsecond line")
            return 0.5
        return timer

    monkeypatch.setattr(tuner, "gpu_timer", gpu_timer)
    out_json, db = tmp_path / "tune.json", tmp_path / "db.json"
    code, out, err = run(capsys, "tune", "--shapes", "2x8x1024x128", "--family", "fwd", "--db", str(db),
                         "--json", str(out_json), "--no-progress")
    assert code == 0, err
    data = json.loads(out_json.read_text())
    assert data["gpu"] == "FakeGPU" and data["db"] == str(db) and len(data["results"]) == 1
    result = data["results"][0]
    chosen, failed = result["chosen"], next(iter(result["errors"]))
    assert result["timings_ms"][chosen] == 0.5 and result["timings_ms"][failed] is None and "triton" in failed
    gluon = sorted(name for name, ms in result["timings_ms"].items() if ms is not None)
    assert len(gluon) == 2 and gluon[1] == gluon[0] + "_persistent"  # both Gluon forwards timed
    assert result["errors"][failed] == "RuntimeError: out of resources: shared memory"
    assert "fmha tune on FakeGPU: DB " in out and "0.5 " in out
    assert f"{failed} failed on B=2 Hq=8 Hk=8 Sq=1024" in out and f"wrote {out_json}" in out
    assert json.loads(db.read_text())["entries"]
    monkeypatch.setattr(tuner, "gpu_timer", lambda w, r: gpu_timer(w, r, fail=lambda name: True))
    code, out, err = run(capsys, "tune", "--shapes", "2x8x1024x128", "--family", "fwd", "--db",
                         str(tmp_path / "db2.json"), "--no-progress")
    assert code == 1, err
    assert "none ran" in out and "wrote" not in out


@pytest.mark.parametrize("family", [Family.FWD, Family.BWD_DQ_DK_DV])
def test_the_runner_that_tune_times_forces_the_candidate(family):
    prob = problem(seqlen=20, head_dim=16, causal=True).with_(dtype=DType.FP32, nhead_q=4, nhead_k=2, alibi=True)
    config = OTHER_FWD if family == Family.FWD else next(
        c for c in STOCK if c.family == family and c.signature.archs == ("cpu",))
    fn, dispatcher = tuner.runner(config, prob, "cpu")
    assert [c.name for c in dispatcher.registry if c.family == family] == [config.name]
    assert dispatcher.tuning is None
    with fmha.api.use_dispatcher(dispatcher):
        assert dispatcher.select(prob, family)[0] == config
        result = fn()
    tensors = [result] if family == Family.FWD else list(result)
    assert all(torch.isfinite(t).all() for t in tensors)
    assert fmha.get_dispatcher() is not dispatcher  # restored


def test_the_runner_refuses_a_problem_it_cannot_build():
    with pytest.raises(ValueError, match="give another problem.*'layout': \\('bshd', 'bhsd'\\)"):
        tuner.runner(OTHER_FWD, problem().with_(layout="bshd"), "cpu")


def test_the_default_dispatcher_reads_the_db_in_fmha_cache_dir(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fmha.dispatch.dispatcher, "_default", None)  # built afresh, reading the new dir
    argv = ["kernels", "explain", "--arch", "cpu", "-b", "1", "--nhead-q", "2", "--seqlen-q", "100",
            "--hdim-q", "64", "--causal"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and f"selected: {CPU_FWD.name} (heuristic: first fit" in out
    prob = cli._spec_from_args(cli.build_parser().parse_args(argv), True).problem("cpu")
    TuningDB(tmp_path / "tuning.json").record(prob, Family.FWD, {CPU_FWD.name: 0.5})
    code, out, _ = run(capsys, *argv)
    assert code == 0 and f"selected: {CPU_FWD.name} (tuned: fastest of 1 measured, 0.5 ms" in out
