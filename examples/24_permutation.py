"""Example 24: input and output permutations (CK's i_perm / o_perm).

    python examples/24_permutation.py

CK's examples choose whether inputs and outputs are (B, H, S, D) or (B, S, H, D) in
memory. fmha takes the logical layout as an argument and reads any memory order
through strides; the output comes back in the input's logical layout. Here the same
data is stored in four memory orders (bhsd, bshd, shbd, sbhd); each runs without a copy
and gives the same answer (bitwise on the CPU), checked against the float64 truth.
"""

import torch

import fmha

from _common import DEVICE, ON_GPU, bhsd, done, header, randn, run_checked, sizes

header("Example 24: permutations")
gen = torch.Generator().manual_seed(24)
B, H, S, D = sizes((2, 4, 33, 32), (4, 16, 2048, 128))
base = [randn(B, H, S, D, gen=gen) for _ in range(3)]  # logical bhsd
results = {}
# memory order -> permutation from bhsd to that order
orders = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "shbd": (2, 1, 0, 3), "sbhd": (2, 0, 1, 3)}
for name, perm in orders.items():
    stored = [t.permute(perm).contiguous() for t in base]  # memory in this order
    inverse = [perm.index(i) for i in range(4)]
    views = [t.permute(inverse) for t in stored]  # logical bhsd views of that memory
    layout = "bhsd"
    if name == "bshd":  # the natural FlashAttention layout: pass it as is
        views, layout = stored, "bshd"
    o = run_checked(f"memory {name}, q strides {views[0].stride()}, layout={layout}", *views, layout=layout,
                    causal=True)[0]
    results[name] = bhsd(o, layout)
gaps = {name: (o.float() - results["bhsd"].float()).abs().max().item() for name, o in results.items()}
print(f"  largest difference to the bhsd run: {max(gaps.values()):.1e}")
# The interpreter computes the same tiles in the same order whatever the strides: bitwise equal.
# Compiled kernels may vectorise loads differently per stride pattern, so allow fp16 rounding there.
assert all(g == 0 for g in gaps.values()) if not ON_GPU else all(g <= 1e-3 for g in gaps.values()), gaps
# The output layout follows the input layout; the other one is a free view.
o_bshd = fmha.attention(*[t.transpose(1, 2) for t in base], layout="bshd")
assert o_bshd.shape == (B, S, H, D) and o_bshd.is_contiguous()
print(f"  layout='bshd' output: {tuple(o_bshd.shape)} contiguous; as bhsd: a transpose view (device {DEVICE})")
done()
