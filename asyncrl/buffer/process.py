"""The buffer process: scored groups in (PULL), batches out on request (ROUTER), status out (PUB).

The loop is ``asyncrl.buffer.service.BufferService``; its boundaries are ``asyncrl.buffer.channels``.
A malformed request or priority update is rejected, counted in ``asyncrl_rejected_frames`` and
logged once per reason; the service keeps serving.
"""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.buffer.checkpoint import save_checkpoint_part
from asyncrl.buffer.context import BufferContext
from asyncrl.buffer.observer import BufferMetrics
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.service import BufferService
from asyncrl.wire.messages import BufferFinal, CheckpointCommand, CheckpointPartEvent, ReadyEvent
from asyncrl.wire.sockets import Publisher, ReplyServer, StreamReceiver

log = logging.getLogger(__name__)


def build_service(ctx: BufferContext) -> BufferService:
    """The buffer (restored from the checkpoint resumed from, if any) and its sockets."""
    buf = ReplayBuffer.from_config(
        ctx.cfg.buffer,
        observer=BufferMetrics(ctx.ledger),
        drop_truncated=ctx.cfg.algorithm.truncation.mode == "drop",
        partial_rollouts=ctx.cfg.generator.partial_rollouts,
    )
    if ctx.resume_dir is not None:
        buf.restore(ctx.resume_dir / "buffer")
        log.info("buffer: restored %d groups from %s", len(buf), ctx.resume_dir)
    inbox = StreamReceiver(ctx.endpoints.buffer_in, name="buffer.in")
    requests = ReplyServer(ctx.endpoints.buffer_requests, name="buffer.requests")
    status = Publisher(ctx.endpoints.buffer_status, name="buffer.status")
    service = BufferService(buf, inbox, requests, status)
    service.ledger = ctx.ledger
    return service


def run_buffer(ctx: BufferContext) -> None:
    service = build_service(ctx)
    buf = service.buf
    ctx.emit(ReadyEvent())

    def stop_or_command() -> bool:
        for command in ctx.commands():
            if isinstance(command, CheckpointCommand):
                save_checkpoint_part(buf, Path(command.dir))
                ctx.emit(CheckpointPartEvent(part="buffer", version=command.version))
        return ctx.stop_requested()

    service.serve(stop_or_command)
    service.drain()
    ctx.ledger.write("held", buf.held_group_ids())
    if ctx.cfg.buffer.snapshot_on_exit:
        buf.snapshot(ctx.run_dir / "buffer_snapshot")
    ctx.emit(
        BufferFinal(
            **buf.reconcile(),
            removed=dict(buf.removed),
            rejected_frames=service.rejected_frames,
            priority_updates_ignored=buf.priority_updates_ignored,
            zero_variance=buf.zero_variance.report() if buf.zero_variance is not None else None,
        )
    )
    for sock in (service.inbox, service.requests, service.status):
        sock.close()
