"""Example 34: any page size.

    python examples/34_kvcache_page_sizes.py

Page sizes need not match the kernel's key tile: 1 (token-level, as SGLang's radix
cache), odd sizes, vLLM's 16, and large pages all work; a key tile may span pages and a
page may be read by several tiles. The same sequences stored with each page size give
the same attention, checked against fmha.reference.
"""

import torch

from _common import DEVICE, done, header, kvcache_checked, randn, sizes

header("Example 34: KV-cache page sizes")
gen = torch.Generator().manual_seed(34)
B, Hq, Hk, D, S = sizes((2, 4, 1, 32, 30), (8, 32, 8, 128, 4096))
keys, values = randn(B, S, Hk, D, gen=gen), randn(B, S, Hk, D, gen=gen)  # the sequences, contiguous
lens = torch.tensor([S - 1 - 5 * b for b in range(B)], dtype=torch.int32, device=DEVICE)
q = randn(B, 2, Hq, D, gen=gen)
outs = {}


def to_pages(t, page, order):
    """(B, S, Hk, D) -> a pool of pages, page i of the padded sequences stored at order[i]."""
    pages = -(-S // page)
    padded = torch.cat([t, t.new_zeros(B, pages * page - S, Hk, D)], 1).view(B * pages, page, Hk, D)
    pool = torch.empty_like(padded)
    pool[order.to(DEVICE)] = padded
    return pool


for page in sizes([1, 3, 16, 32], [1, 16, 64, 256]):
    pages = -(-S // page)
    order = torch.randperm(B * pages, generator=gen)  # scatter the pages around the pool
    table = order.view(B, pages).to(torch.int32).to(DEVICE)
    pool_k, pool_v = to_pages(keys, page, order), to_pages(values, page, order)
    o, *_ = kvcache_checked(f"page_size={page}: {B * pages} pages", q, pool_k, pool_v, cache_seqlens=lens,
                            block_table=table, causal=True, num_splits=2)
    outs[page] = o
contiguous = kvcache_checked("contiguous cache", q, keys, values, cache_seqlens=lens, causal=True, num_splits=2)[0]
spread = max((o.float() - contiguous.float()).abs().max().item() for o in outs.values())
print(f"  largest difference between page sizes and the contiguous cache: {spread:.2e}")
done()
