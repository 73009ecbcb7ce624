"""KV-cache attention (append, RoPE, paged, split-KV) and merge_states, interpreter vs reference."""

import numpy as np
import pytest
import torch

import fmha
from fmha import reference
from fmha.problem import DType, MaskAlign
from fmha.testing.numerics import max_abs_error

from attn_testing import randn


def np64(t):
    return None if t is None else t.double().numpy()


def paged_case(rng, *, batch=3, seqlen_q=2, nhead_q=4, nhead_k=2, head_dim=32, page_size=5,
               pages_per_seq=6, dtype=torch.float32):
    num_pages = batch * pages_per_seq + 3
    q = randn((batch, seqlen_q, nhead_q, head_dim), dtype, rng)
    k_cache = randn((num_pages, page_size, nhead_k, head_dim), dtype, rng)
    v_cache = randn((num_pages, page_size, nhead_k, head_dim), dtype, rng)
    block_table = torch.randperm(num_pages, generator=rng)[:batch * pages_per_seq]
    return q, k_cache, v_cache, block_table.reshape(batch, pages_per_seq).int()


def check(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens, tol=1e-4, **kw):
    kc, vc = k_cache.clone(), v_cache.clone()
    o, lse = fmha.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=cache_seqlens,
                                         return_lse=True, **kw)
    ref_kw = {key: kw[key] for key in ("block_table", "cache_batch_idx", "rotary_interleaved", "causal",
                                       "window", "mask_align", "sink_size", "softcap", "scale") if key in kw}
    for key in ("rotary_cos", "rotary_sin", "alibi_slopes", "sinks"):
        if kw.get(key) is not None:
            ref_kw[key] = np64(kw[key])
    for key in ("block_table", "cache_batch_idx"):
        if ref_kw.get(key) is not None:
            ref_kw[key] = ref_kw[key].numpy()
    ro, rl, rk, rv = reference.attention_with_kvcache(
        np64(q), np64(k_cache), np64(v_cache), k=np64(k), v=np64(v),
        cache_seqlens=cache_seqlens.numpy(), **ref_kw)
    assert not torch.isnan(o).any()
    assert max_abs_error(o, torch.from_numpy(ro)) < tol
    assert max_abs_error(lse, torch.from_numpy(rl)) < tol
    assert max_abs_error(kc, torch.from_numpy(rk)) < tol and max_abs_error(vc, torch.from_numpy(rv)) < tol
    return o


@pytest.mark.parametrize("num_splits", [1, 2, 7, 0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_paged_append_with_rotary_and_splits(rng, num_splits, interleaved):
    q, kc, vc, bt = paged_case(rng)
    k, v = randn((3, 2, 2, 32), torch.float32, rng), randn((3, 2, 2, 32), torch.float32, rng)
    cos, sin = randn((64, 12), torch.float32, rng), randn((64, 12), torch.float32, rng)
    check(q, kc, vc, k=k, v=v, cache_seqlens=torch.tensor([3, 27, 0], dtype=torch.int32), block_table=bt,
          rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_any_page_size(rng, page_size):
    pages = -(-40 // page_size)
    q, kc, vc, bt = paged_case(rng, page_size=page_size, pages_per_seq=pages, seqlen_q=1)
    check(q, kc, vc, cache_seqlens=torch.tensor([40, 1, 23], dtype=torch.int32), block_table=bt,
          num_splits=3)


@pytest.mark.parametrize("offsets_32", [True, False])
def test_page_addressing_variants(rng, monkeypatch, offsets_32):
    """Pages of 16 (the page of a key is a shift), a V cache laid out unlike K (its own row
    offsets), and 64-bit offsets (what caches past 2**31 elements take) match the reference."""
    from fmha.kernels.triton import kvcache as kvcache_kernels

    monkeypatch.setattr(kvcache_kernels, "_offsets_fit_int32", lambda *caches: offsets_32)
    q, kc, vc, bt = paged_case(rng, page_size=16, pages_per_seq=3, seqlen_q=1)
    vc = vc.transpose(1, 2).contiguous().transpose(1, 2)  # head-major pages: other strides than K
    assert kc.stride() != vc.stride()
    check(q, kc, vc, cache_seqlens=torch.tensor([48, 17, 30], dtype=torch.int32), block_table=bt, num_splits=2)


def test_int32_offsets_only_where_they_fit():
    from fmha.kernels.triton.kvcache import _offsets_fit_int32

    fits = torch.empty((1024, 16, 8, 128), device="meta")  # 2**24 elements
    beyond = torch.empty((2**20, 16, 8, 128), device="meta")  # 2**34 elements
    assert _offsets_fit_int32(fits, fits) and not _offsets_fit_int32(fits, beyond)
    two_rows_far_apart = torch.empty((2, 2**31), device="meta")[:, :1]  # 2 elements, offset 2**31
    assert not _offsets_fit_int32(two_rows_far_apart)


def test_contiguous_cache_with_batch_index_and_decode_features(rng):
    q = randn((2, 3, 8, 32), torch.float16, rng)
    kc, vc = randn((4, 50, 2, 32), torch.float16, rng), randn((4, 50, 2, 32), torch.float16, rng)
    k, v = randn((2, 3, 2, 32), torch.float16, rng), randn((2, 3, 2, 32), torch.float16, rng)
    check(q, kc, vc, k=k, v=v, cache_seqlens=torch.tensor([10, 44], dtype=torch.int32),
          cache_batch_idx=torch.tensor([3, 1], dtype=torch.int32), window=(8, 0), sink_size=2,
          softcap=5.0, alibi_slopes=torch.rand(8, generator=rng) * 0.2,
          sinks=randn((8,), torch.float32, rng), num_splits=4, tol=3e-3)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_sink_logits_are_counted_once_across_splits(rng, num_splits):
    q, kc, vc, bt = paged_case(rng, seqlen_q=1)
    check(q, kc, vc, cache_seqlens=torch.tensor([30, 12, 5], dtype=torch.int32), block_table=bt,
          sinks=randn((4,), torch.float32, rng), num_splits=num_splits)


def test_empty_cache_rows_give_zero_output(rng):
    q, kc, vc, bt = paged_case(rng, seqlen_q=1)
    o = check(q, kc, vc, cache_seqlens=torch.tensor([0, 12, 0], dtype=torch.int32), block_table=bt,
              num_splits=2)
    assert torch.all(o[0] == 0) and torch.all(o[2] == 0)


def test_merge_states_matches_reference_and_handles_empty_parts(rng):
    outs = [randn((2, 3, 16), torch.float32, rng) for _ in range(3)]
    lses = [randn((2, 3), torch.float32, rng) for _ in range(3)]
    lses[1][0, 0] = float("-inf")
    for lse in lses:
        lse[1, 2] = float("-inf")
    o, lse = fmha.merge_states(outs, lses)
    ro, rl = reference.merge_states([np64(x) for x in outs], [np64(x) for x in lses])
    assert max_abs_error(o, torch.from_numpy(np.asarray(ro))) < 1e-6
    assert max_abs_error(lse, torch.from_numpy(np.asarray(rl))) < 1e-6
    assert torch.all(o[1, 2] == 0) and torch.isneginf(lse[1, 2])


@pytest.mark.parametrize("n_parts", [5, 16, 37])
def test_merge_states_reads_the_parts_in_chunks(rng, n_parts):
    """The combine reads up to COMBINE_PARTS partials of a row at once: counts below, at and
    above it (37: three chunks, the last partly masked), rows whose partials of a whole chunk are
    empty, a row with none, and a head dim that is not a power of two."""
    outs = [randn((3, 5, 24), torch.float32, rng) for _ in range(n_parts)]
    lses = [randn((3, 5), torch.float32, rng) * 4 for _ in range(n_parts)]
    for lse in lses[:16]:
        lse[0, 1] = float("-inf")  # row (0, 1): only partials past the first chunk count
    for lse in lses:
        lse[2, 4] = float("-inf")  # row (2, 4): nothing
    o, lse = fmha.merge_states(outs, lses)
    ro, rl = reference.merge_states([np64(x) for x in outs], [np64(x) for x in lses])
    assert max_abs_error(o, torch.from_numpy(np.asarray(ro))) < 1e-5
    finite = np.isfinite(np.asarray(rl))
    assert max_abs_error(lse[torch.from_numpy(finite)], torch.from_numpy(np.asarray(rl)[finite])) < 1e-5
    assert torch.all(o[2, 4] == 0) and torch.isneginf(lse[2, 4])
    assert (n_parts > 16) == bool(torch.isfinite(lse[0, 1]))


def test_combine_tile_fills_the_gpu_for_decode():
    """A split-KV decode's combine (256 rows, 4 splits) runs in 128 programs of 2 rows, all four
    partials of a row read at once; many partials are read 16 at a time."""
    from fmha.kernels.triton import kvcache as kernels

    assert kernels.combine_tile(4, 32) == (2, 4)
    assert kernels.combine_tile(1, 32) == (8, 1)
    assert kernels.combine_tile(100, 32) == (1, 16)
    assert kernels.combine_tile(3, 1) == (1, 4)


def test_split_attention_merged_equals_full_attention(rng):
    q, k, v = (randn((1, 2, 20, 16), torch.float32, rng) for _ in range(3))
    k2, v2 = randn((1, 2, 15, 16), torch.float32, rng), randn((1, 2, 15, 16), torch.float32, rng)
    o1, l1 = fmha.attention(q, k, v, return_lse=True)
    o2, l2 = fmha.attention(q, k2, v2, return_lse=True)
    o, lse = fmha.merge_states([o1, o2], [l1, l2])
    full_o, full_lse = fmha.attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), return_lse=True)
    assert max_abs_error(o, full_o) < 1e-5 and max_abs_error(lse, full_lse) < 1e-5


@pytest.mark.parametrize("bad,message", [
    (dict(block_table=torch.zeros(3, 6, dtype=torch.int64)), "block_table.dtype"),
    (dict(cache_seqlens=torch.tensor([3, 40, 0], dtype=torch.int32)), "exceeds the cache capacity"),
    (dict(rotary_cos=torch.ones(8, 4), rotary_sin=torch.ones(8, 4)), "pass k and v"),
    (dict(num_splits=200), "num_splits=200"),
    (dict(num_splits=True), "num_splits=True"),  # (a bool is an int to isinstance)
    (dict(block_table=torch.full((3, 6), 99, dtype=torch.int32)), "outside the page pool"),
])
def test_bad_kvcache_input_names_the_argument(rng, bad, message):
    q, kc, vc, bt = paged_case(rng)
    kw = dict(cache_seqlens=torch.tensor([3, 27, 0], dtype=torch.int32), block_table=bt)
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        fmha.attention_with_kvcache(q, kc, vc, **kw)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("mask", [dict(window=(40, 0), sink_size=5),
                                  dict(window=(30, 20), mask_align="top_left", sink_size=70),
                                  dict(causal=True)])
def test_splits_take_the_key_tiles_a_mask_shows(rng, num_splits, mask):
    """The splits divide the key tiles the rows see (sink tokens left of a window, the window, sink
    tokens right of it), not [0, len_k): whatever the split count, each visible key counts once."""
    q = randn((2, 3, 4, 16), torch.float32, rng)
    kc, vc = randn((2, 200, 2, 16), torch.float32, rng), randn((2, 200, 2, 16), torch.float32, rng)
    check(q, kc, vc, cache_seqlens=torch.tensor([200, 77], dtype=torch.int32), num_splits=num_splits, **mask)


def test_the_split_policy_counts_the_keys_a_window_shows():
    """num_splits=0 with a window: the policy splits the keys the window shows (left + queries +
    right + sink tokens), not the cache's capacity: a 128-key window over 32k keys is one split."""
    from fmha.problem import Problem

    dispatcher = fmha.Dispatcher(fmha.default_registry())
    problem = Problem(batch=8, nhead_q=32, nhead_k=8, seqlen_q=1, seqlen_k=32768, head_dim_qk=128, head_dim_v=128,
                      arch="sm90", seqused_k=True)
    splits = [dispatcher.num_splits(problem.with_(window=window, sink_size=sink), 132, 16, 64)
              for window, sink in (((-1, -1), 0), ((-1, 0), 0), ((127, 0), 0), ((127, 0), 32768))]
    assert splits[0] == splits[1] == splits[3] > 1 and splits[2] == 1, splits
    q, cache = torch.zeros((2, 1, 4, 16)), torch.zeros((2, 64, 2, 16))
    text = fmha.explain_kvcache(q, cache, cache, cache_seqlens=torch.full((2,), 64, dtype=torch.int32), window=(7, 0))
    splits_line = next(line for line in text.splitlines() if line.startswith("key splits: "))
    assert splits_line.endswith("over the 8 keys the window shows of 64)"), text


def test_sink_tokens_reach_queries_that_the_causal_window_hides(rng):
    """Bottom-right causal with more queries than keys: the first rows see only sink tokens."""
    q, kc, vc, bt = paged_case(rng, seqlen_q=20, pages_per_seq=2)
    check(q, kc, vc, cache_seqlens=torch.tensor([3, 9, 1], dtype=torch.int32), block_table=bt,
          causal=True, sink_size=2, num_splits=2)


def test_a_float8_cache_takes_its_own_decode_tile(rng, monkeypatch):
    """attention_with_kvcache marks a float8 cache in the Problem (feature fp8_kv_cache); on sm90
    a float8 cache at D=64, 128 and 256 takes the Gluon decode (attempts 106, 111), one at D=96 the
    Triton kernel, whose 64-key tile the default selection passes over for float8 caches (measured
    slower, attempt 57) for the 128-key one, while a 16-bit cache keeps the 64-key tile."""
    import fmha.kvcache as api_kvcache
    from fmha.api import get_dispatcher
    from fmha.dispatch.configs import Family
    from fmha.problem import Feature

    seen = []
    decode_plan = api_kvcache._decode_plan
    monkeypatch.setattr(api_kvcache, "_decode_plan", lambda d, problem, **kw: seen.append(problem)
                        or decode_plan(d, problem, **kw))
    q = randn((2, 1, 4, 32), torch.bfloat16, rng)
    for cache_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        cache = randn((2, 40, 2, 32), torch.float32, rng).to(cache_dtype)
        fmha.attention_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([40, 7], dtype=torch.int32))
    assert [p.kv_fp8 for p in seen] == [True, False]
    assert Feature.FP8_KV_CACHE in seen[0].features and Feature.FP8_KV_CACHE not in seen[1].features
    dispatcher = get_dispatcher()
    for kv_fp8, head_dim, block_n, warps in ((True, 128, 32, 1), (True, 64, 32, 1), (True, 256, 16, 1),
                                             (True, 96, 128, 4), (False, 128, 64, 4), (False, 64, 128, 4)):
        problem = seen[0].with_(arch="sm90", head_dim_qk=head_dim, head_dim_v=head_dim, seqlen_k=8192, kv_fp8=kv_fp8)
        config, why = dispatcher.select(problem, Family.FWD_SPLITKV)
        a = config.algorithm
        assert (a.block_m, a.block_n, a.num_warps) == (16, block_n, warps), config.name
        assert a.pipeline.is_gluon is (kv_fp8 and head_dim != 96), config.name
        assert ("1 passed over before it" in why) is (kv_fp8 and head_dim == 96), why
    assert "float8 KV cache: measured slower there than the next config" in dispatcher.explain(
        seen[0].with_(arch="sm90", head_dim_qk=96, head_dim_v=96), Family.FWD_SPLITKV)


@pytest.mark.parametrize("change, reason", [
    (dict(seqlen_q=5), "5 queries x 4 query heads per KV head = 20 rows: at most 16"),
    (dict(varlen=True), "packed varlen queries"),
    (dict(kv_fp8=False), "a float8 KV cache only"),
    (dict(nhead_q=64, nhead_k=2), "1 queries x 32 query heads per KV head = 32 rows: at most 16"),
    (dict(head_dim_qk=96, head_dim_v=96), "head dims (qk 96, v 96) are not equal and one of [128]"),
    (dict(dtype=DType.FP32), "dtype fp32 not in ['fp16', 'bf16']"),
    (dict(tma_aligned=False), "not 16-byte aligned"),
    (dict(arch="sm80"), "arch sm80 not in ['sm90']"),
])
def test_the_gluon_fp8_decode_serves_decode_steps_and_explain_says_why_not(change, reason):
    """The registry's Gluon decode (kernels/kvcache_gluon.py) takes up to 16 query rows a (sequence, KV
    head) over a float8 cache (contiguous or paged) at D=64, 128 or 256 on sm90, with every mask and score
    feature, split so that about four one-warp programs run an SM (its config's programs_per_sm); the
    rest goes to the Triton kernel, and explain names the reason."""
    from fmha.api import get_dispatcher
    from fmha.dispatch.configs import Family
    from fmha.problem import DType, Problem

    base = Problem(batch=32, nhead_q=32, nhead_k=8, seqlen_q=1, seqlen_k=8192, head_dim_qk=128, head_dim_v=128,
                   dtype=DType.BF16, layout="bshd", arch="sm90", seqused_k=True, kv_fp8=True)
    dispatcher = get_dispatcher()
    for problem in (base, base.with_(causal=True), base.with_(dtype=DType.FP16), base.with_(paged_kv=True),
                    base.with_(seqlen_q=4, causal=True), base.with_(causal=True, mask_align=MaskAlign.TOP_LEFT),
                    base.with_(window=(100, 0), sink_size=4), base.with_(alibi=True, softcap=5.0, sinks=True),
                    base.with_(nhead_q=128, seqlen_q=1)):
        config, _ = dispatcher.select(problem, Family.FWD_SPLITKV)
        assert config.algorithm.pipeline.is_gluon and config.algorithm.programs_per_sm == 4, config.name
    a = dispatcher.select(base, Family.FWD_SPLITKV)[0].algorithm
    # B=32 8k: 256 programs -> 2 splits (512); B=8 32k: 64 -> 8; 2048 programs: no split
    assert [dispatcher.num_splits(p, 132, a.block_m, a.block_n, a.programs_per_sm) for p in
            (base, base.with_(batch=8, seqlen_k=32768), base.with_(batch=256))] == [2, 8, 1]
    assert dispatcher.num_splits(base, 132, a.block_m, a.block_n) == 1  # (the policy's own 2 an SM)
    import fmha.kvcache as api_kvcache

    q8 = torch.zeros((32, 1, 32, 128), dtype=torch.bfloat16)
    cache = torch.zeros((32, 1024, 8, 128), dtype=torch.float8_e4m3fn)
    seqlens = torch.full((32,), 1024, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api_kvcache, "_arch", lambda device: "sm90")
        m.setattr(api_kvcache, "_sm_count", lambda device: 132)
        text = fmha.explain_kvcache(q8, cache, cache, cache_seqlens=seqlens)
    assert "_sm90_gluon_m16n32w1s3" in text.splitlines()[1], text
    assert "key splits: 2 (the split policy's, SplitPolicy(" in text
    assert "counting this kernel's 4 programs an SM" in text
    assert "(kernels.gluon.kvcache)" in text
    problem = base.with_(**change)
    config, _ = dispatcher.select(problem, Family.FWD_SPLITKV)
    assert not config.algorithm.pipeline.is_gluon, config.name
    line = next(line for line in dispatcher.explain(problem, Family.FWD_SPLITKV).splitlines() if "_gluon_" in line)
    assert "refused" in line and reason in line, line


def test_explain_kvcache_says_what_the_call_would_launch_and_why(rng, monkeypatch):
    """fmha.explain_kvcache: the call's plan (append, split-KV attention, combine), its key splits
    and every split-KV config's verdict, after the call's own checks; nothing is launched and the
    cache is not written. On the H200 path a float8 cache shows the 64-key tile passed over."""
    import fmha.kvcache as api_kvcache

    q = randn((2, 1, 8, 96), torch.bfloat16, rng)  # (D=96: the Triton kernel; 64, 128, 256 take the Gluon decode)
    cache = randn((2, 300, 2, 96), torch.float32, rng).to(torch.float8_e4m3fn)
    seqlens = torch.tensor([299, 100], dtype=torch.int32)
    new = randn((2, 1, 2, 96), torch.bfloat16, rng)
    before = cache.clone()
    text = fmha.explain_kvcache(q, cache, cache, k=new, v=new, cache_seqlens=seqlens, num_splits=3, causal=True)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # not written
    lines = text.splitlines()
    assert "fp8_kv_cache" in lines[0] and "causal" in lines[0]
    assert [line.split()[1] for line in lines[1:4]] == ["append_kv", "fwd_splitkv", "splitkv_combine"]
    assert "key splits: 3 (num_splits=3)" in text and "family: fwd_splitkv" in text
    with pytest.raises(ValueError, match="num_splits"):  # the call's checks
        fmha.explain_kvcache(q, cache, cache, cache_seqlens=seqlens, num_splits=True)
    with pytest.raises(TypeError):
        fmha.explain_kvcache(q, cache, cache, cache_seqlen=seqlens)
    monkeypatch.setattr(api_kvcache, "_arch", lambda device: "sm90")
    monkeypatch.setattr(api_kvcache, "_sm_count", lambda device: 132)
    text = fmha.explain_kvcache(q, cache, cache, cache_seqlens=seqlens)
    assert "fwd_splitkv_fp16-bf16_d1-128_cuda_triton_m16n128w4s3  (heuristic: first fit" in text
    assert "m16n64w4s3: fits, passed over by the default selection: float8 KV cache" in text
    assert "key splits: 1 (the split policy's, SplitPolicy(" in text
    cache16 = cache.to(torch.bfloat16)
    text16 = fmha.explain_kvcache(q, cache16, cache16, cache_seqlens=seqlens)
    assert "m16n64w4s3  (heuristic" in text16
    # the products' dtype of a float8 cache: fp16 for bf16 queries (scaled), q's own for fp16 ones
    assert ("float8 cache: converted to torch.float16 for the products (exact); bf16 queries scaled by a power "
            "of two into fp16's range per program, P by 2**15 (kernels.triton.kvcache)" in text)
    text_fp16 = fmha.explain_kvcache(q.half(), cache, cache, cache_seqlens=seqlens)
    assert "float8 cache: converted to torch.float16 for the products (exact)\n" in text_fp16
    assert "float8 cache" not in text16
