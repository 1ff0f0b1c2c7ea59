"""A restricted arithmetic evaluator for model-written expressions.

Model output is untrusted, so expressions are never handed to `eval`. They are
parsed with `ast` and walked by hand, and only numbers and the operators
+ - * / // % ** (and ^ as a power, as calculators write it) with parentheses
are accepted: no names, calls, attributes, subscripts, strings or anything else
that could reach a module, a file or the interpreter. Arithmetic is exact
(`fractions.Fraction`), so 8 / 3 * 3 is 8, and size and time are bounded:

- the expression is at most `max_chars` characters and `max_nodes` syntax nodes;
- an exponent is a whole number of at most `max_exponent` in size, and no
  intermediate value may exceed `max_digits` digits (so 9**9**9 is refused
  before it is computed, not after);
- evaluation stops after `time_limit_s`.

Every refusal is an `ArithmeticRefused` (a ValueError) whose message says what
was wrong, fit to show the model as an observation.
"""

from __future__ import annotations

import ast
import math
import time
from dataclasses import dataclass
from fractions import Fraction


class ArithmeticRefused(ValueError):
    """The expression is not plain arithmetic within the limits (the message says why)."""


@dataclass(frozen=True)
class Limits:
    max_chars: int = 200
    max_nodes: int = 64
    max_exponent: int = 64
    max_digits: int = 100
    time_limit_s: float = 0.1


_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**", ast.BitXor: "**"}
_UNARY = {ast.UAdd: "+", ast.USub: "-"}
_DESCRIBE = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
             ast.Subscript: "subscripts", ast.Lambda: "lambdas", ast.Compare: "comparisons",
             ast.BoolOp: "boolean operators", ast.JoinedStr: "strings", ast.List: "lists",
             ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets", ast.IfExp: "conditional expressions",
             ast.NamedExpr: "assignments", ast.Starred: "starred expressions"}


def evaluate(expr: str, limits: Limits = Limits()) -> Fraction:
    """The exact value of `expr`, or ArithmeticRefused saying why not."""
    if not isinstance(expr, str):
        raise ArithmeticRefused("the expression must be text")
    expr = expr.strip()
    if not expr:
        raise ArithmeticRefused("the expression is empty")
    if len(expr) > limits.max_chars:
        raise ArithmeticRefused(f"the expression is longer than {limits.max_chars} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ArithmeticRefused("not an arithmetic expression (syntax error)") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > limits.max_nodes:
        raise ArithmeticRefused(f"the expression has more than {limits.max_nodes} parts")
    for node in nodes:  # refuse before evaluating anything
        if type(node) in _DESCRIBE or not isinstance(
                node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)):
            what = _DESCRIBE.get(type(node), type(node).__name__)
            name = f" ({node.id})" if isinstance(node, ast.Name) else ""
            raise ArithmeticRefused(f"{what} are not allowed{name}: only numbers and + - * / // % ** ( )")
        if isinstance(node, (ast.operator, ast.unaryop)) and type(node) not in _BINARY | _UNARY:
            raise ArithmeticRefused(f"the operator {type(node).__name__} is not allowed: only + - * / // % **")
    deadline = time.monotonic() + limits.time_limit_s
    return _eval(tree.body, limits, deadline)


def _eval(node: ast.AST, limits: Limits, deadline: float) -> Fraction:
    if time.monotonic() > deadline:
        raise ArithmeticRefused(f"evaluation took longer than {limits.time_limit_s:g} s")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArithmeticRefused(f"{type(value).__name__} values are not allowed: only numbers")
        if isinstance(value, float) and not math.isfinite(value):
            raise ArithmeticRefused("the number is not finite")
        return _bounded(Fraction(value) if isinstance(value, int) else Fraction(repr(value)), limits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _eval(node.operand, limits, deadline)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left, limits, deadline), _eval(node.right, limits, deadline)
        op = _BINARY[type(node.op)]
        if op in ("/", "//", "%") and b == 0:
            raise ArithmeticRefused("division by zero")
        if op == "**":
            return _power(a, b, limits)
        out = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if op == "/" else None,
               "//": Fraction(a // b) if op == "//" else None, "%": a % b if op == "%" else None}[op]
        return _bounded(out, limits)
    raise ArithmeticRefused(f"{type(node).__name__} is not allowed")


def _power(base: Fraction, exponent: Fraction, limits: Limits) -> Fraction:
    if exponent.denominator != 1:
        raise ArithmeticRefused("exponents must be whole numbers")
    if abs(exponent) > limits.max_exponent:
        raise ArithmeticRefused(f"exponents above {limits.max_exponent} are not allowed")
    if base == 0 and exponent < 0:
        raise ArithmeticRefused("division by zero")
    # Size check before computing: digits of the result ≈ |e| × digits of the base.
    size = max(abs(base.numerator), base.denominator)
    if size > 1 and abs(int(exponent)) * math.log10(size) > limits.max_digits:
        raise ArithmeticRefused(f"the result would have more than {limits.max_digits} digits")
    return _bounded(base ** int(exponent), limits)


def _bounded(value: Fraction, limits: Limits) -> Fraction:
    if max(abs(value.numerator), value.denominator) >= 10 ** limits.max_digits:
        raise ArithmeticRefused(f"a value has more than {limits.max_digits} digits")
    return value


def format_number(value: Fraction) -> str:
    """An exact value as a person writes it: 42, -3.5, or 10/3 rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    exact = Fraction(text) == value
    return text if exact else f"{text} (exactly {value.numerator}/{value.denominator})"


def parse_number(text: str) -> Fraction | None:
    """A number a model wrote ("1,205", "-3.5", "10/3"), or None."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
