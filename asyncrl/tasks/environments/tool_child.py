"""The child process of ``ToolRunner``: it imports the tools and runs one call at a time.

Started as ``python -m asyncrl.tasks.environments.tool_child SETTINGS`` where SETTINGS is a JSON
object: ``tools`` (name -> ``module:function``), ``path`` (the parent's ``sys.path``, appended to
this one so that the same modules import), ``memory_bytes`` (the address-space limit, or null),
``max_result_chars`` and ``parent`` (the parent's PID).

It speaks JSON lines on the stdin and stdout it was started with:

- once, after the limit is set and the tools are imported: ``{"ready": {"failed": {name: why}}}``
  (the tools that did not import, each with its error);
- per request ``{"tool": name, "arguments": {...}}`` one reply: ``{"content": str, "truncated":
  bool}`` or ``{"error": label, "detail": str}``, the label one of ``bad_arguments`` (they do not
  fit the function's signature), ``exception``, ``bad_result`` and ``out_of_memory`` (after which
  the child exits: a process that ran out of memory may hold half-built state).

What a tool prints goes to stderr (the protocol keeps the original stdout to itself). The child
exits when its stdin closes or its parent goes, whichever is noticed first.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
import threading
import time

TRUNCATED = "…[truncated]"
"""The end of a result cut to ``max_result_chars`` (counted in them)."""

DETAIL_CHARS = 300
"""Longest detail of an error reply: an exception's message can be huge."""


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ("pkg.mod", "fn"); an error naming ``ref`` and the rule otherwise."""
    module, sep, name = str(ref).partition(":")
    parts = module.split(".") + name.split(".")
    if not sep or not all(part.isidentifier() for part in parts):
        raise ValueError(f"tool function ({ref!r}) must be 'module:function', e.g. 'mypkg.tools:calc'")
    return module, name


def load(ref: str):
    """The callable ``ref`` names, imported here."""
    module, name = split_ref(ref)
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{ref} is a {type(fn).__name__}, not a callable")
    return fn


def as_content(result, max_chars: int) -> dict:
    """A tool's return value -> its reply: a str as it is, any other JSON value as JSON text."""
    if isinstance(result, str):
        text = result
    else:
        try:
            # allow_nan=False: NaN is not JSON. A tuple passes, as the list it becomes.
            text = json.dumps(result, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            why = f"returned a {type(result).__name__}, not a JSON value (str, number, bool, None, list, dict): {e}"
            return {"error": "bad_result", "detail": why[:DETAIL_CHARS]}
    if len(text) > max_chars:
        return {"content": text[: max_chars - len(TRUNCATED)] + TRUNCATED, "truncated": True}
    return {"content": text, "truncated": False}


def run(fn, arguments: dict, max_chars: int, loop: asyncio.AbstractEventLoop) -> dict:
    """One call of ``fn`` with keyword ``arguments``, as its reply."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return {"error": "bad_arguments", "detail": str(e)[:DETAIL_CHARS]}
    except ValueError:
        pass  # a builtin without a signature: the call itself says what is wrong
    try:
        result = fn(**arguments)
        if inspect.isawaitable(result):
            result = loop.run_until_complete(result)
    except MemoryError:
        return {"error": "out_of_memory", "detail": ""}
    except Exception as e:
        return {"error": "exception", "detail": f"{type(e).__name__}: {e}"[:DETAIL_CHARS]}
    try:
        return as_content(result, max_chars)
    except MemoryError:  # the JSON text of a huge result
        return {"error": "out_of_memory", "detail": ""}


def _exit_with_parent(parent: int) -> None:
    # Polled rather than the kernel's parent-death signal: that one fires when the parent's
    # *thread* that started this process exits, and the runner starts it from worker threads.
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(settings: dict) -> None:
    _exit_with_parent(settings["parent"])
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the tools' prints go to stderr
    sys.path.extend(p for p in settings["path"] if p not in sys.path)
    if settings["memory_bytes"] is not None:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = settings["memory_bytes"] if hard == resource.RLIM_INFINITY else min(settings["memory_bytes"], hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # hard too: a tool cannot raise it again
    tools, failed = {}, {}
    for name, ref in settings["tools"].items():
        try:
            tools[name] = load(ref)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"[:DETAIL_CHARS]

    def send(reply: dict) -> None:
        replies.write(json.dumps(reply) + "\n")
        replies.flush()

    send({"ready": {"failed": failed}})
    loop = asyncio.new_event_loop()
    max_chars = settings["max_result_chars"]
    for line in sys.stdin:
        request = json.loads(line)
        reply = run(tools[request["tool"]], request["arguments"], max_chars, loop)
        send(reply)
        if reply.get("error") == "out_of_memory":
            os._exit(1)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
