"""Example 17: the backward pass.

    python examples/17_backward.py

fmha.attention is differentiable: autograd runs three kernel stages (dot(dO, O), then
dK/dV with dQ accumulated by atomics, then dQ converted), each from the registry.
Gradients are checked against torch autograd in float64. On the CPU the interpreter
also runs float64 kernels, so torch.autograd.gradcheck can check the backward against
finite differences of the forward.
"""

import torch

import fmha

from _common import ON_GPU, done, grads_checked, header, qkv, sizes

header("Example 17: backward")
gen = torch.Generator().manual_seed(17)
B, Hq, Hk, S, D = sizes((1, 4, 2, 40, 32), (2, 16, 4, 1024, 128))
q, k, v = qkv(B, Hq, Hk, S, S, D, gen=gen, grad=True)
print(fmha.explain(q, k, v, causal=True).split("\n\n")[0])
grads_checked("plain", q, k, v)
grads_checked("causal, GQA", q, k, v, causal=True)
grads_checked("causal, Dv != Dqk", q, k, qkv(B, Hq, Hk, S, S, D // 2, gen=gen)[2], causal=True)

if ON_GPU:
    print("  gradcheck: skipped on CUDA (float64 kernels exist for the interpreter only); run on the CPU")
else:
    q, k, v = (t.detach().double()[..., :12, :8].requires_grad_() for t in qkv(1, 2, 1, 12, 12, 8, gen=gen))
    ok = torch.autograd.gradcheck(lambda q, k, v: fmha.attention(q, k, v, causal=True), (q, k, v), fast_mode=True)
    print(f"  torch.autograd.gradcheck in float64 (interpreter): {ok}")
    assert ok
done()
