"""What a generator's schedulers share: its sockets, weights, counters, and how a group is sent.

A scheduler (``asyncrl.generators.schedulers``: batch or continuous) decides when prompts are
asked for and sampled; everything else a generator does is here, the same for both: the prompt
source (``PromptSource``) and the outbox to the reward workers (``GroupSink``), the weight
subscription and how the newest weights are applied (between requests, or by the in-flight
applier), held-out evaluation requests, the refusal of prompts the engine cannot take, the
validation of each group before it is sent, and the counters of the final report.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from asyncrl.generators.channels import GroupSink, PromptSource
from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.evaluation import EvalCounters, HeldForVersion
from asyncrl.generators.groups import refuse_too_long
from asyncrl.generators.weights_apply import apply_newest_weights
from asyncrl.generators.weights_hold import WeightsHold
from asyncrl.observability.metrics import (
    ENVIRONMENT_FAILURES,
    EPISODE_TOKENS,
    EPISODE_TURNS,
    GENERATED_TOKENS,
    SAMPLES,
    TOOL_CALLS,
)
from asyncrl.weights import make_subscriber
from asyncrl.weights.probe import ProbeCheck
from asyncrl.wire.messages import PromptRow
from asyncrl.wire.schema import Group, WireError, policy_tokens, validate_group
from asyncrl.wire.sockets import EvalRequestReceiver

log = logging.getLogger(__name__)


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


class GeneratorParts:
    """One generator's sockets, weights and counters around ``engine`` (see the module docstring)."""

    def __init__(self, ctx: GeneratorContext, engine, gen_index: int):
        cfg = self.cfg = ctx.cfg
        self.ctx, self.engine, self.gen_index = ctx, engine, gen_index
        gcfg = cfg.generator
        self.prompts = PromptSource(
            ctx.endpoints.dispatcher, f"{ctx.name}.dispatcher", ctx.name, gcfg.prompts_per_batch, gcfg.request_timeout_s
        )
        self.outbox = GroupSink(ctx.endpoints.reward_in, f"{ctx.name}.out", gcfg.send_timeout_s)
        self.weights = make_subscriber(
            cfg.weights,
            ctx.endpoints.weights,
            ctx.endpoints.weights_stream,
            f"{ctx.name}.weights",
            rank=gen_index + 1,
        )
        self.probe = ProbeCheck(cfg.weights.probe_atol, cfg.weights.probe_noise_factor) if cfg.weights.probe else None
        self.hold = WeightsHold(ctx)  # the starting weights, while the round before RL is answered
        self.applier = None  # in_flight: a background thread swaps weights while requests run
        if cfg.weights.apply_mode == "in_flight":
            from asyncrl.generators.inflight import InFlightApplier

            self.applier = InFlightApplier(
                engine, self.weights, self.probe, cfg.weights.poll_s, name=ctx.name, held=self.hold.held
            )
        self.evals = None  # held-out evaluation requests from the controller (asyncrl.tasks.heldout)
        if getattr(ctx.endpoints, "evals", None) and cfg.eval.engine == "generators":
            receiver = EvalRequestReceiver(ctx.endpoints.evals, name=f"{ctx.name}.evals")
            self.evals = HeldForVersion(receiver, engine, hold_s=cfg.eval.timeout_floor_s / 2)
        self.eval_counters = EvalCounters()
        self.counts = GeneratorCounters()

    def apply_weights(self) -> None:
        if self.applier is not None:
            self.applier.drain(self.ctx)  # report what was swapped in flight; raise what failed
        elif not self.hold.held():
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

    def close(self) -> None:
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
