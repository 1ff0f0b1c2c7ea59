"""serve/losses.py against values worked out by hand, and the checks on a loss's config."""

import math

import pytest
import torch

from serve.losses import cross_entropy, importance_sampling, loss_fn, ppo


def test_losses_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    loss, per_token = cross_entropy(logp, {"weights": torch.tensor([0.0, 1.0, 2.0])}, {})
    assert loss.item() == pytest.approx(0 * 1.0 + 1 * 2.0 + 2 * 0.5)  # −Σ w·logp = 3
    assert per_token.tolist() == pytest.approx([0.0, 2.0, 1.0])
    assert cross_entropy(logp, {}, {})[0].item() == pytest.approx(3.5)  # weights default to 1
    q = logp - torch.tensor([math.log(2.0), 0.0, math.log(0.5)])  # ratios π/q = 2, 1, 0.5
    adv = torch.tensor([1.0, -1.0, 2.0])
    inputs = {"logprobs": q, "advantages": adv}
    assert importance_sampling(logp, inputs, {})[0].item() == pytest.approx(-(2 * 1 + 1 * -1 + 0.5 * 2))
    # clip [0.8, 1.2]: min(2·1, 1.2·1) = 1.2; min(1·−1, 1·−1) = −1; min(0.5·2, 0.8·2) = 1
    assert ppo(logp, inputs, {})[0].item() == pytest.approx(-(1.2 - 1 + 1.0))
    # clip [0.6, 1.5]: 1.5; −1; min(1, 1.2) = 1
    got = ppo(logp, inputs, {"clip_low_threshold": 0.6, "clip_high_threshold": 1.5})[0].item()
    assert got == pytest.approx(-(1.5 - 1 + 1.0))


def test_the_gradient_is_the_formulas():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    cross_entropy(logp, {"weights": torch.tensor([1.0, 3.0])}, {})[0].backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -3.0])


@pytest.mark.parametrize("name, config, message", [
    ("cispo", {}, "unknown loss_fn"),
    ("cross_entropy", {"clip_low_threshold": 0.9}, "not read by cross_entropy"),
    ("ppo", {"clip_low_threshold": "x"}, "must be a number"),
    ("ppo", {"clip_low_threshold": 1.1}, "low <= 1 <= high"),
])
def test_bad_losses_are_refused(name, config, message):
    with pytest.raises(ValueError, match=message):
        loss_fn(name, config)
