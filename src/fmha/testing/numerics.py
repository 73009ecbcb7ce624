"""Validation with per-dtype tolerances, in the FlashAttention style.

A kernel's error against the float64 truth may be at most twice the error of the same
computation done plainly in PyTorch at the kernel's dtype (`torch_attention` with
`compute_dtype` = the input dtype), plus an absolute slack: FlashAttention 3's
`2 * max|truth + 0.3 - 0.3 - truth|` in the kernel's dtype (the rounding of values of
the truth's size), and never less than a small floor per dtype. The float64
truth is `fmha.reference` (numpy), or, for large GPU problems, `torch_attention` in
float64 on the GPU; the tests check the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import reference

# Slack added to the 2x bound, per dtype (covers problems whose baseline error happens to
# be tiny, e.g. a single visible key), scaled by the truth's largest magnitude where that
# exceeds 1: fp32's summation-order noise grows with the values (a property-test case,
# fp32 dq of magnitude 11 at logits of std 8: 8.0e-5 against torch's 2.95e-5, and 2.7e-5
# with the other key tile of the interpreter). fp16/bf16 already get a larger rounding slack.
SLACK = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float64: 1e-12}


def torch_attention(q, k, v, *, compute_dtype=None, scale=None, causal=False, window=(-1, -1),
                    mask_align="bottom_right", sink_size=0, bias=None, alibi_slopes=None,
                    softcap=0.0, sinks=None, dropout_p=0.0, dropout_mask=None):
    """Plain PyTorch attention (bhsd), SPEC section 1, computed in `compute_dtype`.

    With compute_dtype=float64 this is a float64 truth that runs on the GPU. With the
    inputs' dtype it is the baseline of the 2x rule: logits and P rounded to that dtype,
    softmax in fp32 (as FlashAttention's `attention_ref(upcast=False)`).
    Returns (o (B, Hq, Sq, Dv) in compute_dtype, lse (B, Hq, Sq) in fp32 or fp64).
    """
    dt = compute_dtype or q.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    batch, nhead_q, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    group = nhead_q // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(acc)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(acc).reshape(-1, nhead_q, 1, 1)
        off = seqlen_k - seqlen_q if mask_align == "bottom_right" else 0
        rows = torch.arange(seqlen_q, device=q.device, dtype=acc)[:, None]
        cols = torch.arange(seqlen_k, device=q.device, dtype=acc)[None, :]
        s = s - slopes * (rows + off - cols).abs()
    vis = torch.as_tensor(reference.visible_mask(seqlen_q, seqlen_k, causal=causal, window=tuple(window),
                                                 mask_align=mask_align, sink_size=sink_size),
                          device=q.device)
    s = s.masked_fill(~vis, float("-inf"))
    # (no keys: amax of an empty row is an error, -inf is what the rest expects)
    m = s.amax(-1, keepdim=True) if seqlen_k else s.new_full((*s.shape[:-1], 1), float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).reshape(1, nhead_q, 1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    # rows that see nothing: lse -inf, p 0; log/divide a safe denominator so that their
    # gradients are 0, not NaN (where() alone passes 0 * inf = NaN back through log(0))
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = torch.where(denom == 0, torch.full_like(denom, float("-inf")), torch.log(safe) + m)
    p = e / safe
    if dropout_p > 0:
        p = p * dropout_mask.to(acc) / (1.0 - dropout_p)
    o = torch.matmul(p.to(dt), v)
    return o, lse.squeeze(-1)


@dataclass
class Comparison:
    name: str
    error: float  # max |out - truth|
    baseline_error: float  # max |baseline - truth|
    bound: float  # 2 * baseline_error + slack

    @property
    def ok(self) -> bool:
        # an infinite error (NaN or inf where the truth differs) never passes, even against
        # an infinite bound (a baseline that overflowed would make the check void)
        return math.isfinite(self.error) and self.error <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{self.name}: max error {self.error:.3e} <= bound {self.bound:.3e} "
                f"(2 x baseline {self.baseline_error:.3e} + slack): {verdict}")


def max_abs_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.double().cpu(), truth.double().cpu()
    same_inf = torch.isinf(x) & torch.isinf(truth) & (torch.sign(x) == torch.sign(truth))
    diff = torch.where(same_inf, torch.zeros_like(x), (x - truth).abs())
    if diff.numel() == 0:
        return 0.0
    return float("inf") if torch.isnan(diff).any() else float(diff.max())


def max_magnitude(t: torch.Tensor) -> float:
    """The largest finite |t| (0 for an empty or all-infinite tensor)."""
    t = t.detach().double().cpu().abs()
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def rounding_slack(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention 3's absolute term: 2 * max |t + 0.3 - 0.3 - t| with t = truth in dtype."""
    t = truth.detach().cpu().to(dtype)
    t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    if t.numel() == 0:
        return 0.0
    return 2 * float(((t + 0.3) - 0.3 - t).abs().max())


def compare(name: str, out: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor,
            dtype: torch.dtype) -> Comparison:
    """FlashAttention-style check of `out` against `truth`, relative to `baseline`."""
    base = max_abs_error(baseline, truth)
    slack = max(SLACK[dtype] * max(1.0, max_magnitude(truth)), rounding_slack(truth, dtype))
    return Comparison(name, max_abs_error(out, truth), base, 2 * base + slack)
