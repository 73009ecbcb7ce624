"""fmha.compat.flash_attn keeps FlashAttention 2's signatures and return conventions."""

import torch

import fmha
from fmha.compat import flash_attn as fa

from attn_testing import randn


def test_flash_attn_func_matches_attention_in_bshd(rng):
    q, k, v = randn((2, 17, 4, 32), torch.float16, rng), randn((2, 23, 2, 32), torch.float16, rng), \
        randn((2, 23, 2, 32), torch.float16, rng)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=3.0,
                                           return_attn_probs=True)
    ref, ref_lse = fmha.attention(q, k, v, layout="bshd", causal=True, window=(5, 0), softcap=3.0,
                                  return_lse=True)
    assert out.shape == (2, 17, 4, 32) and lse.shape == (2, 4, 17) and s_dmask is None
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_packed_variants_are_views_of_the_same_call(rng):
    qkv = randn((1, 20, 3, 2, 16), torch.float32, rng)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = fmha.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], layout="bshd", causal=True)
    assert torch.equal(out, ref)
    kv = qkv[:, :, 1:]
    assert torch.equal(fa.flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True), ref)


def test_varlen_and_dropout_mask_conventions(rng):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (randn((12, 2, 16), torch.float32, rng) for _ in range(3))
    out, lse, mask = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, dropout_p=0.2, causal=True,
                                               return_attn_probs=True)
    assert out.shape == (12, 2, 16) and lse.shape == (2, 12) and mask.dtype == torch.bool


def test_with_kvcache_keeps_flash_attn_defaults(rng):
    q = randn((2, 1, 4, 16), torch.float32, rng)
    kc, vc = randn((2, 30, 2, 16), torch.float32, rng), randn((2, 30, 2, 16), torch.float32, rng)
    k, v = randn((2, 1, 2, 16), torch.float32, rng), randn((2, 1, 2, 16), torch.float32, rng)
    cos, sin = randn((40, 4), torch.float32, rng), randn((40, 4), torch.float32, rng)
    seqlens = torch.tensor([3, 20], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    ref = fmha.attention_with_kvcache(q, kc2, vc2, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                      rotary_interleaved=True, cache_seqlens=seqlens, causal=True)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and lse.shape == (2, 4, 1)
