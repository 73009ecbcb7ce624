"""A process that ran CPU tensors (Triton's interpreter) can still compile CUDA kernels."""

import sys
from pathlib import Path

import torch

import fmha

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))


def test_compiling_for_sm90_still_works_after_an_interpreted_run(tmp_path, monkeypatch):
    import compile_check
    # Compile for real (no cache hit). Through the environment: setting the knob in code
    # would pin it for later tests in this process.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from fmha.kernels.triton import fwd

    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    fmha.attention(q, q, q, causal=True).sum().backward()  # interpreted runs patch triton.language
    flags = dict.fromkeys(["IS_VARLEN", "HAS_SEQUSED_K", "ALIGN_BOTTOM_RIGHT", "HAS_LEFT", "HAS_RIGHT",
                           "HAS_SINK_TOKENS", "HAS_SOFTCAP", "HAS_BIAS", "HAS_ALIBI", "HAS_DROPOUT",
                           "HAS_SINKS"], False)
    pointers = {n: "fp16" for n in ["Q", "K", "V", "O"]}
    pointers.update({n: "fp32" for n in ["LSE", "Bias", "Alibi", "Sinks", "QDescale", "KDescale", "VDescale"]})
    pointers.update({n: "i32" for n in ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"]})
    shared, _ = compile_check.compile_one(fwd.fwd_kernel, pointers, compile_check.FLOATS,
                                          {**flags, "DOT_PRECISION": "ieee", "BLOCK_M": 16, "BLOCK_N": 16,
                                           "BLOCK_DQK": 16, "BLOCK_DV": 16, **compile_check.NO_FP8}, 4, 1)
    assert shared > 0
