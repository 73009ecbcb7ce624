"""Example 32: torch.compile(fullgraph=True) through fmha.

    python examples/32_torch_compile.py

fmha's entry points are torch.library custom ops with fake implementations, so a
compiled model keeps them as single nodes: no graph breaks, forward and backward. On a
GPU this uses the default inductor backend; on the CPU "aot_eager" (no C++ compiler
needed), which still traces the whole graph and the autograd of the op.
"""

import torch

import fmha

from _common import DEVICE, ON_GPU, check, done, header, randn, sizes, truth_and_baseline


class Block(torch.nn.Module):
    """Pre-norm attention block with GQA, causal, soft-cap."""

    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        o = fmha.attention(q, k, v, layout="bshd", causal=True, softcap=20.0)
        return x + self.out(o.reshape(b, s, -1))


header("Example 32: torch.compile")
gen = torch.Generator().manual_seed(32)
torch.manual_seed(32)
B, S, dim, heads, kv_heads = sizes((2, 24, 64, 4, 2), (4, 2048, 2048, 16, 4))
dtype = torch.float32  # compiled and eager then agree to fp32 rounding
block = Block(dim, heads, kv_heads).to(DEVICE, dtype)
x = randn(B, S, dim, dtype=dtype, gen=gen).requires_grad_()
backend = "inductor" if ON_GPU else "aot_eager"
compiled = torch.compile(block, fullgraph=True, backend=backend)
eager_out = block(x)
(eager_dx,) = torch.autograd.grad(eager_out.float().sum(), x)
out = compiled(x)
(dx,) = torch.autograd.grad(out.float().sum(), x)
gap_o = (out.float() - eager_out.float()).abs().max().item()
gap_dx = (dx.float() - eager_dx.float()).abs().max().item()
tol = 1e-4 if ON_GPU else 1e-5  # inductor may reorder fp32 reductions
print(f"  backend={backend}: |compiled - eager| output {gap_o:.2e}, input grad {gap_dx:.2e} (allowed {tol})")
assert gap_o <= tol and gap_dx <= tol

# And the attention inside, checked against the truth (same projections as the block).
with torch.no_grad():
    h = block.norm(x)
    q = block.q(h).view(B, S, heads, -1)
    k, v = block.kv(h).view(B, S, 2, kv_heads, -1).unbind(2)
    o = torch.compile(lambda q, k, v: fmha.attention(q, k, v, layout="bshd", causal=True, softcap=20.0),
                      fullgraph=True, backend=backend)(q, k, v)
    truth = truth_and_baseline(q, k, v, layout="bshd", causal=True, softcap=20.0)
print("  compiled fmha.attention alone")
check("o", o.transpose(1, 2), truth[0], truth[2], dtype)
done()
