"""Small builders of wire records for tests."""

from __future__ import annotations

import numpy as np

from asyncrl.wire import Group, Sample


def make_group(group_id: str = "g0", n: int = 4, version: int = 0, rewards=None, length: int = 3) -> Group:
    rewards = rewards if rewards is not None else [None] * n
    samples = [
        Sample(
            uid=f"{group_id}/{i}",
            response_ids=np.arange(length, dtype=np.int32) + i,
            logprobs=np.full(length, -0.5, dtype=np.float32),
            text=str(i),
            finish_reason="stop",
            reward=rewards[i],
        )
        for i in range(n)
    ]
    return Group(
        group_id=group_id,
        prompt_uid=f"addition/{group_id}",
        task="addition",
        prompt="01+02=",
        answer="3",
        prompt_ids=np.array([5, 6, 7], dtype=np.int32),
        policy_version=version,
        generator="test",
        samples=samples,
    )
