"""--learner.step-weight (GiGPO): each turn's step-level advantage, from the turns of its group played
from the same state, added to the episode-level one on that turn's tokens."""

import numpy as np
import pytest
import torch

from learner.batch import collate
from learner.losses import grpo_advantages, step_advantages, turn_index
from tests.replay.helpers import make_group


def test_turns_from_the_same_state_are_compared_by_their_discounted_returns():
    """Two episodes from state 1: one moves on to 2 and reaches the goal (reward 1 at its second
    turn), one bumps (stays at 1), then moves on and reaches it a turn later; a third never leaves
    state 1 and fails."""
    anchors = [[1, 2], [1, 1, 2], [1, 1, 1]]
    rewards = [[0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    adv = step_advantages(anchors, rewards, gamma=0.5, normalize_std=False)
    # returns: [0.5, 1], [0.25, 0.5, 1], [0, 0, 0]; state 1's turns: 0.5, 0.25, 0.5, 0, 0, 0
    state1 = np.array([0.5, 0.25, 0.5, 0.0, 0.0, 0.0])
    mean = state1.mean()
    np.testing.assert_allclose(adv[0], [0.5 - mean, 0.0])  # state 2's returns are equal: 0
    np.testing.assert_allclose(adv[1], [0.25 - mean, 0.5 - mean, 0.0])
    np.testing.assert_allclose(adv[2], [-mean] * 3)
    assert adv[1][0] < adv[0][0], "the bump is pushed down against the move from the same state"
    normed = step_advantages(anchors, rewards, gamma=0.5)
    np.testing.assert_allclose(normed[0][0], (0.5 - mean) / (state1.std() + 1e-6))
    # a state visited once, or by turns whose returns are all equal, gives exactly 0
    alone = step_advantages([[5], [6]], [[1.0], [0.0]], gamma=0.9)
    assert [list(a) for a in alone] == [[0.0], [0.0]]


def test_each_model_token_knows_its_turn():
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1])
    assert turn_index(mask).tolist() == [-1, -1, 0, 0, -1, -1, 1, -1, 2, 2, 2]
    assert turn_index(np.zeros(3, np.uint8)).tolist() == [-1, -1, -1]


def turn_group(seed: int, rewards, anchors, turn_rewards, turns: int = 3, length: int = 24):
    """A group whose trajectories have `turns` replies of 2 tokens each, with their turns' states."""
    g = make_group(seed=seed, length=length, rewards=rewards)
    for t, a, r in zip(g.trajectories, anchors, turn_rewards):
        mask = np.zeros(length, np.uint8)
        for k in range(turns):
            mask[4 + 6 * k: 6 + 6 * k] = 1
        t.mask, t.logprobs = mask, np.where(mask, t.logprobs - 0.1, 0).astype(np.float32)
        t.turns, t.anchors, t.turn_rewards = turns, a, r
    return g


def test_a_tokens_advantage_is_its_episodes_plus_weight_times_its_turns():
    anchors = [[1, 2, 3], [1, 1, 2], [1, 4, 4], [1, 2, 5]]
    turn_rewards = [[0, 0, 1.0], [0, 0, 1.0], [0, 0, 0], [0, 0, 0]]
    g = turn_group(0, [1.0, 1.0, 0.0, 0.0], anchors, turn_rewards)
    plain = collate([g], 0, pad_id=0)
    batch = collate([g], 0, pad_id=0, step_weight=0.5, step_gamma=0.9)
    assert plain.advantages.shape == (4,) and batch.advantages.shape == (4, 24)
    episode = grpo_advantages(torch.tensor([[1.0, 1.0, 0.0, 0.0]]))[0]
    steps = step_advantages(anchors, turn_rewards, 0.9)
    for i, t in enumerate(g.trajectories):
        on = t.mask.astype(bool)
        turn = turn_index(t.mask)
        expected = episode[i].item() + 0.5 * steps[i][turn[on]]
        np.testing.assert_allclose(batch.advantages[i][torch.from_numpy(on)].numpy(), expected, rtol=1e-5, atol=1e-6)
        assert (batch.advantages[i][torch.from_numpy(~on)] == 0).all()
    assert steps[0][1] > 0 > steps[3][1], "from state 2, the turn on the way to the goal is ranked above"
    compared = sum(int(np.count_nonzero(a)) for a in steps)
    assert batch.step_share == pytest.approx(compared / 12) and 0 < compared < 12 and plain.step_share is None


def test_a_group_without_its_turns_states_stops_the_step_with_a_message():
    g = make_group(seed=1)  # a producer of its own: no turn states
    with pytest.raises(ValueError, match="does not carry each turn's state"):
        collate([g], 0, pad_id=0, step_weight=1.0)
    bad = turn_group(2, [1.0, 0.0, 0.0, 0.0], [[1, 2, 3]] * 4, [[0, 0, 1.0]] * 4)
    bad.trajectories[2].mask[20] = 1  # a fourth reply in a trajectory of three turns
    with pytest.raises(ValueError, match="has 4 replies for 3 turns"):
        collate([bad], 0, pad_id=0, step_weight=1.0)


def test_a_broken_episode_adds_no_step_advantage():
    g = turn_group(3, [1.0, 0.0, 0.0, 0.0], [[1, 2, 3], [1, 1, 1], [1, 2, 2], [1, 1, 2]], [[0, 0, 1.0], [0] * 3,
                                                                                           [0] * 3, [0] * 3])
    g.trajectories[3].mask[:] = 0  # env_error: the actor clears the mask
    g.trajectories[3].finish_reason = "env_error"
    batch = collate([g], 0, pad_id=0, step_weight=1.0)
    assert (batch.advantages[3] == 0).all()
    # nor do its turns count in the step groups of the others: as if it had not been played
    whole = step_advantages([t.anchors for t in g.trajectories[:3]], [t.turn_rewards for t in g.trajectories[:3]], 0.95)
    episode = grpo_advantages(torch.from_numpy(g.rewards)[None])[0]
    first = g.trajectories[0]
    on = torch.from_numpy(first.mask.astype(bool))
    expected = episode[0].item() + whole[0][turn_index(first.mask)[first.mask.astype(bool)]]
    np.testing.assert_allclose(batch.advantages[0][on].numpy(), expected, rtol=1e-5, atol=1e-6)


def _steps(model, out):
    """One Learner.step of a world-1 learner with --learner.step-weight 0 and 1, from the same
    weights and groups; the groups' turns were played from states that differ (each turn its own
    state: no step advantage) or repeat (state 1 at every first turn)."""
    import socket

    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay

    torch.set_num_threads(1)
    results = []
    for weight, shared in ((0.0, False), (1.0, False), (1.0, True)):
        torch.manual_seed(0)
        replay = LocalReplay(ReplayBuffer(groups_per_step=2, max_staleness=0))
        for i in range(2):
            anchors = [[1 if shared else 10 * j + 10, 10 * j + 11, 10 * j + 12] for j in range(4)]
            turn_rewards = [[0.0, 0.0, r] for r in (1.0, 0.0, 0.0, 1.0)]
            if shared:
                turn_rewards[0] = [1.0, 0.0, 0.0]  # the first episode paid on its first turn
            replay.push(turn_group(i, [1.0, 0.0, 0.0, 1.0], anchors, turn_rewards))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2, step_weight=weight), model, 0, 1, url, replay)
        grads = []
        clip = learner._clip

        def clipped(params):
            grads.extend(p.grad.full_tensor().numpy().copy() for p in params)
            return clip(params)

        learner._clip = clipped
        try:
            learner.setup()
            metrics = learner.step()
            results.append((metrics["loss"], grads, metrics.get("step_share")))
        finally:
            learner.close()
    out.put(results)


def test_a_learner_step_trains_on_the_per_token_advantages(tiny_model):
    """Run as a user would with --learner.step-weight 1: where no two turns share a state the step is
    the plain GRPO step; where the first turns share one, the gradient changes."""
    import multiprocessing as mp

    from tests.learner.ranks import as_rank

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=as_rank, args=(_steps, tiny_model, out))
    p.start()
    (loss0, g0, share0), (loss1, g1, share1), (loss2, g2, share2) = out.get(timeout=240)
    p.join(60)
    assert p.exitcode == 0
    assert any(np.abs(g).max() > 0 for g in g0)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert share0 is None and share1 == 0.0 and share2 == pytest.approx(4 / 12)  # TensorBoard's learner/step_share
    assert loss2 != pytest.approx(loss0, rel=1e-3)
    assert max(np.abs(a - b).max() for a, b in zip(g2, g0)) > 1e-4
