"""Example 10: bfloat16, forward and backward.

    python examples/10_bf16.py

bf16 keeps fp32's exponent range with 8 bits of mantissa: its rounding error is 8x
fp16's. The kernels accumulate in fp32 either way; the 2x rule scales with the dtype's
own baseline, so the same check applies. fp16 runs alongside for comparison.
"""

import torch

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 10: bf16")
shape = sizes((2, 4, 2, 48, 56, 64), (2, 16, 4, 2048, 2048, 128))
for dtype in (torch.bfloat16, torch.float16):
    gen = torch.Generator().manual_seed(10)  # same values in both dtypes
    q, k, v = qkv(*shape, dtype=dtype, gen=gen)
    o, _ = run_checked(f"{dtype} forward, causal, GQA", q, k, v, causal=True)
    grads = grads_checked(f"{dtype} backward", q, k, v, causal=True)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads.values())
done()
