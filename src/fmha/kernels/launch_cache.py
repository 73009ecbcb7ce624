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
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

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
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *bound),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)


class Plan:
    """A launch to repeat: the compiled kernel `launch` found for a call, its grid, the values of
    the parameters after the positional ones (constexprs and options), and the device it is
    loaded on."""

    __slots__ = ("compiled", "grid", "tail", "device")

    def __init__(self, compiled, grid: tuple, tail: tuple, device: int) -> None:
        self.compiled, self.grid, self.tail, self.device = compiled, grid, tail, device


def make_plan(kernel, grid: tuple, *args, **kwargs) -> Plan | None:
    """`launch(kernel, grid, *args, **kwargs)`, then the Plan that repeats it with other tensors
    of the same metadata (None where `launch` does not cache: interpreted kernels, parameters
    left to their defaults, tensors by keyword; and while `launch` is replaced)."""
    if not plans_enabled(kernel):
        launch(kernel, grid, *args, **kwargs)  # (a spy's, if one replaced it)
        return None
    cached = _launch(kernel, grid, args, kwargs)
    if cached is None:
        return None
    (compiled, tail, _), device = cached
    return Plan(compiled, _grid3(grid), tail, device)


def current_device() -> int:
    """The current CUDA device (what a plan's key holds: its compiled kernel is loaded there)."""
    return driver.active.get_current_device()


def plans_enabled(kernel) -> bool:
    """Whether a launcher of `kernel` may use its plans: a compiled kernel (not the
    interpreter's), and `launch` not replaced (a spy sees every launch then). A launcher's key
    holds `current_device()`: a plan runs where it was made."""
    return launch is _LAUNCH and isinstance(kernel, JITFunction) and not knobs.runtime.interpret


def run_plan(plan: Plan, *args) -> None:
    """Launch `plan` with `args`: the same leading arguments as the call that made it (new
    tensors of the same metadata) on the current stream of the plan's device."""
    _run(plan.compiled, plan.grid, plan.device, (*args, *plan.tail))


_PLAN_TABLES: list[dict] = []
PLANS_MAX = 1024  # per launcher; a full table is cleared


def plan_table() -> dict:
    """A launcher's table of plans (key -> its plan), registered for `clear_plans`."""
    table: dict = {}
    _PLAN_TABLES.append(table)
    return table


def keep_plan(table: dict, key, planned) -> None:
    if len(table) >= PLANS_MAX:
        table.clear()
    table[key] = planned


def clear_plans() -> None:
    """Forget every launcher's plans (after changing what a launcher reads besides its
    arguments, e.g. a test's monkeypatched tile shapes: the keys do not see that)."""
    for table in _PLAN_TABLES:
        table.clear()


_LAUNCH = launch  # (plans_enabled: whether `launch` is still this module's own)
