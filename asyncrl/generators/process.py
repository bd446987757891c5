"""The generator process: prompts in from the dispatcher, sampled groups out to the reward workers.

One loop, one engine (``asyncrl.generators.engines``), one scheduler
(``asyncrl.generators.schedulers``) deciding when prompts are asked for and sampled:

- ``continuous`` (the default): the engine is kept full and each group leaves the moment its
  samples are done; weights are swapped in flight. Every rollout runs here: single answers,
  multi-turn episodes with an environment, agent programs through the gateway
  (``asyncrl.generators.rollouts``).
- ``batch``: a batch of prompts sampled in one engine call, weights applied between calls.

What both share (sockets, weights, evaluation requests, counters, validation and sending) is
``asyncrl.generators.parts``. After each update the generator reports the version it now serves.

A group that fails validation (e.g. a non-finite logprob from the engine) is dropped with reason
``invalid``, counted, and never sent. A prompt the engine would refuse (``max_model_len`` tokens
or more: vLLM fails the whole batch for it) is dropped before sampling with reason
``prompt_too_long``: prompts are measured when they are loaded (``asyncrl.tasks.prompt_length``), so
this is the last line of defence, not the filter. A group the reward workers do not take is kept
and retried: nothing is dropped for backpressure.
"""

from __future__ import annotations

import time

from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.engines.build import build_engine, build_stream
from asyncrl.generators.parts import GeneratorParts
from asyncrl.observability.metrics import POLICY_VERSION
from asyncrl.wire.messages import GeneratorFinal, ReadyEvent


class Generator:
    """One turn (``step``) of the configured scheduler, and the end (``finish``)."""

    def __init__(self, ctx: GeneratorContext, model_dir: str):
        cfg = ctx.cfg
        gen_index = int(ctx.name.rsplit("-", 1)[-1]) if ctx.name[-1].isdigit() else 0
        if cfg.generator.mode == "continuous":
            from asyncrl.generators.schedulers.continuous import ContinuousLoop

            stream = build_stream(cfg, model_dir, gen_index)
            self.parts = GeneratorParts(ctx, stream.engine, gen_index)
            self.scheduler = ContinuousLoop(self.parts, stream)
        else:
            from asyncrl.generators.schedulers.batch import BatchLoop

            self.parts = GeneratorParts(ctx, build_engine(cfg, model_dir, gen_index), gen_index)
            self.scheduler = BatchLoop(self.parts)
        self.ctx, self.engine = ctx, self.parts.engine

    def step(self) -> None:
        self.scheduler.step()

    def finish(self, wall_s: float) -> None:
        self.scheduler.finish()  # continuous: what is still sampling is aborted and returned
        parts = self.parts
        # A reply that came after its request timed out holds prompts the dispatcher counts as
        # handed out; the ledger says they were returned unsampled, so they are not mistaken for lost.
        for rows in parts.prompts.late_replies(wait=0.3):
            self.ctx.ledger.write("returned", [r["group_id"] for r in rows])
        counts = parts.counts
        self.ctx.emit(
            GeneratorFinal(
                generated=counts.generated,
                tokens=counts.tokens,
                dropped=dict(counts.dropped),
                held=0,
                busy_s=counts.busy_s,
                wall_s=wall_s,
                version=self.engine.version,
                eval_prompts=parts.eval_counters.prompts,
                eval_s=parts.eval_counters.seconds,
                resumed=counts.resumed,
            )
        )
        parts.close()


def run_generator(ctx: GeneratorContext, model_dir: str) -> None:
    generator = Generator(ctx, model_dir)
    POLICY_VERSION.set(generator.engine.version)
    ctx.emit(ReadyEvent(version=generator.engine.version))
    loop_start = time.monotonic()
    while not ctx.stop_requested():
        generator.step()
    generator.finish(time.monotonic() - loop_start)
