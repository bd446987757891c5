"""Continuous generation with the simulated engine, against a dispatcher of this test's making: groups
leave as soon as their answers are done, room is asked for, a silent dispatcher or a stalled engine
never leaves sequences in the engine, and the end returns what was still sampling."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.generators.channels import PromptSource
from asyncrl.generators.engines.mock_engine import MockEngine, MockEngineConfig
from asyncrl.generators.engines.mock_stream import MockStream
from asyncrl.generators.engines.vllm_engine import SamplingConfig
from asyncrl.generators.parts import GeneratorCounters, GeneratorParts
from asyncrl.generators.schedulers import continuous
from asyncrl.generators.schedulers.continuous import ContinuousLoop, GroupTimeout, InflightBound
from asyncrl.wire.messages import Prompts, WantPrompts
from asyncrl.wire.sockets import ReplyServer

N = 4


def row(gid: str) -> dict:
    return {"group_id": gid, "prompt_uid": f"p-{gid}", "text": "12+34=", "answer": "46", "task": "addition"}


class Ledger:
    def __init__(self):
        self.lines: list[tuple[str, list[str], dict]] = []

    def write(self, event, groups=None, **fields):
        self.lines.append((event, list(groups or []), fields))

    def ids(self, event: str) -> list[str]:
        return [g for e, gs, _ in self.lines if e == event for g in gs]


class Context:
    name = "generator-0"

    def __init__(self, cfg):
        self.cfg, self.ledger, self.events = cfg, Ledger(), []

    def emit(self, event):
        self.events.append(event)


class Outbox:
    def __init__(self):
        self.groups = []

    def send(self, group):
        self.groups.append(group)


class Harness:
    """The parts of a ``Generator`` its continuous loop uses: the real prompt source (to this test's
    dispatcher), counters, drop and send logic; a recording outbox and ledger. ``stream``: the
    engine's stream (a real vLLM one); None: the simulated engine's."""

    def __init__(self, dispatcher: ReplyServer, overrides=(), engine: MockEngineConfig | None = None, stream=None):
        self.cfg = cfg = load_config(
            "configs/bench_pipeline.yaml", [f"sampling.n={N}", "sampling.max_tokens=512", *overrides]
        )
        self.ctx = Context(cfg)
        if stream is None:
            stream = MockStream(MockEngine(engine or MockEngineConfig(decode_step_s=0.001, overhead_s=0), seed=0))
        self.engine = stream.engine
        self.prompts = PromptSource(
            dispatcher.address, "test.prompts", self.ctx.name, 8, cfg.generator.request_timeout_s
        )
        self.outbox = Outbox()
        self.counts = GeneratorCounters()
        self.evals = None
        self.gen_index = 0
        self.loop = ContinuousLoop(self, stream)

    def apply_weights(self):
        pass

    refuse_too_long = GeneratorParts.refuse_too_long
    send = GeneratorParts.send

    def run_until(self, done, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
            self.loop.step()


@pytest.fixture
def dispatcher():
    server = ReplyServer("tcp://127.0.0.1:*", name="test.dispatcher")
    yield server
    server.close()


def answer(h: Harness, server: ReplyServer, rows: list[dict]) -> WantPrompts:
    """Run the loop until it asks, answer the ask with ``rows``; returns the ask."""
    h.run_until(lambda: server.sock.poll(0), 5, "an ask")
    who, _kind, ask = server.recv(timeout=1)
    server.reply(who, Prompts(prompts=rows), ask.request_id)
    return ask


def lengths_in_turn(engine: MockEngine, per_call: list[int]) -> None:
    """The k-th group submitted gets answers of ``per_call[k]`` tokens."""
    calls = iter(per_call)
    engine.draw_lengths = lambda size, max_tokens: np.full(size, next(calls), dtype=np.int64)


def test_a_short_group_overtakes_a_long_one_from_the_same_reply(dispatcher):
    h = Harness(dispatcher)
    lengths_in_turn(h.engine, [300, 3])
    ask = answer(h, dispatcher, [row("g0"), row("g1")])
    assert ask.max_prompts == h.loop.bound.value // N  # room // n
    h.run_until(lambda: len(h.outbox.groups) == 2, 10, "both groups")
    assert [g.group_id for g in h.outbox.groups] == ["g1", "g0"]  # the short one did not wait for the long one
    assert [len(g.samples[0].response_ids) for g in h.outbox.groups] == [3, 300]
    assert h.ctx.ledger.ids("generated") == ["g1", "g0"]
    assert h.counts.generated == 2 * N and h.counts.tokens == N * 303
    assert h.outbox.groups[0].rollout_s < h.outbox.groups[1].rollout_s
    assert h.loop.stream.running == 0 and not h.loop.inflight


def test_room_is_asked_for_as_soon_as_a_group_leaves(dispatcher):
    h = Harness(dispatcher, ["generator.max_inflight_sequences=8"])  # two groups of 4
    lengths_in_turn(h.engine, [200, 2, 2])
    assert answer(h, dispatcher, [row("g0"), row("g1")]).max_prompts == 2
    h.run_until(lambda: len(h.outbox.groups) == 1, 10, "the short group")
    # g0 still runs: the next ask is for the one group's room it freed, long before g0 is done
    assert answer(h, dispatcher, [row("g2")]).max_prompts == 1
    h.run_until(lambda: len(h.outbox.groups) == 2, 10, "the third group")
    assert [g.group_id for g in h.outbox.groups] == ["g1", "g2"] and "g0" in h.loop.inflight


def test_a_silent_dispatcher_never_leaves_sequences_in_the_engine(dispatcher, caplog):
    h = Harness(dispatcher, ["generator.dispatcher_silence_s=0.3"])
    lengths_in_turn(h.engine, [50, 80, 20])
    answer(h, dispatcher, [row("g0"), row("g1"), row("g2")])
    with caplog.at_level(logging.WARNING, logger="asyncrl.generators.schedulers.continuous"):
        # the dispatcher answers nothing more, yet every group is done and sent within the bound
        h.run_until(lambda: h.loop.stream.running == 0 and len(h.outbox.groups) == 3, 10, "the engine to empty")
        h.run_until(lambda: "dispatcher has not answered" in caplog.text, 5, "the silence to be named")
    assert sorted(g.group_id for g in h.outbox.groups) == ["g0", "g1", "g2"]
    assert h.counts.generated == 3 * N


def test_a_group_stuck_in_the_engine_is_aborted_and_dropped_by_name(dispatcher, caplog):
    stalled = MockEngineConfig(decode_step_s=10.0, overhead_s=0)  # 10 s a token: it never ends in time
    h = Harness(dispatcher, ["generator.group_timeout_s=0.3"], engine=stalled)
    answer(h, dispatcher, [row("g0")])
    with caplog.at_level(logging.WARNING, logger="asyncrl.generators.schedulers.continuous"):
        h.run_until(lambda: h.ctx.ledger.ids("dropped"), 5, "the stuck group to be given up")
    assert "group_timeout_s" in caplog.text and "g0" in caplog.text
    assert h.loop.stream.running == 0 and not h.outbox.groups
    assert h.ctx.ledger.lines[-1] == ("dropped", ["g0"], {"reason": "generation_timeout"})
    assert h.counts.generated == N and h.counts.dropped == {"generation_timeout": N}
    # the dispatcher is told with the next ask, to settle it
    told = []
    h.run_until(lambda: (ask := dispatcher.recv(timeout=0)) and told.extend(ask[2].dropped) or told, 5, "the drop told")
    assert told == ["g0"]


def test_a_silent_dispatcher_and_a_stalled_group_end_within_a_bound_scaled_to_the_model(
    dispatcher, caplog, monkeypatch
):
    monkeypatch.setattr(continuous, "GROUP_TIMEOUT_MIN_S", 0.0)  # the floor (30 s) is for real models
    h = Harness(dispatcher, ["sampling.max_tokens=16", "generator.dispatcher_silence_s=0.3"])
    assert h.loop.timeout.seconds() == continuous.GROUP_TIMEOUT_UNMEASURED_S  # nothing measured yet
    lengths_in_turn(h.engine, [8, 10**6])  # g1 would take 1000 s: the engine stalls on it
    answer(h, dispatcher, [row("g0"), row("g1")])
    with caplog.at_level(logging.WARNING, logger="asyncrl.generators.schedulers.continuous"):
        h.run_until(lambda: h.outbox.groups, 10, "the short group")
        # g0 measured the engine: g1 may take 8 x max_tokens at that pace, then it is given up
        limit = h.loop.timeout.seconds()
        assert limit == pytest.approx(continuous.GROUP_TIMEOUT_SLACK * 16 * h.loop.timeout.s_per_token)
        assert limit < 5, limit
        h.run_until(lambda: h.ctx.ledger.ids("dropped"), 5 + 2 * limit, "the stalled group to be given up")
        h.run_until(lambda: "dispatcher has not answered" in caplog.text, 5, "the silence to be named")
    assert h.loop.stream.running == 0 and not h.loop.inflight
    assert "g1" in caplog.text and "16 tokens x" in caplog.text  # the group and the rule, by name
    assert h.ctx.ledger.ids("generated") == ["g0"] and h.ctx.ledger.ids("dropped") == ["g1"]


def test_the_group_timeout_follows_the_engine_speed():
    limit = GroupTimeout(None, max_tokens=100)
    limit.note(rollout_s=2.0, longest=100)  # 0.02 s a token
    assert limit.seconds() == max(continuous.GROUP_TIMEOUT_MIN_S, 8 * 100 * 0.02)
    for _ in range(40):
        limit.note(rollout_s=20.0, longest=100)  # a 10x slower model (or a busier engine)
    assert limit.seconds() == pytest.approx(8 * 100 * 0.2, rel=1e-3)
    assert GroupTimeout(5.0, max_tokens=100).seconds() == 5.0  # configured wins


def test_the_end_returns_what_was_still_sampling(dispatcher):
    h = Harness(dispatcher)
    lengths_in_turn(h.engine, [2, 5000])
    answer(h, dispatcher, [row("g0"), row("g1")])
    h.run_until(lambda: len(h.outbox.groups) == 1, 10, "the short group")
    h.loop.finish()
    assert h.ctx.ledger.ids("generated") == ["g0"] and h.ctx.ledger.ids("returned") == ["g1"]
    assert h.loop.stream.running == 0 and h.counts.generated == N  # returned prompts were never sampled


def test_a_group_handed_out_again_while_it_samples_here_is_sampled_once(dispatcher):
    # the dispatcher's lease on a long group ran out unseen: it comes back to the same generator
    h = Harness(dispatcher)
    lengths_in_turn(h.engine, [300, 5000])
    answer(h, dispatcher, [row("g0")])
    h.run_until(lambda: "g0" in h.loop.inflight, 10, "g0 in the engine")
    answer(h, dispatcher, [row("g0"), row("g1")])
    h.run_until(lambda: "g1" in h.loop.inflight, 10, "g1 in the engine")
    h.run_until(lambda: h.outbox.groups, 10, "g0")
    assert [g.group_id for g in h.outbox.groups] == ["g0"] and h.loop.submitted == 2


def test_greedy_baseline_rides_with_its_group(dispatcher):
    h = Harness(dispatcher, ["generator.greedy_baseline=true", "algorithm.adv_estimator=remax"])
    assert h.loop.per_group == N + 1
    answer(h, dispatcher, [row("g0")])
    h.run_until(lambda: h.outbox.groups, 10, "the group")
    assert h.outbox.groups[0].greedy_text in ("46", "47")


def test_a_version_loaded_while_sequences_run_starts_a_segment():
    engine = MockEngine(MockEngineConfig(length_sigma=0, length_median=200, decode_step_s=0.005, overhead_s=0))
    stream = MockStream(engine)
    stream.submit("g0", "1+2=", SamplingConfig(n=2, max_tokens=256))
    time.sleep(0.1)
    engine.load_weights(None, 1)  # as the in-flight applier does, from its thread
    ((key, completions, _),) = stream.finished(timeout=5)
    for c in completions:
        (_, v0), (first, v1) = c.version_segments
        assert (v0, v1) == (0, 1) and 0 < first < len(c.response_ids) == 200


def test_the_bound_shrinks_under_kv_pressure_never_below_a_group_and_grows_back_when_it_ends():
    bound = InflightBound(None, capacity=40, fallback=16, per_group=8)
    assert bound.value == 40 and bound.room(running=17) == 2
    assert not bound.update(0, now=0.0)
    assert bound.update(2, now=0.0) and bound.value == 30
    assert not bound.update(5, now=0.5)  # the same episode
    assert bound.update(6, now=2.0) and bound.value == 22
    for t in range(3, 10):
        bound.update(10 + t, now=2.0 * t)
    assert bound.value == 8
    # the pressure ends: one group back at a time, once quiet, never past the ceiling
    quiet = 18.0 + continuous.GROW_QUIET_S
    assert not bound.update(19, now=quiet - 0.1) and bound.value == 8
    assert bound.update(19, now=quiet) and bound.value == 16
    assert not bound.update(19, now=quiet + 0.1) and bound.value == 16  # gradually
    for k in range(1, 10):
        bound.update(19, now=quiet + k * continuous.GROW_EVERY_S)
    assert bound.value == bound.ceiling == 40
    assert bound.update(20, now=100.0) and bound.value == 30  # pressure again: the quiet clock restarts
    assert not bound.update(20, now=100.0 + continuous.GROW_QUIET_S - 0.1)
    assert InflightBound(12, capacity=400, fallback=16, per_group=8).value == 12  # configured wins
    assert InflightBound(None, capacity=None, fallback=16, per_group=8).value == 16
    assert InflightBound(4, capacity=None, fallback=16, per_group=8).value == 8  # room for one group at least
