"""A group's episodes on the async engine's contract: a turn aborted as too stale
(``generator.partial_rollouts: resume``) goes on under the newer weights, its tokens kept, and the
interruption is counted on the episode."""

import asyncio
import dataclasses

import numpy as np

from asyncrl.generators.completion import Completion
from asyncrl.generators.config import EnvironmentConfig
from asyncrl.generators.rollouts.episode_group import EpisodeGroups
from asyncrl.generators.sampling import SamplingConfig

EOS = 1


class Tokenizer:
    eos_token_id = EOS
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class AbortingEngine:
    """Answers "7" + EOS; the first turn is aborted after its first token (as ``abort_requests``
    does to a request too stale), and resumed by ``resume_request`` under version 1."""

    tokenizer = Tokenizer()

    def __init__(self):
        self.calls = []

    async def sample_request(self, prompt_ids, params, request_id, oldest=None):
        self.calls.append(("sample", request_id))
        ids = [ord("7")] if not self.calls[:-1] else [ord("7"), EOS]
        finish = "abort" if len(self.calls) == 1 else "stop"
        return Completion(np.array(prompt_ids), np.array(ids), np.full(len(ids), -0.1), "7", finish, [[0, 0]])

    async def resume_request(self, partial, params, request_id):
        self.calls.append(("resume", request_id))
        ids = np.append(partial.response_ids, EOS)
        return dataclasses.replace(
            partial, response_ids=ids, logprobs=np.full(2, -0.1), finish_reason="stop",
            version_segments=[[0, 0], [1, 1]], resumed=partial.resumed + 1,
        )  # fmt: skip


def test_a_turn_aborted_as_too_stale_is_resumed_and_counted():
    engine = AbortingEngine()
    env = EnvironmentConfig(cls="asyncrl.tasks.environments.guess_number:GuessNumber", plain_template="{content}\n")
    groups = EpisodeGroups(engine, env, SamplingConfig(n=1, max_tokens=4), max_model_len=64)
    row = {"text": "guess 1-16:", "answer": "7", "columns": {"low": 1, "high": 16}}
    (episode,) = asyncio.run(groups.sample("g", row, [ord(c) for c in row["text"]], seed=3))
    assert [kind for kind, _ in engine.calls] == ["sample", "resume"]
    assert episode.resumed == 1 and episode.env_reward == 1.0 and episode.turns == 1
    assert episode.response_ids.tolist() == [ord("7"), EOS] and episode.version_segments == [[0, 0], [1, 1]]
