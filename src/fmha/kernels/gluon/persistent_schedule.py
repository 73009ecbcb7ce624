"""Which causal tile order a persistent Gluon kernel runs (TILE_ORDER), from a model of its
static schedule.

Program p of P runs the tiles t(k) = k * P + slot(k), slot(k) = p in even rounds and P - 1 - p
in odd ones (a snake: fwd_gluon._my_tile / bwd_gluon._my_key_tile), so the order of the tiles
decides each program's share of the work. Under a causal mask tile i of a head (its row tile
in the forward, key tile in the backward, longest first) costs ~(n - i) blocks of n:

- heads outermost (TILE_ORDER 1) keeps a head's tiles on the machine together (its K/V, or Q
  and dO, stay in L2: 2-10% faster where it balances), but its balance depends on n against P.
  B=1 H=16 S=16384 (n = 128, P = 132): the programs holding a head's first tiles of
  every round get ~1.5x the mean work, and the D=64 backward ran at 0.71x cuDNN (4.50 ms
  against 3.09 with pairs, H200 2026-11-30); tools/persistent_schedule_sim.py.
- pairs (TILE_ORDER 2) hands out units of a head's i-th longest and i-th shortest tile,
  equal work each, so it balances at any n.

`causal_tile_order` keeps heads where its modelled makespan is within `SLACK` of pairs'.
"""

from __future__ import annotations

import functools

import numpy as np

HEADS, PAIRS = 1, 2
OVERHEAD = 0.3  # per tile, in blocks: prologue/epilogue the next tile's loads mostly hide
SLACK = 1.02  # heads' locality gain at the shapes where both balance (attempts 41, 43)


def _snake(num_units: int, programs: int) -> np.ndarray:
    """(rounds, programs) unit positions of the snake round robin; -1 past the end."""
    rounds = -(-num_units // programs)
    k = np.arange(rounds)[:, None]
    p = np.arange(programs)[None, :]
    u = k * programs + np.where(k % 2 == 0, p, programs - 1 - p)
    return np.where(u < num_units, u, -1)


def _cost(longest_first_index: np.ndarray, n: int) -> np.ndarray:
    return n - longest_first_index + OVERHEAD


def heads_makespan(num_bh: int, n: int, programs: int) -> float:
    """Largest program's work (blocks) under TILE_ORDER 1: tile t is a head's (t % n)-th longest."""
    t = _snake(num_bh * n, programs)
    return float(np.where(t >= 0, _cost(t % n, n), 0.0).sum(axis=0).max())


def pairs_makespan(num_bh: int, n: int, programs: int) -> float:
    """Largest program's work under TILE_ORDER 2 (fwd_gluon._pair_tile): a unit is a head's
    r-th longest and r-th shortest tile, blocks of two heads giving n units; odd n: the two
    heads' middle tiles form the block's last unit."""
    num_tiles = num_bh * n
    u = _snake(-(-num_tiles // 2), programs)
    block, r = u // n, u % n
    half = n // 2
    heads_in_block = np.minimum(2, num_bh - 2 * block)
    # a unit's two tiles: r < half (and, with a second head, half <= r < 2 half): n + 1 blocks;
    # the middle unit: two middle tiles, or one when the block has one head (odd num_tiles)
    pair = (r < half) | ((heads_in_block == 2) & (r < 2 * half))
    middle = n - half  # the middle tile's cost
    work = np.where(pair, n + 1 + 2 * OVERHEAD, heads_in_block * (middle + OVERHEAD))
    return float(np.where(u >= 0, work, 0.0).sum(axis=0).max())


@functools.lru_cache(maxsize=4096)
def causal_tile_order(preferred: int, num_bh: int, tiles_per_head: int, programs: int) -> int:
    """The TILE_ORDER a persistent causal launch runs: `preferred` (the kernel shape's), unless
    it is heads outermost and that order's static schedule leaves the programs' work
    unbalanced (its makespan more than SLACK times pairs'): then pairs."""
    if preferred != HEADS:
        return preferred
    heads = heads_makespan(num_bh, tiles_per_head, programs)
    return HEADS if heads <= SLACK * pairs_makespan(num_bh, tiles_per_head, programs) else PAIRS
