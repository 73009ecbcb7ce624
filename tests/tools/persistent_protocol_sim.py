"""Randomized simulation of fwd_gluon.fwd_ws_kernel's PERSISTENT barrier protocol, on the CPU.

A model of the kernel's waits and arrives (kept by hand in step with _producer / _attend /
_consumer): the producer and NUM_WG consumer warpgroups as coroutines, mbarriers with parity
waits, TMA loads landing at random later times, any interleaving. Covers a ring of 2-4
stages, 2-3 warpgroups, ping-pong turns, O staged in Q's buffer or its own (O_BUF), CTA
tiles of 1-8 key tiles. Checks: no deadlock, and every read sees the buffer version it
expects (nothing overwritten while in use).

    python tests/tools/persistent_protocol_sim.py   (3000 random cases; prints the failures)
"""

import random


class Bar:
    def __init__(self, count):
        self.count, self.pending, self.done = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.done += 1
            self.pending = self.count

    def ok(self, parity):  # try_wait.parity: the phase of this parity has completed
        return (self.done & 1) != parity


class Machine:
    """What the actors of one case share: TMA loads in flight, the errors seen, and the random
    interleaving (also used by tests/tools/bwd_persistent_protocol_sim.py)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.events = []  # TMA loads in flight: (barrier, buffer, index, what lands)
        self.errors = []

    def check(self, buf, i, tag, what):
        if buf[i] != tag:
            self.errors.append(f"{what}[{i}] holds {buf[i]}, expected {tag}")

    def load(self, bar, buf, i, tag):
        buf[i] = "writing"
        self.events.append((bar, buf, i, tag))

    def interleave(self, actors):
        """Run the actors (coroutines yielding ("wait", barrier, parity) or ("step",)) and the
        landing of the loads in a random order: the first error, a deadlock, or None."""
        blocked = dict.fromkeys(actors)
        steps = 0
        while actors:
            steps += 1
            runnable = [a for a in actors if blocked[a] is None or blocked[a][1].ok(blocked[a][2])]
            choices = runnable + (["event"] if self.events else [])
            if not choices:
                return f"DEADLOCK after {steps} steps, blocked: {sorted(blocked)}"
            c = self.rng.choice(choices)
            if c == "event":
                bar, buf, i, tag = self.events.pop(self.rng.randrange(len(self.events)))
                buf[i] = tag
                bar.arrive()
                continue
            try:
                op = next(actors[c])
                blocked[c] = op if op[0] == "wait" else None
            except StopIteration:
                del actors[c], blocked[c]
        return self.errors[0] if self.errors else None


def run(tiles, num_wg, stages, pingpong, o_buf, seed):
    machine = Machine(seed)
    check, load = machine.check, machine.load
    k_ready, v_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    k_empty, v_empty = [Bar(num_wg) for _ in range(stages)], [Bar(num_wg) for _ in range(stages)]
    q_bar, q_empty = [Bar(1) for _ in range(num_wg)], [Bar(1) for _ in range(num_wg)]
    turn = [Bar(1) for _ in range(num_wg)]
    turn[0].arrive()
    kbuf, vbuf, qbuf = [None] * stages, [None] * stages, [None] * num_wg

    def producer():
        it = 0
        for k, n in enumerate(tiles):
            def load_kv(j, g, k=k):
                st = g % stages
                yield ("wait", k_empty[st], ((g // stages) & 1) ^ 1)
                load(k_ready[st], kbuf, st, ("K", k, j))
                yield ("wait", v_empty[st], ((g // stages) & 1) ^ 1)
                load(v_ready[st], vbuf, st, ("V", k, j))
            yield from load_kv(0, it)
            for wg in range(num_wg):
                yield ("wait", q_empty[wg], (k & 1) ^ 1)
                load(q_bar[wg], qbuf, wg, ("Q", k, wg))
            for j in range(1, n):
                yield from load_kv(j, it + j)
            it += n

    def consumer(wg):
        it = 0
        for k, n in enumerate(tiles):
            q = ("Q", k, wg)
            yield ("wait", q_bar[wg], k & 1)
            first = it % stages
            yield ("wait", k_ready[first], (it // stages) & 1)
            if pingpong:
                yield ("wait", turn[wg], it & 1)
            check(kbuf, first, ("K", k, 0), "K")
            check(qbuf, wg, q, "Q")
            if pingpong:
                turn[(wg + 1) % num_wg].arrive()
            yield ("step",)
            check(kbuf, first, ("K", k, 0), "K")
            check(qbuf, wg, q, "Q")
            k_empty[first].arrive()
            for j in range(1, n):
                g = it + j
                st, prev = g % stages, (g - 1) % stages
                yield ("wait", k_ready[st], (g // stages) & 1)
                if pingpong:
                    yield ("wait", turn[wg], g & 1)
                check(kbuf, st, ("K", k, j), "K")
                yield ("wait", v_ready[prev], ((g - 1) // stages) & 1)
                check(vbuf, prev, ("V", k, j - 1), "V")
                if pingpong:
                    turn[(wg + 1) % num_wg].arrive()
                yield ("step",)
                check(kbuf, st, ("K", k, j), "K")
                check(qbuf, wg, q, "Q")
                k_empty[st].arrive()
                yield ("step",)
                check(vbuf, prev, ("V", k, j - 1), "V")
                v_empty[prev].arrive()
            if o_buf:  # RELEASE_Q
                q_empty[wg].arrive()
            g_last = it + n - 1
            last = g_last % stages
            yield ("wait", v_ready[last], (g_last // stages) & 1)
            check(vbuf, last, ("V", k, n - 1), "V")
            yield ("step",)
            check(vbuf, last, ("V", k, n - 1), "V")
            v_empty[last].arrive()  # RELEASE_V
            yield ("step",)  # epilogue
            if not o_buf:  # O staged in Q's buffer: store, store_wait, then Q is free
                check(qbuf, wg, q, "Q before O staging")
                qbuf[wg] = ("O", k, wg)
                yield ("step",)
                check(qbuf, wg, ("O", k, wg), "O staging")
                q_empty[wg].arrive()
            it += n

    return machine.interleave({"P": producer(), **{f"C{w}": consumer(w) for w in range(num_wg)}})


def main():
    bad = 0
    rng = random.Random(0)
    for trial in range(3000):
        case = dict(num_wg=rng.choice([2, 3]), stages=rng.choice([2, 3, 4]),
                    tiles=[rng.choice([1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 6))],
                    pingpong=rng.random() < 0.5, o_buf=rng.random() < 0.5)
        result = run(seed=trial, **case)
        if result:
            bad += 1
            if bad < 5:
                print("FAIL", case, result)
    print("trials 3000, failures", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
