"""--actor.novelty: a count-based exploration bonus for the episodes that earn nothing, so that a
group whose episodes all fail still says which of them went further."""

import numpy as np
import pytest

from actors.actor import ActorConfig
from actors.torch_engine import TorchEngine
from launch.monitor import InfoMeans
from replay.buffer import Entry, ReplayBuffer
from replay.wire import OUTCOME_SPREAD, encode_group
from tests.actors.test_actor import LORA, play_groups
from envs.base import STATE
from tests.actors.test_turn_states import GOAL, Line

BETA = 0.2


class Sticky(Line):
    """Line's walk where only a reply whose length is a multiple of 3 moves on: a third of the
    turns, so failures reach one, two or three cells in their six turns."""

    def _step(self, text):
        self.turn += 1
        self.cell += len(text) % 3 == 0
        done = self.cell == GOAL
        return "walk", float(done), done, not done and self.turn >= 6, {STATE: str(self.cell)}


def bonus(t) -> float:
    """What the bonus should be for trajectory `t`, from its own recorded turns."""
    return 0.0 if sum(t.turn_rewards) > 0 else BETA * (1 - 1 / len(set(t.anchors)))


def test_failed_episodes_earn_a_bonus_for_the_states_they_reached(tiny_model, chat):
    """Run as a user would: an actor with --actor.novelty 0.2 plays a walk where a reply can
    bump; each trajectory's reward is the environment's plus β·(1 − 1/n) for a failure (n the
    distinct states its turns were played from), nothing for a success, and the group's spread,
    the one dynamic sampling judges, sees the bonus."""
    engine = TorchEngine(tiny_model, LORA, seed=3)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=5, temperature=1.0, novelty=BETA)
    groups, stats = play_groups(engine, chat, cfg, Sticky, max_groups=12, seed=4)
    trajs = [t for g in groups for t in g.trajectories]
    failed = [t for t in trajs if sum(t.turn_rewards) == 0]
    assert failed and len(failed) < len(trajs), "the walk both succeeds and fails with these seeds"
    for t in trajs:
        assert t.reward == pytest.approx(sum(t.turn_rewards) + bonus(t))
    assert len({round(bonus(t), 6) for t in failed}) >= 2, "failures that went further earn more"
    assert max(t.reward for t in failed) < min(t.reward for t in trajs if sum(t.turn_rewards) > 0), \
        "a success outranks every failure"
    for g in groups:
        assert g.meta[OUTCOME_SPREAD] == pytest.approx(float(np.ptp(g.rewards)), abs=1e-6)
    assert stats["novelty_sum"] == pytest.approx(sum(bonus(t) for t in trajs), abs=1e-5)
    assert InfoMeans().scalars([stats])["rollout/novelty"] == pytest.approx(stats["novelty_sum"] / len(trajs))


def test_a_group_whose_episodes_all_fail_is_kept_when_they_explored_differently(tiny_model, chat):
    """Dynamic sampling drops a group of equal rewards; with the bonus, failures that reached
    different numbers of states are not equal, and the replay buffer keeps their group."""
    engine = TorchEngine(tiny_model, LORA, seed=3)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=5, temperature=1.0, novelty=BETA)
    groups, _ = play_groups(engine, chat, cfg, Sticky, max_groups=12, seed=4)
    all_failed = [g for g in groups if not any(sum(t.turn_rewards) for t in g.trajectories)]
    explored = [g for g in all_failed if g.meta[OUTCOME_SPREAD] > 0]
    assert explored, "some group failed in every episode, some of them going further than others"
    buffer = ReplayBuffer(groups_per_step=1, max_staleness=100, drop_zero_variance=True)
    for g in explored:
        buffer.push(Entry.of(g, encode_group(g)), len(g.trajectories))
    assert buffer.stats.dropped["zero_variance"] == 0


@pytest.mark.parametrize("beta", [-0.1, 1.0])
def test_a_bonus_outside_0_to_1_is_refused(beta):
    with pytest.raises(ValueError, match="--actor.novelty is a β in \\[0, 1\\)"):
        ActorConfig(novelty=beta)
