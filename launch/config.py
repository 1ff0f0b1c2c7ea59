"""The one root config, parsed by tyro: headline knobs on top, one dataclass per part.

`python -m launch.async --help` lists every field with the docstring under it.
Validation happens in `__post_init__`, with messages that say what to change.
This module imports nothing heavy, so `--help` answers at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.actor import ActorConfig
from learner.trainer import LearnerConfig
from replay.server import ReplayConfig

KNOWN_ENVS = ("maze",)


@dataclass
class MazeConfig:
    """The maze environment (used when --env maze)."""

    size: int = 5
    """Grid side in cells."""
    wall_density: float = 0.3
    """Probability that a cell is a wall."""
    min_path: int = 3
    """Shortest path length (moves) below which a maze is redrawn."""
    max_steps: int = 12
    """Moves allowed before the episode is truncated (reward 0)."""

    def kwargs(self) -> dict:
        return {"size": self.size, "wall_density": self.wall_density, "min_path": self.min_path,
                "max_steps": self.max_steps}


@dataclass
class Config:
    """Tandem: asynchronous actor–learner RL for language-model agents."""

    actors: int = 6
    """Actor processes (each owns an inference engine and a batch of environments)."""
    learners: int = 2
    """Learner processes: FSDP ranks (gloo on CPU, NCCL on GPU)."""
    colocate: bool = False
    """Synchronous on-policy mode: generation and training share the devices and take turns
    (generate a batch with the current weights, train on it, push the adapter, repeat)."""
    steps: int = 150
    """Optimizer-step budget: the run ends after this many learner steps."""
    max_minutes: float = 28.0
    """Wall-clock budget of the whole run, warm start included (0 = none): when it is spent the
    learners finish the step they are in, the final adapter is saved and evaluated."""
    logdir: str | None = None
    """Where TensorBoard events and the final adapter go (default runs/<env>-<mode>-<time>)."""
    max_staleness: int = 1
    """Staleness bound η: no group trained on is more than η policy versions old (forced to 0 by --colocate)."""
    model: str = "builtin:maze"
    """Policy: "builtin:maze" (tiny model after the maze warm start, built locally on first use),
    "builtin:tiny" (untrained), a local Hugging Face checkpoint path, or a Hub id."""
    env: str = "maze"
    """Environment to train on."""
    seed: int = 0
    """Seed for task sampling, the engines' samplers and adapter initialisation."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. "auto"); default: start a local Ray instance."""
    eval_every: int = 10
    """Evaluate greedily on the fixed evaluation set every this many policy versions."""
    eval_episodes: int = 64
    """Size of the evaluation set (64 gives maze-64)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    maze: MazeConfig = field(default_factory=MazeConfig)

    def __post_init__(self) -> None:
        if self.actors < 1:
            raise ValueError(f"--actors must be at least 1, got {self.actors}")
        if self.learners < 1:
            raise ValueError(f"--learners must be at least 1, got {self.learners}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be 0 or more, got {self.max_staleness}")
        if self.env not in KNOWN_ENVS:
            raise ValueError(f"unknown --env {self.env!r}; choose one of {', '.join(KNOWN_ENVS)}")
        if self.max_minutes < 0:
            raise ValueError(f"--max-minutes must be 0 (no limit) or positive, got {self.max_minutes}")
        if self.eval_every < 1 or self.eval_episodes < 1:
            raise ValueError("--eval-every and --eval-episodes must be at least 1")
        if self.learner.groups_per_step % self.learners:
            raise ValueError(
                f"--learner.groups-per-step ({self.learner.groups_per_step}) must be a multiple of "
                f"--learners ({self.learners}): each rank trains on an equal shard of every batch")

    @property
    def staleness_bound(self) -> int:
        """η actually enforced: 0 in colocated mode, which is strictly on-policy."""
        return 0 if self.colocate else self.max_staleness

    @property
    def run_dir(self) -> str:
        if self.logdir is None:  # fixed once, on first use
            mode = "colocate" if self.colocate else "async"
            self.logdir = f"runs/{self.env}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        return self.logdir

    def env_kwargs(self) -> dict:
        return self.maze.kwargs() if self.env == "maze" else {}
