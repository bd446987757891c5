"""Partial rollouts, ``resume``: after a weight update, the answers past the staleness bound are
aborted and resumed under the new version, each interruption on the answer and in the ledger;
the resumed answer's segments say which version sampled which tokens, down to the learner."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.generators.completion import Completion
from asyncrl.generators.engines.mock_engine import MockEngine, MockEngineConfig
from asyncrl.generators.engines.mock_stream import MockStream
from asyncrl.generators.groups import build_groups
from asyncrl.generators.interrupt import StaleResumer, answer_params, record_resumed, resume_bound
from asyncrl.generators.parts import GeneratorCounters
from asyncrl.generators.resume import merge_continuation
from asyncrl.generators.sampling import SamplingConfig
from asyncrl.learner.batch import collate
from asyncrl.wire import decode, encode_group
from tests.generators.schedulers.test_continuous import Harness, N, answer, dispatcher, lengths_in_turn, row  # noqa: F401

SLOW = MockEngineConfig(length_sigma=0, length_median=60, decode_step_s=0.004, overhead_s=0)


def test_only_answers_past_the_bound_are_resumed_and_they_keep_their_tokens():
    engine = MockEngine(SLOW)
    stream = MockStream(engine)
    stream.submit("old", "1+2=", SamplingConfig(n=2, max_tokens=64))
    time.sleep(0.05)
    engine.load_weights(None, 1)
    stream.submit("new", "3+4=", SamplingConfig(n=2, max_tokens=64), greedy_tokens=8)
    time.sleep(0.05)
    engine.load_weights(None, 2)
    resumer = StaleResumer(stream, bound=1)
    assert resumer.after_update(engine.version) == 2  # "old"'s answers hold version 0 < 2 - 1
    assert resumer.after_update(engine.version) == 0  # each version acted on once
    done = dict((key, comps) for key, comps, _ in stream.finished(timeout=5) + stream.finished(timeout=5))
    for c in done["old"]:
        (_, v0), (a, v1), (b, v2) = c.version_segments
        assert (v0, v1, v2) == (0, 1, 2) and 0 < a < b < len(c.response_ids) == 60 and c.resumed == 1
    for c in done["new"]:
        assert [v for _, v in c.version_segments] == [1, 2] and c.resumed == 0


def test_a_resumed_group_is_named_in_the_ledger_once_per_interruption(dispatcher):  # noqa: F811
    h = Harness(
        dispatcher,
        ["generator.partial_rollouts=resume", "buffer.max_staleness=0", "learner.broadcast_every=1"],
        engine=SLOW,
    )
    lengths_in_turn(h.engine, [60, 2])
    answer(h, dispatcher, [row("g0")])
    h.run_until(lambda: h.loop.stream.active and h.loop.stream.active[0].done > 5, 5, "g0 to have 5 tokens")
    h.engine.load_weights(None, 1)  # as the in-flight applier does
    h.run_until(lambda: h.outbox.groups, 10, "g0")
    assert h.ctx.ledger.ids("resumed") == ["g0"] * N and h.counts.resumed == N
    (group,) = h.outbox.groups
    assert group.policy_version == 0 and all([v for _, v in s.version_segments] == [0, 1] for s in group.samples)


def test_record_resumed_writes_nothing_for_answers_sampled_in_one_request():
    class Ledger(list):
        def write(self, event, groups, **fields):
            self.append((event, groups))

    ledger, counts = Ledger(), GeneratorCounters()
    one = Completion(np.zeros(1, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32), "", "stop")
    assert record_resumed(ledger, counts, "g0", [one, one]) == 0 and not ledger
    twice = Completion(one.prompt_ids, one.response_ids, one.logprobs, "", "stop", [[0, 0], [1, 1]], resumed=2)
    assert record_resumed(ledger, counts, "g1", [one, twice]) == 2 and ledger == [("resumed", ["g1", "g1"])]
    assert counts.resumed == 2


def test_resume_needs_continuous_generation_and_a_staleness_bound():
    cfg = load_config("configs/bench_pipeline.yaml", ["generator.partial_rollouts=resume", "buffer.max_staleness=3"])
    assert resume_bound(cfg) == 3
    auto = load_config(
        "configs/bench_pipeline.yaml", ["generator.partial_rollouts=resume", "buffer.max_staleness=auto"]
    )
    assert resume_bound(auto) == auto.buffer.auto_staleness.max  # the ceiling: stale under any bound
    assert resume_bound(load_config("configs/bench_pipeline.yaml", ["generator.partial_rollouts=mask"])) is None
    with pytest.raises(ValueError, match="needs generator.mode continuous"):
        load_config("configs/bench_pipeline.yaml", ["generator.partial_rollouts=resume", "generator.mode=batch"])
    with pytest.raises(ValueError, match=r"needs buffer.max_staleness \(null\)"):
        load_config("configs/bench_pipeline.yaml", ["generator.partial_rollouts=resume", "buffer.max_staleness=null"])


def test_each_answer_of_a_group_run_apart_has_its_own_seed():
    class Params:  # the part of vLLM's SamplingParams answer_params uses
        def __init__(self, n, seed):
            self.n, self.seed = n, seed

        def clone(self):
            return Params(self.n, self.seed)

    params = Params(4, 11)
    seeds = [answer_params(params, i).seed for i in range(4)]
    assert len(set(seeds)) == 4 and all(answer_params(params, i).n == 1 for i in range(4))
    assert params.n == 4 and answer_params(Params(2, None), 1).seed is None


def test_a_resumed_answer_reaches_the_learner_token_by_token_with_its_versions():
    """Aborted after 3 tokens under version 4, resumed under version 6: through the wire and the
    learner's batch, each token keeps its behaviour logprob and the version that sampled it."""
    prompt = np.array([5, 6, 7], np.int32)
    prefix = Completion(prompt, np.array([10, 11, 12], np.int32), np.array([-0.1, -0.2, -0.3], np.float32), "", "abort")
    prefix.version_segments = [[0, 4]]
    rest = Completion(
        np.concatenate([prompt, prefix.response_ids]),
        np.array([13, 14], np.int32),
        np.array([-0.4, -0.5], np.float32),
        "",
        "stop",
        [[0, 6]],
    )
    whole = merge_continuation(prefix, rest, prefix_version=4, version=6)
    plain = Completion(prompt, np.array([20, 21], np.int32), np.array([-1.0, -1.1], np.float32), "", "stop", [[0, 6]])
    row_ = {"group_id": "g7", "prompt_uid": "p", "text": "x", "answer": "y", "task": "addition"}
    (group,) = build_groups([row_], [[whole, plain]], version=6, generator="generator-0", rollout_s=1.0)
    group = decode(encode_group(group))[1].group
    assert group.policy_version == 4 and group.samples[0].version_segments == [[0, 4], [3, 6]]
    batch = collate([group], [np.zeros(2)], pad_id=0)
    in_response = batch.response_mask[0] > 0
    assert batch.input_ids[0, 1:][in_response].tolist() == [10, 11, 12, 13, 14]
    assert batch.behaviour_version[0][in_response].tolist() == [4, 4, 4, 6, 6]
    torch.testing.assert_close(batch.behaviour_logprobs[0][in_response], torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]))
    # at learner version 7 with a bound of 1, the buffer masks version 4's tokens: they stay as context
    group.samples[0].trained_from = 3
    masked = collate([group], [np.zeros(2)], pad_id=0)
    kept = masked.response_mask[0] > 0
    assert masked.input_ids[0, 1:][kept].tolist() == [13, 14]
    assert masked.behaviour_version[0][kept].tolist() == [6, 6] and masked.policy_version.tolist() == [6, 6]
