"""A generator's settings (the run's ``generator`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.configbase import Config


class GeneratorConfig(Config):
    mode: Literal["continuous", "batch"] = "continuous"
    """``continuous``: keep up to ``max_inflight_sequences`` sequences in the engine, ask for more
    prompts as soon as room frees and send each group the moment its n answers are done
    (``asyncrl.generators.continuous``); weights are then swapped in flight. ``batch``: ask for
    ``prompts_per_batch`` prompts, sample them in one engine call and send them when the slowest
    answer is done (the batch barrier, kept for comparison)."""
    prompts_per_batch: int = Field(16, ge=1)
    """batch: prompts a generator asks for and samples in one engine call (each gives a group of
    n). continuous: the simulated engine's default bound is this many groups of n."""
    max_inflight_sequences: int | None = Field(None, ge=1)
    """continuous: most sequences (n per group, ReMax's greedy answer included) a generator keeps in
    its engine. None: what the engine's KV cache holds, KV blocks // ceil(expected_sequence_tokens /
    block size) (vLLM reports its blocks once started), at most ``engine.max_num_seqs``;
    ``prompts_per_batch`` groups for the simulated engine. Either way it is a ceiling: the bound
    shrinks by a quarter when the engine runs out of KV cache (sequences preempted or waiting for
    blocks) and grows back one group at a time once that stops."""
    expected_sequence_tokens: int | None = Field(None, ge=1)
    """continuous: tokens (prompt + answer) one sequence is expected to hold, for the default
    ``max_inflight_sequences``. None: ``engine.max_model_len``, the most any can reach, so no
    sequence is preempted; a smaller figure (e.g. the usual prompt + the median answer) keeps more
    sequences in flight and leaves the tail to the preemption back-off."""
    group_timeout_s: float | None = Field(None, gt=0)
    """continuous: seconds a group may stay in the engine; past it its requests are aborted and the
    group is dropped, reason ``generation_timeout``, named in the log (an engine never holds
    sequences forever). None: scaled to the model, 8 x ``sampling.max_tokens`` x the seconds per
    token the engine has taken (averaged over finished groups), at least 30 s, and 600 s until a
    group has finished (``asyncrl.generators.continuous.GroupTimeout``)."""
    dispatcher_silence_s: float = Field(30.0, gt=0)
    """continuous: seconds without an answer from the dispatcher after which the silence is logged
    by name (the sequences in flight go on and are sent; nothing waits on the dispatcher)."""
    request_timeout_s: float = Field(0.25, gt=0)
    """Seconds a request for prompts waits before it is asked again, with the version then served
    (short, because the dispatcher's admission is computed from the version in the request)."""
    greedy_baseline: bool = False
    """Also decode each prompt greedily and send that answer with its group (``meta['greedy_text']``),
    for ReMax's baseline; the reward worker scores it into ``meta['greedy_reward']``."""
    send_timeout_s: float = Field(30.0, gt=0)
    """Seconds a finished group waits for a reward worker to take it before the wait is reported."""
    partial_rollouts: Literal["off", "mask", "resume"] = "off"
    """What becomes of an answer whose oldest tokens are past ``buffer.max_staleness`` when it is
    trained: ``off``, its whole group is dropped (reason ``stale``); ``mask``, the stale tokens
    stay as context but leave the loss (``Sample.trained_from``), the group being dropped only when
    none of its tokens is within the bound; ``resume``, as ``mask``, and a request still running
    at a weight update is also aborted and resumed under the new version from its tokens so far
    (AReaL's interruptible generation, ``asyncrl.generators.resume``)."""
