"""The events every process sends the controller, one declared type per ``type`` tag (``EVENTS``
in ``asyncrl.wire.messages`` gathers them with the final reports of ``asyncrl.wire.finals``)."""

from __future__ import annotations

import msgspec

from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.message_base import Event


class ReadyEvent(Event, kw_only=True, tag="ready"):
    """The process is up and waits for ``go``; a generator says the version it serves."""

    version: int | None = None


class ErrorEvent(Event, kw_only=True, tag="error"):
    """The process failed with ``error`` and is exiting."""

    error: str


class CheckpointPartEvent(Event, kw_only=True, tag="checkpoint_part"):
    """The process wrote its ``part`` of the checkpoint of ``version``."""

    part: str
    version: int
    seconds: float | None = None


class RequeuedEvent(Event, kw_only=True, tag="requeued"):
    """The dispatcher answered the requeue command ``id``: ``groups`` of ``scope`` to dispatch again."""

    scope: str
    groups: int
    generator: str | None = None
    id: str | None = None


class StepEvent(Event, kw_only=True, tag="step"):
    """The learner's step that produced ``stats.version``, with everything it measured (one
    declared field per statistic: ``asyncrl.observability.step_stats.StepStats``)."""

    stats: StepStats

    @property
    def version(self) -> int:
        return self.stats.version

    def record(self, t: float) -> dict:
        """The step's line of ``steps.jsonl``: ``type``, ``source``, ``role`` (and ``loop``), the
        stats' ``record()`` (their names as keys) and ``t``, seconds since the run's go."""
        head = {"type": self.type, "source": self.source, "role": self.role}
        if self.loop is not None:
            head["loop"] = self.loop
        return {**head, **self.stats.record(), "t": t}


class SampleText(msgspec.Struct, kw_only=True):
    """One trained answer as a person reads it (``SamplesEvent``): its text cut to
    ``logging.samples_max_chars``, its reward and where it came from."""

    uid: str
    group_id: str
    prompt_uid: str
    task: str
    prompt: str
    answer: str
    """The reference answer the rule rewards compare with."""
    completion: str
    reward: float | None
    reward_parts: dict[str, float] = {}
    """Reward name -> the value it gave (before weights)."""
    finish_reason: str
    tokens: int
    """Response tokens (the text may be cut; the tokens are counted whole)."""
    policy_version: int
    """The version of the answer's oldest token (its group's, or its first segment's)."""
    version_segments: list[list[int]] | None = None
    staleness: int
    """The learner's version before the step that trained it, minus ``policy_version``."""
    generator: str
    turns: int = 1
    """Model turns of a multi-turn episode (1: a single answer; ``completion`` is the last turn)."""
    tool_calls: int = 0
    tool_errors: int = 0
    masked_tokens: int = 0
    """Of ``tokens``, the environment's and the tools' (out of the loss)."""
    env_error: str | None = None
    """Why the episode's environment failed (then it is unscored)."""
    transcript: str | None = None
    """A multi-turn episode's whole text: the model's turns, the environment's answers in ``⟦ ⟧``."""


class SamplesEvent(Event, kw_only=True, tag="samples"):
    """A share of the answers the learner step that produced ``version`` trained on, with their
    text, rewards and versions (``logging.samples_per_step`` groups, whole): the controller appends
    them to ``samples.jsonl`` and TensorBoard's text."""

    version: int
    samples: list[SampleText]


class DoneEvent(Event, kw_only=True, tag="done"):
    """The learner took its last step, reaching ``version``."""

    version: int


class BroadcastEvent(Event, kw_only=True, tag="broadcast"):
    """The learner published ``version`` over ``transport``, and what it cost."""

    version: int
    transport: str
    published_at: float
    """The learner's wall clock when it started publishing."""
    gather_s: float
    probe_s: float
    bytes: int
    buckets: int
    seconds: float
    extra_bytes: int | None = None
    """Peak bytes of buffers the transport held beside the weights (stream transport)."""


class ProbeStats(msgspec.Struct, kw_only=True):
    """One probe check of a weight update on a generator (``asyncrl.weights.probe.ProbeCheck``)."""

    mean_diff: float
    """mean_t |G_t − L_t| against the published version's logprobs."""
    max_diff: float
    """max_t |G_t − L_t|."""
    tol: float
    """The bound ``mean_diff`` was held to."""
    noise: float | None = None
    """The mismatch measured at identical weights (None: not calibrated yet)."""
    previous_diff: float | None = None
    """mean_t |G_t − L^prev_t| against the previous version's logprobs (None: not sent)."""
    separation: float | None = None
    """mean_t |L_t − L^prev_t|: how far apart the two versions are on the probe text."""
    tokens: int
    base_diff: float | None = None
    """With a LoRA adapter: mean_t |G_t − B_t| against the base model's logprobs (None: no adapter)."""
    base_separation: float | None = None
    """With a LoRA adapter: mean_t |L_t − B_t|, how far the adapter stands from the base model."""


class VersionEvent(Event, kw_only=True, tag="version"):
    """A generator now serves ``version``, and how long each stage of getting there took."""

    version: int
    apply_s: float
    load_s: float
    receive_s: float
    probe_s: float
    ready_at: float | None
    served_at: float
    """Wall clock, joined with the learner's ``published_at`` (``asyncrl.weights.timeline``)."""
    bytes: int
    probe_diff: float | None = None
    """The probe's mean |Δ| (``probe.mean_diff``)."""
    probe: ProbeStats | None = None
    """The probe check's statistics (None: no probe)."""


class HeartbeatEvent(Event, kw_only=True, tag="heartbeat"):
    """A process that joined by address is alive (every ``asyncrl.fleet.join.HEARTBEAT_S``): the
    controller, which did not start it and cannot see it die, takes its silence for a death."""
