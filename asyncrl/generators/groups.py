"""Dispatched prompt rows and the engine's completions -> the groups a generator sends, and the rows
the engine would refuse."""

from __future__ import annotations

import numpy as np

from asyncrl.wire.messages import PromptRow
from asyncrl.wire.schema import Episode, Group, Sample


def build_groups(
    rows: list[PromptRow], completions, version: int, generator: str, rollout_s: float, sampled_at: float = 0.0
) -> list[Group]:
    """One ``Group`` per dispatched prompt row, from the engine's n completions of it (more when
    an episode is split: its later parts follow, each with its own context).

    ``version`` stamps completions the engine did not label; labelled ones (``version_segments``,
    swapped in flight) stamp the group with the version of its oldest token, and a sample keeps
    its segments unless that one version sampled all of it."""
    groups = []
    for row, comps in zip(rows, completions):
        segments = [c.version_segments or [[0, version]] for c in comps]
        oldest = min(seg[0][1] for seg in segments)
        samples = []
        for i, (c, seg) in enumerate(zip(comps, segments)):
            episode_id = f"{row['group_id']}/{i if c.episode_index is None else c.episode_index}"
            samples.append(
                Sample(
                    uid=episode_id if c.part == 0 else f"{episode_id}.{c.part}",
                    response_ids=c.response_ids.astype(np.int32),
                    logprobs=c.logprobs.astype(np.float32),
                    text=c.text,
                    finish_reason=c.finish_reason,
                    version_segments=None if seg == [[0, oldest]] else seg,
                    **episode_fields(c, episode_id, comps[0].prompt_ids),
                )
            )
        groups.append(
            Group(
                group_id=row["group_id"],
                prompt_uid=row["prompt_uid"],
                task=row["task"],
                prompt=row["text"],
                answer=row["answer"],
                prompt_ids=comps[0].prompt_ids.astype(np.int32),
                policy_version=oldest,
                generator=generator,
                samples=samples,
                rollout_s=rollout_s,
                sampled_at=sampled_at,  # wall clock, for end-to-end latency
                columns=row.get("columns"),
            )
        )
    return groups


def episode_fields(c, episode_id: str, group_prompt: np.ndarray) -> dict:
    """A multi-turn episode's ``Sample.episode`` (none for a single answer)."""
    if c.loss_mask is None:
        return {}
    return dict(
        episode=Episode(
            id=episode_id,
            loss_mask=c.loss_mask.astype(np.uint8),
            turns=c.turns,
            tool_calls=c.tool_calls,
            tool_errors=c.tool_errors,
            env_reward=c.env_reward,
            env_error=None if c.env_error is None else c.env_error[:200],
            step_rewards=c.step_rewards,
            part=c.part,
            # a later part's context, or an opening of the environment's that differs from the
            # group's first episode's: the sample's own prompt
            prompt_ids=None if np.array_equal(c.prompt_ids, group_prompt) else c.prompt_ids.astype(np.int32),
        )
    )


def refuse_too_long(tokenizer, rows: list[PromptRow], max_model_len: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(rows the engine takes, rows it would refuse): a prompt of ``max_model_len`` tokens or more
    leaves no room to sample, and vLLM refuses it by failing the whole batch. ``tokenizer`` is the
    engine's own (None, as for the simulated engine: every row is taken)."""
    if tokenizer is None:
        return rows, []
    taken, refused = [], []
    for row in rows:
        (taken if len(tokenizer.encode(row["text"])) < max_model_len else refused).append(row)
    return taken, refused
