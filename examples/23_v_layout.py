"""Example 23: layouts: bhsd, bshd, strided views and column-major V.

    python examples/23_v_layout.py

layout="bhsd" (SDPA, CK) or "bshd" (FlashAttention). Any strides work as long as the
last dimension is contiguous; nothing is copied. Views of a packed QKV projection
(B, S, 3, H, D) go straight in, and V may be column-major (stride 1 along the sequence,
as when it comes out of a transposed matmul). Forward and backward are checked.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, randn, run_checked, sizes

header("Example 23: layouts and strides")
gen = torch.Generator().manual_seed(23)
B, H, S, D = sizes((2, 2, 40, 32), (2, 16, 2048, 128))
for layout in ("bhsd", "bshd"):
    q, k, v = qkv(B, H, H, S, S, D, layout=layout, gen=gen)
    o, _ = run_checked(f"layout={layout}: q {tuple(q.shape)}", q, k, v, layout=layout, causal=True)
    assert o.shape == q.shape

packed = randn(B, S, 3, H, D, gen=gen)  # a fused QKV projection
q, k, v = packed.unbind(2)  # (B, S, H, D) views with strides (S*3*H*D, 3*H*D, D, 1)
print(f"  packed QKV views: q.stride()={q.stride()}, contiguous={q.is_contiguous()}")
run_checked("packed QKV views, bshd", q, k, v, layout="bshd")
grads_checked("backward through the packed views", q, k, v, layout="bshd", causal=True)

qh, kh, _ = qkv(B, H, H, S, S, D, gen=gen)
v_cm = randn(B, H, D, S, gen=gen).transpose(-1, -2)  # (B, H, S, D) with stride 1 along S
print(f"  column-major v: shape {tuple(v_cm.shape)} stride {v_cm.stride()}")
run_checked("column-major v", qh, kh, v_cm, causal=True)
grads_checked("backward with column-major v", qh, kh, v_cm)

q_strided = randn(B, H, S, 2 * D, gen=gen)[..., ::2]  # every other element: last-dim stride 2
try:
    fmha.attention(q_strided, kh, v_cm)
except ValueError as e:
    print(f"  q with a strided last dimension refused, as expected: {str(e)[:100]}")
else:
    raise AssertionError("a q with a strided last dimension was accepted")
done()
