"""The step event carries a batch's multi-turn figures, counted per episode (a multi-part episode
once, by its id), and nothing new for a batch of single-turn answers."""

import numpy as np
import pytest

from asyncrl.learner.batch_requests import Batch
from asyncrl.learner.step_report import episode_figures, report_step
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.messages import StepEvent
from asyncrl.wire.schema import Episode, Group, Sample
from tests.factories import RecordingContext, make_group

EPISODE_FIELDS = [name for name in StepStats.__struct_fields__ if name.startswith("episode")]  # episodes too


def part(uid: str, episode_id: str, mask, turns: int, calls: int = 0, errors: int = 0, env_error=None) -> Sample:
    mask = np.asarray(mask, dtype=np.uint8)
    ids = np.arange(len(mask), dtype=np.int32)
    logprobs = np.where(mask == 1, -0.5, 0.0).astype(np.float32)
    episode = Episode(episode_id, mask, turns=turns, tool_calls=calls, tool_errors=errors, env_error=env_error)
    return Sample(uid, ids, logprobs, "", "stop", reward=0.5, episode=episode)


def episodes_group() -> Group:
    samples = [
        # one episode in two parts (its context was edited): 3 + 1 turns, 2 + 1 calls, 10 + 4 tokens
        part("e/0", "e/0", [1, 1, 0, 0, 0, 1, 1, 0, 0, 1], turns=3, calls=2, errors=1),
        part("e/0.1", "e/0", [1, 0, 0, 1], turns=1, calls=1),
        # one the environment failed: 1 turn, 6 tokens, none of them the environment's
        part("e/1", "e/1", [1] * 6, turns=1, env_error="environment_timeout: step 1"),
    ]
    return Group("e", "guess/0", "guess", "", "", np.array([1, 2], np.int32), 0, "gen", samples)


def stats() -> StepStats:
    return StepStats(version=1, loss=0.1, tokens=10, staleness_mean=0.0, staleness_max=0)


def test_episode_figures_are_per_episode_over_its_parts_and_the_share_is_of_every_response_token():
    single = make_group("s", n=2, length=5)  # two single-turn answers: 10 response tokens
    figures = episode_figures([episodes_group(), single])
    assert figures == pytest.approx(
        {
            "episodes": 2,
            "episode_turns": (4 + 1) / 2,
            "episode_tool_calls": (3 + 0) / 2,
            "episode_tool_errors": (1 + 0) / 2,
            "episode_tokens": (14 + 6) / 2,
            "episode_masked_tokens": (7 + 0) / 2,  # 5 in the first part, 2 in the second
            "episode_masked_frac": 7 / (14 + 6 + 10),
            "episode_env_failed": 1 / 2,
        }
    )
    assert set(figures) <= set(StepStats.__struct_fields__)
    assert sorted(figures) == sorted(EPISODE_FIELDS)  # every episode field is set


def test_a_batch_of_single_turn_answers_reports_no_episode_figure():
    ctx = RecordingContext()
    report_step(ctx, Batch([make_group("a"), make_group("b")], None, None, 0.2), stats())
    (event,) = ctx.events
    assert isinstance(event, StepEvent) and event.stats.samples == 8
    assert all(getattr(event.stats, name) is None for name in EPISODE_FIELDS)
    record, curves = event.stats.record(), event.stats.scalars()
    assert not any(key.startswith("episode") for key in record)
    assert not any(key.startswith("train/episode") for key in curves)


def test_the_step_event_of_a_batch_of_episodes_carries_their_figures_to_every_reader():
    ctx = RecordingContext()
    report_step(ctx, Batch([episodes_group()], None, None, 0.2), stats())
    (event,) = ctx.events
    assert event.stats.episodes == 2 and event.stats.episode_turns == 2.5
    assert event.stats.episode_masked_frac == pytest.approx(7 / 20)
    assert event.stats.record()["episode_env_failed"] == 0.5  # steps.jsonl, the jsonl console
    assert event.stats.scalars()["train/episode_tool_calls"] == 1.5  # TensorBoard, W&B
