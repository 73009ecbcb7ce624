"""Example 31: FlashAttention 2's Python interface on fmha (fmha.compat.flash_attn).

    python examples/31_flash_attn_compat.py

Code written for flash_attn runs by changing one import. Tensors are (B, S, H, D), causal
aligns bottom-right, softmax_lse is (B, H, S). flash_attn_func, the packed variants,
varlen and with_kvcache are shown, each checked against the float64 truth.
"""

import torch

from fmha.compat.flash_attn import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

from _common import (
    DEVICE,
    bhsd,
    check,
    done,
    grads_checked,
    header,
    kvcache_checked,
    qkv,
    randn,
    sizes,
    truth_and_baseline,
)

header("Example 31: flash_attn compatibility")
gen = torch.Generator().manual_seed(31)
B, Hq, Hk, S, D = sizes((2, 4, 2, 40, 32), (2, 16, 4, 2048, 128))
q, k, v = qkv(B, Hq, Hk, S, S, D, layout="bshd", gen=gen)
print("  flash_attn_func(q, k, v, causal=True, window_size=(16, 0), softcap=10, return_attn_probs=True)")
out, lse, _ = flash_attn_func(q, k, v, causal=True, window_size=(16, 0), softcap=10.0, return_attn_probs=True)
truth = truth_and_baseline(q, k, v, layout="bshd", causal=True, window=(16, 0), softcap=10.0)
check("out", bhsd(out, "bshd"), truth[0], truth[2], q.dtype)
check("softmax_lse", lse, truth[1], truth[3], torch.float32)
grads_checked("backward through flash_attn_func's op", q, k, v, layout="bshd", causal=True)

qkv_packed = randn(B, S, 3, Hq, D, gen=gen)
out = flash_attn_qkvpacked_func(qkv_packed, causal=True)
truth = truth_and_baseline(*qkv_packed.unbind(2), layout="bshd", causal=True)
print("  flash_attn_qkvpacked_func")
check("out", bhsd(out, "bshd"), truth[0], truth[2], q.dtype)

lens = sizes([7, 20, 13], [100, 1900, 2048])
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
qp, kp, vp = randn(sum(lens), Hq, D, gen=gen), randn(sum(lens), Hk, D, gen=gen), randn(sum(lens), Hk, D, gen=gen)
out = flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens), causal=True)
print("  flash_attn_varlen_func")
for b in range(len(lens)):
    s = slice(cu[b].item(), cu[b + 1].item())
    dense = [t[s][None] for t in (qp, kp, vp)]
    truth = truth_and_baseline(*dense, layout="bshd", causal=True)
    check(f"seq {b}", bhsd(out[s][None], "bshd"), truth[0], truth[2], q.dtype)

k_cache, v_cache = randn(B, S, Hk, D, gen=gen), randn(B, S, Hk, D, gen=gen)
lens = torch.tensor([S // 3, S - 2][:B] + [S // 2] * (B - 2), dtype=torch.int32, device=DEVICE)
q1, k1, v1 = randn(B, 1, Hq, D, gen=gen), randn(B, 1, Hk, D, gen=gen), randn(B, 1, Hk, D, gen=gen)
out = flash_attn_with_kvcache(q1, k_cache.clone(), v_cache.clone(), k=k1, v=v1, cache_seqlens=lens, causal=True)
o_checked = kvcache_checked("flash_attn_with_kvcache (same call through fmha.attention_with_kvcache)", q1, k_cache,
                            v_cache, k=k1, v=v1, cache_seqlens=lens, causal=True)[0]
assert torch.equal(out, o_checked)
done()
