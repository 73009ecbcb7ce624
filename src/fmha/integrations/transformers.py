"""fmha as a Hugging Face transformers attention backend.

    import fmha.integrations.transformers as fmha_hf
    fmha_hf.register()                                   # once, registers "fmha"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fmha")
    # or: model.set_attn_implementation("fmha")

`register(name)` adds `attention_forward` to `transformers.AttentionInterface` and, so
that models build the masks it expects, transformers' SDPA mask function to
`AttentionMaskInterface` under the same name (a name without a mask function gets no
mask at all from transformers, which would drop padding).

What the models pass, and what fmha makes of it (the contract of transformers'
`sdpa_attention_forward`):
- query (B, Hq, Sq, D), key/value (B, Hk, Sk, D): GQA/MQA run natively (no repeat_kv).
- attention_mask None: causal iff the module is causal and Sq > 1, aligned top-left
  (SDPA's is_causal; the same as slicing the keys to Sq for an empty static cache);
  a 4-D boolean mask (B or 1, 1 or H, Sq, Sk), True = attend: an additive fp32 bias of
  0 / -inf, broadcast through zero strides; a 4-D float mask: added as it is (bias).
  Rows that see no key give 0 (SDPA gives NaN or garbage there).
  Anything else (2-D masks, flex BlockMask) raises a ValueError/NotImplementedError.
- scaling -> scale, dropout -> dropout_p (Philox in-kernel), softcap -> softcap,
  s_aux (gpt-oss sink logits, (Hq,)) -> sinks, position_bias (T5) -> added to the bias,
  sliding_window: already in a materialized mask; without a mask (Sq == Sk or decode)
  applied as window (sliding_window - 1, 0) on a causal module.
Returns (attn_output (B, Sq, Hq, D) contiguous, None) as SDPA's backend does; attention
weights are never materialized (output_attentions=True warns, as with SDPA).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import api

Tensor = torch.Tensor

def _mask_to_bias(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """A 4-D transformers mask as an additive bias broadcastable to (B, Hq, Sq, Sk)."""
    batch, nhead_q, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    if mask.dim() != 4:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; the fmha backend accepts a 4-D mask "
            f"(B or 1, 1 or Hq, Sq, Sk) as transformers builds it (register() sets that up), or None")
    if mask.shape[-2:] != (seqlen_q, seqlen_k):
        if mask.shape[-1] > seqlen_k and mask.shape[-2] == seqlen_q:
            mask = mask[..., :seqlen_k]  # as transformers' eager path: keys beyond the cache are unused
        else:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; accepted: (*, *, {seqlen_q}, "
                             f"{seqlen_k}) for query length {seqlen_q} and key length {seqlen_k}")
    if mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, nhead_q):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; its first two dimensions must be "
                         f"1 or batch={batch}, and 1 or nhead={nhead_q}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask.dtype={mask.dtype}; accepted: torch.bool (True = attend) or a "
                        f"floating-point additive mask")
    return mask if mask.dtype in (torch.float32, query.dtype) else mask.float()


def attention_forward(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
    position_bias: Tensor | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function (signature of `sdpa_attention_forward`), on fmha's kernels.

    query: (B, Hq, Sq, D); key, value: (B, Hk, Sk, D) with Hq % Hk == 0. Returns
    (attn_output (B, Sq, Hq, Dv), None).
    """
    if attention_mask is not None and not isinstance(attention_mask, Tensor):
        raise NotImplementedError(
            f"attention_mask of type {type(attention_mask).__name__} (e.g. flex_attention's BlockMask) cannot be "
            f"mapped onto fmha; accepted: None or a 4-D boolean/float tensor")
    if kwargs.get("output_attentions", False):
        warnings.warn("the fmha attention backend does not return attention weights (output_attentions=True); "
                      "use attn_implementation='eager' for them", stacklevel=2)
    if kwargs.get("head_mask") is not None:
        raise NotImplementedError("head_mask is not supported by the fmha attention backend")
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and seqlen_q > 1 and attention_mask is None

    bias = None if attention_mask is None else _mask_to_bias(attention_mask, query, key)
    if position_bias is not None:
        position_bias = position_bias[..., :seqlen_k] if position_bias.shape[-1] > seqlen_k else position_bias
        bias = position_bias if bias is None else bias + position_bias

    window = (-1, -1)
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None and attention_mask is None:
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive int")
        if causal:
            window = (sliding_window - 1, -1)
        elif seqlen_q == 1:  # decode without a mask: the newest query sees the last `sliding_window` keys
            window = (sliding_window - 1, 0)
        else:
            raise NotImplementedError(
                f"sliding_window={sliding_window} on a non-causal module without an attention_mask: the fmha "
                f"backend maps sliding windows of causal modules only; pass the mask transformers builds")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.float() if sinks.dtype != torch.float32 else sinks
    # Decode without a mask aligns at the bottom right (the last query is the newest token);
    # causal prefill uses SDPA's top-left is_causal (the same when Sq == Sk).
    align = "bottom_right" if window[1] == 0 and not causal else "top_left"
    out = api.attention(
        query, key, value, scale=scaling, causal=causal, window=window, mask_align=align, bias=bias,
        softcap=0.0 if softcap is None else float(softcap), sinks=sinks, dropout_p=float(dropout),
    )
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "fmha") -> None:
    """Register fmha under `name` in transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


__all__ = ["attention_forward", "register"]
