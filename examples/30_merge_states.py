"""Example 30: merging partial attention results (merge_states).

    python examples/30_merge_states.py

Attention over a key set split in parts (ring attention, prefix + suffix caches,
cascade inference) can be computed part by part, each returning (o_i, lse_i), and
merged exactly: lse = logsumexp_i lse_i, o = sum_i exp(lse_i - lse) o_i.
fmha.merge_states runs the split-KV combine kernel on any (..., D) tensors. Checked
against the attention over all keys (float64 truth) and fmha.reference.merge_states.
"""

from itertools import pairwise

import torch

import fmha
from fmha import reference

from _common import bhsd, check, done, header, qkv, sizes, truth_and_baseline

header("Example 30: merge_states")
gen = torch.Generator().manual_seed(30)
B, H, Sq, Sk, D = sizes((1, 2, 24, 60, 32), (2, 16, 1024, 8192, 128))
q, k, v = qkv(B, H, H, Sq, Sk, D, gen=gen)
cuts = [0, Sk // 5, Sk // 2, Sk]  # three uneven parts
outs, lses = [], []
for a, b in pairwise(cuts):
    o_i, lse_i = fmha.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
    outs.append(o_i)
    lses.append(lse_i)
o, lse = fmha.merge_states(outs, lses)
print(f"  merged {len(outs)} parts of {[b - a for a, b in pairwise(cuts)]} keys")
truth_o, truth_lse, base_o, base_lse = truth_and_baseline(q, k, v)
check("merged o vs attention over all keys", o, truth_o, base_o, q.dtype)
check("merged lse", lse, truth_lse, base_lse, torch.float32)
ro, rl = reference.merge_states([t.double().cpu().numpy() for t in outs], [t.double().cpu().numpy() for t in lses])
gap = (o.double().cpu() - torch.from_numpy(ro)).abs().max().item()
print(f"    vs fmha.reference.merge_states of the same parts: {gap:.2e}")
assert gap <= 2e-3, gap

# A part that sees no key (lse = -inf) contributes nothing, without NaN.
empty_o, empty_lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], float("-inf"))
o2, lse2 = fmha.merge_states([*outs, empty_o], [*lses, empty_lse])
assert torch.equal(o2, o) and torch.equal(lse2, lse)
print("  an empty part (lse = -inf) changes nothing")
assert bhsd(o, "bhsd").shape == (B, H, Sq, D)
done()
