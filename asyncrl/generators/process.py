"""The generator process: prompts in from the dispatcher, sampled groups out to the reward workers.

One loop, one vLLM engine. With ``generator.mode: continuous`` (the default) the engine is kept
full and each group leaves the moment its answers are done (``asyncrl.generators.continuous``);
weights are then swapped in flight. With ``batch`` each turn it (1) applies the newest announced
weights, if any, (2) asks the dispatcher for up to ``generator.prompts_per_batch`` prompts, (3)
samples n answers for each in one engine call and (4) pushes one group per prompt. With ``weights.apply_mode:
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
from dataclasses import dataclass, field

from asyncrl.generators.channels import GroupSink, PromptSource
from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.evaluation import EvalCounters, HeldForVersion, answer_eval_request
from asyncrl.generators.groups import build_groups, refuse_too_long
from asyncrl.generators.sampling import request_seed
from asyncrl.generators.weights_apply import apply_newest_weights
from asyncrl.observability.metrics import (
    BUSY_SECONDS,
    ENVIRONMENT_FAILURES,
    EPISODE_TOKENS,
    EPISODE_TURNS,
    GENERATED_TOKENS,
    POLICY_VERSION,
    ROLLOUT_SECONDS,
    SAMPLES,
    TOOL_CALLS,
)
from asyncrl.weights import make_subscriber
from asyncrl.weights.probe import ProbeCheck
from asyncrl.wire.messages import GeneratorFinal, PromptRow, ReadyEvent
from asyncrl.wire.schema import Group, WireError, policy_tokens, validate_group
from asyncrl.wire.sockets import EvalRequestReceiver

log = logging.getLogger(__name__)


def build_engine(cfg, model_dir: str, gen_index: int):
    """Batch mode's engine: the simulated one, or vLLM (the async engine when weights are swapped in flight)."""
    if cfg.simulation.generator is not None:
        from asyncrl.generators.mock_engine import MockEngine

        return MockEngine(cfg.simulation.generator, seed=cfg.run.seed + gen_index)
    from asyncrl.generators.engine import VLLMEngine

    engine_cls = VLLMEngine
    if cfg.weights.apply_mode == "in_flight":
        from asyncrl.generators.async_engine import AsyncVLLMEngine as engine_cls
    return engine_cls(model_dir, cfg.engine.model_copy(update={"seed": cfg.run.seed + gen_index}))


@dataclass
class GeneratorCounters:
    generated: int = 0
    """Samples accounted for: sent, or dropped here (n per group, as the ledger counts them)."""
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0
    resumed: int = 0
    """Answers of groups sent that were aborted and resumed under a newer version (once per interruption)."""
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_ids: list[str] = field(default_factory=list)
    """Told to the dispatcher with the next request, so it settles them."""


class Generator:
    """One turn (``step``): apply weights, answer an evaluation, ask for prompts, sample, send."""

    def __init__(self, ctx: GeneratorContext, model_dir: str):
        cfg = self.cfg = ctx.cfg
        self.ctx = ctx
        self.gen_index = int(ctx.name.rsplit("-", 1)[-1]) if ctx.name[-1].isdigit() else 0
        gcfg = cfg.generator
        stream = None  # generator.mode continuous: the engine behind a stream, kept full
        if gcfg.mode == "continuous":
            from asyncrl.generators.continuous import build_stream

            stream = build_stream(cfg, model_dir, self.gen_index)
            self.engine = stream.engine
        else:
            self.engine = build_engine(cfg, model_dir, self.gen_index)
        self.prompts = PromptSource(
            ctx.endpoints.dispatcher, f"{ctx.name}.dispatcher", ctx.name, gcfg.prompts_per_batch, gcfg.request_timeout_s
        )
        self.outbox = GroupSink(ctx.endpoints.reward_in, f"{ctx.name}.out", gcfg.send_timeout_s)
        self.weights = make_subscriber(
            cfg.weights,
            ctx.endpoints.weights,
            ctx.endpoints.weights_stream,
            f"{ctx.name}.weights",
            rank=self.gen_index + 1,
        )
        self.probe = ProbeCheck(cfg.weights.probe_atol, cfg.weights.probe_noise_factor) if cfg.weights.probe else None
        self.applier = None  # in_flight: a background thread swaps weights while requests run
        if cfg.weights.apply_mode == "in_flight":
            from asyncrl.generators.inflight import InFlightApplier

            self.applier = InFlightApplier(self.engine, self.weights, self.probe, cfg.weights.poll_s, name=ctx.name)
        self.evals = None  # held-out evaluation requests from the controller (asyncrl.tasks.heldout)
        if getattr(ctx.endpoints, "evals", None) and cfg.eval.engine == "generators":
            receiver = EvalRequestReceiver(ctx.endpoints.evals, name=f"{ctx.name}.evals")
            self.evals = HeldForVersion(receiver, self.engine, hold_s=cfg.eval.timeout_floor_s / 2)
        self.eval_counters = EvalCounters()
        self.counts = GeneratorCounters()
        self.continuous = None  # generator.mode continuous: the engine kept full, groups sent when done
        if stream is not None:
            from asyncrl.generators.continuous import ContinuousLoop

            self.continuous = ContinuousLoop(self, stream)

    def step(self) -> None:
        if self.continuous is not None:
            self.continuous.step()
            return
        self.apply_weights()
        if self.evals is not None:  # at most one evaluation request between two training batches
            answer_eval_request(self.engine, self.evals, self.ctx, self.eval_counters)
        rows = self.prompts.ask(self.engine.version, self.counts.dropped_ids)
        self.counts.dropped_ids = []
        rows = self.refuse_too_long(rows)
        if not rows:
            return
        self.apply_weights()  # sample with the newest weights: only less stale
        self.send(self.sample(rows))

    def apply_weights(self) -> None:
        if self.applier is not None:
            self.applier.drain(self.ctx)  # report what was swapped in flight; raise what failed
        else:
            apply_newest_weights(self.engine, self.weights, self.ctx, self.probe)

    def refuse_too_long(self, rows: list[PromptRow]) -> list[PromptRow]:
        """The rows the engine takes; the others are dropped, reason ``prompt_too_long``."""
        max_len, n, counts = self.cfg.engine.max_model_len, self.cfg.sampling.n, self.counts
        rows, refused = refuse_too_long(getattr(self.engine, "tokenizer", None), rows, max_len)
        if refused:
            ids = [r["group_id"] for r in refused]
            if not counts.dropped["prompt_too_long"]:  # logged once; the count is in the final report
                log.warning(
                    "%s: dropping prompts of max_model_len (%d) tokens or more, e.g. %s (groups %s)",
                    self.ctx.name,
                    max_len,
                    refused[0]["prompt_uid"],
                    ids,
                )
            counts.dropped["prompt_too_long"] += len(ids) * n
            counts.generated += len(ids) * n  # as the ledger counts them: n samples a group
            counts.dropped_ids.extend(ids)
            self.ctx.ledger.write("dropped", ids, reason="prompt_too_long")
        return rows

    def sample(self, rows: list[PromptRow]) -> list[Group]:
        """One engine call for every row: a group of n per prompt (and ReMax's greedy baseline)."""
        cfg, engine, counts = self.cfg, self.engine, self.counts
        version = engine.version  # of the first tokens; an engine that swaps in flight labels the rest
        start = time.monotonic()
        sampled_at = time.time()
        prompts = [r["text"] for r in rows]
        seeds = [request_seed(cfg.run.seed, r["group_id"]) for r in rows]  # reproducible per group
        completions = engine.generate(prompts, cfg.sampling, seed=seeds)
        # ReMax's baseline, by the same weights as the samples (no update runs between the calls).
        greedy = engine.greedy(prompts, cfg.sampling.max_tokens) if cfg.generator.greedy_baseline else None
        rollout_s = time.monotonic() - start
        counts.busy_s += rollout_s
        BUSY_SECONDS.inc(rollout_s)
        counts.batches += 1
        self.ctx.ledger.write("generated", [r["group_id"] for r in rows], version=engine.version)
        groups = build_groups(rows, completions, version, self.ctx.name, rollout_s, sampled_at)
        for index, group in enumerate(groups):
            if greedy is not None:
                group.greedy_text = greedy[index]
            ROLLOUT_SECONDS.observe(rollout_s)
        return groups

    def send(self, groups: list[Group]) -> None:
        """Each valid group to the reward workers; an invalid one is dropped here, reason ``invalid``."""
        counts = self.counts
        for group in groups:
            try:
                validate_group(group)
            except WireError as e:
                log.warning("%s: dropping invalid group %s: %s", self.ctx.name, group.group_id, e)
                counts.dropped["invalid"] += len(group.samples)
                counts.dropped_ids.append(group.group_id)
                self.ctx.ledger.write("dropped", [group.group_id], reason="invalid")
                counts.generated += len(group.samples)
                continue
            self.outbox.send(group)
            count_episodes(group)
            counts.generated += len(group.samples)
            counts.tokens += group.num_tokens
            GENERATED_TOKENS.inc(group.num_tokens)
            SAMPLES.labels("generated").inc(len(group.samples))

    def finish(self, wall_s: float) -> None:
        if self.continuous is not None:  # what is still sampling is aborted and returned
            self.continuous.finish()
        # A reply that came after its request timed out holds prompts the dispatcher counts as
        # handed out; the ledger says they were returned unsampled, so they are not mistaken for lost.
        for rows in self.prompts.late_replies(wait=0.3):
            self.ctx.ledger.write("returned", [r["group_id"] for r in rows])
        counts = self.counts
        self.ctx.emit(
            GeneratorFinal(
                generated=counts.generated,
                tokens=counts.tokens,
                dropped=dict(counts.dropped),
                held=0,
                busy_s=counts.busy_s,
                wall_s=wall_s,
                version=self.engine.version,
                eval_prompts=self.eval_counters.prompts,
                eval_s=self.eval_counters.seconds,
                resumed=counts.resumed,
            )
        )
        if self.applier is not None:
            self.applier.close()
        for sock in (self.prompts, self.outbox, self.weights, self.evals):
            if sock is not None:
                sock.close()
        self.engine.close()


def count_episodes(group: Group) -> None:
    """The episode metrics of a group of multi-turn episodes (none for single answers)."""
    for s in group.samples:
        e = s.episode
        if e is None:
            continue
        EPISODE_TURNS.observe(e.turns)
        own = policy_tokens(s)
        EPISODE_TOKENS.labels("model").inc(own)
        EPISODE_TOKENS.labels("environment").inc(len(s.response_ids) - own)
        TOOL_CALLS.labels("ok").inc(e.tool_calls - e.tool_errors)
        TOOL_CALLS.labels("error").inc(e.tool_errors)
        if e.env_error is not None:
            ENVIRONMENT_FAILURES.labels(e.env_error.split(":", 1)[0]).inc()


def run_generator(ctx: GeneratorContext, model_dir: str) -> None:
    generator = Generator(ctx, model_dir)
    POLICY_VERSION.set(generator.engine.version)
    ctx.emit(ReadyEvent(version=generator.engine.version))
    loop_start = time.monotonic()
    while not ctx.stop_requested():
        generator.step()
    generator.finish(time.monotonic() - loop_start)
