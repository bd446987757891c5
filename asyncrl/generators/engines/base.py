"""What every engine and stream offers the rest of the generator: the interfaces to implement for a new one.

A generator samples through one of two interfaces, by ``generator.mode``:

- ``Engine`` (batch mode, evaluation, the weight probe): blocking calls on a whole batch of
  prompts, and ``load_weights`` between them. ``VLLMEngine`` (``vllm.LLM``),
  ``AsyncVLLMEngine`` (``AsyncLLM``, whose weights may change while requests run) and the
  simulated ``MockEngine`` (``simulation.generator``: timing without a model) implement it.
- ``Stream`` (continuous mode): groups submitted one by one and handed back when done, the engine
  kept full (``asyncrl.generators.schedulers.continuous``). ``VLLMStream`` (over
  ``AsyncVLLMEngine``) and ``MockStream`` (over ``MockEngine``) implement it. A group's samples
  come from a rollout (``asyncrl.generators.rollouts.base.Rollout``): ``submit`` takes the
  single-turn one's arguments, ``submit_rollout`` any rollout's (vLLM only).

Both hand back ``Completion``s (``asyncrl.generators.completion``): token ids exactly as sampled, their behaviour log-probabilities
and which policy version sampled which tokens. A new engine (another inference server, a remote
fleet) implements ``Engine`` and, for continuous generation, ``Stream``, and is picked in
``asyncrl.generators.schedulers`` (``build_engine`` / ``build_stream``); ``docs/how-to/extending.md``
lists the files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.generators.completion import Completion
    from asyncrl.generators.sampling import AnswerOptions, SamplingConfig


class Engine(Protocol):
    """Blocking sampling of a batch, weights swapped between calls."""

    version: int
    """The policy version of the weights loaded now."""

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: list[int] | None = None
    ) -> list[list[Completion]]:
        """``sampling.n`` completions of each prompt, the i-th prompt seeded by ``seed[i]``."""
        ...

    def greedy(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Each prompt's greedy answer (ReMax's baseline)."""
        ...

    def answer(self, prompts: list[str], options: list[AnswerOptions]) -> list[list[tuple[str, str]]]:
        """Held-out answers: per prompt, the (text, finish reason) of each answer ``options`` asks for."""
        ...

    def load_weights(self, weights: Any, version: int) -> float:
        """Load ``weights`` as ``version``; returns the seconds it took."""
        ...

    def close(self) -> None: ...


class Stream(Protocol):
    """Groups in and out of an engine kept full (continuous generation)."""

    engine: Any
    """The engine behind the stream (its ``version``, ``load_weights``)."""

    @property
    def running(self) -> int:
        """Sequences submitted and not yet handed back."""
        ...

    def submit(
        self, key: str, prompt: str, sampling: SamplingConfig, seed: int | None = None, greedy_tokens: int | None = None
    ) -> None:
        """Start the group ``key``: ``sampling.n`` answers of ``prompt`` (and its greedy answer of
        up to ``greedy_tokens``)."""
        ...

    def finished(self, timeout: float) -> list[tuple[str, list[Completion], str | None]]:
        """``(key, completions, greedy text or None)`` of each group done, waiting up to ``timeout`` s for the first."""
        ...

    def abort(self, keys) -> None:
        """Stop the groups of ``keys``; unknown or finished ones are ignored."""
        ...

    def capacity(self, expected_tokens: int | None = None) -> int | None:
        """Sequences of ``expected_tokens`` the engine holds at once; None: unknown."""
        ...

    def kv_pressure(self) -> int:
        """A running count of the engine's signals that it ran out of KV cache."""
        ...

    def until_next(self, limit: float) -> float:
        """Seconds worth waiting elsewhere before a group may be done (at most ``limit``)."""
        ...

    def close(self) -> None: ...
