"""A generator's side of held-out evaluation, over real sockets: one request per turn, answered
greedily by the engine, reported to the controller and counted apart from samples."""

import time
from types import SimpleNamespace

import msgspec

from asyncrl.generators.engines.mock_engine import MockEngine, MockEngineConfig
from asyncrl.generators.evaluation import EvalCounters, answer_eval_request
from asyncrl.generators.sampling import SamplingConfig
from asyncrl.wire.messages import EvalRequest
from asyncrl.wire.sockets import EvalRequestReceiver, EvalRequestSender, StreamReceiver, StreamSender
from tests.waits import wait_until


class Ctx:
    """The part of a process context the eval path uses: its name and its report channel."""

    def __init__(self, name, events_address):
        self.name = name
        self.cfg = SimpleNamespace(sampling=SamplingConfig())
        self.events = StreamSender(events_address, name=f"{name}.events")

    def report(self, message):
        self.events.send(msgspec.structs.replace(message, source=self.name), timeout=5)


def request(chunk, prompts):
    return EvalRequest(round="v2", chunk=chunk, version=2, prompts=prompts, max_new_tokens=4, sent_at=time.time())


def test_a_generator_answers_one_request_per_turn_and_counts_it_apart():
    sender = EvalRequestSender("tcp://127.0.0.1:0")
    events = StreamReceiver("tcp://127.0.0.1:0", name="controller.events")
    receiver = EvalRequestReceiver(sender.address, name="generator-0.evals")
    ctx = Ctx("generator-0", events.address)
    engine = MockEngine(MockEngineConfig(overhead_s=0, decode_step_s=0, decode_s_per_seq=0, accuracy=1.0))
    engine.version = 5
    counters = EvalCounters()
    try:
        wait_until(lambda: sender.offer(request(0, ["07+45=", "10+10="])), "the generator to connect")
        sender.offer(request(1, ["01+01="]))
        # a turn answers at most one request, even with two waiting
        wait_until(lambda: answer_eval_request(engine, receiver, ctx, counters), "a turn that answers a request")
        assert counters.requests == 1 and counters.prompts == 2
        kind, body = events.recv(timeout=5)
        assert kind == "eval_result" and body.chunk == 0 and body.round == "v2"
        assert body.texts == ["52", "20"] and body.version == 5 and body.generator == "generator-0"
        assert body.queued_s >= 0 and body.seconds >= 0
        wait_until(lambda: answer_eval_request(engine, receiver, ctx, counters), "a turn that answers the second")
        assert counters.requests == 2
        assert events.recv(timeout=5)[1].texts == ["2"]
        assert not answer_eval_request(engine, receiver, ctx, counters)  # nothing waiting: no wait either
    finally:
        for sock in (sender, receiver, events, ctx.events):
            sock.close()


def test_a_prompt_the_engine_refuses_fails_the_request_not_the_generator():
    class Refusing(MockEngine):
        def answer(self, prompts, options):
            raise ValueError("prompt 0 (310 tokens) leaves no room in engine.max_model_len (256)")

    sender = EvalRequestSender("tcp://127.0.0.1:0")
    events = StreamReceiver("tcp://127.0.0.1:0", name="controller.events")
    receiver = EvalRequestReceiver(sender.address, name="generator-0.evals")
    ctx = Ctx("generator-0", events.address)
    try:
        wait_until(lambda: sender.offer(request(0, ["a long prompt", "x"])), "the generator to connect")
        counters = EvalCounters()
        engine = Refusing(MockEngineConfig())
        wait_until(lambda: answer_eval_request(engine, receiver, ctx, counters), "a turn that answers the request")
        assert events.recv(timeout=5)[1].texts == ["", ""]
    finally:
        for sock in (sender, receiver, events, ctx.events):
            sock.close()


class Receiver:
    def __init__(self, *requests):
        self.queue = list(requests)

    def take(self):
        return self.queue.pop(0) if self.queue else None


class Served:
    version = 0


def test_a_request_waits_for_the_version_it_was_asked_at_and_then_is_given_out():
    from asyncrl.generators.evaluation import HeldForVersion

    now = [0.0]
    engine = Served()
    held = HeldForVersion(
        Receiver(request(0, ["1+1="]), request(1, ["2+2="])), engine, hold_s=30.0, clock=lambda: now[0]
    )
    assert held.take() is None  # asked at version 2, the engine serves 0
    now[0] = 29.0
    assert held.take() is None  # still held, and the next request does not overtake it
    engine.version = 2
    assert held.take().chunk == 0
    assert held.take().chunk == 1  # its version is served already: given out at once
    assert held.take() is None


def test_a_request_held_past_its_bound_is_answered_with_the_version_served_and_logged(caplog):
    from asyncrl.generators.evaluation import HeldForVersion

    now = [0.0]
    held = HeldForVersion(Receiver(request(0, ["1+1="])), Served(), hold_s=30.0, clock=lambda: now[0])
    assert held.take() is None
    now[0] = 30.0
    with caplog.at_level("WARNING"):
        assert held.take().chunk == 0
    assert "asked at version 2" in caplog.text and "still serves version 0" in caplog.text
