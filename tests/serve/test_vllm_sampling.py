"""Sampling on vLLM, as a user runs `python -m launch.tinker --actor.engine vllm` (vLLM's CPU build
here): a training client's adapter, LoRA on the output head included (the API's default), reaches
the engine through the weight channel's adapter files; its sampled log-probs equal the training
forward's within the engines' parity tolerance; compute_logprobs, the base model, seeds and a
request longer than the engine's context are answered as on the torch engine."""

import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from tests.serve.conftest import start_service
from tests.serve.test_service import datum
from tests.serve.test_training import DATA, logprobs, step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a vLLM engine starts (20-70 s on 2 cores)
pytest.importorskip("vllm", reason="vLLM sampling needs vLLM: pip install -e '.[test]'")

PROMPT = [5, 6, 7, 8]
TOLERANCE = 5e-4  # max |Δ log p|, engine against learner, in float32 (tests/actors/test_vllm_engine.py)


@pytest.fixture(scope="module")
def on_vllm(tiny_model, tmp_path_factory):
    s = start_service(tiny_model, tmp_path_factory.mktemp("tinker-vllm"), "--actor.engine", "vllm",
                      "--actor.max-tokens", "256", "--poll-s", "2")
    yield s
    s.stop()


def sample(sc, n=1, **params):
    return sc.sample(types.ModelInput.from_ints(PROMPT), n, types.SamplingParams(**params)).result().sequences


def test_vllm_samples_with_the_training_clients_adapter(on_vllm, tiny_model):
    with on_vllm.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=3).result()
        for _ in range(3):
            step(tc, DATA, types.AdamParams(learning_rate=5e-2))  # far enough from the base to tell apart
        sc = tc.save_weights_and_get_sampling_client().result()
        seqs = sample(sc, n=3, max_tokens=10, temperature=1.0, seed=11, stop=[])
        assert all(len(s.tokens) == 10 for s in seqs)
        for s in seqs:
            full = PROMPT + s.tokens
            lp = logprobs(tc.forward([datum(full[:-1], full[1:])], "cross_entropy").result())[0]
            np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=TOLERANCE)
        again = sample(sc, n=3, max_tokens=10, temperature=1.0, seed=11, stop=[])
        assert [s.tokens for s in again] == [s.tokens for s in seqs]  # a seed fixes the samples
        prompt_lp = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT + seqs[0].tokens)).result()
        assert prompt_lp[0] is None
        np.testing.assert_allclose(prompt_lp[len(PROMPT):], seqs[0].logprobs, atol=TOLERANCE)

        base = client.create_sampling_client(base_model=tiny_model).result()  # the same engine, no adapter
        fresh = client.create_lora_training_client(base_model=tiny_model, rank=8).result()
        plain = sample(base, n=2, max_tokens=6, seed=5, stop=[])
        for s in plain:
            full = PROMPT + s.tokens
            lp = logprobs(fresh.forward([datum(full[:-1], full[1:])], "cross_entropy").result())[0]
            np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=TOLERANCE)
        trained = sample(sc, n=3, max_tokens=10, temperature=1.0, seed=11, stop=[])
        assert [s.tokens for s in trained] == [s.tokens for s in seqs]  # its adapter back after the base's

        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="context of 256"):
            sample(sc, max_tokens=300)
        assert len(sample(sc, max_tokens=2)[0].tokens) <= 2  # still serving


def test_stopping_the_service_stops_its_engines(on_vllm):
    """SIGTERM, as a process manager stops the service: it closes its engines (vLLM's engine core
    and worker processes) and exits 0, leaving nothing running."""
    children = psutil.Process(on_vllm.proc.pid).children(recursive=True)
    assert children  # the engine's processes
    on_vllm.stop()
    assert on_vllm.proc.returncode == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.name() for p in alive]
