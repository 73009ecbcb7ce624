"""Example 14: grouped-query and multi-query attention.

    python examples/14_gqa.py

Hq query heads share Hk key/value heads (Hq % Hk == 0; head h reads kv head
h // (Hq // Hk)). No K/V is repeated in memory; the backward sums dK/dV over each group
inside the kernel. Checked against the float64 truth, and against the same call with
K/V repeated to Hq heads (MHA), which must agree.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 14: GQA / MQA")
gen = torch.Generator().manual_seed(14)
B, S, D = sizes((1, 40, 32), (2, 2048, 128))
for hq, hk in sizes([(8, 2), (4, 1)], [(32, 8), (32, 1)]):
    q, k, v = qkv(B, hq, hk, S, S, D, gen=gen)
    kind = "MQA" if hk == 1 else "GQA"
    o, _ = run_checked(f"{kind} Hq={hq} Hk={hk}, causal", q, k, v, causal=True)
    group = hq // hk
    o_mha = fmha.attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal=True)
    diff = (o.float() - o_mha.float()).abs().max().item()
    print(f"    vs K/V repeated to {hq} heads: max difference {diff:.2e}")
    assert diff <= 1e-3, diff
    n = sizes(S, 512)
    g = grads_checked(f"{kind} backward", q[..., :n, :], k[..., :n, :], v[..., :n, :], causal=True)
    assert g["dk"].shape == k[..., :n, :].shape
done()
