"""Launch a compiled kernel again without the JIT's per-call argument binding.

`kernel[grid](*args, **kwargs)` specializes every argument (dtype, 16-byte alignment, int
range, == 1, % 16) and looks the kernel up by that key: about 1 us of Python per argument,
40-80 us for the 30-argument attention kernels, the largest part of a short problem's host
path on Hopper (tools/host_overhead_gpu.py). `launch` keys the compiled kernel by a finer
key that is cheaper to compute (the constexpr and option values as given; per argument its
value or type, see `_key_of`), and calls its launcher directly. The first call of a
key goes through the JIT (compiling or loading from Triton's cache, with its checks); so does
every call of an interpreted kernel.

Plans go one step further for the launchers called on every Hopper call (the Gluon forward and
dK/dV): `make_plan` launches as `launch` and returns the compiled kernel with its grid and
trailing constexpr values; the launcher keeps it under a key of its inputs' metadata (shapes,
strides, dtypes, alignments and its scalar arguments: everything the kernel and the non-tensor
arguments depend on) and re-launches it with `run_plan` and the call's tensors, skipping its own
argument work and this module's key. While `launch` is replaced (a test's spy), launchers must
not use plans (`plans_enabled`), so that the spy sees every launch.

A plan launches through Triton's compiled C launcher itself where it can (`_Direct`): Triton's
Python wrapper around it re-encodes every TMA descriptor and walks every argument on each call
(11 of a 19 us launch on the H200 host, tools/launcher_cost.py); a plan keeps the encoded
descriptors per (address, shape, strides, type) instead, and takes in a descriptor's place the
tensor it was built over.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.backends.nvidia.driver import CudaLauncher, make_tensordesc_arg
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from .plan_tables import PLANS_MAX, clear_plans, keep_plan, plan_table  # noqa: F401 (the launchers' plan tables)

_CACHE: dict = {}
_CACHE_MAX = 4096
_PLAIN = (int, float, bool, str, type(None))  # keyword values the key may hold as they are


def _tensor_key(t: torch.Tensor):
    return (t.dtype, t.data_ptr() % 16 == 0)


def _descriptor_key(d):
    # A host TMA descriptor's type: dtype, block shape and layout (the layouts are cached
    # objects, gluon_common._shared_layout); its base is 16-byte aligned by construction.
    return (d.base.dtype, tuple(d.block_shape), d.layout)


def _key_of(a: Any):
    """What the compiled kernel depends on: an int's value (finer than the JIT's == 1 / % 16 /
    range, so never coarser), a float's or None's type, a bool's value, a tensor's dtype and
    alignment, a descriptor's type."""
    kind = type(a)
    if kind is int:
        return a
    if kind is float or a is None:
        return kind
    if kind is bool:
        return (bool, a)  # (True == 1 as a key)
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if hasattr(a, "block_shape") and hasattr(a, "layout"):
        return _descriptor_key(a)
    raise TypeError(f"launch_cache: no key for an argument of type {kind.__name__}")


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`. args: the kernel's leading parameters, positionally;
    kwargs: every later parameter (constexprs) by name, then launch options (num_warps, ...).
    Calls that leave a parameter to its default or pass a tensor by keyword are not cached."""
    _launch(kernel, grid, args, kwargs)


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """`launch`; returns (the cache entry this call used or stored, the current device), or
    None where the call is not cached."""
    if not isinstance(kernel, JITFunction) or knobs.runtime.interpret:
        kernel[grid](*args, **kwargs)
        return None
    device = driver.active.get_current_device()
    key = (id(kernel), device, tuple(map(_key_of, args)), tuple(kwargs.items()))
    hit = _CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        names = kernel.arg_names[len(args):]
        if (compiled is None or not set(names) <= kwargs.keys()
                or not all(type(x) in _PLAIN for x in kwargs.values())):
            return None  # (parameters left to their defaults, or tensors by keyword: the JIT binds each call)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = (compiled, tuple(kwargs[n] for n in names), kernel)  # (kernel: keeps its id)
        return _CACHE[key], device
    _run(hit[0], _grid3(grid), device, (*args, *hit[1]))
    return hit, device


def _grid3(grid: tuple) -> tuple:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


def _run(compiled, grid: tuple, device: int, bound: tuple) -> None:
    """The compiled kernel's own launcher, on the current stream of `device` (grid: 3 values)."""
    stream = driver.active.get_current_stream(device)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _idle(enter) and _idle(exit_):  # (no metadata to build for hooks that do nothing)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *bound)
    else:
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *bound), enter, exit_, *bound)


class Plan:
    """A launch to repeat: the compiled kernel `launch` found for a call, its grid, the values of
    the parameters after the positional ones (constexprs and options), the device it is
    loaded on, the positions of its TMA descriptor arguments (with a descriptor of each, to
    rebuild them: `slots`) and, where Triton's launcher allows, its direct launch (`_Direct`)."""

    __slots__ = ("compiled", "grid", "tail", "device", "slots", "direct")

    def __init__(self, compiled, grid: tuple, tail: tuple, device: int, slots: tuple = (),
                 direct: _Direct | None = None) -> None:
        self.compiled, self.grid, self.tail, self.device = compiled, grid, tail, device
        self.slots, self.direct = slots, direct


def _is_descriptor(a) -> bool:
    return hasattr(a, "block_shape") and hasattr(a, "layout")


def _over_whole_tensor(d) -> bool:
    """A descriptor whose shape and strides are its base tensor's: rebuilt from the tensor alone."""
    return list(d.shape) == list(d.base.shape) and list(d.strides) == list(d.base.stride())


class _Direct:
    """Triton 3.6's compiled C launcher of a kernel (`CudaLauncher.launch`'s inner function, or
    that function itself for a kernel without descriptors) and the arguments it takes between
    the stream and the kernel's own: called without `CudaLauncher.__call__` and its descriptor
    wrapper. `encode`: per descriptor slot, last first, (position, a descriptor of it, the
    launcher's TMA metadata, the cache key of the values `make_tensordesc_arg` encodes besides
    the tensor)."""

    __slots__ = ("launcher", "prefix", "encode")

    def __init__(self, launcher, prefix: tuple, encode: tuple) -> None:
        self.launcher, self.prefix, self.encode = launcher, prefix, encode


def _direct_launch(compiled, slots: tuple) -> _Direct | None:
    """The direct launch of `compiled` (None where its launcher is not the one this module knows:
    another backend or Triton version, scratch memory to allocate per call, descriptors the
    kernel reads without TMA)."""
    run = getattr(compiled, "run", None)
    if not isinstance(run, CudaLauncher) or run.global_scratch_size or run.profile_scratch_size:
        return None
    inner = run.launch
    if getattr(inner, "__closure__", None) is None:  # no descriptors: Triton calls the C launcher itself
        if slots:
            return None
        metas = ()
        launcher = inner
    else:
        cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__), strict=True))
        metas = cells.get("tensordesc_meta")
        launcher = cells.get("launcher")
        if launcher is None or not metas or len(metas) != len(slots) or None in metas:
            return None
        metas = tuple(metas)
    encode = tuple((pos, proto, m, (m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]),
                                    m["fp4_padded"], proto.padding))
                   for (pos, proto), m in zip(slots, metas, strict=True))
    # (global and profile scratch: none; launch_metadata and the enter / exit hooks: None, see run_plan)
    prefix = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
              None, None, None)
    return _Direct(launcher, prefix, encode[::-1])


def make_plan(kernel, grid: tuple, *args, **kwargs) -> Plan | None:
    """`launch(kernel, grid, *args, **kwargs)`, then the Plan that repeats it with other tensors
    of the same metadata (None where `launch` does not cache: interpreted kernels, parameters
    left to their defaults, tensors by keyword; while `launch` is replaced; and where a TMA
    descriptor does not span its whole tensor)."""
    if not plans_enabled(kernel):
        launch(kernel, grid, *args, **kwargs)  # (a spy's, if one replaced it)
        return None
    cached = _launch(kernel, grid, args, kwargs)
    if cached is None:
        return None
    (compiled, tail, _), device = cached
    slots = tuple((i, a) for i, a in enumerate(args) if _is_descriptor(a))
    if not all(_over_whole_tensor(d) for _, d in slots):
        return None
    slots = tuple((i, _without_tensor(d)) for i, d in slots)  # (a plan must not keep this call's tensors alive)
    return Plan(compiled, _grid3(grid), tail, device, slots, _direct_launch(compiled, slots))


def current_device() -> int:
    """The current CUDA device (what a plan's key holds: its compiled kernel is loaded there)."""
    return driver.active.get_current_device()


def plans_enabled(kernel) -> bool:
    """Whether a launcher of `kernel` may use its plans: a compiled kernel (not the
    interpreter's), and `launch` not replaced (a spy sees every launch then). A launcher's key
    holds `current_device()`: a plan runs where it was made."""
    return launch is _LAUNCH and isinstance(kernel, JITFunction) and not knobs.runtime.interpret


def run_plan(plan: Plan, *args) -> None:
    """Launch `plan` with `args`: the leading arguments of the call that made it, as new tensors
    of the same metadata, where each TMA descriptor's place takes the tensor it was built over;
    on the current stream of the plan's device. Through Triton's C launcher directly
    (`_Direct`), unless a launch hook is set (profilers): then as `launch` does."""
    direct = plan.direct
    if direct is not None and _idle(knobs.runtime.launch_enter_hook) and _idle(knobs.runtime.launch_exit_hook):
        if direct.encode:
            args = list(args)
            for pos, proto, meta, spec in direct.encode:  # (last first: no shift before it)
                args[pos:pos + 1] = _encoded(args[pos], proto, meta, spec)
        grid = plan.grid
        direct.launcher(grid[0], grid[1], grid[2], driver.active.get_current_stream(plan.device), *direct.prefix,
                        *args, *plan.tail)
        return
    if plan.slots:
        args = list(args)
        for pos, proto in plan.slots:
            args[pos] = _rebuilt(proto, args[pos])
    _run(plan.compiled, plan.grid, plan.device, (*args, *plan.tail))


class Planned:
    """A launcher's plan (`make_plan`) with the arguments after its call's tensors (`tail`, fixed
    by the launcher's key) and how the call's tensors become the plan's leading arguments
    (`arrange`, None: as they are). Launchers return it, so that a caller whose own key fixes
    what the launcher's key holds can launch it again (`runnable`, `Planned.launch`)."""

    __slots__ = ("plan", "kernel", "tail", "arrange")

    def __init__(self, plan: Plan, kernel, tail: tuple, arrange=None) -> None:
        self.plan, self.kernel, self.tail, self.arrange = plan, kernel, tail, arrange

    def launch(self, *tensors) -> None:
        run_plan(self.plan, *(self.arrange(*tensors) if self.arrange is not None else tensors), *self.tail)


def keep(table: dict, key, plan: Plan | None, kernel, tail: tuple, arrange=None) -> Planned | None:
    """A launcher's last step: `plan` as a Planned (see there) kept under `key` in its `table`,
    and returned; None where the launcher keeps no plan (no key, or `make_plan` made none)."""
    if key is None or plan is None:
        return None
    planned = Planned(plan, kernel, tail, arrange)
    keep_plan(table, key, planned)
    return planned


def runnable(*planned: Planned | None) -> bool:
    """Whether each of these plans may launch now: given, plans on for its kernel
    (`plans_enabled`), the current device the one it was made on."""
    device = None
    for p in planned:
        if p is None or not plans_enabled(p.kernel):
            return False
        device = current_device() if device is None else device
        if p.plan.device != device:
            return False
    return True


def _idle(hook) -> bool:
    """No launch hook to call: Triton 3.6's hooks are chains, empty unless a profiler adds one
    (its launcher then calls the empty chain with launch metadata built for nothing)."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


def _without_tensor(d):
    """Descriptor `d` without its tensor, shape and strides: what `_rebuilt` fills in again."""
    proto = object.__new__(type(d))
    proto.__dict__.update(d.__dict__)
    proto.base = proto.shape = proto.strides = None
    return proto


def _rebuilt(proto, t):
    """`proto` (a descriptor over a whole tensor) over `t` instead."""
    d = object.__new__(type(proto))
    d.__dict__.update(proto.__dict__)
    d.base, d.shape, d.strides = t, list(t.shape), list(t.stride())
    return d


# Encoded TMA descriptors (Triton's launcher arguments for one: the CUtensorMap, shape and
# strides) by (address, shape, strides, spec): a pure function of these, so a tensor at an
# address the caching allocator hands out again reuses its encoding.
_ENCODED = plan_table()  # (forgotten with the plans)
_ENCODED_MAX = 4 * PLANS_MAX  # several descriptors a plan (4 a forward, up to 9 a backward): a table 4x the plans


def _encoded(t, proto, meta: dict, spec: tuple) -> list:
    key = (t.data_ptr(), t.shape, t.stride(), spec)
    hit = _ENCODED.get(key)
    if hit is None:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        hit = _ENCODED[key] = make_tensordesc_arg(_rebuilt(proto, t), meta)
    return hit


_LAUNCH = launch  # (plans_enabled: whether `launch` is still this module's own)
