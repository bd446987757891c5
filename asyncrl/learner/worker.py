"""The learner process: batches in from the buffer, one optimizer step each, weights out.

Each step asks the buffer for ``learner.batch_groups`` groups, stating its version (the buffer
drops groups that are too stale for it), trains one staleness-corrected step, and every
``learner.broadcast_every`` steps publishes the weights. A request that times out is logged with
what it waits for and asked again; a stall beyond ``run.stall_timeout_s`` is the controller's to
judge. At the end it saves the final model as a Hugging Face directory in ``RUN_DIR/final``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from asyncrl.learner.weights import WeightPublisher
from asyncrl.metrics import LEARNER_STEP_SECONDS, POLICY_VERSION, SAMPLES, STALENESS
from asyncrl.transport import RequestClient

log = logging.getLogger(__name__)


def run_learner(ctx, model_dir: str) -> None:
    from asyncrl.learner.trainer import PolicyTrainer

    cfg = ctx.cfg
    trainer_cfg = cfg.learner.trainer.model_copy(update={"temperature": cfg.sampling.temperature})
    trainer = PolicyTrainer(model_dir, trainer_cfg)
    buffer = RequestClient(ctx.endpoints.buffer_requests, name="learner.buffer")
    publisher = WeightPublisher(ctx.endpoints.weights, ctx.run_dir / "weights")
    trained = 0
    staleness_hist: Counter[int] = Counter()
    busy_s = 0.0
    ctx.emit("ready", version=trainer.version)
    loop_start = time.monotonic()
    while trainer.version < cfg.learner.total_steps and not ctx.stop_requested():
        publisher.announce()
        wait_start = time.monotonic()
        reply = buffer.request(
            "want_batch",
            {
                "num_groups": cfg.learner.batch_groups,
                "policy_version": trainer.version,
                "timeout_s": cfg.learner.batch_timeout_s,
            },
            timeout=cfg.learner.batch_timeout_s,
        )
        groups = reply[1]["groups"] if reply is not None else []
        if not groups:
            log.info(
                "learner: waiting for a batch of %d groups at version %d", cfg.learner.batch_groups, trainer.version
            )
            continue
        wait_s = time.monotonic() - wait_start
        stats = trainer.train_step(groups)
        busy_s += stats["seconds"]
        LEARNER_STEP_SECONDS.observe(stats["seconds"])
        POLICY_VERSION.set(trainer.version)
        n = sum(len(g.samples) for g in groups)
        trained += n
        SAMPLES.labels("trained").inc(n)
        for s in stats["staleness"]:
            staleness_hist[int(s)] += 1
            STALENESS.observe(s)
        if trainer.version % cfg.learner.broadcast_every == 0 or trainer.version == cfg.learner.total_steps:
            publisher.publish(trainer.full_state_dict(), trainer.version)
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
            **{k: v for k, v in stats.items() if k in ("clipfrac", "behaviour_weight_mean", "approx_kl")},
        )
    wall = time.monotonic() - loop_start
    trainer.save_pretrained(ctx.run_dir / "final")
    ctx.emit(
        "final",
        trained=trained,
        version=trainer.version,
        staleness_hist={str(k): v for k, v in sorted(staleness_hist.items())},
        busy_s=busy_s,
        wall_s=wall,
    )
    # Keep announcing the last version until the controller stops us, so every generator hears it.
    while not ctx.stop_requested():
        publisher.announce()
        time.sleep(0.1)
    buffer.close()
    publisher.close()
