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
The evaluation set is fixed: `min(64, rows // 5)` rows drawn with the evaluation
seed are held out, and training resets never draw them; `eval_file` points at a
separate file instead (envs/rows.py).

skyrl-gym is an optional extra (`pip install -e '.[skyrl]'`); Parquet needs pyarrow.
"""

from __future__ import annotations

import json
from typing import Any

from envs.base import TextEnv
from envs.rows import Split, load_rows

SKYRL_EVAL_SEED = 90090


def load_tasks(path: str) -> tuple[dict, ...]:
    """Rows of a JSONL or Parquet task file in SkyRL's format (cached per process)."""
    return load_rows(path, "--skyrl.tasks")


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
        self.split = Split(self.rows, self.eval_rows if eval_file else None, SKYRL_EVAL_SEED)
        self.train_rows = self.split.train
        self.env = None

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """See `envs.rows.Split.eval_tasks`."""
        return self.split.eval_tasks(seed, n)

    def _reset(self, options: dict[str, Any]) -> tuple[list | str, dict[str, Any]]:
        import skyrl_gym
        from omegaconf import OmegaConf

        self.close()
        index, row = self.split.row(options, self.np_random)
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
