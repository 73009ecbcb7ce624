"""Example 15: split-KV decoding (flash-decoding) and its combine kernel.

    python examples/15_splitkv.py

For a decode step (few queries, long cache) one program per (batch, kv head) leaves
most of the GPU idle; fmha splits the keys across programs and merges the partial
(o, lse) with the splitkv_combine kernel. num_splits=0 lets a heuristic choose (fill
the multiprocessors twice); 1..128 forces it. Every split count gives the same
attention, checked against fmha.reference.attention_with_kvcache.
"""

import torch

import fmha
from fmha.ops import prepare

from _common import DEVICE, done, header, kvcache_checked, randn, sizes

header("Example 15: split-KV")
gen = torch.Generator().manual_seed(15)
B, Hq, Hk, S_cache, D = sizes((2, 4, 2, 96, 32), (8, 32, 8, 8192, 128))
q = randn(B, 1, Hq, D, gen=gen)  # one new query per sequence: (B, Sq, Hq, D)
k_cache, v_cache = randn(B, S_cache, Hk, D, gen=gen), randn(B, S_cache, Hk, D, gen=gen)
lens = torch.tensor([S_cache - 5 - 7 * b for b in range(B)], dtype=torch.int32, device=DEVICE)

dispatcher = fmha.get_dispatcher()
problem = fmha.Problem(batch=B, nhead_q=Hq, nhead_k=Hk, seqlen_q=1, seqlen_k=S_cache, head_dim_qk=D,
                       head_dim_v=D, dtype=fmha.DType.FP16, layout="bshd",
                       arch=prepare.arch_of(torch.device(DEVICE)), seqused_k=True)
config, _ = dispatcher.select(problem, fmha.Family.FWD_SPLITKV)
sm = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 1
heuristic = dispatcher.num_splits(problem, sm, config.algorithm.block_m, config.algorithm.block_n)
print(f"  heuristic: {heuristic} splits for B={B} Hk={Hk} Sk={S_cache} on {sm} multiprocessor(s)")
print(dispatcher.plan_kvcache(problem, append=False, num_splits=max(2, heuristic)).describe())
outs = {}
for splits in (1, 2, 5, 0):
    o, lse, _, _ = kvcache_checked(f"num_splits={splits or 'heuristic'}", q, k_cache, v_cache,
                                   cache_seqlens=lens, num_splits=splits)
    outs[splits] = o
spread = max((outs[s].float() - outs[1].float()).abs().max().item() for s in outs)
print(f"  largest difference between split counts: {spread:.2e}")
done()
