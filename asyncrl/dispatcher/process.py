"""The dispatcher: hands training prompts to generators, within a staleness budget.

Dispatch starts when the controller says go (every process is ready). Generators pull: each
asks for up to k prompts; a request that cannot be served yet is held until capacity opens (a
new version, a drop) or until its deadline passes, after which it is dropped unanswered because
the generator has stopped waiting for it. Admission is ``asyncrl.dispatcher.admission``'s rule.

At-least-once dispatch (``asyncrl.dispatcher.outstanding``): until a group is settled for good its
prompt row is kept; deaths the controller reports and leases that run out send the rows that may
have been lost out again, first, under the same group id. Its part of a checkpoint is the cursor,
the counters and those rows (``asyncrl.dispatcher.checkpoint``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.channels import BufferStatusFeed, PromptRequests
from asyncrl.dispatcher.checkpoint import restore_dispatcher, save_dispatcher
from asyncrl.dispatcher.context import DispatcherContext
from asyncrl.dispatcher.cursor import MixedCursor, PromptCursor, make_cursor
from asyncrl.dispatcher.outstanding import Outstanding
from asyncrl.rundir.ledger import group_id_of
from asyncrl.wire.messages import (
    CheckpointCommand,
    CheckpointCommittedCommand,
    CheckpointPartEvent,
    Control,
    DispatcherFinal,
    PromptRow,
    ReadyEvent,
    RequeueCommand,
    RequeuedEvent,
)

log = logging.getLogger(__name__)

LEASE_CHECK_S = 1.0
"""Seconds between two looks for groups whose lease ran out."""
READ_WAIT_S = 0.05
"""Seconds a turn waits for a request when none is queued."""
GO_POLL_S = 0.05
BUDGET_REPORT_S = 5.0
"""Seconds between two debug reports of the budget's counters."""


class Dispatcher:
    """One turn (``step``) applies commands and the buffer's news, takes requests and serves them."""

    def __init__(
        self, ctx: DispatcherContext, cursor: PromptCursor | MixedCursor, admission: Admission, outstanding: Outstanding
    ):
        self.ctx = ctx
        self.cursor, self.admission, self.outstanding = cursor, admission, outstanding
        self.requests = PromptRequests(ctx.endpoints.dispatcher)
        self.status = BufferStatusFeed(ctx.endpoints.buffer_status)
        self.nudged: dict[str, int] = {}  # generator -> the version it was last told to move on from
        self.last_lease_check = time.monotonic()
        self.last_report = time.monotonic()

    @classmethod
    def from_context(cls, ctx: DispatcherContext, model_dir: str | None) -> Dispatcher:
        from asyncrl.tasks.prompts import load_run_prompts

        cfg = ctx.cfg
        weights = {s.name: s.weight for s in cfg.task.sources}
        cursor = make_cursor(load_run_prompts(cfg, "train", model_dir), weights, cfg.run.seed, cfg.dispatcher.epochs)
        admission = Admission(cfg.learner.batch_groups, cfg.buffer.initial_staleness, cfg.dispatcher.ahead_versions)
        outstanding = Outstanding(
            lease_s=cfg.dispatcher.lease_s,
            grace_s=cfg.dispatcher.requeue_grace_s,
            keep_trained=cfg.checkpoint.every_steps > 0,
        )
        if ctx.resume_dir is not None:
            restored = restore_dispatcher(ctx.resume_dir, cursor, admission, outstanding, cfg.buffer.auto)
            log.info("dispatcher: resumed from %s: %s", ctx.resume_dir, restored)
        return cls(ctx, cursor, admission, outstanding)

    def wait_for_go(self) -> None:
        """Hold every request until the whole fleet is up, so no generator runs ahead alone."""
        while not self.ctx.go_given() and not self.ctx.stop_requested():
            time.sleep(GO_POLL_S)

    def step(self) -> None:
        for command in self.ctx.commands():
            self.on_command(command)
        self.settle_from_buffer()
        self.hold_requests()
        now = time.monotonic()
        self.requeue_expired(now)
        self.requests.expire(now)
        self.serve(now)
        self.nudge_behind()
        self.report_budget(now)

    def report_budget(self, now: float) -> None:
        """Every few seconds, at debug level: the budget's counters and what is outstanding, by
        state (what a run that drops too much as stale is diagnosed from)."""
        if now - self.last_report <= BUDGET_REPORT_S or not log.isEnabledFor(logging.DEBUG):
            return
        self.last_report = now
        a, states = self.admission, Counter(e.state for e in self.outstanding.entries.values())
        log.debug(
            "dispatcher: version %d dispatched %d dropped %d capacity %d outstanding %s again %d unsent %d",
            a.version,
            a.dispatched,
            a.dropped,
            a.capacity(None, len(self.outstanding.unsent)),
            dict(states),
            len(self.outstanding.again),
            len(self.outstanding.unsent),
        )

    def settle_from_buffer(self) -> None:
        """Slots are freed by the groups this dispatcher sees retired, by id: the buffer's own
        count restarts with it and counts every copy of a group dispatched again."""
        for status in self.status.latest():
            if status.max_staleness is not None and status.max_staleness != self.admission.max_staleness:
                log.info("dispatcher: staleness bound %s -> %d", self.admission.max_staleness, status.max_staleness)
                self.admission.set_bound(status.max_staleness)
            self.admission.update(status.learner_version)
            self.admission.dropped += self.outstanding.settle(status.inserted, status.dropped, status.trained)
            for version, gids in status.trained:
                self.admission.count_trained(version, len(gids))

    def hold_requests(self) -> None:
        for client, request in self.requests.take(READ_WAIT_S):
            # Groups the generator dropped (invalid) are settled: their reason is in its ledger.
            self.admission.dropped += self.outstanding.settle(dropped=request.dropped)
            self.requests.hold(client, request, self.admission.version)

    def requeue_expired(self, now: float) -> None:
        if now - self.last_lease_check <= LEASE_CHECK_S:
            return
        self.last_lease_check = now
        if n := self.outstanding.requeue("expired", now=now):
            log.warning("dispatcher: %d groups unseen by the buffer past their lease: dispatching again", n)

    def serve(self, now: float) -> None:
        for request in list(self.requests.pending):
            rows = self.rows_for(request.max_prompts, request.policy_version)
            if not rows:
                continue
            for row in rows:
                self.outstanding.dispatched(row, request.generator, now)
            self.ctx.ledger.write("dispatched", [r["group_id"] for r in rows], generator=request.generator)
            self.requests.answer(request, rows)

    def rows_for(self, max_prompts: int, version: int) -> list[PromptRow]:
        """Groups to hand out again come first, but only to a
        generator whose weights are recent enough: a restarted one starts from the initial
        weights, and what it sampled before loading the newest would only be dropped as stale.
        Both take slots of the budget of ``version``: groups sent again after a restore or a
        death are charged like new prompts, so no more run than can be trained within the bound."""
        admission, outstanding = self.admission, self.outstanding
        room = min(max_prompts, admission.capacity(version, len(outstanding.unsent)))
        rows = outstanding.take_again(room) if admission.may_sample(version) else []
        room = min(max_prompts - len(rows), admission.capacity(version, len(outstanding.unsent)))
        for prompt in self.cursor.take(room) if room > 0 else []:
            row = PromptRow(
                group_id=group_id_of(admission.dispatched),
                prompt_uid=prompt.prompt_uid,
                text=prompt.text,
                answer=prompt.answer,
                task=prompt.task,
            )
            if prompt.columns is not None:
                row["columns"] = prompt.columns
            rows.append(row)
            admission.dispatched += 1
        return rows

    def nudge_behind(self) -> None:
        """A generator held at a version the budget has used up is answered at once, empty, so it
        loads the newer weights and asks again instead of waiting out its request (in the
        synchronous mode that wait idled every generator at every step). Once per version, so a
        generator whose newer weights are not published yet does not spin."""
        for p in [
            p
            for p in self.requests.pending
            if self.admission.behind(p.policy_version, len(self.outstanding.unsent))
            and self.nudged.get(p.generator) != p.policy_version
        ]:
            self.nudged[p.generator] = p.policy_version
            self.requests.answer(p, [], learner_version=self.admission.version)

    def on_command(self, command: Control) -> None:
        ctx, outstanding = self.ctx, self.outstanding
        if isinstance(command, RequeueCommand):
            scope, generator, ack = command.scope, command.generator, command.id
            if ack in outstanding.handled:  # the controller repeats until it hears back
                ctx.emit(RequeuedEvent(scope=scope, generator=generator, groups=0, id=ack))
                return
            outstanding.handled.append(ack)
            n = outstanding.requeue(scope, generator, now=time.monotonic())
            log.warning("dispatcher: %s (%s): %d groups to dispatch again", scope, generator, n)
            if scope in ("in_flight", "buffered") and outstanding.grace_s > 0:
                log.warning(
                    "dispatcher: those not yet in the buffer go out again if unseen for %.0f s", outstanding.grace_s
                )
            ctx.emit(RequeuedEvent(scope=scope, generator=generator, groups=n, id=ack))
        elif isinstance(command, CheckpointCommand):
            path = Path(command.dir) / "dispatcher.json"
            if not path.exists():
                save_dispatcher(path, self.cursor, self.admission, outstanding, command.version)
            ctx.emit(CheckpointPartEvent(part="dispatcher.json", version=command.version))
        elif isinstance(command, CheckpointCommittedCommand):
            outstanding.forget_trained(command.version)
            self.admission.fold(command.version)

    def finish(self) -> None:
        # The last replies may still sit in the socket's queue: give them time to leave before the
        # socket closes (a reply lost here is a group dispatched and never sampled).
        time.sleep(0.5)
        self.ctx.emit(
            DispatcherFinal(
                dispatched=self.admission.dispatched,
                epoch=self.cursor.epoch,
                index=self.cursor.index,
                requeued=self.outstanding.requeued,
                passed_over=self.outstanding.passed_over,
            )
        )
        self.requests.close()
        self.status.close()


def run_dispatcher(ctx: DispatcherContext, model_dir: str | None = None) -> None:
    """Serve prompt requests until told to stop. ``model_dir``: the policy model, whose tokenizer
    renders and measures the prompts (``asyncrl.tasks.prompts.load_run_prompts``)."""
    dispatcher = Dispatcher.from_context(ctx, model_dir)
    ctx.emit(ReadyEvent())
    dispatcher.wait_for_go()
    while not ctx.stop_requested():
        dispatcher.step()
    dispatcher.finish()
