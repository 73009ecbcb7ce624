"""Compiled and interpreted copies of the kernel families.

CUDA tensors run the kernels compiled. CPU tensors run the very same kernel source
through Triton's interpreter: `@triton.jit` decides between the two at decoration time,
so the whole `fmha.kernels` package is imported a second time, under another name, with
the interpreter switched on. Its relative imports resolve inside the copy, so nested
`@triton.jit` calls are interpreted too. The user sets no environment variable.

Two small patches to Triton 3.6's interpreter, applied when the copy is first made:
- it multiplies the raw bit patterns of bf16 operands in `tl.dot`; `_patch_bf16_dot`
  widens them to fp32 first (exact), which is what the GPU's tensor cores compute;
- it converts fp32 to bf16 by truncation; `_patch_bf16_rounding` rounds to nearest even,
  as the GPU does;
- its float8 conversions are wrong (rounding that does not carry into the exponent, no
  saturation, e5m2 <-> e4m3 fails) and `tl.dot` widens fp8 through the same code;
  `_patch_fp8` converts exactly through torch's float8 types, saturating to the largest
  finite value as the GPU's `cvt.rn.satfinite` does;
- Triton's own library functions (`tl.zeros`, `tl.max`, `tl.philox`, ...) were decorated
  compiled, and a compiled `JITFunction` refuses to be called from Python;
  `_patch_jit_calls` runs them interpreted while an interpreted grid is executing.
  The same wrapper undoes what the interpreter leaves patched in `triton.language` after
  a run (nested interpreted calls patch it and never restore it), so CUDA kernels still
  compile in a process that ran CPU tensors first. The interpreter's grid index and its
  patches are process-wide, so interpreted launches are serialised by a lock.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

_PACKAGE_DIR = Path(__file__).parent.parent  # fmha/kernels: the package copied for the interpreter
_KERNELS_PACKAGE = __package__.rsplit(".", 1)[0]
_INTERPRETED_NAME = "_fmha_interpreted_kernels"
_lock = threading.Lock()
_run_lock = threading.RLock()  # one interpreted grid at a time: the interpreter's state is global


def _check_numpy_for_interpreter() -> None:
    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    if (major, minor) >= (2, 3):
        raise RuntimeError(
            f"CPU tensors run through Triton's interpreter, which fails with numpy "
            f"{np.__version__}; install numpy<2.3 (pip install 'numpy<2.3') or use CUDA tensors"
        )


def _patch_bf16_rounding() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_fmha_patched", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = np.isnan(src.data)
            rounded = np.where(nan, np.uint32(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._fmha_patched = True
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)


def _patch_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_fmha_patched", False):
        return
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:  # stored as uint16 bit patterns
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._fmha_patched = True
    builder.create_dot = create_dot


def _patch_fp8() -> None:
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_fp_to_fp, "_fmha_patched", False):
        return
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    original_fp_to_fp, original_dot = builder.create_fp_to_fp, builder.create_dot

    def to_f32(handle) -> np.ndarray:
        ty = handle.dtype.scalar
        if ty in fp8:
            return torch.from_numpy(np.ascontiguousarray(handle.data)).view(fp8[ty]).float().numpy()
        if ty == tl.bfloat16:
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data.astype(np.float32)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty not in fp8 and dst_ty not in fp8:
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        x = to_f32(src)
        if dst_ty in fp8:
            big = torch.finfo(fp8[dst_ty]).max
            x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            x = torch.where(x.isnan(), x, x.clamp(-big, big))  # satfinite, NaN stays NaN
            data = x.to(fp8[dst_ty]).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, dst_ty)
        if dst_ty == tl.bfloat16:
            return self.cast_impl(interpreter.TensorHandle(x, tl.float32), dst_type)
        return interpreter.TensorHandle(x.astype(interpreter._get_np_dtype(dst_type)), dst_ty)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in fp8 or b.dtype.scalar in fp8:  # exact products, fp32 sums
            a = interpreter.TensorHandle(to_f32(a), tl.float32)
            b = interpreter.TensorHandle(to_f32(b), tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_fp_to_fp._fmha_patched = True
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_dot = create_dot


_interpreting = threading.local()


def _patch_jit_calls() -> None:
    from triton.runtime import interpreter, jit

    if getattr(jit.JITFunction.__call__, "_fmha_patched", False):
        return
    compiled_call = jit.JITFunction.__call__
    grid_call = interpreter.GridExecutor.__call__
    interpreted: dict[int, interpreter.InterpretedFunction] = {}

    def jit_call(self, *args, **kwargs):
        if getattr(_interpreting, "depth", 0) == 0:
            return compiled_call(self, *args, **kwargs)
        fn = interpreted.get(id(self))
        if fn is None:
            fn = interpreted[id(self)] = interpreter.InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    def run_grid(self, *args, **kwargs):
        depth = getattr(_interpreting, "depth", 0)
        if depth:
            return grid_call(self, *args, **kwargs)
        with _run_lock:
            saved = _language_state()
            _interpreting.depth = 1
            try:
                return grid_call(self, *args, **kwargs)
            finally:
                _interpreting.depth = 0
                _restore_language_state(saved)

    jit_call._fmha_patched = True
    jit.JITFunction.__call__ = jit_call
    interpreter.GridExecutor.__call__ = run_grid


def _language_objects() -> list:
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.standard, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]


def _language_state() -> list[tuple[object, dict]]:
    return [(obj, dict(vars(obj))) for obj in _language_objects()]


def _restore_language_state(saved: list[tuple[object, dict]]) -> None:
    """Put back every attribute of triton.language that an interpreted run changed.

    Names the run added stay on modules: the interpreter also copies its own globals into
    the modules of the functions it rewrites, and its cached rewrites refer to them.
    """
    for obj, before in saved:
        now = vars(obj)
        if isinstance(obj, type):
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)


_MISSING = object()


def _interpreted_package() -> str:
    """Import the interpreted copy of this package once; return its module name."""
    if _INTERPRETED_NAME in sys.modules:
        return _INTERPRETED_NAME
    _check_numpy_for_interpreter()
    import triton

    _patch_bf16_dot()
    _patch_bf16_rounding()
    _patch_fp8()
    _patch_jit_calls()
    spec = importlib.util.spec_from_file_location(
        _INTERPRETED_NAME, _PACKAGE_DIR / "__init__.py",
        submodule_search_locations=[str(_PACKAGE_DIR)],
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[_INTERPRETED_NAME] = package
    previous = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = True
    try:
        spec.loader.exec_module(package)
    finally:
        triton.knobs.runtime.interpret = previous
    return _INTERPRETED_NAME


class _GuardedModule:
    """A compiled kernel module whose `launch*` functions survive a damaged Triton cache
    entry (evicted with a warning, compiled again: see fmha.kernels.launch.jit_cache)."""

    def __init__(self, module: ModuleType) -> None:
        from .jit_cache import guard_launch

        self._module = module
        self._launchers = {n: guard_launch(f, module) for n, f in vars(module).items()
                           if n.startswith("launch") and callable(f)}

    def __getattr__(self, name: str):
        launcher = self._launchers.get(name)
        return launcher if launcher is not None else getattr(self._module, name)


_guarded: dict[str, _GuardedModule] = {}


def family_module(name: str, *, interpreted: bool) -> ModuleType:
    """The kernel module `fmha.kernels.<name>`, compiled (launchers guarded against a
    damaged Triton cache) or interpreted."""
    if not interpreted:
        guarded = _guarded.get(name)
        if guarded is None:
            guarded = _guarded.setdefault(name, _GuardedModule(importlib.import_module(f"{_KERNELS_PACKAGE}.{name}")))
        return guarded  # type: ignore[return-value]
    import triton

    with _lock:
        package = _interpreted_package()
        full = f"{package}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        previous = triton.knobs.runtime.interpret
        triton.knobs.runtime.interpret = True
        try:
            return importlib.import_module(full)
        finally:
            triton.knobs.runtime.interpret = previous
