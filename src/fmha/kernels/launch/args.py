"""Host-side helpers shared by the launchers: strides and constexpr flags from tensors.

Kernel views are bhsd (dense) or packed (total, H, D) (varlen); lse-like tensors are
(B, Hq, Sq) or (Hq, total_q). Absent optional tensors get zero strides.
"""

import torch


def seq_strides(t, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides; packed tensors have no batch stride."""
    return (0, t.stride(1), t.stride(0)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def row_strides(lse, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides of an lse-shaped tensor."""
    return (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()


def bias_strides(bias) -> tuple[int, int, int, int]:
    return bias.stride() if bias is not None else (0, 0, 0, 0)


def alibi_strides(alibi_slopes) -> tuple[int, int]:
    """(batch, head) strides of (B or 1, Hq) slopes; a batch of 1 broadcasts."""
    if alibi_slopes is None:
        return (0, 0)
    return (alibi_slopes.stride(0) if alibi_slopes.shape[0] > 1 else 0, alibi_slopes.stride(1))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grids: `triton.cdiv` is a constexpr_function in Triton 3.6,
    ~2.5 us of Python per call (its arguments unwrapped as constexprs), this ~0.05 us."""
    return -(-a // b)


def padded_dim(d: int) -> int:
    """Head dims are padded to a power of two (at least 16, tl.dot's minimum) inside the kernel."""
    return max(16, 1 << (d - 1).bit_length())  # (triton.next_power_of_2 costs ~10 us per call)


def feature_flags(window, sink_size, softcap, bias, alibi_slopes, dropout_p, align_bottom_right,
                  cu_seqlens_q, seqused_k) -> dict:
    """The constexpr feature flags the dense forward and backward kernels share."""
    left, right = window
    return dict(
        IS_VARLEN=cu_seqlens_q is not None, HAS_SEQUSED_K=seqused_k is not None,
        ALIGN_BOTTOM_RIGHT=align_bottom_right, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_SINK_TOKENS=sink_size > 0, HAS_SOFTCAP=softcap > 0, HAS_BIAS=bias is not None,
        HAS_ALIBI=alibi_slopes is not None, HAS_DROPOUT=dropout_p > 0,
    )


_UNIT_DESCALES: dict = {}


def unit_descale(device) -> torch.Tensor:
    """A (1, 1) fp32 one on `device`: an absent float8 descale. Kept per device (read only), except
    while a CUDA graph is being captured (a tensor allocated then belongs to the graph's memory pool)."""
    one = _UNIT_DESCALES.get(device)
    if one is None:
        one = torch.ones((1, 1), dtype=torch.float32, device=device)
        if not (one.is_cuda and torch.cuda.is_current_stream_capturing()):
            _UNIT_DESCALES[device] = one
    return one


def descale_views(descales: tuple | None, device) -> tuple:
    """The three fp8 descale kernel views (B or 1, H or 1, blocks) of `fmha.fp8.check_descales`, an
    absent one (None) as 1 for every (batch, head): `unit_descale` with zero strides."""
    descales = descales or (None, None, None)
    if any(d is None for d in descales):  # (not `None in`: a tensor's == None costs ~13 us)
        one = unit_descale(device).as_strided((1, 1, 1), (0, 0, 0))
        descales = tuple(one if d is None else d for d in descales)
    return tuple(descales)
