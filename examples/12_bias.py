"""Example 12: additive bias and ALiBi.

    python examples/12_bias.py

bias is added to the scaled logits and broadcast from any shape broadcastable to
(B, Hq, Sq, Sk) through zero strides (no copy): a full bias, a per-key padding bias
(B, 1, 1, Sk), a per-head one. ALiBi adds -slope[h] * |i + off - j| from slopes of shape
(Hq,) or (B, Hq). Bias and ALiBi add up. The backward returns dbias summed over the
broadcast dimensions. All checked against the float64 truth.
"""

import torch

from _common import done, grads_checked, header, qkv, randn, run_checked, sizes

header("Example 12: bias and ALiBi")
gen = torch.Generator().manual_seed(12)
B, H, S, D = sizes((2, 4, 40, 32), (2, 16, 2048, 128))
q, k, v = qkv(B, H, H, S, S, D, gen=gen)
full = randn(B, H, S, S, dtype=torch.float32, gen=gen)
pad = torch.zeros(B, 1, 1, S, device=q.device)
pad[0, ..., S - 7:] = float("-inf")  # batch 0: the last 7 keys are padding
per_head = randn(1, H, S, S, dtype=torch.float16, gen=gen)
slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)
run_checked("full bias (B, H, Sq, Sk) fp32", q, k, v, bias=full)
run_checked("key padding bias (B, 1, 1, Sk) with -inf", q, k, v, bias=pad, causal=True)
run_checked("per-head bias (1, H, Sq, Sk) fp16", q, k, v, bias=per_head)
run_checked("ALiBi slopes (H,)", q, k, v, alibi_slopes=slopes, causal=True)
run_checked("ALiBi slopes (B, H) + bias", q, k, v, alibi_slopes=torch.stack([slopes, slopes / 2]), bias=full)
n = sizes(S, 512)  # the float64 backward truth is (B, H, n, n) per tensor
g = grads_checked("backward with dbias (1, H, Sq, Sk), ALiBi", q[..., :n, :], k[..., :n, :], v[..., :n, :],
                  bias=per_head[..., :n, :n].float(), alibi_slopes=slopes, causal=True)
assert g["dbias"].shape == (1, H, n, n)
row_bias = randn(B, 1, 1, n, dtype=torch.float32, gen=gen)
g = grads_checked("backward with dbias of a (B, 1, 1, Sk) bias (summed over heads and rows)",
                  q[..., :n, :], k[..., :n, :], v[..., :n, :], bias=row_bias)
assert g["dbias"].shape == (B, 1, 1, n)
done()
