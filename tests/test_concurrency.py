"""Thread safety: the dispatcher, the registry and the interpreter path (CPU tensors).

The interpreter test runs in a subprocess: a race in Triton's interpreter can corrupt
program ids and read out of bounds, and a crash must fail this test, not the test worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fmha
from fmha import Family, Problem, Registry, default_registry
from fmha.problem import DType

N_THREADS = 8
ROOT = Path(__file__).resolve().parents[1]


def _run_together(fn, args):
    """Call fn(arg) for every arg, all threads released at once by a barrier."""
    barrier = threading.Barrier(len(args))

    def task(arg):
        barrier.wait()
        return fn(arg)

    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(task, args))


# ----------------------------------------------------------------------------------------
# Registry and dispatcher (pure Python)


def test_registry_json_round_trip_concurrently():
    text = default_registry().to_json()
    expected = [c.to_dict() for c in default_registry()]

    def round_trip(i):
        out = []
        for _ in range(20):
            registry = Registry.from_json(text)
            again = registry.to_json()
            out.append((again, [c.to_dict() for c in registry], len(registry), registry.name))
        return out

    for results in _run_together(round_trip, list(range(N_THREADS))):
        for again, configs, n, name in results:
            assert again == text
            assert configs == expected and n == len(expected) and name == "default"


def test_registry_round_trips_of_different_registries_do_not_mix():
    full = default_registry()
    subsets = [full.filter(family=f) for f in Family] + [full.filter(dtype=DType.FP32),
                                                        full.filter(arch="cpu")]
    texts = [r.to_json() for r in subsets]

    def round_trip(i):
        return [Registry.from_json(texts[i]).to_json() for _ in range(20)]

    for i, results in enumerate(_run_together(round_trip, list(range(len(subsets))))):
        assert all(t == texts[i] for t in results)


def _problems():
    out = []
    for i in range(N_THREADS * 4):
        out.append(Problem(batch=1 + i % 2, nhead_q=4, nhead_k=1 + i % 2 * 3, seqlen_q=17 + i,
                           seqlen_k=9 + 3 * i, head_dim_qk=(16, 64, 128, 200)[i % 4],
                           head_dim_v=(16, 64, 128, 200)[i % 4],
                           dtype=(DType.FP16, DType.BF16, DType.FP32)[i % 3],
                           arch=("cpu", "sm90", "sm80")[i % 3], causal=i % 2 == 0,
                           bias=i % 5 == 0, dropout_p=0.1 if i % 7 == 0 else 0.0,
                           deterministic=i % 4 == 0))
    return out


@pytest.mark.parametrize("fresh", [False, True], ids=["shared", "fresh-dispatchers"])
def test_plan_forward_and_backward_from_many_threads_are_equal(fresh):
    problems = _problems()
    serial_fwd = [fmha.get_dispatcher().plan_forward(p, return_dropout_mask=p.dropout_p > 0)
                  for p in problems]
    serial_bwd = [fmha.get_dispatcher().plan_backward(p) for p in problems]

    def plan_all(i):
        dispatcher = fmha.Dispatcher() if fresh else fmha.get_dispatcher()
        order = problems[i:] + problems[:i]  # each thread walks the problems from elsewhere
        fwd = {p: dispatcher.plan_forward(p, return_dropout_mask=p.dropout_p > 0) for p in order}
        bwd = {p: dispatcher.plan_backward(p) for p in order}
        return [fwd[p] for p in problems], [bwd[p] for p in problems]

    for fwd, bwd in _run_together(plan_all, list(range(N_THREADS))):
        assert fwd == serial_fwd
        assert bwd == serial_bwd


def test_explain_from_many_threads_is_identical():
    problems = _problems()[:8]
    serial = [fmha.get_dispatcher().explain(p, Family.FWD) for p in problems]
    results = _run_together(lambda i: [fmha.get_dispatcher().explain(p, Family.FWD) for p in problems],
                            list(range(N_THREADS)))
    assert all(r == serial for r in results)


# ----------------------------------------------------------------------------------------
# The interpreter path: fmha.attention on CPU tensors from several threads

_THREADED_ATTENTION = textwrap.dedent("""
    import json, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    import fmha

    sys.setswitchinterval(1e-5)  # switch threads often, as a loaded machine would
    g = torch.Generator().manual_seed(0)
    problems = []
    for i in range(4):  # different shapes, dtypes and features per thread
        dtype = (torch.float16, torch.float32)[i % 2]
        q = torch.randn(1 + i % 2, 2, 20 + 5 * i, 16, generator=g).to(dtype)
        k = torch.randn(1 + i % 2, 1 + i % 2, 17 + 4 * i, 16, generator=g).to(dtype)
        v = torch.randn(1 + i % 2, 1 + i % 2, 17 + 4 * i, 16, generator=g).to(dtype)
        problems.append((q, k, v, dict(causal=i % 2 == 0, window=(-1, -1) if i < 2 else (5, 0 if i % 2 == 0 else 3))))
    serial = [fmha.attention(q, k, v, return_lse=True, **kw) for q, k, v, kw in problems]

    def run(i):
        barrier.wait()
        q, k, v, kw = problems[i]
        try:
            return fmha.attention(q, k, v, return_lse=True, **kw)
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[-1][:160]}"

    report = []
    for trial in range(3):
        barrier = threading.Barrier(4)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, range(4)))
        for i, (want, got) in enumerate(zip(serial, results)):
            if isinstance(got, str):
                report.append(f"trial {trial} thread {i}: raised {got}")
            elif not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                report.append(f"trial {trial} thread {i}: result differs from the serial run")
    print("REPORT " + json.dumps(report))
""")


def test_attention_from_threads_equals_serial():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _THREADED_ATTENTION], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, (
        f"the threaded run died (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    problems = json.loads(line[len("REPORT "):])
    assert not problems, "concurrent fmha.attention calls on CPU tensors:\n" + "\n".join(problems)


def test_attention_from_threads_serialized_by_the_caller_equals_serial():
    """With the caller holding a lock, threads get the serial results (the harness works)."""
    import torch

    g = torch.Generator().manual_seed(1)
    problems = [tuple(torch.randn(1, 2, 9 + 3 * i, 16, generator=g) for _ in range(3)) for i in range(4)]
    serial = [fmha.attention(*p, causal=True) for p in problems]
    lock = threading.Lock()

    def run(i):
        with lock:
            return fmha.attention(*problems[i], causal=True)

    results = _run_together(run, list(range(4)))
    assert all(torch.equal(a, b) for a, b in zip(serial, results, strict=True))
