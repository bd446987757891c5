"""A go that holds the starting weights keeps every publication out until the release (both apply modes)."""

import threading

from asyncrl.generators import inflight, parts
from asyncrl.generators.inflight import InFlightApplier
from asyncrl.generators.parts import GeneratorParts
from asyncrl.generators.weights_hold import WeightsHold
from asyncrl.wire.messages import GoCommand


class Ctx:
    name = "generator-0"
    go_command = None
    weights_released = False


def test_between_requests_a_held_go_applies_nothing_until_released(monkeypatch):
    applied = []
    monkeypatch.setattr(parts, "apply_newest_weights", lambda engine, weights, ctx, probe: applied.append(1))
    gen = GeneratorParts.__new__(GeneratorParts)  # only what apply_weights reads
    ctx = Ctx()
    gen.ctx, gen.engine, gen.weights, gen.probe, gen.applier = ctx, None, None, None, None
    gen.hold = WeightsHold(ctx)
    gen.apply_weights()
    assert applied == [1]  # before go: nothing to hold
    ctx.go_command = GoCommand(hold_weights_s=600.0)
    gen.apply_weights()
    gen.apply_weights()
    assert applied == [1]
    ctx.weights_released = True
    gen.apply_weights()
    assert applied == [1, 1]


def test_in_flight_a_held_go_applies_nothing_until_released(monkeypatch):
    applied = threading.Event()
    monkeypatch.setattr(inflight, "apply_newest_weights", lambda engine, weights, ctx, probe: applied.set())
    ctx = Ctx()
    ctx.go_command = GoCommand(hold_weights_s=600.0)
    hold = WeightsHold(ctx)
    applier = InFlightApplier(None, None, None, poll_s=0.01, held=hold.held)
    try:
        assert not applied.wait(0.3)  # thirty polls, all held
        ctx.weights_released = True
        assert applied.wait(10.0)
    finally:
        applier.close()
