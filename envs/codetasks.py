"""Bug-fixing tasks the project generates: small Python packages with injected bugs.

Design decisions:
- A task is a package of 1-3 modules built from a library of small reference functions
  (`FUNCTIONS`); one or more of them gets one injected bug from that function's list (a
  swapped operator, an off-by-one, a wrong constant, a loop that never ends, ...).
- Hidden tests are calls `(module, function, args)`; their expected values are the
  reference's results, computed here. The grader (envs/code.py) runs the calls in a sandbox
  and compares the printed results here, so a solution that prints or exits cannot pass.
- Every task is validated before use: the reference is run in this process on every hidden
  call (it is our code, with a budget of traced lines) and the bug must change at least one
  result, raise, or exhaust the budget (a hang). A bug that changes nothing is redrawn.
- The visible test (`tests/test_visible.py`) asserts one failing call; with
  `hidden_counterexample` it asserts a passing one, so only the statement points at the bug.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

from envs.sandbox import WORKDIR

R = np.random.Generator


def _ints(rng: R, n: int, lo: int = -20, hi: int = 50) -> list[int]:
    return [int(v) for v in rng.integers(lo, hi, size=n)]


@dataclass(frozen=True)
class Function:
    name: str
    source: str
    bugs: tuple[tuple[str, str], ...]  # (text in the reference, its buggy replacement)
    draw: object  # rng -> args (a list)


FUNCTIONS = [
    Function("total_price", '''def total_price(prices, discount):
    """Sum of `prices` less `discount` percent, rounded to cents."""
    total = 0
    for p in prices:
        total += p
    return round(total * (100 - discount) / 100, 2)
''', (("total += p", "total -= p"), ("(100 - discount)", "(100 + discount)"), ("100, 2)", "100, 1)")),
        lambda rng: [[round(float(v), 2) for v in rng.uniform(1, 90, int(rng.integers(2, 6)))],
                     int(rng.integers(5, 40))]),
    Function("count_long_words", '''def count_long_words(text, n):
    """How many whitespace-separated words of `text` have at least `n` characters."""
    count = 0
    for word in text.split():
        if len(word) >= n:
            count += 1
    return count
''', (("len(word) >= n", "len(word) > n"), ("count += 1", "count += 2"), ("text.split()", "text.split(' ', 3)")),
        lambda rng: [" ".join("abcdefgh"[: int(k)] for k in rng.integers(1, 9, int(rng.integers(4, 10)))),
                     int(rng.integers(2, 6))]),
    Function("running_max", '''def running_max(xs):
    """The list whose i-th item is the largest of xs[0], ..., xs[i]."""
    out = []
    best = None
    for x in xs:
        if best is None or x > best:
            best = x
        out.append(best)
    return out
''', (("x > best", "x < best"), ("out.append(best)", "out.append(x)")),
        lambda rng: [_ints(rng, int(rng.integers(4, 9)))]),
    Function("find_index", '''def find_index(xs, target):
    """The index of `target` in the sorted list `xs` (binary search), or -1 if absent."""
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', (("while lo <= hi", "while lo < hi"), ("lo = mid + 1", "lo = mid"), ("return -1", "return 0")),
        lambda rng: (lambda xs: [xs, int(rng.choice(xs)) if rng.random() < 0.7 else 1000])(
            sorted({int(v) for v in rng.integers(0, 99, int(rng.integers(3, 12)))}))),
    Function("digit_sum", '''def digit_sum(n):
    """The sum of the decimal digits of abs(n)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
''', (("n % 10", "n % 9"), ("n //= 10", "n //= 1"), ("n = abs(n)", "n = n")),
        lambda rng: [int(rng.integers(-99999, 99999))]),
    Function("fizzbuzz", '''def fizzbuzz(n):
    """For 1..n: "FizzBuzz" for multiples of 15, "Fizz" of 3, "Buzz" of 5, else the number as text."""
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
''', (("range(1, n + 1)", "range(1, n)"), ("i % 15 == 0", "i % 10 == 0"), ('"Buzz")', '"Fizz")')),
        lambda rng: [int(rng.integers(5, 31))]),
    Function("mean_of_top", '''def mean_of_top(xs, k):
    """The mean of the `k` largest values of `xs` (1 <= k <= len(xs))."""
    top = sorted(xs, reverse=True)[:k]
    return sum(top) / k
''', (("reverse=True", "reverse=False"), ("[:k]", "[:k - 1]"), ("sum(top) / k", "sum(top) // k")),
        lambda rng: (lambda xs: [xs, int(rng.integers(2, len(xs) + 1))])(_ints(rng, int(rng.integers(3, 8)), 0, 100))),
    Function("caesar", '''def caesar(text, shift):
    """`text` with each lowercase letter moved `shift` places on in the alphabet (z wraps to a)."""
    out = []
    for c in text:
        if "a" <= c <= "z":
            out.append(chr((ord(c) - 97 + shift) % 26 + 97))
        else:
            out.append(c)
    return "".join(out)
''', (("% 26", "% 25"), ("+ shift)", "- shift)"), ('"a" <= c <= "z"', '"a" < c <= "z"')),
        lambda rng: ["".join(rng.choice(list("abcxyz hello"), int(rng.integers(5, 12)))), int(rng.integers(1, 25))]),
    Function("count_pairs", '''def count_pairs(xs, target):
    """How many index pairs i < j have xs[i] + xs[j] == target."""
    count = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if xs[i] + xs[j] == target:
                count += 1
    return count
''', (("range(i + 1, len(xs))", "range(i, len(xs))"), ("== target", ">= target")),
        lambda rng: (lambda xs: [xs, int(xs[0] + xs[-1])])(_ints(rng, int(rng.integers(4, 9)), 0, 10))),
    Function("collatz_steps", '''def collatz_steps(n):
    """Steps for n >= 1 to reach 1, each step n -> n / 2 if n is even, else 3n + 1."""
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
''', (("3 * n + 1", "3 * n - 1"), ("steps += 1", "steps += 2"), ("steps = 0", "steps = 1")),
        lambda rng: [int(rng.integers(2, 60))]),
    Function("compound", '''def compound(principal, rate, years):
    """The balance after `years` of yearly compound interest at `rate` percent, rounded to cents."""
    balance = principal
    for _ in range(years):
        balance = balance * (1 + rate / 100)
    return round(balance, 2)
''', (("rate / 100", "rate / 10"), ("range(years)", "range(years - 1)"), ("(1 + rate", "(1 - rate")),
        lambda rng: [int(rng.integers(100, 5000)), int(rng.integers(1, 12)), int(rng.integers(1, 8))]),
    Function("merge_sorted", '''def merge_sorted(a, b):
    """The sorted merge of the sorted lists `a` and `b`."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
''', (("a[i] <= b[j]", "a[i] >= b[j]"), ("out + a[i:] + b[j:]", "out + a[i:]"), ("j += 1", "j += 2")),
        lambda rng: [sorted(_ints(rng, int(rng.integers(2, 6)))), sorted(_ints(rng, int(rng.integers(2, 6))))]),
]

PACKAGES = ["shoplib", "textkit", "numtools", "listops", "mathbits", "utilpack", "calcs", "toolbox"]
MODULES = ["core", "helpers", "ops", "extra", "misc", "basics"]
LINE_BUDGET = 20_000
"""Traced lines a validation call may run before it counts as hanging."""


@dataclass(frozen=True)
class Knobs:
    """Difficulty of generated tasks."""

    functions: int = 1
    """Functions in the package."""
    files: int = 1
    """Modules they are spread over (at most `functions`)."""
    bugs: int = 1
    """Functions with a bug, each in a different module where there are enough."""
    hidden_counterexample: bool = False
    """The visible test passes: only the statement says what is wrong."""
    cases: int = 8
    """Hidden calls per function."""

    def __post_init__(self) -> None:
        if not 1 <= self.files <= self.functions <= len(FUNCTIONS):
            raise ValueError(f"need 1 <= files <= functions <= {len(FUNCTIONS)}, got files={self.files}, "
                             f"functions={self.functions}")
        if not 1 <= self.bugs <= self.functions or self.cases < 1:
            raise ValueError(f"need 1 <= bugs <= functions and cases >= 1, got bugs={self.bugs}, cases={self.cases}")


@dataclass(frozen=True)
class Task:
    """A repository to repair: files (path -> text) as the agent gets them, and how to grade."""

    statement: str
    files: tuple[tuple[str, str], ...]
    """The buggy repository."""
    source_files: tuple[str, ...]
    """Paths whose changes count (everything else is restored before grading)."""
    calls: tuple[tuple[str, str, tuple], ...]
    """Hidden calls: (module, function, args as JSON)."""
    expected: str
    """The reference's results of `calls`, as JSON."""
    fix: tuple[tuple[str, str], ...]
    """The reference versions of the buggy files (the known fix)."""

    def prompt(self) -> str:
        """What the agent is shown first: the statement, the files, the visible test."""
        files = dict(self.files)
        listing = "\n".join(f"  {path}" for path in files)
        test = files.get("tests/test_visible.py")
        shown = f"\ntests/test_visible.py:\n{test}" if test else ""
        return f"{self.statement}\nFiles in {WORKDIR}:\n{listing}{shown}"

    def key(self) -> str:
        return self.prompt()


def _run_traced(fn, args: list):
    """fn(*args) with at most LINE_BUDGET traced lines; ("ok", result) or ("error", name)."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines > LINE_BUDGET:
            raise TimeoutError("line budget")
        return trace

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        return "ok", fn(*json.loads(json.dumps(args)))
    except Exception as exc:  # the buggy version may raise anything
        return "error", type(exc).__name__
    finally:
        sys.settrace(old)


def _load(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "<task>", "exec"), namespace)
    return namespace


def _literal(args: list) -> str:
    return ", ".join(repr(a) for a in args)


def make_task(rng: R, knobs: Knobs = Knobs()) -> Task:
    """A validated task drawn from `rng` (bugs that change no hidden result are redrawn)."""
    package = PACKAGES[int(rng.integers(len(PACKAGES)))]
    modules = [str(m) for m in rng.choice(MODULES, knobs.files, replace=False)]
    picked = [FUNCTIONS[int(i)] for i in rng.choice(len(FUNCTIONS), knobs.functions, replace=False)]
    placed = [(modules[i % knobs.files], f) for i, f in enumerate(picked)]
    buggy_ix = _spread_bugs(rng, placed, knobs.bugs)
    while True:
        bugs = {i: placed[i][1].bugs[int(rng.integers(len(placed[i][1].bugs)))] for i in buggy_ix}
        calls, results, counter = [], [], {}
        for i, (module, f) in enumerate(placed):
            reference = _load(f.source)[f.name]
            buggy = _load(f.source.replace(*bugs[i]))[f.name] if i in bugs else reference
            for _ in range(knobs.cases):
                args = f.draw(rng)
                want = _run_traced(reference, args)
                assert want[0] == "ok", f"reference {f.name}{tuple(args)} failed: {want}"
                calls.append((module, f.name, json.dumps(args)))
                results.append(json.loads(json.dumps(want[1])))
                if i in bugs and _run_traced(buggy, args) != ("ok", results[-1]) and i not in counter:
                    counter[i] = (args, results[-1])
        if len(counter) == len(bugs):
            break  # every bug shows on a hidden call: valid
    return _assemble(package, placed, bugs, calls, results, counter, rng, knobs)


def _spread_bugs(rng: R, placed: list, n: int) -> list[int]:
    """Indices of the functions to break, in different modules first."""
    by_module: dict[str, list[int]] = {}
    for i, (module, _) in enumerate(placed):
        by_module.setdefault(module, []).append(i)
    order = [int(rng.choice(ix)) for ix in by_module.values()]
    rest = [i for i in range(len(placed)) if i not in order]
    return (order + [int(i) for i in rng.permutation(rest)])[:n]


def _assemble(package, placed, bugs, calls, results, counter, rng, knobs) -> Task:
    files, fixed = {f"{package}/__init__.py": '"""Small utilities."""\n'}, {}
    for module in dict.fromkeys(m for m, _ in placed):
        funcs = [(i, f) for i, (m, f) in enumerate(placed) if m == module]
        ref = "\n\n".join(f.source for _, f in funcs)
        bad = "\n\n".join(f.source.replace(*bugs[i]) if i in bugs else f.source for i, f in funcs)
        path = f"{package}/{module}.py"
        files[path] = f'"""{module.capitalize()} functions of {package}."""\n\n\n' + bad
        if bad != ref:
            fixed[path] = f'"""{module.capitalize()} functions of {package}."""\n\n\n' + ref
    first = min(counter)
    module, f = placed[first]
    if knobs.hidden_counterexample:  # a call the bug does not change, if any
        args = f.draw(rng)
        ok = _run_traced(_load(f.source)[f.name], args)
        want = (args, ok[1]) if _run_traced(_load(f.source.replace(*bugs[first]))[f.name], args) == ok else None
    else:
        want = counter[first]
    names = ", ".join(f"`{package}.{placed[i][0]}.{placed[i][1].name}`" for i in sorted(bugs))
    statement = (f"The package `{package}` has a bug: {names} {'does' if len(bugs) == 1 else 'do'} not do what "
                 f"{'its docstring says' if len(bugs) == 1 else 'their docstrings say'}. Fix the package's code "
                 "so that every function matches its docstring; hidden tests check many inputs.")
    if want is not None:
        files["tests/test_visible.py"] = (
            "import os\nimport sys\n\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
            f"from {package}.{module} import {f.name}  # noqa: E402\n\n\n"
            f"def test_{f.name}():\n    assert {f.name}({_literal(want[0])}) == {want[1]!r}\n\n\n"
            f"if __name__ == \"__main__\":\n    test_{f.name}()\n    print(\"passed\")\n")
        statement += " `python3 tests/test_visible.py` runs one test" + (
            "." if knobs.hidden_counterexample else "; it fails now.")
    sources = tuple(p for p in files if p.startswith(f"{package}/"))
    return Task(statement, tuple(files.items()), sources,
                tuple((f"{package}.{m}", fn, a) for m, fn, a in calls), json.dumps(results), tuple(fixed.items()))
