"""`python -m launch.eval <adapter dir> --env maze --episodes 64 --seed S`

Greedy success rate of a saved adapter on `episodes` tasks generated from seed
S (S = the environment's evaluation seed, 64064 for the maze, gives maze-64).
With --temperature T > 0 the sampling policy plays each task --samples times
instead, and the rate is over all those episodes.
The base model is the one the adapter was trained on (recorded in its
adapter_config.json) unless --model says otherwise; the engine is built with
the adapter's own LoRA spec (rank, alpha and target modules, from the same file).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated

import tyro


@dataclass
class EvalArgs:
    adapter: Annotated[str, tyro.conf.Positional]
    """Directory of a saved adapter (the run's <logdir>/adapter), or "none" for the base model."""
    env: str = "maze"
    """Environment."""
    episodes: int = 64
    """Number of evaluation tasks."""
    seed: int | None = None
    """Seed of the task set (default: the environment's evaluation seed, i.e. maze-64)."""
    model: str | None = None
    """Base model (default: the one recorded in the adapter)."""
    temperature: float = 0.0
    """0: greedy. Above 0: the sampling policy at this temperature."""
    samples: int = 1
    """Episodes per task (above 1 only with --temperature above 0)."""


def main(args: EvalArgs) -> dict:
    from launch.config import Config
    from launch.monitor import Evaluator
    from launch.parts import resolve_policy
    from policy.adapter import read_adapter

    adapter = None
    if args.adapter != "none":
        try:
            adapter = read_adapter(args.adapter)
            lora = adapter.lora_spec()
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
    cfg = Config(env=args.env, learners=1, model=args.model or (adapter.base_model if adapter else "auto"))
    if adapter is not None:
        cfg.learner.lora = lora
    model_path = resolve_policy(cfg)
    ev = None
    try:
        try:
            ev = Evaluator(cfg, model_path, seed=args.seed, episodes=args.episodes)
            if adapter is not None:
                ev.load(adapter.version, adapter.tensors)
        except ValueError as exc:
            if adapter is None:
                raise
            # The engine builds its LoRA layers from the adapter's spec: a module the model lacks
            # fails there (PEFT's message), a tensor that does not fit in `load`.
            raise SystemExit(f"error: the adapter in {adapter.path} (LoRA {lora.to_dict()}) cannot be applied "
                             f"to {model_path}: {exc}") from None
        try:
            result = ev.evaluate(args.temperature, args.samples)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    finally:
        if ev is not None:
            ev.close()
    how = f"sampled at temperature {args.temperature}, {args.samples} a task" if args.temperature else "greedy"
    print(f"{args.episodes} tasks of {args.env} (seed {args.seed if args.seed is not None else 'eval'}), "
          f"{result['episodes']} episodes: {how} success {result['success_rate']:.1%}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(EvalArgs))
    sys.exit(0)
