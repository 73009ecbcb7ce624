"""Example 33: a decode step captured in a CUDA graph.

    python examples/33_cuda_graph_decode.py

attention_with_kvcache reads no device tensor on the host (index values are checked on
the host only for CPU tensors or in debug mode), so one decode step (append the new
token, attend over a paged cache, merge splits) can be captured once and replayed with
new cache_seqlens and queries written into the captured buffers. Each replay is
compared with an eager call and checked against the float64 reference. On the CPU
there are no CUDA graphs: the same steps run eagerly (and are checked the same way).
"""

import torch

import fmha

from _common import DEVICE, ON_GPU, done, header, kvcache_checked, randn, sizes

header("Example 33: CUDA-graph decode")
gen = torch.Generator().manual_seed(33)
B, Hq, Hk, D, page, pages = sizes((2, 4, 2, 32, 4, 6), (8, 32, 8, 128, 16, 64))
pool_k = randn(B * pages, page, Hk, D, gen=gen)
pool_v = randn(B * pages, page, Hk, D, gen=gen)
table = torch.arange(B * pages, dtype=torch.int32, device=DEVICE).view(B, pages)
lens = torch.tensor([(b * 7 + 3) % (pages * page - 4) for b in range(B)], dtype=torch.int32, device=DEVICE)
q, k, v = randn(B, 1, Hq, D, gen=gen), randn(B, 1, Hk, D, gen=gen), randn(B, 1, Hk, D, gen=gen)
splits = 3


def step():
    return fmha.attention_with_kvcache(q, pool_k, pool_v, k=k, v=v, cache_seqlens=lens, block_table=table,
                                       causal=True, num_splits=splits)


if ON_GPU:
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    print("  captured one decode step (append + split-KV attention + combine)")
else:
    print("  CPU: no CUDA graphs; running the same steps eagerly")
for replay in range(3):
    lens.add_(1)  # one more token in every sequence
    for t, fresh in ((q, randn(B, 1, Hq, D, gen=gen)), (k, randn(B, 1, Hk, D, gen=gen)),
                     (v, randn(B, 1, Hk, D, gen=gen))):
        t.copy_(fresh)
    before_k, before_v = pool_k.clone(), pool_v.clone()
    if ON_GPU:
        graph.replay()
        torch.cuda.synchronize()
        replayed, after_k, after_v = out.clone(), pool_k.clone(), pool_v.clone()
        pool_k.copy_(before_k)
        pool_v.copy_(before_v)
    expected = kvcache_checked(f"step {replay}: cache_seqlens {lens.tolist()[:4]}", q, before_k, before_v, k=k, v=v,
                               cache_seqlens=lens, block_table=table, causal=True, num_splits=splits)
    pool_k.copy_(expected[2])
    pool_v.copy_(expected[3])
    if ON_GPU:
        assert torch.equal(replayed, expected[0]), "replay differs from the eager call"
        assert torch.equal(after_k, expected[2]) and torch.equal(after_v, expected[3])
        print("    replay == eager call, caches equal")
done()
