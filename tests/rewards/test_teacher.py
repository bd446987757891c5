"""The teacher scores every answer token, and fails like a reward: unscored with its reason, never silent."""

import asyncio
import threading
import time

import numpy as np
import pytest

from asyncrl.rewards.base import TeacherLogprobs, score_with
from asyncrl.rewards.registry import RewardSpec, build_reward
from asyncrl.rewards.rules import ExactMatchReward
from asyncrl.rewards.teacher import TeacherConfig, TeacherReward
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import GroupMessage
from asyncrl.wire.schema import Episode
from tests.factories import make_group


class _Stub(TeacherReward):
    """A teacher without a model: ``score_sequences`` gives -0.25 per token, or what the test makes it do."""

    def __init__(self, timeout_s=5.0, behaviour=None, vocab_size=100):
        self.name, self.cfg = "teacher", TeacherConfig(path="unused", timeout_s=timeout_s)
        self.vocab_size, self.max_positions = vocab_size, 64
        self._lock, self.failures = threading.Lock(), 0
        self.behaviour = behaviour

    def score_sequences(self, rows):
        if self.behaviour is not None:
            self.behaviour()
        return [np.full(len(r), -0.25, dtype=np.float32) for _p, r in rows]


def _score(group, teacher):
    group.answer = "0"
    return asyncio.run(score_with(group, [(ExactMatchReward("exact_match"), 1.0), (teacher, 1.0)]))


def test_teacher_logprobs_travel_with_the_sample_and_leave_the_reward_alone():
    group = _score(make_group("g", n=2), _Stub())
    assert group.scored and group.unscored_reason is None
    assert [s.reward for s in group.samples] == [1.0, 0.0]  # exact match only: the teacher is no reward
    for s in group.samples:
        assert s.teacher_logprobs.tolist() == [-0.25] * 3
        assert s.reward_parts["teacher"] == pytest.approx(-0.25 - -0.5)  # mean log pi_T - log mu
    kind, message = decode(encode(GroupMessage(group=group)))  # and on the wire
    assert message.group.samples[1].teacher_logprobs.tolist() == [-0.25] * 3


def test_a_teacher_that_times_out_leaves_the_group_unscored_by_that_reason():
    group = _score(make_group("g", n=2), _Stub(timeout_s=0.05, behaviour=lambda: time.sleep(0.5)))
    assert not group.scored
    assert group.unscored_reason == "reward_failed: teacher: teacher_timeout"
    assert all(s.teacher_logprobs is None for s in group.samples)


def test_a_teacher_that_raises_leaves_the_group_unscored_by_that_reason():
    def boom():
        raise RuntimeError("CUDA out of memory")

    group = _score(make_group("g", n=2), _Stub(behaviour=boom))
    assert group.unscored_reason == "reward_failed: teacher: teacher_error"
    assert "CUDA out of memory" in group.unscored_detail


def test_tokens_outside_the_teachers_vocabulary_are_refused():
    group = _score(make_group("g", n=2), _Stub(vocab_size=4))  # prompt ids 5, 6, 7
    assert group.unscored_reason == "reward_failed: teacher: teacher_vocab"


def test_logprobs_that_do_not_fit_the_answer_leave_it_unscored():
    class Short(_Stub):
        async def score(self, group):
            return [TeacherLogprobs(np.zeros(1, np.float32)) for _ in group.samples]

    group = _score(make_group("g", n=2), Short())
    assert group.unscored_reason == "reward_failed: teacher: bad_teacher_logprobs"


def test_tokens_out_of_an_episodes_loss_carry_no_teacher_logprob():
    group = make_group("g", n=1)
    sample = group.samples[0]
    sample.logprobs[1] = 0.0
    sample.episode = Episode(id="g/0", loss_mask=np.array([1, 0, 1], dtype=np.uint8))
    _score(group, _Stub())
    assert sample.teacher_logprobs.tolist() == [-0.25, 0.0, -0.25]


def test_a_spec_of_kind_teacher_checks_its_options_when_read():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardSpec(kind="teacher", options={"path": "x", "timeout_s": 0})
    with pytest.raises(ValueError, match="path"):
        RewardSpec(kind="teacher", options={})


@pytest.mark.slow  # the first transformers model of a process: ~6 s of imports
def test_a_tiny_teacher_scores_answers_batched_as_one_by_one(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    path = build_tiny_model(shape, tmp_path / "teacher")
    teacher = build_reward(RewardSpec(kind="teacher", options={"path": str(path), "batch_size": 2}))
    group = make_group("g", n=3)
    group.samples[1].response_ids = np.array([9, 10], dtype=np.int32)  # lengths differ: padding matters
    group.samples[1].logprobs = np.zeros(2, dtype=np.float32)
    results = asyncio.run(teacher.score(group))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for sample, result in zip(group.samples, results):
        ids = torch.from_numpy(np.concatenate([group.prompt_ids, sample.response_ids]).astype(np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)  # (L-1, V)
        want = logp[torch.arange(len(ids[0]) - 1), ids[0, 1:]][len(group.prompt_ids) - 1 :]
        assert result.values.tolist() == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.slow  # a vLLM engine (~10 s to start on the CPU)
def test_the_vllm_teacher_gives_the_hf_teachers_logprobs(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    path = build_tiny_model(TinyModelConfig(num_layers=2), tmp_path / "t")  # head_dim 32: vLLM CPU attention
    group = make_group("g", n=3)
    group.samples[1].response_ids = np.array([9, 10], dtype=np.int32)
    group.samples[1].logprobs = np.zeros(2, dtype=np.float32)
    hf = build_reward(RewardSpec(kind="teacher", options={"path": str(path)}))
    engine = build_reward(RewardSpec(kind="teacher", options={"path": str(path), "engine": "vllm"}))
    try:
        want, got = asyncio.run(hf.score(group)), asyncio.run(engine.score(group))
    finally:
        asyncio.run(engine.close())
    for w, g in zip(want, got):
        assert g.values.tolist() == pytest.approx(w.values.tolist(), abs=1e-4)
