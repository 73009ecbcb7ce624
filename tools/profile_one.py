"""Run one shape's forward+backward a few times, for a profiler (ncu) to pick a kernel:
fmha's, or SDPA cuDNN's (--backend cudnn) to compare the two kernels' counters.

    ncu --clock-control none -k regex:bwd_dkdv --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python tools/profile_one.py --hdim 128
    ncu --clock-control none -k regex:flash_bprop --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python tools/profile_one.py --hdim 128 --backend cudnn

(cuDNN's backward kernel on the H200 with cuDNN 9.19:
cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64.)
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
    p.add_argument("--backend", choices=("fmha", "cudnn"), default="fmha")
    a = p.parse_args()
    shape = (a.batch, a.nhead, a.seqlen, a.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if a.backend == "fmha":
        print(fmha.explain(q, k, v, causal=a.causal))
        attend = fmha.attention
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attend(q, k, v, causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for _ in range(a.iters):
        attend(q, k, v, causal=a.causal).backward(do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
