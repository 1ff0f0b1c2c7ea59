"""`python -m launch.plot <logdir> [--out curve.png]`: draw the training curve from TensorBoard events.

Reads the scalars the launcher wrote and plots the evaluation set's success (greedy) against
learner steps, with the rollout reward beside it; the labels name the run's environment and
parts, from the config.json it was started with.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated

import tyro


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under `logdir` as tag -> [(step, value)], sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


@dataclass
class PlotArgs:
    logdir: Annotated[str, tyro.conf.Positional]
    """A run's --logdir."""
    out: str = "curve.png"
    """Where to write the PNG."""


def _labels(logdir: str) -> tuple[str, str]:
    """(the evaluation set's name, the title) of the run in `logdir`."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(logdir) / "config.json").read_text())
    except (OSError, ValueError):
        return "evaluation", "Tandem: GRPO"
    env, n = cfg.get("env", "maze"), cfg.get("eval_episodes", 64)
    parts = (f"{cfg.get('learners', 1)} colocated learners" if cfg.get("colocate")
             else f"{cfg.get('actors', 1)} actors + {cfg.get('learners', 1)} learners")
    return f"{env}-{n}", f"Tandem: {cfg.get('algo', 'grpo').upper()} on {env}, {parts}"


def main(args: PlotArgs) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("launch.plot needs matplotlib: pip install 'tandem[plot]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(args.logdir)
    if "eval/success_rate" not in scalars:
        raise SystemExit(f"error: no eval/success_rate scalars under {args.logdir}")
    evaluation, title = _labels(args.logdir)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, success = zip(*scalars["eval/success_rate"])
    ax.plot(steps, [100 * s for s in success], "o-", label=f"{evaluation} success, greedy (%)")
    if "rollout/reward_mean" in scalars:
        rs, rv = zip(*scalars["rollout/reward_mean"])
        ax.plot(rs, [100 * v for v in rv], alpha=0.5, label="training reward, sampled (%)")
    ax.axhline(95, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(PlotArgs))
    sys.exit(0)
