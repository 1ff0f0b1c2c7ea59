"""The torch engine's KV cache: transformers' DynamicCache whose layers append into room kept
at the end of their keys and values instead of concatenating.

transformers' DynamicLayer appends a forward's keys and values with `torch.cat`, which copies the
whole cache of the layer: every decoding step of a batch copies every layer's keys and values
once, so a turn of n tokens over a context of L costs n copies of L: little in the mazes' few
hundred tokens, a third of decoding's time after 8,000 (docs/engines.md, `bench.kv_cache`: 1.54-1.67x
as fast without it). `GrowingLayer` keeps each tensor in a buffer
with room on the time axis and writes new slots into it; `keys` and `values` are views of the
filled part. A full buffer moves into one with a quarter more room than it fills (at least
MIN_ROOM slots): appending then costs the new slots, plus one copy of the cache each time it
grows by a quarter, and a layer holds at most a quarter more memory than DynamicLayer's (which
itself holds the old and the new tensor at once while it concatenates).

The torch engine's own edits of the cache (selecting rows, adding rows, compacting holes) assign
`layer.keys` and `layer.values` whole tensors, as they do for a DynamicLayer: an assigned tensor
becomes the buffer, with no room, and the next append makes room. So the layer behaves exactly
as a DynamicLayer, value for value; only the copies differ.

Usage::

    cache = growing_cache()    # in place of DynamicCache(); pass it as the model's cache
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 64
"""The fewest empty slots a new buffer keeps after the ones it fills."""


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers with room to grow on the time axis."""

    def __init__(self, **kwargs) -> None:
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._filled: dict[str, int] = {"keys": 0, "values": 0}
        super().__init__(**kwargs)

    def _get(self, name: str):
        buf = self._buffers[name]
        if buf is None or buf.dim() != 4 or buf.shape[-2] == self._filled[name]:
            return buf
        return buf[:, :, : self._filled[name]]

    def _set(self, name: str, tensor) -> None:
        self._buffers[name] = tensor
        self._filled[name] = tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0

    keys = property(lambda self: self._get("keys"), lambda self, t: self._set("keys", t))
    values = property(lambda self: self._get("values"), lambda self, t: self._set("values", t))

    def _append(self, name: str, new: torch.Tensor) -> None:
        buf, n = self._buffers[name], self._filled[name]
        if n and (buf.shape[:2] != new.shape[:2] or buf.shape[-1] != new.shape[-1]):
            # torch.cat would refuse them; writing into the room would broadcast a single row
            raise ValueError(f"KV cache: {name} of shape {tuple(new.shape)} appended to {tuple(buf[:, :, :n].shape)}")
        total = n + new.shape[-2]
        if not n or total > buf.shape[-2]:
            room = new.new_empty((*new.shape[:2], total + max(MIN_ROOM, total // 4), new.shape[-1]))
            if n:
                room[:, :, :n] = buf[:, :, :n]
            buf = self._buffers[name] = room
        buf[:, :, n:total] = new
        self._filled[name] = total

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values


def growing_cache() -> DynamicCache:
    """An empty DynamicCache that adds a GrowingLayer for each layer the model updates."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
