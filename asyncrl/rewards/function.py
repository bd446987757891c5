"""``kind: python``: a reward function the user writes, run in child processes with a timeout.

What the function is given and may return is ``asyncrl.rewards.function_child``'s docstring. Here
is how the reward worker runs it. The function is the user's code: it may hang, raise, leak or
kill its own process, and none of that may stop the worker. So it runs in ``processes`` child
processes (plain subprocesses, like math-verify's: killing one is safe, and nothing needs a
``__main__`` guard), each scoring one sample at a time; the worker's event loop only waits for
their replies, from threads, so a slow synchronous function never stalls it. Per sample:

- a reply within ``timeout_s``: its value, or ``Unscored`` with the function's own reason;
- an exception: ``Unscored("python_error", "ValueError: ...")``;
- no reply within ``timeout_s``: the child's whole process group is killed (what the function
  started dies with it) and ``Unscored("python_timeout")``; a fresh child starts on the next sample;
- the child exits (``os._exit``, a segfault, the kernel's OOM killer): ``Unscored("python_crashed")``,
  and a fresh child as well.

Unscored samples are counted per reason (``asyncrl_reward_unscored_samples_total``) and their
group is dropped by the buffer under ``reward_failed: NAME: REASON``, or scored again with
``reward.on_failure: requeue`` (only its unscored samples: the results are per sample). A fresh
child's first sample also waits ``startup_s`` for the interpreter to start and import the module.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config
from asyncrl.rewards.base import RewardResult, TimedResults
from asyncrl.rewards.function_child import HEADER, accepted, load_function, resolve_ref
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Group, Sample

log = logging.getLogger(__name__)


class PythonRewardConfig(Config):
    """Options of ``kind: python``."""

    function: str
    """'module:function' (an importable module) or 'path/to/file.py:function' (relative to the
    working directory; written absolute into the resolved config). Imported when the config is read."""
    timeout_s: float = Field(10.0, gt=0)
    """Seconds one sample may take; past it the child is killed and the sample is unscored (python_timeout)."""
    startup_s: float = Field(60.0, gt=0)
    """Extra seconds a fresh child gets for its first sample: the interpreter starts and imports the module."""
    processes: int = Field(2, ge=1)
    """Child processes per reward worker, each scoring one sample at a time."""
    min_score: float | None = None
    """Smallest valid reward; a smaller one leaves the sample unscored (``score_out_of_range``). None: no bound
    (the function's scale is its own)."""
    max_score: float | None = None
    """Largest valid reward; a larger one leaves the sample unscored (``score_out_of_range``). None: no bound."""

    @model_validator(mode="after")
    def check_range(self) -> PythonRewardConfig:
        if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be <= max_score ({self.max_score})")
        return self

    @field_validator("function")
    @classmethod
    def check_function(cls, value: str) -> str:
        ref = resolve_ref(value)
        fn = load_function(ref)
        try:
            accepted(fn)
        except ValueError as e:
            raise ValueError(f"function ({value!r}): {e}") from None
        return ref


class _Child:
    """One child process and its pipes; ``call`` is used by one thread at a time."""

    def __init__(self, ref: str, startup_s: float):
        self.ref, self.startup_s = ref, startup_s
        self.proc: subprocess.Popen | None = None
        self.ready = False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.rewards.function_child", self.ref, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes what it started too
        )
        self.ready = False

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(5)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc = None

    def _read(self, deadline: float):
        """One reply frame by ``deadline`` (monotonic); None past it, EOFError if the child exited."""
        fd = self.proc.stdout.fileno()
        data = b""
        need = HEADER.size
        header_done = False
        while True:
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, need - len(data))
                if not chunk:
                    raise EOFError
                data += chunk
            if header_done:
                return pickle.loads(data)
            need, data, header_done = HEADER.unpack(data)[0], b"", True

    def call(self, kwargs: dict, timeout_s: float) -> tuple:
        """The reply for one sample, or ``("unscored", reason, detail)`` when the child failed it."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.kill()
            self.start()
        try:
            if not self.ready:
                hello = self._read(time.monotonic() + self.startup_s)
                if hello is None:
                    self.kill()
                    return ("unscored", "python_timeout", f"the child did not start within {self.startup_s} s")
                if hello[0] != "ready":
                    self.kill()
                    return ("unscored", "python_error", str(hello[1]))
                self.ready = True
            data = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.write(HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
            reply = self._read(time.monotonic() + timeout_s)
        except (EOFError, BrokenPipeError, OSError):
            try:  # it closed its end: it has exited or is about to
                code = self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            return ("unscored", "python_crashed", f"the child process exited (code {code})")
        if reply is None:
            self.kill()
            return ("unscored", "python_timeout", f"no result within {timeout_s} s")
        return reply


def sample_arguments(group: Group, sample: Sample, metadata: dict[str, Any]) -> dict:
    """The keyword arguments of one call (``function_child.ARGUMENTS``)."""
    return {
        "completion": sample.text,
        "completion_ids": sample.response_ids,
        "prompt": group.prompt,
        "prompt_ids": group.prompt_ids,
        "answer": group.answer,
        "row": dict(group.columns or {}),
        "task": group.task,
        "metadata": metadata,
        "finish_reason": sample.finish_reason,
        "uid": sample.uid,
    }


class PythonReward:
    """A user's function (``PythonRewardConfig``) scoring each sample in a child process.

    ``task_metadata``: each task's ``metadata`` (by name), handed to the function as ``metadata``.
    """

    per_sample = True

    def __init__(self, name: str, cfg: PythonRewardConfig, task_metadata: dict[str, dict] | None = None):
        self.name, self.cfg = name, cfg
        low, high = cfg.min_score, cfg.max_score
        self.score_range = (-math.inf if low is None else low, math.inf if high is None else high)
        self.task_metadata = task_metadata or {}
        self.children = [_Child(cfg.function, cfg.startup_s) for _ in range(cfg.processes)]
        self._idle: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.failures = 0

    async def _one(self, group: Group, sample: Sample) -> tuple[RewardResult, float]:
        if self._loop is not asyncio.get_running_loop():  # a queue serves the loop it was made in
            self._idle, self._loop = asyncio.Queue(), asyncio.get_running_loop()
            for child in self.children:
                self._idle.put_nowait(child)
        kwargs = sample_arguments(group, sample, self.task_metadata.get(group.task, {}))
        child = await self._idle.get()
        start = time.perf_counter()
        try:
            reply = await asyncio.to_thread(child.call, kwargs, self.cfg.timeout_s)
        finally:
            self._idle.put_nowait(child)
        seconds = time.perf_counter() - start
        if reply[0] == "ok":
            return reply[1], seconds
        reason, detail = (reply[1], reply[2]) if reply[0] == "unscored" else ("python_error", reply[1])
        if reason.startswith("python_"):
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:  # once: the counters say how often (asyncrl_reward_unscored_samples_total)
                log.warning("reward %s: %s on sample %s: %s", self.name, reason, sample.uid, detail)
        return Unscored(reason, detail), seconds

    async def score(self, group: Group) -> list[RewardResult]:
        outcomes = await asyncio.gather(*(self._one(group, s) for s in group.samples))
        return TimedResults([r for r, _ in outcomes], [s for _, s in outcomes])

    async def close(self) -> None:
        for child in self.children:
            await asyncio.to_thread(child.kill)
