"""Batch prefill over a paged KV cache: chunked prefill and decode in one call.

A serving step as SGLang or FlashInfer schedule it: some sequences decode one token, one
continues a long prompt chunk by chunk, one starts a new prompt. Their queries are packed
into one (total_q, Hq, D) tensor with `cu_seqlens_q`; the cache is a pool of pages and
each sequence's pages are listed by FlashInfer/SGLang tables (`kv_indptr`, `kv_indices`,
`kv_last_page_len`), which already count this step's new tokens. One call writes the new
keys and values into their pages and attends, each sequence causally over its own keys
(query t of a sequence with L keys and n queries sits at position L - n + t).

    python examples/22_batch_prefill.py

Runs on the GPU if there is one, else through Triton's interpreter at small sizes, and
checks the result against the float64 reference (fmha.reference).
"""

import numpy as np
import torch

import fmha
from fmha import reference
from fmha.compat.flash_attn import flash_attn_varlen_func

from _common import done, header

header("22 batch prefill over a paged cache")

device = "cuda" if torch.cuda.is_available() else "cpu"
gpu = device == "cuda"
dtype = torch.bfloat16 if gpu else torch.float32
torch.manual_seed(0)

nhead_q, nhead_k, head_dim, page_size = (32, 8, 128, 64) if gpu else (4, 2, 32, 16)
scale = 8 if gpu else 1
# (tokens already cached, new tokens this step) per sequence
sequences = [(300 * scale, 1), (41 * scale, 1), (100 * scale, 24 * scale), (0, 37 * scale)]
cached = [c for c, _ in sequences]
q_lens = [n for _, n in sequences]
lengths = [c + n for c, n in sequences]  # after this step's append

# The page pool and the tables (a real server allocates pages as sequences grow).
pages = [-(-n // page_size) for n in lengths]
num_pages = sum(pages) + 4
k_cache = torch.randn(num_pages, page_size, nhead_k, head_dim, device=device, dtype=dtype)
v_cache = torch.randn(num_pages, page_size, nhead_k, head_dim, device=device, dtype=dtype)
kv_indices = torch.randperm(num_pages, device=device)[:sum(pages)].int()
kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), device=device, dtype=torch.int32)
kv_last_page_len = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, pages, strict=True)],
                                device=device, dtype=torch.int32)

# Packed queries and the new keys/values (one per query).
cu_seqlens_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), device=device, dtype=torch.int32)
total_q = sum(q_lens)
q = torch.randn(total_q, nhead_q, head_dim, device=device, dtype=dtype)
k_new = torch.randn(total_q, nhead_k, head_dim, device=device, dtype=dtype)
v_new = torch.randn(total_q, nhead_k, head_dim, device=device, dtype=dtype)
k_before, v_before = k_cache.cpu().double().numpy(), v_cache.cpu().double().numpy()

o, lse = fmha.attention_with_kvcache(
    q, k_cache, v_cache, k=k_new, v=v_new, kv_indptr=kv_indptr, kv_indices=kv_indices,
    kv_last_page_len=kv_last_page_len, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(q_lens),
    causal=True, return_lse=True)

# The float64 truth: the same step, one sequence at a time.
table, seqlens = reference.page_table_from_indptr(kv_indptr.cpu().numpy(), kv_indices.cpu().numpy(),
                                                  kv_last_page_len.cpu().numpy(), page_size)
assert seqlens.tolist() == lengths
ro, rl, rk, rv = reference.batch_prefill_with_kvcache(
    q.cpu().double().numpy(), k_before, v_before, cu_seqlens_q.cpu().numpy(), k=k_new.cpu().double().numpy(),
    v=v_new.cpu().double().numpy(), cache_seqlens=np.array(cached), block_table=table, causal=True)
o_err = float(np.abs(o.cpu().double().numpy() - ro).max())
lse_err = float(np.abs(lse.cpu().double().numpy() - rl).max())
cache_err = float(np.abs(k_cache.cpu().double().numpy() - rk).max())
tol = 2e-2 if gpu else 1e-4
print(f"{device}: {len(sequences)} sequences, {total_q} queries (decode {q_lens[:2]}, prefill chunks "
      f"{q_lens[2:]}), {sum(lengths)} keys in pages of {page_size}")
print(f"max |o - truth| = {o_err:.2e}, max |lse - truth| = {lse_err:.2e}, new keys in the cache: "
      f"max error {cache_err:.1e} (tolerance {tol:g})")
if not (o_err < tol and lse_err < tol and cache_err == 0.0):
    raise SystemExit("batch prefill does not match the reference")

# The same attention through flash_attn's interface, now that the new tokens are cached:
# cu_seqlens_k counts each sequence's keys, block_table lists its pages.
block_table = torch.from_numpy(table).to(device=device, dtype=torch.int32)
cu_seqlens_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device, dtype=torch.int32)
o2 = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max(q_lens), max(lengths),
                            causal=True, block_table=block_table)
diff = float((o.float() - o2.float()).abs().max())
if not diff < tol:
    raise SystemExit(f"flash_attn_varlen_func(block_table=...) differs from attention_with_kvcache by {diff}")
done(f"flash_attn_varlen_func(block_table=...) gives the same output (max difference {diff:.1e}): ok")
