"""Rule rewards: exact match of the answer against the dataset's reference.

``score_group`` fills ``sample.reward`` for every sample of a group, or marks the group
unscored with the reason (an exception in a scorer is never turned into a reward of 0).
"""

from __future__ import annotations

import time

from asyncrl.tasks import score_answer
from asyncrl.wire import Group


def exact_match_reward(task: str, response: str, answer: str) -> float:
    """1.0 if the response's answer equals the reference, else 0.0 (see ``tasks.score_answer``)."""
    return score_answer(task, response, answer)


def score_group(group: Group) -> Group:
    """Score every sample in place; on failure set ``meta['unscored_reason']`` and leave rewards None."""
    start = time.perf_counter()
    try:
        rewards = [exact_match_reward(group.task, s.text, group.answer) for s in group.samples]
    except Exception as e:  # a scorer bug must not kill the worker: the group is dropped by reason
        group.meta["unscored_reason"] = f"reward_failed: {type(e).__name__}"
        group.meta["unscored_detail"] = str(e)[:200]
    else:
        for sample, reward in zip(group.samples, rewards):
            sample.reward = reward
        group.meta["rewards"] = "exact_match"
    group.reward_s = time.perf_counter() - start
    return group
