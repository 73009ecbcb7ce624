"""Every example on the GPU, at its realistic sizes (`pytest -m gpu tests/test_gpu_examples.py`).

The examples run as separate processes, several at a time (Triton's compilation is
CPU-bound and the GPU has room for them): FMHA_EXAMPLES_JOBS (default 8). With
FMHA_EXAMPLES_OUT=DIR each example's output is written to DIR/NN_name.log, with a
summary.json of exit codes and times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "examples").glob("[0-9]*.py"))


def _run(script: Path) -> tuple[str, int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=float(os.environ.get("FMHA_EXAMPLES_TIMEOUT", 400)))
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, text = -1, f"timed out after {e.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    seconds = time.perf_counter() - start
    out = os.environ.get("FMHA_EXAMPLES_OUT")
    if out:  # as each example ends, so that a run cut short still leaves its results
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{script.stem}.log").write_text(f"exit {code} in {seconds:.0f} s\n{text}")
    return script.stem, code, seconds, text


def test_every_example_passes_on_the_gpu():
    import torch
    assert torch.cuda.is_available()
    jobs = int(os.environ.get("FMHA_EXAMPLES_JOBS", 8))
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(_run, SCRIPTS))
    out = os.environ.get("FMHA_EXAMPLES_OUT")
    if out:
        (Path(out) / "summary.json").write_text(json.dumps(
            {name: {"exit_code": code, "seconds": round(sec, 1)} for name, code, sec, _ in results}, indent=2))
    for name, code, sec, _ in results:
        print(f"{name}: exit {code} in {sec:.0f} s")
    failed = [(name, text[-3000:]) for name, code, _, text in results if code != 0]
    assert not failed, "\n\n".join(f"== {name}\n{text}" for name, text in failed)
