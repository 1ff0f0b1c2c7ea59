"""The torch engine: batched multi-turn generation whose log-probs match a plain forward."""

import torch

from actors.engine import SamplingParams, TorchEngine, make_engine
from policy.load import LoraSpec


def full_logprobs(engine, prompt, generated):
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + generated])).logits[0]
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated)]


def perturbed_engine(tiny_model):
    engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=1)
    gen = torch.Generator().manual_seed(0)
    for name, p in engine.model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    return engine


def test_logprobs_match_a_full_forward_across_turns_and_batch_changes(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(4, chat.stop_ids, temperature=1.0)
    a = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    b = chat.prompt_ids([{"role": "user", "content": "a longer opening message"}])
    first = engine.generate([a, b], params, sessions=["a", "b"])
    a2 = a + first[0].tokens + chat.observation_ids([{"role": "user", "content": "moved"}])
    c = chat.prompt_ids([{"role": "user", "content": "late joiner"}])
    # b finished, c joins, order changes: the cache is reused, not rebuilt
    second = engine.generate([c, a2], params, sessions=["c", "a"])
    for prompt, out in [(a, first[0]), (b, first[1]), (c, second[0]), (a2, second[1])]:
        torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_stops_on_the_stop_token(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    prompt = chat.prompt_ids([{"role": "user", "content": "hello"}])
    out1 = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))
    out2 = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))
    assert out1[0].tokens == out2[0].tokens
    stop = out1[0].tokens[0]
    out3 = engine.generate([prompt], SamplingParams(6, (stop,), temperature=0.0))
    assert out3[0].tokens == [stop] and out3[0].stopped


def test_unknown_engine_is_a_clear_error(tiny_model):
    import pytest

    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt", tiny_model, LoraSpec())


def _fed_widths(engine):
    """Record how many tokens each forward pass feeds (instrumentation, not a replacement)."""
    widths, forward = [], engine.model.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    engine.model.forward = spy
    return widths


def test_compacting_the_cache_keeps_logprobs_exact(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(3, chat.stop_ids, temperature=1.0)
    long = chat.prompt_ids([{"role": "user", "content": "x" * 150}])
    short = chat.prompt_ids([{"role": "user", "content": "hi"}])
    first = engine.generate([long, short], params, sessions=["long", "short"])
    width, cache = engine._mask.shape[1], engine._cache
    # "long" ends and a new long episode joins: "short" keeps a real row of ~11 slots in a
    # ~160-slot axis, which is compacted before the newcomer's tokens are appended
    late = chat.prompt_ids([{"role": "user", "content": "y" * 150}])
    short2 = short + first[1].tokens + chat.observation_ids([{"role": "user", "content": "ok"}])
    second = engine.generate([short2, late], params, sessions=["short", "late"])
    assert engine._cache is cache  # the same cache object: nothing was re-prefilled
    assert engine._mask.shape[1] < width + len(late) - 100  # the holes are gone
    short3 = short2 + second[0].tokens + chat.observation_ids([{"role": "user", "content": "go"}])
    third = engine.generate([short3, late + second[1].tokens], params, sessions=["short", "late"])
    for prompt, out in [(short2, second[0]), (late, second[1]), (short3, third[0]),
                        (late + second[1].tokens, third[1])]:
        torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)


def _new_adapter(engine, scale=0.2):
    from peft import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in get_peft_model_state_dict(engine.model).items()}


def test_a_new_adapter_keeps_the_cache_or_recomputes_it(tiny_model, chat):
    params = SamplingParams(3, chat.stop_ids, temperature=1.0)
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    obs = chat.observation_ids([{"role": "user", "content": "moved"}])
    for recompute in (False, True):
        engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=1, recompute_kv=recompute)
        first = engine.generate([prompt], params, sessions=["a"])
        engine.load_adapter(1, _new_adapter(engine))
        widths = _fed_widths(engine)
        turn2 = prompt + first[0].tokens + obs
        second = engine.generate([turn2], params, sessions=["a"])[0]
        if recompute:  # everything re-prefilled under the new weights: exactly π_new
            assert widths[0] == len(turn2)
            torch.testing.assert_close(second.logprobs, full_logprobs(engine, turn2, second.tokens),
                                       atol=1e-4, rtol=0)
        else:  # in-flight: only the observation is fed; the prefix keeps its old keys and values
            assert widths[0] == len(obs) + 1  # (+ the last sampled token, not fed until now)
            exact = full_logprobs(engine, turn2, second.tokens)
            assert max(abs(a - b) for a, b in zip(second.logprobs, exact)) > 1e-4


def test_a_merged_adapter_computes_what_the_lora_branch_computes(tiny_model, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    params = SamplingParams(4, chat.stop_ids, temperature=0.0)
    merged = TorchEngine(tiny_model, LoraSpec(rank=4), merge_lora=True)
    branch = TorchEngine(tiny_model, LoraSpec(rank=4), merge_lora=False)
    first = _new_adapter(merged)
    for version, scale in [(1, 0.2), (2, 0.3)]:  # the second update starts again from W₀
        tensors = {k: v * scale / 0.2 for k, v in first.items()}
        for engine in (merged, branch):
            engine.load_adapter(version, tensors)
        a, b = merged.generate([prompt], params)[0], branch.generate([prompt], params)[0]
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert abs(a.logprobs[0] - full_logprobs(TorchEngine(tiny_model, LoraSpec(rank=4)), prompt, a.tokens)[0]) > 1e-4
