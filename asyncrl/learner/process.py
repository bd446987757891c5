"""The learner process: batches in from the buffer, one learner step each, weights out.

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

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.observability.metrics import (
    BUSY_SECONDS,
    LEARNER_STEP_SECONDS,
    POLICY_VERSION,
    SAMPLES,
    STALENESS,
    WEIGHT_BROADCAST_SECONDS,
    WEIGHT_BYTES,
    record_learner_step,
)
from asyncrl.rundir.checkpoints import staging_dir
from asyncrl.rundir.ledger import GroupIdSet
from asyncrl.tasks.answers import batch_accuracy
from asyncrl.weights import BroadcastSchedule, make_publisher
from asyncrl.weights.timeline import TimedBuckets
from asyncrl.wire.sockets import RequestClient

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
    "grad_norm_max",
    "grad_clipped",
    "grad_clip_coef",
    "lr",
    "updates",
    "approx_kl",
    "clipfrac_by_epoch",
    "approx_kl_by_epoch",
    "value_loss",
    "truncated_frac",
    "overlong_penalty",
    "padding_frac",
    "outside_truncation_frac",
)
"""Trainer stats that ride along in each "step" event (the controller prints some, keeps all)."""


def run_learner(ctx, model_dir: str) -> None:
    cfg = ctx.cfg
    sampling = cfg.sampling  # the learner scores tokens under the distribution they were sampled from
    trainer_cfg = cfg.learner.trainer.model_copy(
        update={
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "lr_decay_steps": cfg.learner.trainer.lr_decay_steps
            or cfg.learner.total_steps * cfg.learner.updates_per_step,
        }
    )
    if cfg.simulation.learner is not None:
        from asyncrl.learner.mock_trainer import MockTrainer

        trainer = MockTrainer(cfg.simulation.learner)
    else:
        from asyncrl.learner.trainer import PolicyTrainer  # DeepSpeed loads only where it trains

        algo = cfg.algorithm
        if algo.loss_norm_tokens is None:
            algo = algo.model_copy(update={"loss_norm_tokens": cfg.sampling.max_tokens})
        if algo.truncation.max_tokens is None:
            truncation = algo.truncation.model_copy(update={"max_tokens": cfg.sampling.max_tokens})
            algo = algo.model_copy(update={"truncation": truncation})
        trainer = PolicyTrainer(
            model_dir,
            trainer_cfg,
            algo,
            reference_address=ctx.endpoints.reference,
            ppo_epochs=cfg.learner.ppo_epochs,
            mini_batches=cfg.learner.mini_batches,
        )
    buffer = RequestClient(ctx.endpoints.buffer_requests, name="learner.buffer")
    wcfg = cfg.weights
    publisher = make_publisher(
        wcfg, ctx.endpoints.weights, ctx.endpoints.weights_stream, ctx.run_dir, num_subscribers=cfg.run.num_generators
    )
    schedule = BroadcastSchedule(wcfg, cfg.learner.broadcast_every, cfg.buffer.max_staleness, cfg.learner.total_steps)
    counters = Counters()
    reuse = cfg.buffer.max_times_sampled != 1
    seen: dict[int, set[str]] = {}  # policy_version -> uids trained, while a group may come back
    trained_ids = GroupIdSet()  # every group trained in this run's history: exactly-once across failures
    priority_updates: dict | None = None
    just_trained: dict | None = None  # the last step's groups, reported to the dispatcher via the buffer
    latencies = Reservoir(10_000)  # seconds from the start of sampling to the end of training, per sample
    if ctx.resume_dir is not None:
        trained_ids = load_learner_part(trainer, counters, ctx.resume_dir / "learner")
        log.info("learner: resumed at version %d from %s", trainer.version, ctx.resume_dir)
    ctx.emit("ready", version=trainer.version)
    if trainer.version > 0:  # generators start from the initial weights: bring them to this version
        publish_weights(trainer, publisher, wcfg, ctx)
        schedule.published(trainer.version)
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
        if just_trained is not None:
            request["trained"] = just_trained
        reply = buffer.request("want_batch", request, timeout=cfg.learner.batch_timeout_s)
        if reply is not None:
            priority_updates = just_trained = None  # delivered with that request
        groups = reply[1]["groups"] if reply is not None else []
        if groups and not reuse:
            # A group trained before (a copy dispatched again after a failure) is not trained twice.
            copies = [g for g in groups if g.group_id in trained_ids]
            if copies:
                groups = [g for g in groups if g.group_id not in trained_ids]
                counters.dropped["duplicate"] += sum(len(g.samples) for g in copies)
                ctx.ledger.write("dropped", [g.group_id for g in copies], reason="duplicate")
                if not groups:
                    continue
        if not groups:
            log.info(
                "learner: waiting for a batch of %d groups at version %d", cfg.learner.batch_groups, trainer.version
            )
            continue
        wait_s = time.monotonic() - wait_start
        is_weights = reply[1].get("is_weights")
        if is_weights is not None and len(is_weights) != len(groups):  # some copies were taken out
            keep = {g.group_id for g in groups}
            is_weights = [w for g, w in zip(reply[1]["groups"], is_weights) if g.group_id in keep]
        stats = trainer.train_step(groups, weights=is_weights)
        for g in groups:
            trained_ids.add(g.group_id)
        just_trained = {"version": trainer.version, "group_ids": [g.group_id for g in groups]}
        ctx.ledger.write("trained", just_trained["group_ids"], version=trainer.version)
        counters.busy_s += stats["seconds"]
        BUSY_SECONDS.inc(stats["seconds"])
        LEARNER_STEP_SECONDS.observe(stats["seconds"])
        POLICY_VERSION.set(trainer.version)
        record_learner_step(stats)
        n = sum(len(g.samples) for g in groups)
        counters.trained_with_reuse += n
        counters.trained_tokens += sum(g.num_tokens for g in groups)
        if reuse:
            counters.trained += _count_first_time(groups, seen, trainer.version, cfg.buffer.max_staleness)
            if cfg.buffer.sampler == "prioritized" and "group_keys" in reply[1]:
                priority = [float(np.abs(a).mean()) for a in trainer.advantages(groups)]
                priority_updates = {"group_keys": reply[1]["group_keys"], "priorities": priority}
        else:
            counters.trained += n
        SAMPLES.labels("trained").inc(n)
        for s in stats["staleness"]:
            counters.staleness_hist[int(s)] += 1
            STALENESS.observe(s)
        now = time.time()
        latencies.extend(now - g.meta.get("sampled_at", now) for g in groups for _ in g.samples)
        if schedule.due(trainer.version):
            publish_weights(trainer, publisher, wcfg, ctx)
            schedule.published(trainer.version)
        every = cfg.checkpoint.every_steps
        # Every `every` steps, and at the last one so that a finished run can be resumed to train longer.
        if every and (trainer.version % every == 0 or trainer.version == cfg.learner.total_steps):
            stage = staging_dir(ctx.run_dir, trainer.version)
            save_start = time.monotonic()
            save_learner_part(trainer, counters, trained_ids, stage / "learner")
            ctx.emit("checkpoint_part", part="learner", version=trainer.version, seconds=time.monotonic() - save_start)
        rewards = [s.reward for g in groups for s in g.samples]
        ctx.emit(
            "step",
            version=trainer.version,
            loss=stats["loss"],
            reward=sum(rewards) / len(rewards),
            accuracy=batch_accuracy(groups),
            tokens=sum(g.num_tokens for g in groups),
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
            ctx.ledger.write("held", [g.group_id for g in late[1]["groups"]])
    ctx.emit(
        "final",
        trained=counters.trained,
        trained_with_reuse=counters.trained_with_reuse,
        held=held,
        dropped=dict(counters.dropped),
        version=trainer.version,
        staleness_hist={str(k): v for k, v in sorted(counters.staleness_hist.items())},
        latency_s=latency_summary(latencies.values),
        trained_tokens=counters.trained_tokens,
        busy_s=counters.busy_s,
        wall_s=wall,
    )
    buffer.close()
    publisher.close()


@dataclass
class Counters:
    """The learner's running totals; saved in checkpoints so a resumed run's totals continue."""

    trained: int = 0
    """Samples trained at least once."""
    trained_with_reuse: int = 0
    """Every time a sample was trained."""
    trained_tokens: int = 0
    """Response tokens of every batch trained."""
    busy_s: float = 0.0
    staleness_hist: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    """Samples not trained here, by reason (``duplicate``: a copy of a group already trained)."""


def save_learner_part(trainer, counters: Counters, trained_ids: GroupIdSet, out: Path) -> None:
    """The learner's part of a checkpoint (see ``asyncrl.rundir.checkpoints``)."""
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_state(out)
    (out / "trained_ids.bin").write_bytes(trained_ids.to_bytes())
    state = {
        "trained": counters.trained,
        "trained_with_reuse": counters.trained_with_reuse,
        "trained_tokens": counters.trained_tokens,
        "busy_s": counters.busy_s,
        "staleness_hist": {str(k): v for k, v in counters.staleness_hist.items()},
        "dropped": dict(counters.dropped),
    }
    (out / "learner_state.json").write_text(json.dumps({"version": trainer.version, "counters": state}))


def load_learner_part(trainer, counters: Counters, src: Path) -> GroupIdSet:
    trainer.load_state(src)
    state = json.loads((src / "learner_state.json").read_text())
    if int(state["version"]) != trainer.version:
        raise ValueError(f"{src}: learner_state.json says version {state['version']}, the trainer {trainer.version}")
    saved = state["counters"]
    counters.trained = saved["trained"]
    counters.trained_with_reuse = saved["trained_with_reuse"]
    counters.trained_tokens = saved["trained_tokens"]
    counters.busy_s = saved["busy_s"]
    counters.staleness_hist = Counter({int(k): v for k, v in saved["staleness_hist"].items()})
    counters.dropped = Counter(saved["dropped"])
    return GroupIdSet.from_bytes((src / "trained_ids.bin").read_bytes())


def publish_weights(trainer, publisher, wcfg, ctx) -> dict:
    """Publish the trainer's weights bucket by bucket, with its probe; record and report it."""
    published_at = time.time()  # wall clock: the controller compares it with each generator's served_at
    probe = trainer.probe() if wcfg.probe else None
    probe_s = time.time() - published_at
    buckets = TimedBuckets(trainer.weight_buckets(int(wcfg.bucket_mb * (1 << 20))))
    stats = publisher.publish(buckets, trainer.version, meta={"probe": probe} if probe is not None else None)
    WEIGHT_BROADCAST_SECONDS.observe(stats["seconds"])
    WEIGHT_BYTES.inc(stats["bytes"])
    ctx.emit(
        "broadcast",
        version=trainer.version,
        transport=publisher.transport,
        published_at=published_at,
        gather_s=buckets.seconds,
        probe_s=probe_s,
        **stats,
    )
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


class Reservoir:
    """A uniform sample of at most ``size`` values of a stream (Vitter's algorithm R): percentiles
    over a run of any length in memory allocated once, so a long run's footprint never moves."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seen = size, 0
        self._kept = np.empty(size, dtype=np.float64)
        self._rng = np.random.default_rng(seed)

    @property
    def values(self) -> np.ndarray:
        return self._kept[: min(self.seen, self.size)]

    def extend(self, values) -> None:
        for v in values:
            if self.seen < self.size:
                self._kept[self.seen] = v
            elif (j := int(self._rng.integers(self.seen + 1))) < self.size:
                self._kept[j] = v
            self.seen += 1


def latency_summary(latencies) -> dict:
    """Mean and percentiles of the per-sample end-to-end latency (sampling start -> trained)."""
    if len(latencies) == 0:
        return {}
    arr = np.asarray(latencies)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95))}
