"""Example 36: float32 inputs.

    python examples/36_fp32.py

fp32 runs with exact fp32 dot products (dot_precision="ieee") by default, so fmha's
error is that of a plain fp32 computation: about 1e-6, a thousand times below fp16.
Forward and backward are checked with the same 2x rule, whose baseline is now torch in
fp32. A config with dot_precision="tf32" trades that for speed on NVIDIA GPUs.
"""

import torch

import fmha
from fmha import Algorithm, DType, Family, KernelConfig

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 36: fp32")
gen = torch.Generator().manual_seed(36)
B, Hq, Hk, S, D = sizes((1, 4, 2, 40, 48), (2, 16, 4, 2048, 128))
q, k, v = qkv(B, Hq, Hk, S, S, D, dtype=torch.float32, gen=gen)
o, lse = run_checked("fp32 forward, causal, GQA", q, k, v, causal=True)
g = grads_checked("fp32 backward", q, k, v, causal=True)
assert o.dtype == torch.float32 and g["dq"].dtype == torch.float32
h16 = run_checked("the same in fp16, for scale", *(t.half() for t in (q, k, v)), causal=True)
err32 = (o.double() - h16[0].double()).abs().max().item()
print(f"  |fp32 - fp16| = {err32:.1e}: the fp16 rounding, not fp32's")
fp32_gpu = next(c for c in fmha.default_registry() if c.family == Family.FWD and c.signature.dtypes == (DType.FP32,))
tf32 = KernelConfig(fp32_gpu.signature, Algorithm(64, 32, 4, 2, dot_precision="tf32"))
print(f"  a tf32 variant of {fp32_gpu.name}, for a GPU registry: {tf32.name}")
done()
