"""Every examples/NN_name.py runs to the end on the CPU (Triton's interpreter).

The examples check their own results against the float64 reference and raise on a
failure, so running them is the test. They are found by file name, so examples added
later are picked up. They run in this process (runpy) to share the interpreter's warm-up;
one also runs as a standalone script in a subprocess, as a user would start it.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fmha

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("[0-9]*.py"))


def test_examples_are_found():
    assert len(SCRIPTS) >= 30, [p.name for p in SCRIPTS]


TIMEOUT_S = 300  # per example; they take seconds on an idle core


def _timed_out(signum, frame):
    raise TimeoutError(f"the example ran longer than {TIMEOUT_S} s")


@pytest.fixture
def example_env(monkeypatch):
    """Examples on the CPU (even where CUDA exists), fresh `_common`, a time limit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(sys.modules, "_common", raising=False)  # re-read DEVICE under the patch
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", ["example"])
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        fmha.set_dispatcher(None)  # an example that fails half-way must not leak its registry


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_example_runs_and_validates(script, example_env, capsys):
    torch.manual_seed(0)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "(device: cpu," in out, out[:500]
    assert out.splitlines()[-1].startswith("OK:"), out[-2000:]


def test_an_example_runs_as_a_standalone_script():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "01_basic.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("OK:")


def test_a_failing_check_exits_non_zero(tmp_path):
    script = tmp_path / "99_broken.py"
    script.write_text(
        "import torch\n"
        "from _common import check\n"
        "t = torch.zeros(4)\n"
        "check('o', t + 1.0, t.double(), t, torch.float16)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(EXAMPLES)])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "AssertionError" in proc.stderr
