"""CPU simulation of the persistent Gluon forward's causal tile orders (fwd_gluon.TILE_ORDERS)
against the one-tile-per-program grid: makespan (load balance) and the number of distinct K/V
heads in flight at once (an L2 proxy: each one streams its own K and V).

Model: a CTA tile of row tile m costs its key tiles (causal, Sq = Sk, 128-row tiles: m + 1
tiles of 128 keys) plus a fixed overhead per tile (prologue/epilogue; `--overhead`, default
1.0 for the one-tile grid, 0.3 for the persistent kernel, which overlaps the next tile's loads
with this one's last products). The one-tile grid: the hardware hands out programs in grid
order to whichever SM frees first (greedy list scheduling, heads outermost, the longest row
tile of each head first). The persistent kernel: program p of P runs its static sequence
t(k) = k * P + slot(k) (the snake, `_my_tile`) back to back, in one of the orders:

  lpt     TILE_ORDER=0 (main): the longest row tiles of all heads first, heads innermost
  heads   TILE_ORDER=1: heads outermost, longest row tile first (the one-tile grid's order)
  pairs   TILE_ORDER=2: units of two tiles of equal total cost, handed out by the snake one
          unit (two consecutive k) at a time: the longest and the shortest row tile of a head,
          then the second longest and second shortest, ...; heads outermost in blocks of two
          heads, whose middle row tiles (odd num_m) form one more unit (both half length)
  group   (not in the kernel, for contrast) heads in groups of G = max(1, P // num_m), LPT inside
          each group: the group boundaries drift against the rounds and break the snake's pairing

    python tests/tools/persistent_schedule_sim.py [--programs 132] [--overhead-grid 1.0] [--overhead-persist 0.3]
    python tests/tools/persistent_schedule_sim.py --check   (the kernel's closed forms against enumeration)

Heads in flight: distinct (batch, head) among the running tiles, time-weighted mean and max;
KV MB: that mean times one head's K and V (bf16, D=128) against H200's 50 MB L2.
"""

import heapq
import sys

SHAPES = [(16, 16, 1024), (4, 16, 4096), (2, 16, 8192), (4, 16, 8192), (1, 16, 16384)]
BLOCK_M = 128


def tile_of(order: str, t: int, num_bh: int, num_m: int, nprog: int) -> tuple[int, int]:
    """(bh, pid_m) of tile index t in `order` (as fwd_gluon._my_tile computes it)."""
    if order == "lpt":
        return t % num_bh, num_m - 1 - t // num_bh
    if order == "heads":
        return t // num_m, num_m - 1 - t % num_m
    if order == "pairs":
        return pair_tile(t, num_bh, num_m)
    if order == "group":
        g = max(nprog // num_m, 1)
        per_group = g * num_m
        first = t // per_group * g
        local = t % per_group
        width = min(g, num_bh - first)  # the last group may hold fewer heads
        return first + local % width, num_m - 1 - local // width
    raise ValueError(order)


def pair_tile(t: int, num_bh: int, num_m: int) -> tuple[int, int]:
    """(bh, pid_m) of position t of the pairs order (fwd_gluon._pair_tile)."""
    u, second = t // 2, t % 2
    half = num_m // 2
    block, r = u // num_m, u % num_m
    bh = 2 * block
    two = bh + 1 < num_bh
    if r < half:
        return bh, r if second else num_m - 1 - r
    if two and r < 2 * half:
        return bh + 1, r - half if second else num_m - 1 - (r - half)
    return bh + second, half  # the middle row tiles of the block's heads (odd num_m)


def slots(num_tiles: int, nprog: int, unit: int = 1) -> list[list[int]]:
    """Each program's tile positions: the snake round robin of _my_tile / _my_tile_count over
    units of `unit` consecutive positions (2: the pairs order)."""
    out = [[] for _ in range(nprog)]
    k = 0
    units = -(-num_tiles // unit)
    while k * nprog < units:
        for p in range(nprog):
            u = k * nprog + (p if k % 2 == 0 else nprog - 1 - p)
            out[p] += [t for t in range(u * unit, (u + 1) * unit) if t < num_tiles] if u < units else []
        k += 1
    return out


def kernel_count(num_tiles: int, nprog: int, pid: int, pairs: bool) -> int:
    """fwd_gluon._my_tile_count, transcribed (Python's // and % agree with the kernel's on >= 0)."""
    if pairs:
        num_units = -(-num_tiles // 2)
        last = -(-num_units // nprog) - 1
        slot = pid + (last & 1) * (nprog - 1 - 2 * pid)
        mine = last + int(slot < num_units - last * nprog)
        return 2 * mine - (num_tiles & 1) * int(slot == num_units - 1 - last * nprog)
    last = -(-num_tiles // nprog) - 1
    slot = pid + (last & 1) * (nprog - 1 - 2 * pid)
    return last + int(slot < num_tiles - last * nprog)


def kernel_position(k: int, nprog: int, pid: int, pairs: bool) -> int:
    """The tile position fwd_gluon._my_tile gives the program's k-th tile."""
    if pairs:
        j = k // 2
        return 2 * (j * nprog + pid + (j & 1) * (nprog - 1 - 2 * pid)) + (k & 1)
    return k * nprog + pid + (k & 1) * (nprog - 1 - 2 * pid)


def check() -> int:
    """Every order is a permutation of the tiles and the kernel's count/position formulas walk
    exactly the snake's sequence, for 1-9 heads, 1-9 row tiles, 1-7 programs (and 132)."""
    bad = 0
    for num_bh in range(1, 10):
        for num_m in range(1, 10):
            tiles = num_bh * num_m
            for order in ("lpt", "heads", "pairs"):
                got = sorted(tile_of(order, t, num_bh, num_m, 5) for t in range(tiles))
                bad += got != sorted((b, m) for b in range(num_bh) for m in range(num_m))
            for nprog in (*range(1, 8), 132):
                for pairs in (False, True):
                    want = slots(tiles, nprog, 2 if pairs else 1)
                    for pid in range(nprog):
                        seq = [kernel_position(k, nprog, pid, pairs)
                               for k in range(kernel_count(tiles, nprog, pid, pairs))]
                        if seq != want[pid]:
                            bad += 1
                            print("mismatch", num_bh, num_m, nprog, pid, pairs, seq, want[pid])
    print("check:", "ok" if not bad else f"{bad} failures")
    return int(bad > 0)


def in_flight(intervals: list[tuple[float, float, int]]) -> tuple[float, int]:
    """Time-weighted mean and max of distinct heads among running intervals (start, end, head)."""
    events = sorted([(s, 1, h) for s, e, h in intervals] + [(e, -1, h) for s, e, h in intervals],
                    key=lambda x: (x[0], x[1]))
    count, heads, area, last, peak = {}, 0, 0.0, 0.0, 0
    for time, kind, h in events:
        area += heads * (time - last)
        last = time
        if kind == 1:
            count[h] = count.get(h, 0) + 1
            heads += count[h] == 1
        else:
            count[h] -= 1
            heads -= count[h] == 0
        peak = max(peak, heads)
    return area / last, peak


def simulate(batch, heads, seqlen, nprog, overhead_grid, overhead_persist):
    num_m = -(-seqlen // BLOCK_M)
    num_bh = batch * heads
    num_tiles = num_m * num_bh

    def cost(pid_m, overhead):
        return pid_m + 1 + overhead

    rows = {}
    # one-tile grid: greedy in grid order (pid // num_m = bh, longest row tile first)
    free = [(0.0, p) for p in range(min(nprog, num_tiles))]
    heapq.heapify(free)
    intervals = []
    for pid in range(num_tiles):
        bh, pid_m = pid // num_m, num_m - 1 - pid % num_m
        start, p = heapq.heappop(free)
        end = start + cost(pid_m, overhead_grid)
        intervals.append((start, end, bh))
        heapq.heappush(free, (end, p))
    rows["grid"] = (max(e for _, e, _ in intervals), *in_flight(intervals))
    for order in ("lpt", "heads", "pairs", "group"):
        intervals, finish = [], []
        for seq in slots(num_tiles, nprog, 2 if order == "pairs" else 1):
            time = 0.0
            for t in seq:
                bh, pid_m = tile_of(order, t, num_bh, num_m, nprog)
                end = time + cost(pid_m, overhead_persist)
                intervals.append((time, end, bh))
                time = end
            finish.append(time)
        rows[order] = (max(finish), *in_flight(intervals))
    bound = sum(cost(m, overhead_persist) for m in range(num_m)) * num_bh / nprog
    return rows, bound


def main() -> int:
    if "--check" in sys.argv:
        return check()
    nprog = int(sys.argv[sys.argv.index("--programs") + 1]) if "--programs" in sys.argv else 132
    og = float(sys.argv[sys.argv.index("--overhead-grid") + 1]) if "--overhead-grid" in sys.argv else 1.0
    op = float(sys.argv[sys.argv.index("--overhead-persist") + 1]) if "--overhead-persist" in sys.argv else 0.3
    head_mb = None
    print(f"P={nprog} programs, overhead per tile: grid {og}, persistent {op} (units: one 128x128 key tile)")
    print(f"{'shape':<22} {'order':<6} {'makespan':>9} {'/bound':>7} {'/grid':>6} {'heads mean':>10} "
          f"{'max':>4} {'KV MB':>7}")
    for batch, heads, seqlen in SHAPES:
        rows, bound = simulate(batch, heads, seqlen, nprog, og, op)
        head_mb = 2 * seqlen * 128 * 2 / 2**20
        for order, (span, mean, peak) in rows.items():
            print(f"B={batch} H={heads} S={seqlen:<6} {order:<6} {span:9.1f} {span / bound:7.3f} "
                  f"{span / rows['grid'][0]:6.3f} {mean:10.1f} {peak:4d} {mean * head_mb:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
