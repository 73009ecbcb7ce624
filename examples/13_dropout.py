"""Example 13: dropout inside the kernel (Philox), reproducible from (seed, offset).

    python examples/13_dropout.py

Each probability is kept with probability 1 - p and scaled by 1 / (1 - p). The keep
decision is a pure function of (seed, offset, b, h, i, j), so the forward and backward
agree and a run can be repeated. return_dropout_mask=True returns the keep mask, which
the check hands to the float64 reference.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 13: dropout")
gen = torch.Generator().manual_seed(13)
B, H, S, D = sizes((1, 2, 48, 32), (4, 16, 2048, 128))
p = 0.2
q, k, v = qkv(B, H, H, S, S, D, gen=gen)
run_checked(f"dropout p={p}, seed=7", q, k, v, dropout_p=p, seed=7)
run_checked(f"dropout p={p} + causal, seed=8, offset=1000", q, k, v, dropout_p=p, seed=8, offset=1000, causal=True)

o1, m1 = fmha.attention(q, k, v, dropout_p=p, seed=42, return_dropout_mask=True)
o2, m2 = fmha.attention(q, k, v, dropout_p=p, seed=42, return_dropout_mask=True)
o3, m3 = fmha.attention(q, k, v, dropout_p=p, seed=43, return_dropout_mask=True)
keep = m1.float().mean().item()
print(f"  same seed: identical output {torch.equal(o1, o2)}, identical mask {torch.equal(m1, m2)}; "
      f"other seed: masks differ in {(m1 != m3).float().mean().item():.1%}; kept {keep:.3f} (expected {1 - p})")
assert torch.equal(o1, o2) and torch.equal(m1, m2) and not torch.equal(m1, m3)
n = m1.numel()
assert abs(keep - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, "keep rate far from 1 - p"
n = sizes(S, 512)
grads_checked(f"backward with dropout p={p} (same mask in both passes)", q[..., :n, :], k[..., :n, :],
              v[..., :n, :], dropout_p=p, seed=9, causal=True)
done()
