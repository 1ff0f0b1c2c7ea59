"""Countdown, the calculator tool and the text-to-SQL database, played as a model would."""

import itertools
import os
from fractions import Fraction

import numpy as np
import pytest

from envs.arith import ArithmeticRefused, Limits, evaluate
from envs.calculator import CalculatorEnv, Problem
from envs.countdown import CountdownEnv, Puzzle, make_puzzle
from envs.maze import MazeEnv
from envs.sql import SqlEnv, make_question


# -- the restricted evaluator -------------------------------------------------------

@pytest.mark.parametrize("expr, value", [
    ("1 + 2 * 3", 7),
    ("8 / 3 * 3", 8),             # exact: Fractions, not floats
    ("2 ^ 10", 1024),             # ^ is a power, as calculators write it
    ("(1.5 + 2) * 2", 7),
    ("-(3) + 10 // 3 % 2", -2),   # 10 // 3 = 3, 3 % 2 = 1, -3 + 1
    ("2 ** -2", Fraction(1, 4)),
])
def test_arithmetic_is_exact(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("().__class__.__bases__", "attributes are not allowed"),
    ("open('/etc/passwd')", "function calls are not allowed"),
    ("x + 1", r"names are not allowed \(x\)"),
    ("'a' * 3", "str values are not allowed"),
    ("[1][0]", "subscripts are not allowed"),
    ("1 if 1 else 2", "conditional expressions are not allowed"),
    ("(y := 3)", "assignments are not allowed"),
    ("lambda: 1", "lambdas are not allowed"),
    ("1 & 2", "the operator BitAnd is not allowed"),
    ("9 ** 9 ** 9", "exponents above 64"),
    ("99 ** 60", "more than 100 digits"),
    ("1 / 0", "division by zero"),
    ("1 +", "syntax error"),
    ("1" * 300, "longer than 200 characters"),
    ("+".join(["1"] * 40), "more than 64 parts"),
])
def test_anything_but_arithmetic_is_refused_with_a_reason(expr, reason):
    with pytest.raises(ArithmeticRefused, match=reason):
        evaluate(expr)


def test_evaluation_has_a_time_limit():
    with pytest.raises(ArithmeticRefused, match="longer than"):
        evaluate("2 ** 64 * 3 ** 64", Limits(time_limit_s=-1.0))  # already past its deadline


# -- countdown ------------------------------------------------------------------------

def solvable(p: Puzzle) -> bool:
    """Brute force: some order of the numbers and operations reaches the target."""
    def reach(values):
        if len(values) == 1:
            return values[0] == p.target
        for i, j in itertools.permutations(range(len(values)), 2):
            a, b = values[i], values[j]
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            for v in (a + b, a - b, a * b, *([a / b] if b else [])):
                if reach(rest + [v]):
                    return True
        return False
    return reach([Fraction(n) for n in p.numbers])


def test_countdown_puzzles_are_solvable_by_construction():
    rng = np.random.default_rng(0)
    for _ in range(10):
        assert solvable(make_puzzle(rng, 4, 25, 999))


def test_countdown_checks_answers_exactly_and_gives_feedback():
    env = CountdownEnv(max_attempts=3)
    env.reset(options={"puzzle": Puzzle((3, 5, 7, 8), 52)})
    obs, r, term, trunc, _ = env.step("3 * 5 + 7 + 8")
    assert (r, term, trunc) == (0.0, False, False)
    assert "= 30, not 52" in obs[0]["content"] and "2 attempts left" in obs[0]["content"]
    obs, r, *_ = env.step("answer: 5 * 8 + 7")
    assert "leaves out 3" in obs[0]["content"] and r == 0.0
    obs, r, term, trunc, _ = env.step("`(7 - 3) * 8 + 5 * 4`")
    assert "uses 4 which you were not given" in obs[0]["content"]
    assert (r, term, trunc) == (0.0, False, True)  # out of attempts
    env.reset(options={"puzzle": Puzzle((3, 5, 7, 8), 52)})
    obs, r, term, _, _ = env.step("Answer: 5 * 8 + 7 + 3 + 2 - 2 = 52")
    assert r == 0.0  # 2 is not a given number
    env.reset(options={"puzzle": Puzzle((3, 5, 7, 8), 52)})
    obs, r, term, _, _ = env.step("(8 + 5) * (7 - 3)")
    assert (r, term) == (1.0, True) and "Correct" in obs[0]["content"]  # (8 + 5) * (7 - 3) = 13 * 4 = 52


# -- calculator -------------------------------------------------------------------------

def test_calculator_tool_then_answer():
    env = CalculatorEnv(max_turns=4)
    problem = Problem("A warehouse has 48 shelves with 137 boxes on each. 1205 boxes are shipped. "
                      "How many boxes are left?", 48 * 137 - 1205)
    obs, _ = env.reset(options={"problem": problem})
    assert "calc: <expression>" in obs[0]["content"]
    obs, r, term, trunc, _ = env.step("Let me compute. calc: 48 * 137 - 1205")
    assert obs[0]["content"] == "calc: 48 * 137 - 1205 = 5371" and (r, term, trunc) == (0.0, False, False)
    obs, r, term, trunc, _ = env.step("answer: 5,371")
    assert (r, term) == (1.0, True)


def test_a_calculator_task_is_drawn_however_slowly_the_machine_runs(monkeypatch):
    """The task's own arithmetic has no time limit: on a loaded machine a reset paused past 0.1 s
    was an environment error. The model's expressions keep theirs."""
    import envs.arith

    clock = itertools.count(step=1.0)  # every look at the clock: one more second gone
    monkeypatch.setattr(envs.arith.time, "monotonic", lambda: float(next(clock)))
    env = CalculatorEnv(max_turns=4)
    obs, _ = env.reset(seed=3)
    assert "calc: <expression>" in obs[0]["content"]
    obs, _, term, _, _ = env.step("calc: (1 + 2) * 3")
    assert obs[0]["content"].startswith("calc error: evaluation took longer than") and not term


@pytest.mark.parametrize("call", [
    "calc: __import__('os').system('touch pwned')",
    "calc: open('/etc/passwd').read()",
    "calc(().__class__.__subclasses__())",
    "calc: 10 ** 10 ** 10",
])
def test_calculator_refuses_code_and_keeps_the_episode(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, r, term, trunc, _ = env.step(call)
    assert obs[0]["content"].startswith("calc error:") and (r, term) == (0.0, False)
    assert list(tmp_path.iterdir()) == []


def test_calculator_truncates_after_max_turns_and_wrong_answers_end_it():
    env = CalculatorEnv(max_turns=2)
    env.reset(seed=3)
    assert env.step("hmm")[3] is False
    assert env.step("still thinking")[3] is True
    env.reset(seed=3)
    _, r, term, _, _ = env.step("answer: -1")
    assert (r, term) == (0.0, True)


# -- text-to-SQL ------------------------------------------------------------------------

def test_sql_gold_answer_is_rewarded_in_any_row_order():
    env = SqlEnv()
    question = make_question(np.random.default_rng(1))
    env.reset(options={"question": question})
    obs, r, term, _, _ = env.step("query: SELECT name, city FROM departments")
    assert "Sales" in obs[0]["content"] and "(8 rows)" in obs[0]["content"] and (r, term) == (0.0, False)
    _, r, term, _, _ = env.step(f"answer: {question.gold}")
    assert (r, term) == (1.0, True)
    env.reset(options={"question": question})
    _, r, _, _, _ = env.step(f"answer: SELECT * FROM ({question.gold}) ORDER BY 1 DESC")
    assert r == 1.0
    env.reset(options={"question": question})
    _, r, term, _, _ = env.step("answer: SELECT 123456789")
    assert (r, term) == (0.0, True)
    env.close()


@pytest.mark.parametrize("sql", [
    "DELETE FROM employees",
    "DROP TABLE employees",
    "UPDATE employees SET salary = 0",
    "INSERT INTO departments VALUES (99, 'x', 'y')",
    "CREATE TABLE t (x)",
    "ATTACH DATABASE 'copy.db' AS c",
    "VACUUM INTO 'copy.db'",
    "PRAGMA query_only = OFF",
    "SELECT 1; DELETE FROM employees",
])
def test_sql_refuses_writes_and_leaves_no_files(sql, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SQLITE_TMPDIR", str(tmp_path))
    env = SqlEnv()
    env.reset(seed=0)
    obs, r, term, _, info = env.step(f"query: {sql}")
    assert obs[0]["content"].startswith("error:") and (r, term) == (0.0, False)
    obs, *_ = env.step("query: SELECT COUNT(*) FROM employees")
    assert obs[0]["content"].splitlines()[1] == "200"  # nothing was deleted
    env.close()
    assert list(tmp_path.iterdir()) == []


def test_sql_times_out_a_slow_query_and_goes_on():
    env = SqlEnv(time_limit_s=0.3)
    env.reset(seed=0)
    obs, r, term, _, _ = env.step(
        "query: WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c")
    assert "longer than the 0.3 s limit" in obs[0]["content"] and not term
    obs, *_ = env.step("query: SELECT COUNT(*) FROM departments")
    assert obs[0]["content"].splitlines()[1] == "8"
    env.close()


def test_sql_large_sorts_stay_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SQLITE_TMPDIR", str(tmp_path))
    env = SqlEnv(time_limit_s=5.0)
    env.reset(seed=0)
    obs, *_ = env.step("query: SELECT a.name, b.name FROM employees a, employees b ORDER BY a.salary + b.salary")
    assert "more not shown" in obs[0]["content"]
    env.close()
    assert os.listdir(tmp_path) == []


# -- maze options -----------------------------------------------------------------------

def test_maze_size_option_and_curriculum():
    env = MazeEnv(size=5, curriculum="3@0,4@10")
    grid = lambda obs: obs[0]["content"].splitlines()[4:]  # noqa: E731  (under four lines)
    assert len(grid(env.reset(seed=0, options={"policy_version": 0})[0])) == 3
    assert len(grid(env.reset(seed=0, options={"policy_version": 12})[0])) == 4
    assert len(grid(env.reset(seed=0, options={"size": 6})[0])) == 6
    assert len(MazeEnv(size=5).reset(seed=0)[0][0]["content"].splitlines()[4:]) == 5
    with pytest.raises(ValueError, match="size@version"):
        MazeEnv(curriculum="three")
