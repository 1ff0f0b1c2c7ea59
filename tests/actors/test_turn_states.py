"""Each turn's state and reward, recorded by the actor and pushed with the group: what
--learner.step-weight (GiGPO) groups turns by."""

import pytest

from actors.actor import ActorConfig
from actors.engine import SamplingParams
from actors.envrunner import EnvRunner
from actors.rollout import anchor, play, start
from actors.torch_engine import TorchEngine
from envs.base import STATE, TextEnv
from envs.maze import MazeEnv
from learner.losses import turn_index
from tests.actors.test_actor import LORA, play_groups
from tests.actors.test_turn_discount import Steps

GOAL = 3


class Line(TextEnv):
    """A walk along cells 0..3: a reply of odd length moves one cell on, an even one stays (a
    bump); reward 1 on reaching cell 3, six turns at most. Its state is the cell."""

    def _reset(self, options):
        self.cell, self.turn = 0, 0
        return "walk", {STATE: "0"}

    def _step(self, text):
        self.turn += 1
        self.cell += len(text) % 2
        done = self.cell == GOAL
        return ("moved" if len(text) % 2 else "bump"), float(done), done, not done and self.turn >= 6, \
            {STATE: str(self.cell)}


def replies(chat, t):
    """The decoded text of each model turn of trajectory `t` (what the environment was stepped with)."""
    turn = turn_index(t.mask)
    return [chat.decode(t.tokens[turn == k].tolist()) for k in range(t.turns)]


def play_line(tiny_model, chat, env=Line):
    engine = TorchEngine(tiny_model, LORA, seed=3)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=5, temperature=1.0)
    return play_groups(engine, chat, cfg, env, max_groups=8, seed=4)[0]


def test_every_turn_carries_the_state_it_was_played_from_and_its_reward(tiny_model, chat):
    """Run as a user would: an actor plays an environment that names its states; replaying each
    trajectory's replies through a fresh environment gives back the recorded states and rewards."""
    groups = play_line(tiny_model, chat)
    stays = 0
    for g in groups:
        for t in g.trajectories:
            assert len(t.anchors) == len(t.turn_rewards) == t.turns >= 1
            env = Line()
            _, info = env.reset()
            states, rewards = [], []
            for text in replies(chat, t):
                states.append(info[STATE])
                _, reward, _, _, info = env.step(text)
                rewards.append(reward)
            assert t.anchors == [anchor({STATE: s}, [], []) for s in states]
            assert t.turn_rewards == rewards and sum(rewards) == t.reward
            stays += sum(a == b for a, b in zip(t.anchors, t.anchors[1:]))
        assert len({t.anchors[0] for t in g.trajectories}) == 1, "a group's episodes start from one state"
    assert stays > 0, "some turns bumped and were played again from the same state"
    assert {t.finish_reason for g in groups for t in g.trajectories} >= {"terminated"}


def test_without_a_named_state_a_turn_is_keyed_by_its_observation(tiny_model, chat):
    """An environment that names no states: turns whose observations render the same share a key.
    Steps answers every turn with "again", so every turn after the first shares one key, and the
    first turns (the prompt) share another."""
    groups = play_line(tiny_model, chat, env=Steps)
    trajs = [t for g in groups for t in g.trajectories]
    assert len({t.anchors[0] for t in trajs}) == 1
    later = {a for t in trajs for a in t.anchors[1:]}
    assert len(later) == 1 and later != {trajs[0].anchors[0]}


def test_a_maze_names_the_agents_cell():
    env = MazeEnv()
    _, info = env.reset(seed=11)
    start_cell = info[STATE]
    assert start_cell == f"{env.pos[0]},{env.pos[1]}"
    _, _, _, _, info = env.step("no move here")
    assert info[STATE] == start_cell  # an invalid move, like a bump, leaves the agent where it was


class BadState(Line):
    def _step(self, text):
        obs, reward, done, truncated, info = super()._step(text)
        return obs, reward, done, truncated, {STATE: ("cell", self.cell)}


def test_a_state_that_is_not_a_string_ends_the_episode_with_a_message(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA, seed=3)
    runner = EnvRunner()
    try:
        episodes = [start(BadState(), chat, runner, seed=1)]
        play(engine, chat, episodes, SamplingParams(4, chat.stop_ids, temperature=1.0), 512, runner)
    finally:
        runner.close()
    ep = episodes[0]
    assert ep.finish_reason == "env_error" and "state as a string of at most 1024 characters, got tuple" in ep.error
    t = ep.trajectory()
    assert len(t.anchors) == len(t.turn_rewards) == t.turns == 1 and not t.mask.any()


@pytest.mark.parametrize("info", [{STATE: "x" * 2000}, {STATE: 3}])
def test_the_base_environment_refuses_a_state_that_is_not_a_short_string(info):
    class Named(Line):
        def _reset(self, options):
            super()._reset(options)
            return "walk", info

    with pytest.raises(ValueError, match="info\\['state'\\]"):
        Named().reset()
