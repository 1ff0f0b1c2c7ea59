"""bench.moves counts what a maze policy's moves do, checked on moves played by hand."""

from collections import Counter

import pytest

from bench.moves import Args, counting, measure, play_line, recorded, solved
from envs import make_env
from envs.maze import MOVES, shortest_path


def test_every_bump_and_shortest_move_is_counted_against_chance_in_the_same_cell():
    counts = Counter()
    env = counting(make_env("maze"), counts)
    env.reset(seed=3)
    expected, last, blocked_before = Counter(), None, []
    for _ in range(4):
        r, c = env.pos
        blocked = [m for m, (dr, dc) in MOVES.items() if not env.maze.open(r + dr, c + dc)]
        best = shortest_path(env.maze, env.pos)[0]
        move = blocked[0] if blocked and not expected["bumps"] else best
        expected.update(moves=1, bumps=int(move in blocked), shortest=int(move == best))
        if last in blocked_before:
            expected.update(after_bump=1, repeats=int(move == last))
        last, blocked_before = move, blocked
        expected["random_bumps"] += len(blocked) / 4
        _, _, terminated, truncated, _ = env.step(move)
        if terminated or truncated:
            break
    assert expected["bumps"] == 1, "the maze at seed 3 gives no wall to bump into"
    assert counts == expected


def test_a_move_right_after_a_bump_is_counted_and_so_is_a_repeat_of_the_bumped_move():
    counts = Counter()
    env = counting(make_env("maze"), counts)
    env.reset(seed=3)
    r, c = env.pos
    wall = next(m for m, (dr, dc) in MOVES.items() if not env.maze.open(r + dr, c + dc))
    best = shortest_path(env.maze, env.pos)[0]
    for move in (wall, wall, best):
        env.step(move)
    assert (counts["bumps"], counts["after_bump"], counts["repeats"]) == (2, 2, 1)
    assert play_line(env) == f"{wall}* {wall}* {best}"
    env.reset(seed=3)  # a new episode: nothing before its first move
    for reply in ("no move", "no move", best):
        env.step(reply)
    assert play_line(env) == f"?* ?* {best}"
    assert (counts["after_bump"], counts["repeats"]) == (4, 1), "a reply that names no move repeats nothing"


def test_the_bench_reports_a_policys_moves_on_the_image_maze(tiny_vlm):
    figures = measure(Args(model=tiny_vlm, env="image-maze", episodes=2, max_new_tokens=4))
    assert figures["moves"] > 0 and 0 <= figures["bump_rate"] <= 1 and 0 <= figures["shortest_rate"] <= 1
    assert 0 < figures["random_bump_rate"] < 1 and figures["bump_vs_random"] >= 0
    assert 0 <= figures["after_bump"] < figures["moves"] and 0 <= figures["repeat_after_bump"] <= 1


def test_each_maze_played_is_kept_in_order_and_solved_only_on_its_goal():
    envs = []
    make = recorded(lambda: make_env("image-maze"), envs)
    first, second = make(), make()
    assert envs == [first, second]
    first.reset(seed=3)
    second.reset(seed=3)
    for move in shortest_path(first.maze, first.pos):
        first.step(move)
    second.step(shortest_path(second.maze, second.pos)[0])  # one move of the way
    assert solved(first) and not solved(second)


def test_the_mazes_the_greedy_policy_fails_are_listed_with_how_often_sampling_solves_them(tiny_vlm):
    """An untrained policy: every maze it fails is listed once with its shortest path, and played
    `samples` times by the sampling policy."""
    figures = measure(Args(model=tiny_vlm, env="image-maze", episodes=3, max_new_tokens=4, samples=2, temperature=1.0))
    failures = figures["greedy_failures"]
    assert len(failures) == round((1 - figures["success"]) * 3) > 0
    assert sorted({f["maze"] for f in failures}) == [f["maze"] for f in failures]
    assert all(f["shortest"] >= 3 and f["sampled_success"] in (0.0, 0.5, 1.0) for f in failures)
    assert all(1 <= len(f["greedy_play"].split()) <= 12 for f in failures), failures
    assert figures["sampled_success"] == pytest.approx(sum(f["sampled_success"] for f in failures) / len(failures), abs=1e-4)


@pytest.mark.parametrize("samples, temperature", [(-1, 0.7), (4, 0.0)])
def test_sampled_plays_need_a_count_and_a_temperature_above_zero(samples, temperature):
    with pytest.raises(ValueError, match="--samples ≥ 0 and --temperature > 0"):
        measure(Args(model="builtin:no-such-model", samples=samples, temperature=temperature))
