"""A sampled sequence as every part of the generator passes it on: ids as sampled, behaviour logprobs, versions.

Engines return ``Completion``s (``asyncrl.generators.engines``), rollouts compose them into
episodes (``asyncrl.generators.rollouts``), and ``asyncrl.generators.groups`` turns them into the
wire's ``Sample``s. It sits below all of them, so none imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Completion:
    """One sampled answer, with what the learner needs to recompute its logprobs."""

    prompt_ids: np.ndarray
    """(P,) int32 prompt token ids exactly as the engine saw them."""
    response_ids: np.ndarray
    """(T,) int32 sampled token ids, EOS included when the answer ended by EOS."""
    logprobs: np.ndarray
    """(T,) float32 behaviour logprobs of ``response_ids`` (see the module docstring)."""
    text: str
    """The decoded answer, special tokens (EOS) left out."""
    finish_reason: str
    """``stop`` (ended by EOS) or ``length`` (hit max_tokens or max_model_len)."""
    version_segments: list[list[int]] | None = None
    """``[[first_token_index, policy_version], ...]``: which version sampled which tokens, when the
    engine labels versions (``AsyncVLLMEngine``: more than one when the answer spans an update)."""
    resumed: int = 0
    """Times this answer was aborted and continued from its tokens so far under newer weights
    (``asyncrl.generators.resume``); 0 for an answer sampled in one request."""
    loss_mask: np.ndarray | None = None
    """(T,) uint8 for a multi-turn episode: 1 on the model's tokens, 0 on what the environment
    answered (``asyncrl.generators.rollouts.episode``); None for a single answer."""
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None
    """The environment's reward for the episode (None: no environment, or it failed)."""
    env_error: str | None = None
    """Why the environment failed the episode (it raised or timed out): the episode is unscored."""
    step_rewards: list[list] | None = None
    """``[[token_index, reward], ...]``: the environment's step rewards, on the last token of the
    turn each step answered (``Episode.step_rewards``)."""
    episode_index: int | None = None
    """Which of the group's episodes this sample belongs to; None: its place among the completions."""
    part: int = 0
    """0, or k for the k-th later sample of an episode whose context stopped extending the one
    before (``Episode.part``); such a part's ``prompt_ids`` are its own context."""
