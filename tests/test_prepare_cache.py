"""The dense-call cache of validated Problems (prepare.prepare_call): hits only on identical
metadata and scalars, never caches a refusal, and never serves varlen calls."""

import pytest
import torch

import fmha
from fmha import api


def test_same_metadata_reuses_the_problem_and_other_metadata_does_not():
    q = torch.randn(2, 4, 33, 64, dtype=torch.bfloat16)
    first = api.problem_of(q, q, q, causal=True)
    assert api.problem_of(q.clone(), q.clone(), q.clone(), causal=True) is first
    assert api.problem_of(q, q, q) is not first and not api.problem_of(q, q, q).causal
    assert api.problem_of(q, q, q, causal=True, mask_align="top_left").mask_align.value == "top_left"
    wide = torch.randn(2, 4, 33, 68, dtype=torch.bfloat16)[..., :64]  # same shape, other strides
    assert not api.problem_of(wide, wide, wide, causal=True).tma_aligned and first.tma_aligned
    shifted = torch.randn(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)  # same strides, base off by 2 B
    assert not api.problem_of(shifted, shifted, shifted, causal=True).tma_aligned


def test_refusals_are_not_cached():
    q = torch.randn(1, 3, 16, 32, dtype=torch.float16)
    k = torch.randn(1, 2, 16, 32, dtype=torch.float16)  # 3 query heads over 2 KV heads
    for _ in range(2):
        with pytest.raises(ValueError, match="nhead"):
            fmha.attention(q, k, k)


def test_varlen_calls_are_validated_every_time():
    q = torch.randn(10, 2, 16, dtype=torch.float16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    fmha.attention_varlen(q, q, q, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=6, max_seqlen_k=6)
    bad = torch.tensor([0, 7, 10], dtype=torch.int32)  # same metadata, a longest sequence of 7 > 6
    with pytest.raises(ValueError, match="max_seqlen"):
        fmha.attention_varlen(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=good, max_seqlen_q=6, max_seqlen_k=6)
