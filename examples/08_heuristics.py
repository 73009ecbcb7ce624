"""Example 08: kernel selection: first fit, a custom heuristic, and explain().

    python examples/08_heuristics.py

The stock dispatcher takes the first config in registry order that fits the problem
(CK's rule). A heuristic(problem, candidates) -> config can choose instead. Here a
registry holds three forward tiles; the heuristic picks a short query tile for short
problems (decode-like) and a tall one otherwise. Every run is checked, and explain()
prints each candidate with its verdict. A problem that no config serves raises
NoKernelError listing each refusal.
"""

import torch

import fmha
from fmha import Algorithm, DType, Family, KernelConfig, Registry, Signature
from fmha.dispatch.configs import CPU, CUDA_ARCHS

from _common import ON_GPU, done, header, qkv, run_checked, sizes

header("Example 08: heuristics")
archs = CUDA_ARCHS if ON_GPU else (CPU,)
dtypes = (DType.FP16, DType.BF16, DType.FP32)
tiles = sizes([(16, 16), (32, 16), (64, 32)], [(64, 64), (128, 64), (128, 32)])
fwd = [KernelConfig(Signature(Family.FWD, dtypes, archs, 128), Algorithm(m, n, 4, sizes(1, 2))) for m, n in tiles]
registry = Registry(fwd, name="three_tiles")


def by_length(problem, candidates):
    """Shortest query tile that covers seqlen_q, else the tallest one."""
    ordered = sorted(candidates, key=lambda c: c.algorithm.block_m)
    return next((c for c in ordered if c.algorithm.block_m >= problem.seqlen_q), ordered[-1])


gen = torch.Generator().manual_seed(8)
cases = sizes([(1, 2, 70), (1, 2, 12)], [(4, 16, 4096), (64, 16, 1)])
for label, dispatcher in (("first fit", fmha.Dispatcher(registry)),
                          ("heuristic", fmha.Dispatcher(registry, heuristic=by_length))):
    fmha.set_dispatcher(dispatcher)
    try:
        for b, h, s in cases:
            q, k, v = qkv(b, h, h, s, sizes(70, 4096), 64, gen=gen)
            config, why = dispatcher.select(fmha.problem_of(q, k, v))
            run_checked(f"{label}: Sq={s} -> {config.name} ({why})", q, k, v)
    finally:
        fmha.set_dispatcher(None)

print()
print(fmha.Dispatcher(registry, heuristic=by_length).explain(fmha.problem_of(q, k, v)))
q, k, v = qkv(1, 2, 2, 16, 16, 256, gen=gen)  # head dim 256: over every config's limit
try:
    fmha.Dispatcher(registry).select(fmha.problem_of(q, k, v))
except fmha.NoKernelError as e:
    print(f"\nNoKernelError, as expected:\n{e}")
else:
    raise AssertionError("head dim 256 was served by a registry capped at 128")
done()
