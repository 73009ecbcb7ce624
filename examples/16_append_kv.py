"""Example 16: appending to the KV cache with rotary embeddings, then decoding.

    python examples/16_append_kv.py

attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=L,
rotary_cos=cos, rotary_sin=sin) rotates the new keys at positions L + t, writes them and
the new values into the cache in place, rotates q at the same positions and attends to
the first L + Snew keys (causal, bottom-right: the last query sees the last key). Both
rotary styles (GPT-NeoX halves, GPT-J interleaved pairs) and partial rotary dims run. A
prefill chunk is followed by a few decode steps; each is checked against
fmha.reference.attention_with_kvcache (output and the cache contents).
"""

import torch

from _common import DEVICE, done, header, kvcache_checked, randn, sizes

header("Example 16: append KV + rotary")
gen = torch.Generator().manual_seed(16)
B, Hq, Hk, S_cache, D, chunk = sizes((2, 4, 2, 64, 32, 6), (4, 32, 8, 4096, 128, 512))


def rotary_tables(max_pos, rotary_dim, base=10000.0):
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None]
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


for interleaved, rotary_dim in ((False, D), (True, D // 2)):
    style = "GPT-J interleaved" if interleaved else "GPT-NeoX halves"
    print(f" rotary {style}, rotary_dim={rotary_dim}")
    cos, sin = rotary_tables(S_cache, rotary_dim)
    k_cache = torch.zeros(B, S_cache, Hk, D, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    lens = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    for step, new in enumerate([chunk, 1, 1, 1]):  # prefill, then three decode steps
        q = randn(B, new, Hq, D, gen=gen)
        k, v = randn(B, new, Hk, D, gen=gen), randn(B, new, Hk, D, gen=gen)
        _, _, k_cache, v_cache = kvcache_checked(
            f"step {step}: {new} new token(s) after {lens.tolist()}", q, k_cache, v_cache, k=k, v=v,
            cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=True)
        lens += new
done()
