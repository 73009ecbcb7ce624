"""Example 29: a paged KV cache (vLLM-style block table).

    python examples/29_paged_kv.py

The cache is a pool of pages (num_pages, page_size, Hk, D); block_table[b, i] is the
page holding tokens i*page_size .. (i+1)*page_size - 1 of sequence b. Pages of one
sequence need not be adjacent or ordered. New tokens are appended through the table.
Checked against fmha.reference.attention_with_kvcache (output and the page pool).
"""

import torch

from _common import DEVICE, done, header, kvcache_checked, randn, sizes

header("Example 29: paged KV cache")
gen = torch.Generator().manual_seed(29)
B, Hq, Hk, D, page, pages_per_seq = sizes((3, 4, 2, 32, 4, 8), (16, 32, 8, 128, 16, 256))
num_pages = B * pages_per_seq + 5  # a few spare pages
pool_k, pool_v = randn(num_pages, page, Hk, D, gen=gen), randn(num_pages, page, Hk, D, gen=gen)
block_table = torch.randperm(num_pages, generator=gen)[:B * pages_per_seq].view(B, pages_per_seq)
block_table = block_table.to(torch.int32).to(DEVICE)
capacity = pages_per_seq * page
lens = torch.tensor([(capacity * (b + 1)) // (B + 1) for b in range(B)], dtype=torch.int32, device=DEVICE)
print(f"  pool {tuple(pool_k.shape)}, block_table {tuple(block_table.shape)}, cache_seqlens {lens.tolist()[:6]}...")

q = randn(B, 1, Hq, D, gen=gen)
kvcache_checked("decode over the paged cache", q, pool_k, pool_v, cache_seqlens=lens, block_table=block_table)
k, v = randn(B, 3, Hk, D, gen=gen), randn(B, 3, Hk, D, gen=gen)
q3 = randn(B, 3, Hq, D, gen=gen)
_, _, pool_k2, _ = kvcache_checked("append 3 tokens through the table, causal", q3, pool_k, pool_v, k=k, v=v,
                                   cache_seqlens=lens, block_table=block_table, causal=True)
pos = lens[0].item()
page_id, slot = block_table[0, pos // page].item(), pos % page
assert torch.equal(pool_k2[page_id, slot], k[0, 0]), "the first new key is not where the table says"
print(f"  sequence 0's token {pos} landed in page {page_id}, slot {slot}")
done()
