"""Numpy float64 ground truth for everything ``fmha`` computes.

Every GPU kernel of the library is validated against the functions in this module.
They implement the math of SPEC.md sections 1-3 as directly as possible: dense
``(Sq, Sk)`` score matrices, explicit masks, plain softmax, and the textbook backward
formulas. Nothing here is fast and nothing here tries to be; when a kernel and this
module disagree, this module is meant to be obviously right.

Conventions
-----------
* Every array input is converted to float64 with ``np.asarray(x, dtype=np.float64)``
  (this works for ``ml_dtypes.bfloat16`` arrays, too); every returned array is float64
  (boolean masks and lists of arrays excepted).
* Dense tensors use the ``bhsd`` layout: ``q (B, Hq, Sq, Dq)``, ``k (B, Hk, Sk, Dq)``,
  ``v (B, Hk, Sk, Dv)``, ``o (B, Hq, Sq, Dv)``, ``lse (B, Hq, Sq)``. ``Hq % Hk == 0`` and
  query head ``h`` reads kv head ``h // (Hq // Hk)`` (GQA / MQA).
* ``lse`` is the natural-log log-sum-exp of the (soft-capped, biased, masked) logits,
  including the sink logit when ``sinks`` is given, computed before dropout. A row with
  no visible key has ``o = 0`` and ``lse = -inf`` (or ``sinks[h]``); never NaN, and no
  floating point warnings are emitted.
* The reference never draws random numbers: dropout needs an explicit boolean keep mask.

The module imports only numpy and the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "alibi_bias",
    "apply_rotary",
    "attention_bwd",
    "attention_fwd",
    "attention_varlen_bwd",
    "attention_varlen_fwd",
    "attention_with_kvcache",
    "batch_prefill_with_kvcache",
    "from_bhsd",
    "max_abs_error",
    "merge_states",
    "page_table_from_indptr",
    "paged_gather",
    "relative_error",
    "to_bhsd",
    "visible_mask",
]

_MASK_ALIGNS = ("bottom_right", "top_left")
_LAYOUTS = ("bhsd", "bshd")


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------


def _f64(x, name: str) -> np.ndarray:
    """``x`` as a float64 ndarray."""
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be convertible to a float64 array: {e}") from None


def _int_array(x, name: str) -> np.ndarray:
    """``x`` as an int64 ndarray; refuses non-integer input."""
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    return a.astype(np.int64)


def _offset(seqlen_q: int, seqlen_k: int, mask_align: str) -> int:
    """Diagonal offset ``off`` of SPEC step 3/4: ``Sk - Sq`` (bottom-right) or 0."""
    if mask_align not in _MASK_ALIGNS:
        raise ValueError(f"mask_align={mask_align!r} is not one of {_MASK_ALIGNS}")
    return seqlen_k - seqlen_q if mask_align == "bottom_right" else 0


def _window(causal: bool, window) -> tuple[int, int]:
    """Effective ``(left, right)`` window; ``causal`` forces ``right = 0``."""
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair of ints (left, right), got {window!r}") from None
    if causal:
        right = 0
    return left, right


def _sum_to_shape(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a broadcast gradient ``g`` to ``shape`` (the shape of the broadcast input).

    Leading dimensions that ``shape`` lacks are summed away; dimensions where ``shape``
    has size 1 are summed with ``keepdims``.
    """
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _to_4d(x: np.ndarray) -> np.ndarray:
    """Prepend size-1 dimensions until ``x`` has 4 dimensions."""
    if x.ndim > 4:
        raise ValueError(f"expected at most 4 dimensions, got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


# ---------------------------------------------------------------------------
# masks and biases
# ---------------------------------------------------------------------------


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
) -> np.ndarray:
    """Boolean ``(Sq, Sk)`` matrix: ``True`` where key ``j`` is visible to query ``i``.

    SPEC step 4: with ``off = Sk - Sq`` ("bottom_right") or ``0`` ("top_left"), column
    ``j`` is visible to row ``i`` iff
    ``((left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right))``
    or ``j < sink_size``. ``causal=True`` means ``right = 0`` (and ``left`` as given,
    ``-1`` by default).
    """
    off = _offset(seqlen_q, seqlen_k, mask_align)
    left, right = _window(causal, window)
    if sink_size < 0:
        raise ValueError(f"sink_size={sink_size} must be >= 0")
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    in_left = (j >= i + off - left) if left >= 0 else np.ones((seqlen_q, seqlen_k), bool)
    in_right = (j <= i + off + right) if right >= 0 else np.ones((seqlen_q, seqlen_k), bool)
    return (in_left & in_right) | (j < sink_size)


def alibi_bias(
    slopes,
    seqlen_q: int,
    seqlen_k: int,
    *,
    mask_align: str = "bottom_right",
) -> np.ndarray:
    """ALiBi bias ``-slope[b?, h] * |i + off - j|``.

    ``slopes`` is ``(H,)`` (result ``(1, H, Sq, Sk)``) or ``(B, H)`` (result
    ``(B, H, Sq, Sk)``); ``off`` as in :func:`visible_mask`.
    """
    slopes = _f64(slopes, "alibi_slopes")
    if slopes.ndim == 1:
        slopes = slopes[None, :]
    if slopes.ndim != 2:
        raise ValueError(f"alibi_slopes must be (H,) or (B, H), got shape {slopes.shape}")
    off = _offset(seqlen_q, seqlen_k, mask_align)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    dist = np.abs(i + off - j).astype(np.float64)  # (Sq, Sk)
    return -slopes[:, :, None, None] * dist[None, None, :, :]


# ---------------------------------------------------------------------------
# dense attention
# ---------------------------------------------------------------------------


def _check_dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int]:
    """Validate bhsd shapes; return ``(B, Hq, Hk, Sq, Sk)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, S, D) in bhsd layout, got shape {x.shape}")
    B, Hq, Sq, Dq = q.shape
    Bk, Hk, Sk, Dk = k.shape
    if Bk != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if Dk != Dq:
        raise ValueError(f"head dim of k ({Dk}) differs from head dim of q ({Dq})")
    if v.shape[1] != Hk or v.shape[2] != Sk:
        raise ValueError(f"v shape {v.shape} does not match k shape {k.shape} in (B, Hk, Sk)")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"nhead_q={Hq} is not a multiple of nhead_k={Hk}")
    return B, Hq, Hk, Sq, Sk


def _forward_core(
    q,
    k,
    v,
    *,
    scale,
    causal,
    window,
    mask_align,
    sink_size,
    bias,
    alibi_slopes,
    softcap,
    sinks,
    dropout_p,
    dropout_mask,
) -> dict:
    """All forward intermediates, shared by :func:`attention_fwd` and :func:`attention_bwd`.

    Returned keys (shapes for bhsd inputs):
    ``q, k, v`` float64 inputs; ``k_rep, v_rep`` (B, Hq, Sk, D) kv heads repeated per query
    head; ``scale``; ``s_raw`` (B, Hq, Sq, Sk) scaled logits before soft-cap; ``valid``
    bool (B, Hq, Sq, Sk) entries that take part in the softmax; ``p`` softmax probabilities
    (before dropout); ``drop`` the dropout factor ``keep / (1 - p)`` or ``None``; ``p_sink``
    (B, Hq, Sq) probability mass of the sink logit or ``None``; ``lse`` (B, Hq, Sq);
    ``o`` (B, Hq, Sq, Dv); plus the normalised arguments ``bias, sinks, softcap``.
    """
    q = _f64(q, "q")
    k = _f64(k, "k")
    v = _f64(v, "v")
    B, Hq, Hk, Sq, Sk = _check_dense(q, k, v)
    Dq = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(Dq)
    scale = float(scale)
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"softcap={softcap} must be >= 0 (0 disables soft-capping)")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if dropout_p > 0.0 and dropout_mask is None:
        raise ValueError(
            "dropout_p > 0 needs an explicit boolean dropout_mask: the reference draws no random numbers"
        )

    # Step 1: scaled logits, each query head against its kv head.
    group = Hq // Hk
    k_rep = np.repeat(k, group, axis=1)  # (B, Hq, Sk, Dq)
    v_rep = np.repeat(v, group, axis=1)  # (B, Hq, Sk, Dv)
    s_raw = scale * (q @ np.swapaxes(k_rep, -1, -2))  # (B, Hq, Sq, Sk)

    # Step 2: soft-cap.
    s = softcap * np.tanh(s_raw / softcap) if softcap > 0 else s_raw.copy()

    # Step 3: additive bias and ALiBi.
    if bias is not None:
        bias = _f64(bias, "bias")
        s = s + np.broadcast_to(bias, (B, Hq, Sq, Sk))
    if alibi_slopes is not None:
        slopes = _f64(alibi_slopes, "alibi_slopes")
        if slopes.shape not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must be ({Hq},) or ({B}, {Hq}), got {slopes.shape}")
        s = s + alibi_bias(slopes, Sq, Sk, mask_align=mask_align)

    # Step 4: mask. Entries that are -inf already (e.g. from the bias) count as masked.
    mask = visible_mask(Sq, Sk, causal=causal, window=window, mask_align=mask_align, sink_size=sink_size)
    valid = mask[None, None, :, :] & (s > -np.inf)
    s = np.where(valid, s, -np.inf)

    # Steps 5-6: softmax with an optional sink logit that joins only the denominator.
    m = np.max(s, axis=-1, initial=-np.inf)  # (B, Hq, Sq); initial handles Sk = 0
    if sinks is not None:
        sinks = _f64(sinks, "sinks")
        if sinks.shape != (Hq,):
            raise ValueError(f"sinks must have shape ({Hq},), got {sinks.shape}")
        sink_logit = np.broadcast_to(sinks[None, :, None], (B, Hq, Sq))
        m = np.maximum(m, sink_logit)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(valid, np.exp(s - m_safe[..., None]), 0.0)  # exp(-inf) = 0, no warning
    denom = e.sum(axis=-1)
    if sinks is not None:
        e_sink = np.exp(sink_logit - m_safe)
        denom = denom + e_sink
    has_mass = denom > 0
    denom_safe = np.where(has_mass, denom, 1.0)
    lse = np.where(has_mass, m_safe + np.log(denom_safe), -np.inf)
    p = e / denom_safe[..., None]  # rows without mass are all zero already
    p_sink = e_sink / denom_safe if sinks is not None else None

    # Step 7: dropout with an explicit keep mask.
    drop = None
    if dropout_mask is not None:
        keep = np.asarray(dropout_mask)
        if keep.dtype != np.bool_:
            raise TypeError(f"dropout_mask must be a boolean keep mask, got dtype {keep.dtype}")
        drop = np.broadcast_to(keep, (B, Hq, Sq, Sk)).astype(np.float64) / (1.0 - dropout_p)
    p_dropped = p * drop if drop is not None else p

    # Step 8: output.
    o = p_dropped @ v_rep  # (B, Hq, Sq, Dv)
    return {
        "q": q,
        "k": k,
        "v": v,
        "k_rep": k_rep,
        "v_rep": v_rep,
        "scale": scale,
        "s_raw": s_raw,
        "valid": valid,
        "p": p,
        "drop": drop,
        "p_sink": p_sink,
        "lse": lse,
        "o": o,
        "bias": bias,
        "sinks": sinks,
        "softcap": softcap,
        "group": group,
    }


def attention_fwd(
    q,
    k,
    v,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
    bias=None,
    alibi_slopes=None,
    softcap: float = 0.0,
    sinks=None,
    dropout_p: float = 0.0,
    dropout_mask=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention forward, SPEC section 1, in float64.

    Shapes: ``q (B, Hq, Sq, Dq)``, ``k (B, Hk, Sk, Dq)``, ``v (B, Hk, Sk, Dv)``;
    ``bias`` broadcastable to ``(B, Hq, Sq, Sk)``; ``alibi_slopes (Hq,)`` or ``(B, Hq)``;
    ``sinks (Hq,)``; ``dropout_mask`` boolean keep mask broadcastable to ``(B, Hq, Sq, Sk)``
    (``p_ij * keep_ij / (1 - dropout_p)``; required when ``dropout_p > 0``, and applied
    whenever given).

    Returns ``o (B, Hq, Sq, Dv)`` and ``lse (B, Hq, Sq)`` (natural log, before dropout).
    """
    f = _forward_core(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=window,
        mask_align=mask_align,
        sink_size=sink_size,
        bias=bias,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
    )
    return f["o"], f["lse"]


def attention_bwd(
    q,
    k,
    v,
    do,
    *,
    dlse=None,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
    bias=None,
    alibi_slopes=None,
    softcap: float = 0.0,
    sinks=None,
    dropout_p: float = 0.0,
    dropout_mask=None,
) -> dict:
    """Attention backward, SPEC section 2, in float64.

    ``do (B, Hq, Sq, Dv)`` is the gradient of ``o``; ``dlse (B, Hq, Sq)`` (optional) the
    gradient of ``lse``. Other arguments as in :func:`attention_fwd`.

    With ``P`` the softmax probabilities (before dropout), ``Z = keep / (1 - p)`` the
    dropout factor (1 without dropout) and ``O`` the forward output:

    * ``dV = (P * Z)^T dO``  (summed over the query heads of each kv head)
    * ``dP = (dO V^T) * Z``
    * ``D = rowsum(dO * O)``  (``O`` already contains ``Z``, so no extra factor here)
    * ``dS = P * (dP - D + dlse)``  (``dlse`` broadcast over the row; ``dS`` is also
      ``dbias``)
    * soft-cap chain rule: ``dS_raw = dS * (1 - tanh^2(s_raw / softcap))``
    * ``dQ = scale * dS_raw K``, ``dK = scale * dS_raw^T Q`` (summed per kv head)
    * ``dsinks[h] = sum_{b,i} p_sink * (dlse - D)``, ``p_sink = exp(sinks[h] - lse)``

    Returns a dict with ``"dq"``, ``"dk"``, ``"dv"`` (shapes of q, k, v), ``"dbias"``
    (``None`` without bias, else exactly the shape of ``bias``, summed over broadcast
    dimensions) and ``"dsinks"`` (``None`` without sinks, else ``(Hq,)``).
    """
    f = _forward_core(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=window,
        mask_align=mask_align,
        sink_size=sink_size,
        bias=bias,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
    )
    q, k, v, o, p = f["q"], f["k"], f["v"], f["o"], f["p"]
    B, Hq, Sq, _ = q.shape
    Hk = k.shape[1]
    group = f["group"]
    do = _f64(do, "do")
    if do.shape != o.shape:
        raise ValueError(f"do must have the shape of o {o.shape}, got {do.shape}")
    if dlse is None:
        dlse = np.zeros((B, Hq, Sq))
    else:
        dlse = _f64(dlse, "dlse")
        if dlse.shape != (B, Hq, Sq):
            raise ValueError(f"dlse must have shape {(B, Hq, Sq)}, got {dlse.shape}")
    drop = f["drop"] if f["drop"] is not None else 1.0

    dv_rep = np.swapaxes(p * drop, -1, -2) @ do  # (B, Hq, Sk, Dv)
    dp = (do @ np.swapaxes(f["v_rep"], -1, -2)) * drop  # (B, Hq, Sq, Sk)
    D = np.sum(do * o, axis=-1)  # (B, Hq, Sq)
    ds = p * (dp - D[..., None] + dlse[..., None])  # zero wherever p is zero (masked)
    ds = np.where(f["valid"], ds, 0.0)

    dbias = _sum_to_shape(ds, f["bias"].shape) if f["bias"] is not None else None

    if f["softcap"] > 0:
        t = np.tanh(f["s_raw"] / f["softcap"])
        ds_raw = ds * (1.0 - t * t)
    else:
        ds_raw = ds
    scale = f["scale"]
    dq = scale * (ds_raw @ f["k_rep"])  # (B, Hq, Sq, Dq)
    dk_rep = scale * (np.swapaxes(ds_raw, -1, -2) @ q)  # (B, Hq, Sk, Dq)

    # GQA: query head h = hk * group + r uses kv head hk; sum over r.
    dk = dk_rep.reshape(B, Hk, group, *dk_rep.shape[2:]).sum(axis=2)
    dv = dv_rep.reshape(B, Hk, group, *dv_rep.shape[2:]).sum(axis=2)

    dsinks = None
    if f["sinks"] is not None:
        dsinks = np.sum(f["p_sink"] * (dlse - D), axis=(0, 2))  # (Hq,)
    return {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias, "dsinks": dsinks}


# ---------------------------------------------------------------------------
# varlen ("group mode")
# ---------------------------------------------------------------------------


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k) -> list[tuple[int, int, int, int]]:
    """Validate packed inputs; return ``(q_start, sq, k_start, sk)`` per sequence."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed (total, H, D), got shape {x.shape}")
    cq = _int_array(cu_seqlens_q, "cu_seqlens_q")
    ck = _int_array(cu_seqlens_k, "cu_seqlens_k")
    if cq.ndim != 1 or ck.ndim != 1 or cq.shape != ck.shape or cq.size < 1:
        raise ValueError(f"cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} must both be (B+1,)")
    for name, cu, total in (
        ("cu_seqlens_q", cq, q.shape[0]),
        ("cu_seqlens_k", ck, k.shape[0]),
    ):
        if cu[0] < 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
            raise ValueError(f"{name}={cu.tolist()} must be non-decreasing, start >= 0 and end <= {total}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k {k.shape} and v {v.shape} have different total_k")
    B = cq.size - 1
    lens_k = np.diff(ck)
    if seqused_k is not None:
        used = _int_array(seqused_k, "seqused_k")
        if used.shape != (B,) or np.any(used < 0) or np.any(used > lens_k):
            raise ValueError(
                f"seqused_k={used.tolist()} must be ({B},) with 0 <= seqused_k[b] <= "
                f"cu_seqlens_k[b+1] - cu_seqlens_k[b] = {lens_k.tolist()}"
            )
        lens_k = used
    return [(int(cq[b]), int(cq[b + 1] - cq[b]), int(ck[b]), int(lens_k[b])) for b in range(B)]


def _varlen_full(x, B: int, Hq: int, max_sq: int, max_sk: int, name: str) -> np.ndarray | None:
    """Broadcast a varlen bias / dropout mask to ``(B, Hq, >= max_sq, >= max_sk)``."""
    if x is None:
        return None
    x4 = _to_4d(np.asarray(x))
    shape = (B, Hq, max(x4.shape[2], max_sq), max(x4.shape[3], max_sk))
    try:
        return np.broadcast_to(x4, shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {np.shape(x)} is not broadcastable to (B, Hq, max_seqlen_q, "
            f"max_seqlen_k) = {(B, Hq, max_sq, max_sk)}"
        ) from None


def _varlen_slices(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, bias, dropout_mask, alibi_slopes):
    """Yield per-sequence dense (1, H, S, D) inputs and keyword overrides."""
    plan = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
    B, Hq = len(plan), q.shape[1]
    max_sq = max((sq for _, sq, _, _ in plan), default=0)
    max_sk = max((sk for _, _, _, sk in plan), default=0)
    bias_full = _varlen_full(_f64(bias, "bias") if bias is not None else None, B, Hq, max_sq, max_sk, "bias")
    keep_full = _varlen_full(dropout_mask, B, Hq, max_sq, max_sk, "dropout_mask")
    slopes = _f64(alibi_slopes, "alibi_slopes") if alibi_slopes is not None else None
    if slopes is not None and slopes.shape not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes must be ({Hq},) or ({B}, {Hq}), got {slopes.shape}")
    for b, (q0, sq, k0, sk) in enumerate(plan):
        qb = np.swapaxes(q[q0 : q0 + sq], 0, 1)[None]  # (1, Hq, sq, Dq)
        kb = np.swapaxes(k[k0 : k0 + sk], 0, 1)[None]  # (1, Hk, sk, Dq)
        vb = np.swapaxes(v[k0 : k0 + sk], 0, 1)[None]  # (1, Hk, sk, Dv)
        kw = {
            "bias": bias_full[b : b + 1, :, :sq, :sk] if bias_full is not None else None,
            "dropout_mask": keep_full[b : b + 1, :, :sq, :sk] if keep_full is not None else None,
            "alibi_slopes": (slopes[b] if slopes is not None and slopes.ndim == 2 else slopes),
        }
        yield b, (q0, sq, k0, sk), qb, kb, vb, kw, bias_full


def attention_varlen_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    seqused_k=None,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
    bias=None,
    alibi_slopes=None,
    softcap: float = 0.0,
    sinks=None,
    dropout_p: float = 0.0,
    dropout_mask=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Varlen ("group mode") forward: one dense :func:`attention_fwd` call per sequence.

    Shapes: packed ``q (total_q, Hq, Dq)``, ``k (total_k, Hk, Dq)``, ``v (total_k, Hk, Dv)``;
    ``cu_seqlens_q``, ``cu_seqlens_k`` int ``(B+1,)``; ``seqused_k`` int ``(B,)`` optional.
    Sequence ``b`` uses query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys
    ``cu_seqlens_k[b] : cu_seqlens_k[b] + sk_b`` with ``sk_b = seqused_k[b]`` if given,
    else ``cu_seqlens_k[b+1] - cu_seqlens_k[b]``. Masks and ALiBi use each sequence's own
    ``(sq_b, sk_b)``. ``bias`` and ``dropout_mask`` are broadcastable to
    ``(B, Hq, max_seqlen_q, max_seqlen_k)`` and indexed by local positions
    (``bias[b, :, :sq_b, :sk_b]``); ``alibi_slopes`` is ``(Hq,)`` or ``(B, Hq)``.

    Returns ``o (total_q, Hq, Dv)`` and ``lse (Hq, total_q)``. Rows of ``q`` outside every
    sequence (past ``cu_seqlens_q[-1]``) get ``o = 0`` and ``lse = -inf``.
    """
    q, k, v = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    o = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for _, (q0, sq, _, _), qb, kb, vb, kw, _ in _varlen_slices(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, bias, dropout_mask, alibi_slopes
    ):
        ob, lseb = attention_fwd(
            qb,
            kb,
            vb,
            scale=scale,
            causal=causal,
            window=window,
            mask_align=mask_align,
            sink_size=sink_size,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            **kw,
        )
        o[q0 : q0 + sq] = np.swapaxes(ob[0], 0, 1)
        lse[:, q0 : q0 + sq] = lseb[0]
    return o, lse


def attention_varlen_bwd(
    q,
    k,
    v,
    do,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    seqused_k=None,
    dlse=None,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
    bias=None,
    alibi_slopes=None,
    softcap: float = 0.0,
    sinks=None,
    dropout_p: float = 0.0,
    dropout_mask=None,
) -> dict:
    """Varlen backward: one dense :func:`attention_bwd` call per sequence.

    ``do (total_q, Hq, Dv)``, ``dlse (Hq, total_q)`` optional; the rest as in
    :func:`attention_varlen_fwd`. Returns packed ``"dq" (total_q, Hq, Dq)``,
    ``"dk" (total_k, Hk, Dq)``, ``"dv" (total_k, Hk, Dv)`` (zero for keys no sequence
    uses), ``"dbias"`` (shape of ``bias``, or ``None``) and ``"dsinks"`` (``(Hq,)`` or
    ``None``).
    """
    q, k, v = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    do = _f64(do, "do")
    if do.shape != (q.shape[0], q.shape[1], v.shape[-1]):
        raise ValueError(f"do must have shape {(q.shape[0], q.shape[1], v.shape[-1])}, got {do.shape}")
    if dlse is not None:
        dlse = _f64(dlse, "dlse")
        if dlse.shape != (q.shape[1], q.shape[0]):
            raise ValueError(f"dlse must have shape {(q.shape[1], q.shape[0])}, got {dlse.shape}")
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = np.zeros(q.shape[1]) if sinks is not None else None
    dbias_full = None
    for b, (q0, sq, k0, sk), qb, kb, vb, kw, bias_full in _varlen_slices(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, bias, dropout_mask, alibi_slopes
    ):
        dob = np.swapaxes(do[q0 : q0 + sq], 0, 1)[None]
        dlseb = dlse[None, :, q0 : q0 + sq] if dlse is not None else None
        g = attention_bwd(
            qb,
            kb,
            vb,
            dob,
            dlse=dlseb,
            scale=scale,
            causal=causal,
            window=window,
            mask_align=mask_align,
            sink_size=sink_size,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            **kw,
        )
        dq[q0 : q0 + sq] += np.swapaxes(g["dq"][0], 0, 1)
        dk[k0 : k0 + sk] += np.swapaxes(g["dk"][0], 0, 1)
        dv[k0 : k0 + sk] += np.swapaxes(g["dv"][0], 0, 1)
        if dsinks is not None:
            dsinks += g["dsinks"]
        if bias_full is not None:
            if dbias_full is None:
                dbias_full = np.zeros(bias_full.shape)
            dbias_full[b : b + 1, :, :sq, :sk] += g["dbias"]
    dbias = None
    if bias is not None:
        bias_shape = np.shape(bias)
        if dbias_full is None:  # no sequences at all
            dbias = np.zeros(bias_shape)
        else:
            shape4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
            dbias = _sum_to_shape(dbias_full, shape4).reshape(bias_shape)
    return {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias, "dsinks": dsinks}


# ---------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------


def to_bhsd(x, layout: str) -> np.ndarray:
    """Convert a 4-D tensor from ``layout`` ("bhsd" or "bshd") to bhsd (float64)."""
    x = _f64(x, "x")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {_LAYOUTS}")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D, got shape {x.shape}")
    return x if layout == "bhsd" else np.swapaxes(x, 1, 2)


def from_bhsd(x, layout: str) -> np.ndarray:
    """Convert a 4-D bhsd tensor to ``layout`` ("bhsd" or "bshd") (float64)."""
    return to_bhsd(x, layout)  # swapping axes 1 and 2 is its own inverse


# ---------------------------------------------------------------------------
# KV cache pieces
# ---------------------------------------------------------------------------


def paged_gather(cache, block_table, seqlens) -> list[np.ndarray]:
    """Contiguous keys (or values) of each batch entry from a paged cache.

    ``cache (num_pages, page_size, Hk, D)``, ``block_table`` int ``(B, max_pages)``,
    ``seqlens`` int ``(B,)``. Token ``t`` of batch ``b`` lives at
    ``cache[block_table[b, t // page_size], t % page_size]``. Returns a list of ``B``
    arrays of shape ``(seqlens[b], Hk, D)``.
    """
    cache = _f64(cache, "cache")
    table = _int_array(block_table, "block_table")
    lens = _int_array(seqlens, "seqlens")
    if cache.ndim != 4:
        raise ValueError(f"cache must be (num_pages, page_size, H, D), got shape {cache.shape}")
    if table.ndim != 2 or lens.shape != (table.shape[0],):
        raise ValueError(f"block_table {table.shape} must be (B, max_pages), seqlens (B,): {lens.shape}")
    num_pages, page_size = cache.shape[:2]
    out = []
    for b in range(table.shape[0]):
        n = int(lens[b])
        if n < 0 or n > table.shape[1] * page_size:
            raise ValueError(f"seqlens[{b}]={n} does not fit in {table.shape[1]} pages of {page_size}")
        t = np.arange(n)
        pages = table[b, t // page_size]
        if np.any((pages < 0) | (pages >= num_pages)):
            raise ValueError(f"block_table[{b}] refers to pages outside [0, {num_pages})")
        out.append(cache[pages, t % page_size])
    return out


def apply_rotary(x, cos, sin, *, positions, interleaved: bool = False) -> np.ndarray:
    """Rotary position embedding, flash_attn ``apply_rotary_emb`` convention.

    ``x (..., S, H, D)``: bshd-like, the sequence axis is axis ``-3``. ``cos``, ``sin``
    ``(max_pos, rotary_dim / 2)``. ``positions`` int, broadcastable to ``x.shape[:-2]``
    (the leading dims plus S, e.g. ``(B, S)``), each in ``[0, max_pos)``.

    The first ``rotary_dim = 2 * cos.shape[-1]`` features are rotated by the angle of
    each token's position; the rest pass through unchanged.

    * ``interleaved=False`` (GPT-NeoX, "half" style): ``x1 = x[..., :r/2]``,
      ``x2 = x[..., r/2:r]``, result ``[x1*c - x2*s, x2*c + x1*s]``.
    * ``interleaved=True`` (GPT-J style): the pairs ``(x[2i], x[2i+1])`` are rotated in
      the same way.
    """
    x = _f64(x, "x")
    cos = _f64(cos, "cos")
    sin = _f64(sin, "sin")
    if x.ndim < 3:
        raise ValueError(f"x must be (..., S, H, D), got shape {x.shape}")
    if cos.ndim != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must both be (max_pos, rotary_dim/2)")
    half = cos.shape[1]
    r = 2 * half
    if r > x.shape[-1]:
        raise ValueError(f"rotary_dim={r} exceeds head dim {x.shape[-1]}")
    pos = _int_array(positions, "positions")
    if np.any((pos < 0) | (pos >= cos.shape[0])):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (rows of the cos/sin tables)")
    pos = np.broadcast_to(pos, x.shape[:-2])
    c = cos[pos][..., None, :]  # (..., S, 1, r/2)
    s = sin[pos][..., None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = x1 * c - x2 * s
        out[..., 1:r:2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., :half], x[..., half:r]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:r] = x2 * c + x1 * s
    return out


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    k=None,
    v=None,
    cache_seqlens,
    block_table=None,
    cache_batch_idx=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = False,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mask_align: str = "bottom_right",
    sink_size: int = 0,
    alibi_slopes=None,
    softcap: float = 0.0,
    sinks=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decoding attention over a KV cache, ``flash_attn_with_kvcache`` semantics.

    Shapes: ``q (B, Sq, Hq, Dq)`` (bshd). Caches ``(B_cache, S_cache, Hk, D)`` or, with
    ``block_table`` int ``(B, max_pages)``, paged ``(num_pages, page_size, Hk, D)``.
    ``cache_seqlens`` int ``(B,)`` (or a scalar for all). ``cache_batch_idx`` int ``(B,)``
    picks the cache row of each batch entry (non-paged caches only; default ``b``).
    ``k (B, Snew, Hk, Dq)``, ``v (B, Snew, Hk, Dv)``: new tokens, given together or not
    at all. ``rotary_cos``/``rotary_sin`` ``(max_pos, rotary_dim/2)``: need ``k``/``v``
    (as in flash_attn).

    Steps, per batch entry ``b`` with ``L = cache_seqlens[b]``:

    1. the new keys are rotated at positions ``L + t`` and, with the new values, written
       to cache positions ``L .. L + Snew - 1`` (of copies of the caches);
    2. ``q`` is rotated at positions ``L + t`` (``t = 0 .. Sq-1``) when rotary tables are
       given;
    3. ``q`` attends to the first ``Sk = L + Snew`` cache positions with the given masks
       (so bottom-right causal aligns the last query with the last key).

    Returns ``o (B, Sq, Hq, Dv)``, ``lse (B, Hq, Sq)`` and the updated copies of
    ``k_cache`` and ``v_cache`` (the inputs are not modified).
    """
    q = _f64(q, "q")
    k_cache = _f64(k_cache, "k_cache").copy()
    v_cache = _f64(v_cache, "v_cache").copy()
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape} must all be 4-D")
    B, Sq, Hq, _ = q.shape
    if (k is None) != (v is None):
        raise ValueError("k and v (new tokens) must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    rotary = rotary_cos is not None
    if rotary and k is None:
        raise ValueError("rotary_cos/rotary_sin need new k and v to append (as in flash_attn)")
    lens = np.broadcast_to(_int_array(cache_seqlens, "cache_seqlens"), (B,))
    if np.any(lens < 0):
        raise ValueError(f"cache_seqlens={lens.tolist()} must be >= 0")

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with a paged cache (block_table)")
        table = _int_array(block_table, "block_table")
        if table.ndim != 2 or table.shape[0] != B:
            raise ValueError(f"block_table must be ({B}, max_pages), got {table.shape}")
        page_size = k_cache.shape[1]
        capacity = table.shape[1] * page_size
        rows = None
    else:
        rows = np.arange(B) if cache_batch_idx is None else _int_array(cache_batch_idx, "cache_batch_idx")
        if rows.shape != (B,) or np.any((rows < 0) | (rows >= k_cache.shape[0])):
            raise ValueError(f"cache_batch_idx must be ({B},) in [0, {k_cache.shape[0]})")
        capacity = k_cache.shape[1]

    snew = 0
    if k is not None:
        k = _f64(k, "k")
        v = _f64(v, "v")
        if k.ndim != 4 or k.shape[0] != B or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"k {k.shape} and v {v.shape} must be (B={B}, Snew, Hk, D)")
        snew = k.shape[1]
    if np.any(lens + snew > capacity):
        raise ValueError(
            f"cache_seqlens + Snew = {(lens + snew).tolist()} exceeds the cache capacity {capacity}"
        )

    if paged:
        for b in range(B):
            used = table[b, : -(-(int(lens[b]) + snew) // page_size)]  # pages that are read
            if np.any((used < 0) | (used >= k_cache.shape[0])):
                raise ValueError(
                    f"block_table[{b}] uses pages {used.tolist()} outside [0, {k_cache.shape[0]})"
                )

    def slots(b: int, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row-or-page, offset) index arrays of cache positions ``t`` of batch ``b``."""
        if paged:
            return table[b, t // page_size], t % page_size
        return np.full(t.shape, rows[b]), t

    # 1. rotate and append the new tokens.
    if k is not None:
        if rotary:
            pos_k = lens[:, None] + np.arange(snew)[None, :]  # (B, Snew)
            k = apply_rotary(
                k,
                rotary_cos,
                rotary_sin,
                positions=pos_k,
                interleaved=rotary_interleaved,
            )
        for b in range(B):
            i0, i1 = slots(b, lens[b] + np.arange(snew))
            k_cache[i0, i1] = k[b]
            v_cache[i0, i1] = v[b]

    # 2. rotate q.
    if rotary:
        pos_q = lens[:, None] + np.arange(Sq)[None, :]  # (B, Sq)
        q = apply_rotary(q, rotary_cos, rotary_sin, positions=pos_q, interleaved=rotary_interleaved)

    # 3. attention over the first L + Snew keys of each batch entry.
    slopes = _f64(alibi_slopes, "alibi_slopes") if alibi_slopes is not None else None
    o = np.zeros((B, Sq, Hq, v_cache.shape[-1]))
    lse = np.zeros((B, Hq, Sq))
    for b in range(B):
        i0, i1 = slots(b, np.arange(lens[b] + snew))
        kb = np.swapaxes(k_cache[i0, i1], 0, 1)[None]  # (1, Hk, Sk, Dq)
        vb = np.swapaxes(v_cache[i0, i1], 0, 1)[None]  # (1, Hk, Sk, Dv)
        qb = np.swapaxes(q[b], 0, 1)[None]  # (1, Hq, Sq, Dq)
        sb = slopes[b] if slopes is not None and slopes.ndim == 2 else slopes
        ob, lseb = attention_fwd(
            qb,
            kb,
            vb,
            scale=scale,
            causal=causal,
            window=window,
            mask_align=mask_align,
            sink_size=sink_size,
            alibi_slopes=sb,
            softcap=softcap,
            sinks=sinks,
        )
        o[b] = np.swapaxes(ob[0], 0, 1)
        lse[b] = lseb[0]
    return o, lse, k_cache, v_cache


def page_table_from_indptr(kv_indptr, kv_indices, kv_last_page_len, page_size: int):
    """FlashInfer/SGLang page tables as a vLLM block table and lengths.

    Sequence ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; its last page
    holds ``kv_last_page_len[b]`` tokens (in ``[1, page_size]``; ``0`` with no pages), so it
    has ``(pages - 1) * page_size + kv_last_page_len[b]`` tokens. Returns
    ``block_table (B, max_pages)`` (unused entries 0) and ``seqlens (B,)``, int64.
    """
    indptr = _int_array(kv_indptr, "kv_indptr")
    indices = _int_array(kv_indices, "kv_indices")
    last = _int_array(kv_last_page_len, "kv_last_page_len")
    if indptr.ndim != 1 or indptr.size < 1 or last.shape != (indptr.size - 1,):
        raise ValueError(f"kv_indptr {indptr.shape} must be (B+1,), kv_last_page_len {last.shape} (B,)")
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] > indices.size:
        raise ValueError(f"kv_indptr={indptr.tolist()} must start at 0, never decrease and end "
                         f"<= {indices.size} (the length of kv_indices)")
    pages = np.diff(indptr)
    ok = np.where(pages > 0, (last >= 1) & (last <= page_size), last == 0)
    if not np.all(ok):
        raise ValueError(f"kv_last_page_len={last.tolist()} must be in [1, {page_size}] "
                         f"(0 for sequences without pages; pages: {pages.tolist()})")
    table = np.zeros((pages.size, max(1, int(pages.max(initial=0)))), dtype=np.int64)
    for b in range(pages.size):
        table[b, : pages[b]] = indices[indptr[b] : indptr[b + 1]]
    seqlens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    return table, seqlens


def batch_prefill_with_kvcache(q, k_cache, v_cache, cu_seqlens_q, *, k=None, v=None, cache_seqlens,
                               block_table=None, cache_batch_idx=None, alibi_slopes=None, **kwargs):
    """Batch prefill: packed varlen queries over a KV cache, one sequence at a time.

    ``q (total_q, Hq, Dq)``, ``cu_seqlens_q`` int ``(B+1,)``; sequence ``b`` is
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` with ``sq_b`` rows. Optional new tokens
    ``k (total_q, Hk, Dq)``, ``v (total_q, Hk, Dv)`` (one per query) are appended at
    ``cache_seqlens[b] + t``. Each sequence is :func:`attention_with_kvcache` with batch 1,
    so masks align bottom-right on its ``cache_seqlens[b] (+ sq_b)`` keys. ``alibi_slopes``
    ``(Hq,)`` or ``(B, Hq)``; other keyword arguments as :func:`attention_with_kvcache`.

    Returns ``o (total_q, Hq, Dv)``, ``lse (Hq, total_q)`` and updated copies of the caches.
    """
    q = _f64(q, "q")
    cu = _int_array(cu_seqlens_q, "cu_seqlens_q")
    if q.ndim != 3 or cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or cu[-1] != q.shape[0] or np.any(np.diff(cu) < 0):
        raise ValueError(f"q {q.shape} must be (total_q, Hq, D) and cu_seqlens_q={cu.tolist()} non-decreasing "
                         f"from 0 to total_q")
    B = cu.size - 1
    lens = np.broadcast_to(_int_array(cache_seqlens, "cache_seqlens"), (B,))
    slopes = None if alibi_slopes is None else _f64(alibi_slopes, "alibi_slopes")
    k_cache, v_cache = _f64(k_cache, "k_cache"), _f64(v_cache, "v_cache")
    o = np.zeros((q.shape[0], q.shape[1], v_cache.shape[-1]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(B):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        per_seq = dict(kwargs)
        if block_table is not None:
            per_seq["block_table"] = _int_array(block_table, "block_table")[b : b + 1]
        else:
            per_seq["cache_batch_idx"] = [b if cache_batch_idx is None else int(cache_batch_idx[b])]
        if slopes is not None:
            per_seq["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        ob, lseb, k_cache, v_cache = attention_with_kvcache(
            q[None, rows], k_cache, v_cache, k=None if k is None else _f64(k, "k")[None, rows],
            v=None if v is None else _f64(v, "v")[None, rows], cache_seqlens=lens[b : b + 1], **per_seq)
        o[rows] = ob[0]
        lse[:, rows] = lseb[0]
    return o, lse, k_cache, v_cache


def merge_states(outs: Sequence, lses: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Combine partial attention results over disjoint key sets.

    ``outs``: list of ``(..., D)`` arrays; ``lses``: list of matching ``(...)`` arrays
    (natural log). Returns ``lse = log(sum_i exp(lse_i))`` and
    ``o = sum_i exp(lse_i - lse) * o_i``. Where every ``lse_i`` is ``-inf``:
    ``o = 0``, ``lse = -inf``.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need equally long, non-empty lists: {len(outs)} outs, {len(lses)} lses")
    os_ = np.stack([_f64(o, "outs") for o in outs])  # (N, ..., D)
    ls = np.stack([_f64(x, "lses") for x in lses])  # (N, ...)
    if os_.shape[:-1] != ls.shape:
        raise ValueError(f"each lse must be its out without the last dim: {os_.shape} vs {ls.shape}")
    m = np.max(ls, axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(ls - m_safe)  # exp(-inf) = 0
    total = w.sum(axis=0)
    has_mass = total > 0
    total_safe = np.where(has_mass, total, 1.0)
    lse = np.where(has_mass, m_safe + np.log(total_safe), -np.inf)
    o = np.sum((w / total_safe)[..., None] * os_, axis=0)
    return o, lse


# ---------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------


def _error_diff(x, ref) -> np.ndarray | None:
    """``x - ref`` with equal entries (equal infinities included) set to 0; None if NaN."""
    x = _f64(x, "x")
    ref = _f64(ref, "ref")
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: x {x.shape}, ref {ref.shape}")
    if np.isnan(x).any() or np.isnan(ref).any():
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(x == ref, 0.0, np.abs(x - ref))


def relative_error(x, ref) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius, float64).

    Entries where ``x == ref`` (matching infinities, such as ``lse = -inf`` of fully
    masked rows, included) contribute 0; ``||ref||`` is taken over the finite entries of
    ``ref``. If that norm is 0 the absolute error ``||x - ref||`` is returned. NaN in
    either array gives ``inf``; so does an infinity that the other array does not match.
    Shapes must be equal.
    """
    diff = _error_diff(x, ref)
    if diff is None:
        return math.inf
    ref = _f64(ref, "ref")
    if not np.all(np.isfinite(diff)):
        return math.inf
    num = float(np.linalg.norm(diff.ravel()))
    den = float(np.linalg.norm(ref[np.isfinite(ref)].ravel()))
    return num / den if den > 0 else num


def max_abs_error(x, ref) -> float:
    """``max |x - ref|`` (float64); 0 for empty arrays, matching infinities count as equal.

    NaN in either array gives ``inf``. Shapes must be equal.
    """
    diff = _error_diff(x, ref)
    if diff is None:
        return math.inf
    return float(np.max(diff, initial=0.0))
