"""Where a kernel's warps spend their time, from the per-instruction warp-stall samples of ncu's source page.

Collect (on the GPU machine; `tools/profile_one.py` is one such program):

    ncu --clock-control none -k regex:KERNEL --launch-skip 1 --launch-count 1 --section WarpStateStats \
        --section SourceCounters -o R python PROGRAM
    ncu -i R.ncu-rep --page source --csv --print-source sass > R_sass.csv      (gzip it if you keep it)

Then, anywhere:

    python tests/tools/ncu_source_report.py R_sass.csv[.gz] [--range LO HI] [--listing] [--min-samples N]

Prints the code regions (runs of instructions executed the same number of times: a loop body, a
prologue; instructions never executed, such as a branch not taken inside a loop, do not end a
region) with their shares of all samples; then, for one region, the samples by opcode
(instructions of each opcode, their share of the region's samples) and the stall reasons' shares.
The region: --range LO HI (hex offsets from the kernel's first instruction), else the most sampled
region that issues warpgroup products (GMMA: a consumer's key loop). --listing: the region's
instructions with at least --min-samples samples (default 250), or that synchronize (barriers,
mbarrier waits and arrives, fences, wgmma fences and waits), with their two main stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter
from dataclasses import dataclass, field

SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"
SYNC_OPS = ("BAR", "SYNCS", "FENCE", "MEMBAR", "WARPGROUP", "DEPBAR")


@dataclass
class Instruction:
    offset: int
    source: str
    samples: int
    executed: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        """The opcode without its predicate and modifiers (`@!P1 SYNCS.ARRIVE.TRANS64 ...` -> SYNCS)."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else ""


@dataclass
class Region:
    executed: int
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    @property
    def span(self) -> str:
        return f"{self.instructions[0].offset:05x}-{self.instructions[-1].offset:05x}"


def read(path: str) -> list[Instruction]:
    """The instructions of the first kernel in ncu's source-page CSV (offsets from its first)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    out: list[Instruction] = []
    for row in rows[start + 1:]:
        if not row or not row[0].startswith("0x"):
            break  # (the next kernel's block, if any)
        out.append(Instruction(int(row[0], 16), row[1].strip(), int(row[col[SAMPLES]] or 0),
                               int(row[col[EXECUTED]] or 0),
                               {name[len("stall_"):]: int(row[col[name]] or 0) for name in stall_cols}))
    base = out[0].offset if out else 0
    for ins in out:
        ins.offset -= base
    return out


def regions(instructions: list[Instruction]) -> list[Region]:
    """Runs of instructions with the same executed count; unexecuted ones join the current run."""
    out: list[Region] = []
    for ins in instructions:
        if ins.executed == 0 and out:
            out[-1].instructions.append(ins)
        elif out and out[-1].executed == ins.executed:
            out[-1].instructions.append(ins)
        else:
            out.append(Region(ins.executed, [ins]))
    return out


def hottest_product_loop(found: list[Region]) -> Region | None:
    """The most sampled region that issues warpgroup products (HGMMA / QGMMA)."""
    loops = [r for r in found if any("GMMA" in i.opcode for i in r.instructions)]
    return max(loops, key=lambda r: r.samples, default=None)


def opcode_shares(region: Region) -> list[tuple[str, int, float]]:
    """(opcode, executed instructions of it in the region, share of the region's samples), most sampled first."""
    samples, count = Counter(), Counter()
    for ins in region.instructions:
        if ins.executed:
            samples[ins.opcode] += ins.samples
            count[ins.opcode] += 1
    total = max(1, sum(samples.values()))
    return [(op, count[op], s / total) for op, s in samples.most_common()]


def stall_shares(region: Region) -> list[tuple[str, float]]:
    total = Counter()
    for ins in region.instructions:
        total.update(ins.stalls)
    whole = max(1, region.samples)
    return [(name, n / whole) for name, n in total.most_common() if n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--range", nargs=2, metavar=("LO", "HI"), help="hex offsets of the region to detail")
    parser.add_argument("--listing", action="store_true")
    parser.add_argument("--min-samples", type=int, default=250)
    args = parser.parse_args(argv)
    instructions = read(args.csv)
    found = regions(instructions)
    total = max(1, sum(i.samples for i in instructions))
    print(f"{len(instructions)} instructions, {total} samples; regions with >= 0.5% of them:")
    for r in found:
        if r.samples >= 0.005 * total:
            print(f"  {r.span}  {len(r.instructions):5d} instructions  executed {r.executed:10d}  "
                  f"samples {r.samples:8d} ({r.samples / total:6.1%})")
    if args.range:
        lo, hi = (int(x, 16) for x in args.range)
        chosen = Region(0, [i for i in instructions if lo <= i.offset <= hi])
    else:
        chosen = hottest_product_loop(found)
    if chosen is None or not chosen.instructions:
        print("no region to detail")
        return 1
    print(f"\nregion {chosen.span}: {chosen.samples} samples; by opcode (instructions, share of samples):")
    for op, n, share in opcode_shares(chosen)[:20]:
        print(f"  {op:10s} {n:4d}  {share:.3f}")
    print("stall reasons: " + ", ".join(f"{name} {share:.3f}" for name, share in stall_shares(chosen)[:12]))
    if args.listing:
        print()
        for ins in chosen.instructions:
            if ins.samples >= args.min_samples or ins.opcode in SYNC_OPS:
                top = sorted(ins.stalls.items(), key=lambda kv: -kv[1])[:2]
                print(f"  {ins.offset:05x} {ins.samples:6d} {ins.executed:10d}  {ins.source[:62]:<62} "
                      + " ".join(f"{k}={v}" for k, v in top if v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
