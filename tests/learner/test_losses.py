"""Advantages and the policy loss against values worked out by hand."""

import math

import pytest
import torch

from learner.batch import collate
from learner.losses import grpo_advantages, policy_loss, token_logprobs


def test_grpo_advantages_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group 1: mean 0.5, std (population) 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1]
    # group 2: mean 0.75, std sqrt(0.75·0.25) = 0.4330127 -> [0.5773503, 0.5773503, 0.5773503, -1.7320508]
    adv = grpo_advantages(rewards, eps=0.0)
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    torch.testing.assert_close(adv[1], torch.tensor([0.5773503, 0.5773503, 0.5773503, -1.7320508]))


def test_dr_grpo_drops_the_std():
    # mean 0.75 -> r - 0.75
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), normalize_std=False)
    torch.testing.assert_close(adv[0], torch.tensor([0.25, 0.25, 0.25, -0.75]))


def test_uniform_rewards_give_zero_advantage():
    assert grpo_advantages(torch.ones(1, 8)).abs().max() == 0


def test_token_logprobs_align_with_the_predicted_token():
    # vocab 2, logits favour token 1 by log(3): p(1) = 3/4, p(0) = 1/4 at every position
    logits = torch.tensor([[[0.0, math.log(3.0)]] * 3])
    tokens = torch.tensor([[0, 1, 0]])
    lp = token_logprobs(logits, tokens)
    # entry 0 has no prediction; entry 1 = log p(1) = log 0.75; entry 2 = log p(0) = log 0.25
    torch.testing.assert_close(lp, torch.tensor([[0.0, math.log(0.75), math.log(0.25)]]))


def test_policy_loss_on_policy_is_advantage_weighted_token_mean():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0])
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), adv, mask)
    # ratio = 1, is_weight = 1: loss = -(2 + 2) / 2 tokens = -2
    assert float(loss.detach()) == pytest.approx(-2.0)
    loss.backward()
    # d loss / d logp_t = -A · ratio / n = -2 / 2 = -1 on masked tokens, 0 elsewhere
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert m["clip_fraction"] == 0 and m["is_weight_mean"] == pytest.approx(1.0)


def test_truncated_importance_weights_and_clipping():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.1, 0.4]]))       # π_old/μ = [5, 1.25] -> capped at C = 2: [2, 1.25]
    new = torch.log(torch.tensor([[0.75, 0.5]]))      # ratio = [1.5, 1.0]
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    loss, m = policy_loss(new, old, mu, adv, mask, clip_low=0.2, clip_high=0.28, is_cap=2.0)
    # token 1: min(1.5·1, clip(1.5, 0.8, 1.28)·1) = 1.28, weighted by 2 -> 2.56
    # token 2: min(1.0, 1.0) = 1.0, weighted by 1.25 -> 1.25
    # loss = -(2.56 + 1.25) / 2 = -1.905
    assert float(loss) == pytest.approx(-1.905, abs=1e-5)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_weight_mean"] == pytest.approx(1.625)
    # no correction: weights 1 -> -(1.28 + 1.0) / 2 = -1.14
    loss0, _ = policy_loss(new, old, mu, adv, mask, is_cap=0.0)
    assert float(loss0) == pytest.approx(-1.14, abs=1e-5)


def test_collate_pads_and_computes_per_group_advantages():
    from tests.replay.helpers import make_group

    g1 = make_group(version=2, size=2, length=5, rewards=[1.0, 0.0])
    g2 = make_group(version=3, size=2, length=7, rewards=[1.0, 1.0])
    b = collate([g1, g2], version=4, pad_id=0)
    assert b.tokens.shape == (4, 7) and int(b.attention[0].sum()) == 5
    torch.testing.assert_close(b.advantages, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.staleness, torch.tensor([2.0, 2.0, 1.0, 1.0]))


def test_sequence_mean_weighs_every_trajectory_the_same():
    from learner.losses import aggregate

    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # token_mean: (1 + 1 + 1 + 1 + 4) / 5 tokens = 1.6
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(1.6)
    # seq_mean_token_mean: (4/4 + 4/1) / 2 trajectories = 2.5
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, mask, "sum")
