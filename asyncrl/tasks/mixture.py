"""Several prompt sources in one run, mixed by weight, each a task of its own.

``task.sources`` lists them. Each source is a task: its ``name`` is what its prompts carry (so the
reward worker scores them with the rewards of ``reward.by_task[name]``, and the held-out evaluation
reports each apart), its ``data`` is read like ``task.data`` (or, for ``addition`` and ``gsm8k``
without data, the built-in prompts), and its ``weight`` is its share of the training prompts.

How the dispatcher draws by weight without losing exactly-once or resume is
``asyncrl.dispatcher.cursor.MixedCursor``: a deterministic weighted round robin over the sources,
each passed over in its own seeded order, so its state is the position in each source.

The held-out prompts of a mix are the sources' test splits interleaved (one of each in turn), so
the first ``eval.num_prompts`` of them hold every source.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from asyncrl.configbase import Config
from asyncrl.tasks.sources import DataConfig

PRESETS = ("addition", "gsm8k")
"""Tasks with prompts and a scoring rule of their own: they need no ``data``."""
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_task_name(value: str) -> str:
    """A task's name goes into prompt ids, metric labels and file names: letters, digits, ``_.-``."""
    if not NAME_RE.match(value):
        raise ValueError(
            f"task name ({value!r}) must be letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return value


class SourceConfig(Config):
    """One source of a mix: a task of its own, with its share of the training prompts."""

    name: str
    """The task its prompts belong to: 'addition' or 'gsm8k' (built in), or any name with ``data``;
    ``reward.by_task`` routes by it and the held-out evaluation reports by it."""
    weight: float = Field(1.0, gt=0)
    """Share of the training prompts: weight / the sum of the sources' weights."""
    data: DataConfig = DataConfig()
    """Where its prompts come from (required unless ``name`` is built in), keys and templates, as ``task.data``."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything its rewards should know (a python reward receives it as ``metadata``)."""

    @field_validator("name")
    @classmethod
    def check_name(cls, value: str) -> str:
        return check_task_name(value)


def interleave(parts: list[list]) -> list:
    """One of each part in turn until all are used up.

    >>> interleave([[1, 2, 3], ["a"], [10, 20]])
    [1, 'a', 10, 2, 20, 3]
    """
    out, longest = [], max((len(p) for p in parts), default=0)
    for i in range(longest):
        out.extend(part[i] for part in parts if i < len(part))
    return out
