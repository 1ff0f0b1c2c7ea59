"""Countdown: reach a target number from given numbers with + - * / (TinyZero's task, multi-turn).

Design decisions:
- A puzzle is `n_numbers` numbers from 1..`max_number` and a target that is
  reachable by construction: the numbers are combined pairwise in random order
  with random operations whose results stay positive whole numbers, until one
  value is left. Targets equal to one of the numbers are redrawn (no free wins).
  With 4 numbers up to 25 there are hundreds of thousands of distinct puzzles.
- The model answers with an expression that uses every number exactly once. It
  is checked exactly (`envs.arith`: Fractions, no `eval`), so 8 / 3 * 3 = 8.
- Multi-turn: a wrong answer gets feedback (its value, or which numbers it
  misused, or why it could not be read) and another attempt, up to
  `max_attempts`. Reward 1.0 for a correct answer, else 0.
- countdown-64 is 64 distinct puzzles from `COUNTDOWN64_SEED`; training resets
  never produce one of them.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.arith import ArithmeticRefused, Limits, evaluate, format_number
from envs.base import TextEnv, distinct_tasks

COUNTDOWN64_SEED = 24024
_INTEGER = re.compile(r"\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer\s*[:=]?", re.IGNORECASE)


@dataclass(frozen=True)
class Puzzle:
    numbers: tuple[int, ...]
    target: int

    def key(self) -> str:
        return f"{sorted(self.numbers)}->{self.target}"


def make_puzzle(rng: np.random.Generator, n_numbers: int, max_number: int, max_target: int) -> Puzzle:
    """A puzzle whose target some expression over all the numbers reaches."""
    while True:
        numbers = [int(x) for x in rng.integers(1, max_number + 1, size=n_numbers)]
        values = list(numbers)
        while len(values) > 1:
            i, j = rng.choice(len(values), size=2, replace=False)
            a, b = values[i], values[j]
            options = [a + b, a * b] + ([a - b] if a > b else []) + ([a // b] if b > 1 and a % b == 0 else [])
            value = options[int(rng.integers(len(options)))]
            values = [v for k, v in enumerate(values) if k not in (i, j)] + [value]
        target = values[0]
        if 1 <= target <= max_target and target not in numbers:
            return Puzzle(tuple(numbers), target)


def puzzle_set(seed: int, n: int, n_numbers: int, max_number: int, max_target: int) -> list[Puzzle]:
    return distinct_tasks(lambda rng: make_puzzle(rng, n_numbers, max_number, max_target), seed, n)


@functools.lru_cache(maxsize=8)
def _held_out(n_numbers: int, max_number: int, max_target: int) -> frozenset[str]:
    return frozenset(p.key() for p in puzzle_set(COUNTDOWN64_SEED, 64, n_numbers, max_number, max_target))


def read_expression(text: str) -> str:
    """The expression in a model's answer: after "answer:" if present, its first line with a
    digit, without code marks or a trailing "= value"."""
    match = _ANSWER.search(text)
    if match:
        text = text[match.end():]
    text = text.replace("`", " ")
    line = next((ln for ln in text.splitlines() if any(c.isdigit() for c in ln)), "")
    return max(line.split("="), key=lambda part: len(_INTEGER.findall(part))).strip() if line else ""


class CountdownEnv(TextEnv):
    """Make the target from the given numbers; reward 1.0 for an exact answer.

    `reset(seed=s)` draws the puzzle from `s`; `options={"puzzle": Puzzle}` plays that one.
    """

    eval_seed = COUNTDOWN64_SEED

    def __init__(self, n_numbers: int = 4, max_number: int = 25, max_target: int = 999,
                 max_attempts: int = 3) -> None:
        super().__init__()
        if not 2 <= n_numbers <= 6:
            raise ValueError(f"n_numbers must be between 2 and 6, got {n_numbers}")
        if max_number < 2 or max_target < 1 or max_attempts < 1:
            raise ValueError("max_number must be ≥ 2, and max_target and max_attempts ≥ 1")
        self.n_numbers, self.max_number, self.max_target = n_numbers, max_number, max_target
        self.max_attempts = max_attempts
        self.limits = Limits(max_chars=200, max_nodes=64, max_exponent=8, max_digits=30)
        self.puzzle: Puzzle | None = None
        self.attempts = 0

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        return [{"puzzle": p} for p in puzzle_set(seed, n, self.n_numbers, self.max_number, self.max_target)]

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        puzzle = options.get("puzzle")
        if puzzle is not None and not isinstance(puzzle, Puzzle):
            raise TypeError("options['puzzle'] must be a Puzzle")
        held_out = _held_out(self.n_numbers, self.max_number, self.max_target)
        while puzzle is None or ("puzzle" not in options and puzzle.key() in held_out):
            puzzle = make_puzzle(self.np_random, self.n_numbers, self.max_number, self.max_target)
        self.puzzle, self.attempts = puzzle, 0
        numbers = " ".join(map(str, puzzle.numbers))
        return (f"Use the numbers {numbers}, each exactly once, with + - * / and parentheses, "
                f"to make {puzzle.target}. Answer with the expression only."), {"target": puzzle.target}

    def check(self, text: str) -> tuple[bool, str]:
        """(correct, feedback) for one answer."""
        assert self.puzzle is not None
        expr = read_expression(text)
        if not expr:
            return False, "No expression found. Answer with an expression such as (3 + 5) * 2."
        used = Counter(_INTEGER.findall(expr))
        given = Counter(str(n) for n in self.puzzle.numbers)
        if used != given:
            extra, missing = used - given, given - used
            parts = ([f"uses {' '.join(sorted(extra.elements()))} which you were not given"] if extra else []) + \
                    ([f"leaves out {' '.join(sorted(missing.elements()))}"] if missing else [])
            return False, f"`{expr}` {' and '.join(parts)}: use each number exactly once."
        try:
            value = evaluate(expr, self.limits)
        except ArithmeticRefused as exc:
            return False, f"`{expr}` cannot be evaluated: {exc}."
        if value == self.puzzle.target:
            return True, f"`{expr}` = {self.puzzle.target}. Correct."
        return False, f"`{expr}` = {format_number(value)}, not {self.puzzle.target}."

    def _step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.puzzle is None:
            raise RuntimeError("call reset() before step()")
        self.attempts += 1
        correct, feedback = self.check(text)
        truncated = not correct and self.attempts >= self.max_attempts
        if not correct and not truncated:
            left = self.max_attempts - self.attempts
            feedback += f" Try again ({left} attempt{'s' if left > 1 else ''} left)."
        return feedback, 1.0 if correct else 0.0, correct, truncated, {"attempts": self.attempts}
