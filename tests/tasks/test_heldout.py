"""The controller's side of held-out evaluation: rounds, windows, timeouts, scores."""

import concurrent.futures
import time

import msgspec
import pytest

from asyncrl.tasks.answers import score_answer
from asyncrl.tasks.heldout import EvalConfig, EvalRound, HeldOutEvaluator
from asyncrl.tasks.prompts import Prompt
from asyncrl.wire import WireError, decode, encode, encode_map
from asyncrl.wire.messages import EvalResult

PROMPTS = [Prompt(str(i), f"{i}+1=", str(i + 1), "addition") for i in range(10)]


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class Sender:
    """Takes what it is offered while ``room`` lasts (a PUSH with generators connected)."""

    def __init__(self, room=100):
        self.room, self.sent = room, []

    def offer(self, body):
        if self.room <= 0:
            return False
        self.room -= 1
        # through the real codec: what a generator would receive
        self.sent.append(decode(encode(body))[1])
        return True


class ExactMatchScorer:
    """Scores at once, by each task's exact match (the scorer's interface, without its thread)."""

    def submit(self, prompts, answers):
        future = concurrent.futures.Future()
        future.set_result([[score_answer(p.task, t, p.answer) for t, _ in a] for p, a in zip(prompts, answers)])
        return future


def answer(request, right=True, version=3, generator="generator-0"):
    texts = [str(int(p[:-3]) + (1 if right else 2)) for p in request.prompts]
    body = {"round": request.round, "chunk": request.chunk, "generator": generator, "version": version}
    body.update(texts=texts, finish_reasons=["stop"] * len(texts), seconds=0.5, queued_s=0.1)
    return decode(encode_map("eval_result", body))[1]


def evaluator(clock, sender, **cfg):
    cfg = EvalConfig(**{"num_prompts": 10, "chunk_prompts": 4, "max_new_tokens": 4, **cfg})
    return HeldOutEvaluator(cfg, PROMPTS, sender, ExactMatchScorer(), clock=clock)


def test_a_round_is_scored_over_every_prompt_with_the_versions_that_answered():
    clock, sender = Clock(), Sender()
    ev = evaluator(clock, sender)
    assert ev.start("v4", 4)
    ev.poll(num_generators=2)
    assert [r.chunk for r in sender.sent] == [0, 1]  # one request per generator at a time
    assert ev.answer(answer(sender.sent[0], right=True, version=4)) is None
    ev.poll(num_generators=2)
    assert [r.chunk for r in sender.sent] == [0, 1, 2]  # the window moved on
    assert ev.answer(answer(sender.sent[1], right=False, version=5, generator="generator-1")) is None
    record = ev.answer(answer(sender.sent[2], right=True, version=5))
    # chunks of 4, 4 and 2 prompts: 4 + 2 right of 10
    assert record["exact_match"] == pytest.approx(0.6)
    assert record["version"] == 4 and record["versions"] == [4, 5]
    assert record["generators"] == {"generator-0": 6, "generator-1": 4}
    assert record["failed"] is None and ev.current is None


def test_late_or_repeated_answers_are_ignored():
    clock, sender = Clock(), Sender()
    ev = evaluator(clock, sender, chunk_prompts=10)
    ev.start("before", 0)
    ev.poll(1)
    first = answer(sender.sent[0], right=False)
    ev.answer(msgspec.structs.replace(first, round="v2"))  # a round that has ended
    record = ev.answer(first)
    assert record["exact_match"] == 0.0
    assert ev.answer(first) is None  # no round open any more


def test_a_request_past_its_timeout_is_offered_again_then_the_round_fails():
    clock, sender = Clock(), Sender()
    ev = evaluator(clock, sender, timeout_floor_s=10, timeout_factor=2, initial_s_per_token=1.0, max_retries=1)
    assert ev.timeout_s() == 10 + 2 * 4 * 1.0  # floor + factor x max_new_tokens x s/token
    ev.start("v2", 2)
    ev.poll(1)
    clock.now = 18.5
    ev.poll(1)
    assert [r.chunk for r in sender.sent] == [0, 0]  # offered again
    clock.now = 37.5
    record = ev.poll(1)
    assert record["exact_match"] is None and "request 0 unanswered 2 times" in record["failed"]
    assert ev.current is None


def test_the_timeout_grows_with_the_measured_speed():
    clock, sender = Clock(), Sender()
    ev = evaluator(clock, sender, chunk_prompts=10, timeout_floor_s=10, timeout_factor=2, initial_s_per_token=0.01)
    ev.start("v2", 2)
    ev.poll(1)
    clock.now = 40.0  # 40 s for 4 tokens: 10 s per token, far slower than assumed
    ev.answer(answer(sender.sent[0]))
    assert ev.s_per_token == 10.0
    assert ev.timeout_s() == 10 + 2 * 4 * 10.0


def test_one_round_at_a_time_and_no_offer_without_a_taker():
    clock, sender = Clock(), Sender(room=0)
    ev = evaluator(clock, sender)
    assert ev.start("v2", 2)
    assert not ev.start("v4", 4)  # skipped, said so
    ev.poll(2)
    assert sender.sent == [] and ev.current.todo == [0, 1, 2]  # kept for the next poll


def test_answers_must_match_their_request():
    round_ = EvalRound("v2", 2, PROMPTS, EvalConfig(chunk_prompts=4))
    assert (
        round_.answer(EvalResult(round="v2", chunk=0, version=2, generator="g", texts=["1"], seconds=0, queued_s=0))
        is None
    )
    assert 0 not in round_.answered
    with pytest.raises(ValueError, match=r"prompts \(0 given\)"):
        EvalRound("v2", 2, [], EvalConfig(chunk_prompts=4))


def test_the_wire_refuses_malformed_eval_messages():
    good = {"round": "v2", "chunk": 0, "version": 2, "prompts": ["1+1="], "max_new_tokens": 4, "sent_at": 1.0}
    assert decode(encode_map("eval_request", good))[1].prompts == ["1+1="]
    for bad in ({**good, "prompts": [1]}, {**good, "chunk": "0"}, {k: v for k, v in good.items() if k != "round"}):
        with pytest.raises(WireError, match="bad_fields"):
            decode(encode_map("eval_request", bad))


def test_with_an_environment_requests_carry_the_rows_and_answers_their_episodes_rewards():
    from asyncrl.rewards.config import RewardSpec
    from asyncrl.rewards.evaluation import EvalScorer

    prompts = [Prompt(f"p{i}", "guess 1-16:", str(i + 1), "guess_number") for i in range(3)]
    cfg = EvalConfig(chunk_prompts=3, samples_k=1, correct_at=0.05)
    scorer = EvalScorer({"guess_number": RewardSpec(kind="environment")})
    sent = []

    class Sender:
        def offer(self, request):
            sent.append(request)
            return True

    try:
        evaluator = HeldOutEvaluator(cfg, prompts, Sender(), scorer, episodes=True)
        evaluator.start("before", 0)
        evaluator.poll(1)
        (request,) = sent
        assert [r["answer"] for r in request.rows] == ["1", "2", "3"] and request.rows[0]["prompt_uid"] == "p0"
        body = dict(round="before", chunk=0, generator="g", version=0, seconds=0.1, queued_s=0.0)
        answers = dict(texts=["8"] * 3, finish_reasons=["stop", "length", "stop"])
        samples = dict(samples=[["4"]] * 3, sample_finish_reasons=[["stop"]] * 3)
        # the episodes' shapes must match: one environment reward a greedy and a sampled episode
        assert (
            evaluator.current.answer(
                EvalResult(**body, **answers, **samples, env_rewards=[[1.0]] * 3, env_errors=[[None]] * 3)
            )
            is None
        )
        assert 0 not in evaluator.current.answered
        played = dict(
            env_rewards=[[0.9, 0.0], [0.0, None], [0.0, 1.0]],
            env_errors=[[None, None], [None, "environment_timeout: slow"], [None, None]],
        )
        record = evaluator.answer(EvalResult(**body, **answers, **samples, **played))
        deadline = time.monotonic() + 30
        while record is None and time.monotonic() < deadline:
            time.sleep(0.01)
            record = evaluator.poll(1)
    finally:
        scorer.close()
    assert record["rewards"] == {"guess_number": "environment"}
    assert record["exact_match"] == pytest.approx(1 / 3)  # the greedy episodes: one found the number
    assert record["pass_at_k"] == pytest.approx(1 / 3)  # the sampled: one found it, one failed (unscored: wrong)


def test_a_round_of_episodes_reports_turns_tool_calls_and_environment_failures_beside_the_score():
    from asyncrl.tasks.eval_round import EvalRound

    prompts = [Prompt(f"p{i}", "guess 1-16:", str(i + 1), "guess_number") for i in range(2)]
    cfg = EvalConfig(chunk_prompts=2, samples_k=1, correct_at=0.05)
    body = dict(round="before", chunk=0, generator="g", version=0, seconds=0.1, queued_s=0.0)
    body |= dict(
        texts=["8", "3"], finish_reasons=["stop"] * 2, samples=[["4"]] * 2, sample_finish_reasons=[["stop"]] * 2
    )
    body |= dict(env_rewards=[[0.9, 0.0], [0.0, None]], env_errors=[[None, None], [None, "environment_failed: x"]])
    figures = dict(turns=[[2, 4], [3, 1]], tool_calls=[[1, 2], [0, 1]], tool_errors=[[0, 2], [0, 1]])

    def result(**fields):  # through the real codec, as the controller receives it
        return decode(encode(EvalResult(**{**body, **fields})))[1]

    r = EvalRound("before", 0, prompts, cfg, episodes=True)
    assert r.answer(result(**{**figures, "turns": [[2], [3]]})) is None and 0 not in r.answered  # one per episode
    r.answer(result(**figures))
    r.score(0, [[0.9, 0.0], [0.0, None]])
    record = r.record()
    assert record["exact_match"] == 0.5
    assert record["episode_turns"] == 2.5 and record["episode_tool_calls"] == 0.5 and record["episode_tool_errors"] == 0
    assert record["sampled_episode_turns"] == 2.5 and record["sampled_episode_tool_errors"] == 1.5
    assert record["env_failures"] == 1

    # a generator that predates the figures: the answer is taken, the failures counted, the means unknown
    older = EvalRound("v2", 2, prompts, cfg, episodes=True)
    old = result()
    assert old.turns == [] and older.answer(old) is None and 0 in older.answered
    older.score(0, [[0.9, 0.0], [0.0, None]])
    record = older.record()
    assert record["episode_turns"] is None and record["sampled_episode_tool_calls"] is None
    assert record["env_failures"] == 1

    # a failed round of episodes keeps the episode keys (every one None), a round of answers has none
    failed = EvalRound("v4", 4, prompts, cfg, episodes=True)
    failed.failed = "request 0 unanswered"
    assert failed.record()["episode_turns"] is None and "env_failures" in failed.record()
    assert "episode_turns" not in EvalRound("v4", 4, PROMPTS, cfg).record()
