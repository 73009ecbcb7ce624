"""Example 18: variable-length batches (CK's group mode) and padded batches.

    python examples/18_padding.py

attention_varlen takes sequences packed end to end, (total_tokens, H, D), with int32
prefix sums cu_seqlens_q/k; masks align per sequence and empty sequences are allowed.
A padded batch (B, S, H, D) with per-sequence lengths is unpadded into that form and the
result padded back. seqused_k uses only the first keys of each sequence's slot.
Forward and backward are checked sequence by sequence against the float64 truth.
"""

import torch

import fmha
from fmha.testing import numerics

from _common import DEVICE, check, done, header, randn, sizes, truth_and_baseline

header("Example 18: varlen and padding")
gen = torch.Generator().manual_seed(18)
Hq, Hk, D = sizes((4, 2, 32), (16, 4, 128))
lens_q = sizes([5, 0, 17, 33], [1, 700, 2048, 0, 1500])
lens_k = sizes([2, 4, 17, 20], [1, 900, 2048, 30, 1500])  # seqused_k below: 0 keys for the first


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def check_per_sequence(title, q, k, v, o, lse, cq, ck, used=None, grads=None, do=None, **kw):
    """Each sequence against the dense truth on its own slice."""
    print(f"  {title}")
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1] if used is None else ck[b] + used[b])
        dense = lambda t, s: t[s].transpose(0, 1)[None].detach()
        tq, tk, tv = dense(q, qs), dense(k, ks), dense(v, ks)
        if tq.shape[2] == 0:
            continue
        truth_o, truth_lse, base_o, base_lse = truth_and_baseline(tq, tk, tv, **kw)
        check(f"seq {b} o", dense(o, qs), truth_o, base_o, q.dtype)
        check(f"seq {b} lse", lse[:, qs][None], truth_lse, base_lse, torch.float32)


total_q, total_k = sum(lens_q), sum(lens_k)
q = randn(total_q, Hq, D, gen=gen).requires_grad_()
k, v = randn(total_k, Hk, D, gen=gen).requires_grad_(), randn(total_k, Hk, D, gen=gen).requires_grad_()
cq, ck = cu(lens_q), cu(lens_k)
o, lse = fmha.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True, return_lse=True)
check_per_sequence(f"packed, lengths q={lens_q} k={lens_k}, causal", q, k, v, o, lse, cq.tolist(), ck.tolist(),
                   causal=True)

used = [max(0, n - 3) for n in lens_k]
o2, lse2 = fmha.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), seqused_k=torch.tensor(
    used, dtype=torch.int32, device=DEVICE), return_lse=True)
check_per_sequence(f"seqused_k={used}", q, k, v, o2, lse2, cq.tolist(), ck.tolist(), used=used)

# Gradients, sequence by sequence: torch autograd in float64 (truth) and at the dtype (baseline).
do = randn(*o.shape, gen=gen)
dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)


def dense_grads(qs, ks, vs, dos, dtype):
    xs = [t.detach().transpose(0, 1)[None].to(dtype).requires_grad_() for t in (qs, ks, vs)]
    out, _ = numerics.torch_attention(*xs, compute_dtype=dtype, causal=True)
    return [g[0].transpose(0, 1) for g in torch.autograd.grad(out, xs, dos.transpose(0, 1)[None].to(dtype))]


print("  backward, sequence by sequence")
cql, ckl = cq.tolist(), ck.tolist()
for b in range(len(lens_q)):
    qs, ks = slice(cql[b], cql[b + 1]), slice(ckl[b], ckl[b + 1])
    if lens_q[b] == 0:  # keys that no query looked at get zero gradients
        assert dk[ks].abs().max() == 0 and dv[ks].abs().max() == 0
        print(f"    seq {b}: no queries, dk = dv = 0")
        continue
    truth = dense_grads(q[qs], k[ks], v[ks], do[qs], torch.float64)
    base = dense_grads(q[qs], k[ks], v[ks], do[qs], q.dtype)
    for name, ours, t, bl in zip(("dq", "dk", "dv"), (dq[qs], dk[ks], dv[ks]), truth, base, strict=True):
        check(f"seq {b} {name}", ours, t, bl, q.dtype)

# A padded batch: unpad, run varlen, pad back.
B, S = len(lens_q), max(lens_q)
padded = torch.zeros(B, S, Hq, D, dtype=q.dtype, device=DEVICE)
for b in range(B):
    padded[b, :lens_q[b]] = q[cql[b]:cql[b + 1]].detach()
valid = torch.arange(S, device=DEVICE)[None] < torch.tensor(lens_q, device=DEVICE)[:, None]
packed = padded[valid]  # (total_q, Hq, D), sequence after sequence
o3 = fmha.attention_varlen(packed, k.detach(), v.detach(), cq, ck, S, max(lens_k), causal=True)
out_padded = torch.zeros(B, S, Hq, D, dtype=o3.dtype, device=DEVICE)
out_padded[valid] = o3
assert torch.equal(out_padded[valid], o.detach()), "unpad -> varlen -> pad changed the result"
print(f"  padded batch {tuple(padded.shape)} -> packed {tuple(packed.shape)} -> padded: same output")
done()
