"""Training through the real SDK: a supervised loop whose loss falls, chunked forward_backward
(the SDK sends 2-datum chunks in parallel here), the policy-gradient losses against values worked
out by hand, Adam parameters per call, and two training clients at once."""

import numpy as np
import pytest
from tinker import types

from tests.serve.test_service import datum

DATA = [datum([5, 6, 7, 8, 9], [6, 7, 8, 9, 10], [0, 1, 1, 1, 1]),
        datum([20, 21, 22], [21, 22, 23], [0, 1, 1]),
        datum([30, 31, 32, 33], [31, 32, 33, 34], [0, 0, 1, 1]),
        datum([40, 41], [41, 42], [1, 1]),
        datum([50, 51, 52], [51, 52, 53], [0, 1, 1])]
PROBE = [datum([7, 8, 9, 10, 11, 12], [8, 9, 10, 11, 12, 13])]
ADAM = types.AdamParams(learning_rate=1e-3)


def logprobs(out) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def step(tc, data, adam=ADAM):
    fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
    return fb.result().metrics["loss:sum"], opt.result()


def test_supervised_loss_falls_and_chunks_add_up(served, tiny_model):
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=0).result()
        first = tc.forward(DATA, "cross_entropy").result()  # 5 datums: 3 chunks of at most 2
        assert len(first.loss_fn_outputs) == len(DATA)
        lps = logprobs(first)
        assert [len(lp) for lp in lps] == [d.model_input.length for d in DATA]
        # loss:sum is Σ −w·logp over every datum of every chunk
        by_hand = sum(-(lp * d.loss_fn_inputs["weights"].to_numpy()).sum() for lp, d in zip(lps, DATA))
        assert first.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-5)
        one = tc.forward(DATA[3:4], "cross_entropy").result()  # a datum alone scores as in the batch
        np.testing.assert_allclose(logprobs(one)[0], lps[3], atol=1e-5)
        losses = [step(tc, DATA)[0] for _ in range(8)]
        assert losses[0] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)
        assert losses[-1] < 0.8 * losses[0], losses


def test_policy_gradient_losses_by_hand(served, tiny_model):
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=3).result()
        tokens, targets = [5, 6, 7, 8], [6, 7, 8, 9]
        lp = logprobs(tc.forward([datum(tokens, targets)], "cross_entropy").result())[0]
        adv = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
        shift = np.array([0.5, 0.5, -0.5, -0.5], dtype=np.float32)  # log π − log q per token

        def rl(loss, config=None):
            d = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                            loss_fn_inputs={"target_tokens": np.array(targets), "logprobs": lp - shift,
                                            "advantages": adv})
            return tc.forward([d], loss, config).result().metrics["loss:sum"]

        ratio = np.exp(shift)  # [1.65, 1.65, 0.61, 0.61]
        assert rl("importance_sampling") == pytest.approx(-(ratio * adv).sum(), rel=1e-4)
        # ppo, clip [0.8, 1.2]: token 0 (A>0, ρ>1.2) clipped to 1.2; token 1 (A<0) keeps ρ·A;
        # token 2 (A>0, ρ<0.8) keeps ρ·A; token 3 (A>0, ρ<0.8) keeps ρ·A
        expect = -(1.2 * 1.0 + ratio[1] * -2.0 + ratio[2] * 0.5 + ratio[3] * 3.0)
        assert rl("ppo") == pytest.approx(expect, rel=1e-4)
        # clip [0.7, 1.1] from loss_fn_config: token 0 clipped to 1.1
        expect = -(1.1 * 1.0 + ratio[1] * -2.0 + ratio[2] * 0.5 + ratio[3] * 3.0)
        got = rl("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1})
        assert got == pytest.approx(expect, rel=1e-4)


def test_two_clients_at_once_match_each_alone(served, tiny_model):
    with served.client() as client:
        a = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=11).result()
        b = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=12, train_mlp=False).result()
        for _ in range(3):  # interleaved: every call of both in flight together
            futures = [a.forward_backward(DATA[:2], "cross_entropy"), b.forward_backward(DATA[2:], "cross_entropy"),
                       a.optim_step(ADAM), b.optim_step(types.AdamParams(learning_rate=3e-3, beta2=0.99))]
            [f.result() for f in futures]
        alone_a = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=11).result()
        alone_b = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=12,
                                                     train_mlp=False).result()
        for _ in range(3):
            step(alone_a, DATA[:2])
        for _ in range(3):
            step(alone_b, DATA[2:], types.AdamParams(learning_rate=3e-3, beta2=0.99))
        probe = {name: logprobs(tc.forward(PROBE, "cross_entropy").result())[0]
                 for name, tc in (("a", a), ("b", b), ("alone_a", alone_a), ("alone_b", alone_b))}
        np.testing.assert_allclose(probe["a"], probe["alone_a"], atol=1e-5)
        np.testing.assert_allclose(probe["b"], probe["alone_b"], atol=1e-5)
        assert np.abs(probe["a"] - probe["b"]).max() > 1e-3


def test_adam_parameters_of_each_call(served, tiny_model):
    with served.client() as client:
        tcs = [client.create_lora_training_client(base_model=tiny_model, rank=4, seed=5).result() for _ in range(3)]
        step(tcs[0], DATA, types.AdamParams(learning_rate=0.0))
        step(tcs[1], DATA, types.AdamParams(learning_rate=1e-3))
        step(tcs[2], DATA, types.AdamParams(learning_rate=4e-3))
        probe = [logprobs(tc.forward(PROBE, "cross_entropy").result())[0] for tc in tcs]
        fresh = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=5).result()
        np.testing.assert_allclose(probe[0], logprobs(fresh.forward(PROBE, "cross_entropy").result())[0], atol=1e-6)
        # Adam's first step moves each adapted weight by ≈ lr: a larger rate moves the log-probs further
        moved = [np.abs(p - probe[0]).max() for p in probe[1:]]
        assert 1e-4 < moved[0] < moved[1], moved
