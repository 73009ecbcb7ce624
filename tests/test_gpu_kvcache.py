"""GPU tests of the KV-cache paths at serving sizes (`pytest -m gpu`, on an H200): paged
decode through block tables and FlashInfer/SGLang tables, batch prefill, CUDA graphs.

The truth is `numerics.torch_attention` in float64 on the GPU, per sequence, over the keys
gathered from the cache; the bound is the FlashAttention 2x rule against the same
computation in bf16. The grid is chosen, not the full product, to stay near 2 minutes.
"""

import pytest
import torch

import fmha
from fmha.compat.flash_attn import flash_attn_varlen_func
from fmha.testing import numerics

from attn_testing import randn

pytestmark = pytest.mark.gpu
CUDA = "cuda"
BF16 = torch.bfloat16


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=CUDA)


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return i32(out)


class PagePool:
    """A shuffled page pool holding `lengths[b]` tokens per sequence (after any append)."""

    def __init__(self, rng, lengths, *, page_size, nhead_k, head_dim, spare_pages=0):
        self.page_size, self.lengths = page_size, list(lengths)
        self.pages = [-(-n // page_size) for n in lengths]
        total = sum(self.pages) + spare_pages
        self.k = randn((total, page_size, nhead_k, head_dim), BF16, rng, CUDA)
        self.v = randn((total, page_size, nhead_k, head_dim), BF16, rng, CUDA)
        perm = torch.randperm(total, device=CUDA).int()
        self.ids = [perm[sum(self.pages[:b]):sum(self.pages[:b + 1])] for b in range(len(lengths))]

    def block_table(self):
        width = max(1, max(self.pages))
        table = torch.zeros((len(self.lengths), width), dtype=torch.int32, device=CUDA)
        for b, ids in enumerate(self.ids):
            table[b, :ids.numel()] = ids
        return table

    def indptr_tables(self):
        last = [n - (p - 1) * self.page_size if p else 0 for n, p in zip(self.lengths, self.pages, strict=True)]
        return dict(kv_indptr=cu(self.pages), kv_indices=torch.cat(self.ids), kv_last_page_len=i32(last))

    def keys(self, b):
        """(1, Hk, L, D) keys and values of sequence b, from the (possibly updated) cache."""
        n = self.lengths[b]
        ids = self.ids[b].long()
        k = self.k[ids].reshape(-1, *self.k.shape[2:])[:n]
        v = self.v[ids].reshape(-1, *self.v.shape[2:])[:n]
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def check_sequences(o, lse, q, pool, q_ranges, lse_of, **mask):
    """Sequence b's queries q[q_ranges[b]] (bshd rows) against pool.keys(b), 2x rule."""
    for b, rows in enumerate(q_ranges):
        if rows.stop == rows.start:
            continue
        k, v = pool.keys(b)
        qb = q[rows].transpose(0, 1)[None] if q.dim() == 3 else q[b:b + 1].transpose(1, 2)
        ob = o[rows].transpose(0, 1)[None] if o.dim() == 3 else o[b:b + 1].transpose(1, 2)
        ref_o, ref_lse = numerics.torch_attention(qb, k, v, compute_dtype=torch.float64, **mask)
        base_o, base_lse = numerics.torch_attention(qb, k, v, **mask)
        c = numerics.compare("o", ob, ref_o, base_o, BF16)
        assert c.ok, (b, str(c))
        c = numerics.compare("lse", lse_of(lse, b, rows), ref_lse, base_lse, torch.float32)
        assert c.ok, (b, str(c))


def lengths_up_to(rng, batch, context):
    lengths = torch.randint(1, context + 1, (batch,), generator=rng).tolist()
    lengths[-1] = 1  # the shortest, and the longest (first, so that a batch of one is the longest)
    lengths[0] = context
    return lengths


# (batch, Hq, Hk, head_dim, page_size, context, table form)
DECODE_CASES = [
    (1, 32, 8, 128, 16, 131072, "block_table"),
    (256, 32, 8, 128, 16, 1024, "indptr"),
    (64, 64, 8, 128, 64, 4096, "indptr"),
    (8, 32, 8, 256, 256, 16384, "block_table"),
    (32, 64, 8, 64, 1, 2048, "block_table"),
    (16, 32, 8, 128, 256, 32768, "indptr"),
    (4, 32, 8, 128, 64, 65536, "block_table"),
]


@pytest.mark.parametrize("batch,nhead_q,nhead_k,head_dim,page_size,context,form", DECODE_CASES)
def test_paged_decode_step_at_serving_sizes(rng, batch, nhead_q, nhead_k, head_dim, page_size, context, form):
    """One decode step: append the new token (its slot already in the tables), attend causally."""
    lengths = lengths_up_to(rng, batch, context)  # after the append
    pool = PagePool(rng, lengths, page_size=page_size, nhead_k=nhead_k, head_dim=head_dim, spare_pages=3)
    q = randn((batch, 1, nhead_q, head_dim), BF16, rng, CUDA)
    kn, vn = (randn((batch, 1, nhead_k, head_dim), BF16, rng, CUDA) for _ in range(2))
    if form == "indptr":
        index = pool.indptr_tables()
    else:
        index = dict(block_table=pool.block_table(), cache_seqlens=i32([n - 1 for n in lengths]))
    o, lse = fmha.attention_with_kvcache(q, pool.k, pool.v, k=kn, v=vn, causal=True, return_lse=True, **index)
    for b in (0, batch - 1):  # the new tokens are in the cache at position L - 1
        k, v = pool.keys(b)
        assert torch.equal(k[0, :, -1], kn[b, 0]) and torch.equal(v[0, :, -1], vn[b, 0])
    check_sequences(o, lse, q, pool, [slice(b, b + 1) for b in range(batch)],
                    lambda lse, b, rows: lse[b:b + 1], causal=True)


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("form", ["block_table", "indptr"])
def test_planned_decode_calls_match_the_truth(rng, monkeypatch, form, num_splits):
    """A decode step repeated with new inputs of the same metadata (other lengths, pages, values)
    takes the call plan (kvcache._DecodeCallPlan) and the launchers' plans, launched through
    Triton's C launcher directly: each step against the float64 truth. The pool and the
    kv_indices buffer keep their sizes, as in a serving loop."""
    from fmha import kvcache

    batch, nhead_q, nhead_k, head_dim, page, context = 8, 32, 8, 128, 64, 8192
    capacity = batch * context // page
    full_path = []
    check_queries = kvcache._check_queries
    monkeypatch.setattr(kvcache, "_check_queries", lambda *a: full_path.append(1) or check_queries(*a))
    for _ in range(2):  # the first call makes the plans, the second runs them
        lengths = lengths_up_to(rng, batch, context)  # (the longest fills its table row: one width)
        pages = sum(-(-n // page) for n in lengths)
        pool = PagePool(rng, lengths, page_size=page, nhead_k=nhead_k, head_dim=head_dim,
                        spare_pages=capacity - pages)
        q = randn((batch, 1, nhead_q, head_dim), BF16, rng, CUDA)
        if form == "indptr":
            index = pool.indptr_tables()
            unused = torch.zeros(capacity - pages, dtype=torch.int32, device=CUDA)  # (past kv_indptr[-1])
            index["kv_indices"] = torch.cat([index["kv_indices"], unused])
        else:
            index = dict(block_table=pool.block_table(), cache_seqlens=i32(lengths))
        o, lse = fmha.attention_with_kvcache(q, pool.k, pool.v, causal=True, num_splits=num_splits,
                                             return_lse=True, **index)
        check_sequences(o, lse, q, pool, [slice(b, b + 1) for b in range(batch)],
                        lambda lse, b, rows: lse[b:b + 1], causal=True)
    assert len(full_path) == 1
    (planned,) = kvcache._DECODE_CALL_PLANS.values()
    assert (planned.combine is None) == (num_splits == 1)  # (num_splits=0 picks several here)
    assert all(p.plan.direct is not None for p in planned.launches)


def test_paged_and_contiguous_caches_give_identical_results(rng):
    """Same keys, same split count: page sizes 1, 64 (one id per tile) and 256, block table
    or indptr tables, give bitwise the contiguous cache's output."""
    batch, Hq, Hk, D, cap = 4, 32, 8, 128, 8192
    kc = randn((batch, cap, Hk, D), BF16, rng, CUDA)
    vc = randn((batch, cap, Hk, D), BF16, rng, CUDA)
    seqlens = i32([cap, 5000, 1, 777])
    q = randn((batch, 1, Hq, D), BF16, rng, CUDA)
    want = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=8)
    for page in (1, 64, 256):
        kp, vp = kc.reshape(batch * cap // page, page, Hk, D), vc.reshape(batch * cap // page, page, Hk, D)
        table = torch.arange(batch * cap // page, device=CUDA, dtype=torch.int32).reshape(batch, cap // page)
        got = fmha.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=8)
        assert torch.equal(got, want), page
        pages = (seqlens + page - 1) // page
        indptr = torch.cat([i32([0]), pages.cumsum(0).int()])
        indices = torch.cat([table[b, :int(pages[b])] for b in range(batch)])
        last = (seqlens - (pages - 1) * page).int()
        got = fmha.attention_with_kvcache(q, kp, vp, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                          num_splits=8)
        assert torch.equal(got, want), ("indptr", page)


# (decode sequences, prefill chunks as (queries, cached before), Hq, Hk, head_dim, page, form, features)
PREFILL_CASES = [
    (8, [(512, 4096), (2048, 0)], 32, 8, 128, 16, "block_table", False),
    (16, [(1000, 3000), (17, 100)], 64, 8, 128, 64, "indptr", True),
    (4, [(300, 1200)], 32, 8, 256, 256, "indptr", False),
    (6, [(128, 64)], 64, 8, 64, 1, "block_table", True),
]


@pytest.mark.parametrize("n_decode,chunks,nhead_q,nhead_k,head_dim,page_size,form,features", PREFILL_CASES)
def test_batch_prefill_mixed_with_decode(rng, n_decode, chunks, nhead_q, nhead_k, head_dim, page_size, form,
                                         features):
    """Chunked prefill and decode in one call: each sequence appends its queries' tokens and
    attends bottom-right causally (with a window, sink tokens, soft-cap, ALiBi and sink
    logits when `features`)."""
    q_lens = [1] * n_decode + [n for n, _ in chunks]
    cached = torch.randint(1, 8192, (n_decode,), generator=rng).tolist() + [c for _, c in chunks]
    lengths = [c + n for c, n in zip(cached, q_lens, strict=True)]
    pool = PagePool(rng, lengths, page_size=page_size, nhead_k=nhead_k, head_dim=head_dim)
    total = sum(q_lens)
    q = randn((total, nhead_q, head_dim), BF16, rng, CUDA)
    kn, vn = (randn((total, nhead_k, head_dim), BF16, rng, CUDA) for _ in range(2))
    mask = dict(causal=True)
    extra = {}
    if features:
        mask = dict(causal=True, window=(700, 0), sink_size=4, softcap=30.0)
        slopes = torch.rand(nhead_q, device=CUDA) * 0.01
        sinks = torch.randn(nhead_q, device=CUDA)
        extra = dict(alibi_slopes=slopes, sinks=sinks)
    if form == "indptr":
        index = pool.indptr_tables()
    else:
        index = dict(block_table=pool.block_table(), cache_seqlens=i32(cached))
    o, lse = fmha.attention_with_kvcache(q, pool.k, pool.v, k=kn, v=vn, cu_seqlens_q=cu(q_lens),
                                         max_seqlen_q=max(q_lens), return_lse=True, **index, **mask, **extra)
    assert o.shape == (total, nhead_q, head_dim) and lse.shape == (nhead_q, total)
    starts = cu(q_lens).tolist()
    ranges = [slice(starts[b], starts[b + 1]) for b in range(len(q_lens))]
    for b in (0, len(q_lens) - 1):
        k, _ = pool.keys(b)
        assert torch.equal(k[0, :, cached[b]:].transpose(0, 1), kn[ranges[b].start:ranges[b].stop])
    check_sequences(o, lse, q, pool, ranges, lambda lse, b, rows: lse[:, rows.start:rows.stop][None],
                    **mask, **extra)


def test_flash_attn_varlen_func_with_a_block_table(rng):
    q_lens, k_lens = [1, 300, 1, 64], [5000, 1300, 1, 64]
    pool = PagePool(rng, k_lens, page_size=16, nhead_k=8, head_dim=128)
    q = randn((sum(q_lens), 32, 128), BF16, rng, CUDA)
    out, lse, _ = flash_attn_varlen_func(q, pool.k, pool.v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens),
                                         causal=True, block_table=pool.block_table(), return_attn_probs=True)
    starts = cu(q_lens).tolist()
    check_sequences(out, lse, q, pool, [slice(starts[b], starts[b + 1]) for b in range(4)],
                    lambda lse, b, rows: lse[:, rows.start:rows.stop][None], causal=True)


def test_paged_decode_with_indptr_tables_captured_in_a_cuda_graph(rng):
    """The tables' contents (not sizes) change between replays, as in a serving loop."""
    batch, Hq, Hk, D, page, pool_pages = 8, 32, 8, 128, 64, 600
    kc = randn((pool_pages, page, Hk, D), BF16, rng, CUDA)
    vc = randn((pool_pages, page, Hk, D), BF16, rng, CUDA)
    q = randn((batch, 1, Hq, D), BF16, rng, CUDA)
    kn, vn = (randn((batch, 1, Hk, D), BF16, rng, CUDA) for _ in range(2))
    budget = 512  # kv_indices buffer of a fixed size
    indptr, last = i32([0] * (batch + 1)), i32([1] * batch)
    indices = torch.zeros(budget, dtype=torch.int32, device=CUDA)

    def load(lengths):
        pages = [-(-n // page) for n in lengths]
        indptr.copy_(cu(pages))
        perm = torch.randperm(pool_pages, device=CUDA)[:sum(pages)].int()
        indices[:perm.numel()] = perm
        last.copy_(i32([n - (p - 1) * page for n, p in zip(lengths, pages, strict=True)]))
        q.copy_(torch.randn_like(q))

    def step():
        return fmha.attention_with_kvcache(q, kc, vc, k=kn, v=vn, kv_indptr=indptr, kv_indices=indices,
                                           kv_last_page_len=last, causal=True, num_splits=4)
    load([100] * batch)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([3000, 1, 64, 65, 4000, 129, 2, 777], [1] * batch, [4096] * batch):
        load(lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@pytest.mark.parametrize("num_splits", [0, 1])
def test_planned_decode_step_captured_in_a_cuda_graph(rng, monkeypatch, num_splits):
    """A plain decode step (no append) captured once its call plan exists: the capture records
    the plan's direct launches, and replays with new lengths, tables and queries give what an
    eager step gives then."""
    from fmha import kvcache

    batch, Hq, Hk, D, page, pages = 8, 32, 8, 128, 64, 64
    kc = randn((batch * pages, page, Hk, D), BF16, rng, CUDA)
    vc = randn((batch * pages, page, Hk, D), BF16, rng, CUDA)
    table = torch.randperm(batch * pages, device=CUDA).int().reshape(batch, pages)
    seqlens = i32([4096] * batch)
    q = randn((batch, 1, Hq, D), BF16, rng, CUDA)
    full_path = []
    check_queries = kvcache._check_queries
    monkeypatch.setattr(kvcache, "_check_queries", lambda *a: full_path.append(1) or check_queries(*a))

    def step():
        return fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True,
                                           num_splits=num_splits)
    step()  # compile and plan outside the capture
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert len(full_path) == 1  # (the second call and the captured one ran the plan)
    for lengths in ([4096, 1, 64, 65, 3000, 129, 2, 777], [1] * batch):
        seqlens.copy_(i32(lengths))
        table.copy_(torch.randperm(batch * pages, device=CUDA).int().reshape(batch, pages))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


def test_batch_prefill_captured_in_a_cuda_graph(rng):
    """Fixed max_seqlen_q and total_q; the split of queries among sequences and the cache
    lengths change between replays."""
    Hq, Hk, D, page, width = 32, 8, 128, 16, 256
    batch, total, max_q = 4, 96, 64
    kc = randn((batch * width, page, Hk, D), BF16, rng, CUDA)
    vc = randn((batch * width, page, Hk, D), BF16, rng, CUDA)
    table = torch.randperm(batch * width, device=CUDA).int().reshape(batch, width)
    q = randn((total, Hq, D), BF16, rng, CUDA)
    cu_q, seqlens = cu([24] * batch), i32([100] * batch)

    def step():
        return fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, cu_seqlens_q=cu_q,
                                           max_seqlen_q=max_q, causal=True)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for q_lens, lengths in (([64, 1, 1, 30], [64, 4000, 1, 2000]), ([1, 1, 30, 64], [9, 1, 30, 4096])):
        cu_q.copy_(cu(q_lens))
        seqlens.copy_(i32(lengths))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
