"""The torch engine's KV cache: appends into kept room, and holds what transformers' cache holds."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import actors.kv_cache as kv_cache
from actors.engine import SamplingParams
from actors.kv_cache import GrowingLayer, growing_cache
from actors.torch_engine import TorchEngine
from policy.load import LoraSpec


def _kv(gen, rows, slots):
    return torch.randn(rows, 2, slots, 8, generator=gen), torch.randn(rows, 2, slots, 8, generator=gen)


def _same(a, b):
    assert a.keys.shape == b.keys.shape and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_a_growing_layer_holds_what_a_dynamic_layer_holds_through_the_engines_edits():
    """Appends of a prefill and of single steps, with the edits the torch engine makes between
    turns (rows selected, rows added, holes compacted: whole tensors assigned): after every one,
    the layer's keys and values and what `update` returns equal a DynamicLayer's."""
    gen = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    assert grow.get_seq_length() == 0

    def append(rows, slots):
        k, v = _kv(gen, rows, slots)
        for got, want in zip(grow.update(k, v), plain.update(k, v)):
            assert torch.equal(got, want)
        _same(grow, plain)
        filled = grow.get_seq_length()  # the room kept: at most a quarter more, or MIN_ROOM slots
        assert grow._buffers["keys"].shape[-2] <= filled + max(kv_cache.MIN_ROOM, filled // 4)

    append(4, 23)                      # a prefill
    for _ in range(70):                # decoding steps, past the first buffer's room
        append(4, 1)
    idx = torch.tensor([2, 0, 3])      # a row finished, the others in a new order
    grow.batch_select_indices(idx)
    plain.batch_select_indices(idx)
    _same(grow, plain)
    append(3, 5)
    for layer in (grow, plain):        # two rows join (the engine's _add_rows)
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((2, *layer.keys.shape[1:]))])
        layer.values = torch.cat([layer.values, layer.values.new_zeros((2, *layer.values.shape[1:]))])
    _same(grow, plain)
    append(5, 1)
    order = torch.arange(30).flip(0)   # slots moved (the engine's _compact)
    for layer in (grow, plain):
        layer.keys, layer.values = layer.keys[:, :, order].contiguous(), layer.values[:, :, order].contiguous()
    _same(grow, plain)
    for _ in range(3):
        append(5, 2)


def test_a_step_writes_into_the_room_and_leaves_earlier_views_as_they_were():
    gen = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    k, v = _kv(gen, 2, 10)
    keys, _ = layer.update(k, v)
    first = keys.clone()
    buffer = layer._buffers["keys"]
    assert buffer.shape[-2] == 10 + kv_cache.MIN_ROOM
    for _ in range(kv_cache.MIN_ROOM):
        keys2, _ = layer.update(*_kv(gen, 2, 1))
    assert layer._buffers["keys"] is buffer  # no copy while the room lasts
    assert torch.equal(keys, first) and torch.equal(keys2[:, :, :10], first)
    layer.update(*_kv(gen, 2, 1))              # full: one move into a buffer with room again
    assert layer._buffers["keys"] is not buffer and layer._buffers["keys"].shape[-2] > kv_cache.MIN_ROOM + 1
    assert torch.equal(layer.keys[:, :, :10], first) and layer.get_seq_length() == kv_cache.MIN_ROOM + 11


@pytest.mark.parametrize("rows, slots", [(2, 100), (1, 1), (2, 1)])
def test_keys_of_other_rows_are_refused_with_a_message(rows, slots):
    """Whether they fit the room or not: a single row would otherwise be broadcast into every row."""
    gen = torch.Generator().manual_seed(2)
    layer = GrowingLayer()
    layer.update(*_kv(gen, 3, 4))
    before = layer.keys.clone()
    with pytest.raises(ValueError, match=r"keys of shape \(%d, 2, %d, 8\) appended to \(3, 2, 4, 8\)" % (rows, slots)):
        layer.update(*_kv(gen, rows, slots))
    assert torch.equal(layer.keys, before)


def _episodes(engine, chat):
    """Two rounds of turns with a row finishing, a row joining and the cache compacted; the
    seeded tokens and log-probs of every turn."""
    params = SamplingParams(4, chat.stop_ids, temperature=1.0)
    long = chat.prompt_ids([{"role": "user", "content": "x" * 150}])
    short = chat.prompt_ids([{"role": "user", "content": "hi"}])
    first = engine.generate([long, short], params, sessions=["long", "short"], seeds=[1, 2])
    short2 = short + first[1].tokens + chat.observation_ids([{"role": "user", "content": "ok"}])
    late = chat.prompt_ids([{"role": "user", "content": "y" * 150}])
    second = engine.generate([short2, late], params, sessions=["short", "late"], seeds=[3, 4])
    return [(o.tokens, o.logprobs) for o in first + second]


def test_the_engine_decodes_on_growing_layers_the_tokens_and_logprobs_of_transformers_cache(tiny_model, chat):
    engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=5)
    grown = _episodes(engine, chat)
    assert engine._cache.layers and all(isinstance(layer, GrowingLayer) for layer in engine._cache.layers)
    engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=5, growing_kv=False)
    plain = _episodes(engine, chat)
    assert engine._cache.layers and not any(isinstance(layer, GrowingLayer) for layer in engine._cache.layers)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(grown, plain):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-6, rtol=0)


def test_an_empty_growing_cache_adds_growing_layers():
    cache = growing_cache()
    cache.update(*_kv(torch.Generator().manual_seed(3), 1, 2), layer_idx=1)
    assert len(cache.layers) == 2 and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert cache.get_seq_length(1) == 2
