"""The dispatcher: hands training prompts to generators, within a staleness budget.

Admission (AReaL's rule). With B groups per optimizer step, max staleness s and v the policy
version that will sample the prompt, a new prompt is admitted only while

    accepted + running < (s + v + 1) · B

where ``accepted + running`` counts groups dispatched and not dropped (dropped groups never
become a training step, so they free their slot). Taken in order, the i-th group is trained at
learner version ⌊i / B⌋ ≤ s + v, so its staleness stays within s and the buffer's gate has
nothing to drop. v is the version the *requesting generator serves* (it says so in its request),
not the learner's: a generator lags the learner by up to the broadcast period, and admitting
against the learner's version let a third of the demo's samples go stale before training.

Dispatch starts when the controller says go (every process is ready). Generators pull: each
asks for up to k prompts; a request that cannot be served yet is held until capacity opens (a
new version, a drop) or until its deadline passes, after which it is dropped unanswered because
the generator has stopped waiting for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from asyncrl.configbase import Config
from asyncrl.tasks import Prompt

log = logging.getLogger(__name__)


class DispatcherConfig(Config):
    epochs: int | None = None
    """Passes over the training prompts; None cycles forever (reshuffled each pass)."""


class Admission:
    """The staleness budget, as a pure object the service and the tests share.

    >>> a = Admission(batch_groups=4, max_staleness=1)
    >>> a.capacity()  # (1 + 0 + 1) * 4
    8
    """

    def __init__(self, batch_groups: int, max_staleness: int | None):
        if batch_groups < 1:
            raise ValueError(f"batch_groups ({batch_groups}) must be >= 1")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.version = 0
        self.dispatched = 0
        self.dropped = 0

    def capacity(self, version: int | None = None) -> int:
        """How many more groups may be dispatched now, to be sampled by ``version``
        (default: the learner's version, the most any generator can serve)."""
        if self.max_staleness is None:
            return 1 << 30
        v = self.version if version is None else min(version, self.version)
        bound = (self.max_staleness + v + 1) * self.batch_groups
        return max(0, bound - (self.dispatched - self.dropped))

    def update(self, version: int, dropped_groups: int) -> None:
        self.version = max(self.version, version)
        self.dropped = max(self.dropped, dropped_groups)


class PromptCursor:
    """Seeded passes over the prompts; the position is a (epoch, index) pair a checkpoint can keep."""

    def __init__(self, prompts: list[Prompt], seed: int, epochs: int | None):
        if not prompts:
            raise ValueError("the training split has no prompts")
        self.prompts = prompts
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if self.index == len(self._order):
                if self.epochs is not None and self.epoch + 1 >= self.epochs:
                    break
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out


@dataclass
class _Pending:
    client: bytes
    request_id: int
    generator: str
    max_prompts: int
    policy_version: int
    deadline: float


def run_dispatcher(ctx) -> None:
    """Serve prompt requests until told to stop."""
    from asyncrl.tasks import load_prompts
    from asyncrl.transport import ReplyServer, Subscriber

    cfg = ctx.cfg
    cursor = PromptCursor(load_prompts(cfg.task, "train"), cfg.run.seed, cfg.dispatcher.epochs)
    admission = Admission(cfg.learner.batch_groups, cfg.buffer.max_staleness)
    server = ReplyServer(ctx.endpoints.dispatcher, name="dispatcher.requests")
    status = Subscriber(ctx.endpoints.buffer_status, name="dispatcher.buffer_status")
    pending: list[_Pending] = []
    ctx.emit("ready")
    # Hold every request until the whole fleet is up, so no generator runs ahead alone.
    while not ctx.go_given() and not ctx.stop_requested():
        time.sleep(0.05)
    while not ctx.stop_requested():
        for _kind, body in status.recv_latest():
            admission.update(int(body["learner_version"]), int(body["dropped_groups"]))
        req = server.recv(timeout=0.05)
        if req is not None:
            client, kind, body = req
            if kind == "want_prompts":
                margin = 0.05  # answer only requests whose generator is surely still waiting
                request = _Pending(
                    client,
                    body.get("request_id"),
                    str(body.get("generator")),
                    max(1, int(body.get("max_prompts", 1))),
                    int(body.get("policy_version", admission.version)),
                    time.monotonic() + float(body.get("timeout_s", 1.0)) - margin,
                )
                # A generator waits on one request at a time: a new one replaces its older ones.
                pending = [p for p in pending if p.generator != request.generator] + [request]
        now = time.monotonic()
        pending = [p for p in pending if p.deadline > now]
        for p in [p for p in pending if admission.capacity(p.policy_version) > 0]:
            pending.remove(p)
            prompts = cursor.take(min(p.max_prompts, admission.capacity(p.policy_version)))
            rows = []
            for prompt in prompts:
                rows.append(
                    {
                        "group_id": f"g{admission.dispatched:08d}",
                        "prompt_uid": prompt.prompt_uid,
                        "text": prompt.text,
                        "answer": prompt.answer,
                        "task": prompt.task,
                    }
                )
                admission.dispatched += 1
            server.reply(p.client, "prompts", {"prompts": rows}, p.request_id)
    ctx.emit("final", dispatched=admission.dispatched, epoch=cursor.epoch, index=cursor.index)
    server.close()
    status.close()
