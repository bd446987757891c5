"""Continuous generation (``generator.mode: continuous``): the engine is kept full, groups leave when done.

The batch loop asks for ``prompts_per_batch`` prompts, samples them in one engine call and waits
for the slowest answer: on long-tailed answer lengths the engine runs nearly empty while the last
few finish. Here each generator keeps up to ``bound`` sequences in its engine instead:

- **Room is asked for at once.** While the engine holds fewer than ``bound`` sequences, one ask
  for ``room // sequences_per_group`` prompts is outstanding at the dispatcher (whose admission
  still decides how many it gets); its rows are submitted the moment they arrive.
- **A group leaves when its n answers are done** (and its greedy answer, with ReMax's baseline):
  no barrier, so a short group overtakes a long one that came in the same reply.
- **Nothing waits on the dispatcher.** The ask is sent without waiting (``PromptSource.send_ask``)
  and its reply is polled between looks at the engine, so a dispatcher that stops answering only
  stops new prompts: the sequences in flight run on and are sent, and the silence is logged by name
  after ``dispatcher_silence_s``. A group still in the engine past its timeout (a stalled
  engine; ``generator.group_timeout_s``, by default scaled to the seconds per token the engine has
  shown, ``GroupTimeout``) is aborted and dropped, reason ``generation_timeout``, and named in the
  log: the engine never holds it forever.
- **Weights change in flight** (``weights.apply_mode: in_flight``, the only mode continuous
  generation allows): each sample's ``version_segments`` say which version sampled which tokens,
  and its group is stamped with the oldest.
- **Partial rollouts** (``generator.partial_rollouts: resume``): after each update the answers
  whose oldest tokens are past the staleness bound are aborted and resumed under the new version
  (``asyncrl.generators.interrupt``); each interruption is a ledger line ``resumed``.
- **The bound** (``InflightBound``) is ``generator.max_inflight_sequences``, by default what the
  engine's KV cache holds: vLLM's KV blocks // the blocks one sequence of
  ``generator.expected_sequence_tokens`` takes (by default ``engine.max_model_len``: then no
  sequence is ever preempted), at most ``engine.max_num_seqs``. It shrinks by a quarter when the
  engine reports KV pressure (sequences preempted for want of KV cache, which recompute their
  KV: wasted work, or waiting for blocks) and grows back one group at a time once it stops.

At the end (``finish``) what is still in the engine is aborted and its prompts are written to the
ledger as ``returned`` (dispatched, never sampled), like prompts that arrive after the last turn.

An engine is driven through a *stream* (the ``Stream`` interface of ``asyncrl.generators.engines.base``:
``MockStream`` for the simulated engine, ``VLLMStream`` for vLLM's ``AsyncLLM``): single answers
by ``submit``, any other rollout (multi-turn episodes with an environment, agent programs
through the gateway: ``build_rollout``) by ``submit_rollout``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.generators.groups import build_groups
from asyncrl.generators.interrupt import StaleResumer, record_resumed, resume_bound
from asyncrl.generators.sampling import request_seed
from asyncrl.observability.metrics import BUSY_SECONDS, ROLLOUT_SECONDS
from asyncrl.wire.messages import PromptRow

if TYPE_CHECKING:
    from asyncrl.generators.parts import GeneratorParts
    from asyncrl.generators.rollouts.base import Rollout

log = logging.getLogger(__name__)

ENGINE_POLL_S = 0.05
"""Longest wait on the engine for a finished group when no ask is outstanding."""
REPLY_POLL_S = 0.01
"""Longest wait on the dispatcher's reply between two looks at the engine."""
PRESSURE_COOLDOWN_S = 1.0
"""After the bound shrinks, KV pressure within this many seconds is the same episode."""
GROW_QUIET_S = 5.0
"""Seconds without KV pressure before the bound grows back."""
GROW_EVERY_S = 2.0
"""The bound grows back by one group at most this often."""
GROUP_TIMEOUT_SLACK = 8
"""A group may take this many times the tokens/s the engine has shown before it is given up."""
GROUP_TIMEOUT_MIN_S = 30.0
"""The scaled group timeout is never shorter (a weight swap or a slow step is not a stall)."""
GROUP_TIMEOUT_UNMEASURED_S = 600.0
"""The group timeout until a group has finished and the engine's speed is known."""
AGENT_GRACE_S = 30.0
"""Beyond ``agent.episode_timeout_s``, the least a group of agent episodes is given: the program's
own bound ends its episode (unscored, ``agent_timeout``) before the group is given up."""


def build_rollout(cfg, engine) -> Rollout | None:
    """The config's multi-turn rollout on ``engine`` (an ``AsyncVLLMEngine``): agent programs
    (``agent.command``) or an environment (``environment.cls``); None: single answers, which the
    stream samples itself (``SingleTurn``, or the simulated engine's)."""
    if cfg.agent.command is not None:
        from asyncrl.generators.gateway.agent_rollout import AgentGroups

        return AgentGroups(engine, cfg.agent, cfg.sampling, cfg.engine.max_model_len)
    if cfg.environment.cls is not None:
        from asyncrl.generators.rollouts.episode_group import EpisodeGroups

        return EpisodeGroups(engine, cfg.environment, cfg.sampling, cfg.engine.max_model_len)
    return None


class InflightBound:
    """The most sequences a generator keeps in its engine: additive increase, multiplicative
    decrease (AIMD, as TCP's congestion window, Jacobson 1988) on the engine's KV pressure.

    The ceiling is ``configured``, else the engine's ``capacity`` (what its KV cache holds at the
    expected sequence length), else ``fallback``; never below one group (``per_group``
    sequences). Each episode of KV pressure (the engine ran out of KV cache: it preempts
    sequences, which recompute what it evicted, wasted work, or leaves new ones waiting) shrinks
    the bound by a quarter; after ``GROW_QUIET_S`` without pressure it grows back by one group
    every ``GROW_EVERY_S``, up to the ceiling.

    >>> bound = InflightBound(None, 64, 32, per_group=8)
    >>> bound.value, bound.update(3, now=0.0), bound.value
    (64, True, 48)
    >>> bound.update(3, now=GROW_QUIET_S), bound.value
    (True, 56)
    """

    def __init__(self, configured: int | None, capacity: int | None, fallback: int, per_group: int, name: str = ""):
        if per_group < 1:
            raise ValueError(f"per_group ({per_group}) must be >= 1")
        start = configured or capacity or fallback
        self.ceiling = self.value = max(per_group, start)
        self.per_group = per_group
        self.name = name
        self.seen = 0
        self.shrunk_at = float("-inf")
        """When the last episode of KV pressure began shrinking the bound."""
        self.pressure_at = float("-inf")
        """When the engine last reported KV pressure."""
        self.grown_at = float("-inf")
        if configured is None:
            log.info("%s: up to %d sequences in flight (%s)", name, self.value, "KV cache" if capacity else "default")

    def update(self, pressure: int, now: float) -> bool:
        """Note the engine's running count of KV-pressure signals (``stream.kv_pressure()``) at
        ``now`` (time.monotonic()); True if the bound moved."""
        new, self.seen = pressure - self.seen, pressure
        if new > 0:
            self.pressure_at = now
            if now - self.shrunk_at < PRESSURE_COOLDOWN_S or self.value <= self.per_group:
                return False
            old, self.value = self.value, max(self.per_group, (self.value * 3) // 4)
            self.shrunk_at = now
            log.warning(
                "%s: the engine's KV cache is full (%d signals: sequences preempted or waiting for blocks): in flight %d -> %d",
                self.name,
                new,
                old,
                self.value,
            )
            return True
        if self.value >= self.ceiling or now - self.pressure_at < GROW_QUIET_S or now - self.grown_at < GROW_EVERY_S:
            return False
        self.value = min(self.ceiling, self.value + self.per_group)
        self.grown_at = now
        if self.value == self.ceiling:
            log.info("%s: no KV pressure for %g s: back to %d sequences in flight", self.name, GROW_QUIET_S, self.value)
        return True

    def room(self, running: int) -> int:
        """Groups that fit beside ``running`` sequences."""
        return max(0, self.value - running) // self.per_group


class GroupTimeout:
    """How long a group may stay in the engine before it is aborted (``generator.group_timeout_s``,
    or scaled to the model and engine at hand).

    Scaled: ``GROUP_TIMEOUT_SLACK`` x ``max_tokens`` x the seconds per token the engine has taken
    (a moving average over finished groups, rollout time / their longest answer), at least
    ``floor_s`` (``GROUP_TIMEOUT_MIN_S``; an agent program's episode timeout and its grace, so that
    the program's own bound ends its episode first); ``GROUP_TIMEOUT_UNMEASURED_S`` until a group
    has finished. A larger model or a busier engine decodes more slowly, and is given longer.

    >>> limit = GroupTimeout(None, max_tokens=512)
    >>> limit.seconds(), limit.note(10.0, 100), limit.seconds()
    (600.0, None, 409.6)
    """

    def __init__(self, configured: float | None, max_tokens: int, floor_s: float = GROUP_TIMEOUT_MIN_S):
        self.configured, self.max_tokens, self.floor_s = configured, max_tokens, floor_s
        self.s_per_token: float | None = None

    def note(self, rollout_s: float, longest: int) -> None:
        """A group finished: ``rollout_s`` in the engine, its longest answer ``longest`` tokens."""
        rate = rollout_s / max(1, longest)
        self.s_per_token = rate if self.s_per_token is None else 0.8 * self.s_per_token + 0.2 * rate

    def seconds(self) -> float:
        if self.configured is not None:
            return self.configured
        if self.s_per_token is None:
            return max(GROUP_TIMEOUT_UNMEASURED_S, self.floor_s)
        return max(self.floor_s, GROUP_TIMEOUT_SLACK * self.max_tokens * self.s_per_token)

    def rule(self) -> str:
        """Where ``seconds()`` comes from, for the log."""
        if self.configured is not None:
            return "generator.group_timeout_s"
        if self.s_per_token is None:
            return "no group finished yet"
        return f"{GROUP_TIMEOUT_SLACK} x {self.max_tokens} tokens x {self.s_per_token:.3g} s a token"


@dataclass
class _InFlight:
    row: PromptRow
    submitted: float
    """time.monotonic() when it went into the engine."""
    sampled_at: float
    """Wall clock then (end-to-end latency)."""


class ContinuousLoop:
    """One generator's continuous turns (``step``) and end (``finish``); see the module docstring."""

    def __init__(self, gen: GeneratorParts, stream):
        self.gen, self.stream = gen, stream
        self.cfg = gen.cfg
        gcfg = self.cfg.generator
        self.per_group = self.cfg.sampling.n + (1 if gcfg.greedy_baseline else 0)
        self.bound = InflightBound(
            gcfg.max_inflight_sequences,
            stream.capacity(gcfg.expected_sequence_tokens or self.cfg.engine.max_model_len),
            gcfg.prompts_per_batch * self.per_group,
            self.per_group,
            gen.ctx.name,
        )
        # Multi-turn: each group is n episodes (an environment's, or agent programs'); None: single answers.
        self.episodes = build_rollout(self.cfg, stream.engine)
        turns, floor = 1, GROUP_TIMEOUT_MIN_S  # model turns a group's sequence may take: its timeout scales with them
        if self.cfg.agent.command is not None:
            turns, floor = self.cfg.agent.max_calls, max(floor, self.cfg.agent.episode_timeout_s + AGENT_GRACE_S)
        elif self.cfg.environment.cls is not None:
            turns = self.cfg.environment.max_turns
        self.timeout = GroupTimeout(gcfg.group_timeout_s, self.cfg.sampling.max_tokens * turns, floor)
        self.inflight: dict[str, _InFlight] = {}
        self.asked_at: float | None = None
        """time.monotonic() of the outstanding ask (None: none outstanding)."""
        self.answered_at = time.monotonic()
        self.silence_logged = False
        self.submitted = 0
        self.busy_since: float | None = None
        bound = resume_bound(self.cfg)  # partial rollouts: answers too stale are resumed after updates
        self.resumer = None if bound is None else StaleResumer(stream, bound, gen.ctx.name)

    def step(self) -> None:
        """Apply weights, answer an evaluation, send what is done, ask for room, take what came."""
        gen = self.gen
        gen.apply_weights()  # in flight: report what the applier swapped, raise what failed
        if self.resumer is not None:
            self.resumer.after_update(gen.engine.version)
        if gen.evals is not None:
            from asyncrl.generators.evaluation import answer_eval_request

            answer_eval_request(gen.engine, gen.evals, gen.ctx, gen.eval_counters, self.episodes)
        self.send_finished(0.0)
        now = time.monotonic()
        self.expire(now)
        self.bound.update(self.stream.kv_pressure(), now)
        if self.asked_at is not None and now - self.asked_at > self.cfg.generator.request_timeout_s:
            self.asked_at = None  # held past its deadline: ask again, with the version now served
        room = self.bound.room(self.stream.running)
        if self.asked_at is None and room > 0:
            self.asked_at = now
            self.take(gen.prompts.send_ask(gen.engine.version, gen.counts.dropped_ids, room))
            gen.counts.dropped_ids = []
        if self.asked_at is not None:
            # Wait for the reply until the engine may have a group done (a simulated engine knows when).
            self.take(
                gen.prompts.take_reply(self.stream.until_next(REPLY_POLL_S if self.stream.running else ENGINE_POLL_S))
            )
            self.send_finished(0.0)
        else:
            self.send_finished(ENGINE_POLL_S)
        self.note_silence(time.monotonic())

    def take(self, rows: list[PromptRow] | None) -> None:
        """Submit a reply's rows (None: no reply yet). A row of a group still in the engine here
        is not sampled twice: the dispatcher hands a group out again when its lease runs out
        unseen (``asyncrl.dispatcher.outstanding``), which a long group (agent episodes) can
        outlast; the copy in flight is sent when done, and the ids keep it to one."""
        if rows is None:
            return
        self.asked_at = None
        self.answered_at = time.monotonic()
        self.silence_logged = False
        gen, cfg = self.gen, self.cfg
        greedy_tokens = cfg.sampling.max_tokens if cfg.generator.greedy_baseline else None
        running = [r["group_id"] for r in rows if r["group_id"] in self.inflight]
        if running:
            log.info(
                "%s: groups %s were handed out again while still sampling here: not sampled twice",
                gen.ctx.name,
                running[:5],
            )
            rows = [r for r in rows if r["group_id"] not in self.inflight]
        for row in gen.refuse_too_long(rows):
            seed = request_seed(cfg.run.seed, row["group_id"])  # reproducible per group
            if self.episodes is not None:
                self.stream.submit_rollout(row["group_id"], row, self.episodes, seed)
            else:
                self.stream.submit(row["group_id"], row["text"], cfg.sampling, seed, greedy_tokens)
            self.submitted += 1
            self.inflight[row["group_id"]] = _InFlight(row, time.monotonic(), time.time())
        self.note_busy()

    def send_finished(self, wait: float) -> None:
        """Send every group the engine has done (waiting up to ``wait`` s for the first)."""
        finished = self.stream.finished(wait)
        now = time.monotonic()
        for key, completions, greedy in finished:
            flight = self.inflight.pop(key)
            rollout_s = now - flight.submitted
            self.timeout.note(rollout_s, max((len(c.response_ids) for c in completions), default=0))
            (group,) = build_groups(
                [flight.row], [completions], self.gen.engine.version, self.gen.ctx.name, rollout_s, flight.sampled_at
            )
            if greedy is not None:
                group.greedy_text = greedy
            ROLLOUT_SECONDS.observe(rollout_s)
            self.gen.ctx.ledger.write("generated", [key], version=group.policy_version)
            record_resumed(self.gen.ctx.ledger, self.gen.counts, key, completions)
            self.gen.send([group])
        if finished:
            self.gen.counts.batches += 1
        self.note_busy()

    def note_busy(self) -> None:
        """Busy time: while the engine holds any sequence of this generator's."""
        now, counts = time.monotonic(), self.gen.counts
        if self.busy_since is not None:
            counts.busy_s += now - self.busy_since
            BUSY_SECONDS.inc(now - self.busy_since)
        self.busy_since = now if self.inflight else None

    def expire(self, now: float) -> None:
        """Abort and drop the groups in the engine past the group timeout (``GroupTimeout``)."""
        limit = self.timeout.seconds()
        late = [key for key, f in self.inflight.items() if now - f.submitted > limit]
        if not late:
            return
        log.warning(
            "%s: groups %s were still in the engine after the group timeout (%.3g s: %s): aborted and dropped",
            self.gen.ctx.name,
            late[:5],
            limit,
            self.timeout.rule(),
        )
        self.stream.abort(late)
        counts, n = self.gen.counts, self.cfg.sampling.n
        for key in late:
            del self.inflight[key]
        counts.dropped["generation_timeout"] += len(late) * n
        counts.generated += len(late) * n  # as the ledger counts them: n samples a group
        counts.dropped_ids.extend(late)
        self.gen.ctx.ledger.write("dropped", late, reason="generation_timeout")

    def note_silence(self, now: float) -> None:
        silent_s = now - self.answered_at
        if silent_s > self.cfg.generator.dispatcher_silence_s and not self.silence_logged:
            self.silence_logged = True
            log.warning(
                "%s: the dispatcher has not answered for %.0f s; the %d sequences in flight go on and are sent",
                self.gen.ctx.name,
                silent_s,
                self.stream.running,
            )

    def finish(self) -> None:
        """Abort what is still in the engine; its prompts go to the ledger as ``returned``; an
        agent rollout's gateway stops (its open episodes end)."""
        self.send_finished(0.0)
        if self.inflight:
            keys = list(self.inflight)
            self.stream.abort(keys)
            self.gen.ctx.ledger.write("returned", keys)
            log.info("%s: %d groups still sampling at the end were returned unsampled", self.gen.ctx.name, len(keys))
            self.inflight.clear()
        close = getattr(self.episodes, "close", None)
        if close is not None:
            self.stream.engine.submit(close()).result(AGENT_GRACE_S)
        self.note_busy()
