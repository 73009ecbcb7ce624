"""Two-GPU scaling of ring attention (fmha.distributed) against single-GPU fmha.attention.

    PYTHONPATH=src python tools/ring_bench.py --out ring_bench.json [--seqlens 32768 65536 131072]

For each total sequence length S and head configuration (16:16 and 32:8 GQA, D=128, B=1,
bf16, causal with zigzag slices), forward and forward+backward, it reports:
  - single: fmha.attention on the full sequence on one GPU;
  - ring: ring_attention on two GPUs (each holds S/2 tokens), the slowest rank per run;
  - compute: the same ring schedule with the transfers left out (each rank reuses its own
    keys), i.e. the compute the communication has to hide behind;
  - speedup = single / ring (ideal 2), comm_overhead = ring / compute - 1 (near 0: hidden).
Medians over --reps runs after a warm-up. NVLink multicast stays off in every process.
`--device cpu --seqlens 64 --heads 2:1 --head-dim 16 --reps 1` smoke-tests the script on
gloo and the interpreter (fp32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fmha
from fmha.distributed import NO_MULTICAST_ENV, _RingAttention, disable_nvlink_multicast


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_runs(fn, reps: int, dev, sync_group: bool) -> list[float]:
    """Wall times (ms) of `fn` per run; with sync_group, the slowest rank's time per run."""
    fn()  # warm-up (compilation, NCCL connection set-up)
    times = []
    for _ in range(reps):
        if sync_group:
            dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    if sync_group:
        t = torch.tensor(times, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    return times


def _flops(seqlen, nhead_q, head_dim, causal, backward) -> float:
    f = 4 * seqlen * seqlen * nhead_q * head_dim * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def _worker(rank, world, init, args, out_path):
    disable_nvlink_multicast()  # before init_process_group
    cpu = args.device == "cpu"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dtype = torch.float32 if cpu else torch.bfloat16  # the interpreter's bf16 dot is wrong
    d = args.head_dim
    results = []
    try:
        for seqlen in args.seqlens:
            for nhead_q, nhead_k in args.heads:
                local = seqlen // world
                g = torch.Generator(device=dev).manual_seed(1234 + rank)

                def rnd(*shape):
                    return torch.randn(shape, generator=g, device=dev).to(dtype)

                q = rnd(1, nhead_q, local, d)
                k, v = rnd(1, nhead_k, local, d), rnd(1, nhead_k, local, d)
                do = rnd(1, nhead_q, local, d)
                for backward in (False, True):
                    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))

                    def ring(communicate):
                        o, _ = _RingAttention.apply(qg, kg, vg, None, None, None, "bhsd", None, (-1, 0), True, 0.0,
                                                    communicate)
                        if backward:
                            torch.autograd.grad(o, (qg, kg, vg), do)

                    t_ring = _time_runs(lambda: ring(True), args.reps, dev, True)
                    t_compute = _time_runs(lambda: ring(False), args.reps, dev, True)
                    t_single = None
                    if rank == 0:  # one GPU, the whole sequence; the other rank waits
                        fq = rnd(1, nhead_q, seqlen, d).requires_grad_(backward)
                        fk = rnd(1, nhead_k, seqlen, d).requires_grad_(backward)
                        fv = rnd(1, nhead_k, seqlen, d).requires_grad_(backward)
                        fdo = rnd(1, nhead_q, seqlen, d)

                        def single():
                            o = fmha.attention(fq, fk, fv, causal=True)
                            if backward:
                                torch.autograd.grad(o, (fq, fk, fv), fdo)

                        t_single = _time_runs(single, args.reps, dev, False)
                        del fq, fk, fv, fdo
                    dist.barrier()
                    if rank == 0:
                        ring_ms, compute_ms = statistics.median(t_ring), statistics.median(t_compute)
                        single_ms = statistics.median(t_single)
                        flops = _flops(seqlen, nhead_q, d, True, backward)
                        row = {"seqlen": seqlen, "nhead_q": nhead_q, "nhead_k": nhead_k, "head_dim": d,
                               "batch": 1, "dtype": str(dtype).removeprefix("torch."), "causal": True,
                               "zigzag": True, "pass": "fwd+bwd" if backward else "fwd",
                               "single_ms": single_ms, "ring_ms": ring_ms, "compute_only_ms": compute_ms,
                               "speedup": single_ms / ring_ms, "efficiency": single_ms / ring_ms / world,
                               "comm_overhead": ring_ms / compute_ms - 1.0,
                               "single_tflops": flops / single_ms * 1e-9,
                               "ring_tflops_per_gpu": flops / world / ring_ms * 1e-9,
                               "runs_ms": {"single": t_single, "ring": t_ring, "compute_only": t_compute}}
                        results.append(row)
                        print(f"S={seqlen:6d} H={nhead_q}:{nhead_k} {row['pass']:8s} single {single_ms:8.2f} ms  "
                              f"ring {ring_ms:8.2f} ms  compute-only {compute_ms:8.2f} ms  "
                              f"speedup {row['speedup']:.2f}x  comm overhead {100 * row['comm_overhead']:+.1f}%",
                              flush=True)
                        with open(out_path, "w") as f:  # after every row: partial results survive
                            name = "cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name(dev)
                            json.dump(dict(device=name, world=world, torch=torch.__version__,
                                           env={k: os.environ.get(k) for k in NO_MULTICAST_ENV},
                                           results=results), f, indent=1)
    finally:
        dist.destroy_process_group()


def _heads(text: str) -> tuple[int, int]:
    hq, hk = (int(x) for x in text.split(":"))
    return hq, hk


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--heads", type=_heads, nargs="+", default=[(16, 16), (32, 8)], help="Hq:Hk pairs")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke test of this script on gloo (tiny sizes, interpreter)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        sys.exit("ring_bench needs two CUDA GPUs (or --device cpu for a smoke test)")
    for s in args.seqlens:
        if s % 4:
            sys.exit(f"--seqlens {s}: must be a multiple of 4 (2 ranks x 2 zigzag chunks)")
    disable_nvlink_multicast()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, f"tcp://127.0.0.1:{port}", args, os.path.abspath(args.out)), nprocs=2, join=True)


if __name__ == "__main__":
    main()
