"""One fp8 (e4m3, per-head descales) forward, three times, for ncu (default B=4 H=16 S=8192 D=128).

    ncu --clock-control none -k regex:fwd_ws_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SourceCounters -o fp8 python tools/fp8_profile.py [--hdim 256]
        [--causal] [--pingpong] [--bf16]

--pingpong: the Gluon fp8 tile with ping-pong (GLUON_WS_PINGPONG) instead of the registry's choice;
--bf16: the same shape's bf16 forward instead (the registry's kernel), for comparison.
"""

import argparse
import sys
from pathlib import Path

import torch

import fmha
from fmha.dispatch.configs import Family, Pipeline
from fmha.dispatch.registry import _gluon_config
from fmha.problem import DType

sys.path.insert(0, str(Path(__file__).parent))
from fp8_bench import FP8_TILE  # noqa: E402  (the registry's Gluon fp8 tiles)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch", type=int, default=4)
    p.add_argument("--nhead", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pingpong", action="store_true")
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    q, k, v = (torch.randn(a.batch, a.nhead, a.seqlen, a.hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.pingpong:
        block_n, stages = FP8_TILE[a.hdim]
        first = _gluon_config(Family.FWD, a.hdim, 128, block_n, 4, stages, Pipeline.GLUON_WS_PINGPONG, "ping-pong fp8",
                              dtypes=(DType.FP8_E4M3,))
        fmha.set_dispatcher(fmha.Dispatcher(fmha.Registry([first]).merged(fmha.default_registry(), name="pp")))
    if a.bf16:
        def call():
            return fmha.attention(q, k, v, causal=a.causal)
    else:
        (q8, qd), (k8, kd), (v8, vd) = (fmha.quantize_fp8(t, torch.float8_e4m3fn, "head") for t in (q, k, v))

        def call():
            return fmha.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=a.causal)
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
