"""Example 21: sink tokens (StreamingLLM) and sink logits (gpt-oss).

    python examples/21_sink_tokens.py

Two different "sinks":
- sink_size=n keeps the first n keys visible to every query, whatever the window
  (StreamingLLM's attention sinks): a sliding window plus a few always-visible keys.
- sinks=(Hq,) fp32 logits join each row's softmax denominator only (no value), so a head
  can attend to "nothing"; lse includes them, and the backward returns dsinks.
Both, separately and together, checked forward and backward.
"""

import torch

from _common import done, grads_checked, header, qkv, randn, run_checked, sizes

header("Example 21: sink tokens and sink logits")
gen = torch.Generator().manual_seed(21)
B, H, S, D = sizes((1, 4, 56, 32), (2, 16, 4096, 128))
window = sizes(8, 512)
q, k, v = qkv(B, H, H, S, S, D, gen=gen)
sinks = randn(H, dtype=torch.float32, gen=gen) * 2
run_checked(f"causal window ({window}, 0) + 4 sink tokens", q, k, v, causal=True, window=(window, -1), sink_size=4)
o_sinks, lse_sinks = run_checked("sink logits, causal", q, k, v, causal=True, sinks=sinks)
_, lse_plain = run_checked("no sink logits, causal (for comparison)", q, k, v, causal=True)
# The sink joins the denominator: lse grows by log(1 + exp(sink - lse)).
expected = torch.logaddexp(lse_plain, sinks.view(1, H, 1))
assert torch.allclose(lse_sinks, expected, atol=1e-3), (lse_sinks - expected).abs().max()
print("  lse with sinks == logaddexp(lse without, sink): ok")
run_checked("both, with GQA", q, k[:, :2], v[:, :2], causal=True, window=(window, -1), sink_size=2, sinks=sinks)
n = sizes(S, 512)
g = grads_checked("backward with dsinks, window and sink tokens", q[..., :n, :], k[..., :n, :], v[..., :n, :],
                  causal=True, window=(window, -1), sink_size=4, sinks=sinks.float())
assert g["dsinks"].shape == (H,)
done()
