"""The environments' sections of the root config (`--maze.*`, `--sql.*`, `--dataset.*`, ...).

Each section holds one environment's constructor arguments (`kwargs()`) and checks its own
values; `Config.env_kwargs` picks the section of `--env`.
"""

from __future__ import annotations

from dataclasses import dataclass


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
class ImageMazeConfig(MazeConfig):
    """The image maze (used when --env image-maze): the maze shown as a picture every turn, the
    text saying only the rules and what the last move did."""

    hints: bool = False
    """Add the text maze's goal / open / new lines to the text (for experiments; off: the
    picture alone shows the state)."""
    blank: bool = False
    """The control: every picture is the same grey image, so only the text can be learned from."""

    def kwargs(self) -> dict:
        return {**super().kwargs(), "hints": self.hints, "blank": self.blank}


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
    tool_calls: bool = False
    """Declare a run_query tool that the model calls in its chat template's format (Qwen's
    <tool_call>, Llama 3.1's JSON) instead of writing `query: <SQL>` (docs/tools.md)."""

    def kwargs(self) -> dict:
        return {"max_turns": self.max_turns, "time_limit_s": self.time_limit_s, "max_rows": self.max_rows,
                "tool_calls": self.tool_calls}


@dataclass
class CalculatorConfig:
    """Tool use (used when --env calculator): word problems with a calculator tool."""

    max_turns: int = 4
    """Turns (calculator calls and the answer) per episode."""
    max_chars: int = 200
    """Longest expression the calculator accepts."""
    time_limit_s: float = 0.1
    """Time limit of one calculation."""
    tool_calls: bool = False
    """Declare a calculate tool that the model calls in its chat template's format (Qwen's
    <tool_call>, Llama 3.1's JSON) instead of writing `calc: <expression>` (docs/tools.md)."""

    def kwargs(self) -> dict:
        return {"max_turns": self.max_turns, "max_chars": self.max_chars, "time_limit_s": self.time_limit_s,
                "tool_calls": self.tool_calls}


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
class DatasetConfig:
    """A dataset and a reward function (used when --env dataset): each row of --dataset.path is a
    task, scored by --dataset.reward (envs/dataset.py, docs/datasets.md)."""

    path: str = ""
    """Task rows: a local JSONL or Parquet file, each row a `prompt` (a string or chat messages)
    and the columns the reward reads (required)."""
    reward: str = ""
    """The reward function, module:function, called as fn(completion, row) -> float (required;
    the module is imported from the launch directory)."""
    eval_path: str = ""
    """Evaluation rows (default: min(64, rows // 5) rows held out of --dataset.path)."""
    max_turns: int = 1
    """Answers per episode: 1 is single-turn; above 1 the reward function may return
    (reward, feedback) to send feedback and ask again."""
    system: str = ""
    """A system message put before every prompt (empty: none)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"--dataset.max-turns must be at least 1, got {self.max_turns}")

    def check(self) -> None:
        """ValueError, before any part starts, for a missing file or a reward that does not import."""
        import os

        from envs.dataset import load_reward

        if not self.path or not self.reward:
            raise ValueError("--env dataset needs --dataset.path (a JSONL or Parquet file of prompts) and "
                             "--dataset.reward (module:function)")
        for flag, path in (("--dataset.path", self.path), ("--dataset.eval-path", self.eval_path)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file")
        load_reward(self.reward)

    def kwargs(self) -> dict:
        return {"path": self.path, "reward": self.reward, "eval_path": self.eval_path, "max_turns": self.max_turns,
                "system": self.system}


@dataclass
class CodeConfig:
    """Coding agent (used when --env code): fix a bug in a generated Python package with shell
    commands, each run in a fresh bubblewrap sandbox (docs/sandbox.md)."""

    max_turns: int = 8
    """Turns (commands and the submission) per episode; the last is graded as it stands."""
    command_s: float = 10.0
    """Wall-clock limit of one command."""
    grade_s: float = 15.0
    """Wall-clock limit of grading (the hidden tests in a fresh sandbox)."""
    episode_s: float = 120.0
    """Sandbox time of all an episode's commands; past it the episode is graded as it stands."""
    memory_mb: int = 1024
    """Resident memory of a command's whole process tree."""
    output_chars: int = 2000
    """Output of a command shown (its first and last halves)."""
    functions: int = 1
    """Difficulty: functions in a generated package."""
    files: int = 1
    """Difficulty: modules they are spread over."""
    bugs: int = 1
    """Difficulty: functions with a bug (in different modules where there are enough)."""
    hidden_counterexample: bool = False
    """Difficulty: the visible test passes, so only the statement points at the bug."""
    sandbox_root: str = ""
    """Folder of the episodes' work folders (default: $TMPDIR/tandem-sandbox-<uid>)."""
    tasks: str = ""
    """SWE-bench / SWE-Gym rows (JSONL or Parquet) instead of generated tasks (docs/sandbox.md)."""
    repos: str = ""
    """With --code.tasks: the folder of checkouts, one per row, named by instance_id."""
    rootfs: str = ""
    """A root filesystem (an exported image) the commands run in instead of the host's /usr."""
    ro_binds: tuple[str, ...] = ()
    """Host folders made visible read-only at the same paths (e.g. a Python environment)."""
    python: str = "python3"
    """With --code.tasks: the command that runs the environment's Python (pytest is run with it)."""

    def __post_init__(self) -> None:
        from envs.codetasks import Knobs

        self.ro_binds = tuple(self.ro_binds)  # a list when read back from config.json
        try:
            Knobs(self.functions, self.files, self.bugs, self.hidden_counterexample)
        except ValueError as exc:
            raise ValueError(f"--code.functions/files/bugs: {exc}") from None

    def kwargs(self) -> dict:
        return {"max_turns": self.max_turns, "command_s": self.command_s, "grade_s": self.grade_s,
                "episode_s": self.episode_s, "memory_mb": self.memory_mb, "output_chars": self.output_chars,
                "functions": self.functions, "files": self.files, "bugs": self.bugs,
                "hidden_counterexample": self.hidden_counterexample, "sandbox_root": self.sandbox_root,
                "tasks": self.tasks, "repos": self.repos, "rootfs": self.rootfs, "ro_binds": self.ro_binds,
                "python": self.python}
