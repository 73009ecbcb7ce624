"""Example 38: using the returned log-sum-exp.

    python examples/38_lse_return.py

return_lse=True also returns lse = log sum_j exp(s_ij), natural log, fp32: (B, Hq, Sq) in
both dense layouts, (Hq, total_q) for varlen, (B, Hq, Sq) for the KV cache. With it,
any attention probability can be recomputed exactly (p_ij = exp(s_ij - lse_i)), and
partial results combine without a second pass. Rows that see no key have lse = -inf.
"""

import torch

import fmha

from _common import DEVICE, done, header, qkv, run_checked, sizes

header("Example 38: the returned lse")
gen = torch.Generator().manual_seed(38)
B, H, Sq, Sk, D = sizes((1, 2, 40, 24, 32), (2, 16, 2048, 1024, 128))
q, k, v = qkv(B, H, H, Sq, Sk, D, gen=gen, dtype=torch.float32)
o, lse = run_checked("causal bottom-right with Sq > Sk (the first rows see nothing)", q, k, v, causal=True)
empty = Sq - Sk
assert torch.isneginf(lse[..., :empty]).all() and (o[..., :empty, :] == 0).all()
print(f"  rows 0..{empty - 1}: lse = -inf and o = 0 (no NaN)")

# Probabilities of a few rows from lse, without the kernel ever storing P.
rows = torch.arange(empty, Sq, max(1, (Sq - empty) // 8), device=DEVICE)
s = (q[..., rows, :] @ k.transpose(-1, -2)) / D ** 0.5
visible = torch.arange(Sk, device=DEVICE)[None] <= (rows[:, None] - empty)
p = torch.exp(s - lse[..., rows, None]).masked_fill(~visible, 0)
sums = p.sum(-1)
print(f"  rows {rows.tolist()[:4]}...: sum_j exp(s_ij - lse_i) in [{sums.min():.6f}, {sums.max():.6f}]")
assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
recon = p @ v
gap = (recon - o[..., rows, :]).abs().max().item()
print(f"  P @ V from lse vs o: {gap:.1e}")
assert gap <= 5e-5

# lse of the layouts and entry points.
_, lse_bshd = fmha.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd",
                             causal=True, return_lse=True)
assert lse_bshd.shape == (B, H, Sq) and torch.equal(lse_bshd, lse)
cu = torch.tensor([0, Sq], dtype=torch.int32, device=DEVICE)
cuk = torch.tensor([0, Sk], dtype=torch.int32, device=DEVICE)
_, lse_var = fmha.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cuk,
                                   Sq, Sk, causal=True, return_lse=True)
assert lse_var.shape == (H, Sq) and torch.allclose(lse_var, lse[0], atol=1e-6)
print(f"  lse shapes: bhsd/bshd {tuple(lse.shape)}, varlen {tuple(lse_var.shape)}")
done()
