"""kernels/persistent_schedule: the persistent kernels' causal tile order. The makespan model
must be the kernels' static schedule (checked against tests/tools/persistent_schedule_sim.py's
enumeration of `_my_tile`'s positions), and the launchers must run pairs where heads outermost
would leave programs idle (B=1 H=16 S=16384: the D=64 backward ran at 0.71x cuDNN)."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from fmha.kernels.gluon import bwd as bwd_gluon
from fmha.kernels.gluon import fwd as fwd_gluon
from fmha.kernels.gluon.persistent_schedule import (
    HEADS,
    OVERHEAD,
    PAIRS,
    causal_tile_order,
    heads_makespan,
    pairs_makespan,
)
from fmha.kernels.launch import cache as launch_cache


def _sim():
    path = Path(__file__).parent / "tools" / "persistent_schedule_sim.py"
    spec = importlib.util.spec_from_file_location("persistent_schedule_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_makespans_match_the_enumerated_schedule():
    """Both closed forms against the per-tile walk of the kernels' snake (the simulation's
    transcription, which `--check` holds to the kernels' own count and position formulas)."""
    sim = _sim()
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    for _ in range(150):
        n, num_bh, programs = rng.randint(1, 70), rng.randint(1, 40), rng.choice([1, 2, 3, 5, 7, 16, 132])
        for order, model in (("heads", heads_makespan), ("pairs", pairs_makespan)):
            work = [sum(sim.tile_of(order, t, num_bh, n, programs)[1] + 1 + OVERHEAD for t in seq)
                    for seq in sim.slots(n * num_bh, programs, 2 if order == "pairs" else 1)]
            assert model(num_bh, n, programs) == pytest.approx(max(work)), (seed, order, n, num_bh, programs)


@pytest.mark.parametrize("num_bh, tiles, order", [
    (256, 8, HEADS),  # B=16 H=16 S=1024: both balance, heads keeps its locality
    (64, 32, HEADS),  # B=4 H=16 S=4096
    (32, 64, HEADS),  # B=2 H=16 S=8192
    (16, 128, PAIRS),  # B=1 H=16 S=16384: heads 1.49x pairs' makespan
    (8, 32, PAIRS),  # B=1 H=8 S=4096: 1.71x
    (96, 5, PAIRS),  # B=6 H=16 S=640 (the forward's D=128 short rule): 1.30x
    (3, 7, HEADS),  # fewer tiles than programs: one each
])
def test_heads_outermost_only_where_it_balances(num_bh, tiles, order):
    assert causal_tile_order(HEADS, num_bh, tiles, 132) == order
    assert causal_tile_order(PAIRS, num_bh, tiles, 132) == PAIRS  # only heads is second-guessed
    assert causal_tile_order(0, num_bh, tiles, 132) == 0


def _tile_orders(monkeypatch, module):
    seen = []
    monkeypatch.setattr(launch_cache, "launch", lambda kernel, grid, *a, **k: seen.append(k["TILE_ORDER"]))
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (CPU tensors name no device)
    return seen


@pytest.mark.parametrize("batch, heads, seqlen, order", [(16, 16, 1024, HEADS), (1, 16, 16384, PAIRS)])
def test_persistent_dkdv_launch_runs_the_balanced_order(monkeypatch, batch, heads, seqlen, order):
    """launch_dkdv (D=64, whose SHAPES prefer heads) on CPU tensors, up to its kernel call."""
    seen = _tile_orders(monkeypatch, bwd_gluon)
    q, k, v, do = (torch.empty(batch, heads, seqlen, 64, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = torch.empty(batch, heads, seqlen), torch.empty(batch, heads, seqlen)
    for causal in (True, False):
        bwd_gluon.launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v),
                              torch.empty(batch, heads, seqlen, 64), causal=causal, align_bottom_right=False,
                              scale=0.125, block_m=128, block_n=128, num_stages=2, warp_specialized=True,
                              persistent=True)
    assert bwd_gluon.preferred_tile_order(64) == HEADS
    assert seen == [order, 0]


@pytest.mark.parametrize("batch, heads, seqlen, order", [(16, 16, 1024, HEADS), (6, 16, 640, PAIRS),
                                                         (1, 16, 16384, PAIRS)])
def test_persistent_forward_launch_runs_the_balanced_order(monkeypatch, batch, heads, seqlen, order):
    """fwd_gluon.launch at D=128 (heads preferred up to 8 row tiles) on CPU tensors; an
    explicit tile_order is run as given."""
    seen = _tile_orders(monkeypatch, fwd_gluon)
    q, k, v, o = (torch.empty(batch, heads, seqlen, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(batch, heads, seqlen)
    for tile_order in (None, HEADS):
        fwd_gluon.launch(q, k, v, o, lse, causal=True, align_bottom_right=True, scale=0.1, block_m=128,
                         block_n=128, num_stages=2, persistent=True, tile_order=tile_order)
    assert seen == [order, HEADS]
