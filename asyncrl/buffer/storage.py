"""Group storage: whole groups keyed by ``group_id``, in arrival order, bounded in samples.

A group (the n samples of one prompt) is inserted, sampled and removed as one item, because a
group statistic (GRPO's mean and std of rewards) is meaningless for a partial group.
"""

from __future__ import annotations

from collections import OrderedDict

from asyncrl.wire import Group


class GroupStorage:
    """Insertion-ordered groups with a capacity in samples.

    >>> s = GroupStorage(capacity_samples=16)
    >>> s.has_room_for(8)
    True
    """

    def __init__(self, capacity_samples: int):
        if capacity_samples < 1:
            raise ValueError(f"capacity_samples ({capacity_samples}) must be >= 1")
        self.capacity_samples = capacity_samples
        self._groups: OrderedDict[str, Group] = OrderedDict()
        self.num_samples = 0

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def has_room_for(self, num_samples: int) -> bool:
        return self.num_samples + num_samples <= self.capacity_samples

    def insert(self, group: Group) -> None:
        if group.group_id in self._groups:
            raise KeyError(f"group {group.group_id!r} is already stored")
        self._groups[group.group_id] = group
        self.num_samples += len(group.samples)

    def remove(self, group_id: str) -> Group:
        group = self._groups.pop(group_id)
        self.num_samples -= len(group.samples)
        return group

    def ids(self) -> list[str]:
        """Group ids, oldest arrival first."""
        return list(self._groups)

    def get(self, group_id: str) -> Group:
        return self._groups[group_id]

    def groups(self) -> list[Group]:
        return list(self._groups.values())
