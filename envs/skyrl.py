"""Run any skyrl-gym environment unchanged: `--env skyrl:<id> --skyrl.tasks <file>`.

skyrl-gym environments speak chat messages as we do, with a different lifecycle:
one environment object per episode, built as `skyrl_gym.make(id, env_config=...,
extras=row)` from a dataset row, opened with `init(prompt) -> (messages, info)`
and stepped with `step(text) -> {"observations", "reward", "done", "metadata"}`.
This adapter is a `TextEnv` that does exactly that for each reset, so our
actors, evaluation and failure isolation treat it like any built-in task.

Tasks are rows of a local JSONL or Parquet file in SkyRL's dataset format:
`prompt` (a list of chat messages, or a string), optional `env_class`, and the
rest (`reward_spec`, `extra_info`, ...) passed to the environment as `extras`.
The evaluation set is fixed: 64 rows (at most a fifth of the file) drawn with
the evaluation seed are held out, and training resets never draw them;
`eval_file` points at a separate file instead.

skyrl-gym is an optional extra (`pip install -e '.[skyrl]'`); Parquet needs pyarrow.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import TextEnv

SKYRL_EVAL_SEED = 90090


@functools.lru_cache(maxsize=8)
def load_tasks(path: str) -> tuple[dict, ...]:
    """Rows of a JSONL or Parquet task file (cached per process)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"skyrl task file {path!r} not found: give --skyrl.tasks a JSONL or Parquet file")
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading Parquet needs pyarrow: pip install -e '.[skyrl]'") from None
        rows = pq.read_table(file).to_pylist()
    else:
        rows = []
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg})") from None
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{path}: row {n} has no 'prompt' (SkyRL rows carry prompt, reward_spec, ...)")
    if not rows:
        raise ValueError(f"{path}: no tasks")
    return tuple(rows)


def _held_out(n_rows: int) -> int:
    return min(64, n_rows // 5)


class SkyrlEnv(TextEnv):
    """A skyrl-gym environment as a `TextEnv`.

    `reset(seed=s)` plays a training row drawn from `s`; `options={"row": i}` plays row i.
    """

    eval_seed = SKYRL_EVAL_SEED

    def __init__(self, name: str, tasks: str, eval_file: str = "", env_config: str = "{}") -> None:
        super().__init__()
        try:
            import skyrl_gym
        except ImportError:
            raise ImportError("skyrl-gym environments need the skyrl extra: pip install -e '.[skyrl]'") from None
        if name not in skyrl_gym.registry:
            raise ValueError(f"unknown skyrl-gym environment {name!r}; registered: {sorted(skyrl_gym.registry)}")
        self.name, self.tasks_path, self.eval_path = name, tasks, eval_file
        self.rows = load_tasks(tasks)
        self.eval_rows = load_tasks(eval_file) if eval_file else self.rows
        self.config = json.loads(env_config) if isinstance(env_config, str) else dict(env_config)
        order = np.random.default_rng(SKYRL_EVAL_SEED).permutation(len(self.rows))
        held = set() if eval_file else {int(i) for i in order[: _held_out(len(self.rows))]}
        self.train_rows = [i for i in range(len(self.rows)) if i not in held]
        self.env = None

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """With `eval_file`: n rows of it drawn with `seed`. Otherwise, at the evaluation seed,
        the held-out rows (at most 64); at any other seed, n rows of the task file."""
        if self.eval_path:
            order = np.random.default_rng(seed).permutation(len(self.eval_rows))[:n]
            return [{"row": int(i), "eval": True} for i in order]
        order = np.random.default_rng(seed).permutation(len(self.rows))
        if seed == SKYRL_EVAL_SEED:
            order = order[: _held_out(len(self.rows))]
        return [{"row": int(i)} for i in order[:n]]

    def _reset(self, options: dict[str, Any]) -> tuple[list | str, dict[str, Any]]:
        import skyrl_gym
        from omegaconf import OmegaConf

        self.close()
        rows = self.eval_rows if options.get("eval") else self.rows
        if "row" in options:
            index = int(options["row"])
        else:
            index = self.train_rows[int(self.np_random.integers(len(self.train_rows)))]
        row = rows[index]
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        self.env = skyrl_gym.make(self.name, env_config=OmegaConf.create(self.config), extras=extras)
        prompt = row["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages, info = self.env.init(prompt)
        return list(messages), {"row": index, **(info or {})}

    def _step(self, text: str) -> tuple[list, float, bool, bool, dict[str, Any]]:
        if self.env is None:
            raise RuntimeError("call reset() before step()")
        out = self.env.step(text)
        return list(out.get("observations") or []), float(out["reward"]), bool(out["done"]), False, \
            dict(out.get("metadata") or {})

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
