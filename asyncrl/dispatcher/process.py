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

At-least-once dispatch. Until a group is settled for good (dropped with a reason, or trained by a
step a committed checkpoint holds) the dispatcher keeps its prompt row (``Outstanding``), and
learns what became of it from the buffer's status (inserted, dropped, trained). When the
controller reports a death, or a group's lease runs out unseen, the rows that may have been lost
are dispatched again, first, under the same group id; their slots were admitted already. Its
part of a checkpoint is the cursor, the counters and those rows (``save_dispatcher``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.dispatcher.context import DispatcherContext
from asyncrl.rundir.ledger import group_id_of
from asyncrl.tasks.prompts import Prompt

log = logging.getLogger(__name__)


class DispatcherConfig(Config):
    epochs: int | None = None
    """Passes over the training prompts; None cycles forever (reshuffled each pass)."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a dispatched group may go unseen by the buffer before its prompt is dispatched
    again (a safety net: deaths the controller sees are acted on at once)."""


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
        self._buffer_dropped: int | None = None  # the last count the buffer reported

    def capacity(self, version: int | None = None) -> int:
        """How many more groups may be dispatched now, to be sampled by ``version``
        (default: the learner's version, the most any generator can serve)."""
        if self.max_staleness is None:
            return 1 << 30
        v = self.version if version is None else min(version, self.version)
        bound = (self.max_staleness + v + 1) * self.batch_groups
        return max(0, bound - (self.dispatched - self.dropped))

    def behind(self, version: int) -> bool:
        """True when a generator serving ``version`` gets nothing now but would at the learner's
        version: it should load the newer weights and ask again rather than wait."""
        return version < self.version and self.capacity(version) == 0 and self.capacity() > 0

    def update(self, version: int, dropped_groups: int | None = None) -> None:
        """The buffer's status: the learner's version and the groups it has dropped so far. That
        count starts again from 0 when a dead buffer is restarted empty, and from its snapshot's
        count after a restore: only its increases are added here."""
        self.version = max(self.version, version)
        if dropped_groups is None:
            return
        last, self._buffer_dropped = self._buffer_dropped, dropped_groups
        if last is None:  # first report: the larger of our own (restored) count and the buffer's
            self.dropped = max(self.dropped, dropped_groups)
        elif dropped_groups >= last:
            self.dropped += dropped_groups - last
        else:  # a buffer restarted empty counts from 0 again
            self.dropped += dropped_groups

    def may_sample(self, version: int) -> bool:
        """Whether groups sampled by ``version`` would be within the staleness bound now."""
        return self.max_staleness is None or self.version - version <= self.max_staleness


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


DISPATCHED, BUFFERED, TRAINED = "dispatched", "buffered", "trained"


@dataclass
class _Entry:
    row: dict
    state: str = DISPATCHED
    generator: str = ""
    at: float = 0.0
    version: int = -1
    """For TRAINED: the learner version of the step that trained it."""


@dataclass
class Outstanding:
    """Every group dispatched and not yet settled for good, and the queue of groups to hand out again.

    A group is settled for good when it is dropped with a reason, or trained by a step that a
    committed checkpoint holds (``forget_trained``). Until then its prompt row is kept, so that
    whatever is lost downstream — a generator or reward worker killed with its groups, a buffer
    restarted empty, a learner restored to an older version — is dispatched again under the same
    group id. What the buffer and learner report arrives on a PUB socket that may drop messages
    under load; a missed report only makes a group go out again, and ids keep the copy from being
    trained twice.
    """

    lease_s: float = 600.0
    entries: dict[str, _Entry] = field(default_factory=dict)
    again: deque = field(default_factory=deque)
    """Rows to dispatch again, before any new prompt."""
    requeued: int = 0
    passed_over: int = 0
    """Rows queued again but not sent: their group was settled meanwhile (``take_again``)."""
    keep_trained: bool = True
    """Keep trained groups until a checkpoint holds them (False when the run takes no checkpoints:
    nothing could bring them back, and memory stays flat)."""
    handled: deque = field(default_factory=lambda: deque(maxlen=256))
    """Ids of requeue commands already acted on."""

    def dispatched(self, row: dict, generator: str, now: float) -> None:
        e = self.entries.get(row["group_id"])
        if e is None:
            self.entries[row["group_id"]] = _Entry(row, DISPATCHED, generator, now)
        else:
            e.state, e.generator, e.at = DISPATCHED, generator, now

    def settle(self, body: dict) -> int:
        """Apply a status report: ``inserted``, ``dropped`` ids, ``trained`` [version, ids] pairs.
        Returns how many outstanding groups it retires untrained: each frees its admission slot
        once, however many copies of it are dropped (a copy of a trained group frees nothing)."""
        retired = 0
        for gid in body.get("inserted", ()):
            e = self.entries.get(gid)
            if e is not None and e.state == DISPATCHED:
                e.state = BUFFERED
        for gid in body.get("dropped", ()):
            e = self.entries.get(gid)
            if e is not None and e.state != TRAINED:
                del self.entries[gid]
                retired += 1
        for version, gids in body.get("trained", ()):
            for gid in gids:
                e = self.entries.get(gid)
                if e is not None and not self.keep_trained:
                    del self.entries[gid]
                elif e is not None:
                    e.state, e.version = TRAINED, int(version)
        return retired

    def forget_trained(self, version: int) -> None:
        """A checkpoint at ``version`` is committed: its trained groups can never come back."""
        for gid in [g for g, e in self.entries.items() if e.state == TRAINED and e.version <= version]:
            del self.entries[gid]

    def requeue(self, scope: str, generator: str | None = None, now: float | None = None) -> int:
        """Queue again the groups a failure may have lost; returns how many.

        ``generator``: those dispatched to that generator and not yet in the buffer;
        ``in_flight``: every group not yet in the buffer (a reward worker died);
        ``buffered``: every group not yet trained (the buffer died);
        ``expired``: groups not in the buffer after ``lease_s`` (``now`` required).
        """
        queued = {r["group_id"] for r in self.again}
        states = {"generator": (DISPATCHED,), "in_flight": (DISPATCHED,), "buffered": (DISPATCHED, BUFFERED)}
        if scope == "expired":
            picked = [e for e in self.entries.values() if e.state == DISPATCHED and now - e.at > self.lease_s]
        elif scope in states:
            picked = [e for e in self.entries.values() if e.state in states[scope]]
            if scope == "generator":
                picked = [e for e in picked if e.generator == generator]
        else:
            raise ValueError(f"requeue scope {scope!r} is not one of generator, in_flight, buffered, expired")
        picked = [e for e in picked if e.row["group_id"] not in queued]
        for e in picked:
            e.state, e.at = DISPATCHED, float("inf")  # not expired again while it waits in the queue
            self.again.append(e.row)
        self.requeued += len(picked)
        return len(picked)

    def take_again(self, k: int) -> list[dict]:
        """Up to ``k`` rows to dispatch again. Rows settled since they were queued are passed
        over: the original turned up in the buffer after all (a reward worker or the buffer died
        while it was on its way), was trained, or was dropped. A copy of those would only be
        sampled to be thrown away."""
        rows: list[dict] = []
        while self.again and len(rows) < k:
            row = self.again.popleft()
            e = self.entries.get(row["group_id"])
            if e is not None and e.state == DISPATCHED:
                rows.append(row)
            else:
                self.passed_over += 1
        return rows

    def to_checkpoint(self, version: int) -> list[dict]:
        """Rows a resume from a checkpoint of ``version`` must dispatch again (less what it holds)."""
        return [e.row for e in self.entries.values() if not (e.state == TRAINED and e.version <= version)]


def save_dispatcher(path: Path, cursor: PromptCursor, admission: Admission, outstanding: Outstanding, version: int):
    state = {
        "epoch": cursor.epoch,
        "index": cursor.index,
        "dispatched": admission.dispatched,
        "dropped": admission.dropped,
        "version": version,
        "rows": outstanding.to_checkpoint(version),
    }
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def restore_dispatcher(ckpt: Path, cursor: PromptCursor, admission: Admission, outstanding: Outstanding) -> dict:
    """Load the dispatcher's part of checkpoint ``ckpt``; queue again what the other parts lack."""
    from asyncrl.rundir.ledger import GroupIdSet

    state = json.loads((ckpt / "dispatcher.json").read_text())
    cursor.epoch = int(state["epoch"])
    cursor._order = cursor._permutation(cursor.epoch)
    cursor.index = int(state["index"])
    admission.dispatched = int(state["dispatched"])
    admission.dropped = int(state["dropped"])
    admission.version = int(state["version"])
    held = set(json.loads((ckpt / "buffer" / "buffer_ids.json").read_text()))
    trained = GroupIdSet.from_bytes((ckpt / "learner" / "trained_ids.bin").read_bytes())
    again = [r for r in state["rows"] if r["group_id"] not in held and r["group_id"] not in trained]
    for row in state["rows"]:
        if row["group_id"] in held:
            outstanding.entries[row["group_id"]] = _Entry(row, BUFFERED)
    for row in again:
        outstanding.entries[row["group_id"]] = _Entry(row, DISPATCHED, at=float("inf"))
        outstanding.again.append(row)
    return {"version": admission.version, "dispatched": admission.dispatched, "again": len(again)}


def run_dispatcher(ctx: DispatcherContext, model_dir: str | None = None) -> None:
    """Serve prompt requests until told to stop. ``model_dir``: the policy model, whose tokenizer
    renders and measures the prompts (``asyncrl.tasks.prompts.load_run_prompts``)."""
    from asyncrl.tasks.prompts import load_run_prompts
    from asyncrl.wire.sockets import ReplyServer, Subscriber

    cfg = ctx.cfg
    cursor = PromptCursor(load_run_prompts(cfg, "train", model_dir), cfg.run.seed, cfg.dispatcher.epochs)
    admission = Admission(cfg.learner.batch_groups, cfg.buffer.max_staleness)
    outstanding = Outstanding(lease_s=cfg.dispatcher.lease_s, keep_trained=cfg.checkpoint.every_steps > 0)
    if ctx.resume_dir is not None:
        restored = restore_dispatcher(ctx.resume_dir, cursor, admission, outstanding)
        log.info("dispatcher: resumed from %s: %s", ctx.resume_dir, restored)
    server = ReplyServer(ctx.endpoints.dispatcher, name="dispatcher.requests")
    status = Subscriber(ctx.endpoints.buffer_status, name="dispatcher.buffer_status")
    pending: list[_Pending] = []
    nudged: dict[str, int] = {}  # generator -> the version it was last told to move on from
    ctx.emit("ready")
    # Hold every request until the whole fleet is up, so no generator runs ahead alone.
    while not ctx.go_given() and not ctx.stop_requested():
        time.sleep(0.05)
    last_lease_check = time.monotonic()
    while not ctx.stop_requested():
        for command in ctx.commands():
            _on_command(ctx, command, cursor, admission, outstanding)
        for _kind, body in status.recv_latest():
            # Slots are freed by the groups this dispatcher sees retired, by id: the buffer's own
            # count restarts with it and counts every copy of a group dispatched again.
            admission.update(int(body["learner_version"]))
            admission.dropped += outstanding.settle(body)
        # Every request already queued is read before any is served: a generator that asked
        # again while the dispatcher was busy (or before go) is answered once, not once per ask,
        # else the extra answers queue up in its socket and it lags a few batches behind.
        first = server.recv(timeout=0.05)
        queued = [first] if first is not None else []
        while first is not None and len(queued) < 1000 and (more := server.recv(timeout=0)) is not None:
            queued.append(more)
        for client, kind, body in queued:
            if kind == "want_prompts":
                # Groups the generator dropped (invalid) are settled: their reason is in its ledger.
                admission.dropped += outstanding.settle({"dropped": body.get("dropped", ())})
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
        if now - last_lease_check > 1.0:
            last_lease_check = now
            if n := outstanding.requeue("expired", now=now):
                log.warning(
                    "dispatcher: %d groups unseen by the buffer for %.0f s: dispatching again", n, outstanding.lease_s
                )
        pending = [p for p in pending if p.deadline > now]
        for p in list(pending):
            # Groups to hand out again come first (they were admitted once already), but only to a
            # generator whose weights are recent enough: a restarted one starts from the initial
            # weights, and what it sampled before loading the newest would only be dropped as stale.
            rows = outstanding.take_again(p.max_prompts) if admission.may_sample(p.policy_version) else []
            room = min(p.max_prompts - len(rows), admission.capacity(p.policy_version))
            for prompt in cursor.take(room) if room > 0 else []:
                rows.append(
                    {
                        "group_id": group_id_of(admission.dispatched),
                        "prompt_uid": prompt.prompt_uid,
                        "text": prompt.text,
                        "answer": prompt.answer,
                        "task": prompt.task,
                    }
                )
                admission.dispatched += 1
            if not rows:
                continue
            pending.remove(p)
            for row in rows:
                outstanding.dispatched(row, p.generator, now)
            ctx.ledger.write("dispatched", [r["group_id"] for r in rows], generator=p.generator)
            server.reply(p.client, "prompts", {"prompts": rows}, p.request_id)
        # A generator held at a version the budget has used up is answered at once, empty, so it
        # loads the newer weights and asks again instead of waiting out its request (in the
        # synchronous mode that wait idled every generator at every step). Once per version, so
        # a generator whose newer weights are not published yet does not spin.
        for p in [
            p for p in pending if admission.behind(p.policy_version) and nudged.get(p.generator) != p.policy_version
        ]:
            pending.remove(p)
            nudged[p.generator] = p.policy_version
            server.reply(p.client, "prompts", {"prompts": [], "learner_version": admission.version}, p.request_id)
    # The last replies may still sit in the socket's queue: give them time to leave before the
    # socket closes (a reply lost here is a group dispatched and never sampled).
    time.sleep(0.5)
    ctx.emit(
        "final",
        dispatched=admission.dispatched,
        epoch=cursor.epoch,
        index=cursor.index,
        requeued=outstanding.requeued,
        passed_over=outstanding.passed_over,
    )
    server.close()
    status.close()


def _on_command(ctx: DispatcherContext, command: dict, cursor, admission, outstanding) -> None:
    kind = command.get("command")
    if kind == "requeue":
        if command.get("id") in outstanding.handled:  # the controller repeats until it hears back
            ctx.emit("requeued", scope=command["scope"], generator=command.get("generator"), groups=0, id=command["id"])
            return
        outstanding.handled.append(command.get("id"))
        n = outstanding.requeue(command["scope"], command.get("generator"))
        log.warning("dispatcher: %s (%s): %d groups to dispatch again", command["scope"], command.get("generator"), n)
        ctx.emit("requeued", scope=command["scope"], generator=command.get("generator"), groups=n, id=command.get("id"))
    elif kind == "checkpoint":
        path = Path(command["dir"]) / "dispatcher.json"
        if not path.exists():
            save_dispatcher(path, cursor, admission, outstanding, int(command["version"]))
        ctx.emit("checkpoint_part", part="dispatcher.json", version=command["version"])
    elif kind == "checkpoint_committed":
        outstanding.forget_trained(int(command["version"]))
