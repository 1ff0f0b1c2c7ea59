"""Advantages, losses, aggregations and corrections against values worked out by hand."""

import math

import pytest
import torch

from learner.batch import collate
from learner.losses import (Correction, aggregate, correct, explained_variance, gae, grpo_advantages,
                            group_advantages, kl_penalty, mismatch_kl, policy_loss, rloo_advantages,
                            terminal_rewards, token_entropy, token_logprobs, value_loss, whiten)

close = torch.testing.assert_close


def on_policy(logp, mask):
    """The correction every test of the surrogate alone uses: anchor = logp, weights 1."""
    return Correction(logp.detach(), torch.ones_like(logp), mask)


# -- advantages -----------------------------------------------------------------

def test_grpo_advantages_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group 1: mean 0.5, std (population) 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1]
    # group 2: mean 0.75, std sqrt(0.75·0.25) = 0.4330127 -> [0.5773503, 0.5773503, 0.5773503, -1.7320508]
    adv = grpo_advantages(rewards, eps=0.0)
    close(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    close(adv[1], torch.tensor([0.5773503, 0.5773503, 0.5773503, -1.7320508]))


def test_dr_grpo_drops_the_std():
    # mean 0.75 -> r - 0.75
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), normalize_std=False)
    close(adv[0], torch.tensor([0.25, 0.25, 0.25, -0.75]))


def test_uniform_rewards_give_zero_advantage():
    assert grpo_advantages(torch.ones(1, 8)).abs().max() == 0
    assert rloo_advantages(torch.ones(1, 8)).abs().max() == 0


def test_equal_partial_credit_rewards_give_exactly_zero_advantage():
    # Rewards arrive as float32. The float32 mean of eight 0.7s is not 0.7: the rounding error
    # (6e-8) over a std of the same size plus eps (1.06e-6) gave GRPO 0.056 for all eight, one
    # sign for the whole group, and RLOO 6e-8, above the trainer's 1e-8 skip.
    for rewards in ([0.7] * 8, [0.3] * 6, [1 / 3] * 5, [0.1] * 16):
        r = torch.tensor([rewards])
        for adv in (grpo_advantages(r), grpo_advantages(r, normalize_std=False), rloo_advantages(r)):
            assert adv.dtype == torch.float32 and adv.abs().max() == 0, (rewards, adv)


def test_random_groups_uniform_ones_zero_the_others_exact():
    g = torch.Generator().manual_seed(0)
    for size in (2, 3, 5, 6, 8, 16):
        rewards = torch.rand(64, size, generator=g)  # float32 partial credit
        rewards[::2] = rewards[::2, :1]              # every other group: all equal
        for adv, reference in (
                (grpo_advantages(rewards), lambda r: (r - r.mean(1, keepdim=True))
                 / (r.std(1, unbiased=False, keepdim=True) + 1e-6)),
                (rloo_advantages(rewards), lambda r: size / (size - 1) * (r - r.mean(1, keepdim=True)))):
            assert adv[::2].abs().max() == 0
            # the other groups: the formula, worked in float64
            close(adv[1::2], reference(rewards[1::2].double()).float(), atol=1e-6, rtol=1e-6)


def test_a_uniform_partial_credit_group_is_skipped_by_the_step():
    from learner.plan import trained_rows
    from tests.replay.helpers import make_group

    groups = [make_group(size=8, length=6, rewards=[0.7] * 8), make_group(size=2, length=6, rewards=[0.7, 0.2])]
    for algo in ("grpo", "rloo"):
        batch = collate(groups, version=0, pad_id=0, algo=algo)
        assert batch.advantages[:8].abs().max() == 0
        live, _ = trained_rows(batch, critic=False, mini_batches=1)
        assert sorted(live) == [8, 9]  # only the group with a reward spread is trained on


def test_rloo_baseline_is_the_mean_of_the_others():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]]))
    # group 1: 1 - (0 + 0 + 1)/3 = 0.6667; 0 - (1 + 0 + 1)/3 = -0.6667
    close(adv[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # group 2: 3 - 0/3 = 3; 0 - (3 + 0 + 0)/3 = -1
    close(adv[1], torch.tensor([3.0, -1.0, -1.0, -1.0]))
    close(group_advantages(torch.tensor([[3.0, 0.0, 0.0, 0.0]]), "rloo"), adv[1:])
    with pytest.raises(ValueError, match="ppo uses the critic"):
        group_advantages(torch.ones(1, 2), "ppo")


def test_terminal_rewards_sit_on_the_last_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    r = terminal_rewards(torch.tensor([1.0, 0.5, 7.0]), mask)
    # last action tokens: row 0 at t = 4, row 1 at t = 1; row 2 has none, so no reward
    close(r, torch.tensor([[0, 0, 0, 0, 1.0, 0], [0, 0.5, 0, 0, 0, 0], [0.0] * 6]))


def test_gae_skips_observation_tokens_across_turns():
    # one episode: prompt, action, action, observation, action (last), padding
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 0.8, 9.0]])  # 9s sit off the mask and must not matter
    rewards = torch.tensor([[0.0, 0, 0, 0, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # t = 4 (last action): δ = 1 + 0 - 0.8 = 0.2; A = 0.2
    # t = 2: next action is t = 4 (t = 3 is an observation): δ = 0 + 0.8 - 0.6 = 0.2; A = 0.2 + 0.5·0.2 = 0.3
    # t = 1: δ = 0 + 0.6 - 0.5 = 0.1; A = 0.1 + 0.5·0.3 = 0.25
    close(adv, torch.tensor([[0.0, 0.25, 0.3, 0.0, 0.2, 0.0]]))
    # R = A + V on the mask: [0.75, 0.9, 1.0]
    close(ret, torch.tensor([[0.0, 0.75, 0.9, 0.0, 1.0, 0.0]]))


def test_gae_with_discount_and_lambda_one_is_the_discounted_return_minus_value():
    mask = torch.tensor([[1.0, 0, 1, 1]])
    values = torch.tensor([[0.2, 5.0, 0.4, 0.1]])
    rewards = torch.tensor([[0.0, 0, 0, 2.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # returns discount per action step, not per token: R = [0.5²·2, -, 0.5·2, 2] = [0.5, 0, 1, 2]
    close(ret, torch.tensor([[0.5, 0.0, 1.0, 2.0]]))
    # A = R - V = [0.3, 0, 0.6, 1.9]
    close(adv, torch.tensor([[0.3, 0.0, 0.6, 1.9]]))


def test_whiten_over_the_mask():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # mean 2, std 1 over the two masked entries -> [-1, 1]; off the mask 0
    close(whiten(x, mask, eps=0.0), torch.tensor([[-1.0, 1.0, 0.0]]))


# -- per-token terms ------------------------------------------------------------------

def test_token_logprobs_align_with_the_predicted_token():
    # vocab 2, logits favour token 1 by log(3): p(1) = 3/4, p(0) = 1/4 at every position
    logits = torch.tensor([[[0.0, math.log(3.0)]] * 3])
    tokens = torch.tensor([[0, 1, 0]])
    lp = token_logprobs(logits, tokens)
    # entry 0 has no prediction; entry 1 = log p(1) = log 0.75; entry 2 = log p(0) = log 0.25
    close(lp, torch.tensor([[0.0, math.log(0.75), math.log(0.25)]]))


def test_token_entropy():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, 5.0]]])
    h = token_entropy(logits)
    # entry 1 from position 0's logits: p = [1/4, 3/4]: -(0.25·ln 0.25 + 0.75·ln 0.75) = 0.5623351
    # entry 2 from position 1's: p = [1/2, 1/2]: ln 2 = 0.6931472
    close(h, torch.tensor([[0.0, 0.5623351, 0.6931472]]))


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    # log ρ = log π_ref - log π_θ = [ln 0.5, 0] = [-0.6931472, 0]
    # k1 = -log ρ = [0.6931472, 0]
    close(kl_penalty(logp, ref, "k1"), torch.tensor([0.6931472, 0.0]))
    # k2 = ½ (log ρ)² = [0.5 · 0.480453, 0] = [0.2402265, 0]
    close(kl_penalty(logp, ref, "k2"), torch.tensor([0.2402265, 0.0]))
    # k3 = ρ - 1 - log ρ = [0.5 - 1 + 0.6931472, 0] = [0.1931472, 0]
    close(kl_penalty(logp, ref, "k3"), torch.tensor([0.1931472, 0.0]))
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_mismatch_kl_is_k3_of_learner_over_behaviour():
    mu = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    learner = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # ρ = π/μ = [0.5, 1, -]: k3 = [0.5 - 1 + ln 2, 0] = [0.1931472, 0]; mean over 2 tokens = 0.0965736
    assert mismatch_kl(learner, mu, mask) == pytest.approx(0.0965736, abs=1e-6)


# -- aggregation ------------------------------------------------------------------

def test_aggregations():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # token_mean: (1 + 1 + 1 + 1 + 4) / 5 tokens = 1.6
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(1.6)
    # seq_mean_token_mean: (4/4 + 4/1) / 2 trajectories = 2.5
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx(2.5)
    # seq_mean_token_sum_norm with L = 8: (4 + 4) / 2 trajectories / 8 = 0.5
    assert float(aggregate(x, mask, "seq_mean_token_sum_norm", norm_length=8)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, mask, "sum")


# -- corrections ----------------------------------------------------------------------

OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.3, 0.3, 0.3]]))
MU = torch.log(torch.tensor([[0.1, 0.4, 0.5], [0.3, 0.6, 0.3]]))
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
# π_old/μ = [[5, 1.25, (1, off the mask)], [1, 0.5, 1]]


def test_correction_none_anchors_on_the_behaviour_policy():
    c = correct("none", OLD, MU, MASK)
    close(c.old_logprobs, MU)
    close(c.is_weight, torch.ones(2, 3))
    close(c.mask, MASK)


def test_token_tis_clamps_each_weight():
    c = correct("tis", OLD, MU, MASK, cap=2.0)
    close(c.old_logprobs, OLD)
    # min(w, 2) = [[2, 1.25, 1 (log w is zeroed off the mask)], [1, 0.5, 1]]
    close(c.is_weight, torch.tensor([[2.0, 1.25, 1.0], [1.0, 0.5, 1.0]]))
    close(c.mask, MASK)


def test_sequence_tis_clamps_the_product():
    c = correct("seq-tis", OLD, MU, MASK, cap=2.0)
    # row 0: 5 · 1.25 = 6.25 -> 2; row 1: 1 · 0.5 · 1 = 0.5
    close(c.is_weight, torch.tensor([[2.0] * 3, [0.5] * 3]))


def test_geometric_mean_mask_drops_whole_sequences():
    c = correct("geo-mask", OLD, MU, MASK, geo_bound=1.5)
    # row 0: (5 · 1.25)^(1/2) = 2.5 > 1.5 -> dropped; row 1: (0.5)^(1/3) = 0.7937 ≥ 1/1.5 = 0.667 -> kept
    close(c.mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    close(c.is_weight, torch.ones(2, 3))
    c = correct("geo-mask", OLD, MU, MASK, geo_bound=1.2)
    # row 1: 0.7937 < 1/1.2 = 0.8333 -> dropped too
    assert float(c.mask.sum()) == 0


def test_decoupled_drops_tokens_over_its_filter():
    c = correct("decoupled", OLD, MU, MASK, cap=100.0, drop_cap=2.0)  # C too high to truncate here
    close(c.old_logprobs, OLD)
    # w = [[5 -> dropped (weight 0), 1.25, 1], [1, 0.5, 1]]
    close(c.is_weight, torch.tensor([[0.0, 1.25, 1.0], [1.0, 0.5, 1.0]]))
    close(c.mask, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="--correction"):
        correct("vtrace", OLD, MU, MASK)


def test_decoupled_truncates_at_c_and_drops_over_its_filter_of_five_by_default():
    mu = torch.log(torch.tensor([[0.125, 0.0625, 0.625]]))
    c = correct("decoupled", torch.log(torch.tensor([[0.5, 0.5, 0.5]])), mu, torch.ones(1, 3))
    # w = [0.5 / 0.125 = 4 (kept: 4 <= 5, truncated at C = 2), 0.5 / 0.0625 = 8 (dropped: 8 > 5),
    #      0.5 / 0.625 = 0.8 (kept as is)]
    close(c.is_weight, torch.tensor([[2.0, 0.0, 0.8]]))
    close(c.mask, torch.tensor([[1.0, 0.0, 1.0]]))


# -- policy loss -----------------------------------------------------------------------

def test_policy_loss_on_policy_is_advantage_weighted_token_mean():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(logp, on_policy(logp, mask), torch.tensor([2.0]))
    # ratio = 1, weight 1: loss = -(2 + 2) / 2 tokens = -2
    assert float(loss.detach()) == pytest.approx(-2.0)
    loss.backward()
    # d loss / d logp_t = -A · ratio / n = -2 / 2 = -1 on masked tokens, 0 elsewhere
    close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert m["clip_fraction"] == 0 and m["is_weight_mean"] == pytest.approx(1.0)


def test_clip_higher_and_truncated_weights():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.1, 0.4]]))       # π_old/μ = [5, 1.25] -> capped at C = 2: [2, 1.25]
    new = torch.log(torch.tensor([[0.75, 0.5]]))      # ratio = [1.5, 1.0]
    mask = torch.ones(1, 2)
    loss, m = policy_loss(new, correct("tis", old, mu, mask, cap=2.0), torch.tensor([1.0]),
                          clip_low=0.2, clip_high=0.28)
    # token 1: min(1.5·1, clip(1.5, 0.8, 1.28)·1) = 1.28, weighted by 2 -> 2.56
    # token 2: min(1.0, 1.0) = 1.0, weighted by 1.25 -> 1.25
    # loss = -(2.56 + 1.25) / 2 = -1.905
    assert float(loss) == pytest.approx(-1.905, abs=1e-5)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_weight_mean"] == pytest.approx(1.625)
    # the symmetric bound 0.2 would clip at 1.2 instead: -(1.2·2 + 1.25) / 2 = -1.825
    loss_sym, _ = policy_loss(new, correct("tis", old, mu, mask, cap=2.0), torch.tensor([1.0]),
                              clip_low=0.2, clip_high=0.2)
    assert float(loss_sym) == pytest.approx(-1.825, abs=1e-5)


def test_negative_advantage_clips_below_and_dual_clip_bounds_it():
    old = torch.zeros(1, 2)                                   # log 1
    new = torch.log(torch.tensor([[0.5, 4.0]]))               # ratio = [0.5, 4]
    mask = torch.ones(1, 2)
    c = Correction(old, torch.ones(1, 2), mask)
    loss, m = policy_loss(new, c, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    # token 1: min(0.5·-1, 0.8·-1) = -0.8; token 2: min(4·-1, 1.28·-1) = -4 (unbounded for A < 0)
    # loss = -(-0.8 - 4) / 2 = 2.4
    assert float(loss) == pytest.approx(2.4)
    assert m["clip_fraction"] == pytest.approx(1.0)
    loss, _ = policy_loss(new, c, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # dual-clip c = 3: token 2 becomes max(-4, 3·-1) = -3 -> loss = -(-0.8 - 3) / 2 = 1.9
    assert float(loss) == pytest.approx(1.9)


def test_per_token_advantages_and_dropped_tokens():
    logp = torch.zeros(1, 3, requires_grad=True)
    c = Correction(torch.zeros(1, 3), torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    loss, _ = policy_loss(logp, c, torch.tensor([[2.0, -4.0, 100.0]]))
    # ratio 1: -(1·2 + 0.5·-4) / 2 kept tokens = 0; the third token is masked out
    assert float(loss.detach()) == pytest.approx(0.0)
    loss.backward()
    # d/d logp_t = -w_t·A_t / 2 = [-1, 1, 0]
    close(logp.grad, torch.tensor([[-1.0, 1.0, 0.0]]))


def test_decoupled_loss_against_a_moved_policy():
    # π_prox = 0.5 on both tokens, μ = [0.2, 0.4] -> w = [2.5 (over C = 2: dropped), 1.25]
    prox = torch.log(torch.tensor([[0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.2, 0.4]]))
    new = torch.log(torch.tensor([[0.9, 0.7]]))   # ratio to π_prox = [1.8, 1.4]
    loss, m = policy_loss(new, correct("decoupled", prox, mu, torch.ones(1, 2), drop_cap=2.0), torch.tensor([1.0]),
                          clip_low=0.2, clip_high=0.2)
    # only token 2 remains: min(1.4, 1.2)·1 · 1.25 = 1.5; the dropped token is a zero term that
    # still counts: loss = -(0 + 1.5) / 2 action tokens = -0.75
    assert float(loss) == pytest.approx(-0.75, abs=1e-6)
    assert m["is_weight_mean"] == pytest.approx(1.25) and m["clip_fraction"] == pytest.approx(1.0)


def test_behaviour_clip_holds_tokens_pushed_past_mu():
    mu = torch.log(torch.tensor([[0.2, 0.2, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.4, 0.4, 0.2, 0.2]]))  # π_old/μ = [2, 2, 0.4, 0.4], under C = 2
    logp = old.clone().requires_grad_(True)                # π_θ = π_old: ratio 1, PPO's clip idle
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logp, correct("tis", old, mu, mask, cap=2.0), adv, behaviour_clip=1.5)
    # ρ = π_θ/μ = [2, 2, 0.4, 0.4]; B = 1.5, 1/B = 0.667
    # token 1: A > 0 and ρ = 2 > B: held; token 2: A < 0, pushing down is free: pulls
    # token 3: A < 0 and ρ = 0.4 < 1/B: held; token 4: A > 0, pushing up is free: pulls
    # loss = -(2·1 + 2·-1 + 0.4·-1 + 0.4·1) / 4 = 0 (the clip changes gradients, not the value)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert m["behaviour_clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # d/d logp_t = -w_t·A_t / 4 on the pulling tokens: token 2 -2·-1/4 = 0.5, token 4 -0.4·1/4 = -0.1
    close(logp.grad, torch.tensor([[0.0, 0.5, 0.0, -0.1]]))
    free = old.clone().requires_grad_(True)
    loss, m = policy_loss(free, correct("tis", old, mu, mask, cap=2.0), adv)
    loss.backward()
    # off: every token pulls, [-2·1, -2·-1, -0.4·-1, -0.4·1] / 4
    close(free.grad, torch.tensor([[-0.5, 0.5, 0.1, -0.1]]))
    assert m["behaviour_clip_fraction"] == 0


def test_dr_grpo_aggregation_in_the_loss():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, on_policy(logp, mask), torch.tensor([1.0, -1.0]),
                          aggregation="seq_mean_token_sum_norm", norm_length=4)
    # ratio 1: sums per sequence [4·1, 1·-1] = [4, -1]; mean over 2 = 1.5; / L = 4 -> 0.375; loss = -0.375
    assert float(loss) == pytest.approx(-0.375)


# -- value loss ------------------------------------------------------------------------

def test_value_loss_clips_around_the_old_values():
    values = torch.tensor([[1.0, 0.0, 0.5]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.5]])
    returns = torch.tensor([[0.0, 1.0, 0.5]])
    mask = torch.ones(1, 3)
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    # token 1: (1 - 0)² = 1; clipped V = 0.5 + clip(0.5, ±0.2) = 0.7 -> 0.49; max = 1
    # token 2: (0 - 1)² = 1; clipped V = 0 -> 1; max = 1
    # token 3: 0
    # L = ½ · (1 + 1 + 0) / 3 = 0.3333333
    assert float(loss.detach()) == pytest.approx(1 / 3)
    assert m["value_clip_fraction"] == pytest.approx(1 / 3)
    # explained variance: Var(R) = Var([0, 1, 0.5]) = 1/6; R - V = [-1, 1, 0], Var = 2/3 -> 1 - 4 = -3
    assert m["explained_variance"] == pytest.approx(-3.0)
    loss_clip, _ = value_loss(torch.tensor([[0.9]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                              torch.ones(1, 1), clip=0.2)
    # V moved 0.9 from V_old: (0.9 - 1)² = 0.01, clipped V = 0.2 -> (0.2 - 1)² = 0.64; max -> ½·0.64 = 0.32
    assert float(loss_clip) == pytest.approx(0.32)


def test_explained_variance_of_a_perfect_critic_is_one():
    r = torch.tensor([[0.0, 1.0, 2.0]])
    assert explained_variance(r, r, torch.ones(1, 3)) == pytest.approx(1.0)
    # a constant prediction at the mean explains nothing: R - V = [-1, 0, 1] has Var(R)
    assert explained_variance(torch.ones(1, 3), r, torch.ones(1, 3)) == pytest.approx(0.0)


# -- collate ----------------------------------------------------------------------------

def test_collate_pads_and_computes_per_group_advantages():
    from tests.replay.helpers import make_group

    g1 = make_group(version=2, size=2, length=5, rewards=[1.0, 0.0])
    g2 = make_group(version=3, size=2, length=7, rewards=[1.0, 1.0])
    b = collate([g1, g2], version=4, pad_id=0)
    assert b.tokens.shape == (4, 7) and int(b.attention[0].sum()) == 5
    close(b.advantages, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    close(b.staleness, torch.tensor([2.0, 2.0, 1.0, 1.0]))
    # RLOO with G = 2: 1 - 0 = 1, 0 - 1 = -1
    close(collate([g1], version=4, pad_id=0, algo="rloo").advantages, torch.tensor([1.0, -1.0]))
    # PPO leaves the advantages to the critic
    close(collate([g1], version=4, pad_id=0, algo="ppo").advantages, torch.zeros(2))
