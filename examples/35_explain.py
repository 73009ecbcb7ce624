"""Example 35: explain(): which kernels a call launches, and why.

    python examples/35_explain.py          # also: fmha kernels explain --seqlen-q 4096 ...

fmha.explain(q, k, v, **kwargs) prints the plan (forward, and the three backward stages
when an input requires grad) and every forward config with its verdict: "fits" or the
reasons it is refused (arch, dtype, head dim, features). The same for a hand-made
Problem (e.g. for a GPU, from a CPU-only machine) through Dispatcher.explain and the
CLI. fmha.explain_kvcache(q, k_cache, v_cache, **kwargs) does the same for
attention_with_kvcache (append, split-KV attention, combine, and the key splits). Each
explained call is then run and checked.
"""

import torch

import fmha
from fmha import cli

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 35: explain")
gen = torch.Generator().manual_seed(35)
B, H, S, D = sizes((1, 2, 32, 64), (2, 16, 2048, 128))
q, k, v = qkv(B, H, H, S, S, D, gen=gen)
print(fmha.explain(q, k, v, causal=True, softcap=30.0))
run_checked("the explained call", q, k, v, causal=True, softcap=30.0)

print()
q.requires_grad_()
print(fmha.explain(q, k, v, window=(8, 0), deterministic=True).split("\n\n")[0])
grads_checked("the explained backward", q, k, v, window=(8, 0), deterministic=True)

print("\n  a GPU problem explained anywhere (Problem by hand, arch sm90):")
problem = fmha.Problem(batch=4, nhead_q=32, nhead_k=8, seqlen_q=8192, seqlen_k=8192, head_dim_qk=256,
                       head_dim_v=256, dtype=fmha.DType.BF16, arch="sm90", causal=True, window=(-1, 0))
text = fmha.get_dispatcher().explain(problem)
print("  " + text.replace("\n", "\n  "))
assert "selected: fwd_" in text
print("\n  the CLI: fmha kernels explain --arch sm90 --dtype bf16 --hdim-q 256 --seqlen-q 8192 --causal")
rc = cli.main(["kernels", "explain", "--arch", "sm90", "--dtype", "bf16", "--hdim-q", "256", "--seqlen-q", "8192",
               "--causal"])
assert rc == 0, rc

print("\n  a decode step over a paged float8 cache (explain_kvcache; nothing runs, the cache is not written):")
pages, page = 8, 16
kc = (torch.randn(pages, page, 2, 64, generator=gen) / 4).to(q.device).to(torch.float8_e4m3fn)
table = torch.randperm(pages, generator=gen).reshape(2, 4).int().to(q.device)
lens = torch.tensor([50, 17], dtype=torch.int32, device=q.device)
q1 = torch.randn(2, 1, 8, 64, generator=gen).to(q.device, torch.bfloat16)
text = fmha.explain_kvcache(q1, kc, kc, cache_seqlens=lens, block_table=table, num_splits=2)
print("  " + text.split("\n\n")[0].replace("\n", "\n  "))
assert "fp8_kv_cache paged_kv" in text and "key splits: 2 (num_splits=2)" in text
o = fmha.attention_with_kvcache(q1, kc, kc, cache_seqlens=lens, block_table=table, num_splits=2)
for b in range(2):  # against float64 on the dequantized pages
    n = int(lens[b])
    kb = kc[table[b].long()].reshape(-1, 2, 64)[:n].double().transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q1[b].double().transpose(0, 1), kb.repeat_interleave(4, 0), kb.repeat_interleave(4, 0))
    err = (o[b].double().transpose(0, 1) - ref).abs().max().item()
    assert err < 2e-2, err
print("  the explained decode step: checked against float64")
done()
