"""Ring attention (fmha.distributed) on CPU process groups: 2 and 4 gloo processes.

Each rank runs the interpreted kernels on its slice; the gathered output, LSE and
gradients must be as close to the float64 truth as single-device `fmha.attention` on
the full sequence (the 2x rule of fmha.testing.numerics). One spawn per world size runs all of
its cases (process start-up dominates at these sizes).
"""

import secrets

import pytest
import torch

from fmha.distributed import ring_attention, zigzag_shard, zigzag_unshard

from ring_testing import compare, spawn, torch64


def case(world, dtype, layout="bhsd", *, causal=True, zigzag=True, window=(-1, -1), nhead_q=2, nhead_k=1,
         head_dim=16, seqlen=64, batch=1, softcap=0.0, sinks=False, dlse=False, alibi=False):
    return dict(world=world, dtype=dtype, layout=layout, causal=causal, zigzag=zigzag, window=window, alibi=alibi,
                nhead_q=nhead_q, nhead_k=nhead_k, head_dim=head_dim, seqlen=seqlen, batch=batch,
                softcap=softcap, sinks=sinks, dlse=dlse)


CASES = {
    2: {
        "causal_zigzag_gqa_fp32": case(2, "float32", nhead_q=4, nhead_k=2),
        "causal_window_zigzag_fp16_bshd_softcap": case(2, "float16", "bshd", window=(13, 0), nhead_k=2,
                                                       head_dim=32, softcap=4.0),
        "full_gqa_sinks_dlse_alibi_fp32": case(2, "float32", causal=False, zigzag=False, batch=2, sinks=True,
                                               dlse=True, alibi=True),
        "two_sided_window_zigzag_alibi_fp32": case(2, "float32", causal=False, window=(9, 5), alibi=True),
    },
    4: {
        "causal_zigzag_gqa_sinks_softcap_fp32_bshd": case(4, "float32", "bshd", nhead_q=4, nhead_k=2,
                                                          softcap=3.0, sinks=True),
        "causal_contiguous_alibi_fp16_dlse": case(4, "float16", zigzag=False, head_dim=24, dlse=True,
                                                  alibi=True),
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world -> (seed, {name: comparisons}), each world spawned once."""
    cache = {}

    def get(world):
        if world not in cache:
            seed = secrets.randbits(30)
            names, cases = list(CASES[world]), list(CASES[world].values())
            outdir = tmp_path_factory.mktemp(f"ring{world}")
            gathered = spawn(world, cases, seed, str(outdir))
            cache[world] = (seed, {
                name: compare(c, ring, torch64(c, seed + i), single)
                for i, (name, c, (ring, single)) in enumerate(zip(names, cases, gathered, strict=True))})
        return cache[world]
    return get


@pytest.mark.parametrize("world,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_ring_matches_single_device(results, world, name):
    seed, comparisons = results(world)
    print(f"seed={seed}")
    for c in comparisons[name]:
        print(c)
    bad = [str(c) for c in comparisons[name] if not c.ok]
    assert not bad, f"{name} (seed {seed}): " + "; ".join(bad)


@pytest.mark.parametrize("world,dim", [(1, 2), (2, 2), (3, 1), (4, -2)])
def test_zigzag_shard_unshard_round_trip(world, dim):
    x = torch.randn(2, 3, 8 * world, 5)
    x = x if dim in (2, -2) else x.transpose(1, 2).contiguous()
    parts = [zigzag_shard(x, r, world, dim=dim) for r in range(world)]
    chunk = x.shape[dim] // (2 * world)
    # rank 0 holds the first and the last chunk
    assert torch.equal(parts[0].narrow(dim, 0, chunk), x.narrow(dim, 0, chunk))
    assert torch.equal(parts[0].narrow(dim, chunk, chunk), x.narrow(dim, x.shape[dim] - chunk, chunk))
    assert torch.equal(zigzag_unshard(torch.cat(parts, dim), world, dim=dim), x)


def test_zigzag_shard_refuses_uneven_lengths():
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 4"):
        zigzag_shard(torch.randn(1, 1, 6, 4), 0, 2)
    with pytest.raises(ValueError, match="rank=2"):
        zigzag_shard(torch.randn(1, 1, 8, 4), 2, 2)


def _qkv(seqlen=8, dtype=torch.float32):
    return [torch.randn(1, 2, seqlen, 16, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (5, 0), (3, 2), (-1, 4), (9, -1), (20, 7)])
@pytest.mark.parametrize("world,zigzag", [(1, False), (2, True), (3, False), (4, True)])
@pytest.mark.parametrize("by_chunk", [False, True])
def test_block_plan_covers_the_global_mask_exactly(world, zigzag, window, by_chunk):
    """Every visible (row, column) pair of the global mask is computed once, and nothing else."""
    import numpy as np

    from fmha import reference
    from fmha.distributed import _blocks

    seqlen = 8  # per rank
    total = seqlen * world
    truth = reference.visible_mask(total, total, window=window)
    positions = [zigzag_shard(torch.arange(total), r, world, dim=0) if zigzag else
                 torch.arange(r * seqlen, (r + 1) * seqlen) for r in range(world)]
    for rank in range(world):
        for src in range(world):
            covered = np.zeros((seqlen, seqlen), dtype=int)
            for rows, cols, (left, right), pos in _blocks(rank, src, world, seqlen, window, zigzag, by_chunk):
                if pos is not None:  # chunk pairs: the first row's and column's global positions
                    assert (int(positions[rank][rows][0]), int(positions[src][cols][0])) == pos[:2]
                sub = reference.visible_mask(len(range(seqlen)[rows]), len(range(seqlen)[cols]),
                                             window=(left, right), mask_align="top_left")
                covered[rows, cols] += sub
            qpos, kpos = positions[rank].numpy(), positions[src].numpy()
            np.testing.assert_array_equal(covered, truth[np.ix_(qpos, kpos)].astype(int),
                                          err_msg=f"rank {rank} src {src}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(causal=True, window=(4, 2)), "causal=True fixes the window's right edge"),
    (dict(bias=torch.zeros(1, 2, 8, 8)), "bias"),
    (dict(sink_size=2), "sink_size=2"),
    (dict(dropout_p=0.1), "dropout_p=0.1"),
])
def test_position_dependent_features_are_refused(kwargs, match):
    with pytest.raises(ValueError if "window" in kwargs else NotImplementedError, match=match):
        ring_attention(*_qkv(), **kwargs)


def test_varlen_inputs_are_refused():
    q = torch.randn(16, 2, 16)
    with pytest.raises(NotImplementedError, match="varlen"):
        ring_attention(q, q, q)


def test_bad_inputs_are_refused_before_any_communication():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k has batch 1 and seqlen 6"):
        ring_attention(q, k[:, :, :6], v)
    with pytest.raises(ValueError, match="even local seqlen"):
        ring_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], zigzag=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, k, v)


def test_one_rank_ring_is_plain_attention(tmp_path):
    """world_size 1 (no communication): the ring reduces to fmha.attention, forward and backward."""
    import torch.distributed as dist

    import fmha

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(secrets.randbits(30))
        q, k, v = (torch.randn(1, 16, h, 16, generator=g) for h in (4, 2, 2))
        sinks, do = torch.randn(4, generator=g), torch.randn(1, 16, 4, 16, generator=g)
        kw = dict(layout="bshd", causal=True, softcap=5.0)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o = ring_attention(*leaves[:3], sinks=leaves[3], zigzag=True, **kw)
        grads = torch.autograd.grad(o, leaves, do)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ref = fmha.attention(*ref_leaves[:3], sinks=ref_leaves[3], **kw)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    for name, ours, theirs in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=name)


def test_fmha_distributed_is_importable_as_an_attribute():
    import fmha

    assert fmha.distributed.ring_attention is ring_attention
