"""How a maze policy moves: of its greedy moves on the evaluation mazes, the share that bump
(the agent stays put: a wall, the edge, or no move at all) and the share that start a shortest
path, against what a uniformly random choice would bump in the very same states.

    python -m bench.moves --model builtin:vlm --env image-maze

A policy that reads the maze bumps far less often than chance (`bump_vs_random` well under 1);
one that does not see the walls bumps about as often as chance. docs/vision.md uses it on the
image maze's warm start. Ends with one JSON line.
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


def counting(env, counts: Counter):
    """`env` with its step counting moves, bumps, shortest-path moves and the bumps a random move
    would make from the same cell."""
    from envs.maze import MOVES, parse_move, shortest_path

    step = env.step

    def counted(action):
        before = env.pos
        best = (shortest_path(env.maze, env.pos) or [None])[0]
        out = step(action)
        counts["moves"] += 1
        counts["bumps"] += int(env.pos == before)
        counts["shortest"] += int(parse_move(action) == best)
        blocked = sum(not env.maze.open(before[0] + dr, before[1] + dc) for dr, dc in MOVES.values())
        counts["random_bumps"] += blocked / len(MOVES)
        return out

    env.step = counted
    return env


def measure(args: Args) -> dict:
    import torch

    from actors.rollout import evaluate
    from actors.torch_engine import TorchEngine
    from envs import make_env
    from envs.maze import MAZE64_SEED
    from policy.adapter import read_adapter
    from policy.load import LoraSpec, load_chat, resolve_model

    torch.set_num_threads(1)
    path = resolve_model(args.model)
    counts: Counter = Counter()
    adapter = read_adapter(args.adapter) if args.adapter else None
    engine = TorchEngine(path, adapter.lora_spec() if adapter else LoraSpec(rank=1))  # rank 1: the identity
    try:
        if adapter is not None:
            engine.load_adapter(adapter.version, adapter.tensors)
        result = evaluate(engine, load_chat(path), lambda: counting(make_env(args.env), counts),
                          make_env(args.env).eval_tasks(MAZE64_SEED, args.episodes), args.max_new_tokens, 2048)
    finally:
        engine.close()
    moves = max(counts["moves"], 1)
    bump, random_bump = counts["bumps"] / moves, counts["random_bumps"] / moves
    return {"model": args.model, "adapter": args.adapter, "env": args.env, "episodes": args.episodes, "success": result["success_rate"],
            "moves": counts["moves"], "bump_rate": round(bump, 4), "shortest_rate": round(counts["shortest"] / moves, 4),
            "random_bump_rate": round(random_bump, 4), "bump_vs_random": round(bump / max(random_bump, 1e-9), 4)}


def main() -> None:
    print(json.dumps(measure(tyro.cli(Args))))


if __name__ == "__main__":
    main()
