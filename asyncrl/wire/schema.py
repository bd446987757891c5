"""The data plane's records (a ``Group`` of ``Sample``s), their validation, and arrays on the wire.

The messages that carry them are declared in ``asyncrl.wire.messages`` and encoded by
``asyncrl.wire.codec``. A generator or reward worker written in another language joins the stream
by producing and consuming these maps:

- Every message is a msgpack map with ``schema`` (int, must equal ``SCHEMA_VERSION``) and
  ``kind`` (str, one of ``messages.KINDS``); the other keys are the fields of its type.
- A numpy array travels as a map ``{"__nd__": True, "dtype": "<f4", "shape": [T], "data": bytes}``
  (raw little-endian bytes, not lists: ~5 µs per 1k-token trajectory each way instead of ~60 µs).
- A ``group`` holds the n samples of one prompt; it is the unit that is scored, buffered, sampled
  and dropped. Each sample carries its ``uid``, the ``policy_version`` that sampled it, and its
  behaviour ``logprobs`` (log-probabilities under the sampler actually used, temperature applied).
- Once scored, a sample carries its combined ``reward`` (or None: unscored, and then the group's
  ``unscored_reason`` says why), optionally ``token_rewards`` (a (T,) float32 array of
  per-token rewards), and ``reward_parts`` / ``reward_seconds``: per reward name, its value and the
  seconds it took. These three keys are optional on the wire (older senders omit them), as is a
  group's ``columns`` (the dataset row the prompt came from, for rewards that read its fields).
  A teacher (the ``teacher`` reward) adds ``teacher_logprobs``, (T,) float32, optional likewise.
- A group declares what every part of the system reads of it: ``sampled_at`` (when its sampling
  began), ``greedy_text`` / ``greedy_reward`` (ReMax's baseline answer and its reward) and
  ``unscored_reason`` / ``unscored_detail`` (why its rewards failed); ``meta`` keeps free-form notes
  only (the names of the rewards that scored it, its requeues).

- A sample may be a multi-turn episode (schema 3): ``response_ids`` then hold every token after
  the prompt, the model's turns and what the environment and tools answered between them, and
  its ``episode`` map says so: its ``loss_mask`` (a (T,) uint8 array) marks the model's own
  tokens with 1 (the others carry no behaviour log-probability: 0), and ``id``, ``turns``,
  ``tool_calls``, ``tool_errors``, ``env_reward`` and ``env_error`` describe the episode.
  ``episode`` is optional on the wire (nil or absent for a single-turn answer).

Schema 2 declared the group fields above; schema 1 carried them in ``meta``. A frame of an older
schema is refused on the sockets like any other schema (``bad_schema``, with a message that says
what changed: every process of a run runs one version), and migrated where it was stored: a
buffer snapshot written under schema 1 or 2 is upgraded as it is restored
(``asyncrl.wire.codec.upgrade``), so a checkpoint taken before the change still resumes.

Decoding validates (``codec.decode``): a frame that is not msgpack, has another schema, an unknown
kind, wrongly typed or shaped fields, or non-finite logprobs raises ``WireError`` with the reason,
which every receiver counts and logs once instead of dying.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 3
"""The wire protocol's version: every message carries it as ``schema``, and a receiver rejects any
other (2: a group's ``sampled_at``, ``greedy_text``, ``greedy_reward``, ``unscored_reason`` and
``unscored_detail`` are declared fields, no longer in its ``meta``; 3: a sample may be a
multi-turn episode, its ``episode`` holding the mask of the policy's own tokens)."""
SCHEMA_CHANGES = {
    1: "schema 1 carried a group's sampled_at, greedy_text, greedy_reward, unscored_reason and "
    "unscored_detail in its meta; schema 2 declares them: run one asyncrl version in every process",
    2: "schema 2 knew single-turn answers only; schema 3 carries multi-turn episodes (a sample's "
    "episode: its loss mask, turns, tool calls and errors, the environment's reward): run one asyncrl version in every process",
}
"""Why each older schema is refused: said in the ``bad_schema`` rejection."""
MOVED_FROM_META = ("sampled_at", "greedy_text", "greedy_reward", "unscored_reason", "unscored_detail")
"""The group fields schema 1 carried in ``meta``."""
_ND = "__nd__"


class WireError(ValueError):
    """A frame that must be rejected; ``reason`` is a short label for metrics (``bad_schema``...)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# records


@dataclass
class Episode:
    """A multi-turn episode's own fields, on its sample (``Sample.episode``). One field of the
    sample, not seven: a single-turn answer pays one key on the wire for them, not seven."""

    id: str
    """The episode (``{group_id}/{index}``). An episode whose every prompt extended the last one
    token for token is one sample; one whose context was edited is several, linked by this id."""
    loss_mask: np.ndarray
    """(T,) uint8 over the sample's ``response_ids``: 1 where the policy sampled the token, 0 where
    it is context the episode put there (an environment's observation, a tool's result, the chat
    template's turn markup): those tokens are never trained on and carry no behaviour
    log-probability (0 in ``logprobs``)."""
    turns: int = 1
    """Model turns in this sample."""
    tool_calls: int = 0
    """Tool calls the model made in them."""
    tool_errors: int = 0
    """Of those, the calls that ended in an error observation (a bad call, a tool that failed,
    hung or returned garbage)."""
    env_reward: float | None = None
    """The reward the environment gave the episode (the sum of its steps'), read by the
    ``environment`` reward kind; None: the environment failed."""
    env_error: str | None = None
    """Why the environment failed the episode (it raised, or a step timed out; at most 200
    characters): the ``environment`` reward leaves it unscored with this reason, never a 0."""
    step_rewards: list[list] | None = None
    """``[[token_index, reward], ...]``: the environment's step rewards where they were earned,
    on the last token of the model turn each step answered (their sum is ``env_reward``); the
    ``environment`` reward hands them on as per-token rewards. None: no step earned one alone."""
    part: int = 0
    """This sample's place in its episode: 0, or k for the k-th time the episode went on from a
    context that did not extend the one before token for token (an agent that edited or
    summarised its history): a new sample then starts, linked to the others by ``id``. The
    episode's outcome is its last part's; every part is trained with its episode's advantage
    (``asyncrl.learner.group_advantages``)."""
    prompt_ids: np.ndarray | None = None
    """(P,) int32: this sample's own context, in place of the group's ``prompt_ids`` (the
    learner's input is this, then ``response_ids``): a later part's, or an episode whose
    environment opened it with other messages than the group's first episode's. None: the
    group's prompt."""


@dataclass
class Sample:
    """One answer to one prompt, as sampled by a generator."""

    uid: str
    """Globally unique sample id: ``{group_id}/{index}``."""
    response_ids: np.ndarray
    """(T,) int32 token ids of the answer, EOS included when the answer ended by EOS."""
    logprobs: np.ndarray
    """(T,) float32 behaviour log-probabilities of ``response_ids`` under the sampler."""
    text: str
    """The decoded answer."""
    finish_reason: str
    """``stop`` (EOS or stop string) or ``length``."""
    reward: float | None = None
    """Scalar reward once scored; None while unscored."""
    token_rewards: np.ndarray | None = None
    """(T,) float32 per-token rewards, when a reward scores tokens; their sum is part of ``reward``."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    """Reward name -> the value it gave this sample (before weights); names of rewards that scored it."""
    reward_seconds: dict[str, float] = field(default_factory=dict)
    """Reward name -> seconds the reward took for this sample (or for its whole group call)."""
    version_segments: list[list[int]] | None = None
    """``[[first_token_index, policy_version], ...]`` when this answer was not sampled by the group's
    ``policy_version`` alone (a weight update swapped in while it was being sampled): tokens from
    each index on, up to the next, were sampled by that version. Starts at index 0, indices and
    versions strictly increasing, first version >= the group's. None: every token by the group's
    version. Optional on the wire (older senders omit it)."""
    episode: Episode | None = None
    """What makes this sample a multi-turn episode (its loss mask, turns, tools, the
    environment's reward); None for a single-turn answer. Optional on the wire."""
    trained_from: int = 0
    """Index of the first token trained on: the tokens before it stay in the sequence as context
    but are out of the loss, because the versions that sampled them were past the staleness
    bound when the group was handed to the learner (``generator.partial_rollouts``: set by the
    buffer, ``asyncrl.buffer.stale_segments``). ``len(response_ids)``: no token is trained. In
    [0, len(response_ids)]; optional on the wire (0)."""
    teacher_logprobs: np.ndarray | None = None
    """(T,) float32 log-probabilities of ``response_ids`` under a teacher model (the ``teacher``
    reward, ``asyncrl.rewards.teacher``), for on-policy distillation (``algorithm.distill``); 0 on
    tokens out of the loss. None without a teacher. Optional on the wire."""

    def __post_init__(self):
        if not isinstance(self.response_ids, np.ndarray) or not isinstance(self.logprobs, np.ndarray):
            raise WireError("bad_fields", f"sample {self.uid!r:.80}: response_ids and logprobs must be arrays")
        if self.response_ids.shape != self.logprobs.shape or self.response_ids.ndim != 1:
            raise WireError(
                "bad_shape",
                f"sample {self.uid}: response_ids {self.response_ids.shape} and logprobs "
                f"{self.logprobs.shape} must be equal 1-D shapes",
            )


@dataclass
class Group:
    """The n samples of one prompt, sampled by one policy version (a weight update is atomic)."""

    group_id: str
    """Unique id of this group: ``{prompt_uid}@{generator}#{counter}``."""
    prompt_uid: str
    """The dataset row the prompt came from."""
    task: str
    """Task name, tells the reward worker how to score (``addition``, ``gsm8k``)."""
    prompt: str
    """The prompt text."""
    answer: str
    """The reference answer used by rule rewards."""
    prompt_ids: np.ndarray
    """(P,) int32 prompt token ids, shared by every sample."""
    policy_version: int
    """Learner step count (one per batch) of the weights that sampled the group's *oldest* token (every
    token, unless a sample's ``version_segments`` say otherwise): staleness is measured from it."""
    generator: str
    """Name of the generator process that sampled it."""
    samples: list[Sample]
    """The n answers (n episodes; more samples when an episode is split into parts,
    ``Episode.part``)."""
    rollout_s: float = 0.0
    """Seconds from the generator receiving the prompt to the group being complete."""
    reward_s: float = 0.0
    """Seconds spent scoring the group (0 until scored)."""
    sampled_at: float = 0.0
    """Wall clock (Unix seconds) when the generator began sampling it: the start of the per-sample
    latency the learner reports. 0: not stamped."""
    greedy_text: str | None = None
    """The prompt's greedy answer, sent with the group for ReMax's baseline (``generator.greedy_baseline``)."""
    greedy_reward: float | None = None
    """The reward of ``greedy_text``, by the same rewards as the samples (set by the reward worker)."""
    unscored_reason: str | None = None
    """Why the group is unscored (``reward_failed: {reward}: {reason}``): the buffer drops it by
    this reason. None while scored or not yet scored."""
    unscored_detail: str | None = None
    """More about the failure (at most 200 characters)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form annotations (msgpack-able scalars/strings only)."""
    columns: dict[str, Any] | None = None
    """The dataset row the prompt came from, every column (JSON values), for the rewards that
    read them (a ``python`` reward's ``row``). None: no row (a generated task). Optional on the wire."""

    @property
    def scored(self) -> bool:
        return all(s.reward is not None for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)


def group_to_dict(g: Group) -> dict:
    """Shallow: the arrays are referenced, not copied (``dataclasses.asdict`` deep-copies every
    array, which cost 230 µs of a 1k-token group of 8's 300 µs round trip)."""
    d = dict(zip(_GROUP_FIELDS, _group_values(g)))
    d["samples"] = [dict(zip(_SAMPLE_FIELDS, _sample_values(s))) for s in g.samples]
    return d


_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(Group))
_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
_group_values, _sample_values = operator.attrgetter(*_GROUP_FIELDS), operator.attrgetter(*_SAMPLE_FIELDS)


_GROUP_STRINGS = ("group_id", "prompt_uid", "task", "prompt", "answer", "generator")
_SAMPLE_STRINGS = ("uid", "text", "finish_reason")


def validate_group(g: Group) -> None:
    """Reject what would poison training: wrong types, empty groups, non-finite numbers."""
    for name in _GROUP_STRINGS:
        if not isinstance(getattr(g, name), str):
            raise WireError("bad_fields", f"group: {name} ({getattr(g, name)!r:.80}) must be a string")
    if g.columns is not None and not isinstance(g.columns, dict):
        raise WireError("bad_fields", f"group {g.group_id}: columns must be a map or absent")
    for name in ("greedy_text", "unscored_reason", "unscored_detail"):
        if (value := getattr(g, name)) is not None and not isinstance(value, str):
            raise WireError("bad_fields", f"group {g.group_id}: {name} ({value!r:.40}) must be a string or absent")
    for name in ("sampled_at", "greedy_reward"):
        value = getattr(g, name)
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise WireError("bad_fields", f"group {g.group_id}: {name} ({value!r:.40}) must be a finite number")
    if not isinstance(g.meta, dict) or not isinstance(g.samples, list):
        raise WireError("bad_fields", f"group {g.group_id}: meta must be a map and samples a list")
    if not isinstance(g.policy_version, int) or g.policy_version < 0:
        raise WireError("bad_fields", f"group {g.group_id}: policy_version ({g.policy_version!r}) must be an int >= 0")
    if not g.samples:
        raise WireError("bad_fields", f"group {g.group_id}: has no samples")
    if not isinstance(g.prompt_ids, np.ndarray) or g.prompt_ids.ndim != 1:
        raise WireError("bad_fields", f"group {g.group_id}: prompt_ids must be a 1-D array")
    for s in g.samples:
        validate_sample(s, g)


def validate_sample(s: Sample, g: Group) -> None:
    """One sample of ``g``; runs per sample of every group received, so the usual case is kept to
    a few cheap tests (exact types first) and the messages are built only on failure."""
    if not (type(s.uid) is str and type(s.text) is str and type(s.finish_reason) is str):
        for name in _SAMPLE_STRINGS:
            if not isinstance(getattr(s, name), str):
                raise WireError(
                    "bad_fields", f"group {g.group_id}: sample {name} ({getattr(s, name)!r:.80}) must be a string"
                )
    if s.response_ids.dtype.kind not in "iu":  # both are arrays of one shape (Sample.__post_init__)
        raise WireError("bad_fields", f"sample {s.uid}: response_ids must be an integer array")
    if s.logprobs.dtype.kind != "f":
        raise WireError("bad_fields", f"sample {s.uid}: logprobs must be a float array")
    if not np.isfinite(s.logprobs).all():
        raise WireError("nonfinite_logprobs", f"sample {s.uid}: logprobs contain NaN or inf")
    reward = s.reward
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        raise WireError("nonfinite_reward", f"sample {s.uid}: reward ({reward!r}) must be a finite number")
    if s.token_rewards is not None:
        tr = s.token_rewards
        if not isinstance(tr, np.ndarray) or tr.shape != s.response_ids.shape or tr.dtype.kind != "f":
            raise WireError(
                "bad_fields", f"sample {s.uid}: token_rewards must be a float array shaped like response_ids"
            )
        if not np.isfinite(tr).all():
            raise WireError("nonfinite_reward", f"sample {s.uid}: token_rewards contain NaN or inf")
    if s.teacher_logprobs is not None:
        validate_teacher_logprobs(s)
    if type(s.reward_parts) is not dict or type(s.reward_seconds) is not dict:
        if not isinstance(s.reward_parts, dict) or not isinstance(s.reward_seconds, dict):
            raise WireError("bad_fields", f"sample {s.uid}: reward_parts and reward_seconds must be maps")
    if s.version_segments is not None:
        validate_segments(s.version_segments, len(s.response_ids), g.policy_version, s.uid)
    if s.episode is not None:
        validate_episode(s)
    if type(s.trained_from) is not int or not 0 <= s.trained_from <= len(s.response_ids):
        raise WireError(
            "bad_fields",
            f"sample {s.uid}: trained_from ({s.trained_from!r:.40}) must be an int in [0, {len(s.response_ids)}] (its tokens)",
        )


def validate_teacher_logprobs(s: Sample) -> None:
    """A sample's ``teacher_logprobs``: a float array shaped like ``response_ids``, finite, <= 0."""
    tl = s.teacher_logprobs
    if not isinstance(tl, np.ndarray) or tl.shape != s.response_ids.shape or tl.dtype.kind != "f":
        raise WireError(
            "bad_fields", f"sample {s.uid}: teacher_logprobs must be a float array shaped like response_ids"
        )
    if not np.isfinite(tl).all() or (tl > 0).any():
        raise WireError("nonfinite_logprobs", f"sample {s.uid}: teacher_logprobs must be finite and <= 0")


def validate_episode(s: Sample) -> None:
    """A multi-turn sample's ``episode``: its ``loss_mask`` a 0/1 integer array shaped like
    ``response_ids`` whose masked tokens carry no behaviour log-probability (0), the counters
    non-negative ints, ``id`` a string, ``env_reward`` finite."""
    e = s.episode
    if not isinstance(e, Episode):
        raise WireError("bad_fields", f"sample {s.uid}: episode must be a map of the episode's fields or absent")
    mask = e.loss_mask
    if not isinstance(mask, np.ndarray) or mask.shape != s.response_ids.shape or mask.dtype.kind not in "biu":
        raise WireError("bad_fields", f"sample {s.uid}: loss_mask must be an integer array shaped like response_ids")
    if ((mask != 0) & (mask != 1)).any():
        raise WireError("bad_fields", f"sample {s.uid}: loss_mask must hold only 0 and 1")
    if (s.logprobs[mask == 0] != 0).any():
        raise WireError(
            "bad_fields", f"sample {s.uid}: a token out of the loss (loss_mask 0) must carry no logprob (0)"
        )
    for name in ("id", "env_error"):
        value = getattr(e, name)
        if (value is not None or name == "id") and type(value) is not str:
            raise WireError("bad_fields", f"sample {s.uid}: episode {name} ({value!r:.40}) must be a string")
    for name in ("turns", "tool_calls", "tool_errors", "part"):
        if type(value := getattr(e, name)) is not int or value < 0:
            raise WireError("bad_fields", f"sample {s.uid}: {name} ({value!r:.40}) must be an int >= 0")
    if e.env_reward is not None and not (isinstance(e.env_reward, int | float) and math.isfinite(e.env_reward)):
        raise WireError(
            "nonfinite_reward", f"sample {s.uid}: env_reward ({e.env_reward!r:.40}) must be a finite number"
        )
    for item in e.step_rewards or []:
        ok = isinstance(item, list | tuple) and len(item) == 2 and type(item[0]) is int
        if not ok or not 0 <= item[0] < len(s.response_ids) or not math.isfinite(item[1]):
            raise WireError(
                "bad_fields", f"sample {s.uid}: step_rewards entry {item!r:.40} must be [token index, finite reward]"
            )
    p = e.prompt_ids
    if p is not None and (not isinstance(p, np.ndarray) or p.ndim != 1 or p.dtype.kind not in "iu" or len(p) == 0):
        raise WireError(
            "bad_fields", f"sample {s.uid}: episode prompt_ids must be a non-empty 1-D integer array or absent"
        )


def loss_mask(sample: Sample) -> np.ndarray | None:
    """The (T,) mask of ``sample``'s policy tokens (an episode's); None: every token is the policy's."""
    return None if sample.episode is None else sample.episode.loss_mask


def sample_prompt_ids(group: Group, sample: Sample) -> np.ndarray:
    """The ids ``sample``'s response follows: a later part's own context, else the group's prompt."""
    if sample.episode is not None and sample.episode.prompt_ids is not None:
        return sample.episode.prompt_ids
    return group.prompt_ids


def episode_parts(group: Group) -> list[int] | None:
    """The index of each sample's episode among ``group``'s episodes (in order of first sample),
    when some episode is split into several parts; None when every sample is its own episode.

    >>> ids = np.zeros(1, dtype=np.int32)
    >>> def part(uid, eid, k):
    ...     return Sample(uid, ids, ids.astype(np.float32), "", "stop", episode=Episode(eid, ids.astype(np.uint8), part=k))
    >>> g = Group("g", "p", "t", "", "", ids, 0, "gen-0", [part("g/0", "g/0", 0), part("g/0.1", "g/0", 1), part("g/1", "g/1", 0)])
    >>> episode_parts(g)
    [0, 0, 1]
    """
    if all(s.episode is None or s.episode.part == 0 for s in group.samples):
        return None
    index: dict[str, int] = {}
    return [index.setdefault(s.uid if s.episode is None else s.episode.id, len(index)) for s in group.samples]


def policy_tokens(sample: Sample) -> int:
    """Tokens of ``sample`` the policy sampled (those its ``loss_mask`` keeps; all without one)."""
    mask = loss_mask(sample)
    return len(sample.response_ids) if mask is None else int(np.count_nonzero(mask))


def validate_segments(segments, num_tokens: int, policy_version: int, uid: str) -> None:
    """``version_segments`` must be ``[[0, v0], [i1, v1], ...]`` with 0 < i1 < ... < num_tokens and
    policy_version <= v0 < v1 < ...: each version sampled a non-empty run of tokens."""
    ok = isinstance(segments, (list, tuple)) and len(segments) > 0
    ok = ok and all(
        isinstance(seg, (list, tuple)) and len(seg) == 2 and all(isinstance(x, int) and x >= 0 for x in seg)
        for seg in segments
    )
    if not ok:
        raise WireError(
            "bad_fields",
            f"sample {uid}: version_segments ({segments!r:.80}) must be a non-empty list of [index, version] int pairs",
        )
    indices, versions = [seg[0] for seg in segments], [seg[1] for seg in segments]
    if indices[0] != 0 or any(b <= a for a, b in zip(indices, indices[1:])) or indices[-1] >= max(num_tokens, 1):
        raise WireError(
            "bad_fields",
            f"sample {uid}: version_segments indices {indices} must start at 0 and increase strictly below {num_tokens} tokens",
        )
    if versions[0] < policy_version or any(b <= a for a, b in zip(versions, versions[1:])):
        raise WireError(
            "bad_fields",
            f"sample {uid}: version_segments versions {versions} must increase strictly from at least the group's policy_version ({policy_version})",
        )


def token_versions(sample: Sample, policy_version: int) -> np.ndarray:
    """(T,) int64: the policy version that sampled each response token of ``sample``, from its
    ``version_segments`` (None: ``policy_version``, its group's, sampled every token).

    >>> s = Sample("g/0", np.arange(5, dtype=np.int32), np.zeros(5, np.float32), "", "length", version_segments=[[0, 3], [2, 4]])
    >>> token_versions(s, 3).tolist()
    [3, 3, 4, 4, 4]
    """
    out = np.full(len(sample.response_ids), policy_version, dtype=np.int64)
    for index, version in sample.version_segments or ():
        out[index:] = version  # later segments overwrite from their first token on
    return out


# ---------------------------------------------------------------------------------------------
# arrays on the wire


def array_to_map(obj):
    """A numpy array -> its ``__nd__`` map (raw little-endian bytes); a numpy scalar -> its Python value."""
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return {_ND: True, "dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


_DTYPES: dict[str, np.dtype] = {}  # wire dtype string -> numpy dtype, for those seen (a handful)


def array_from_map(obj: dict) -> np.ndarray:
    """``{"__nd__": True, "dtype", "shape", "data"}`` -> a read-only array over ``data`` (zero-copy)."""
    try:
        dtype = _DTYPES.get(obj["dtype"])
        if dtype is None:
            dtype = np.dtype(obj["dtype"])
            if dtype.kind not in "biuf":
                raise WireError("bad_array", f"dtype {obj['dtype']!r} is not numeric")
            if len(_DTYPES) < 64:
                _DTYPES[obj["dtype"]] = dtype
        shape = obj["shape"]
        arr = np.frombuffer(obj["data"], dtype=dtype)
        if len(shape) == 1 and type(shape[0]) is int and shape[0] == arr.shape[0]:
            return arr  # the common case: 1-D and consistent
        return arr.reshape(tuple(int(n) for n in shape))
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise WireError("bad_array", str(e)) from None


def is_array_map(obj) -> bool:
    return type(obj) is dict and obj.get(_ND) is True


def restore_arrays(obj):
    """Every ``__nd__`` map anywhere in ``obj`` -> its array (the free-form parts of open messages)."""
    if type(obj) is dict:
        if obj.get(_ND) is True:
            return array_from_map(obj)
        return {k: restore_arrays(v) for k, v in obj.items()}
    if type(obj) is list:
        return [restore_arrays(v) for v in obj]
    return obj
