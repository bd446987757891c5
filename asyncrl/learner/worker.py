"""The learner process: batches in from the buffer, one optimizer step each, weights out.

Each step asks the buffer for ``learner.batch_groups`` groups, stating its version (the buffer
drops groups that are too stale for it), trains one staleness-corrected step, and publishes the
weights when the ``weights.schedule`` says so (every ``learner.broadcast_every`` steps by
default; see ``asyncrl.weights.schedule``), bucket by bucket through ``weights.transport``,
with the learner's probe logprobs attached when ``weights.probe`` is on. A request that times out is logged with
what it waits for and asked again; a stall beyond ``run.stall_timeout_s`` is the controller's to
judge. At the end it saves the final model as a Hugging Face directory in ``RUN_DIR/final``.

The buffer's reply carries each group's importance weight (``is_weights``), which scales that
group's loss (all 1 unless the buffer samples by priority with β > 0). When the buffer may hand
a group out more than once (``buffer.max_times_sampled != 1``), the next request carries the
new priorities of the groups just trained (their mean |advantage|), and ``trained`` counts each
sample once, by uid, while ``trained_with_reuse`` counts every time it was trained; the uids
are remembered only while their group could still come back (``buffer.max_staleness``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np

from asyncrl.metrics import (
    BUSY_SECONDS,
    LEARNER_STEP_SECONDS,
    POLICY_VERSION,
    SAMPLES,
    STALENESS,
    WEIGHT_BROADCAST_SECONDS,
    WEIGHT_BYTES,
)
from asyncrl.transport import RequestClient
from asyncrl.weights import BroadcastSchedule, make_publisher

log = logging.getLogger(__name__)

STEP_EVENT_STATS = (
    "clipfrac",
    "is_weight_mean",
    "is_weight_max",
    "is_weight_ess",
    "masked_frac",
    "behaviour_kl",
    "mismatch_kl",
    "entropy",
    "ref_kl",
    "kl_coef",
    "grad_norm",
    "value_loss",
)
"""Trainer stats that ride along in each "step" event (the controller prints some, keeps all)."""


def run_learner(ctx, model_dir: str) -> None:
    cfg = ctx.cfg
    trainer_cfg = cfg.learner.trainer.model_copy(update={"temperature": cfg.sampling.temperature})
    if cfg.simulation.learner is not None:
        from asyncrl.learner.mock_trainer import MockTrainer

        trainer = MockTrainer(cfg.simulation.learner)
    else:
        from asyncrl.learner.trainer import PolicyTrainer  # DeepSpeed loads only where it trains

        algo = cfg.algorithm
        if algo.loss_norm_tokens is None:
            algo = algo.model_copy(update={"loss_norm_tokens": cfg.sampling.max_tokens})
        trainer = PolicyTrainer(model_dir, trainer_cfg, algo, reference_address=ctx.endpoints.reference)
    buffer = RequestClient(ctx.endpoints.buffer_requests, name="learner.buffer")
    wcfg = cfg.weights
    publisher = make_publisher(wcfg, ctx.endpoints.weights, ctx.endpoints.weights_stream, ctx.run_dir)
    schedule = BroadcastSchedule(wcfg, cfg.learner.broadcast_every, cfg.buffer.max_staleness, cfg.learner.total_steps)
    trained = 0  # samples trained at least once
    trained_with_reuse = 0  # every time a sample was trained
    reuse = cfg.buffer.max_times_sampled != 1
    seen: dict[int, set[str]] = {}  # policy_version -> uids trained, while a group may come back
    priority_updates: dict | None = None
    staleness_hist: Counter[int] = Counter()
    trained_tokens = 0  # response tokens of every batch trained
    latencies: list[float] = []  # seconds from the start of sampling to the end of training, per sample
    busy_s = 0.0
    ctx.emit("ready", version=trainer.version)
    loop_start = time.monotonic()
    while trainer.version < cfg.learner.total_steps and not ctx.stop_requested():
        publisher.announce()
        wait_start = time.monotonic()
        request = {
            "num_groups": cfg.learner.batch_groups,
            "policy_version": trainer.version,
            "timeout_s": cfg.learner.batch_timeout_s,
        }
        if priority_updates is not None:
            request["priority_updates"] = priority_updates
        reply = buffer.request("want_batch", request, timeout=cfg.learner.batch_timeout_s)
        if reply is not None:
            priority_updates = None  # delivered with that request
        groups = reply[1]["groups"] if reply is not None else []
        if not groups:
            log.info(
                "learner: waiting for a batch of %d groups at version %d", cfg.learner.batch_groups, trainer.version
            )
            continue
        wait_s = time.monotonic() - wait_start
        stats = trainer.train_step(groups, weights=reply[1].get("is_weights"))
        busy_s += stats["seconds"]
        BUSY_SECONDS.labels("learner").inc(stats["seconds"])
        LEARNER_STEP_SECONDS.observe(stats["seconds"])
        POLICY_VERSION.set(trainer.version)
        n = sum(len(g.samples) for g in groups)
        trained_with_reuse += n
        trained_tokens += sum(g.num_tokens for g in groups)
        if reuse:
            trained += _count_first_time(groups, seen, trainer.version, cfg.buffer.max_staleness)
            if cfg.buffer.sampler == "prioritized" and "group_keys" in reply[1]:
                priority = [float(np.abs(a).mean()) for a in trainer.advantages(groups)]
                priority_updates = {"group_keys": reply[1]["group_keys"], "priorities": priority}
        else:
            trained += n
        SAMPLES.labels("trained").inc(n)
        for s in stats["staleness"]:
            staleness_hist[int(s)] += 1
            STALENESS.observe(s)
        now = time.time()
        latencies.extend(now - g.meta.get("sampled_at", now) for g in groups for _ in g.samples)
        if schedule.due(trainer.version):
            publish_weights(trainer, publisher, wcfg, ctx)
            schedule.published(trainer.version)
        rewards = [s.reward for g in groups for s in g.samples]
        ctx.emit(
            "step",
            version=trainer.version,
            loss=stats["loss"],
            reward=sum(rewards) / len(rewards),
            samples=n,
            wait_s=wait_s,
            step_s=stats["seconds"],
            staleness_mean=sum(stats["staleness"]) / len(stats["staleness"]),
            staleness_max=max(stats["staleness"]),
            **{k: v for k, v in stats.items() if k in STEP_EVENT_STATS},
        )
    wall = time.monotonic() - loop_start
    trainer.save_pretrained(ctx.run_dir / "final")
    ctx.emit("done", version=trainer.version)
    # Until the controller stops us (after the buffer): keep announcing the last version so every
    # generator hears it, and take any batch that still arrives (a reply to a request that timed
    # out), which is held, untrained, rather than lost in the socket.
    held = 0
    while not ctx.stop_requested():
        publisher.announce()
        late = buffer.receive(timeout=0.1)
        if late is not None and late[0] == "batch":
            held += sum(len(g.samples) for g in late[1]["groups"])
    ctx.emit(
        "final",
        trained=trained,
        trained_with_reuse=trained_with_reuse,
        held=held,
        version=trainer.version,
        staleness_hist={str(k): v for k, v in sorted(staleness_hist.items())},
        latency_s=latency_summary(latencies),
        trained_tokens=trained_tokens,
        busy_s=busy_s,
        wall_s=wall,
    )
    buffer.close()
    publisher.close()


def publish_weights(trainer, publisher, wcfg, ctx) -> dict:
    """Publish the trainer's weights bucket by bucket, with its probe; record and report it."""
    probe = trainer.probe() if wcfg.probe else None
    stats = publisher.publish(
        trainer.weight_buckets(int(wcfg.bucket_mb * (1 << 20))),
        trainer.version,
        meta={"probe": probe} if probe is not None else None,
    )
    WEIGHT_BROADCAST_SECONDS.observe(stats["seconds"])
    WEIGHT_BYTES.inc(stats["bytes"])
    ctx.emit("broadcast", version=trainer.version, transport=publisher.transport, **stats)
    return stats


def _count_first_time(groups, seen: dict[int, set[str]], version: int, max_staleness: int | None) -> int:
    """Samples of ``groups`` never trained before, by uid; forgets uids whose group is past the
    staleness bound (the buffer has dropped it, it cannot come back), so memory stays bounded."""
    new = 0
    for g in groups:
        uids = seen.setdefault(g.policy_version, set())
        for s in g.samples:
            if s.uid not in uids:
                uids.add(s.uid)
                new += 1
    if max_staleness is not None:
        for v in [v for v in seen if version - v > max_staleness + 1]:
            del seen[v]
    return new


def latency_summary(latencies: list[float]) -> dict:
    """Mean and percentiles of the per-sample end-to-end latency (sampling start -> trained)."""
    if not latencies:
        return {}
    arr = np.asarray(latencies)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95))}
