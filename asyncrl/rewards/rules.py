"""Rule rewards: exact match against the dataset's reference, a format check, and math-verify.

* ``ExactMatchReward`` — ``tasks.score_answer`` (addition: the stripped text equals the answer;
  gsm8k: the final number equals it numerically). Cheap: runs inline, no thread.
* ``FormatReward`` — ``value`` if the answer matches a regex (``pattern``), else 0.
* ``MathVerifyReward`` — Hugging Face ``math-verify`` (parse both, ``verify(gold, answer)``). It is
  known to hang on some inputs (sympy), and a thread cannot be killed, so it runs in a child
  process that is killed and replaced when one answer takes more than ``timeout_s``; that answer
  is ``Unscored("math_verify_timeout")``, never a 0.

``score_group`` (one exact-match pass, used before the reward interface existed) is kept for callers
that score synchronously.
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import subprocess
import sys
import threading
import time

from asyncrl.rewards.base import RewardResult, Unscored, combine
from asyncrl.tasks.answers import score_answer
from asyncrl.wire.schema import Group


def exact_match_reward(task: str, response: str, answer: str) -> float:
    """1.0 if the response's answer equals the reference, else 0.0 (see ``tasks.score_answer``)."""
    return score_answer(task, response, answer)


class ExactMatchReward:
    """Exact match of each answer against ``group.answer`` for the group's task."""

    score_range = (0.0, 1.0)

    def __init__(self, name: str = "exact_match"):
        self.name = name

    async def score(self, group: Group) -> list[RewardResult]:
        return [exact_match_reward(group.task, s.text, group.answer) for s in group.samples]

    async def close(self) -> None:
        pass


class FormatReward:
    """``value`` for an answer that matches ``pattern`` (``re.search``; DOTALL), else 0.0.

    >>> FormatReward(pattern=r"#### -?\\d+$").pattern.search("so #### 42") is not None
    True
    """

    def __init__(self, name: str = "format", pattern: str = r"####\s*-?[\d,.]+\s*$", value: float = 1.0):
        self.name = name
        self.pattern = re.compile(pattern, re.DOTALL)
        self.value = float(value)
        self.score_range = (min(0.0, self.value), max(0.0, self.value))

    async def score(self, group: Group) -> list[RewardResult]:
        return [self.value if self.pattern.search(s.text) else 0.0 for s in group.samples]

    async def close(self) -> None:
        pass


STARTUP_S = 30.0
"""Extra seconds a fresh math-verify child gets for its first answer (process start and imports)."""

# The child: one JSON line [gold, answer] in, one JSON line ["ok", 1.0] or ["error", why] out.
_CHILD = """
import json, sys
from math_verify import parse, verify
for line in sys.stdin:
    gold, answer = json.loads(line)
    try:
        out = ["ok", float(verify(parse(gold), parse(answer)))]
    except Exception as e:
        out = ["error", (type(e).__name__ + ": " + str(e))[:200]]
    sys.stdout.write(json.dumps(out) + "\\n")
    sys.stdout.flush()
"""


class MathVerifyReward:
    """``math-verify`` equivalence of each answer with ``group.answer``, in one child process.

    Per answer: write (gold, answer) to the child, wait ``timeout_s`` for its verdict; past it the
    child is killed and a fresh one started on the next answer, and this answer is unscored
    (``math_verify_timeout``). A plain subprocess rather than ``multiprocessing``: killing it is
    safe, and it needs no ``__main__`` guard in the caller. Calls are serialized (one child); run
    several workers to verify more in parallel.
    """

    child_code = _CHILD
    """The child's program (tests swap in one that hangs)."""

    score_range = (0.0, 1.0)

    def __init__(self, name: str = "math_verify", timeout_s: float = 5.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._fresh = True
        self.restarts = 0

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self.child_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._fresh = True

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None

    def verify_one(self, gold: str, answer: str) -> RewardResult:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps([gold, answer]) + "\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                return Unscored("math_verify_crashed", "the child process exited")
            # The first answer of a fresh child also waits for it to start and import math-verify.
            wait = self.timeout_s + (STARTUP_S if self._fresh else 0.0)
            ready, _, _ = select.select([self._proc.stdout], [], [], wait)
            if not ready:
                self._kill()
                self.restarts += 1
                return Unscored("math_verify_timeout", f"no verdict within {self.timeout_s} s")
            line = self._proc.stdout.readline()
            if not line:
                self._kill()
                return Unscored("math_verify_crashed", "the child process exited")
            self._fresh = False
        status, value = json.loads(line)
        return value if status == "ok" else Unscored("math_verify_error", value)

    async def score(self, group: Group) -> list[RewardResult]:
        return await asyncio.to_thread(lambda: [self.verify_one(group.answer, s.text) for s in group.samples])

    async def close(self) -> None:
        with self._lock:
            self._kill()


def score_group(group: Group) -> Group:
    """Score every sample in place by exact match; on failure set ``unscored_reason``."""
    start = time.perf_counter()
    try:
        results: list[RewardResult] = [exact_match_reward(group.task, s.text, group.answer) for s in group.samples]
    except Exception as e:  # a scorer bug must not kill the worker: the group is dropped by reason
        group.unscored_reason = f"reward_failed: {type(e).__name__}"
        group.unscored_detail = str(e)[:200]
        group.reward_s = time.perf_counter() - start
        return group
    combine(group, [("exact_match", 1.0, results, time.perf_counter() - start)])
    group.reward_s = time.perf_counter() - start
    return group
