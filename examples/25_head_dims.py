"""Example 25: head dimensions 1..256, and Dqk != Dv.

    python examples/25_head_dims.py

Head dims that are not powers of two are padded inside the kernel (masked loads), never
by copying the tensors. q/k and v may have different head dims (e.g. 192 / 128 as in
DeepSeek's MLA). The dispatcher picks a config by head dim (printed). Forward and
backward are checked.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 25: head dims")
gen = torch.Generator().manual_seed(25)
B, H, S = sizes((1, 2, 24), (2, 16, 1024))
dims = sizes([(1, 1), (8, 8), (40, 40), (96, 96), (200, 200), (256, 256), (192, 128), (64, 16)],
             [(32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (256, 256), (192, 128), (128, 64)])
for dqk, dv in dims:
    q, k, v = qkv(B, H, H, S, S, dqk, dv, gen=gen)
    kernel = fmha.get_dispatcher().plan_forward(fmha.problem_of(q, k, v)).config(fmha.Family.FWD).name
    o, _ = run_checked(f"Dqk={dqk} Dv={dv} -> {kernel}", q, k, v, causal=True)
    assert o.shape[-1] == dv
for dqk, dv in sizes([(40, 40), (192, 128)], [(96, 96), (256, 256), (192, 128)]):
    grads_checked(f"backward Dqk={dqk} Dv={dv}", *qkv(B, H, H, S, S, dqk, dv, gen=gen), causal=True)
done()
