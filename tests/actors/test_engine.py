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
