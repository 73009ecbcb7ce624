"""Example 11: masks: causal in both alignments, sliding windows, sink tokens.

    python examples/11_masks.py

Column j is visible to row i iff i + off - left <= j <= i + off + right (-1: unbounded),
or j < sink_size; off = Sk - Sq for mask_align="bottom_right" (FlashAttention's causal),
0 for "top_left" (SDPA's is_causal). With Sq != Sk the two alignments differ; rows that
see no key give o = 0 and lse = -inf, never NaN. Forward and backward are checked.
"""

import torch

from fmha import reference

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 11: masks")
gen = torch.Generator().manual_seed(11)
B, H, D = sizes((1, 2, 32), (2, 16, 128))
short, long = sizes((24, 56), (1000, 3000))
for sq, sk in ((short, long), (long, short)):
    q, k, v = qkv(B, H, H, sq, sk, D, gen=gen)
    for align in ("bottom_right", "top_left"):
        vis = reference.visible_mask(sq, sk, causal=True, mask_align=align)
        empty = int((~vis.any(-1)).sum())
        o, lse = run_checked(f"causal {align}, Sq={sq} Sk={sk} ({empty} rows see no key)", q, k, v,
                             causal=True, mask_align=align)
        if empty:
            assert torch.isneginf(lse[..., ~torch.from_numpy(vis.any(-1))]).all()
window = sizes((8, 3), (256, 64))
q, k, v = qkv(B, H, H, long, long, D, gen=gen)
run_checked(f"sliding window {window}", q, k, v, window=window)
run_checked(f"causal + window ({window[0]}, 0)", q, k, v, causal=True, window=(window[0], -1))
run_checked(f"window {window} + 4 sink tokens, top_left", q, k, v, window=window, sink_size=4, mask_align="top_left")
grads_checked(f"backward: causal top_left + window {window} + sink tokens", q[:, :, :short], k, v,
              causal=True, window=(window[0], -1), sink_size=2, mask_align="top_left")
done()
