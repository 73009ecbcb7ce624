"""Randomized simulation of bwd_gluon.bwd_dkdv_ws_kernel's PERSISTENT barrier protocol, on the CPU.

A model of the kernel's waits and arrives, kept by hand in step with `_ws_loader_persistent`,
`_ws_compute_persistent` (+ `_ws_compute_tile`) and `_ws_dq_writer_persistent`: the loader, the
compute warps (2-4 of them: CTA barriers among them, arrives by one) and the dQ writer as
coroutines, mbarriers with parity waits, TMA loads landing at random later times, any
interleaving. Covers rings of 2-3 stages, 1-2 dQ hand-over buffers or (alias, D=256:
`_ws_compute_d256_tile`, `_ws_dq_writer_alias_tile`) dQ staged in the consumed Q/dO stage,
which the writer releases; key tiles of 0-7 query iterations (0: a key tile without queries
under causal). Checks: no deadlock, and every read sees the buffer version it expects (K/V of
its tile, Q/dO of its iteration, dQ of its iteration: nothing overwritten while in use).

    python tests/tools/bwd_persistent_protocol_sim.py [--no-kv-barrier]   (3000 random cases)

--no-kv-barrier: leave out the compute warps' CTA barrier before the kv_empty arrive (the
kernel has it): after a tile without iterations a warp may find kv_bar two phases on.
"""

import random
import sys

from persistent_protocol_sim import Bar, Machine  # (this folder: the forward's simulation)


def run(tiles, warps, stages, dq_bufs, alias, kv_barrier, seed):
    machine = Machine(seed)
    check, load = machine.check, machine.load
    kv_bar, kv_empty = Bar(1), Bar(1)
    ready, empty = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    dq_full, dq_empty = [Bar(1) for _ in range(dq_bufs)], [Bar(1) for _ in range(dq_bufs)]
    if alias:  # one dq_full per stage
        dq_full = [Bar(1) for _ in range(stages)]
    cta = Bar(warps)  # gl.thread_barrier of the compute partition
    kv, ring, dq = [None], [None] * stages, [None] * dq_bufs

    def loader():
        it = 0
        for k, n in enumerate(tiles):
            early = min(n, stages) if k > 0 else 0

            def stage_load(j, k=k, it=it):
                g = it + j
                yield ("wait", empty[g % stages], ((g // stages) & 1) ^ 1)
                load(ready[g % stages], ring, g % stages, ("QdO", k, j))
            for j in range(early):
                yield from stage_load(j)
            yield ("wait", kv_empty, (k & 1) ^ 1)
            load(kv_bar, kv, 0, ("KV", k))
            for j in range(early, n):
                yield from stage_load(j)
            it += n

    def compute(w):
        it, syncs = 0, 0

        def sync():
            nonlocal syncs
            cta.arrive()
            yield ("wait", cta, syncs & 1)
            syncs += 1
        for k, n in enumerate(tiles):
            yield ("wait", kv_bar, k & 1)
            for j in range(n):
                g = it + j
                s, b = g % stages, g % dq_bufs
                yield ("wait", ready[s], (g // stages) & 1)
                check(kv, 0, ("KV", k), "K/V")
                check(ring, s, ("QdO", k, j), "Q/dO")
                yield ("step",)  # S^T, dP^T, softmax, dV/dK issued, dS^T stored
                yield from sync()
                yield ("step",)  # dQ = dS K issued; dV, dK, dQ waited
                check(kv, 0, ("KV", k), "K (dQ product)")
                check(ring, s, ("QdO", k, j), "Q/dO (dK/dV products)")
                if alias:
                    yield from sync()  # every warp's dK/dV products (the Q and dO readers) are done
                if alias:  # dQ's halves over the stage's Q and dO (no warp reads them any more)
                    if w == 0:
                        ring[s] = ("dQ", k, j)
                    yield ("step",)
                    yield from sync()
                    if w == 0:
                        dq_full[s].arrive()  # the writer releases the stage
                    continue
                yield ("wait", dq_empty[b], ((g // dq_bufs) & 1) ^ 1)
                if w == 0:
                    dq[b] = ("dQ", k, j)
                yield ("step",)
                yield from sync()
                if w == 0:
                    dq_full[b].arrive()
                    empty[s].arrive()
            if kv_barrier:
                yield from sync()
            if w == 0:
                kv_empty.arrive()
            yield ("step",)  # dK, dV stores (registers to global)
            it += n

    def writer():
        it = 0
        for k, n in enumerate(tiles):
            for j in range(n):
                g = it + j
                if alias:
                    s = g % stages
                    yield ("wait", dq_full[s], (g // stages) & 1)
                    check(ring, s, ("dQ", k, j), "dQ in the stage")
                    yield ("step",)  # two TMA reduce-adds, store_wait
                    check(ring, s, ("dQ", k, j), "dQ in the stage")
                    empty[s].arrive()
                    continue
                b = g % dq_bufs
                yield ("wait", dq_full[b], (g // dq_bufs) & 1)
                check(dq, b, ("dQ", k, j), "dQ")
                yield ("step",)  # TMA reduce-add, store_wait
                check(dq, b, ("dQ", k, j), "dQ")
                dq_empty[b].arrive()
            it += n

    return machine.interleave({"L": loader(), "W": writer(), **{f"C{w}": compute(w) for w in range(warps)}})


def main():
    kv_barrier = "--no-kv-barrier" not in sys.argv
    bad = 0
    rng = random.Random(0)
    trials = 3000
    for trial in range(trials):
        case = dict(warps=rng.choice([2, 3, 4]), stages=rng.choice([2, 3]), dq_bufs=rng.choice([1, 2]),
                    alias=rng.random() < 0.33,
                    tiles=[rng.choice([0, 0, 1, 2, 3, 5, 7]) for _ in range(rng.randint(1, 8))])
        result = run(seed=trial, kv_barrier=kv_barrier, **case)
        if result:
            bad += 1
            if bad < 5:
                print("FAIL", case, result)
    print(f"trials {trials}, failures {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
