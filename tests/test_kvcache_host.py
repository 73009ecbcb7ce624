"""The host path of `attention_with_kvcache` (decode), kernels stubbed: what a call on CUDA
tensors launches and runs on the host, checked on the CPU.

Decode kernels take a few hundred microseconds, as long as a slow host path: the
FlashInfer/SGLang tables must cost no more than a block table (no per-call conversion),
num_splits=0 no more than the split count it picks (the dispatcher's answer is cached),
and nothing may read a device value (a host synchronisation, which CUDA-graph capture
refuses). The calls below take the path of CUDA tensors on an H200: dispatch for sm90
with 132 SMs, no host-side checks of index values (CUDA tensors skip them outside debug
mode)."""

import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fmha
from fmha import kvcache

B, HQ, HK, D, PAGE, S = 4, 8, 2, 64, 16, 4096


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded instead of run, as (name, args, kwargs), on the CUDA path."""
    calls = []

    def launcher(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs))

    stub = types.SimpleNamespace(**{n: launcher(n) for n in ("launch_attention", "launch_combine",
                                                               "launch_rotary_append")})
    monkeypatch.setattr(kvcache, "family_module", lambda *a, **k: stub)
    monkeypatch.setattr(kvcache, "_reads_values", lambda device: False)
    monkeypatch.setattr(kvcache, "_arch", lambda device: "sm90")
    monkeypatch.setattr(kvcache, "_sm_count", lambda device: 132)
    return calls


def tables(lengths=None):
    """q, a page pool (one page's storage expanded: no kernel runs) and equivalent block-table
    and indptr tables (sequences of `lengths` keys, full by default)."""
    lengths = lengths or [S] * B
    n = B * S // PAGE
    q = torch.randn(B, 1, HQ, D, dtype=torch.bfloat16)
    pool = torch.empty(1, PAGE, HK, D, dtype=torch.bfloat16).expand(n, PAGE, HK, D)
    table = torch.randperm(n).int().reshape(B, S // PAGE)
    pages = [-(-n_b // PAGE) for n_b in lengths]
    indptr = torch.tensor([0] + [sum(pages[:b + 1]) for b in range(B)], dtype=torch.int32)
    indices = torch.cat([table[b, :p] for b, p in enumerate(pages)]).contiguous()
    last = torch.tensor([n_b - (p - 1) * PAGE if p else 0 for n_b, p in zip(lengths, pages, strict=True)],
                        dtype=torch.int32)
    block = dict(block_table=table, cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    return q, pool, block, dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)


def described(calls):
    """Launches with tensors replaced by (shape, dtype): comparable across calls."""
    def describe(x):
        return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
    return [(name, [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()})
            for name, args, kwargs in calls]


def test_indptr_tables_launch_what_the_block_table_launches(launches):
    q, pool, block, indptr = tables()
    fmha.attention_with_kvcache(q, pool, pool, **block)
    by_table = described(launches)
    launches.clear()
    fmha.attention_with_kvcache(q, pool, pool, **indptr)
    by_indptr = described(launches)
    assert [name for name, _, _ in by_table] == ["launch_attention", "launch_combine"]
    assert [name for name, _, _ in by_indptr] == ["launch_attention", "launch_combine"]
    (_, args_t, kw_t), combine_t = by_table
    (_, args_i, kw_i), combine_i = by_indptr
    assert kw_t["num_splits"] == kw_i["num_splits"] > 1  # the same split count from the policy
    assert args_t == args_i and combine_t == combine_i
    paging = ("block_table", "kv_indptr", "seqlens_k", "kv_last_page_len")
    assert {k: v for k, v in kw_t.items() if k not in paging} == {k: v for k, v in kw_i.items() if k not in paging}
    # the tables go to the kernel as they are: it derives the key counts from them
    assert launches[0][2]["kv_indptr"] is indptr["kv_indptr"]
    assert launches[0][2]["kv_last_page_len"] is indptr["kv_last_page_len"]
    assert launches[0][2]["block_table"] is indptr["kv_indices"] and launches[0][2]["seqlens_k"] is None


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_indptr_tables_cost_no_device_ops(launches):
    """Decode through indptr tables runs the block table's ops: allocations of the outputs,
    no conversion of the tables (it was 6 device kernels per call, each a CUDA launch)."""
    q, pool, block, indptr = tables(lengths=[S, 1, 0, 1000])
    logs = {}
    for form, kw in (("block_table", block), ("indptr", indptr)):
        with OpLog() as log:
            fmha.attention_with_kvcache(q, pool, pool, **kw)
        logs[form] = log.ops
    assert logs["indptr"] == logs["block_table"]
    assert set(logs["indptr"]) <= {"empty", "new_empty", "view"}


def test_num_splits_0_launches_what_forcing_its_choice_launches(launches):
    q, pool, block, indptr = tables()
    for kw in (block, indptr):
        launches.clear()
        fmha.attention_with_kvcache(q, pool, pool, **kw)
        auto = described(launches)
        chosen = launches[0][2]["num_splits"]
        assert chosen > 1
        launches.clear()
        fmha.attention_with_kvcache(q, pool, pool, **kw, num_splits=chosen)
        assert described(launches) == auto


def test_the_dispatchers_answer_is_cached_per_problem(launches, monkeypatch):
    """A repeated decode shape asks the dispatcher nothing (its registry scans, tuning lookup
    and split search cost more host time than the rest of the call); a different problem,
    split policy or dispatcher is asked again."""
    q, pool, block, indptr = tables()
    asked = []
    dispatcher = fmha.Dispatcher()
    original = dispatcher.select
    monkeypatch.setattr(dispatcher, "select", lambda *a, **k: asked.append(a) or original(*a, **k))
    with fmha.api.use_dispatcher(dispatcher):
        for _ in range(3):
            fmha.attention_with_kvcache(q, pool, pool, **block)
            fmha.attention_with_kvcache(q, pool, pool, **indptr)
        assert 0 < len(asked) <= 3  # split-KV + combine once, for the one problem both forms give
        first = len(asked)
        fmha.attention_with_kvcache(q, pool, pool, **block, num_splits=1)
        assert len(asked) > first  # another plan: one split, no combine
        splits = launches[-1][2]["num_splits"]
        assert splits == 1
        dispatcher.split_policy = fmha.SplitPolicy(max_splits=2)
        fmha.attention_with_kvcache(q, pool, pool, **block)
        assert launches[-2][2]["num_splits"] == 2  # the new policy, not the cached answer
        before = len(asked)
        fmha.attention_with_kvcache(q, pool, pool, **block)
        assert len(asked) == before
        fmha.set_dispatcher(dispatcher)  # clears the plan caches, as for dense calls
        fmha.attention_with_kvcache(q, pool, pool, **block)
        assert len(asked) > before


class NoHostReads(TorchDispatchMode):
    """Raises on every op that copies a device value to the host."""

    READS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "_to_copy", "_copy_from")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.READS:
            raise AssertionError(f"host synchronisation: aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads_refused():
    """Reading a tensor's values on the host raises: through aten (item, nonzero, copies)
    and through the Tensor methods that convert to Python or numpy."""
    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name}")
        return method

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, refuse(name))
        with NoHostReads():
            yield


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("form", ["block_table", "indptr", "contiguous"])
@pytest.mark.parametrize("append", [False, True])
def test_decode_reads_no_device_value_on_the_host(launches, form, num_splits, append):
    """CUDA-graph capturable: no .item(), .tolist(), .cpu(), int()/bool() of a tensor, nonzero
    (with new k/v and RoPE too)."""
    q, pool, block, indptr = tables(lengths=[S - 2, 7, 2, 1000])
    k_cache = pool
    if form == "indptr":  # the tables count the appended tokens
        kw = indptr
    else:  # cache_seqlens counts the tokens before the append
        kw = dict(block, cache_seqlens=block["cache_seqlens"] - (2 if append else 0))
        if form == "contiguous":
            del kw["block_table"]
            k_cache = torch.empty(1, S, HK, D, dtype=torch.bfloat16).expand(B, S, HK, D)
    extra = {}
    if append:
        extra = dict(k=torch.randn(B, 2, HK, D, dtype=torch.bfloat16),
                     v=torch.randn(B, 2, HK, D, dtype=torch.bfloat16),
                     rotary_cos=torch.randn(S, D // 2), rotary_sin=torch.randn(S, D // 2))
    fmha.attention_with_kvcache(q, k_cache, k_cache, **kw, num_splits=num_splits, **extra)  # caches filled
    launches.clear()
    with host_reads_refused():
        o = fmha.attention_with_kvcache(q, k_cache, k_cache, **kw, num_splits=num_splits, **extra)
    assert o.shape == q.shape
    names = [name for name, _, _ in launches]
    splits = next(kw["num_splits"] for name, _, kw in launches if name == "launch_attention")
    assert names[-1] == ("launch_combine" if splits > 1 else "launch_attention")
    assert names.count("launch_rotary_append") == (3 if append else 0)  # k, v, q


def test_the_host_read_guard_catches_reads():
    """The guard above is not vacuous: each kind of read raises under it."""
    t = torch.tensor([1, 2], dtype=torch.int32)
    with host_reads_refused():
        for read in (lambda: t[0].item(), lambda: t.tolist(), lambda: int(t[0]), lambda: bool(t[0]),
                     lambda: t.nonzero(), lambda: t.cpu(), lambda: t.numpy(), lambda: float(t[0])):
            with pytest.raises(AssertionError, match="host synchronisation"):
                read()
