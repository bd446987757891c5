"""The learner process: batches in from the buffer, one learner step each, weights out.

Each pass of the loop is five named steps:

1. receive a batch (``BatchRequester.receive``): ask the buffer for ``learner.batch_groups``
   groups at the learner's version, with what the last step trained; a request that times out
   is logged with what it waits for and asked again (a stall beyond ``run.stall_timeout_s`` is
   the controller's to judge); copies of groups trained before are dropped;
2. train one staleness-corrected step on it (``trainer.train_step``), each group's loss scaled by
   its importance weight, and count it (``asyncrl.learner.totals``);
3. publish the weights when ``weights.schedule`` says so (``asyncrl.learner.weights_out``);
4. checkpoint the learner's part every ``checkpoint.every_steps`` (``asyncrl.learner.checkpoint_io``);
5. report the step (``asyncrl.learner.step_report``).

Under ``buffer.max_staleness: auto``, after step 2 the step's off-policy signals may move the
staleness bound (``asyncrl.learner.staleness_control``): the new bound goes to the publication
schedule at once, and to the buffer and the dispatcher with the next request.

When the buffer may hand a group out more than once (``buffer.max_times_sampled != 1``),
``trained`` counts each sample once, by its group's id (``trained_ids``, kept in checkpoints),
while ``trained_with_reuse`` counts every time it was trained, and under a prioritized sampler
the groups' new priorities (their mean |advantage|) go back with the next request. At the end
the final model is saved as a Hugging Face directory in ``RUN_DIR/final``, and late batches are
held until the controller stops the learner.

With ``learner.ranks: N`` this loop is rank 0's (the process named ``learner``): only it talks to
the buffer, the generators and the controller, and before each thing the whole group must do
together (train a step, publish, checkpoint, finish) it sends the other ranks an order
(``asyncrl.learner.rank_orders``). Ranks 1..N-1 (``learner-1``...) run ``run_other_rank``: do
what rank 0 orders, then save the final model with it and wait for the stop.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from asyncrl.learner.batch_requests import Batch, BatchRequester
from asyncrl.learner.build_trainer import build_trainer
from asyncrl.learner.checkpoint_io import checkpoint_due, checkpoint_if_due, load_learner_part
from asyncrl.learner.context import LearnerContext
from asyncrl.learner.rank_orders import Order, OrderReceiver, OrderSender
from asyncrl.learner.sample_report import report_samples
from asyncrl.learner.staleness_control import AutoStaleness
from asyncrl.learner.step_report import record_step_metrics, report_step
from asyncrl.learner.totals import Counters, Reservoir, latency_summary
from asyncrl.learner.weights_out import WeightsOut, take_part_in_initial_probe, take_part_in_publication
from asyncrl.observability.step_stats import StepStats
from asyncrl.rundir.checkpoints import staging_dir
from asyncrl.rundir.ledger import GroupIdSet
from asyncrl.wire.messages import DoneEvent, LearnerFinal, ReadyEvent
from asyncrl.wire.sockets import RequestClient

log = logging.getLogger(__name__)


def run_learner(ctx: LearnerContext, model_dir: str) -> None:
    cfg = ctx.cfg
    trainer = build_trainer(cfg, model_dir, ctx.endpoints.reference)
    if not trainer.dp.lead:
        run_other_rank(ctx, trainer)
        return
    orders = OrderSender(trainer.dp)
    client = RequestClient(ctx.endpoints.buffer_requests, name="learner.buffer")
    weights = WeightsOut(ctx)
    counters = Counters()
    trained_ids = GroupIdSet()  # every group trained in this run's history: exactly-once across failures
    auto = AutoStaleness(cfg.buffer.auto_staleness) if cfg.buffer.auto else None
    if ctx.resume_dir is not None:
        trained_ids = load_learner_part(trainer, counters, ctx.resume_dir / "learner", auto)
        log.info("learner: resumed at version %d from %s", trainer.version, ctx.resume_dir)
    batches = BatchRequester(client, cfg, ctx.ledger, counters, trained_ids)
    if auto is not None:
        batches.max_staleness = auto.bound
        weights.schedule.set_max_staleness(auto.bound)
    latencies = Reservoir(10_000)  # seconds from the start of sampling to the end of training, per sample
    if trainer.version == 0:  # what the generators start from: they calibrate the probe on it
        weights.probe_initial(trainer)
    ctx.emit(ReadyEvent(version=trainer.version))
    if trainer.version > 0:  # generators start from the initial weights: bring them to this version
        orders.send(Order("publish", trainer.version))
        weights.publish(trainer)
    loop_start = time.monotonic()
    while trainer.version < cfg.learner.total_steps and not ctx.stop_requested():
        weights.announce()
        batch = batches.receive(trainer.version)
        if batch is None:
            orders.send(Order("idle", trainer.version))
            continue
        orders.send(Order("train", trainer.version, batch.groups, batch.is_weights))
        stats = trainer.train_step(batch.groups, weights=batch.is_weights)
        first_time, dropped_stale = batches.trained(batch, trainer.version, _priorities(cfg, trainer, batch))
        record_step_metrics(trainer.version, batch, stats)
        _count_step(batch, stats, first_time, dropped_stale, counters, latencies)
        if auto is not None:  # before publishing: the schedule publishes by the new bound
            auto.after_step(stats)  # the bound it set goes in the step's stats
            batches.max_staleness = auto.bound
            weights.schedule.set_max_staleness(auto.bound)
        if weights.due(trainer.version):
            orders.send(Order("publish", trainer.version))
            weights.publish(trainer)
        if checkpoint_due(cfg, trainer.version):
            orders.send(Order("checkpoint", trainer.version))
            checkpoint_if_due(ctx, trainer, counters, trained_ids, auto)
        report_step(ctx, batch, stats)
        report_samples(ctx, trainer.version, batch.groups, getattr(trainer, "decode", None))
    wall = time.monotonic() - loop_start
    orders.send(Order("finish", trainer.version))
    trainer.save_pretrained(ctx.run_dir / "final")
    ctx.emit(DoneEvent(version=trainer.version))
    # Until the controller stops us (after the buffer): keep announcing the last version so every
    # generator hears it, and hold any batch that still arrives.
    held = 0
    while not ctx.stop_requested():
        weights.announce()
        held += batches.take_late()
    ctx.emit(
        LearnerFinal(
            rank=0,
            trained=counters.trained,
            trained_with_reuse=counters.trained_with_reuse,
            held=held,
            dropped=dict(counters.dropped),
            version=trainer.version,
            staleness_hist={str(k): v for k, v in sorted(counters.staleness_hist.items())},
            token_staleness_hist={str(k): v for k, v in sorted(counters.token_staleness_hist.items())},
            segments_hist={str(k): v for k, v in sorted(counters.segments_hist.items())},
            stale_tokens_masked=counters.stale_tokens_masked,
            latency_s=latency_summary(latencies.values),
            trained_tokens=counters.trained_tokens,
            busy_s=counters.busy_s,
            wall_s=wall,
        )
    )
    batches.close()
    weights.close()


def run_other_rank(ctx: LearnerContext, trainer) -> None:
    """Learner rank r > 0: restore its part of the checkpoint, then do what rank 0 orders until
    it says ``finish``; save the final model with it (collective under ZeRO-3; rank 0 writes)
    and wait for the controller's stop. Its final report carries only its rank, version and
    wall time: the learner's counts are rank 0's."""
    orders = OrderReceiver(trainer.dp)
    if ctx.resume_dir is not None:
        trainer.load_state(ctx.resume_dir / "learner")
    if trainer.version == 0:
        take_part_in_initial_probe(trainer, ctx.cfg.weights, ctx.cfg.engine.max_model_len)
    ctx.emit(ReadyEvent(version=trainer.version))
    start = time.monotonic()
    while True:
        order = orders.next(trainer.version)
        if order.kind == "train":
            trainer.train_step(order.groups, weights=order.is_weights)
        elif order.kind == "publish":
            take_part_in_publication(trainer, ctx.cfg.weights, ctx.cfg.engine.max_model_len)
        elif order.kind == "checkpoint":
            trainer.save_state(staging_dir(ctx.run_dir, trainer.version) / "learner")
        elif order.kind == "finish":
            break
    trainer.save_pretrained(ctx.run_dir / "final")
    while not ctx.stop_requested():  # the controller stops the learner after the buffer
        time.sleep(0.05)
    ctx.emit(LearnerFinal(rank=trainer.dp.rank, version=trainer.version, wall_s=time.monotonic() - start))


def _priorities(cfg, trainer, batch: Batch) -> list[float] | None:
    """The trained groups' new priorities (mean |advantage|) for a prioritized buffer that may
    hand them out again; None otherwise."""
    if cfg.buffer.max_times_sampled == 1 or cfg.buffer.sampler != "prioritized" or batch.group_keys is None:
        return None
    return [float(np.abs(a).mean()) for a in trainer.advantages(batch.groups)]


def _count_step(
    batch: Batch, stats: StepStats, first_time: int, dropped_stale: int, counters: Counters, latencies: Reservoir
) -> None:
    """Add the step to the running totals: samples trained (``first_time`` of them for the first
    time: the buffer may hand a group out again; ``dropped_stale`` handed out with no token left
    to train), tokens, staleness, and each sample's latency."""
    groups = batch.groups
    counters.add_step(groups, stats, first_time, dropped_stale)
    now = time.time()
    latencies.extend(now - (g.sampled_at or now) for g in groups for _ in g.samples)
