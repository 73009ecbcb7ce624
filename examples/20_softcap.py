"""Example 20: logit soft-capping (Gemma 2, Grok).

    python examples/20_softcap.py

With softcap > 0 the scaled logits become softcap * tanh(s / softcap) before bias and
masking, so no logit exceeds softcap in size. The backward applies the chain rule
1 - tanh^2 inside the kernel. Checked forward and backward; a negative softcap is
refused with a clear error.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 20: soft-cap")
gen = torch.Generator().manual_seed(20)
B, H, S, D = sizes((1, 2, 48, 64), (2, 16, 2048, 128))
q, k, v = qkv(B, H, H, S, S, D, gen=gen, dtype=torch.float16)
q = q * 4  # large logits, so the cap matters
for cap in (2.0, 30.0):
    o, lse = run_checked(f"softcap={cap}, causal", q, k, v, softcap=cap, causal=True)
    # every capped logit is <= cap, so lse <= cap + log(visible keys) <= cap + log(S)
    assert (lse <= cap + torch.log(torch.tensor(float(S))) + 1e-4).all()
n = sizes(S, 512)
grads_checked("backward, softcap=5", q[..., :n, :], k[..., :n, :], v[..., :n, :], softcap=5.0, causal=True)
try:
    fmha.attention(q, k, v, softcap=-1.0)
except ValueError as e:
    print(f"  refused, as expected: {e}")
else:
    raise AssertionError("softcap=-1 was accepted")
done()
