"""The generator's side of an update with a simulated engine: reported when applied, raised and
reported back when it fails (never swallowed)."""

import pytest
import torch

from asyncrl.generators.engines.mock_engine import MockEngine, MockEngineConfig
from asyncrl.generators.weights_apply import apply_newest_weights
from asyncrl.observability.metrics import REGISTRY
from asyncrl.weights.probe import ProbeCheck
from asyncrl.weights.update import WeightSyncError, WeightUpdate
from tests.factories import RecordingContext


class OneUpdate:
    def __init__(self, update=None, error=None):
        self.update, self.error, self.reports = update, error, []

    def newest(self, served_version, timeout=0.0):
        if self.error is not None:
            raise self.error
        update, self.update = self.update, None
        if update is not None:
            update._on_done = self.reports.append
        return update


def _failures(stage):
    return REGISTRY.get_sample_value("asyncrl_weight_failures_total", {"stage": stage}) or 0.0


def test_an_applied_update_is_reported_with_its_version_and_acked():
    engine, ctx = MockEngine(MockEngineConfig(load_weights_s=0)), RecordingContext()
    sub = OneUpdate(WeightUpdate(3, [("w", torch.zeros(2))], nbytes=8))
    apply_newest_weights(engine, sub, ctx, probe=ProbeCheck(atol=1e-3))
    assert engine.version == 3 and sub.reports == [None]
    (ev,) = ctx.events
    assert ev.type == "version" and ev.version == 3 and ev.bytes == 8
    apply_newest_weights(engine, sub, ctx)  # nothing newer: nothing happens
    assert len(ctx.events) == 1


def test_a_failed_receive_is_counted_and_raised():
    before = _failures("receive")
    sub = OneUpdate(error=TimeoutError("gen-0.weights: waited 1.0 s for bucket 2 of version 5"))
    with pytest.raises(TimeoutError, match="bucket 2 of version 5"):
        apply_newest_weights(MockEngine(MockEngineConfig()), sub, RecordingContext())
    assert _failures("receive") == before + 1


def test_a_failed_apply_is_reported_back_and_raised():
    class Broken(MockEngine):
        def load_weights(self, weights, version):
            raise WeightSyncError("boom")

    before = _failures("apply")
    sub = OneUpdate(WeightUpdate(4, []))
    engine = Broken(MockEngineConfig())
    with pytest.raises(WeightSyncError, match="boom"):
        apply_newest_weights(engine, sub, RecordingContext())
    assert engine.version == 0 and sub.reports == ["WeightSyncError: boom"]
    assert _failures("apply") == before + 1
