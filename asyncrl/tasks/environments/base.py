"""The interface of an environment, and how a config names one.

An environment plays the other side of a multi-turn episode. asyncrl makes one instance per
episode and calls, from the generator's event loop:

- ``await env.reset(row)`` once, with the dataset row the prompt came from (its ``columns``, and
  ``answer``): the episode starts from the row's prompt as rendered for a single-turn answer,
  followed by the messages ``reset`` returns, if any (``{"role": ..., "content": ...}``).
- ``await env.step(text)`` after each model turn, with the turn's text: the ``Step`` says what
  the environment answers (messages appended to the episode, rendered by
  ``asyncrl.generators.rollouts.render``), the reward this step earned and whether the episode
  is over.
- ``await env.close()`` at the end, whatever happened.

An environment that raises, or takes longer than ``environment.step_timeout_s``, leaves its
episode unscored with the reason, and the run goes on (``asyncrl.generators.rollouts.multi_turn``).

A class whose public methods are its tools needs less: subclass ``ToolEnvironment``, write the
tools as methods with docstrings, and the model calls them in the tool-call format the config
names (``asyncrl.tasks.environments.tool_calls``); each call's result goes back as a ``tool``
message, and a turn without a call ends the episode, scored by the rewards of the run's config.

Environments are named in the config by their dotted path, ``module:Class``, with keyword
``options``.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from asyncrl.configbase import import_class
from asyncrl.tasks.environments.tool_calls import ToolCall, parse_tool_calls
from asyncrl.tasks.environments.tool_child import load as load_tool
from asyncrl.tasks.environments.tool_runner import ToolRunner


@dataclass
class Step:
    """An environment's answer to one model turn."""

    messages: list[dict[str, str]] = field(default_factory=list)
    """Messages appended after the turn (``{"role": "user" | "tool", "content": ...}``); empty
    when the episode is done."""
    reward: float = 0.0
    """Reward this step earned; the episode's ``env_reward`` is the sum over its steps."""
    done: bool = False
    """The episode is over: no further model turn."""
    tool_calls: int = 0
    """Tool calls the model made in the turn."""
    tool_errors: int = 0
    """Of those, the calls that ended in an error observation."""


class EnvironmentFailure(Exception):
    """An environment's failure that names its own kind: its message starts with it
    (``environment_http_timeout: ...``), and the episode's ``env_error`` is that message as it
    is, so the kind labels the metric and the unscored reason. Any other exception an
    environment raises is ``environment_failed``."""


class Environment(Protocol):
    async def reset(self, row: dict[str, Any]) -> list[dict[str, str]] | None: ...

    async def step(self, text: str) -> Step: ...

    async def close(self) -> None: ...


class ToolEnvironment:
    """An environment whose public methods (not starting with ``_``, other than ``reset``,
    ``step``, ``close`` and ``demonstration``, the warm start's episodes) are the tools the model may call.

    A turn with tool calls runs each and answers with one ``tool`` message per call; a turn
    without a call ends the episode (``done``, reward 0: the run's rewards score the final
    answer). ``max_tool_calls`` calls in one turn at most; more are errors. A tool takes keyword
    arguments, or, in the ``tag`` format, one string (its first parameter).

    - **Methods** run in the generator's process: an async one on the engine's event loop, a
      sync one in a thread, so that it does not stall the other episodes. One that does not
      return within ``environment.step_timeout_s`` ends its episode unscored
      (``environment_timeout``). For tools you trust: a method that crashes the interpreter or
      exhausts its memory takes the generator with it.
    - **Process tools** (``process_tools``: name -> ``module:function``) run in a child process
      (``asyncrl.tasks.environments.tool_runner``), one per class and generator, under
      ``tool_timeout_s`` and ``tool_memory_bytes``: a tool that hangs, crashes, runs out of memory
      or returns garbage is an error observation, counted, and the next call gets a fresh child.
      The sandboxed Python tool is one (``python_tool:run_python``).

    A call to an unknown tool, with arguments the tool does not take or bad JSON, or that fails
    is answered with an error message and counted in ``Step.tool_errors``.
    """

    tool_format = "hermes"
    """How calls are written in the model's text: ``hermes`` or ``tag`` (``tool_calls``)."""
    max_tool_calls = 4
    process_tools: ClassVar[dict[str, str]] = {}
    """Tools run in a child process: tool name -> ``module:function``."""
    tool_timeout_s = 10.0
    """Seconds a process tool may take; past it its child is killed (an error observation)."""
    tool_memory_bytes: int | None = 1 << 30
    """Address space of the process tools' child."""
    _runners: ClassVar[dict[type, ToolRunner]] = {}

    def __init__(self, **options):
        self.options = options
        self.row: dict[str, Any] = {}

    @classmethod
    def tools(cls) -> dict[str, Any]:
        """Tool name -> its method, or its ``module:function`` for a process tool."""
        reserved = {"reset", "step", "close", "tools", "call_tool", "runner", "demonstration"}
        methods = {
            name: member
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in reserved
        }
        return {**methods, **cls.process_tools}

    @classmethod
    def runner(cls) -> ToolRunner:
        """The child process of this class's process tools in this process (started on first use,
        closed at exit)."""
        runner = ToolEnvironment._runners.get(cls)
        if runner is None:
            runner = ToolRunner(
                dict(cls.process_tools), timeout_s=cls.tool_timeout_s, memory_bytes=cls.tool_memory_bytes
            )
            ToolEnvironment._runners[cls] = runner
            atexit.register(runner.close)
        return runner

    async def reset(self, row: dict[str, Any]) -> None:
        self.row = row

    async def step(self, text: str) -> Step:
        calls = parse_tool_calls(text, self.tool_format, names=list(self.tools()))
        if not calls:
            return Step(done=True)
        messages, errors = [], 0
        for index, call in enumerate(calls):
            content, failed = await self.call_tool(call) if index < self.max_tool_calls else (None, True)
            if content is None:
                content = f"error: at most {self.max_tool_calls} tool calls a turn"
            errors += failed
            messages.append({"role": "tool", "content": content})
        return Step(messages=messages, tool_calls=len(calls), tool_errors=errors)

    async def call_tool(self, call: ToolCall) -> tuple[str, bool]:
        """(the result's text, whether it is an error)."""
        if call.error is not None:
            return f"error: {call.error}", True
        method = self.tools().get(call.name)
        if method is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.tools())})", True
        if call.name in self.process_tools:
            arguments = call.arguments
            if isinstance(arguments, str):  # the tag format: the one string is the first parameter
                try:
                    arguments = tag_arguments(self.process_tools[call.name], arguments)
                except (ValueError, ImportError, AttributeError) as e:
                    return f"error: {call.name}: {e}", True
            result = await self.runner().call(call.name, arguments)
            return result.content, result.error is not None
        bound = getattr(self, call.name)
        args, kwargs = ((call.arguments,), {}) if isinstance(call.arguments, str) else ((), call.arguments)
        try:
            if inspect.iscoroutinefunction(bound):
                result = await bound(*args, **kwargs)
            else:  # in a thread: a slow tool must not stall the engine's event loop, which runs every episode
                result = await asyncio.to_thread(bound, *args, **kwargs)
        except TypeError as e:
            return f"error: {call.name}: {e}", True
        except Exception as e:
            return f"error: {call.name} raised {type(e).__name__}: {str(e)[:200]}", True
        return str(result), False

    async def close(self) -> None:
        pass


def tag_arguments(ref: str, text: str) -> dict[str, str]:
    """The keyword arguments of a ``tag`` call's one string to the function ``ref`` names: its
    first parameter, or none for a function without parameters called with nothing."""
    parameters = _parameters(ref)
    if parameters:
        return {parameters[0]: text}
    if text.strip():
        raise ValueError(f"the tool takes no argument, and was given {text[:40]!r}")
    return {}


@functools.cache
def _parameters(ref: str) -> list[str]:
    return list(inspect.signature(load_tool(ref)).parameters)


def load_environment_class(path: str) -> type:
    """The class at ``module:Class``; a ValueError names what is wrong."""
    cls = import_class(path, "environment.cls")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment.cls ({path!r}) must define async {' and '.join(missing)} (see Environment)")
    return cls
