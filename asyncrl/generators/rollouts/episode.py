"""One multi-turn episode's tokens as they grow, and the ``Completion`` it becomes.

The model's turns go in exactly as the engine sampled them (ids, behaviour log-probabilities,
the versions that sampled them, loss mask 1); what the environment answers goes in as rendered
ids with loss mask 0 and no log-probability (0). The finished episode is one ``Completion`` whose
``response_ids`` are everything after the prompt, in order: the learner's input is the prompt
then this concatenation, token for token.
"""

from __future__ import annotations

import numpy as np

from asyncrl.generators.completion import Completion


class EpisodeBuilder:
    """The growing episode after ``prompt_ids`` (see the module docstring).

    >>> ep = EpisodeBuilder([1, 2])
    >>> turn = Completion(np.array([1, 2]), np.array([5, 6]), np.array([-0.1, -0.2]), "ab", "stop", [[0, 3]])
    >>> ep.add_turn(turn); ep.add_observation([7, 8, 9])
    >>> ep.context(), ep.mask, ep.segments
    ([1, 2, 5, 6, 7, 8, 9], [1, 1, 0, 0, 0], [[0, 3]])
    """

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.segments: list[list[int]] = []
        """``[[first_token_index, version], ...]`` over the whole episode: each turn's own segments,
        moved to where the turn starts; an observation belongs to the segment before it."""
        self.turns = self.tool_calls = self.tool_errors = 0
        self.env_reward = 0.0
        self.step_rewards: list[list] = []
        """``[[token_index, reward], ...]``: where each rewarding step's turn ended."""
        self.env_error: str | None = None
        self.last_text = ""
        self.resumed = 0

    def __len__(self) -> int:
        return len(self.ids)

    def context(self) -> list[int]:
        """The ids the next model turn is sampled after: the prompt and everything so far."""
        return self.prompt_ids + self.ids

    def add_turn(self, turn: Completion) -> None:
        start = len(self.ids)
        for index, version in turn.version_segments or []:
            if not self.segments or version > self.segments[-1][1]:
                self.segments.append([start + index, version])
        self.ids += [int(t) for t in turn.response_ids]
        self.logprobs += [float(x) for x in turn.logprobs]
        self.mask += [1] * len(turn.response_ids)
        self.turns += 1
        self.last_text = turn.text
        self.resumed += turn.resumed

    def add_step_reward(self, reward: float) -> None:
        """The environment's step reward for the turn just added: on its last token."""
        self.env_reward += reward
        if reward and self.ids:
            self.step_rewards.append([len(self.ids) - 1, reward])

    def add_observation(self, ids: list[int]) -> None:
        self.ids += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def completion(self, finish_reason: str) -> Completion:
        """The episode as one sample; ``text`` is its last model turn (what the run's answer
        rewards read), the tokens hold every turn."""
        segments = self.segments or None
        if segments is not None and len(self.ids) and segments[0][0] != 0:
            segments[0][0] = 0  # an episode whose first turn was empty: its first version covers from the start
        return Completion(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            text=self.last_text,
            finish_reason=finish_reason,
            version_segments=segments if len(self.ids) else None,
            resumed=self.resumed,
            loss_mask=np.asarray(self.mask, dtype=np.uint8),
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            env_reward=None if self.env_error is not None else self.env_reward,
            env_error=self.env_error,
            step_rewards=self.step_rewards or None if self.env_error is None else None,
        )
