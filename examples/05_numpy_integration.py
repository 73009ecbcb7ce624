"""Example 05: numpy arrays in, numpy arrays out (fmha.numpy_api).

    python examples/05_numpy_integration.py

CK's Python runner takes numpy arrays; so does fmha.numpy_api.attention. It copies
them to the device (CUDA when available, else the CPU interpreter), times the call and
returns out, lse, time, TFLOP/s and the kernel name. bfloat16 arrays are
ml_dtypes.bfloat16. The output is checked against fmha.reference in numpy.
"""

import ml_dtypes
import numpy as np
import torch

from fmha import reference
from fmha.numpy_api import attention
from fmha.testing import numerics

from _common import check, done, header, sizes

header("Example 05: numpy integration")
B, H, S, D = sizes((1, 2, 40, 32), (2, 16, 1024, 128))  # the reference runs in numpy
rng = np.random.default_rng(5)
for np_dtype, torch_dtype in ((np.float16, torch.float16), (ml_dtypes.bfloat16, torch.bfloat16),
                              (np.float32, torch.float32)):
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(np_dtype) for _ in range(3))
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)  # numpy keyword arrays travel too
    r = attention(q, k, v, causal=True, bias=bias, warmup=1, repeat=sizes(1, 10))
    print(f"  {np.dtype(np_dtype).name:<9} out {r.out.shape} {r.out.dtype}, {r.time_ms:.3f} ms, "
          f"{r.tflops:.3f} TFLOP/s, kernel {r.kernel}")
    assert r.out.dtype == np.dtype(np_dtype) and r.lse.dtype == np.float32
    truth_o, truth_lse = reference.attention_fwd(q, k, v, causal=True, bias=bias)
    base_o, base_lse = numerics.torch_attention(*(torch.from_numpy(x.astype(np.float32)).to(torch_dtype)
                                                  for x in (q, k, v)), causal=True, bias=torch.from_numpy(bias))
    check("o", torch.from_numpy(r.out.astype(np.float32)), truth_o, base_o, torch_dtype)
    check("lse", torch.from_numpy(r.lse), truth_lse, base_lse, torch.float32)
done()
