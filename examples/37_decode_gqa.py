"""Example 37: decoding with MHA, GQA and MQA caches.

    python examples/37_decode_gqa.py

For decode (one query per sequence) fmha packs the query heads that share a KV head
into one tile, so each KV head's keys and values are read once per group, not once per
query head: MQA (Hk = 1) reads the cache once per sequence. The same queries against
caches with 8, 2 and 1 KV heads, each checked against fmha.reference.
"""

import torch

from _common import DEVICE, done, header, kvcache_checked, randn, sizes

header("Example 37: decode with MHA / GQA / MQA")
gen = torch.Generator().manual_seed(37)
B, Hq, S, D = sizes((2, 8, 40, 32), (8, 32, 4096, 128))  # the reference copies the cache to float64
q = randn(B, 1, Hq, D, gen=gen)
lens = torch.tensor([S - 3 * b for b in range(B)], dtype=torch.int32, device=DEVICE)
for hk in sizes((8, 2, 1), (32, 8, 1)):
    kind = "MHA" if hk == Hq else "MQA" if hk == 1 else "GQA"
    k_cache, v_cache = randn(B, S, hk, D, gen=gen), randn(B, S, hk, D, gen=gen)
    cache_mib = 2 * k_cache.numel() * k_cache.element_size() / 2**20
    kvcache_checked(f"{kind}: Hq={Hq} Hk={hk} (K+V cache {cache_mib:.2f} MiB)", q, k_cache, v_cache,
                    cache_seqlens=lens, softcap=30.0)
done()
