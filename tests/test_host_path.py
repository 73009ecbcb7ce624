"""The host path of a call: plain eager calls that autograd does not need skip torch's
custom-op dispatch (api._direct); every other call still goes through the registered op."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fmha
from fmha import api

from attn_testing import make_qkv


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _qkv(rng, requires_grad=False):
    q, k, v = make_qkv(rng, batch=1, nhead_q=2, nhead_k=1, seqlen_q=9, seqlen_k=12, head_dim=16,
                       dtype=torch.float32)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_no_grad_eager_call_runs_the_body_directly(rng):
    q, k, v = _qkv(rng)
    assert api._direct(api._fwd_op, (q, k, v)) is api._fwd_op._init_fn
    direct = fmha.attention(q, k, v, causal=True)
    through_op = api._fwd_op(q, k, v, None, None, None, None, None, None, 0, 0, "bhsd", None, True, -1, 0,
                             "bottom_right", 0, 0.0, 0.0, 0, 0, False)[0]
    assert torch.equal(direct, through_op)


def test_calls_autograd_needs_keep_the_op_or_take_the_eager_function(rng):
    q, k, v = _qkv(rng, requires_grad=True)
    assert api._direct(api._fwd_op, (q, k, v)) is api._fwd_op
    assert api._direct(api._fwd_op, (q, k, v), autograd=api._EagerAttention) == api._EagerAttention.apply
    with torch.no_grad():
        assert api._direct(api._fwd_op, (q, k, v), autograd=api._EagerAttention) is api._fwd_op._init_fn
    o = fmha.attention(q, k, v, causal=True)
    assert type(o.grad_fn).__name__ == "_EagerAttentionBackward"
    o.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_eager_autograd_function_matches_the_registered_op(rng):
    """The same forward and gradients (dq, dk, dv, and the LSE's) as through the custom op's
    registered autograd, bit for bit: both run the same body and backward."""
    scalars = (0, 0, "bhsd", 0.3, True, -1, 0, "bottom_right", 0, 0.0, 0.0, 0, 0, False)
    q, k, v = _qkv(rng, requires_grad=True)
    do, dlse = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9)
    results = []
    for fn in (api._fwd_op, api._EagerAttention.apply):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = fn(*leaves, None, None, None, None, None, None, *scalars)
        results.append((o, lse, *torch.autograd.grad((o, lse), leaves, (do, dlse))))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_dispatch_modes_and_torch_function_modes_see_the_op(rng):
    q, k, v = _qkv(rng)
    with _SeenOps() as mode:
        fmha.attention(q, k, v)
    assert any("fmha.fwd" in op for op in mode.ops), mode.ops
    with torch.device("cpu"):  # a torch-function mode
        assert api._direct(api._fwd_op, (q, k, v)) is api._fwd_op


def test_torch_compile_of_an_inference_call_keeps_the_op_in_the_graph(rng):
    q, k, v = _qkv(rng)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    compiled = torch.compile(lambda q, k, v: fmha.attention(q, k, v, causal=True), backend=backend, fullgraph=True)
    assert torch.allclose(compiled(q, k, v), fmha.attention(q, k, v, causal=True))
    assert any("fmha.fwd" in target for target in seen), seen
