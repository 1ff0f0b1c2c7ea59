"""Tool use: word problems solved with a calculator the model calls.

Design decisions:
- A task is a short word problem whose numbers are large enough that a model
  should not multiply in its head (e.g. "48 shelves hold 137 boxes each; 1205
  are shipped; how many are left?"), drawn from templates with random numbers.
  The answer is a whole number, checked exactly.
- The tool is a calculator: a turn that contains `calc: <expression>` gets
  `calc: <expression> = <value>` back. The expression is evaluated by
  `envs.arith` (no `eval`: numbers and + - * / // % ** only, with size and time
  limits), so `calc: __import__('os')` gets a refusal, never an exception.
- A turn with `answer: <number>` (or `#### <number>`) ends the episode with
  reward 1.0 if the number is right, else 0. Anything else gets a reminder of the
  two commands. After `max_turns` turns the episode is truncated with reward 0.
- In tool-call mode (`tool_calls=True`) the calculator is a declared tool,
  `calculate(expression)`, that the model calls in its chat template's format
  (envs/tools.py); each call gets a `tool` message with the value or the
  refusal. The answer is still written as `answer: <number>`.
- calculator-64 is 64 distinct problems from `CALC64_SEED`; training resets
  never produce one of them.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from envs.arith import ArithmeticRefused, Limits, evaluate, format_number, parse_number
from envs.base import TextEnv, distinct_tasks
from envs.tools import Tool, ToolError, ToolTurn

CALC64_SEED = 70070
_CALC = re.compile(r"calc(?:ulate)?\s*(?::|\()\s*(.+)", re.IGNORECASE)
_ANSWER = re.compile(r"(?:answer\s*[:=]|####)\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)

# (problem text, answer expression); {a}..{d} are drawn from the ranges beside them.
TEMPLATES: list[tuple[str, str, tuple[tuple[int, int], ...]]] = [
    ("A warehouse has {a} shelves with {b} boxes on each. {c} boxes are shipped. How many boxes are left?",
     "{a}*{b}-{c}", ((12, 99), (25, 250), (1, 999))),
    ("A school orders {a} packs of {b} pencils and {c} packs of {d} pens. How many items is that?",
     "{a}*{b}+{c}*{d}", ((11, 95), (12, 48), (11, 95), (6, 36))),
    ("{a} workers each earn {b} dollars a day for {c} days. How many dollars do they earn in all?",
     "{a}*{b}*{c}", ((3, 12), (120, 960), (7, 31))),
    ("A train travels {a} km per hour for {b} hours, then {c} km per hour for {d} hours. How far does it go?",
     "{a}*{b}+{c}*{d}", ((45, 180), (3, 14), (40, 160), (2, 11))),
    ("A farm harvests {a} kg a day for {b} days and sells {c} kg. How many kg remain?",
     "{a}*{b}-{c}", ((105, 990), (12, 60), (100, 999))),
    ("A tank holds {a} litres. It is filled {b} times and {c} litres leak each time. How many litres "
     "went in?", "({a}-{c})*{b}", ((300, 2500), (7, 45), (10, 99))),
]


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int

    def key(self) -> str:
        return self.text


_OWN = Limits(time_limit_s=math.inf)
"""A task's own expression is ours, not the model's: no time limit (a loaded machine that paused
the thread for 0.1 s made the task's answer an environment error)."""


def make_problem(rng: np.random.Generator) -> Problem:
    text, expr, ranges = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    values = {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in zip("abcd", ranges)}
    answer = evaluate(expr.format(**values), _OWN)
    return Problem(text.format(**values), int(answer))


def problem_set(seed: int, n: int) -> list[Problem]:
    return distinct_tasks(make_problem, seed, n)


@functools.lru_cache(maxsize=1)
def _held_out() -> frozenset[str]:
    return frozenset(p.key() for p in problem_set(CALC64_SEED, 64))


class CalculatorEnv(TextEnv):
    """Solve a word problem, calling `calc: <expression>` as often as needed, then `answer: <n>`.

    `reset(seed=s)` draws the problem from `s`; `options={"problem": Problem}` plays that one.
    """

    eval_seed = CALC64_SEED
    INSTRUCTIONS = ("Tools: write `calc: <expression>` to use a calculator (numbers and + - * / // % ** "
                    "only). When you know the result, write `answer: <number>`.")

    TOOL_INSTRUCTIONS = ("Call the calculate tool for arithmetic. When you know the result, write "
                         "`answer: <number>`.")
    CALCULATE = Tool("calculate", "Evaluate an arithmetic expression: numbers, parentheses and + - * / // % ** "
                     "only.", {"type": "object", "properties": {"expression": {
                         "type": "string", "description": "The expression, e.g. (12 + 5) * 34"}},
                         "required": ["expression"]})

    def __init__(self, max_turns: int = 4, max_chars: int = 200, time_limit_s: float = 0.1,
                 tool_calls: bool = False) -> None:
        super().__init__()
        self.tools = (self.CALCULATE,) if tool_calls else ()
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.limits = Limits(max_chars=max_chars, time_limit_s=time_limit_s)
        self.problem: Problem | None = None
        self.turns = 0
        self.calls = 0

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        return [{"problem": p} for p in problem_set(seed, n)]

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        problem = options.get("problem")
        if problem is not None and not isinstance(problem, Problem):
            raise TypeError("options['problem'] must be a Problem")
        while problem is None or ("problem" not in options and problem.key() in _held_out()):
            problem = make_problem(self.np_random)
        self.problem, self.turns, self.calls = problem, 0, 0
        instructions = self.TOOL_INSTRUCTIONS if self.tools else self.INSTRUCTIONS
        return f"{problem.text}\n{instructions}", {"answer": problem.answer}

    def calculate(self, expr: str) -> str:
        """The calculator tool: the observation for one call."""
        expr = expr.strip().rstrip(")") if expr.count(")") > expr.count("(") else expr.strip()
        try:
            return f"calc: {expr} = {format_number(evaluate(expr, self.limits))}"
        except ArithmeticRefused as exc:
            return f"calc error: {exc}"

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        assert name == "calculate", "run_tools calls declared tools only"
        self.calls += 1
        try:
            return format_number(evaluate(arguments["expression"].strip(), self.limits))
        except ArithmeticRefused as exc:
            raise ToolError(str(exc)) from None

    def _step(self, action: str | ToolTurn) -> tuple[str | list, float, bool, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("call reset() before step()")
        self.turns += 1
        info: dict[str, Any] = {"turns": self.turns, "calls": self.calls}
        text = action.text if isinstance(action, ToolTurn) else action
        answer = _ANSWER.search(text)
        if answer:
            value = parse_number(answer.group(1))
            correct = value is not None and value == Fraction(self.problem.answer)
            info["correct"] = correct
            return ("Correct." if correct else "Wrong."), float(correct), True, False, info
        truncated = self.turns >= self.max_turns
        if isinstance(action, ToolTurn):
            obs = self.run_tools(action) or f"No tool call or answer found. {self.TOOL_INSTRUCTIONS}"
            info["calls"] = self.calls
            return obs, 0.0, False, truncated, info
        call = _CALC.search(text)
        if call:
            self.calls += 1
            info["calls"] = self.calls
            obs = self.calculate(call.group(1).splitlines()[0])
        else:
            obs = "No command found. " + self.INSTRUCTIONS
        return obs, 0.0, False, truncated, info
