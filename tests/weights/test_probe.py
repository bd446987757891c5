"""The probe's decision with an engine that answers fixed logprobs: calibrated at identical
weights, it passes numerics of a real model's size and fails on weights that did not load or
that are wrong, naming which."""

import numpy as np
import pytest

from asyncrl.weights.probe import MIN_ATOL, PROBE_CONTINUATION, Probe, ProbeCheck, learner_probe
from asyncrl.weights.update import WeightSyncError

rng = np.random.default_rng(0)
PREVIOUS = -rng.uniform(0.1, 3.0, 48)  # the learner's logprobs of the probe text at version 4
NEW = PREVIOUS + rng.normal(0, 0.05, 48)  # ... and at version 5 (one step later)


class Served:
    """An engine serving ``version`` whose logprobs of the probe text are ``logprobs``."""

    def __init__(self, version, logprobs):
        self.version, self.logprobs, self.scored = version, np.asarray(logprobs), 0

    def score(self, prompt, continuation_ids):
        self.scored += 1
        assert len(continuation_ids) == len(self.logprobs)
        return self.logprobs.astype(np.float32)


def _probe(new=NEW, previous=PREVIOUS, previous_version=4):
    previous = None if previous is None else list(previous)
    return Probe("12+34=", list(range(48)), list(new), 5, previous_version, previous).to_wire()


def _update(check, engine, served_after, body):
    """What ``apply_newest_weights`` does: calibrate, load, check."""
    check.before_load(engine, body)
    engine.logprobs, engine.version = np.asarray(served_after), 5
    return check.check(engine, body, 5)


def test_a_bf16_sized_mismatch_passes_once_calibrated():
    """Per-token noise of 0.03 (a bf16 engine against a learner, 30 layers) fails a fixed 5e-2
    bound on the largest token, and passes the calibrated mean."""
    noise = lambda: rng.normal(0, 0.03, 48)  # noqa: E731
    engine = Served(4, PREVIOUS + noise())
    check = ProbeCheck(atol=5e-2)
    result = _update(check, engine, NEW + noise(), _probe())
    assert engine.scored == 2 and check.noise is not None and 0.015 < check.noise < 0.035
    assert result.max_diff > 5e-2 > result.mean_diff  # the old rule failed this healthy update
    assert result.tol == pytest.approx(5 * check.noise) and result.previous_diff > result.mean_diff
    # calibrated once: the next update is scored once
    engine.version = 5
    _update(check, engine, NEW + noise(), _probe(previous_version=5))
    assert engine.scored == 3


def test_an_update_that_did_not_load_is_named():
    engine = Served(4, PREVIOUS + rng.normal(0, 1e-4, 48))
    check = ProbeCheck(atol=1e-3)
    with pytest.raises(WeightSyncError, match="still serves version 4's weights: the update did not load"):
        _update(check, engine, PREVIOUS + rng.normal(0, 1e-4, 48), _probe())


def test_wrong_weights_are_named():
    engine = Served(4, PREVIOUS)
    with pytest.raises(WeightSyncError, match="neither the published version's nor the previous one's"):
        _update(ProbeCheck(atol=1e-3), engine, NEW + rng.normal(0, 1.0, 48), _probe())


def test_without_calibration_the_dtype_bound_holds_and_clear_movement_passes():
    """A resumed learner's first publication has no previous logprobs: the dtype bound; an engine
    that serves another version than the previous one: no calibration, but an update that clearly
    moved to the new weights passes."""
    check = ProbeCheck(atol=1e-3)
    with pytest.raises(WeightSyncError, match=r"weights.probe_atol \(not calibrated yet\)"):
        _update(
            check,
            Served(0, PREVIOUS),
            NEW + 0.01,
            _probe(previous=None, previous_version=None),
        )
    engine = Served(2, PREVIOUS)
    result = _update(check, engine, NEW + 0.002, _probe())  # 0.002 > atol, but 20x closer to new than previous
    assert engine.scored == 1 and check.noise is None and result.mean_diff > 1e-3


def test_identical_weights_that_disagree_are_two_models():
    engine = Served(4, PREVIOUS + 0.5)
    with pytest.raises(WeightSyncError, match="do not run the same model"):
        _update(ProbeCheck(atol=1e-3), engine, NEW, _probe())


def test_exact_agreement_still_leaves_room_for_reordered_sums():
    check = ProbeCheck(atol=1e-3)
    check.calibrate(PREVIOUS, PREVIOUS)
    assert check.tol == MIN_ATOL


def test_a_malformed_probe_names_the_field():
    body = _probe()
    body["logprobs"] = body["logprobs"][:3]
    with pytest.raises(WeightSyncError, match="probe logprobs has 3 values for 48 continuation tokens"):
        ProbeCheck(atol=1e-3).check(Served(5, NEW), body, 5)


def test_the_learner_chains_each_version_to_the_one_before():
    first = Probe("p", [1, 2], [-1.0, -2.0], 0)
    second = first.after(3, [-1.5, -2.5])
    assert (second.version, second.previous_version, second.previous_logprobs) == (3, 0, [-1.0, -2.0])
    assert Probe.from_wire(second.to_wire()) == second


def test_the_probe_text_is_cut_to_the_engine_length(tmp_path):
    """Dozens of tokens where the engine takes them; cut to fit a toy's max_model_len."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    path = build_tiny_model(TinyModelConfig(max_position_embeddings=256), tmp_path / "m")
    model, tok = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)
    full = learner_probe(model, tok, max_len=256)
    assert len(full["continuation_ids"]) == len(PROBE_CONTINUATION)  # one token per character
    cut = learner_probe(model, tok, max_len=64)
    assert len(cut["continuation_ids"]) == 64 - 1 - len("12+34=")
    assert np.allclose(cut["logprobs"], full["logprobs"][: len(cut["logprobs"])], atol=1e-5)
