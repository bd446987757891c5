"""A user's reward function: how it is named, loaded and called, and the child process it runs in.

``function: "module:function"`` names a function of an importable module (installed, or on
``PYTHONPATH``); ``function: "path/to/file.py:function"`` one defined in a file, relative to the
working directory. ``load_function`` imports either; the config check calls it when the config is
read (so a typo fails then, naming the value), and the child calls it once when it starts.

The function is called once per sample with keyword arguments, and is given only those its
signature names (all of them if it takes ``**kwargs``), like trl's reward functions:

==================  ======================================================================
``completion``      the sample's text (str)
``completion_ids``  its token ids, (T,) int32 numpy array
``prompt``          the prompt text as the model saw it (str)
``prompt_ids``      the prompt's token ids, (P,) int32
``answer``          the row's reference answer (str; "" for a task without one)
``row``             the whole dataset row: every column (dict)
``task``            the task's name (in a mix of sources: the source's name)
``metadata``        the task's ``metadata`` from the config (dict)
``finish_reason``   ``stop`` or ``length``
``uid``             the sample's id
==================  ======================================================================

It may be ``async def``. It returns a number (the reward), a sequence of T numbers (per-token
rewards over ``completion_ids``; their sum is the sample's reward) or ``Unscored(reason)``.

The child (``python -m asyncrl.rewards.function_child REF``) speaks length-prefixed pickles on
the stdin and stdout it was started with: one ``("ready",)`` or ``("error", why)`` after loading,
then per request (a dict of the keyword arguments) one reply, ``("ok", float | array)``,
``("unscored", reason, detail)`` or ``("error", why)``. What the function prints goes to stderr
(the protocol keeps the original stdout to itself). It exits when its parent goes.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import struct
import sys
import threading
import time
from numbers import Real
from pathlib import Path

import numpy as np

from asyncrl.rewards.unscored import Unscored

ARGUMENTS = (
    "completion",
    "completion_ids",
    "prompt",
    "prompt_ids",
    "answer",
    "row",
    "task",
    "metadata",
    "finish_reason",
    "uid",
)
"""The keyword arguments a reward function may take (see the module docstring)."""

FORMS = "'module:function' (an importable module) or 'path/to/file.py:function' (a file)"
HEADER = struct.Struct(">I")


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ("pkg.mod", "fn"); an error naming ``ref`` and the rule otherwise."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"function ({ref!r}) must be {FORMS}")
    return target, name


def is_file_ref(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def resolve_ref(ref: str) -> str:
    """``ref`` with a file's path made absolute (against the working directory), so the run's
    resolved config names the same file wherever it is read again."""
    target, name = split_ref(ref)
    if not is_file_ref(target):
        return ref
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_file():
        raise ValueError(f"function ({ref!r}): the file {str(path)!r} does not exist (relative to {Path.cwd()})")
    return f"{path.resolve()}:{name}"


def load_function(ref: str):
    """The callable ``ref`` names, imported here; errors name ``ref`` and what went wrong."""
    target, name = split_ref(ref)
    try:
        if is_file_ref(target):
            path = Path(resolve_ref(ref).rpartition(":")[0])
            module_name = f"asyncrl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module  # pickle and dataclasses look modules up there
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as e:
        hint = (
            "" if is_file_ref(target) else " (is the module on PYTHONPATH? a file is named as path/to/file.py:function)"
        )
        raise ValueError(f"function ({ref!r}) does not import: {type(e).__name__}: {e}{hint}") from None
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"function ({ref!r}): {target} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"function ({ref!r}): {name} is a {type(fn).__name__}, not a callable")
    return fn


def accepted(fn) -> tuple[str, ...] | None:
    """The keyword arguments ``fn`` takes (None: all, it has ``**kwargs``); an error when it
    requires one that is not given (see ``ARGUMENTS``)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    unknown = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind is not p.VAR_POSITIONAL
        and (p.kind is p.POSITIONAL_ONLY or p.name not in ARGUMENTS)
    ]
    if unknown:
        raise ValueError(
            f"reward function {getattr(fn, '__qualname__', fn)!r} requires {unknown}, which are not among "
            f"the keyword arguments it is called with: {list(ARGUMENTS)}"
        )
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return tuple(n for n in names if n in ARGUMENTS)


def normalize(result) -> tuple:
    """A function's return value -> the reply it travels as (see the module docstring)."""
    if isinstance(result, Unscored):
        return ("unscored", str(result.reason), str(getattr(result, "detail", "")))
    if isinstance(result, (bool, Real, np.number)):
        return ("ok", float(result))
    if isinstance(result, (list, tuple, np.ndarray)):
        try:
            values = np.asarray(result, dtype=np.float32)
        except (TypeError, ValueError) as e:
            return ("unscored", "python_bad_result", f"a sequence that is not numbers: {e}"[:200])
        if values.ndim != 1:
            return ("unscored", "python_bad_result", f"per-token rewards must be 1-D, got shape {values.shape}")
        return ("ok", values)
    return (
        "unscored",
        "python_bad_result",
        f"returned a {type(result).__name__}: must be a number, a sequence of numbers or Unscored",
    )


def call(fn, names: tuple[str, ...] | None, kwargs: dict, loop: asyncio.AbstractEventLoop) -> tuple:
    """Call ``fn`` with the arguments it takes; its reply (an exception is an ``error`` reply)."""
    given = kwargs if names is None else {k: kwargs[k] for k in names if k in kwargs}
    try:
        result = fn(**given)
        if inspect.isawaitable(result):
            result = loop.run_until_complete(result)
        return normalize(result)
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}"[:300])


# -- the child process ----------------------------------------------------------------------------


def read_frame(stream):
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return pickle.loads(stream.read(HEADER.unpack(header)[0]))


def write_frame(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _exit_with_parent(parent: int) -> None:
    """Die with the reward worker: by the kernel's parent-death signal where there is one
    (Linux), else by noticing within a second that the parent changed."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(ref: str, parent: int) -> None:
    _exit_with_parent(parent)
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the function's prints go to stderr
    try:
        fn = load_function(ref)
        names = accepted(fn)
    except Exception as e:
        write_frame(replies, ("error", str(e)[:300]))
        return
    loop = asyncio.new_event_loop()
    write_frame(replies, ("ready",))
    while (kwargs := read_frame(requests)) is not None:
        write_frame(replies, call(fn, names, kwargs, loop))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
