"""Task rows from a local JSONL or Parquet file, and the evaluation rows held out of them.

Shared by the environments whose tasks are a dataset (`--env skyrl:<id>`, `--env dataset`): each
row is a JSON object with a `prompt` (a string, or a list of chat messages) and whatever else the
environment or its reward reads. The evaluation set is fixed: `held_out(n)` rows drawn with the
environment's evaluation seed, which training resets never draw; or a separate file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np


def read_table(file: Path) -> list:
    """The rows of a Parquet file (by its suffix) or a JSONL file, as they are; ValueError naming
    the line that is not JSON, ImportError when Parquet needs pyarrow."""
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from None
        return pq.read_table(file).to_pylist()
    rows = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{n}: not a JSON object ({exc.msg})") from None
    return rows


@functools.lru_cache(maxsize=8)
def load_rows(path: str, flag: str = "the task file") -> tuple[dict, ...]:
    """Rows of a JSONL or Parquet file (cached per process); `flag` names where the path came
    from in the errors."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task file {path!r} not found: give {flag} a JSONL or Parquet file")
    rows = read_table(file)
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{path}: row {n} has no 'prompt' (a string, or a list of chat messages)")
    if not rows:
        raise ValueError(f"{path}: no tasks")
    return tuple(rows)


def held_out(n_rows: int) -> int:
    """Rows held out of a file for evaluation: 64, at most a fifth of the file."""
    return min(64, n_rows // 5)


class Split:
    """Training and evaluation rows of a file (or of two files).

    Usage::

        split = Split(rows, eval_rows=None, eval_seed=90090)
        split.train[i]                      # indices of rows training may draw
        split.eval_tasks(seed, n)           # [{"row": i} or {"row": i, "eval": True}]
    """

    def __init__(self, rows: tuple[dict, ...], eval_rows: tuple[dict, ...] | None, eval_seed: int) -> None:
        self.rows, self.eval_rows, self.eval_seed = rows, eval_rows, eval_seed
        order = np.random.default_rng(eval_seed).permutation(len(rows))
        held = set() if eval_rows is not None else {int(i) for i in order[: held_out(len(rows))]}
        self.train = [i for i in range(len(rows)) if i not in held]

    def eval_tasks(self, seed: int, n: int) -> list[dict]:
        """With a separate evaluation file: n of its rows drawn with `seed`. Otherwise, at the
        evaluation seed, the held-out rows (at most 64); at any other seed, n rows of the file."""
        if self.eval_rows is not None:
            order = np.random.default_rng(seed).permutation(len(self.eval_rows))[:n]
            return [{"row": int(i), "eval": True} for i in order]
        order = np.random.default_rng(seed).permutation(len(self.rows))
        if seed == self.eval_seed:
            order = order[: held_out(len(self.rows))]
        return [{"row": int(i)} for i in order[:n]]

    def row(self, options: dict, rng: np.random.Generator) -> tuple[int, dict]:
        """(index, row) a reset plays: `options["row"]` (of the evaluation file with
        `options["eval"]`), else a training row drawn from `rng`."""
        rows = self.eval_rows if options.get("eval") and self.eval_rows is not None else self.rows
        if "row" in options:
            index = int(options["row"])
        else:
            index = self.train[int(rng.integers(len(self.train)))]
        return index, rows[index]
