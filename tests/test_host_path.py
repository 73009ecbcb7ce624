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


def test_calls_autograd_needs_keep_the_op(rng):
    q, k, v = _qkv(rng, requires_grad=True)
    assert api._direct(api._fwd_op, (q, k, v)) is api._fwd_op
    with torch.no_grad():
        assert api._direct(api._fwd_op, (q, k, v)) is api._fwd_op._init_fn
    o = fmha.attention(q, k, v, causal=True)
    assert o.grad_fn is not None
    o.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


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
