"""--actor.revisit: an actor starts a share of its groups on tasks whose last group was mixed."""

import numpy as np
import pytest

from actors.actor import ActorConfig
from actors.revisit import Revisits
from actors.torch_engine import TorchEngine
from envs.base import TextEnv
from tests.actors.test_actor import LORA, play_groups


def test_the_pool_keeps_mixed_tasks_picks_by_spread_and_forgets_the_oldest():
    pool = Revisits(share=0.99, size=3, rng=np.random.default_rng(0))
    assert pool.pick() is None  # nothing to revisit yet
    assert not pool.record(1, [1.0, 1.0, 1.0]) and not pool.record(2, [0.0, 0.0])  # all equal: nothing to learn
    assert not pool.record(3, [float("nan"), 1.0]) and not pool.record(4, [1.0]) and len(pool) == 0
    assert pool.record(5, [0.0, 1.0]) and pool.record(6, [0.0, 0.0, 0.0, 1.0]) and len(pool) == 2
    picks = [Revisits(0.99, 3, np.random.default_rng(s)) for s in range(400)]
    for p in picks:
        p.record(5, [0.0, 1.0])  # spread 0.5
        p.record(6, [0.0, 0.0, 0.0, 1.0])  # spread 0.433
    counts = {5: 0, 6: 0, None: 0}
    for p in picks:
        counts[p.pick()] += 1
    assert counts[None] < 20 and abs(counts[5] / (counts[5] + counts[6]) - 0.5 / 0.933) < 0.1
    pool.record(7, [0.0, 1.0])
    pool.record(8, [0.0, 1.0])  # a fourth task: the oldest (5) makes room
    assert len(pool) == 3
    taken = [pool.pick() for _ in range(50)]
    assert sorted(s for s in taken if s is not None) == [6, 7, 8] and len(pool) == 0  # a picked task leaves
    pool.record(6, [0.0, 1.0])
    pool.record(6, [1.0, 1.0])  # solved by every sample now: it leaves
    assert len(pool) == 0


def test_no_revisits_draw_nothing_and_bad_settings_are_refused():
    rng = np.random.default_rng(4)
    pool = Revisits(share=0.0, size=8, rng=rng)
    assert pool.record(1, [0.0, 1.0]) and len(pool) == 0 and pool.pick() is None
    assert rng.integers(2**31 - 1) == np.random.default_rng(4).integers(2**31 - 1)
    for share, size in ((1.0, 8), (-0.1, 8), (0.5, 0)):
        with pytest.raises(ValueError, match="--actor.revisit"):
            Revisits(share, size, rng)
        with pytest.raises(ValueError, match="--actor.revisit"):
            ActorConfig(revisit=share, revisit_pool=size)


class Coin(TextEnv):
    """One turn; rewarded when the reply has an odd length, so a group of samples is often mixed."""

    def _reset(self, options):
        return "say something", {}

    def _step(self, text):
        return "done", float(len(text) % 2), True, False, {}


def play(tiny_model, chat, revisit: float, groups: int = 40):
    engine = TorchEngine(tiny_model, LORA, seed=3)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=4, temperature=1.0, revisit=revisit,
                      revisit_pool=4)
    return play_groups(engine, chat, cfg, Coin, max_groups=groups, seed=1)


def test_an_actor_revisits_only_tasks_whose_last_group_was_mixed(tiny_model, chat):
    """Run as a user would with --actor.revisit 0.5: every task played twice was mixed the time
    before, about half the groups revisit, and the actor's counters say so; without it every
    group is a fresh task."""
    groups, stats = play(tiny_model, chat, revisit=0.5)
    assert len(groups) >= 40
    last_mixed: dict[str, bool] = {}
    revisited = 0
    for g in groups:
        rewards = {t.reward for t in g.trajectories}
        if g.task in last_mixed:
            assert last_mixed[g.task], f"{g.task} was revisited after a group with equal rewards"
            revisited += 1
        last_mixed[g.task] = len(rewards) > 1
    mixed = sum(len({t.reward for t in g.trajectories}) > 1 for g in groups)
    assert stats["groups_mixed"] == mixed and mixed >= 10
    assert 5 <= revisited <= stats["groups_revisited"] <= revisited + 2  # up to 2 revisits still in flight
    fresh, stats = play(tiny_model, chat, revisit=0.0)
    assert len({g.task for g in fresh}) == len(fresh) >= 40 and stats.get("groups_revisited", 0) == 0
