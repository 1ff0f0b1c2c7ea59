"""The service on two learner ranks, as a user runs `python -m launch.tinker --learners 2`: the base
model sharded over two FSDP ranks (gloo here), the datums of each call split between them. The
real SDK gets the same losses, log-probs, samples and saved adapters as from the one-rank
service; two clients at once still match each alone; a learner rank that dies stops the service
with a message naming it, instead of leaving calls to hang."""

import signal

import numpy as np
import psutil
import pytest
from tinker import types

from tests.serve.conftest import start_service
from tests.serve.test_training import ADAM, DATA, PROBE, logprobs, step

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory):
    s = start_service(tiny_model, tmp_path_factory.mktemp("tinker-ranks"), "--learners", "2", "--chunk-datums", "3",
                      "--poll-s", "2")
    yield s
    s.stop()


def session(served, model) -> dict:
    """What a short supervised session gives back: losses, log-probs (one datum alone: the second
    rank runs a stand-in; two: one each), the saved adapter's sample log-probs."""
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        losses = [step(tc, DATA)[0] for _ in range(5)]  # 5 datums in chunks of 3 and 2: split 2/1 and 1/1
        alone = logprobs(tc.forward(PROBE, "cross_entropy").result())
        pair = logprobs(tc.forward(PROBE + DATA[:1], "cross_entropy").result())
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                             types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    return {"losses": np.array(losses), "alone": alone[0], "pair": np.concatenate(pair),
            "tokens": [s.tokens for s in out.sequences], "sampled": np.concatenate([s.logprobs for s in out.sequences])}


def test_two_ranks_train_as_one(served, two_ranks, tiny_model):
    one, two = session(served, tiny_model), session(two_ranks, tiny_model)
    assert two["losses"][-1] < 0.8 * two["losses"][0], two["losses"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-4)
    np.testing.assert_allclose(two["alone"], one["alone"], atol=1e-4)
    np.testing.assert_allclose(two["pair"], one["pair"], atol=1e-4)
    assert two["tokens"] == one["tokens"]  # the adapter rank 0 hands the sampler is the trained one
    np.testing.assert_allclose(two["sampled"], one["sampled"], atol=1e-4)


def test_two_clients_on_two_ranks_match_each_alone(two_ranks, tiny_model):
    with two_ranks.client() as client:
        a = client.create_lora_training_client(base_model=tiny_model, rank=4).result()  # seeds drawn by rank 0
        b = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=12, train_mlp=False).result()
        start_a = logprobs(a.forward(PROBE + DATA[:1], "cross_entropy").result())
        for _ in range(3):
            futures = [a.forward_backward(DATA[:2], "cross_entropy"), b.forward_backward(DATA[2:], "cross_entropy"),
                       a.optim_step(ADAM), b.optim_step(ADAM)]
            [f.result() for f in futures]
        alone = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=12, train_mlp=False).result()
        for _ in range(3):
            step(alone, DATA[2:])
        probe_b, probe_alone = (logprobs(tc.forward(PROBE, "cross_entropy").result())[0] for tc in (b, alone))
        np.testing.assert_allclose(probe_b, probe_alone, atol=1e-5)
        # a's adapter (its seed drawn on rank 0 and sent) is the same on both ranks: the datum each
        # rank scored agrees with the same datum scored alone on rank 0
        end_a = logprobs(a.forward(PROBE + DATA[:1], "cross_entropy").result())
        for i, d in enumerate(PROBE + DATA[:1]):
            np.testing.assert_allclose(end_a[i], logprobs(a.forward([d], "cross_entropy").result())[0], atol=1e-5)
        assert np.abs(end_a[0] - start_a[0]).max() > 1e-3


def test_a_learner_rank_that_dies_stops_the_service(tiny_model, tmp_path):
    served = start_service(tiny_model, tmp_path / "tinker", "--learners", "2")
    try:
        ranks = [p for p in psutil.Process(served.proc.pid).children() if "serve.ranks" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        assert served.proc.wait(timeout=60) == 1
        log = served.log.read_text()
        assert "learner rank 1 exited with code -9" in log, log[-2000:]
    finally:
        served.stop()
