"""Shared fixtures. GPU tests (`-m gpu`) fail loudly without CUDA instead of skipping."""

import secrets

import pytest
import torch


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what it deselects
def pytest_collection_modifyitems(config, items):
    selected_gpu = [item for item in items if item.get_closest_marker("gpu")]
    if selected_gpu and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{len(selected_gpu)} GPU tests were selected (-m gpu) but CUDA is not available")


@pytest.fixture
def rng():
    """A fresh torch generator per test; the seed is printed on failure."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
