"""Batch generation (``generator.mode: batch``): prompts asked for, sampled in one engine call, sent together.

Each turn (``step``) it (1) applies the newest announced weights, if any, (2) answers at most one
held-out evaluation request from the controller (``asyncrl.generators.evaluation``), which is not
a sample and is counted apart, (3) asks the dispatcher for up to ``generator.prompts_per_batch``
prompts, (4) samples n answers for each in one engine call (``Engine.generate``) and (5) pushes
one group per prompt. With ``weights.apply_mode: between_requests`` weights change only between
engine calls, so every token of a group was sampled by the version stamped on it (a weight
update is atomic per request); with ``in_flight`` a background thread swaps them while requests
run (``asyncrl.generators.inflight``) and each sample's ``version_segments`` say which version
sampled which tokens, the group being stamped with its oldest.

Multi-turn rollouts (an environment's episodes, agent programs: ``build_rollout``) run here too,
on vLLM's async engine: the batch's groups are started together on the engine's event loop and
the batch waits for all of them, at most ``generator.group_timeout_s`` (by default
``GROUP_TIMEOUT_UNMEASURED_S``), and weights change only between batches.

The batch waits for its slowest group: simple, and what the simulated benchmarks' timing model
assumes; ``asyncrl.generators.schedulers.continuous`` keeps the engine full instead.
"""

from __future__ import annotations

import time

from asyncrl.generators.evaluation import answer_eval_request
from asyncrl.generators.groups import build_groups
from asyncrl.generators.parts import GeneratorParts
from asyncrl.generators.sampling import request_seed
from asyncrl.generators.schedulers.continuous import AGENT_GRACE_S, GROUP_TIMEOUT_UNMEASURED_S, build_rollout
from asyncrl.observability.metrics import BUSY_SECONDS, ROLLOUT_SECONDS
from asyncrl.wire.messages import PromptRow
from asyncrl.wire.schema import Group


class BatchLoop:
    """One generator's batch turns (``step``) and end (``finish``); see the module docstring."""

    def __init__(self, gen: GeneratorParts):
        self.gen, self.cfg = gen, gen.cfg
        self.rollout = build_rollout(self.cfg, gen.engine)  # None: single answers, one engine call

    def step(self) -> None:
        gen = self.gen
        gen.apply_weights()
        if gen.evals is not None:  # at most one evaluation request between two training batches
            answer_eval_request(gen.engine, gen.evals, gen.ctx, gen.eval_counters, self.rollout)
        rows = gen.prompts.ask(gen.engine.version, gen.counts.dropped_ids)
        gen.counts.dropped_ids = []
        rows = gen.refuse_too_long(rows)
        if not rows:
            return
        gen.apply_weights()  # sample with the newest weights: only less stale
        gen.send(self.sample(rows))

    def sample(self, rows: list[PromptRow]) -> list[Group]:
        """One engine call for every row: a group of n per prompt (and ReMax's greedy baseline)."""
        cfg, gen = self.cfg, self.gen
        engine, counts = gen.engine, gen.counts
        version = engine.version  # of the first tokens; an engine that swaps in flight labels the rest
        start = time.monotonic()
        sampled_at = time.time()
        prompts = [r["text"] for r in rows]
        seeds = [request_seed(cfg.run.seed, r["group_id"]) for r in rows]  # reproducible per group
        if self.rollout is not None:
            completions = self.sample_rollouts(rows, seeds)
        else:
            completions = engine.generate(prompts, cfg.sampling, seed=seeds)
        # ReMax's baseline, by the same weights as the samples (no update runs between the calls).
        greedy = engine.greedy(prompts, cfg.sampling.max_tokens) if cfg.generator.greedy_baseline else None
        rollout_s = time.monotonic() - start
        counts.busy_s += rollout_s
        BUSY_SECONDS.inc(rollout_s)
        counts.batches += 1
        gen.ctx.ledger.write("generated", [r["group_id"] for r in rows], version=engine.version)
        groups = build_groups(rows, completions, version, gen.ctx.name, rollout_s, sampled_at)
        for index, group in enumerate(groups):
            if greedy is not None:
                group.greedy_text = greedy[index]
            ROLLOUT_SECONDS.observe(rollout_s)
        return groups

    def sample_rollouts(self, rows: list[PromptRow], seeds: list[int]) -> list[list]:
        """Each row's group by the rollout, all started at once on the engine's event loop; the
        batch waits for every one, at most the group timeout from the first."""
        engine, limit = self.gen.engine, self.cfg.generator.group_timeout_s or GROUP_TIMEOUT_UNMEASURED_S
        prompt_ids = [list(t["prompt_token_ids"]) for t in engine.tokenize_prompts([r["text"] for r in rows])]
        futures = [
            engine.submit(self.rollout.sample(r["group_id"], r, ids, seed))
            for r, ids, seed in zip(rows, prompt_ids, seeds)
        ]
        deadline = time.monotonic() + limit
        try:
            return [f.result(max(0.0, deadline - time.monotonic())) for f in futures]
        except TimeoutError:
            raise TimeoutError(
                f"{self.gen.ctx.name}: a batch of {len(rows)} groups was not sampled within {limit:.0f} s "
                "(generator.group_timeout_s)"
            ) from None
        finally:
            for f in futures:
                f.cancel()  # a group still running past the bound is aborted, not left in the engine

    def finish(self) -> None:
        """Nothing is left in the engine between two batches; an agent rollout's gateway stops."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            self.gen.engine.submit(close()).result(AGENT_GRACE_S)
