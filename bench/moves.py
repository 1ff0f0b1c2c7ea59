"""How a maze policy moves: of its greedy moves on the evaluation mazes, the share that bump
(the agent stays put: a wall, the edge, or no move at all) and the share that start a shortest
path, against what a uniformly random choice would bump in the very same states.

    python -m bench.moves --model builtin:vlm --env image-maze

A policy that reads the maze bumps far less often than chance (`bump_vs_random` well under 1);
one that does not see the walls bumps about as often as chance. docs/vision.md uses it on the
image maze's warm start.

Of the greedy moves right after a bump (`after_bump`), `repeat_after_bump` is the share that
repeat the bumped move although the environment has just said `wall <move>`: a policy that reads
its own history never does.

It also lists the mazes the greedy policy fails (`greedy_failures`: index in maze-64, shortest
path, the greedy moves with each bump starred), and with `--samples N` plays each of them N
times with the sampling policy (`--temperature`, the actors' 0.7 by default), which tells a
plateau's two causes apart: a maze the sampling policy sometimes solves gives GRPO a group with a
signal, one it never solves gives it nothing to learn from (`sampled_success` per failure, and
over all of them). Ends with one JSON line.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import tyro


@dataclass
class Args:
    model: str = "builtin:vlm"
    """The policy: a built-in name or a Hugging Face checkpoint directory."""
    adapter: str = ""
    """A run's saved adapter (<logdir>/adapter) to apply to --model ("": none)."""
    env: str = "image-maze"
    """"maze" or "image-maze"."""
    episodes: int = 64
    """Evaluation mazes (the first ones of maze-64)."""
    max_new_tokens: int = 8
    """Tokens per model turn."""
    samples: int = 0
    """Sampled plays of each maze the greedy policy fails (0: none)."""
    temperature: float = 0.7
    """Sampling temperature of those plays (the actors' default)."""


def counting(env, counts: Counter):
    """`env` with its step counting moves, bumps, shortest-path moves, the bumps a random move
    would make from the same cell, the moves right after a bump and those of them that repeat the
    bumped move (the environment has just said `wall <move>`). The episode's moves are kept in
    `env.played` as (move, bumped), `move` None for a reply that names none."""
    from envs.maze import MOVES, parse_move, shortest_path

    step, reset = env.step, env.reset
    env.played = []

    def counted(action):
        before, move = env.pos, parse_move(action)
        best = (shortest_path(env.maze, env.pos) or [None])[0]
        out = step(action)
        bumped = env.pos == before
        counts["moves"] += 1
        counts["bumps"] += int(bumped)
        counts["shortest"] += int(move == best)
        blocked = sum(not env.maze.open(before[0] + dr, before[1] + dc) for dr, dc in MOVES.values())
        counts["random_bumps"] += blocked / len(MOVES)
        if env.played and env.played[-1][1]:
            counts["after_bump"] += 1
            counts["repeats"] += int(move is not None and move == env.played[-1][0])
        env.played.append((move, bumped))
        return out

    def restarted(*args, **kwargs):
        env.played = []
        return reset(*args, **kwargs)

    env.step, env.reset = counted, restarted
    return env


def play_line(env) -> str:
    """The moves of `env`'s episode as one line, a bump starred: `right right* down`."""
    return " ".join(f"{move or '?'}{'*' if bumped else ''}" for move, bumped in env.played)


def recorded(make, envs: list):
    """`make` (an environment factory) keeping every environment it makes in `envs`, in order:
    `actors.rollout.evaluate` makes one an episode, in the order of its tasks."""

    def made():
        envs.append(make())
        return envs[-1]

    return made


def solved(env) -> bool:
    """Whether the maze episode `env` played ended on the goal."""
    return env.pos == env.maze.goal


def measure(args: Args) -> dict:
    import torch

    from actors.rollout import evaluate
    from actors.torch_engine import TorchEngine
    from envs import make_env
    from envs.maze import MAZE64_SEED, shortest_path
    from policy.adapter import read_adapter
    from policy.load import LoraSpec, load_chat, resolve_model

    if args.samples < 0 or args.temperature <= 0:
        raise ValueError(f"bench.moves: --samples ≥ 0 and --temperature > 0, got {args.samples} and {args.temperature}")
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    counts: Counter = Counter()
    adapter = read_adapter(args.adapter) if args.adapter else None
    engine = TorchEngine(path, adapter.lora_spec() if adapter else LoraSpec(rank=1))  # rank 1: the identity
    tasks = make_env(args.env).eval_tasks(MAZE64_SEED, args.episodes)
    greedy: list = []
    sampled: list = []
    try:
        if adapter is not None:
            engine.load_adapter(adapter.version, adapter.tensors)
        chat = load_chat(path)
        result = evaluate(engine, chat, recorded(lambda: counting(make_env(args.env), counts), greedy),
                          tasks, args.max_new_tokens, 2048)
        failed = [i for i, env in enumerate(greedy) if not solved(env)]
        if failed and args.samples:
            evaluate(engine, chat, recorded(lambda: make_env(args.env), sampled), [tasks[i] for i in failed],
                     args.max_new_tokens, 2048, temperature=args.temperature, samples=args.samples)
    finally:
        engine.close()
    failures = []
    for k, i in enumerate(failed):
        failure = {"maze": i, "shortest": len(shortest_path(greedy[i].maze)), "greedy_play": play_line(greedy[i])}
        if sampled:
            plays = sampled[k * args.samples:(k + 1) * args.samples]
            failure["sampled_success"] = sum(map(solved, plays)) / args.samples
        failures.append(failure)
    moves = max(counts["moves"], 1)
    bump, random_bump = counts["bumps"] / moves, counts["random_bumps"] / moves
    return {"model": args.model, "adapter": args.adapter, "env": args.env, "episodes": args.episodes, "success": result["success_rate"],
            "moves": counts["moves"], "bump_rate": round(bump, 4), "shortest_rate": round(counts["shortest"] / moves, 4),
            "random_bump_rate": round(random_bump, 4), "bump_vs_random": round(bump / max(random_bump, 1e-9), 4),
            "after_bump": counts["after_bump"], "repeat_after_bump": round(counts["repeats"] / max(counts["after_bump"], 1), 4),
            "greedy_failures": failures, "samples": args.samples, "temperature": args.temperature,
            "sampled_success": (round(sum(map(solved, sampled)) / len(sampled), 4) if sampled else None)}


def main() -> None:
    print(json.dumps(measure(tyro.cli(Args))))


if __name__ == "__main__":
    main()
