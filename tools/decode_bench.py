"""Decode bandwidth on a GPU: fmha.attention_with_kvcache (contiguous and paged) vs SDPA
cuDNN, bytes of K and V read per second. PYTHONPATH=src python tools/decode_bench.py"""

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha


def main():
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for B, Hq, Hk, S, D in [(32, 32, 8, 8192, 128), (8, 32, 8, 32768, 128)]:
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        page = 64
        kp, vp = kc.reshape(B * S // page, page, Hk, D), vc.reshape(B * S // page, page, Hk, D)
        bt = torch.arange(B * S // page, device="cuda", dtype=torch.int32).reshape(B, S // page)
        kq, vq = kc.transpose(1, 2), vc.transpose(1, 2)
        qs = q.transpose(1, 2)
        kv_bytes = 2 * B * S * Hk * D * 2
        runs = {
            "fmha contiguous": lambda: fmha.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
            "fmha paged(64)": lambda: fmha.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=bt),
        }

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qs, kq, vq, enable_gqa=True)

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qs, kq, vq, enable_gqa=True)
        runs["sdpa cudnn"] = cudnn
        runs["sdpa flash"] = flash
        times = {}
        for _ in range(3):  # alternate contenders
            for name, fn in runs.items():
                try:
                    times.setdefault(name, []).append(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                              return_mode="median"))
                except Exception as e:
                    times[name] = [float("nan")]
                    print(name, "failed:", str(e).splitlines()[0][:150])
        for name, ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            print(f"B={B} Hq={Hq} Hk={Hk} S={S} D={D} {name:<16} {ms * 1e3:8.1f} us  "
                  f"{kv_bytes / ms / 1e9:7.2f} TB/s of K+V")


if __name__ == "__main__":
    main()
