"""Example 04: validation, step by step.

    python examples/04_validation.py

How fmha checks itself: the truth is fmha.reference (numpy, float64); the baseline is
the same math in plain PyTorch at the kernel's dtype (fmha.testing.numerics.torch_attention);
a result passes when max|out - truth| <= 2 * max|baseline - truth| + slack. The example
also shows that the check can fail: a perturbed output is refused.
"""

import numpy as np
import torch

import fmha
from fmha import reference
from fmha.testing import numerics

from _common import done, header, qkv, sizes

header("Example 04: validation against the float64 reference")
B, Hq, Hk, S, D = sizes((2, 4, 2, 48, 32), (2, 16, 4, 1024, 128))
gen = torch.Generator().manual_seed(4)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    q, k, v = qkv(B, Hq, Hk, S, S, D, dtype=dtype, gen=gen)
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    # 1. the truth, in float64 numpy
    to_np = lambda t: t.double().cpu().numpy()
    truth_o, truth_lse = reference.attention_fwd(to_np(q), to_np(k), to_np(v), causal=True)
    truth_o, truth_lse = torch.from_numpy(truth_o), torch.from_numpy(truth_lse)
    # 2. the baseline: plain torch at the inputs' dtype
    base_o, base_lse = numerics.torch_attention(q, k, v, causal=True)
    # 3. the rule
    results = [numerics.compare("o", o, truth_o, base_o, dtype),
               numerics.compare("lse", lse, truth_lse, base_lse, torch.float32)]
    rel = reference.relative_error(to_np(o), truth_o.numpy())
    print(f"  {str(dtype):<15} relative error of o {rel:.2e}")
    for c in results:
        print(f"    {c}")
        if not c.ok:
            raise AssertionError(str(c))
    # 4. a wrong answer fails: move one element by 20 baseline errors
    bad = o.clone()
    bad.view(-1)[7] += 20 * max(results[0].baseline_error, float(numerics.SLACK[dtype]))
    refused = numerics.compare("o (perturbed)", bad, truth_o, base_o, dtype)
    print(f"    {refused} (refused, as it should be)")
    if refused.ok:
        raise AssertionError("a perturbed output passed the check")
assert np.isfinite(truth_lse.numpy()).all()
done()
