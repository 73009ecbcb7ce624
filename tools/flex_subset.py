"""fmha, cuDNN and compiled FlexAttention on bf16 D=128 rows of the standard suite (FlexAttention
compiles once per shape, so the whole 60-shape suite with it takes long). Shards like `fmha bench`.

    PYTHONPATH=src python tools/flex_subset.py OUT.json [K/N]
"""

import sys

from fmha.bench import suite as bench


def main() -> None:
    out = sys.argv[1]
    k, n = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1/1").split("/"))
    shapes = [s for s in bench.standard_suite() if s.dtype == "bf16" and s.head_dim == 128
              and s.seqlen in (4096, 8192, 16384)][k - 1::n]
    env = bench.environment()

    def partial(results):
        bench.write_json(out, results, env, {"contenders": ["fmha", "cudnn", "flex"], "complete": False})

    results = bench.run_suite(shapes, contenders=("fmha", "cudnn", "flex"), progress=False, on_shape_done=partial)
    bench.write_json(out, results, env, {"contenders": ["fmha", "cudnn", "flex"], "complete": True})


if __name__ == "__main__":
    main()
