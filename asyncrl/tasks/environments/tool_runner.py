"""Tool calls run in a child process, so that no tool can kill or hang the generator.

``ToolRunner(tools)`` runs the functions ``tools`` names (tool name -> ``module:function``) in one
long-lived child process (``asyncrl.tasks.environments.tool_child``: a plain subprocess speaking
JSON lines, so nothing forks the generator's threads), started on the first call, with an
address-space limit (``memory_bytes``). ``await runner.call(name, arguments)`` calls one with
keyword ``arguments`` and always returns a ``ToolResult``, never raises: every failure is an
error result whose ``content`` tells the model what went wrong, and whose ``error`` labels it:

=================  ============================================================================
``unknown_tool``   no tool has that name
``bad_arguments``  the arguments are not a JSON object, or do not fit the function's signature
``load_failed``    the tool's module did not import in the child (a configuration error)
``exception``      the function raised: the content names the exception's type and message
``timeout``        no result within ``timeout_s``: the child is killed, the next call starts a fresh one
``crashed``        the child exited (``os._exit``, a signal, out of memory): a fresh one next call
``bad_result``     the function returned something that is not a JSON value
``closed``         the runner was closed
=================  ============================================================================

A result is a str as it is, any other JSON value as JSON text. One longer than
``max_result_chars`` is cut to that length, ending in ``…[truncated]``: not an error (the model
gets what fits, and the call is counted in ``truncated``).

Calls are serialized: one child runs one call at a time, the others wait their turn in the event
loop (an ``asyncio.Lock``; no thread is held while waiting), and the pipe I/O runs in a worker
thread, so the loop never blocks. Make several runners to run tool calls in parallel. Every wait is
bounded: a fresh child's start by ``startup_s``, a call by ``timeout_s``, the reaping of a killed
child by ``KILL_WAIT_S``. A runner is used from one event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from asyncrl.tasks.environments.tool_child import split_ref

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""Seconds to wait for a killed child to be reaped."""

MIN_MEMORY_BYTES = 64 << 20
"""The smallest ``memory_bytes``: the interpreter alone maps tens of MiB."""


@dataclass
class ToolResult:
    """The answer to one tool call."""

    content: str
    """What goes back to the model as the observation: the result, or a short error message."""
    error: str | None
    """None on success, else why it failed (a label of the module docstring's table)."""
    seconds: float
    """Seconds the call took once its turn came (a fresh child's start included); 0.0 for one
    refused before reaching the child."""


class ToolRunner:
    """Tools run in one child process with a time and a memory limit (see the module docstring)."""

    def __init__(
        self,
        tools: dict[str, str],
        timeout_s: float = 10.0,
        memory_bytes: int | None = 1 << 30,
        max_result_chars: int = 4000,
        startup_s: float = 30.0,
    ):
        if not tools:
            raise ValueError("tools must name at least one tool (name -> 'module:function')")
        for name, ref in tools.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tool name ({name!r}) must be a non-empty str")
            split_ref(ref)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        if startup_s <= 0:
            raise ValueError(f"startup_s ({startup_s}) must be > 0")
        if memory_bytes is not None and memory_bytes < MIN_MEMORY_BYTES:
            raise ValueError(f"memory_bytes ({memory_bytes}) must be None or >= {MIN_MEMORY_BYTES} (64 MiB)")
        if max_result_chars < 64:
            raise ValueError(f"max_result_chars ({max_result_chars}) must be >= 64")
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_result_chars = max_result_chars
        self.startup_s = startup_s
        self.calls = 0
        self.errors: Counter[str] = Counter()
        self.truncated = 0
        self.restarts = 0
        """Children started after the first (each after a timeout or a crash)."""
        self._turn = asyncio.Lock()  # the queue of calls, in the event loop
        self._io = threading.Lock()  # the child and its pipes: a cancelled call's thread may still hold them
        self._proc: subprocess.Popen | None = None
        self._failed: dict[str, str] = {}
        self._warned: set[str] = set()
        self._started = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The running child's PID, None when there is none."""
        return None if self._proc is None else self._proc.pid

    async def call(self, name: str, arguments: dict) -> ToolResult:
        """Run tool ``name`` with keyword ``arguments``; waits for its turn, then at most
        ``timeout_s`` (plus ``startup_s`` when a fresh child starts)."""
        self.calls += 1
        label = str(name)[:100]
        if self._closed:
            return self._refused("closed", "error: the tools are shut down")
        if name not in self.tools:
            known = ", ".join(sorted(self.tools))
            return self._refused("unknown_tool", f"error: there is no tool named {label!r} (the tools are: {known})")
        if not isinstance(arguments, dict):
            return self._refused(
                "bad_arguments",
                f"error: the arguments of {label} must be a JSON object, not a {type(arguments).__name__}",
            )
        try:
            request = json.dumps({"tool": name, "arguments": arguments}, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            return self._refused("bad_arguments", f"error: the arguments of {label} are not JSON: {e}"[:300])
        if not all(isinstance(key, str) for key in arguments):
            return self._refused("bad_arguments", f"error: the argument names of {label} must be strings")
        async with self._turn:
            return await asyncio.to_thread(self._run, name, request)

    def _refused(self, error: str, content: str) -> ToolResult:
        self.errors[error] += 1
        return ToolResult(content=content, error=error, seconds=0.0)

    def _run(self, name: str, request: str) -> ToolResult:
        """One call in the child, from a worker thread."""
        bound = self.startup_s + self.timeout_s + 2 * KILL_WAIT_S  # the longest a call can hold the child
        if not self._io.acquire(timeout=bound):
            return self._refused("timeout", f"error: the tool {name} did not get its turn within {bound:.3g} s")
        start = time.monotonic()
        try:
            error, content = self._exchange(name, request)
        finally:
            self._io.release()
        if error is not None:
            self.errors[error] += 1
        return ToolResult(content=content, error=error, seconds=time.monotonic() - start)

    def _exchange(self, name: str, request: str) -> tuple[str | None, str]:
        """(error label or None, content) of one call; the caller holds ``_io``."""
        if self._closed:
            return "closed", "error: the tools are shut down"
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            trouble = self._start()
            if trouble is not None:
                return "crashed", f"error: the tool {name} is unavailable ({trouble})"
        if name in self._failed:
            return "load_failed", f"error: the tool {name} is unavailable (it did not load: {self._failed[name]})"
        try:
            self._proc.stdin.write(request.encode())
            self._proc.stdin.flush()
            line = self._read_line(self.timeout_s)
        except (BrokenPipeError, EOFError, OSError):
            return "crashed", f"error: the tool {name} crashed ({self._died()})"
        if line is None:
            self._kill()
            return "timeout", f"error: the tool {name} took longer than {self.timeout_s:g} s"
        try:
            reply = json.loads(line)
        except ValueError:
            self._kill()
            return "crashed", f"error: the tool {name} crashed (its process answered {line[:80]!r})"
        if "content" in reply:
            self.truncated += reply["truncated"]
            return None, reply["content"]
        error, detail = reply["error"], reply["detail"]
        if error == "out_of_memory":
            limit = "" if self.memory_bytes is None else f" (limit {self.memory_bytes / (1 << 20):g} MiB)"
            self._died()
            return "crashed", f"error: the tool {name} ran out of memory{limit}"
        if error == "exception":
            return error, f"error: the tool {name} raised {detail}"
        if error == "bad_arguments":
            return error, f"error: bad arguments for the tool {name}: {detail}"
        return error, f"error: the tool {name} {detail}"  # bad_result: "returned a set, not a JSON value"

    def _start(self) -> str | None:
        """A fresh child, ready; None, or why it did not start (then there is no child)."""
        settings = {
            "tools": self.tools,
            "path": [os.path.abspath(p) for p in sys.path if p],
            "memory_bytes": self.memory_bytes,
            "max_result_chars": self.max_result_chars,
            "parent": os.getpid(),
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.tasks.environments.tool_child", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes what a tool started too
        )
        if self._started:
            self.restarts += 1
        self._started += 1
        try:
            line = self._read_line(self.startup_s)
        except (EOFError, OSError):
            return f"its process exited at start: {self._died()}"
        if line is None:
            self._kill()
            return f"its process did not start within {self.startup_s:g} s"
        self._failed = json.loads(line)["ready"]["failed"]
        for tool, why in self._failed.items():
            if tool not in self._warned:  # once: every fresh child fails the same way
                self._warned.add(tool)
                log.warning("tool %s (%s) did not load: %s", tool, self.tools[tool], why)
        return None

    def _read_line(self, timeout_s: float) -> bytes | None:
        """The child's next reply line within ``timeout_s``; None past it, EOFError if it exited."""
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        # A reply is at most max_result_chars characters (12 bytes each at most, as the JSON escape
        # of a surrogate pair) plus a short envelope; more means the child is broken.
        limit = 12 * self.max_result_chars + 4096
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            data += chunk
            if len(data) > limit:
                raise OSError(f"a reply longer than {limit} bytes")
        return data

    def _died(self) -> str:
        """How the child ended (it closed its end: it has exited or is about to); it is reaped."""
        try:
            code = self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        self._kill()
        if code is None:
            return "its process stopped answering"
        if code < 0:
            return f"its process was killed by signal {signal.Signals(-code).name}"
        return f"its process exited with code {code}"

    def _kill(self) -> None:
        """Kill the child's process group by its PID and reap it; no-op without a child."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the child and everything it started are gone
        try:
            proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the tool process %d was killed but did not exit within %g s", proc.pid, KILL_WAIT_S)
        proc.stdin.close()
        proc.stdout.close()

    def close(self) -> None:
        """Kill the child (and what its tools started) and reap it; later calls are refused
        (``closed``). Idempotent. Waits for a call in flight to see its child die (it then
        returns ``crashed``), at most ``KILL_WAIT_S`` more."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # now, not after the call in flight
            except (ProcessLookupError, PermissionError):
                pass
        if self._io.acquire(timeout=2 * KILL_WAIT_S):
            try:
                self._kill()
            finally:
                self._io.release()
        else:
            log.warning("a tool call still held its process %g s after close", 2 * KILL_WAIT_S)
