"""The environment contract, checked on every built-in environment as a user's trainer would
use it: Gymnasium's own checker, seeded determinism, held-out evaluation sets, hostile actions."""

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from envs import ENVS, make_env

BUILT_IN = [name for name in ENVS if name != "skyrl"]

HOSTILE = [
    "",                                        # empty
    "   \n\n\t  ",                             # whitespace only
    "x" * 200_000,                             # enormous
    "\x00\x01\x1b[31m\x7f\ufffd\ud7ff",        # control characters and odd code points
    "ÿþ🙂 ︎\u202eright\u202c ùp",             # garbled Unicode around a valid word
    "answer: query: calc: ``` ``` #### ::: ",  # every command prefix, none complete
    "up " * 3000,                              # long and repetitive
]


def test_at_least_four_environments_are_registered_under_tandem():
    ids = [i for i in gym.registry if i.startswith("tandem/")]
    assert len(BUILT_IN) >= 4
    for name in BUILT_IN:
        assert f"tandem/{name}-v0" in ids


@pytest.mark.parametrize("name", BUILT_IN)
def test_gymnasium_env_checker_passes(name):
    env = make_env(name)
    check_env(env, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("name", BUILT_IN)
def test_reset_with_a_seed_is_deterministic_and_seeds_differ(name):
    first = [make_env(name).reset(seed=s)[0] for s in range(6)]
    again = [make_env(name).reset(seed=s)[0] for s in range(6)]
    assert first == again
    assert len({m[0]["content"] for m in first}) > 1


@pytest.mark.parametrize("name", BUILT_IN)
def test_hostile_actions_get_an_observation_never_an_exception(name):
    env = make_env(name)
    for action in HOSTILE:
        env.reset(seed=1)
        obs, reward, terminated, truncated, info = env.step(action)
        assert obs in env.observation_space, repr(action[:40])
        assert obs and obs[0]["content"], "the observation says what happened"
        assert isinstance(reward, float) and reward == 0.0
    env.close()


@pytest.mark.parametrize("name", BUILT_IN)
def test_evaluation_set_is_fixed_distinct_and_never_drawn_in_training(name):
    env = make_env(name)
    tasks = env.eval_tasks(env.eval_seed, 64)
    assert len(tasks) == 64
    prompts = set()
    for task in tasks:
        prompts.add(env.reset(options=task)[0][0]["content"])
    assert len(prompts) == 64
    assert env.eval_tasks(env.eval_seed, 64) == tasks
    for seed in range(300):
        assert env.reset(seed=seed)[0][0]["content"] not in prompts
    env.close()


def test_observations_are_capped_and_cleaned():
    from envs.base import MAX_TEXT, TextEnv

    class Loud(TextEnv):
        def _reset(self, options):
            return "a\x00b\r\nc", {}

        def _step(self, text):
            return [{"role": "tool", "content": "z" * (MAX_TEXT * 3)}], 0.0, False, False, {}

    env = Loud()
    obs, _ = env.reset(seed=0)
    assert obs == ({"role": "user", "content": "ab\nc"},)
    obs, *_ = env.step("go")
    assert len(obs[0]["content"]) == MAX_TEXT and obs[0]["content"].endswith("[truncated]")
    assert obs in env.observation_space
