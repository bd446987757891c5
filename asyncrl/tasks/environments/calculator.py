"""Arithmetic with a calculator tool: the model may call ``calc`` on an expression, reads the
result, and answers; the run's rewards (exact match) score its final turn.

A ``ToolEnvironment``: its one tool is the method below. In the ``tag`` format (the default,
which the demo's small model learns from a short warm start) a call is ``<calc>12+34</calc>``,
and the result comes back as the next message (``=46``); in the ``hermes`` format it is
``<tool_call>{"name": "calc", "arguments": {"expression": "12+34"}}</tool_call>``.
"""

from __future__ import annotations

import ast
import operator

from asyncrl.tasks.environments.base import ToolEnvironment

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_DIGITS = 30
"""The largest result the calculator gives, in digits (a product of huge numbers is refused,
not computed)."""


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * // % and parentheses; a ValueError otherwise.

    >>> evaluate("12 + 34 * (2 - 1)")
    46
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot read {expression!r}: {e.msg}") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if max(abs(left), abs(right)) >= 10**MAX_DIGITS:
                raise ValueError(f"numbers of more than {MAX_DIGITS} digits are refused")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"only integers, + - * // % and parentheses are allowed in {expression!r}")

    return value(tree.body)


class Calculator(ToolEnvironment):
    """Arithmetic questions with one tool, ``calc``."""

    tool_format = "tag"

    def calc(self, expression: str) -> str:
        """Evaluate an integer expression (+ - * // % and parentheses): ``=VALUE``."""
        try:
            return f"={evaluate(expression)}"
        except ZeroDivisionError:
            return "error: division by zero"
