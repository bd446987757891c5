"""A share of each step's trained answers, as text, for a person to read (``samples`` events).

``logging.samples_per_step`` groups of the batch, picked at random (seeded by the run's seed and
the version, so a resumed run picks the same), go to the controller whole: every answer of a
picked group, with its prompt, reward and reward parts, the version of its oldest token and its
staleness (the learner's version before this step minus that version, as the step's
``staleness_mean`` counts it). Texts are cut to ``logging.samples_max_chars``; the controller
writes them to ``samples.jsonl`` and TensorBoard (``asyncrl.observability.samples``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.observability.samples import cut
from asyncrl.wire.messages import SamplesEvent, SampleText
from asyncrl.wire.schema import Group, policy_tokens

if TYPE_CHECKING:
    from asyncrl.learner.context import LearnerContext


def pick_groups(groups: list[Group], k: int, seed: int, version: int) -> list[Group]:
    """``k`` of ``groups`` (all when fewer), picked at random by ``(seed, version)``, in batch order."""
    if k <= 0 or not groups:
        return []
    if k >= len(groups):
        return list(groups)
    rng = np.random.default_rng([seed, version])
    return [groups[i] for i in sorted(rng.choice(len(groups), size=k, replace=False))]


def episode_transcript(ids: np.ndarray, mask: np.ndarray, decode: Callable[[list[int]], str]) -> str:
    """A multi-turn episode as text: the model's turns as they are, what the environment answered
    between them in ``⟦ ⟧``.

    >>> episode_transcript(np.array([1, 2, 3, 4]), np.array([1, 0, 0, 1]), lambda ids: "".join(map(str, ids)))
    '1⟦23⟧4'
    """
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            text = decode([int(t) for t in ids[start:end]])
            out.append(text if mask[start] else f"⟦{text}⟧")
            start = end
    return "".join(out)


def sample_texts(
    groups: list[Group], version: int, max_chars: int, decode: Callable[[list[int]], str] | None = None
) -> list[SampleText]:
    """Each answer of ``groups``, trained by the step that produced ``version``, as a
    ``SampleText``; with ``decode`` (the learner's tokenizer), each episode's whole transcript."""
    out = []
    for g in groups:
        for s in g.samples:
            oldest = s.version_segments[0][1] if s.version_segments else g.policy_version
            out.append(
                SampleText(
                    uid=s.uid,
                    group_id=g.group_id,
                    prompt_uid=g.prompt_uid,
                    task=g.task,
                    prompt=cut(g.prompt, max_chars),
                    answer=cut(g.answer, max_chars),
                    completion=cut(s.text, max_chars),
                    reward=None if s.reward is None else float(s.reward),
                    reward_parts={k: float(v) for k, v in s.reward_parts.items()},
                    finish_reason=s.finish_reason,
                    tokens=len(s.response_ids),
                    policy_version=int(oldest),
                    version_segments=s.version_segments,
                    staleness=int(version - 1 - oldest),
                    generator=g.generator,
                    turns=1 if s.episode is None else s.episode.turns,
                    tool_calls=0 if s.episode is None else s.episode.tool_calls,
                    tool_errors=0 if s.episode is None else s.episode.tool_errors,
                    masked_tokens=len(s.response_ids) - policy_tokens(s),
                    env_error=None if s.episode is None else s.episode.env_error,
                    transcript=None
                    if s.episode is None or decode is None
                    else cut(episode_transcript(s.response_ids, s.episode.loss_mask, decode), max_chars),
                )
            )
    return out


def report_samples(
    ctx: LearnerContext, version: int, groups: list[Group], decode: Callable[[list[int]], str] | None = None
) -> None:
    """The ``samples`` event of the step that produced ``version`` (none when ``samples_per_step`` is 0)."""
    cfg = ctx.cfg
    picked = pick_groups(groups, cfg.logging.samples_per_step, cfg.run.seed, version)
    if picked:
        ctx.emit(
            SamplesEvent(version=version, samples=sample_texts(picked, version, cfg.logging.samples_max_chars, decode))
        )
