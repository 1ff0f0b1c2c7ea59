"""Grouped-query attention on the CPU without copying the keys and values for every head.

A model with fewer key-value heads than query heads (grouped-query attention: the built-in
models, Llama, Qwen2) runs transformers' "sdpa" attention. Given a mask, which the torch engine
always passes (its cache has holes, actors/torch_engine.py) and the learner's padded batches
too, transformers repeats each key-value head for its query heads before torch's kernel
(`repeat_kv`): on the CPU a decoding step then copies the whole KV cache of every layer, and that
copy was an eighth of an actor's time on the image maze (docs/engines.md). torch's kernel takes the
grouped heads as they are (`enable_gqa=True`) with a mask on the CPU, and gives the same numbers.

`GQA_SDPA` is transformers' "sdpa" attention with that one change: on CPU tensors with a mask and
grouped heads, the kernel gets `enable_gqa=True` and the heads unrepeated; everything else
(no mask, one key-value head a query head, another device, position biases, paged caches) goes to
transformers' own "sdpa" function unchanged. Its masks are transformers' "sdpa" masks (an
attention name without a registered mask function would get no mask at all).

Usage::

    use_gqa_sdpa(model)    # after loading: a model on "sdpa" switches to GQA_SDPA
"""

from __future__ import annotations

import torch
from transformers.integrations import sdpa_attention as hf

GQA_SDPA = "tandem_gqa_sdpa"
"""The attention implementation's name in transformers' registries."""

_PAGED = getattr(hf, "PagedAttentionCache", None)
"""transformers' paged cache (absent in some versions): updated inside "sdpa", so never bypassed."""


def _gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (attention_mask is None or not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or (_PAGED is not None and isinstance(kwargs.get("cache"), _PAGED))):
        return hf.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         is_causal=is_causal, **kwargs)
    # With a mask, transformers' "sdpa" never sets is_causal (the mask holds the causal pattern).
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add GQA_SDPA to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def use_gqa_sdpa(model) -> None:
    """Switch `model` (a transformers model, or a PEFT model around one) from "sdpa" to GQA_SDPA,
    with its sub-models (a vision-language model's text model and vision tower) that use "sdpa";
    a model on another attention implementation is left as it is."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != "sdpa":
        return
    register()
    base.set_attn_implementation(GQA_SDPA)
