"""Host and layout helpers shared by the Hopper Gluon kernels (fwd_gluon, bwd_gluon):
wgmma accumulator layouts, TMA descriptors over (B, H, S, D) views, their compile-time
signature strings, the alignment rule TMA imposes, and the TMA reduce-add Gluon 3.6 lacks."""

from __future__ import annotations

import functools

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # (imported per call: +2 us a descriptor)

_ELEMENTS = {"fp16": gl.float16, "bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv, "fp32": gl.float32}
_TORCH_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float8_e4m3fn": "fp8e4nv",
                "torch.float32": "fp32"}  # fp32: the backward's dQ accumulator (TMA reduce-add)


@gluon.constexpr_function
def acc_layout(rows, cols, num_warps, instr_k=16):
    """wgmma accumulator layout of a [rows, cols] tile: warps down the rows first (16 rows
    per warp), then across the columns; the widest instruction N that divides a warp's columns.
    instr_k: the instruction's K, 16 for 16-bit operands, 32 for fp8."""
    wm = min(num_warps, rows // 16)
    wn = num_warps // wm
    n = 256
    while n > cols // wn or (cols // wn) % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, n, instr_k])


def tma_aligned(*tensors) -> bool:
    """Base pointers and all but the last (unit) stride 16-byte aligned, no broadcast
    (stride 0) dimension of extent > 1: what a TMA descriptor can address. (On every launch:
    written to read each stride once and no torch.device, ~2 us a tensor instead of ~4.)"""
    for t in tensors:
        strides = t.stride()
        if strides[-1] != 1 or (not t.is_meta and t.data_ptr() % 16):
            return False
        size = t.element_size()
        for extent, stride in zip(t.shape, strides[:-1], strict=False):  # (all but the last dimension)
            if (stride * size) % 16 or (extent > 1 and stride <= 0):
                return False
    return True


@functools.cache
def _shared_layout(dtype: str, rows: int, cols: int):
    """The swizzled layout of a [1, 1, rows, cols] block; cached: building one costs ~15 us of
    Python (constexpr unwrapping), a third of a small problem's host path."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], _ELEMENTS[dtype])


def descriptor(t, block_rows: int, block_cols: int | None = None):
    """A 4-d TMA descriptor over a (B, H, S, D) view: loads/stores of one (b, h) block of
    `block_rows` rows and `block_cols` columns (default: all D). The caller has checked
    `tma_aligned(t)`."""
    cols = block_cols or t.shape[-1]
    return fast_descriptor(t, [1, 1, block_rows, cols], _shared_layout(_TORCH_NAMES[str(t.dtype)], block_rows, cols))


def fast_descriptor(t, block_shape: list, layout):
    """`TensorDescriptor(t, shape, strides, block_shape, layout)` without its per-call checks
    (alignment, block shape, layout type: ~8 us of Python per descriptor), which
    `tma_aligned` and the cached layouts already guarantee."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    desc.block_shape, desc.layout, desc.padding = block_shape, layout, "zero"
    return desc


def descriptor_type(dtype: str, block_rows: int, cols: int) -> str:
    """The signature string of `descriptor(t, block_rows, cols)` for an ahead-of-time compile."""
    layout = _shared_layout(dtype, block_rows, cols)
    return f"tensordesc<{dtype}[1,1,{block_rows},{cols}],{layout!r}>"


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """`global[coord...] += src` for a shared-memory tile, by the TMA unit
    (`cp.reduce.async.bulk.tensor ... .add`; complete with `tma.store_wait`, like a TMA store).
    Triton 3.6's Gluon builds this op (`create_async_tma_reduce`) but its Hopper `tma` module has
    no front-end function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
