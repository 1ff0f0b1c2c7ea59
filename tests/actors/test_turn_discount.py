"""--actor.turn-discount: the return a trajectory is trained on discounts each turn's reward by γ^t;
what the episodes achieved (undiscounted) goes beside it, for the replay's drop and revisits."""

import numpy as np
import pytest

from actors.actor import ActorConfig
from actors.torch_engine import TorchEngine
from envs.base import TextEnv
from replay.wire import OUTCOME_SPREAD
from tests.actors.test_actor import LORA, play_groups

MAX_TURNS = 4


class Steps(TextEnv):
    """Each turn pays 0.25 and goes on, or pays 1.0 and ends when the reply has an odd length;
    the fourth turn ends the episode either way. Episodes of one group end after different
    numbers of turns."""

    def _reset(self, options):
        self.turn = 0
        return "say something", {}

    def _step(self, text):
        self.turn += 1
        done = len(text) % 2 == 1
        return "again", 1.0 if done else 0.25, done, not done and self.turn >= MAX_TURNS, {}


def expected(turns: int, finish: str, gamma: float) -> float:
    last = 1.0 if finish == "terminated" else 0.25
    return sum(0.25 * gamma**t for t in range(turns - 1)) + last * gamma ** (turns - 1)


def achieved(turns: int, finish: str) -> float:
    return expected(turns, finish, 1.0)


def play(tiny_model, chat, gamma: float):
    engine = TorchEngine(tiny_model, LORA, seed=5)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=4, temperature=1.0, turn_discount=gamma)
    return play_groups(engine, chat, cfg, Steps, max_groups=12, seed=2)[0]


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_each_turns_reward_counts_gamma_to_the_turn_in_the_trained_return(tiny_model, chat, gamma):
    """Run as a user would with --actor.turn-discount 0.5 (and without it): every trajectory pushed
    to replay carries Σ γ^t r_t over its turns; with 1 the environment's rewards summed. Each group
    also says how far apart its episodes' undiscounted rewards lie (the replay drops a group by
    that, not by the returns)."""
    groups = play(tiny_model, chat, gamma)
    for g in groups:
        outcomes = [achieved(t.turns, t.finish_reason) for t in g.trajectories]
        assert g.meta[OUTCOME_SPREAD] == pytest.approx(max(outcomes) - min(outcomes), abs=1e-6)
        assert g.outcome_spread == g.meta[OUTCOME_SPREAD]
    if gamma < 1:
        assert any(abs(np.ptp(g.rewards) - g.outcome_spread) > 1e-3 for g in groups), \
            "the returns' spread is not what the episodes achieved"
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) >= 40
    assert {t.turns for t in trajs} >= {1, 2}, "the episodes end after different numbers of turns"
    assert {t.finish_reason for t in trajs} <= {"terminated", "truncated"}
    for t in trajs:
        assert t.reward == pytest.approx(expected(t.turns, t.finish_reason, gamma), abs=1e-6), (t.turns, t.finish_reason)


@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5])
def test_a_discount_outside_zero_to_one_is_refused(gamma):
    with pytest.raises(ValueError, match="--actor.turn-discount"):
        ActorConfig(turn_discount=gamma)

