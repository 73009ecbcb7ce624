"""GPU robustness (`pytest -m gpu`, H200): extreme lengths, extreme values, masked rows,
random problems at GPU sizes, a damaged kernel cache, and the exact-delta backward.

Truths are float64 on the GPU. Where a (Sq, Sk) matrix would not fit (512k-key decode,
128k training) the truth is computed in chunks of keys (online softmax in float64) for
the rows (or key columns) checked. Budget: about 2 minutes, most of it kernel compiles.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import fmha
from fmha.kernels.launch import jit_cache as kernel_cache
from fmha.kernels.launch import loader
from fmha.testing import numerics

from attn_testing import check_attention, check_backward, randn

pytestmark = pytest.mark.gpu
CUDA = "cuda"
GiB = 1 << 30


def _rows_truth(q_rows, rows, k, v, *, scale, causal, chunk=16384):
    """float64 (o, lse) of query rows `rows` (bottom-right causal when Sq == Sk: row i sees
    keys j <= i) over all keys, in chunks of keys: no (rows x Sk) buffer beyond one chunk.

    q_rows: (H, R, D) any dtype; rows: (R,) int64 positions; k, v: (Hk, Sk, D)."""
    H, R, _ = q_rows.shape
    group = H // k.shape[0]
    q64 = q_rows.double()
    m = torch.full((H, R, 1), -math.inf, dtype=torch.float64, device=q_rows.device)
    den = torch.zeros((H, R, 1), dtype=torch.float64, device=q_rows.device)
    acc = torch.zeros((H, R, v.shape[-1]), dtype=torch.float64, device=q_rows.device)
    last = int(rows.max()) if causal else k.shape[1] - 1
    for start in range(0, last + 1, chunk):  # causal: key chunks right of every row are skipped
        kc = k[:, start:start + chunk].double().repeat_interleave(group, 0)
        vc = v[:, start:start + chunk].double().repeat_interleave(group, 0)
        s = torch.matmul(q64, kc.transpose(-1, -2)) * scale
        if causal:
            cols = torch.arange(start, start + kc.shape[1], device=q_rows.device)
            s = s.masked_fill(cols[None, None, :] > rows[None, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(s - safe)
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)
        m = m_new
    return acc / den, (torch.log(den) + m).squeeze(-1)


def _rows_baseline(q_rows, rows, k, v, *, scale, causal):
    """The 2x rule's baseline for those rows: the same math at the inputs' dtype, as
    numerics.torch_attention does it (logits from a bf16 matmul, softmax in fp32, P rounded)."""
    group = q_rows.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = torch.matmul(q_rows, kk.transpose(-1, -2)).float() * scale
    if causal:
        cols = torch.arange(k.shape[1], device=q_rows.device)
        s = s.masked_fill(cols[None, None, :] > rows[None, :, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.matmul(p.to(q_rows.dtype), vv), lse


# ----------------------------------------------------------------------------------------
# Extreme lengths.


def test_decode_over_512k_keys_matches_a_chunked_float64_truth(rng):
    B, Hq, Hk, D, S = 1, 32, 8, 128, 512 * 1024
    kc = randn((B, S, Hk, D), torch.bfloat16, rng, CUDA)  # 1 GiB each
    vc = randn((B, S, Hk, D), torch.bfloat16, rng, CUDA)
    q = randn((B, 1, Hq, D), torch.bfloat16, rng, CUDA)
    seqlens = torch.full((B,), S, dtype=torch.int32, device=CUDA)
    o, lse = fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=True)
    assert o.shape == (B, 1, Hq, D) and lse.shape == (B, Hq, 1)
    scale = D ** -0.5
    q_rows = q[0].transpose(0, 1)  # (Hq, 1, D)
    k, v = kc[0].transpose(0, 1), vc[0].transpose(0, 1)  # (Hk, S, D) views
    rows = torch.tensor([S - 1], device=CUDA)
    ref_o, ref_lse = _rows_truth(q_rows, rows, k, v, scale=scale, causal=False)
    base_o, base_lse = _rows_baseline(q_rows, rows, k, v, scale=scale, causal=False)
    ours = o[0].transpose(0, 1)
    for c in (numerics.compare("o", ours, ref_o, base_o, torch.bfloat16),
              numerics.compare("lse", lse[0], ref_lse, base_lse, torch.float32)):
        assert c.ok, str(c)


def test_128k_training_step_memory_and_sampled_rows(rng):
    """Forward + backward at 128k tokens (causal, GQA): peak memory is the tensors plus a
    documented margin (an S x S term would be 32 GiB per head), and o, lse, dq of sampled
    rows and dk, dv of sampled key columns match float64 truths computed in chunks."""
    B, Hq, Hk, S, D = 1, 8, 4, 128 * 1024, 128
    dt = torch.bfloat16
    q = randn((B, Hq, S, D), dt, rng, CUDA).requires_grad_()
    k = randn((B, Hk, S, D), dt, rng, CUDA).requires_grad_()
    v = randn((B, Hk, S, D), dt, rng, CUDA).requires_grad_()
    do = randn((B, Hq, S, D), dt, rng, CUDA)
    fmha.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], causal=True).sum().backward()  # compile
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    o.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    q_bytes, kv_bytes = q.numel() * 2, k.numel() * 2
    # What the step must hold beyond its inputs: o and lse (kept for backward), dq, dk, dv,
    # dq's fp32 accumulator (2 x q), delta; margin: 10 % + 64 MiB (allocator rounding).
    needed = q_bytes + lse.numel() * 4 + q_bytes + 2 * kv_bytes + 2 * q_bytes + lse.numel() * 4
    assert extra <= 1.10 * needed + 64 * (1 << 20), (extra / GiB, needed / GiB)

    scale = D ** -0.5
    gen = torch.Generator(device=CUDA).manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    rows = torch.cat([torch.tensor([0, 1, 63, 64, S - 1], device=CUDA),
                      torch.randint(0, S, (27,), device=CUDA, generator=gen)]).sort().values
    qr = q.detach()[0][:, rows]  # (Hq, R, D)
    kk, vv = k.detach()[0], v.detach()[0]
    # o, lse: 2x rule against the bf16 baseline of the same rows
    ref_o, ref_lse = _rows_truth(qr, rows, kk, vv, scale=scale, causal=True)
    base_o, base_lse = _rows_baseline(qr, rows, kk, vv, scale=scale, causal=True)
    for c in (numerics.compare("o", o.detach()[0][:, rows], ref_o, base_o, dt),
              numerics.compare("lse", lse[0][:, rows], ref_lse, base_lse, torch.float32)):
        assert c.ok, str(c)
    # dq of those rows: row i's dq depends only on row i (autograd through the row functions)
    dor = do[0][:, rows]
    q64 = qr.double().requires_grad_()
    (ref_dq,) = torch.autograd.grad(_rows_truth(q64, rows, kk, vv, scale=scale, causal=True)[0], q64,
                                    dor.double())
    qb = qr.clone().requires_grad_()
    (base_dq,) = torch.autograd.grad(_rows_baseline(qb, rows, kk, vv, scale=scale, causal=True)[0], qb, dor)
    c = numerics.compare("dq", q.grad[0][:, rows], ref_dq, base_dq, dt)
    assert c.ok, str(c)
    # dk, dv of sampled key columns (all rows contribute), in float64 from fmha's lse (validated
    # above) and delta = rowsum(dO * O) with O in float64 from this truth's forward
    cols = torch.cat([torch.tensor([0, S // 2, S - 1], device=CUDA),
                      torch.randint(0, S, (13,), device=CUDA, generator=gen)]).sort().values
    group = Hq // Hk
    ref_dk = torch.zeros((Hk, cols.numel(), D), dtype=torch.float64, device=CUDA)
    ref_dv = torch.zeros_like(ref_dk)
    chunk = 8192
    for start in range(0, S, chunk):
        r = torch.arange(start, min(start + chunk, S), device=CUDA)
        qc = q.detach()[0][:, r].double()
        doc = do[0][:, r].double()
        o64, _ = _rows_truth(q.detach()[0][:, r], r, kk, vv, scale=scale, causal=True, chunk=4096)
        delta = (doc * o64).sum(-1, keepdim=True)
        kc = kk[:, cols].double().repeat_interleave(group, 0)
        vc = vv[:, cols].double().repeat_interleave(group, 0)
        s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        p = torch.exp(s - lse[0][:, r, None].double()).masked_fill(cols[None, None, :] > r[None, :, None], 0.0)
        dp = torch.matmul(doc, vc.transpose(-1, -2))
        ds = p * (dp - delta)
        ref_dv += torch.matmul(p.transpose(-1, -2), doc).unflatten(0, (Hk, group)).sum(1)
        ref_dk += (torch.matmul(ds.transpose(-1, -2), qc) * scale).unflatten(0, (Hk, group)).sum(1)
    # No same-dtype baseline exists for a key column at this size; bound: 2^-6 of the column
    # block's largest value (bf16 output rounding alone is 2^-9) plus the bf16 slack.
    for name, ours, ref in (("dk", k.grad[0][:, cols], ref_dk), ("dv", v.grad[0][:, cols], ref_dv)):
        err = numerics.max_abs_error(ours, ref)
        bound = ref.abs().max().item() / 64 + numerics.SLACK[dt]
        assert err <= bound, (name, err, bound)


# ----------------------------------------------------------------------------------------
# Extreme values and masked rows.


def test_huge_logits_stay_finite_and_accurate(rng):
    """fp16 q scaled by 1e3: q.k up to ~4e4, scaled logits ~5e3 (the online softmax must
    not overflow; it is nearly one-hot). Head dim 64 keeps the fp16 baseline's q.k under
    65504, so that the 2x rule has a finite baseline to compare with."""
    B, H, S, D = 2, 8, 1024, 64
    q = randn((B, H, S, D), torch.float16, rng, CUDA, scale=1e3)
    k, v = randn((B, H, S, D), torch.float16, rng, CUDA), randn((B, H, S, D), torch.float16, rng, CUDA)
    assert torch.isfinite(q).all()
    assert torch.isfinite(numerics.torch_attention(q, k, v)[0]).all(), "baseline overflowed: the check would be void"
    o, lse = check_attention(q, k, v, truth="torch64")
    assert torch.isfinite(o).all() and torch.isfinite(lse).all() and lse.abs().max() > 1e3
    grads = check_backward(q, k, v, truth="torch64")
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("where", ["q", "k", "k_inf"])
def test_nan_and_inf_reach_only_the_rows_that_see_them(rng, where):
    B, H, S, D, h, j = 1, 4, 2048, 128, 2, 1500
    q, k, v = (randn((B, H, S, D), torch.bfloat16, rng, CUDA) for _ in range(3))
    clean, clean_lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    bad = {"q": q.clone(), "k": k.clone(), "k_inf": k.clone()}[where]
    bad[0, h, j, 7] = float("inf") if where == "k_inf" else float("nan")
    args = (bad, k, v) if where == "q" else (q, bad, v)
    o, lse = fmha.attention(*args, causal=True, return_lse=True)
    touched = torch.zeros((B, H, S), dtype=torch.bool, device=CUDA)
    if where == "q":
        touched[0, h, j] = True  # that query row only
    else:
        touched[0, h, j:] = True  # rows that see key j (causal: i >= j), of that head
    assert not torch.isfinite(o[touched]).any() or where == "k_inf"
    if where == "k_inf":  # +-inf logits: the rows that see them are not finite-and-equal to before
        assert (~torch.isfinite(o[touched]).all(-1) | (o[touched] != clean[touched]).any(-1)).all()
    # every other row is bitwise what it was (its tiles never touch the bad value)
    assert torch.equal(o[~touched], clean[~touched]) and torch.equal(lse[~touched], clean_lse[~touched])


def test_nan_in_v_does_not_reach_query_tiles_that_never_load_it(rng):
    """v[j] is multiplied by P[:, j] = 0 in rows that do not see j but share a tile with one
    that does (0 * NaN = NaN, as in FlashAttention); rows whose tiles never load it are clean."""
    B, H, S, D, j = 1, 4, 2048, 128, 1800
    q, k, v = (randn((B, H, S, D), torch.bfloat16, rng, CUDA) for _ in range(3))
    clean = fmha.attention(q, k, v, causal=True)
    bad = v.clone()
    bad[0, 1, j, 3] = float("nan")
    o = fmha.attention(q, k, bad, causal=True)
    assert torch.isnan(o[0, 1, j:, 3]).all()  # rows that see it, in the NaN's column
    safe = j - 256  # below the 128-row query tile of j and one tile of slack
    assert torch.equal(o[:, :, :safe], clean[:, :, :safe])
    assert torch.equal(o[:, [0, 2, 3]], clean[:, [0, 2, 3]])


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_gradients(rng):
    """Sq > Sk with the bottom-right causal diagonal: the first Sq - Sk rows see no key."""
    B, H, Sq, Sk, D = 2, 4, 2048, 1024, 128
    q = randn((B, H, Sq, D), torch.bfloat16, rng, CUDA)
    k, v = randn((B, H, Sk, D), torch.bfloat16, rng, CUDA), randn((B, H, Sk, D), torch.bfloat16, rng, CUDA)
    o, lse = check_attention(q, k, v, causal=True, truth="torch64")
    dead = slice(0, Sq - Sk)
    assert torch.equal(o[:, :, dead], torch.zeros_like(o[:, :, dead]))
    assert torch.isneginf(lse[:, :, dead]).all() and torch.isfinite(lse[:, :, Sq - Sk:]).all()
    grads = check_backward(q, k, v, causal=True, with_dlse=True, truth="torch64")  # dlse of a -inf lse: 0
    assert torch.equal(grads["dq"][:, :, dead], torch.zeros_like(grads["dq"][:, :, dead]))


# ----------------------------------------------------------------------------------------
# The exact delta (dbias, dsinks) and determinism at GPU sizes.


def test_dbias_broadcast_over_keys_is_zero_and_dsinks_accurate(rng):
    """A bias constant along the keys has gradient exactly 0; with delta from the rounded O
    it came out ~1e-2 (bf16). (fp16: tests/test_properties.py on the CPU.)"""
    dtype = torch.bfloat16
    B, H, S, D = 2, 8, 1024, 128
    q, k, v = (randn((B, H, S, D), dtype, rng, CUDA) for _ in range(3))
    bias = torch.zeros((B, H, S, 1), device=CUDA, requires_grad=True)
    o = fmha.attention(q, k, v, bias=bias, causal=True)
    (dbias,) = torch.autograd.grad(o, bias, randn(o.shape, dtype, rng, CUDA))
    assert dbias.abs().max().item() < 1e-4
    check_backward(q, k, v, sinks=randn((H,), torch.float32, rng, CUDA, scale=2.0),
                   bias=randn((1, H, S, S), torch.float32, rng, CUDA), causal=True, with_dlse=True,
                   truth="torch64")


def test_deterministic_backward_with_bias_grad_is_bitwise_reproducible(rng):
    B, Hq, Hk, S, D = 2, 8, 2, 1024, 128
    q, k, v = (randn((B, h, S, D), torch.bfloat16, rng, CUDA) for h in (Hq, Hk, Hk))
    bias = randn((1, Hq, S, S), torch.float32, rng, CUDA)
    do = randn((B, Hq, S, D), torch.bfloat16, rng, CUDA)
    runs = []
    for _ in range(4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        o = fmha.attention(*leaves[:3], bias=leaves[3], causal=True, deterministic=True)
        runs.append(torch.autograd.grad(o, leaves, do))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


# ----------------------------------------------------------------------------------------
# A damaged kernel cache at run time.


def test_a_truncated_cubin_is_evicted_and_recompiled_at_launch(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fwd = loader.family_module("triton.fwd", interpreted=False)
    module = fwd._module
    kernel_cache.clear_jit_caches(kernel_cache.jit_functions(module))  # compile into tmp_path
    # Head dim 72: the Triton forward (the Gluon one serves 64/128/256 on sm90).
    q, k, v = (randn((1, 2, 300, 72), torch.float16, rng, CUDA) for _ in range(3))
    want = fmha.attention(q, k, v, causal=True)
    cubins = list(tmp_path.rglob("*.cubin"))
    assert cubins, "the forward kernel should have been compiled into the test's cache"
    for cubin in cubins:
        cubin.write_bytes(cubin.read_bytes()[:1000])
    kernel_cache.clear_jit_caches(kernel_cache.jit_functions(module))  # as a new process would
    with pytest.warns(kernel_cache.CorruptCacheWarning, match="truncated"):
        got = fmha.attention(q, k, v, causal=True)
    assert torch.equal(got, want)
    assert kernel_cache.scan(tmp_path) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernel_cache.CorruptCacheWarning)
        assert torch.equal(fmha.attention(q, k, v, causal=True), want)
    kernel_cache.clear_jit_caches(kernel_cache.jit_functions(module))  # leave no kernel from tmp_path


# ----------------------------------------------------------------------------------------
# Random problems at GPU sizes (a few feature sets, so that compiles are shared).

FEATURE_SETS = {
    "causal": dict(causal=True),
    "window+sink_tokens+softcap+alibi": dict(window=(300, 40), sink_size=4, softcap=30.0, alibi=True),
    "bias+sinks+dropout": dict(bias=True, sinks=True, dropout_p=0.1),
}


@st.composite
def gpu_cases(draw):
    """Triton compiles a variant per integer argument that is 1 or a multiple of 16; batch,
    heads and (odd) lengths are drawn so that every example shares the same few variants
    (ragged tile edges are still everywhere). GQA groups 2 and 3."""
    nhead_k, group = draw(st.integers(2, 3)), draw(st.integers(2, 3))
    odd = st.integers(1, 749).map(lambda n: 2 * n + 1)
    return dict(batch=draw(st.integers(2, 3)), nhead_k=nhead_k, nhead_q=nhead_k * group,
                seqlen_q=draw(odd), seqlen_k=draw(odd), layout=draw(st.sampled_from(["bhsd", "bshd"])),
                features=draw(st.sampled_from(sorted(FEATURE_SETS))), seed=draw(st.integers(0, 2**31 - 1)),
                with_dlse=draw(st.booleans()))


@settings(max_examples=30, deadline=None, derandomize=False, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=gpu_cases())
def test_random_problems_at_gpu_sizes(case):
    """bf16, head dim 128, bottom-right masks (the interpreter covers other dims, fp16 and
    top-left alignment on the CPU, tests/test_properties.py)."""
    note(str(case))
    gen = torch.Generator().manual_seed(case["seed"])
    B, Hq, Hk, Sq, Sk, D = tuple(case[n] for n in ("batch", "nhead_q", "nhead_k", "seqlen_q", "seqlen_k")) + (128,)

    def make(h, s):
        shape = (B, h, s, D) if case["layout"] == "bhsd" else (B, s, h, D)
        return randn(shape, torch.bfloat16, gen, CUDA)

    q, k, v = make(Hq, Sq), make(Hk, Sk), make(Hk, Sk)
    kw = dict(FEATURE_SETS[case["features"]])
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand((B, Hq), generator=gen).to(CUDA) * 0.1
    if kw.pop("bias", False):
        kw["bias"] = randn((B, 1, Sq, Sk), torch.float32, gen, CUDA)
    if kw.pop("sinks", False):
        kw["sinks"] = randn((Hq,), torch.float32, gen, CUDA, scale=2.0)
    if "dropout_p" in kw:
        kw["seed"] = case["seed"]
    torch.manual_seed(case["seed"])
    check_attention(q, k, v, layout=case["layout"], truth="torch64", **kw)
    check_backward(q, k, v, layout=case["layout"], with_dlse=case["with_dlse"], truth="torch64", **kw)
