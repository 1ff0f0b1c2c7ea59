"""`python -m launch.eval <run dir or adapter dir> [--episodes 64] [--seed S]`

Success rate of a saved adapter, scored as the run that trained it scored it: the run's
config.json (beside the adapter: `<run>/adapter` and `<run>/config.json`) gives the engine, its
dtype and device, the token limits, the environment and its settings (`--maze.size`, ...), the
chat-template options and the evaluation set's size; only the flags given here change it. An
adapter without a run directory is scored with the default config. Greedy by default; with
--temperature T > 0 the sampling policy plays each task --samples times, and the rate is over all
those episodes. The base model is the one the adapter was trained on (recorded in its
adapter_config.json) unless --model says otherwise; the engine is built with the adapter's own
LoRA spec (rank, alpha and target modules, from the same file).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Annotated

import tyro


@dataclass
class EvalArgs:
    adapter: Annotated[str, tyro.conf.Positional]
    """A run directory, a saved adapter (the run's <logdir>/adapter), or "none" for the base model."""
    config: str | None = None
    """The config to score with (default: the run's config.json beside the adapter, else the defaults)."""
    env: str | None = None
    """Environment (default: the run's; another one is scored with that environment's default settings)."""
    episodes: int | None = None
    """Number of evaluation tasks (default: the run's --eval-episodes)."""
    seed: int | None = None
    """Seed of the task set (default: the environment's evaluation seed, i.e. maze-64)."""
    model: str | None = None
    """Base model (default: the one recorded in the adapter)."""
    temperature: float = 0.0
    """0: greedy. Above 0: the sampling policy at this temperature."""
    samples: int = 1
    """Episodes per task (above 1 only with --temperature above 0)."""


def run_config(args: EvalArgs, base_model: str | None):
    """The Config the adapter is scored with: the run's config.json (or --config) with --env and
    --model applied, or the defaults when the adapter has no run directory; SystemExit for a
    config.json that cannot be read."""
    import dataclasses

    from launch.config import Config

    path = args.config
    if path is None and args.adapter != "none":
        here = os.path.abspath(args.adapter)
        for candidate in (os.path.join(here, "config.json"), os.path.join(os.path.dirname(here), "config.json")):
            if os.path.isfile(candidate):
                path = candidate
                break
    model = args.model or base_model
    if path is None:
        return Config(env=args.env or "maze", learners=1, model=model or "auto"), None
    try:
        with open(path) as f:
            cfg = Config.from_json(f.read())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: the run's config {path}: {exc}") from None
    changes = {"logdir": None, "resume": None}
    if args.env and args.env != cfg.env:  # another environment: its own section's defaults
        changes.update(env=args.env, model="auto")
    if model:
        changes["model"] = model
    try:
        return dataclasses.replace(cfg, **changes), path
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def adapter_dir(path: str) -> str:
    """The adapter of a run directory (`<run>/adapter`), or `path` itself."""
    inner = os.path.join(path, "adapter")
    return inner if os.path.isfile(os.path.join(inner, "adapter_config.json")) else path


def main(args: EvalArgs) -> dict:
    from launch.monitor import Evaluator
    from launch.parts import resolve_policy
    from policy.adapter import read_adapter

    adapter = None
    if args.adapter != "none":
        try:
            adapter = read_adapter(adapter_dir(args.adapter))
            lora = adapter.lora_spec()
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
    cfg, source = run_config(args, adapter.base_model if adapter else None)
    import torch

    torch.set_num_threads(1)  # as the run's driver evaluates: the same sums in the same order
    if adapter is not None:
        cfg.learner.lora = lora
    model_path = resolve_policy(cfg)
    episodes = args.episodes or cfg.eval_episodes
    ev = None
    try:
        try:
            ev = Evaluator(cfg, model_path, seed=args.seed, episodes=episodes)
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
    print(f"{episodes} tasks of {cfg.env} (seed {args.seed if args.seed is not None else 'eval'}; config "
          f"{source or 'defaults'}), {result['episodes']} episodes: {how} success {result['success_rate']:.1%}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(EvalArgs, prog="python -m launch.eval"))
    sys.exit(0)
