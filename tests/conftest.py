"""Shared fixtures. GPU tests (`-m gpu`, `-m gpu2`) fail loudly without the GPUs instead of skipping."""

import os
import secrets

import pytest
import torch


def pytest_configure(config):
    """With FMHA_TEST_SPREAD_GPUS=1, pytest-xdist workers take turns over the visible GPUs
    (device "cuda" is the current device), so a multi-GPU host runs `-m gpu` in parallel."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("FMHA_TEST_SPREAD_GPUS") == "1" and worker.startswith("gw") and torch.cuda.is_available():
        torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what it deselects
def pytest_collection_modifyitems(config, items):
    selected_gpu = [item for item in items if item.get_closest_marker("gpu")]
    if selected_gpu and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{len(selected_gpu)} GPU tests were selected (-m gpu) but CUDA is not available")
    selected_gpu2 = [item for item in items if item.get_closest_marker("gpu2")]
    if selected_gpu2 and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise pytest.UsageError(
            f"{len(selected_gpu2)} two-GPU tests were selected (-m gpu2) but {count} CUDA GPUs are visible")


@pytest.fixture
def rng():
    """A fresh torch generator per test; the seed is printed on failure."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Every test starts and ends without launcher plans (kernels/launch_cache.py): their keys
    hold the launchers' arguments, not module state a test may monkeypatch (tile shapes, SM
    counts, default tile orders)."""
    from fmha.kernels.launch import cache as launch_cache

    launch_cache.clear_plans()
    yield
    launch_cache.clear_plans()
