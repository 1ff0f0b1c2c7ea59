"""Maze rules, determinism, the evaluation set, lenient parsing."""

import gymnasium as gym
import numpy as np
import pytest

from envs import make_env
from envs.maze import MAZE64_SEED, Maze, MazeEnv, generate, maze_set, parse_move, shortest_path


def corridor() -> Maze:
    # @ . #
    # # . G
    walls = ((False, False, True), (True, False, False))
    return Maze(walls, start=(0, 0), goal=(1, 2))


def test_moves_walls_and_goal():
    env = MazeEnv(size=3, max_steps=10)
    obs, info = env.reset(options={"maze": corridor()})
    assert obs == ({"role": "user", "content": "start\ngoal: down right right\nopen: right\nnew: right\n@.#\n#.G"},)
    assert info["optimal_steps"] == 3
    obs, r, term, trunc, info = env.step("down")  # into a wall: nothing changes
    assert (r, term, trunc, info["status"]) == (0.0, False, False, "wall down")
    assert obs[0]["content"] == "wall down\ngoal: down right right\nopen: right\nnew: right\n@.#\n#.G"
    obs, r, term, trunc, _ = env.step("right")
    # "new" leaves out the cell already visited (the start)
    assert obs[0]["content"] == "moved\ngoal: down right\nopen: down left\nnew: down\n.@#\n#.G" and r == 0.0
    obs, *_ = env.step("left")
    assert obs[0]["content"].startswith("moved\ngoal: down right right\nopen: right\nnew: none\n")
    env.step("right")
    env.step("down")
    obs, r, term, trunc, _ = env.step("RIGHT!")
    assert (r, term, trunc) == (1.0, True, False)


def test_step_limit_truncates_without_reward():
    env = MazeEnv(size=3, max_steps=2)
    env.reset(options={"maze": corridor()})
    assert env.step("left")[1:4] == (0.0, False, False)
    _, r, term, trunc, _ = env.step("left")
    assert (r, term, trunc) == (0.0, False, True)


@pytest.mark.parametrize("text", ["", "x" * 100_000, "\x00\xff garbage", "🙂", "upside"])
def test_unparseable_answers_are_wasted_moves(text):
    env = MazeEnv(size=3, max_steps=5)
    env.reset(options={"maze": corridor()})
    obs, r, term, trunc, info = env.step(text)
    assert info["status"] == "invalid" and obs[0]["content"].startswith("invalid\ngoal: down right right")
    assert obs[0]["content"].endswith("@.#\n#.G")


def test_non_text_action_is_a_clear_error():
    env = MazeEnv()
    env.reset(seed=0)
    with pytest.raises(TypeError, match="model's text"):
        env.step(3)


def test_lenient_parsing():
    assert parse_move("I will go Left now") == "left"
    assert parse_move("U") == "up" and parse_move("south") == "down" and parse_move("r") == "right"
    assert parse_move("nothing here") is None


def test_reset_is_deterministic_per_seed():
    a, b = MazeEnv(), MazeEnv()
    assert a.reset(seed=123)[0] == b.reset(seed=123)[0]
    assert a.reset(seed=124)[0] != b.reset(seed=123)[0]


def test_maze64_is_fixed_distinct_solvable_and_held_out():
    env = MazeEnv()
    tasks = env.eval_tasks(MAZE64_SEED, 64)
    keys = {t["maze"].key() for t in tasks}
    assert len(keys) == 64
    assert [t["maze"].key() for t in tasks] == [t["maze"].key() for t in env.eval_tasks(MAZE64_SEED, 64)]
    for t in tasks:
        path = shortest_path(t["maze"])
        assert path is not None and len(path) >= env.min_path
    # Training resets never produce a maze-64 task.
    for seed in range(2000):
        env.reset(seed=seed)
        assert env.maze.key() not in keys


def test_training_distribution_has_over_ten_thousand_distinct_mazes():
    rng = np.random.default_rng(0)
    env = MazeEnv()
    seen = {generate(rng, env.size, env.wall_density, env.min_path).key() for _ in range(12_000)}
    assert len(seen) > 10_000


def test_oracle_solves_every_generated_maze():
    for m in maze_set(1, 50, 5, 0.3, 3):
        env = MazeEnv()
        env.reset(options={"maze": m})
        for move in shortest_path(m):
            _, r, term, _, _ = env.step(move)
        assert term and r == 1.0


def test_registered_with_gymnasium():
    assert "tandem/maze-v0" in gym.registry
    assert isinstance(make_env("maze"), MazeEnv)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("nope")
