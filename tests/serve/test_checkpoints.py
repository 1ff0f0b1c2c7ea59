"""Durable state through the real SDK: save_state -> a restart of the service -> the checkpoints
listed, load_state (optimizer too) -> the identical next step; load_state on a live client; sampler
weights; bad paths."""

import numpy as np
import pytest
import tinker
from tinker import types

from tests.serve.conftest import KEY, start_service
from tests.serve.test_training import ADAM, DATA, PROBE, logprobs, step


@pytest.mark.slow  # two service starts: about 25 s on the 2-core machine
def test_state_survives_a_restart(tiny_model, tmp_path):
    logdir = tmp_path / "run"
    served = start_service(tiny_model, logdir)
    try:
        with served.client() as client:
            tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=2).result()
            for _ in range(2):
                step(tc, DATA)
            path = tc.save_state("two-steps").result().path
            weights_only = tc.save_weights_for_sampler("two-steps").result().path
            assert path.startswith("tinker://") and "/weights/" in path and "/sampler_weights/" in weights_only
            before = step(tc, DATA)[0]
            expect = logprobs(tc.forward(PROBE, "cross_entropy").result())[0]
    finally:
        served.stop()
    assert (logdir / "checkpoints.jsonl").read_text().count(path) == 1
    served = start_service(tiny_model, logdir)
    try:
        run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
        listed = tinker.RestClient(base_url=served.url, api_key=KEY).list_checkpoints(run_id).result()
        assert [c.tinker_path for c in listed.checkpoints] == [weights_only, path]  # newest first
        with served.client() as client:
            tc = client.create_training_client_from_state_with_optimizer(path).result()
            assert step(tc, DATA)[0] == pytest.approx(before, rel=1e-6)
            np.testing.assert_allclose(logprobs(tc.forward(PROBE, "cross_entropy").result())[0], expect, atol=1e-6)
            # without the optimizer's moments the same step lands elsewhere
            fresh = client.create_training_client_from_state(path).result()
            step(fresh, DATA)
            other = logprobs(fresh.forward(PROBE, "cross_entropy").result())[0]
            assert np.abs(other - expect).max() > 1e-4
            # load_state_with_optimizer onto a live client, in its request order
            fresh.load_state_with_optimizer(path).result()
            step(fresh, DATA)
            np.testing.assert_allclose(logprobs(fresh.forward(PROBE, "cross_entropy").result())[0], expect,
                                       atol=1e-6)
            with pytest.raises(tinker.RequestFailedError):  # sampler weights hold no optimizer
                client.create_lora_training_client(base_model=tiny_model, rank=4).result() \
                    .load_state_with_optimizer(weights_only).result()
            for bad in ("tinker://nobody/weights/none", "tinker://../weights/x", "file:///etc/passwd"):
                with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError, ValueError)):
                    client.create_training_client_from_state(bad).result()
            assert step(tc, DATA)[1].metrics  # still serving
    finally:
        served.stop()


def test_sampler_from_saved_path_equals_snapshot(served, tiny_model):
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=9).result()
        step(tc, DATA, types.AdamParams(learning_rate=1e-2))
        path = tc.save_weights_for_sampler("s1").result().path
        params = types.SamplingParams(max_tokens=6, seed=4, stop=[])
        prompt = types.ModelInput.from_ints([5, 6, 7])
        by_path = client.create_sampling_client(model_path=path).result().sample(prompt, 2, params).result()
        snapshot = tc.save_weights_and_get_sampling_client().result().sample(prompt, 2, params).result()
        assert [s.tokens for s in by_path.sequences] == [s.tokens for s in snapshot.sequences]
        np.testing.assert_allclose([s.logprobs for s in by_path.sequences], [s.logprobs for s in snapshot.sequences],
                                   atol=1e-6)
