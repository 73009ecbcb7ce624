"""Run fmha forward+backward on one shape a few times, for a profiler (ncu) to pick a kernel.

    ncu --clock-control none -k regex:bwd_dkdv --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python tools/profile_one.py --hdim 128
"""

import argparse

import torch

import fmha


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch", type=int, default=4)
    p.add_argument("--nhead", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=2)
    a = p.parse_args()
    shape = (a.batch, a.nhead, a.seqlen, a.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    print(fmha.explain(q, k, v, causal=a.causal))
    for _ in range(a.iters):
        fmha.attention(q, k, v, causal=a.causal).backward(do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
