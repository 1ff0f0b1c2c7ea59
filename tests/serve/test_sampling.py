"""Sampling through the real SDK on Tandem's torch engine: sampled log-probs equal to the training
forward's, compute_logprobs, seeds, num_samples, max_tokens, stop tokens and strings, top-k/top-p."""

import numpy as np
import pytest
import tinker
from tinker import types

from tests.serve.test_service import datum
from tests.serve.test_training import DATA, logprobs, step

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def trained(served, tiny_model):
    """A training client after one step, and a sampling client of its current weights."""
    client = served.client()
    tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=21).result()
    step(tc, DATA, types.AdamParams(learning_rate=1e-2))
    yield tc, tc.save_weights_and_get_sampling_client().result()
    client.close("success").result()


def sample(sc, n=1, **params):
    return sc.sample(types.ModelInput.from_ints(PROMPT), n, types.SamplingParams(**params)).result().sequences


def test_sampled_logprobs_equal_the_training_forward(trained):
    tc, sc = trained
    seqs = sample(sc, n=3, max_tokens=8, seed=1, stop=[])
    assert len(seqs) == 3 and all(len(s.tokens) == 8 and s.stop_reason == "length" for s in seqs)
    for s in seqs:
        full = PROMPT + s.tokens
        lp = logprobs(tc.forward([datum(full[:-1], full[1:])], "cross_entropy").result())[0]
        np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=1e-4)
    prompt_lp = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT + seqs[0].tokens)).result()
    assert prompt_lp[0] is None
    np.testing.assert_allclose(prompt_lp[len(PROMPT):], seqs[0].logprobs, atol=1e-4)


def test_seeds_stops_and_truncation(trained, tiny_model):
    _, sc = trained
    a, b = sample(sc, n=2, max_tokens=10, seed=7, stop=[])
    again = sample(sc, n=2, max_tokens=10, seed=7, stop=[])
    assert [a.tokens, b.tokens] == [s.tokens for s in again]  # a seed fixes the samples
    assert a.tokens != b.tokens  # each sample of a request has its own stream
    stop = a.tokens[3]
    cut = sample(sc, max_tokens=10, seed=7, stop=[stop])[0]
    first = a.tokens.index(stop)
    assert cut.tokens == a.tokens[:first + 1] and cut.stop_reason == "stop"
    tokenizer = sc.get_tokenizer()
    text = tokenizer.decode(a.tokens)
    word = text[len(tokenizer.decode(a.tokens[:4])):][:2]
    if word.strip():
        by_string = sample(sc, max_tokens=10, seed=7, stop=[word])[0]
        assert by_string.stop_reason == "stop" and word in tokenizer.decode(by_string.tokens)
        assert by_string.tokens == a.tokens[:len(by_string.tokens)] and len(by_string.tokens) < 10
    greedy = sample(sc, max_tokens=6, temperature=0.0, stop=[])[0]
    for params in ({"top_k": 1}, {"top_p": 1e-6}):  # keep only the most probable token: greedy, log-prob 0
        only = sample(sc, max_tokens=6, seed=3, stop=[], **params)[0]
        assert only.tokens == greedy.tokens
        np.testing.assert_allclose(only.logprobs, 0.0, atol=1e-6)
    base = tinker.ServiceClient(base_url=sc.holder._base_url, api_key=sc.holder._api_key)
    with base:
        plain = base.create_sampling_client(base_model=tiny_model).result()
        fresh = base.create_lora_training_client(base_model=tiny_model, rank=4).result()
        lp = plain.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
        expect = logprobs(fresh.forward([datum(PROMPT[:-1], PROMPT[1:])], "cross_entropy").result())[0]
        np.testing.assert_allclose(lp[1:], expect, atol=1e-5)  # a fresh adapter is the base model


def test_bad_sampling_requests(trained):
    _, sc = trained
    for params, n in (({"max_tokens": 0}, 1), ({"max_tokens": 4}, 0), ({"max_tokens": 4, "top_p": 0.0}, 1),
                      ({"max_tokens": 4, "stop": [10 ** 6]}, 1)):
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError, ValueError)):
            sc.sample(types.ModelInput.from_ints(PROMPT), n, types.SamplingParams(**params)).result()
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)):
        sc.sample(types.ModelInput.from_ints([10 ** 6]), 1, types.SamplingParams(max_tokens=2)).result()
    assert len(sample(sc, max_tokens=2)[0].tokens) <= 2  # still serving
