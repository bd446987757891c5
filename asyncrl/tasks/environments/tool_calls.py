"""Tool calls read from a model turn's text, in one of two formats.

- ``hermes`` (Hermes, Qwen2.5 and SmolLM2's tool format): each call is a JSON object between
  ``<tool_call>`` and ``</tool_call>``, ``{"name": ..., "arguments": {...}}``; ``arguments`` may
  also be a JSON string holding that object.
- ``tag``: each call is ``<NAME>argument</NAME>`` for a tool named NAME, its one argument the text
  between the tags: a format a small model learns from a short warm start (``<calc>12+34</calc>``).

A call whose JSON does not parse, has no name, or whose arguments are not an object is still a
call, with its ``error`` set: the model tried, and the environment answers with the error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | str
    """Keyword arguments (``hermes``), or the one text argument (``tag``)."""
    error: str | None = None
    """Why the call cannot be made as written (bad JSON, no name); None when it can."""


def parse_tool_calls(text: str, fmt: str, names: list[str] | None = None) -> list[ToolCall]:
    """The calls in ``text``, in order. ``names``: the tools of the ``tag`` format.

    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "hermes")
    [ToolCall(name='add', arguments={'a': 1, 'b': 2}, error=None)]
    >>> parse_tool_calls("so <calc>12+34</calc>", "tag", names=["calc"])
    [ToolCall(name='calc', arguments='12+34', error=None)]
    """
    if fmt == "hermes":
        return [_hermes_call(body) for body in _HERMES.findall(text)]
    if fmt == "tag":
        if not names:
            raise ValueError("the tag format needs the tools' names")
        pattern = re.compile("|".join(rf"<({re.escape(n)})>(.*?)</{re.escape(n)}>" for n in names), re.DOTALL)
        calls = []
        for match in pattern.finditer(text):
            groups = [g for g in match.groups() if g is not None]
            calls.append(ToolCall(name=groups[0], arguments=groups[1]))
        return calls
    raise ValueError(f"tool format ({fmt!r}) must be 'hermes' or 'tag'")


def _hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", arguments={}, error=f"the tool call is not JSON ({e.msg} at {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(name="", arguments={}, error='a tool call must be {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(call["name"], {}, error="the arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, error="the arguments must be a JSON object")
    return ToolCall(call["name"], arguments)


def stop_strings(fmt: str, names: list[str] | None = None) -> list[str]:
    """Strings that end a model turn once a call is written, so the environment answers it
    before the model goes on (included in the turn's tokens)."""
    if fmt == "hermes":
        return ["</tool_call>"]
    return [f"</{n}>" for n in names or []]
