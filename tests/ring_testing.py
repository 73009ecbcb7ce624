"""Helpers for the ring attention tests (CPU/gloo and GPU/NCCL): spawn a process group,
run `fmha.distributed.ring_attention` on each rank's slice, gather the results, and check
them against single-device `fmha.attention` on the full sequence (2x rule).

A case is a dict: world, dtype (name), layout, batch, nhead_q, nhead_k, seqlen (total),
head_dim, causal, zigzag, window (optional), alibi (bool, optional), softcap, sinks (bool),
dlse (bool: return_lse with a random upstream gradient for it). Inputs are drawn from
`seed` on the CPU, so every process and the checker see the same full tensors.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fmha
from fmha.distributed import disable_nvlink_multicast, ring_attention, zigzag_shard, zigzag_unshard
from fmha.testing import numerics

GRADS = ("dq", "dk", "dv", "dsinks")


def seq_dim(case) -> int:
    return 2 if case["layout"] == "bhsd" else 1


def full_inputs(case, seed: int, device="cpu"):
    """(q, k, v, sinks or None, do, dlse or None): full sequences in the case's layout."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    b, s = case["batch"], case["seqlen"]

    def shape(h, d):
        return (b, h, s, d) if case["layout"] == "bhsd" else (b, s, h, d)

    def randn(shp, dt=dtype):
        return torch.randn(shp, generator=g).to(dt).to(device)

    q = randn(shape(case["nhead_q"], case["head_dim"]))
    k = randn(shape(case["nhead_k"], case["head_dim"]))
    v = randn(shape(case["nhead_k"], case["head_dim"]))
    sinks = randn((case["nhead_q"],), torch.float32) if case.get("sinks") else None
    do = randn(shape(case["nhead_q"], case["head_dim"]))
    dlse = randn((b, case["nhead_q"], s), torch.float32) if case.get("dlse") else None
    return q, k, v, sinks, do, dlse


def alibi_of(case, seed: int, device="cpu"):
    """fp32 (Hq,) ALiBi slopes in [0.05, 0.55) when the case asks for ALiBi, else None."""
    if not case.get("alibi"):
        return None
    g = torch.Generator().manual_seed(seed + 1_000_003)
    return (torch.rand(case["nhead_q"], generator=g) * 0.5 + 0.05).to(device)


def shard(x, case, rank: int, world: int, dim: int):
    if case["zigzag"]:
        return zigzag_shard(x, rank, world, dim=dim)
    return x.chunk(world, dim)[rank].clone(memory_format=torch.contiguous_format)


def unshard(parts, case, dim: int):
    x = torch.cat(parts, dim)
    return zigzag_unshard(x, len(parts), dim=dim) if case["zigzag"] else x


def run_rank(case, seed: int, rank: int, world: int, device) -> dict:
    """This rank's ring attention forward and backward: its rows of o, lse and gradients."""
    q, k, v, sinks, do, dlse = full_inputs(case, seed, device)
    d = seq_dim(case)
    ql, kl, vl, dol = (shard(t, case, rank, world, d).requires_grad_(t is not do) for t in (q, k, v, do))
    sl = None if sinks is None else sinks.clone().requires_grad_()
    o, lse = ring_attention(ql, kl, vl, layout=case["layout"], causal=case["causal"], zigzag=case["zigzag"],
                            window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0), sinks=sl,
                            alibi_slopes=alibi_of(case, seed, device), return_lse=True)
    outs, grads_out = [o], [dol]
    if dlse is not None:
        outs.append(lse)
        grads_out.append(shard(dlse, case, rank, world, 2))
    inputs = [ql, kl, vl] + ([sl] if sl is not None else [])
    grads = torch.autograd.grad(outs, inputs, grads_out)
    result = {"o": o.detach(), "lse": lse.detach()}
    result.update(zip(GRADS, grads, strict=False))
    return {key: t.cpu() for key, t in result.items()}


def _worker(rank: int, world: int, backend: str, init: str, cases, seed: int, outdir: str,
            truth_dtype: str | None):
    disable_nvlink_multicast()  # before init_process_group: NVLink multicast stays off
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    timing = os.environ.get("FMHA_RING_TIMING")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            torch.save(run_rank(case, seed + i, rank, world, device), os.path.join(outdir, f"{i}_{rank}.pt"))
            if timing:
                print(f"rank {rank} case {i}: ring {time.perf_counter() - t0:.2f} s", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The single-device baselines, shared out over the ranks (they run in parallel).
    for i, case in enumerate(cases):
        if i % world == rank:
            t0 = time.perf_counter()
            result = single_device(case, seed + i, device)
            torch.save({key: t.cpu() for key, t in result.items()}, os.path.join(outdir, f"{i}_single.pt"))
            if truth_dtype is not None:
                result = single_device(case, seed + i, device, getattr(torch, truth_dtype))
                torch.save({key: t.cpu() for key, t in result.items()}, os.path.join(outdir, f"{i}_truth.pt"))
            if timing:
                print(f"rank {rank} case {i}: single device {time.perf_counter() - t0:.2f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, cases, seed: int, outdir: str, backend: str = "gloo",
          truth_dtype: str | None = None) -> list[tuple]:
    """Run every case on `world` processes; returns, per case, (the ring's gathered full
    results, single-device fmha.attention's results on the full sequence), and with
    `truth_dtype` a third: single-device fmha.attention on the inputs cast to that dtype."""
    disable_nvlink_multicast()  # inherited by the children too
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_worker, args=(world, backend, init, cases, seed, outdir, truth_dtype), nprocs=world, join=True)
    gathered = []
    for i, case in enumerate(cases):
        parts = [torch.load(os.path.join(outdir, f"{i}_{r}.pt")) for r in range(world)]
        full = {}
        for key in parts[0]:
            if key == "dsinks":  # each rank's share of the replicated weight's gradient
                full[key] = sum(p[key] for p in parts)
            else:
                full[key] = unshard([p[key] for p in parts], case, 2 if key == "lse" else seq_dim(case))
        single = torch.load(os.path.join(outdir, f"{i}_single.pt"))
        if truth_dtype is None:
            gathered.append((full, single))
        else:
            gathered.append((full, single, torch.load(os.path.join(outdir, f"{i}_truth.pt"))))
    return gathered


def single_device(case, seed: int, device="cpu", dtype=None) -> dict:
    """Single-device fmha.attention on the full sequence (optionally in another dtype)."""
    q, k, v, sinks, do, dlse = full_inputs(case, seed, device)
    if dtype is not None:
        q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.requires_grad_()
    o, lse = fmha.attention(q, k, v, layout=case["layout"], causal=case["causal"],
                            window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0), sinks=sinks,
                            alibi_slopes=alibi_of(case, seed, device), return_lse=True)
    outs, grads_out = ([o, lse], [do, dlse]) if dlse is not None else ([o], [do])
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    result = {"o": o.detach(), "lse": lse.detach()}
    result.update(zip(GRADS, torch.autograd.grad(outs, inputs, grads_out), strict=False))
    return result


def torch64(case, seed: int) -> dict:
    """The float64 truth through torch autograd (numerics.torch_attention), on the CPU."""
    q, k, v, sinks, do, dlse = full_inputs(case, seed)
    bshd = case["layout"] == "bshd"
    q, k, v, do = (t.double() for t in (q, k, v, do))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.double().requires_grad_()
    tr = (lambda t: t.transpose(1, 2)) if bshd else (lambda t: t)
    o, lse = numerics.torch_attention(tr(q), tr(k), tr(v), compute_dtype=torch.float64, causal=case["causal"],
                                      window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                                      sinks=sinks, alibi_slopes=alibi_of(case, seed))
    o = tr(o)
    outs, grads_out = ([o, lse], [do, dlse.double()]) if dlse is not None else ([o], [do])
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    result = {"o": o.detach(), "lse": lse.detach()}
    result.update(zip(GRADS, torch.autograd.grad(outs, inputs, grads_out), strict=False))
    return result


def compare(case, ring: dict, truth: dict, baseline: dict) -> list:
    """numerics.compare for every result: the ring's error at most 2x single-device's."""
    dtype = getattr(torch, case["dtype"])
    comparisons = []
    for key, value in ring.items():
        assert value.shape == truth[key].shape, (key, value.shape, truth[key].shape)
        assert not torch.isnan(value).any(), f"NaN in {key}"
        kind = torch.float32 if key in ("lse", "dsinks") else dtype
        comparisons.append(numerics.compare(key, value, truth[key].cpu(), baseline[key].cpu(), kind))
    return comparisons
