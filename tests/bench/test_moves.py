"""bench.moves counts what a maze policy's moves do, checked on moves played by hand."""

from collections import Counter

from bench.moves import Args, counting, measure
from envs import make_env
from envs.maze import MOVES, shortest_path


def test_every_bump_and_shortest_move_is_counted_against_chance_in_the_same_cell():
    counts = Counter()
    env = counting(make_env("maze"), counts)
    env.reset(seed=3)
    expected = Counter()
    for _ in range(4):
        r, c = env.pos
        blocked = [m for m, (dr, dc) in MOVES.items() if not env.maze.open(r + dr, c + dc)]
        best = shortest_path(env.maze, env.pos)[0]
        move = blocked[0] if blocked and not expected["bumps"] else best
        expected.update(moves=1, bumps=int(move in blocked), shortest=int(move == best))
        expected["random_bumps"] += len(blocked) / 4
        _, _, terminated, truncated, _ = env.step(move)
        if terminated or truncated:
            break
    assert expected["bumps"] == 1, "the maze at seed 3 gives no wall to bump into"
    assert counts == expected


def test_the_bench_reports_a_policys_moves_on_the_image_maze(tiny_vlm):
    figures = measure(Args(model=tiny_vlm, env="image-maze", episodes=2, max_new_tokens=4))
    assert figures["moves"] > 0 and 0 <= figures["bump_rate"] <= 1 and 0 <= figures["shortest_rate"] <= 1
    assert 0 < figures["random_bump_rate"] < 1 and figures["bump_vs_random"] >= 0
