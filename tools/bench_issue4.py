"""The side-by-side table of issues 2 and 4: B=4, H=16, S=4096 and 8192, D=64/128/256,
bf16, causal and not, forward and backward; fmha vs SDPA cuDNN/flash and FlexAttention.

    PYTHONPATH=src python tools/bench_issue4.py [--rounds N]   (writes $OUT/bench_issue4.*)
"""

import os
import sys
from pathlib import Path

from fmha.bench import suite as bench


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    shapes = [bench.Shape(4, 16, 16, s, d, "bf16", causal)
              for s in (4096, 8192) for d in (64, 128, 256) for causal in (False, True)]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    results = bench.run_suite(shapes, modes=("fwd", "bwd"), rounds=rounds, progress=False,
                              on_shape_done=lambda r: bench.write_json(out / "bench_issue4.json", r))
    bench.write_json(out / "bench_issue4.json", results)
    bench.write_csv(out / "bench_issue4.csv", results)
    bench.plot(out / "bench_issue4.png", results, title="fmha vs SDPA/Flex, H200, bf16")
    from rich.console import Console
    Console(width=200).print(bench.render_table(results))
    print(bench.summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
