"""Smoke test of the Gluon forward: a few problems against SDPA in fp32, prints max errors.
Exits non-zero on a wrong result. Run under `timeout` (a barrier bug hangs)."""

import sys

import torch

import fmha


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    for (b, hq, hk, sq, sk, d, causal) in [(1, 2, 2, 256, 256, 128, False), (1, 2, 1, 300, 517, 64, True),
                                           (2, 4, 2, 1000, 700, 256, True), (1, 1, 1, 1, 129, 128, False)]:
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
        first = fmha.explain(q, k, v, causal=causal).splitlines()[0]
        o = fmha.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(hq // hk, 1), v.float().repeat_interleave(hq // hk, 1),
            is_causal=causal) if sq == sk or not causal else None
        if ref is None:
            # bottom-right causal: build the mask explicitly
            i = torch.arange(sq, device="cuda")[:, None]
            j = torch.arange(sk, device="cuda")[None, :]
            mask = j <= i + (sk - sq)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(hq // hk, 1), v.float().repeat_interleave(hq // hk, 1),
                attn_mask=mask)
            ref = torch.where(mask.any(-1)[None, None, :, None], ref, 0.0)
        err = (o.float() - ref).abs().max().item()
        ok = err < 0.05
        bad += not ok
        verdict = "ok" if ok else "WRONG"
        print(f"{b}x{hq}/{hk} sq={sq} sk={sk} d={d} causal={causal}: max err {err:.4f} {verdict} | {first}",
              flush=True)
    for (b, hq, hk, s, d, causal) in [(1, 2, 1, 300, 128, True), (2, 2, 2, 200, 64, False)]:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (hq, hk, hk))
        do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        line = next(x for x in fmha.explain(q, k, v, causal=causal).splitlines() if "bwd_dq_dk_dv " in x)
        got = torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), do)
        torch.cuda.synchronize()
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref_o = torch.nn.functional.scaled_dot_product_attention(
            qf, kf.repeat_interleave(hq // hk, 1), vf.repeat_interleave(hq // hk, 1), is_causal=causal)
        want = torch.autograd.grad(ref_o, (qf, kf, vf), do.float())
        errs = [(g.float() - w).abs().max().item() / max(w.abs().max().item(), 1e-6) for g, w in zip(got, want)]
        ok = max(errs) < 0.03
        bad += not ok
        verdict = "ok" if ok else "WRONG"
        print(f"bwd {b}x{hq}/{hk} s={s} d={d} causal={causal}: rel errs {[round(e, 4) for e in errs]} {verdict} "
              f"| {line.strip()}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
