"""The one root config, parsed by tyro: headline knobs on top, one dataclass per part.

`python -m launch.async --help` lists every field with the docstring under it.
Validation happens in `__post_init__`, with messages that say what to change.
This module imports nothing heavy, so `--help` answers at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.actor import ActorConfig
from learner.config import LearnerConfig
from replay.server import ReplayConfig


@dataclass
class MazeConfig:
    """The maze environment (used when --env maze)."""

    size: int = 4
    """Grid side in cells."""
    wall_density: float = 0.3
    """Probability that a cell is a wall."""
    min_path: int = 3
    """Shortest path length (moves) below which a maze is redrawn."""
    max_steps: int = 12
    """Moves allowed before the episode is truncated (reward 0)."""
    curriculum: str = ""
    """Maze sizes by policy version, e.g. "3@0,4@20,5@50" (size 3 from version 0, 4 from 20, ...);
    empty: always --maze.size. Evaluation uses --maze.size."""

    def __post_init__(self) -> None:
        from envs.maze import parse_curriculum

        try:
            parse_curriculum(self.curriculum)
        except ValueError as exc:
            raise ValueError(f"--maze.curriculum: {exc}") from None

    def kwargs(self) -> dict:
        return {"size": self.size, "wall_density": self.wall_density, "min_path": self.min_path,
                "max_steps": self.max_steps, "curriculum": self.curriculum}


@dataclass
class CountdownConfig:
    """Countdown (used when --env countdown): make the target from the numbers with + - * /."""

    n_numbers: int = 4
    """Numbers per puzzle (each used exactly once)."""
    max_number: int = 25
    """Numbers are drawn from 1 to this."""
    max_target: int = 999
    """Largest target."""
    max_attempts: int = 3
    """Answers allowed (each wrong one gets feedback)."""

    def kwargs(self) -> dict:
        return {"n_numbers": self.n_numbers, "max_number": self.max_number, "max_target": self.max_target,
                "max_attempts": self.max_attempts}


@dataclass
class SqlConfig:
    """Text-to-SQL (used when --env sql) on the built-in company database."""

    max_turns: int = 5
    """Turns (queries and the answer) per episode."""
    time_limit_s: float = 1.0
    """Time limit of one query."""
    max_rows: int = 10
    """Rows shown for an exploratory query."""

    def kwargs(self) -> dict:
        return {"max_turns": self.max_turns, "time_limit_s": self.time_limit_s, "max_rows": self.max_rows}


@dataclass
class CalculatorConfig:
    """Tool use (used when --env calculator): word problems with a calculator tool."""

    max_turns: int = 4
    """Turns (calculator calls and the answer) per episode."""
    max_chars: int = 200
    """Longest expression the calculator accepts."""
    time_limit_s: float = 0.1
    """Time limit of one calculation."""

    def kwargs(self) -> dict:
        return {"max_turns": self.max_turns, "max_chars": self.max_chars, "time_limit_s": self.time_limit_s}


@dataclass
class SkyrlConfig:
    """skyrl-gym environments (used when --env skyrl:<id>, e.g. skyrl:gsm8k)."""

    tasks: str = ""
    """Task rows in SkyRL's dataset format: a local JSONL or Parquet file (required)."""
    eval_file: str = ""
    """Evaluation rows (default: 64 rows held out of --skyrl.tasks)."""
    env_config: str = "{}"
    """The environment's env_config, as JSON."""

    def kwargs(self) -> dict:
        return {"tasks": self.tasks, "eval_file": self.eval_file, "env_config": self.env_config}


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
    steps: int = 250
    """Optimizer-step budget: the run ends after this many learner steps."""
    max_minutes: float = 28.0
    """Wall-clock budget of the whole run, warm start included (0 = none): when it is spent the
    learners finish the step they are in, the final adapter is saved and evaluated."""
    logdir: str | None = None
    """Where TensorBoard events and the final adapter go (default runs/<env>-<mode>-<time>)."""
    max_staleness: int = 1
    """Staleness bound η: no group trained on is more than η policy versions old (forced to 0 by --colocate)."""
    algo: str = "grpo"
    """Advantage estimator: "grpo" (group-normalised; --learner.no-normalize-std gives Dr.GRPO),
    "rloo" (leave-one-out baseline) or "ppo" (a critic with its own LoRA adapter, GAE)."""
    correction: str = "none"
    """Staleness / mismatch correction against the behaviour log-probs μ: "none" (PPO clipped
    around μ: the default; with one update a step, as the default run makes, π_old is π_θ detached
    and only "none" keeps a trust region), "tis" (token-level truncated IS, min(π_old/μ, C)),
    "seq-tis" (sequence-level), "geo-mask" (drop trajectories whose geometric-mean ratio is off),
    "decoupled" (AReaL's decoupled PPO)."""
    model: str = "auto"
    """Policy: "builtin:maze" (tiny model after the maze warm start, built locally on first use),
    "builtin:tiny" (untrained), a local Hugging Face checkpoint path, or a Hub id. "auto" is
    builtin:maze for --env maze and builtin:tiny for any other environment."""
    env: str = "maze"
    """Environment to train on: maze, countdown, sql, calculator, skyrl:<id> (a skyrl-gym
    environment, with --skyrl.tasks), or module:Class (a TextEnv of your own)."""
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
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    sql: SqlConfig = field(default_factory=SqlConfig)
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)
    skyrl: SkyrlConfig = field(default_factory=SkyrlConfig)

    def __post_init__(self) -> None:
        if self.actors < 1:
            raise ValueError(f"--actors must be at least 1, got {self.actors}")
        if self.learners < 1:
            raise ValueError(f"--learners must be at least 1, got {self.learners}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be 0 or more, got {self.max_staleness}")
        from learner.losses import ALGOS, CORRECTIONS

        if self.algo not in ALGOS:
            raise ValueError(f"unknown --algo {self.algo!r}; choose one of {', '.join(ALGOS)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown --correction {self.correction!r}; choose one of {', '.join(CORRECTIONS)}")
        self._check_env()
        if self.model == "auto":
            self.model = "builtin:maze" if self.env == "maze" else "builtin:tiny"
        if self.max_minutes < 0:
            raise ValueError(f"--max-minutes must be 0 (no limit) or positive, got {self.max_minutes}")
        if self.eval_every < 1 or self.eval_episodes < 1:
            raise ValueError("--eval-every and --eval-episodes must be at least 1")
        if 0 < self.actor.max_lora_rank < self.learner.lora.rank:
            raise ValueError(f"--actor.max-lora-rank ({self.actor.max_lora_rank}) is below --learner.lora.rank "
                             f"({self.learner.lora.rank}): the engine could not load the adapters")
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
            env = self.env.replace(":", "-").replace("/", "-")
            self.logdir = f"runs/{env}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        return self.logdir

    def _check_env(self) -> None:
        import json
        import os

        from envs import env_entry

        try:
            env_entry(self.env)
        except ValueError as exc:
            raise ValueError(f"--env: {exc}") from None
        if self.env.startswith("skyrl:"):
            if not self.skyrl.tasks:
                raise ValueError(f"--env {self.env} needs --skyrl.tasks: a JSONL or Parquet file of task rows")
            for flag, path in (("--skyrl.tasks", self.skyrl.tasks), ("--skyrl.eval-file", self.skyrl.eval_file)):
                if path and not os.path.isfile(path):
                    raise ValueError(f"{flag} {path!r}: no such file")
            try:
                json.loads(self.skyrl.env_config)
            except ValueError:
                raise ValueError(f"--skyrl.env-config must be JSON, got {self.skyrl.env_config!r}") from None

    def env_kwargs(self) -> dict:
        """Constructor arguments of --env from its section (--maze.*, --sql.*, ...)."""
        name = "skyrl" if self.env.startswith("skyrl:") else self.env
        section = {"maze": self.maze, "countdown": self.countdown, "sql": self.sql,
                   "calculator": self.calculator, "skyrl": self.skyrl}.get(name)
        return section.kwargs() if section is not None else {}
