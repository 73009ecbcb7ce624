"""Batch prefill (varlen queries over a KV cache), FlashInfer/SGLang page tables and the
split policy: interpreter runs against the float64 reference at small shapes."""

import numpy as np
import pytest
import torch

import fmha
from fmha import reference
from fmha.compat.flash_attn import flash_attn_varlen_func
from fmha.testing.numerics import max_abs_error

from attn_testing import randn


def np64(t):
    return None if t is None else t.double().numpy()


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def cu(lengths):
    return i32(np.concatenate([[0], np.cumsum(lengths)]).tolist())


def page_pool(rng, *, num_pages, page_size, nhead_k=2, head_dim=32, dtype=torch.float32):
    return (randn((num_pages, page_size, nhead_k, head_dim), dtype, rng),
            randn((num_pages, page_size, nhead_k, head_dim), dtype, rng))


def indptr_tables(rng, lengths, page_size, num_pages):
    """Random disjoint pages for sequences of `lengths` tokens: (kv_indptr, kv_indices, kv_last_page_len)."""
    pages = [-(-n // page_size) for n in lengths]
    ids = torch.randperm(num_pages, generator=rng)[:sum(pages)].int()
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages, strict=True)]
    return cu(pages), ids, i32(last)


def check_against_reference(o, lse, kc, vc, ref, tol):
    ro, rl, rk, rv = ref
    assert not torch.isnan(o).any()
    assert max_abs_error(o, torch.from_numpy(ro)) < tol
    assert max_abs_error(lse, torch.from_numpy(rl)) < tol
    assert max_abs_error(kc, torch.from_numpy(rk)) < tol and max_abs_error(vc, torch.from_numpy(rv)) < tol


@pytest.mark.parametrize("page_size,num_splits", [(4, 1), (16, 3), (32, 0)])
def test_indptr_tables_match_the_reference_with_append_and_rotary(rng, page_size, num_splits):
    """Page 16/32 read one page id per key tile (the interpreter's BLOCK_N is 16); page 4 one
    per key. The tables describe the cache after the append of Snew = 2 tokens."""
    snew, lengths = 2, [37, 2, 50]
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    kc, vc = page_pool(rng, num_pages=num_pages, page_size=page_size)
    indptr, indices, last = indptr_tables(rng, lengths, page_size, num_pages)
    q = randn((3, 1, 4, 32), torch.float32, rng)
    k, v = randn((3, snew, 2, 32), torch.float32, rng), randn((3, snew, 2, 32), torch.float32, rng)
    cos, sin = randn((64, 8), torch.float32, rng), randn((64, 8), torch.float32, rng)
    kc2, vc2 = kc.clone(), vc.clone()
    o, lse = fmha.attention_with_kvcache(q, kc2, vc2, k=k, v=v, kv_indptr=indptr, kv_indices=indices,
                                         kv_last_page_len=last, rotary_cos=cos, rotary_sin=sin, causal=True,
                                         num_splits=num_splits, return_lse=True)
    table, seqlens = reference.page_table_from_indptr(indptr.numpy(), indices.numpy(), last.numpy(), page_size)
    assert seqlens.tolist() == lengths
    ref = reference.attention_with_kvcache(np64(q), np64(kc), np64(vc), k=np64(k), v=np64(v),
                                           cache_seqlens=seqlens - snew, block_table=table,
                                           rotary_cos=np64(cos), rotary_sin=np64(sin), causal=True)
    check_against_reference(o, lse, kc2, vc2, ref, 1e-4)


def test_indptr_tables_and_block_table_give_identical_results(rng):
    """Same pages through both forms: bitwise equal outputs (same kernel, same tiles)."""
    page_size, lengths = 16, [40, 0, 17]
    num_pages = 10
    kc, vc = page_pool(rng, num_pages=num_pages, page_size=page_size)
    indptr, indices, last = indptr_tables(rng, lengths, page_size, num_pages)
    table, seqlens = reference.page_table_from_indptr(indptr.numpy(), indices.numpy(), last.numpy(), page_size)
    q = randn((3, 2, 4, 32), torch.float32, rng)
    sinks = randn((4,), torch.float32, rng)
    kw = dict(window=(20, 0), sink_size=3, softcap=4.0, sinks=sinks, num_splits=2, return_lse=True)
    o1, l1 = fmha.attention_with_kvcache(q, kc, vc, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                         **kw)
    o2, l2 = fmha.attention_with_kvcache(q, kc, vc, block_table=torch.from_numpy(table).int(),
                                         cache_seqlens=torch.from_numpy(seqlens).int(), **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert torch.all(o1[1] == 0) and torch.equal(l1[1], sinks[:, None].expand(4, 2))  # the empty sequence


@pytest.mark.parametrize("page_size,num_splits", [(5, 1), (16, 2)])
def test_batch_prefill_mixes_decode_and_prefill_chunks_with_append(rng, page_size, num_splits):
    """Chunked prefill: sequence 0 decodes, 1 prefills a chunk after 3 cached tokens, 2 has no
    queries, 3 prefills its first chunk; causal bottom-right per sequence, RoPE, GQA 4:2."""
    q_lens, cached = [1, 7, 0, 20], [10, 3, 4, 0]
    pages_per_seq = -(-max(c + n for c, n in zip(cached, q_lens, strict=True)) // page_size)
    num_pages = 4 * pages_per_seq + 2
    kc, vc = page_pool(rng, num_pages=num_pages, page_size=page_size)
    table = torch.randperm(num_pages, generator=rng)[:4 * pages_per_seq].reshape(4, pages_per_seq).int()
    total = sum(q_lens)
    q = randn((total, 4, 32), torch.float32, rng)
    k, v = randn((total, 2, 32), torch.float32, rng), randn((total, 2, 32), torch.float32, rng)
    cos, sin = randn((64, 16), torch.float32, rng), randn((64, 16), torch.float32, rng)
    kc2, vc2 = kc.clone(), vc.clone()
    o, lse = fmha.attention_with_kvcache(q, kc2, vc2, k=k, v=v, cache_seqlens=i32(cached), block_table=table,
                                         cu_seqlens_q=cu(q_lens), max_seqlen_q=max(q_lens), rotary_cos=cos,
                                         rotary_sin=sin, rotary_interleaved=True, causal=True,
                                         num_splits=num_splits, return_lse=True)
    assert o.shape == (total, 4, 32) and lse.shape == (4, total)
    ref = reference.batch_prefill_with_kvcache(np64(q), np64(kc), np64(vc), cu(q_lens).numpy(), k=np64(k),
                                               v=np64(v), cache_seqlens=np.array(cached),
                                               block_table=table.numpy(), rotary_cos=np64(cos),
                                               rotary_sin=np64(sin), rotary_interleaved=True, causal=True)
    check_against_reference(o, lse, kc2, vc2, ref, 1e-4)


def test_batch_prefill_masks_softcap_alibi_and_sinks_on_a_contiguous_cache(rng):
    """No append: the cache already holds each sequence's chunk (flash_attn_varlen_func's convention)."""
    q_lens, cached = [3, 1, 18], [9, 30, 18]
    kc = randn((5, 32, 2, 32), torch.float16, rng)
    vc = randn((5, 32, 2, 32), torch.float16, rng)
    rows = i32([4, 0, 2])
    q = randn((sum(q_lens), 8, 32), torch.float16, rng)
    slopes = torch.rand((3, 8), generator=rng) * 0.3
    sinks = randn((8,), torch.float32, rng)
    kw = dict(window=(6, 0), sink_size=2, softcap=5.0)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=i32(cached), cache_batch_idx=rows,
                                         cu_seqlens_q=cu(q_lens), max_seqlen_q=18, alibi_slopes=slopes, sinks=sinks,
                                         num_splits=3, return_lse=True, **kw)
    ref = reference.batch_prefill_with_kvcache(np64(q), np64(kc), np64(vc), cu(q_lens).numpy(),
                                               cache_seqlens=np.array(cached), cache_batch_idx=rows.numpy(),
                                               alibi_slopes=np64(slopes), sinks=np64(sinks), **kw)
    check_against_reference(o, lse, kc, vc, ref, 3e-3)


def test_batch_prefill_with_indptr_tables_and_top_left_alignment(rng):
    page_size, q_lens, lengths = 16, [2, 5], [33, 5]  # lengths after the append
    kc, vc = page_pool(rng, num_pages=6, page_size=page_size)
    indptr, indices, last = indptr_tables(rng, lengths, page_size, 6)
    total = sum(q_lens)
    q = randn((total, 4, 32), torch.float32, rng)
    k, v = randn((total, 2, 32), torch.float32, rng), randn((total, 2, 32), torch.float32, rng)
    kc2, vc2 = kc.clone(), vc.clone()
    o, lse = fmha.attention_with_kvcache(q, kc2, vc2, k=k, v=v, kv_indptr=indptr, kv_indices=indices,
                                         kv_last_page_len=last, cu_seqlens_q=cu(q_lens), max_seqlen_q=5,
                                         causal=True, mask_align="top_left", return_lse=True)
    table, seqlens = reference.page_table_from_indptr(indptr.numpy(), indices.numpy(), last.numpy(), page_size)
    ref = reference.batch_prefill_with_kvcache(np64(q), np64(kc), np64(vc), cu(q_lens).numpy(), k=np64(k),
                                               v=np64(v), cache_seqlens=seqlens - np.array(q_lens),
                                               block_table=table, causal=True, mask_align="top_left")
    check_against_reference(o, lse, kc2, vc2, ref, 1e-4)


def test_flash_attn_varlen_func_with_block_table(rng):
    page_size, q_lens, k_lens = 8, [4, 1, 6], [4, 20, 11]
    kc, vc = page_pool(rng, num_pages=12, page_size=page_size)
    table = torch.randperm(12, generator=rng)[:9].reshape(3, 3).int()
    q = randn((sum(q_lens), 4, 32), torch.float32, rng)
    out, lse, probs = flash_attn_varlen_func(q, kc, vc, cu(q_lens), cu(k_lens), 6, 20, causal=True,
                                             block_table=table, return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(q_lens))
    ro, rl, _, _ = reference.batch_prefill_with_kvcache(np64(q), np64(kc), np64(vc), cu(q_lens).numpy(),
                                                        cache_seqlens=np.array(k_lens), block_table=table.numpy(),
                                                        causal=True)
    assert max_abs_error(out, torch.from_numpy(ro)) < 1e-4 and max_abs_error(lse, torch.from_numpy(rl)) < 1e-4
    with pytest.raises(NotImplementedError, match="dropout_p must be 0"):
        flash_attn_varlen_func(q, kc, vc, cu(q_lens), cu(k_lens), 6, 20, dropout_p=0.1, block_table=table)


def _bad_case(rng):
    kc, vc = page_pool(rng, num_pages=4, page_size=8)
    q = randn((2, 1, 4, 32), torch.float32, rng)
    tables = dict(kv_indptr=i32([0, 1, 3]), kv_indices=i32([0, 2, 3]), kv_last_page_len=i32([5, 8]))
    return q, kc, vc, tables


@pytest.mark.parametrize("change,message", [
    (dict(kv_indices=None), "missing: kv_indices"),
    (dict(block_table=i32([[0], [1]])), "not both"),
    (dict(cache_seqlens=i32([1, 1])), "not both"),
    (dict(kv_indptr=i32([1, 1, 3])), r"kv_indptr\[0\]=1 must be 0"),
    (dict(kv_indptr=i32([0, 2, 1])), "non-decreasing"),
    (dict(kv_indptr=i32([0, 1, 4])), "exceeds the 3 entries"),
    (dict(kv_indices=i32([0, 2, 9])), r"kv_indices\[2\]=9 is outside the page pool \[0, 4\)"),
    (dict(kv_last_page_len=i32([0, 8])), r"kv_last_page_len\[0\]=0 must be in \[1, page_size=8\]"),
    (dict(kv_last_page_len=i32([5, 9])), r"kv_last_page_len\[1\]=9"),
    (dict(kv_indptr=i32([0, 0, 3]), kv_last_page_len=i32([2, 8])), "has no pages, so it must be 0"),
    (dict(kv_indptr=i32([0, 1])), "kv_indptr has 2 entries; accepted: batch \\+ 1 = 3"),
    (dict(kv_last_page_len=torch.tensor([5, 8])), "kv_last_page_len.dtype"),
])
def test_bad_indptr_tables_name_the_argument(rng, change, message):
    q, kc, vc, tables = _bad_case(rng)
    kw = {**tables, **change}
    with pytest.raises((ValueError, TypeError), match=message):
        fmha.attention_with_kvcache(q, kc, vc, **{key: value for key, value in kw.items() if value is not None})


def test_appending_more_tokens_than_the_tables_describe_is_refused(rng):
    q, kc, vc, tables = _bad_case(rng)
    k = randn((2, 6, 2, 32), torch.float32, rng)
    with pytest.raises(ValueError, match="sequence 0 has 5 tokens in its pages but appends 6"):
        fmha.attention_with_kvcache(q, kc, vc, k=k, v=k.clone(), **tables)


@pytest.mark.parametrize("kw,message", [
    (dict(max_seqlen_q=3), "max_seqlen_q=3 is for packed"),
    (dict(cu_seqlens_q=i32([0, 1, 2])), "q must be packed"),
])
def test_bad_varlen_query_arguments(rng, kw, message):
    q, kc, vc, tables = _bad_case(rng)
    with pytest.raises(ValueError, match=message):
        fmha.attention_with_kvcache(q, kc, vc, **tables, **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(max_seqlen_q=None), "needs max_seqlen_q"),
    (dict(max_seqlen_q=1), "max_seqlen_q=1 is smaller than the longest sequence"),
    (dict(cu_seqlens_q=i32([0, 1, 4])), r"cu_seqlens_q\[-1\]=4 must equal the packed length 3"),
    (dict(k=torch.zeros(3, 3, 32)), r"k has shape \(3, 3, 32\); accepted with cu_seqlens_q: \(3, 2, 32\)"),
])
def test_bad_batch_prefill_arguments(rng, kw, message):
    _, kc, vc, tables = _bad_case(rng)
    args = dict(cu_seqlens_q=i32([0, 1, 3]), max_seqlen_q=2, **tables)
    args.update(kw)
    if "k" in args:
        args["v"] = args["k"].clone()
    with pytest.raises(ValueError, match=message):
        fmha.attention_with_kvcache(randn((3, 4, 32), torch.float32, rng), kc, vc, **args)


def test_split_policy_fills_the_gpu_and_round_trips_through_json():
    policy = fmha.SplitPolicy()
    assert fmha.SplitPolicy.from_dict(policy.to_dict()) == policy
    assert policy.splits(programs=256, key_tiles=128, sm_count=132) == 1  # already fills 264 slots
    splits = policy.splits(programs=64, key_tiles=512, sm_count=132)
    waves = 64 * splits / 264
    assert splits > 1 and waves / np.ceil(waves) >= 0.85
    assert policy.splits(programs=8, key_tiles=8, sm_count=132) == 2  # at least 4 key tiles per split
    assert fmha.SplitPolicy(max_splits=3).splits(programs=1, key_tiles=10**6, sm_count=132) == 3
    with pytest.raises(ValueError, match="programs_per_sm"):
        fmha.SplitPolicy(programs_per_sm=0)
    with pytest.raises(ValueError, match=r"no field\(s\) \['bogus'\]"):
        fmha.SplitPolicy.from_dict({"bogus": 1})
    dispatcher = fmha.Dispatcher(split_policy=fmha.SplitPolicy(max_splits=2))
    problem = fmha.Problem(batch=1, nhead_q=8, nhead_k=8, seqlen_q=1, seqlen_k=4096, head_dim_qk=64,
                           head_dim_v=64)
    assert dispatcher.num_splits(problem, 132, 16, 64) == 2


def test_reference_page_table_from_indptr_by_hand():
    table, seqlens = reference.page_table_from_indptr([0, 2, 2, 3], [7, 1, 4], [3, 0, 8], page_size=8)
    assert table.tolist() == [[7, 1], [0, 0], [4, 0]] and seqlens.tolist() == [11, 0, 8]
    with pytest.raises(ValueError, match="kv_last_page_len"):
        reference.page_table_from_indptr([0, 1], [0], [9], page_size=8)


def test_reference_batch_prefill_equals_varlen_attention_on_the_cached_keys():
    """Two references agree: batch prefill over a contiguous cache (no append) is varlen
    attention with each sequence's cached keys packed."""
    rng = np.random.default_rng()
    q_lens, k_lens = [3, 1, 5], [7, 2, 5]
    q = rng.standard_normal((sum(q_lens), 4, 8))
    kc, vc = rng.standard_normal((3, 9, 2, 8)), rng.standard_normal((3, 9, 2, 8))
    o, lse, _, _ = reference.batch_prefill_with_kvcache(q, kc, vc, cu(q_lens).numpy(), cache_seqlens=k_lens,
                                                        causal=True, window=(3, 0))
    k = np.concatenate([kc[b, :n] for b, n in enumerate(k_lens)])
    v = np.concatenate([vc[b, :n] for b, n in enumerate(k_lens)])
    ro, rl = reference.attention_varlen_fwd(q, k, v, cu(q_lens).numpy(), cu(k_lens).numpy(), causal=True,
                                            window=(3, 0))
    assert np.abs(o - ro).max() < 1e-12 and np.abs(lse - rl).max() < 1e-12
