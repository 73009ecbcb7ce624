"""fmha.bench.suite without a GPU: suites, FLOPs, summaries, writers, and the no-CUDA refusal."""

import csv
import io
import json
import math
import time

import pytest
import torch
from rich.console import Console

from fmha import Problem, cli
from fmha.bench import suite as bench
from fmha.bench.suite import Shape


def test_standard_suite_covers_the_performance_issue_shapes():
    shapes = bench.standard_suite()
    assert len(shapes) == 2 * 3 * 2 * 5
    assert len({s.label for s in shapes}) == len(shapes)
    assert {s.dtype for s in shapes} == {"bf16", "fp16"}
    assert {s.head_dim for s in shapes} == {64, 128, 256}
    assert {s.causal for s in shapes} == {False, True}
    dense = {(s.batch, s.nhead_q, s.seqlen) for s in shapes if not s.gqa}
    assert dense == {(16, 16, 1024), (4, 16, 4096), (2, 16, 8192), (1, 16, 16384)}
    gqa = [s for s in shapes if s.gqa]
    assert len(gqa) == 12
    assert {(s.batch, s.nhead_q, s.nhead_k, s.seqlen) for s in gqa} == {(4, 32, 8, 8192)}


def test_quick_suite_is_bf16_d128_causal_and_not():
    shapes = bench.quick_suite()
    fields = [(s.batch, s.nhead_q, s.seqlen, s.head_dim, s.dtype) for s in shapes]
    assert fields == [(4, 16, 4096, 128, "bf16")] * 2
    assert [s.causal for s in shapes] == [False, True]


def test_flops_follow_the_flashattention_convention():
    s = Shape(2, 8, 8, 1024, 128, "bf16", False)
    fwd = 4 * 2 * 8 * 1024 * 1024 * 128
    assert s.flops("fwd") == fwd
    assert s.flops("bwd") == 2.5 * fwd
    causal = Shape(2, 8, 8, 1024, 128, "bf16", True)
    assert causal.flops("fwd") == fwd / 2 and causal.flops("bwd") == 2.5 * fwd / 2
    # GQA: FLOPs count query heads.
    assert Shape(2, 8, 2, 1024, 128).flops("fwd") == fwd
    # Same number as Problem.flops_fwd when Dqk == Dv.
    problem = Problem(batch=2, nhead_q=8, nhead_k=8, seqlen_q=1024, seqlen_k=1024, head_dim_qk=128,
                      head_dim_v=128, causal=True, window=(-1, 0))
    assert problem.flops_fwd() == causal.flops("fwd")
    with pytest.raises(ValueError, match="mode"):
        bench.flops(1, 1, 1, 1, 1, mode="both")


@pytest.mark.parametrize("kwargs,message", [
    (dict(nhead_q=6, nhead_k=4), "not a multiple"),
    (dict(dtype="fp8"), "dtype"),
    (dict(seqlen=0), "seqlen"),
])
def test_shape_checks_its_fields(kwargs, message):
    fields = dict(batch=1, nhead_q=4, nhead_k=4, seqlen=128, head_dim=64, dtype="bf16", causal=False)
    with pytest.raises(ValueError, match=message):
        Shape(**{**fields, **kwargs})


def _result(shape: Shape, mode: str, contender: str, tflops: float | None, error: str | None = None) -> dict:
    ok = tflops is not None
    flops = shape.flops(mode)
    t = flops / (tflops * 1e12) * 1e3 if ok else None
    return {"shape": shape.label, "batch": shape.batch, "nhead_q": shape.nhead_q, "nhead_k": shape.nhead_k,
            "seqlen": shape.seqlen, "head_dim": shape.head_dim, "dtype": shape.dtype, "causal": shape.causal,
            "mode": mode, "contender": contender, "ok": ok, "error": None if ok else (error or "boom"),
            "method": "forward" if mode == "fwd" else "grad_retained_graph", "note": "",
            "time_ms": t, "times_ms": [t] * 3 if ok else [], "flops": flops, "tflops": tflops,
            "max_abs_diff": 0.0 if ok and mode == "fwd" else None, "diff_against": "cudnn"}


def _synthetic() -> list[dict]:
    a, b, c = Shape(1, 2, 2, 256, 64), Shape(1, 2, 2, 512, 64, causal=True), Shape(2, 4, 2, 256, 128)
    return [
        _result(a, "fwd", "fmha", 400.0), _result(a, "fwd", "cudnn", 200.0), _result(a, "fwd", "flex", 150.0),
        _result(b, "fwd", "fmha", 100.0), _result(b, "fwd", "cudnn", 200.0), _result(b, "fwd", "flex", None),
        _result(c, "fwd", "fmha", None, "NotImplementedError: no kernel"), _result(c, "fwd", "cudnn", 300.0),
        _result(c, "fwd", "flex", 250.0),
        _result(a, "bwd", "fmha", 90.0), _result(a, "bwd", "cudnn", 100.0), _result(a, "bwd", "flex", 80.0),
        _result(b, "bwd", "fmha", None, "NotImplementedError: backward"), _result(b, "bwd", "cudnn", 120.0),
        _result(b, "bwd", "flex", 100.0),
    ]


def test_geometric_mean_of_the_ratio_per_mode():
    results = _synthetic()
    rows = bench.ratio_rows(results)
    labels = [Shape(1, 2, 2, 256, 64).label, Shape(1, 2, 2, 512, 64, causal=True).label,
              Shape(2, 4, 2, 256, 128).label]
    assert [(r["shape"], r["mode"]) for r in rows][:3] == [(label, "fwd") for label in labels]
    assert [r["ratio"] for r in rows] == [2.0, 0.5, None, 0.9, None]
    assert rows[2]["errors"] == {"fmha": "NotImplementedError: no kernel"}
    s = bench.summary(results)
    assert s["fwd"]["geomean_ratio"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert (s["fwd"]["shapes"], s["fwd"]["total"]) == (2, 3)
    assert s["bwd"]["geomean_ratio"] == pytest.approx(0.9)
    assert (s["bwd"]["shapes"], s["bwd"]["total"]) == (1, 2)
    assert bench.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert bench.geomean([]) is None


def test_summary_without_any_pair_is_none():
    shape = Shape(1, 2, 2, 256, 64)
    s = bench.summary([_result(shape, "fwd", "fmha", None), _result(shape, "fwd", "cudnn", 100.0)])
    assert s["fwd"]["geomean_ratio"] is None and s["fwd"]["shapes"] == 0


def test_json_writer_produces_parseable_file(tmp_path):
    results = _synthetic()
    path = tmp_path / "bench.json"
    env = {"date": "2025-01-01T00:00:00+00:00", "gpu": "synthetic", "torch": torch.__version__}
    bench.write_json(path, results, env, {"rounds": 3})
    data = json.loads(path.read_text())
    assert data["environment"]["gpu"] == "synthetic"
    assert data["settings"] == {"rounds": 3}
    assert data["results"] == json.loads(json.dumps(results))
    assert data["summary"]["fwd"]["geomean_ratio"] == pytest.approx(1.0)


def test_json_writer_records_the_environment_by_default(tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json(path, _synthetic())
    env = json.loads(path.read_text())["environment"]
    for key in ("date", "gpu", "torch", "triton", "cuda", "cudnn", "fmha"):
        assert key in env
    assert env["torch"] == torch.__version__


def test_csv_writer_produces_parseable_file(tmp_path):
    results = _synthetic()
    path = tmp_path / "bench.csv"
    bench.write_csv(path, results)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert len(rows) == len(results)
    assert tuple(rows[0]) == bench.CSV_FIELDS
    assert rows[0]["contender"] == "fmha" and float(rows[0]["tflops"]) == 400.0
    assert rows[5]["ok"] == "False" and rows[5]["tflops"] == ""


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "bench.png"
    bench.plot(path, _synthetic(), title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_shows_tflops_ratio_and_geomean():
    console = Console(file=io.StringIO(), width=200)
    console.print(bench.render_table(_synthetic(), ["fmha", "cudnn", "flex"]))
    text = console.file.getvalue()
    assert "400.0" in text and "2.000" in text and "n/a" in text
    assert "geomean (2/3 shapes)" in text and "1.000" in text
    lines = bench.na_reasons(_synthetic())
    assert any(line.startswith("fmha bwd") and "NotImplementedError: backward" in line for line in lines)


def test_time_ms_on_the_cpu_is_positive():
    calls = []
    t = bench.time_ms(lambda: calls.append(sum(range(1000))), device="cpu", warmup=2, repeat=3)
    assert t > 0 and len(calls) == 5


def test_bench_without_cuda_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--suite", "quick"]) == 2
    out, err = capsys.readouterr()
    assert "needs a CUDA GPU" in err
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.run_suite(bench.quick_suite(), ["fwd"], ["fmha"], 1, progress=False)


def test_bench_dry_run_lists_the_shapes(capsys):
    assert cli.main(["bench", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "60 shapes" in out and "Hq=32 Hk=8 S=8192" in out


def test_bench_custom_shape_flags(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "-b", "2", "--nhead-q", "8", "--nhead-k", "2", "--seqlen", "2048",
                              "--hdim", "64", "--dtype", "fp16", "--causal", "--mode", "fwd",
                              "--contenders", "fmha,cudnn"])
    assert bench.shapes_from_args(args) == [Shape(2, 8, 2, 2048, 64, "fp16", True)]
    assert args.contenders == ["fmha", "cudnn"]
    assert bench.shapes_from_args(parser.parse_args(["bench"])) == bench.standard_suite()
    assert cli.main(["bench", "--suite", "quick", "--seqlen", "128"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["bench", "--contenders", "fmha,xformers"]) == 2
    assert "unknown contender" in capsys.readouterr().err


def test_features_suite_and_its_shapes():
    """The features suite: sliding windows and packed documents, causal, bf16 D=128; the
    shapes refuse what they cannot mean; FLOPs count the visible pairs (FlashAttention's
    convention: half the diagonal), which the dense mask counts exactly."""
    shapes = bench.features_suite()
    assert [(s.window, s.docs, s.gqa) for s in shapes] == [(1024, 0, False), (4096, 0, False), (0, 8, False),
                                                           (0, 8, True)]
    assert all(s.causal and s.dtype == "bf16" and s.head_dim == 128 for s in shapes)
    assert "window=1024" in shapes[0].label and "varlen docs=8" in shapes[2].label
    assert bench.shapes_from_args(cli.build_parser().parse_args(["bench", "--suite", "features"])) == shapes
    for kwargs, message in ((dict(window=8), "causal"), (dict(docs=2), "causal"),
                            (dict(causal=True, window=8, docs=2), "not both"),
                            (dict(causal=True, docs=2, batch=2), "batch=1"),
                            (dict(causal=True, docs=40), "seqlen"), (dict(causal=True, window=-1), ">= 0")):
        fields = {**dict(batch=1, nhead_q=2, nhead_k=2, seqlen=128, head_dim=16), **kwargs}
        with pytest.raises(ValueError, match=message):
            Shape(**fields)
    assert bench.doc_lengths(100, 4) == [40, 10, 30, 20] and bench.doc_lengths(103, 5) == [29, 7, 22, 14, 31]
    for shape in (Shape(1, 2, 2, 256, 16, causal=True, window=40), Shape(1, 2, 2, 256, 16, causal=True, docs=5),
                  Shape(1, 2, 2, 256, 16, causal=True, window=400)):
        visible = int(bench.dense_mask(shape, "cpu").sum())
        convention = shape.flops("fwd") / (4 * 2 * 16)
        assert visible - shape.seqlen / 2 == pytest.approx(convention), shape.label  # (the diagonal's half)
        assert shape.flops("bwd") == 2.5 * shape.flops("fwd")


@pytest.mark.parametrize("feature", [dict(window=24), dict(docs=3)])
def test_fmha_feature_calls_agree_with_sdpa_under_the_dense_mask(feature):
    """fmha's call of a feature shape (a window; documents through attention_varlen on packed
    copies of the bhsd tensors) computes SDPA's attention under the feature's dense mask,
    forward and backward (through the interpreter)."""
    shape = Shape(1, 4, 2, 80, 16, "fp32", True, **feature)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 80, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    call = bench._make_call("fmha", shape, device="cpu")
    prepare = getattr(call, "prepare", lambda t: t)  # (varlen: packed (total, H, D) copies)
    out = call(prepare(q), prepare(k), prepare(v))
    mask = bench.dense_mask(shape, "cpu")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    dout = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_geomean_is_scale_free():
    values = [0.5, 1.25, 3.0]
    assert bench.geomean(values) == pytest.approx(math.prod(values) ** (1 / 3))


def test_shards_split_the_suite_without_overlap():
    parser = cli.build_parser()
    parts = [bench.shapes_from_args(parser.parse_args(["bench", "--shard", f"{k}/4"])) for k in range(1, 5)]
    assert sorted(s.label for part in parts for s in part) == sorted(s.label for s in bench.standard_suite())
    assert [len(part) for part in parts] == [15] * 4
    assert cli.main(["bench", "--shard", "5/4"]) == 2


def test_features_shapes_are_compared_with_flexattention(tmp_path):
    """Windows and documents: the ratio column, the geomeans and the JSON summary are against
    FlexAttention (cuDNN runs a dense mask there), or cuDNN when flex did not run."""
    window, docs = Shape(1, 2, 2, 256, 64, causal=True, window=64), Shape(1, 2, 2, 256, 64, causal=True, docs=2)
    results = []
    for shape in (window, docs):
        for contender, tflops in (("fmha", 300.0), ("cudnn", 30.0), ("flex", 200.0)):
            results.append({**_result(shape, "fwd", contender, tflops), "window": shape.window, "docs": shape.docs})
    assert bench.reference_contender(results) == "flex"
    assert bench.reference_contender(results, ["fmha", "cudnn"]) == "cudnn"
    assert bench.reference_contender(_synthetic()) == "cudnn"
    assert bench.summary(results)["fwd"] == {"geomean_ratio": pytest.approx(1.5), "shapes": 2, "total": 2,
                                             "against": "flex"}
    console = Console(file=io.StringIO(), width=200)
    console.print(bench.render_table(results, ["fmha", "cudnn", "flex"]))
    text = console.file.getvalue()
    assert "fmha/flex" in text and "fmha/cudnn" not in text and "1.500" in text and "10.000" not in text
    bench.write_json(tmp_path / "f.json", results, {"gpu": "synthetic"})
    assert json.loads((tmp_path / "f.json").read_text())["summary"]["fwd"]["against"] == "flex"


def test_merge_joins_json_files_without_a_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = _synthetic()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    env = {"gpu": "synthetic"}
    bench.write_json(first, results[:9], env)
    bench.write_json(second, results[9:], env)
    merged, table = tmp_path / "all.json", tmp_path / "all.csv"
    code = cli.main(["bench", "--merge", str(first), str(second), "--json", str(merged), "--csv", str(table)])
    out = capsys.readouterr().out
    assert code == 0 and "geomean" in out
    data = json.loads(merged.read_text())
    assert len(data["results"]) == len(results)
    assert data["environment"]["gpu"] == "synthetic"
    assert data["summary"] == json.loads(json.dumps(bench.summary(results)))
    assert len(list(csv.DictReader(io.StringIO(table.read_text())))) == len(results)


def test_merge_refuses_a_file_that_is_not_bench_output(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"configs": []}')
    assert cli.main(["bench", "--merge", str(bad)]) == 2
    assert "cannot read bench results" in capsys.readouterr().err


def test_host_bound_rows_name_the_rows_the_host_set():
    """A row whose host time a call reaches 80% of its measured time is listed as host-bound;
    rows without host_ms (older JSON) or failed rows are not."""
    shape = Shape(16, 16, 16, 1024, 64, causal=True)
    gpu_bound, host_bound, old, failed = (_result(shape, "bwd", name, 200.0)
                                          for name in ("cudnn", "fmha", "flash", "flex"))
    gpu_bound["host_ms"] = 0.2 * gpu_bound["time_ms"]
    host_bound["host_ms"] = 0.9 * host_bound["time_ms"]
    failed.update(ok=False, host_ms=5.0)
    lines = bench.host_bound_rows([gpu_bound, host_bound, old, failed])
    assert len(lines) == 1 and lines[0].startswith(f"host-bound: fmha bwd {shape.label}: "), lines
    assert bench.host_bound_rows([host_bound], fraction=0.95) == []


def test_runner_host_time_is_the_enqueue_time_of_a_call(monkeypatch):
    """_Runner.host_ms: wall time of back-to-back calls of the timed function over their count
    (a 2 ms sleep stands in for a host-bound call; synchronize is stubbed on the CPU)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    def slow_call():
        calls.append(1)
        time.sleep(0.002)

    runner = bench._Runner("fmha", [(1.0, slow_call)])
    host = runner.host_ms(measured_ms=1.0)
    assert len(calls) == 5 and 2.0 <= host < 4.0, (calls, host)  # ~5 ms of GPU work at 1 ms a call
    calls.clear()
    assert runner.host_ms(measured_ms=100.0) >= 2.0 and len(calls) == 3  # at least 3 calls
    calls.clear()  # fwd+bwd minus fwd: no single call to compare with
    assert bench._Runner("fmha", [(1.0, slow_call), (-1.0, slow_call)]).host_ms(1.0) is None and not calls


def test_decode_suite_runs_and_reports_on_the_cpu(tmp_path):
    """bench_decode end to end with CPU tensors (Triton's interpreter; the harness itself is the
    GPU's `fmha bench --decode`): contiguous and paged, 16-bit and float8 caches; fmha's
    output agrees with SDPA's over the same keys, bandwidth counts a float8 cache's bytes as
    one an element, a contender that cannot run (cuDNN on the CPU) is reported n/a with its error,
    and the table and JSON are written."""
    from fmha.bench import decode as bench_decode
    from fmha.bench.decode import DecodeShape

    shapes = [DecodeShape(2, 4, 2, 64, 32, "fp16", page, fp8) for page in (0, 16) for fp8 in (False, True)]
    calls = []

    def timer(fn):
        calls.append(fn)
        return bench.time_ms(fn, device="cpu", warmup=0, repeat=1)

    hosted = []

    def host_timer(fn):
        hosted.append(fn)
        return 0.25 * len(hosted)

    rows = bench_decode.run_decode_suite(shapes, ["fmha", "cudnn", "flash"], rounds=2, timer=timer, device="cpu",
                                         host_timer=host_timer)
    assert len(rows) == 12 and len(calls) == 4 * 2 * 2  # fmha and flash, two rounds, four shapes
    assert hosted == calls  # the host time of each timed call, after its timing
    assert rows[0]["host_ms"] == pytest.approx((0.25 + 1.0) / 2)  # fmha: 1st call, then 4th (order rotated)
    assert all(r["mode"] == "decode" for r in rows)
    assert all((r["host_ms"] is None) == (not r["ok"]) for r in rows)
    bound = [dict(r, host_ms=r["time_ms"]) for r in rows if r["ok"]][:1]
    assert bench.host_bound_rows(bound)[0].startswith(f"host-bound: fmha decode {rows[0]['shape']}: ")
    for r in rows:
        if r["contender"] == "cudnn":
            assert not r["ok"] and r["error"] and r["tb_per_s"] is None
            continue
        assert r["ok"] and len(r["times_ms"]) == 2 and r["tb_per_s"] > 0, r
        element = 1 if r["fp8_cache"] and r["contender"] == "fmha" else 2
        assert r["kv_bytes"] == 2 * 2 * 64 * 2 * 32 * element
        if r["contender"] == "flash":
            assert r["diff_against"] == "fmha" and r["max_abs_diff"] < 2e-3, r  # same keys, fp16 outputs
    text = Console(file=io.StringIO(), width=200)
    text.print(bench_decode.render_decode_table(rows))
    table = text.file.getvalue()
    assert "paged(16) fp8 cache" in table and "n/a" in table
    assert bench_decode.decode_summary(rows) == {"geomean_cudnn_over_fmha": None, "shapes": 0, "total": 4}
    cudnn_like = [dict(r, contender="cudnn", ok=True, time_ms=2 * r["time_ms"]) for r in rows
                  if r["contender"] == "fmha"]  # (as if cuDNN had run, twice as slow)
    assert bench_decode.decode_summary(rows + cudnn_like)["geomean_cudnn_over_fmha"] == pytest.approx(2.0)
    bench.write_json(tmp_path / "decode.json", rows, summary_data=bench_decode.decode_summary(rows))
    data = json.loads((tmp_path / "decode.json").read_text())
    assert len(data["results"]) == 12 and data["summary"]["total"] == 4
    with pytest.raises(ValueError, match="page_size"):
        DecodeShape(2, 4, 2, 64, 32, page_size=24)


def test_bench_decode_flags(capsys, monkeypatch):
    assert cli.main(["bench", "--decode", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "8 decode shapes" in out and "S=32768" in out and "paged(64) fp8 cache" in out
    assert cli.main(["bench", "--decode", "--suite", "quick"]) == 2
    assert "its own suite" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--decode"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
