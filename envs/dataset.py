"""A dataset and a reward function, no environment class: `--env dataset --dataset.path
prompts.jsonl --dataset.reward mymodule:score` (TRL's `reward_funcs`, verl's custom reward).

Each row of a local JSONL or Parquet file is a task: `prompt` (a string, or a list of chat
messages) and any other columns (`answer`, ...), which the reward function reads. The function
is `score(completion: str, row: dict) -> float` (a `turn` keyword, 1 for the first answer, is
passed when it takes one):

- single-turn (`max_turns` 1, the default): the model answers once; the number is the reward.
- multi-turn with a verifier (`max_turns` > 1): the function returns a number to end the
  episode with that reward, or `(reward, feedback)` to give that turn's reward and send the
  feedback text as the next user message (another try), until `max_turns` answers (then the
  episode is truncated). Rewards of an episode's turns add up.

A reward function that raises, or returns anything but a finite number (or such a pair), ends
that episode as an environment error (finish reason `env_error`, counted in TensorBoard as
`rollout/env_errors`, kept out of the gradient); the run goes on. The evaluation set is
`min(64, rows // 5)` rows held out of the file, or `eval_path` (envs/rows.py).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from types import MappingProxyType
from typing import Any, Callable

from envs.base import TextEnv
from envs.rows import Split, load_rows

DATASET_EVAL_SEED = 70070


class RewardError(RuntimeError):
    """The reward function raised or returned something that is not a reward."""


def load_reward(spec: str) -> Callable:
    """The function `module:name` names; ValueError saying what is wrong."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--dataset.reward {spec!r}: give module:function, e.g. mymodule:score")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--dataset.reward {spec!r}: cannot import {name} from {module} ({exc})") from None
    if not callable(fn):
        raise ValueError(f"--dataset.reward {spec!r} is not a function")
    return fn


def _takes_turn(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "turn" or p.kind is p.VAR_KEYWORD for p in params)


def _reward(value: Any) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"returned {value!r:.200}, not a finite number")


class DatasetEnv(TextEnv):
    """Rows of a file as tasks, scored by a reward function (see the module docstring).

    `reset(seed=s)` plays a training row drawn from `s`; `options={"row": i}` plays row i.
    """

    eval_seed = DATASET_EVAL_SEED

    def __init__(self, path: str, reward: str, eval_path: str = "", max_turns: int = 1, system: str = "") -> None:
        super().__init__()
        if max_turns < 1:
            raise ValueError(f"--dataset.max-turns must be at least 1, got {max_turns}")
        self.rows = load_rows(path, "--dataset.path")
        self.split = Split(self.rows, load_rows(eval_path, "--dataset.eval-path") if eval_path else None,
                           DATASET_EVAL_SEED)
        self.reward_name, self.fn = reward, load_reward(reward)
        self.turn_kw = _takes_turn(self.fn)
        self.max_turns, self.system = max_turns, system
        self.row: MappingProxyType | None = None

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """See `envs.rows.Split.eval_tasks`."""
        return self.split.eval_tasks(seed, n)

    def _reset(self, options: dict[str, Any]) -> tuple[list, dict[str, Any]]:
        self.index, row = self.split.row(options, self.np_random)
        self.row, self.turn = MappingProxyType(row), 0  # read-only: a reward cannot change the task
        prompt = row["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + prompt, {"row": self.index}

    def _step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row is None:
            raise RuntimeError("call reset() before step()")
        self.turn += 1
        where = f"--dataset.reward {self.reward_name} on row {self.index}"
        try:
            value = self.fn(text, self.row, turn=self.turn) if self.turn_kw else self.fn(text, self.row)
        except Exception as exc:
            raise RewardError(f"{where} raised {exc!r:.300}") from exc
        feedback = None
        if self.max_turns > 1 and isinstance(value, tuple) and len(value) == 2:
            value, feedback = value
            if feedback is not None and not isinstance(feedback, str):
                raise RewardError(f"{where}: feedback must be a str or None, got {feedback!r:.200}")
        try:
            reward = _reward(value)
        except TypeError as exc:
            raise RewardError(f"{where} {exc}") from None
        info = {"row": self.index, "turn": self.turn}
        if feedback is None:
            return "", reward, True, False, info
        return feedback, reward, False, self.turn >= self.max_turns, info
