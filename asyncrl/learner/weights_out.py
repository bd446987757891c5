"""The learner's weights out: when to publish (``weights.schedule``) and publishing them.

The learner publishes when the ``BroadcastSchedule`` says so (every ``learner.broadcast_every``
steps by default; see ``asyncrl.weights.schedule``), bucket by bucket through the
``weights.transport`` publisher, with the learner's probe logprobs attached when
``weights.probe`` is on (those of the version and of the one published before it, or of the
initial weights: a generator calibrates the probe on them, ``asyncrl.weights.probe``), and
reports each publication as a ``broadcast`` event. Between
publications it keeps announcing the current version, so a generator that joins late hears it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from asyncrl.observability.metrics import WEIGHT_BROADCAST_SECONDS, WEIGHT_BYTES
from asyncrl.weights import BroadcastSchedule, make_publisher
from asyncrl.weights.buckets import cast_buckets
from asyncrl.weights.probe import Probe
from asyncrl.weights.timeline import TimedBuckets
from asyncrl.wire.messages import BroadcastEvent

if TYPE_CHECKING:
    from asyncrl.learner.context import LearnerContext


class WeightsOut:
    """The publisher for the run's transport and the schedule that says when to use it."""

    def __init__(self, ctx: LearnerContext):
        cfg = ctx.cfg
        self.ctx = ctx
        self.wcfg = cfg.weights
        self.publisher = make_publisher(
            self.wcfg,
            ctx.endpoints.weights,
            ctx.endpoints.weights_stream,
            ctx.run_dir,
            num_subscribers=cfg.run.num_generators,
        )
        self.schedule = BroadcastSchedule(
            self.wcfg, cfg.learner.broadcast_every, cfg.buffer.initial_staleness, cfg.learner.total_steps
        )
        self.max_len = cfg.engine.max_model_len
        self.last_probe: Probe | None = None
        """The probe of the last version published (or of the initial weights)."""

    def probe_initial(self, trainer) -> None:
        """The probe of the weights the generators start from (collective under ZeRO-3: other
        ranks call ``take_part_in_initial_probe``), sent as the first version's previous one."""
        if self.wcfg.probe:
            body = trainer.probe(self.max_len)
            if body is not None:
                self.last_probe = Probe(**body, version=trainer.version)

    def announce(self) -> None:
        """Announce the last version published (cheap; call it on every pass of a loop)."""
        self.publisher.announce()

    def due(self, version: int) -> bool:
        """Whether the schedule says ``version`` is to be published."""
        return self.schedule.due(version)

    def publish_if_due(self, trainer) -> None:
        """Publish the trainer's weights if the schedule says its version is due."""
        if self.due(trainer.version):
            self.publish(trainer)

    def publish(self, trainer) -> dict:
        """Publish the trainer's weights now (and tell the schedule)."""
        probe = None
        published_at = time.time()  # wall clock: the controller compares it with each generator's served_at
        if self.wcfg.probe:
            body = trainer.probe(self.max_len)
            if body is not None:
                last = self.last_probe
                probe = (
                    Probe(**body, version=trainer.version)
                    if last is None
                    else last.after(trainer.version, body["logprobs"])
                )
                self.last_probe = probe
        stats = publish_weights(trainer, self.publisher, self.wcfg, self.ctx, probe, published_at)
        self.schedule.published(trainer.version)
        return stats

    def close(self) -> None:
        self.publisher.close()


def publish_weights(trainer, publisher, wcfg, ctx: LearnerContext, probe: Probe | None, published_at: float) -> dict:
    """Publish the trainer's weights bucket by bucket, with ``probe`` (computed since
    ``published_at``); record and report it."""
    probe_s = time.time() - published_at
    buckets = TimedBuckets(cast_buckets(trainer.weight_buckets(int(wcfg.bucket_mb * (1 << 20))), wcfg.dtype))
    meta = {"probe": probe.to_wire()} if probe is not None else None
    adapter = getattr(trainer, "adapter_meta", None)  # LoRA: how to load the adapter (asyncrl.models.lora)
    if adapter is not None:
        meta = {**(meta or {}), "adapter": adapter}
    stats = publisher.publish(buckets, trainer.version, meta=meta)
    WEIGHT_BROADCAST_SECONDS.observe(stats["seconds"])
    WEIGHT_BYTES.inc(stats["bytes"])
    ctx.emit(
        BroadcastEvent(
            version=trainer.version,
            transport=publisher.transport,
            published_at=published_at,
            gather_s=buckets.seconds,
            probe_s=probe_s,
            bytes=stats["bytes"],
            buckets=stats["buckets"],
            seconds=stats["seconds"],
            extra_bytes=stats.get("extra_bytes"),
        )
    )
    return stats


def take_part_in_initial_probe(trainer, wcfg, max_len: int) -> None:
    """A learner rank other than 0 while rank 0 probes the initial weights (``WeightsOut.probe_initial``):
    the forward pass is a collective under ZeRO-3."""
    if trainer.cfg.zero_stage == 3 and wcfg.probe:
        trainer.probe(max_len)


def take_part_in_publication(trainer, wcfg, max_len: int) -> None:
    """A learner rank other than 0 while rank 0 publishes: under ZeRO-3 the probe's forward pass
    and each bucket's gather are collectives, so it runs them too and drops what they give;
    under ZeRO 0-2 every rank holds the whole weights and rank 0 reads its own alone.

    Rank 0 publishes alone, whatever the transport: one sender per version keeps the generators'
    side (one subscriber socket, one NCCL group with learner rank 0) as with one rank, and a
    bucket gathered to every rank costs the same all-gather whoever sends it."""
    if trainer.cfg.zero_stage != 3:
        return
    if wcfg.probe:
        trainer.probe(max_len)
    for _bucket in trainer.weight_buckets(int(wcfg.bucket_mb * (1 << 20))):
        pass
