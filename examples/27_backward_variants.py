"""Example 27: backward variants: deterministic, dlse, dbias, dsinks.

    python examples/27_backward_variants.py

- deterministic=True computes dQ in its own pass instead of by atomics: bitwise the same
  gradients run after run (checked by running twice).
- A returned lse is differentiable: a loss on lse (as in some distillation and
  ring-attention schemes) flows back through the kernels (dlse).
- Gradients of a bias (dbias, reduced to the bias' shape) and of sink logits (dsinks).
Each is checked against torch autograd in float64.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, randn, sizes

header("Example 27: backward variants")
gen = torch.Generator().manual_seed(27)
B, Hq, Hk, S, D = sizes((1, 4, 2, 40, 32), (2, 16, 4, 1024, 128))
q, k, v = qkv(B, Hq, Hk, S, S, D, gen=gen)

g1 = grads_checked("deterministic=True, causal, GQA", q, k, v, causal=True, deterministic=True)
g2 = grads_checked("deterministic=True again", q, k, v, causal=True, deterministic=True)
same = all(torch.equal(g1[n], g2[n]) for n in g1)
print(f"  bitwise identical across runs: {same}")
assert same
plan = fmha.get_dispatcher().plan_backward(fmha.problem_of(q, k, v, causal=True, deterministic=True))
print("  " + plan.describe().replace("\n", "\n  "))

grads_checked("dlse: gradient flowing into the returned lse", q, k, v, causal=True, with_dlse=True)
bias = randn(1, Hq, S, S, dtype=torch.float32, gen=gen)
sinks = randn(Hq, dtype=torch.float32, gen=gen)
g = grads_checked("dbias (1, Hq, Sq, Sk) + dsinks + dlse", q, k, v, bias=bias, sinks=sinks, with_dlse=True)
assert g["dbias"].shape == bias.shape and g["dsinks"].shape == sinks.shape
done()
