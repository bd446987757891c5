"""Arithmetic with a calculator tool: the model may call ``calc`` on an expression, reads the
result, and answers; the run's rewards (exact match) score its final turn.

A ``ToolEnvironment``: its one tool is the method below. In the ``tag`` format (the default,
which the demo's small model learns from a short warm start) a call is ``<calc>12+34</calc>``,
and the result comes back as the next message (``=46``); in the ``hermes`` format it is
``<tool_call>{"name": "calc", "arguments": {"expression": "12+34"}}</tool_call>``.

``demonstration`` writes the episodes the warm start learns (``asyncrl.controller.demonstrations``):
the call's format and what to do with its result, but not when to call (see its docstring).
"""

from __future__ import annotations

import ast
import json
import operator
import random

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
    """Arithmetic questions with one tool, ``calc``.

    ``demonstration_calls``: the share of the warm start's demonstrations that call the tool;
    ``demonstration_slips``: of those, the share whose expression has one digit wrong.
    """

    tool_format = "tag"

    def __init__(self, demonstration_calls: float = 0.3, demonstration_slips: float = 0.2, **options):
        super().__init__(**options)
        for name, share in (("demonstration_calls", demonstration_calls), ("demonstration_slips", demonstration_slips)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} ({share}) must be in [0, 1]")
        self.demonstration_calls, self.demonstration_slips = demonstration_calls, demonstration_slips

    def calc(self, expression: str) -> str:
        """Evaluate an integer expression (+ - * // % and parentheses): ``=VALUE``."""
        try:
            return f"={evaluate(expression)}"
        except ZeroDivisionError:
            return "error: division by zero"

    def demonstration(self, row: dict, rng: random.Random) -> list[dict]:
        """An episode for the warm start, of the row's ``expression`` column: with probability
        ``demonstration_calls`` a call of ``calc`` on it (one digit of it wrong with probability
        ``demonstration_slips``), its result, and that result as the answer; otherwise the
        answer at once, without a call.

        It teaches the call's format, and to answer with what the tool returned. It leaves to RL
        when to call: most demonstrations answer at once, with a value the small model cannot
        compute (a product or a sum of three two-digit numbers), and some calls are mistyped,
        so the warm-started model mostly answers wrong, and RL learns that a call, written as
        asked, is what earns the reward.
        """
        expression = str((row.get("columns") or {}).get("expression", ""))
        if not expression:
            raise ValueError(
                f"a calculator row needs its expression column (it has {sorted(row.get('columns') or {})})"
            )
        if rng.random() >= self.demonstration_calls:
            return [{"role": "assistant", "content": str(evaluate(expression))}]
        written = _slip(expression, rng) if rng.random() < self.demonstration_slips else expression
        result = self.calc(written)
        if self.tool_format == "tag":
            call = f"<calc>{written}</calc>"
        else:
            call = "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": written}}) + "</tool_call>"
        return [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result.removeprefix("=")},
        ]


def _slip(expression: str, rng: random.Random) -> str:
    """``expression`` with one of its digits replaced by another (never a leading zero)."""
    places = [i for i, c in enumerate(expression) if c.isdigit()]
    index = rng.choice(places)
    leading = index == 0 or not expression[index - 1].isdigit()
    digits = [d for d in "0123456789" if d != expression[index] and not (leading and d == "0")]
    return expression[:index] + rng.choice(digits) + expression[index + 1 :]
