"""The rollout interface: one prompt row in, the group's samples out, on the engine's event loop.

A rollout is what a group's samples are: how many sequences it runs and how each is made. Every
scheduler hands a rollout the dispatched row and the prompt's token ids, awaits its
``Completion``s and turns them into one ``Group`` (``asyncrl.generators.groups``):

- ``SingleTurn`` (``single_turn.py``): n answers of the prompt, one request of n samples.
- ``EpisodeGroups`` (``episode_group.py``): n multi-turn episodes, each with its own
  environment instance (``environment.cls``), turn by turn.
- ``AgentGroups`` (``asyncrl.generators.gateway``): n episodes, each played by an agent program
  against the OpenAI-compatible gateway (``agent.command``).

A rollout samples with the stream's async engine (``engine.sample_request`` / ``engine.request``)
and returns one ``Completion`` per sample, episodes in order; an episode split into parts
(``Completion.part``) gives several, its parts in order. ``asyncrl.generators.schedulers.continuous.build_rollout`` picks the config's;
``docs/how-to/extending.md`` says what a new one touches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.generators.completion import Completion
    from asyncrl.generators.sampling import SamplingConfig


class Rollout(Protocol):
    sampling: SamplingConfig
    """The run's sampling settings; ``sampling.n`` sequences per group."""

    async def sample(self, key: str, row: dict[str, Any], prompt_ids: list[int], seed: int) -> list[Completion]:
        """The group ``key``'s samples of ``row`` (its prompt: ``prompt_ids``), seeded by ``seed``."""
        ...
