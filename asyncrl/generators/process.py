"""The generator process: prompts in from the dispatcher, sampled groups out to the reward workers.

One loop, one vLLM engine. Each turn it (1) applies the newest announced weights, if any, (2) asks
the dispatcher for up to ``generator.prompts_per_batch`` prompts, (3) samples n answers for each
in one engine call and (4) pushes one group per prompt. With ``weights.apply_mode:
between_requests`` weights change only between engine calls, so every token of a group was
sampled by the version stamped on it (a weight update is atomic per request); with
``in_flight`` a background thread swaps them while requests run (``asyncrl.generators.inflight``)
and each sample's ``version_segments`` say which version sampled which tokens, the group being
stamped with its oldest. After each update the generator reports the version it now serves.
Between two batches it answers at most one held-out evaluation request from the controller
(``asyncrl.generators.evaluation``), which is not a sample and is counted apart.

A group that fails validation (e.g. a non-finite logprob from the engine) is dropped here with
reason ``invalid``, counted, and never sent. A prompt the engine would refuse (``max_model_len``
tokens or more: vLLM fails the whole batch for it) is dropped before sampling with reason
``prompt_too_long``: prompts are measured when they are loaded (``asyncrl.tasks.prompt_length``), so
this is the last line of defence, not the filter. A group the reward workers do not take is kept and
retried: nothing is dropped for backpressure.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.evaluation import EvalCounters, answer_eval_request
from asyncrl.observability.metrics import (
    BUSY_SECONDS,
    GENERATED_TOKENS,
    POLICY_VERSION,
    ROLLOUT_SECONDS,
    SAMPLES,
    WEIGHT_APPLY_SECONDS,
    WEIGHT_BYTES,
    WEIGHT_FAILURES,
)
from asyncrl.weights import make_subscriber
from asyncrl.weights.probe import check_probe
from asyncrl.wire.schema import Group, Sample, WireError, encode_group, validate_group
from asyncrl.wire.sockets import EvalRequestReceiver, RequestClient, StreamSender

log = logging.getLogger(__name__)


class GeneratorConfig(Config):
    prompts_per_batch: int = Field(16, ge=1)
    """Prompts a generator asks for and samples in one engine call (each gives a group of n)."""
    request_timeout_s: float = Field(0.25, gt=0)
    """Seconds a request for prompts waits before it is asked again, with the version then served
    (short, because the dispatcher's admission is computed from the version in the request)."""
    greedy_baseline: bool = False
    """Also decode each prompt greedily and send that answer with its group (``meta['greedy_text']``),
    for ReMax's baseline; the reward worker scores it into ``meta['greedy_reward']``."""
    send_timeout_s: float = Field(30.0, gt=0)
    """Seconds a finished group waits for a reward worker to take it before the wait is reported."""


def build_groups(
    rows: list[dict], completions, version: int, generator: str, rollout_s: float, sampled_at: float = 0.0
) -> list[Group]:
    """One ``Group`` per dispatched prompt row, from the engine's n completions of it.

    ``version`` stamps completions the engine did not label; labelled ones (``version_segments``,
    swapped in flight) stamp the group with the version of its oldest token, and a sample keeps
    its segments unless that one version sampled all of it."""
    groups = []
    for row, comps in zip(rows, completions):
        segments = [c.version_segments or [[0, version]] for c in comps]
        oldest = min(seg[0][1] for seg in segments)
        samples = [
            Sample(
                uid=f"{row['group_id']}/{i}",
                response_ids=c.response_ids.astype(np.int32),
                logprobs=c.logprobs.astype(np.float32),
                text=c.text,
                finish_reason=c.finish_reason,
                version_segments=None if seg == [[0, oldest]] else seg,
            )
            for i, (c, seg) in enumerate(zip(comps, segments))
        ]
        groups.append(
            Group(
                group_id=row["group_id"],
                prompt_uid=row["prompt_uid"],
                task=row["task"],
                prompt=row["text"],
                answer=row["answer"],
                prompt_ids=comps[0].prompt_ids.astype(np.int32),
                policy_version=oldest,
                generator=generator,
                samples=samples,
                rollout_s=rollout_s,
                meta={"sampled_at": sampled_at},  # wall clock, for end-to-end latency
            )
        )
    return groups


def refuse_too_long(tokenizer, rows: list[dict], max_model_len: int) -> tuple[list[dict], list[dict]]:
    """(rows the engine takes, rows it would refuse): a prompt of ``max_model_len`` tokens or more
    leaves no room to sample, and vLLM refuses it by failing the whole batch. ``tokenizer`` is the
    engine's own (None, as for the simulated engine: every row is taken)."""
    if tokenizer is None:
        return rows, []
    taken, refused = [], []
    for row in rows:
        (taken if len(tokenizer.encode(row["text"])) < max_model_len else refused).append(row)
    return taken, refused


def apply_newest_weights(engine, weights, ctx: GeneratorContext, probe_atol: float | None = None) -> None:
    """Load the newest published version if it is newer than the one served; check it; report it.

    ``weights`` is a subscriber of ``asyncrl.weights`` (its ``newest`` verifies each bucket's
    checksum). With ``probe_atol`` and a probe sent along, the engine then scores the probe text
    and must match the learner's logprobs. Any failure (checksum, missing weights, probe) is
    counted, reported back to the learner where the transport can, and raised: a generator must
    never go on sampling with weights it cannot vouch for.
    """
    start = time.perf_counter()
    try:
        update = weights.newest(engine.version)
    except Exception:
        WEIGHT_FAILURES.labels("receive").inc()
        raise
    if update is None:
        return
    try:
        weights_in = update.path if update.path is not None else update.tensors
        if update.shm is not None and getattr(engine, "maps_shm", False):  # the engine process maps them itself
            load_s = engine.load_weights(weights_in, update.version, shm=update.shm)
        else:
            load_s = engine.load_weights(weights_in, update.version)
        probe = update.meta.get("probe")
        probe_diff = None
        probe_start = time.perf_counter()
        if probe_atol is not None and probe is not None and hasattr(engine, "score"):
            probe_diff = check_probe(engine, probe, probe_atol, update.version)
        probe_s = time.perf_counter() - probe_start
    except Exception as e:
        WEIGHT_FAILURES.labels("apply").inc()
        update.done(error=f"{type(e).__name__}: {e}")
        raise
    update.done()
    apply_s = time.perf_counter() - start
    POLICY_VERSION.set(engine.version)
    WEIGHT_APPLY_SECONDS.observe(apply_s)
    WEIGHT_BYTES.inc(update.nbytes)
    ctx.emit(
        "version",
        version=engine.version,
        apply_s=apply_s,
        load_s=load_s,
        receive_s=update.receive_s,
        probe_s=probe_s,
        ready_at=update.ready_at,
        served_at=time.time(),  # wall clock, joined with the learner's published_at (asyncrl.weights.timeline)
        bytes=update.nbytes,
        probe_diff=probe_diff,
    )


def run_generator(ctx: GeneratorContext, model_dir: str) -> None:
    from asyncrl.generators.engine import VLLMEngine

    cfg = ctx.cfg
    gen_index = int(ctx.name.rsplit("-", 1)[-1]) if ctx.name[-1].isdigit() else 0
    if cfg.simulation.generator is not None:
        from asyncrl.generators.mock_engine import MockEngine

        engine = MockEngine(cfg.simulation.generator, seed=cfg.run.seed + gen_index)
    else:
        engine_cls = VLLMEngine
        if cfg.weights.apply_mode == "in_flight":
            from asyncrl.generators.async_engine import AsyncVLLMEngine as engine_cls
        engine = engine_cls(model_dir, cfg.engine.model_copy(update={"seed": cfg.run.seed + gen_index}))
    dispatcher = RequestClient(ctx.endpoints.dispatcher, name=f"{ctx.name}.dispatcher")
    outbox = StreamSender(ctx.endpoints.reward_in, name=f"{ctx.name}.out")
    weights = make_subscriber(
        cfg.weights, ctx.endpoints.weights, ctx.endpoints.weights_stream, f"{ctx.name}.weights", rank=gen_index + 1
    )
    probe_atol = cfg.weights.probe_atol if cfg.weights.probe else None
    applier = None  # in_flight: a background thread swaps weights while requests run
    if cfg.weights.apply_mode == "in_flight":
        from asyncrl.generators.inflight import InFlightApplier

        applier = InFlightApplier(engine, weights, probe_atol, cfg.weights.poll_s, name=ctx.name)

    def take_weights() -> None:
        if applier is not None:
            applier.drain(ctx)  # report what was swapped in flight; raise what failed
        else:
            apply_newest_weights(engine, weights, ctx, probe_atol)

    evals = None  # held-out evaluation requests from the controller (asyncrl.tasks.heldout)
    if getattr(ctx.endpoints, "evals", None) and cfg.eval.engine == "generators":
        evals = EvalRequestReceiver(ctx.endpoints.evals, name=f"{ctx.name}.evals")
    eval_counters = EvalCounters()
    generated = tokens = batches = 0
    dropped: Counter[str] = Counter()
    dropped_ids: list[str] = []  # told to the dispatcher with the next request, so it settles them
    busy_s = 0.0
    POLICY_VERSION.set(engine.version)
    ctx.emit("ready", version=engine.version)
    loop_start = time.monotonic()
    while not ctx.stop_requested():
        take_weights()
        if evals is not None:  # at most one evaluation request between two training batches
            answer_eval_request(engine, evals, ctx, eval_counters)
        reply = dispatcher.request(
            "want_prompts",
            {
                "generator": ctx.name,
                "max_prompts": cfg.generator.prompts_per_batch,
                "policy_version": engine.version,
                "timeout_s": cfg.generator.request_timeout_s,
                "dropped": dropped_ids,
            },
            timeout=cfg.generator.request_timeout_s,
        )
        dropped_ids = []
        if reply is None or not reply[1].get("prompts"):
            continue
        rows = list(reply[1]["prompts"])
        # Answers to earlier asks that timed out may be queued behind this one: take them too,
        # so a generator never lags behind a backlog of its own replies.
        while (more := dispatcher.receive(timeout=0)) is not None:
            rows.extend(more[1].get("prompts", []) if more[0] == "prompts" else [])
        rows, refused = refuse_too_long(getattr(engine, "tokenizer", None), rows, cfg.engine.max_model_len)
        if refused:
            ids = [r["group_id"] for r in refused]
            if not dropped["prompt_too_long"]:  # logged once; the count is in the final report
                log.warning(
                    "%s: dropping prompts of max_model_len (%d) tokens or more, e.g. %s (groups %s)",
                    ctx.name,
                    cfg.engine.max_model_len,
                    refused[0]["prompt_uid"],
                    ids,
                )
            dropped["prompt_too_long"] += len(ids) * cfg.sampling.n
            generated += len(ids) * cfg.sampling.n  # as the ledger counts them: n samples a group
            dropped_ids.extend(ids)
            ctx.ledger.write("dropped", ids, reason="prompt_too_long")
            if not rows:
                continue
        take_weights()  # sample with the newest weights: only less stale
        version = engine.version  # of the first tokens; an engine that swaps in flight labels the rest
        start = time.monotonic()
        sampled_at = time.time()
        prompts = [r["text"] for r in rows]
        completions = engine.generate(prompts, cfg.sampling, seed=hash((cfg.run.seed, gen_index, batches)) & 0x7FFFFFFF)
        # ReMax's baseline, by the same weights as the samples (no update runs between the calls).
        greedy = engine.greedy(prompts, cfg.sampling.max_tokens) if cfg.generator.greedy_baseline else None
        rollout_s = time.monotonic() - start
        busy_s += rollout_s
        BUSY_SECONDS.inc(rollout_s)
        batches += 1
        ctx.ledger.write("generated", [r["group_id"] for r in rows], version=engine.version)
        for index, group in enumerate(build_groups(rows, completions, version, ctx.name, rollout_s, sampled_at)):
            if greedy is not None:
                group.meta["greedy_text"] = greedy[index]
            ROLLOUT_SECONDS.observe(rollout_s)
            try:
                validate_group(group)
            except WireError as e:
                log.warning("%s: dropping invalid group %s: %s", ctx.name, group.group_id, e)
                dropped["invalid"] += len(group.samples)
                dropped_ids.append(group.group_id)
                ctx.ledger.write("dropped", [group.group_id], reason="invalid")
                generated += len(group.samples)
                continue
            outbox.send_until_taken(encode_group(group), cfg.generator.send_timeout_s)
            generated += len(group.samples)
            tokens += group.num_tokens
            GENERATED_TOKENS.inc(group.num_tokens)
            SAMPLES.labels("generated").inc(len(group.samples))
    wall = time.monotonic() - loop_start
    # A reply that came after its request timed out holds prompts the dispatcher counts as handed
    # out; the ledger says they were returned unsampled, so they are not mistaken for lost.
    while (late := dispatcher.receive(timeout=0.3)) is not None:
        if late[0] == "prompts":
            ctx.ledger.write("returned", [r["group_id"] for r in late[1]["prompts"]])
    ctx.emit(
        "final",
        generated=generated,
        tokens=tokens,
        dropped=dict(dropped),
        held=0,
        busy_s=busy_s,
        wall_s=wall,
        version=engine.version,
        eval_prompts=eval_counters.prompts,
        eval_s=eval_counters.seconds,
    )
    if applier is not None:
        applier.close()
    for sock in (dispatcher, outbox, weights, evals):
        if sock is not None:
            sock.close()
    engine.close()
