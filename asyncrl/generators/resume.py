"""Partial rollouts: an answer aborted mid-generation and continued under newer weights.

AReaL's interruptible generation: at a weight update, a request whose oldest tokens would be too
stale to train is aborted, and resubmitted with its prompt *and the tokens it sampled so far* as
the new prompt, for the tokens it has left. The engine recomputes the prefix's KV with the new
weights, so nothing of the old weights is reused; the tokens already sampled keep their
behaviour logprobs and their versions (the old version did sample them), and the merged answer's
``version_segments`` record the switch. Which of its tokens are then trained is the staleness
gate's decision (``Sample.trained_from``), as for any answer spanning an update.

These are the pure parts (``asyncrl.generators.engines.async_vllm_engine.AsyncVLLMEngine.resume_request``
uses them): the continuation's sampling parameters and the merge of prefix and continuation.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from asyncrl.generators.completion import Completion

SEED_RANGE = 1 << 31
"""vLLM's seeds are 31-bit here (``engine.derive_seed``); a continuation's seed stays in range."""


def oldest_version(completion: Completion, default: int) -> int:
    """The version of ``completion``'s oldest token: its first segment's, or ``default`` (the
    version it was submitted under) when the engine labelled none."""
    return completion.version_segments[0][1] if completion.version_segments else default


def continuation_params(params, done: int):
    """vLLM ``SamplingParams`` for the rest of an answer that has ``done`` tokens: one sample,
    ``max_tokens`` and ``min_tokens`` less ``done``, and a seed moved on by ``done`` (the same
    seed would replay the draws of the answer's first tokens); everything else as ``params``.
    Callers check ``params.max_tokens > done`` first (an answer with no tokens left is whole)."""
    if params.max_tokens is None or params.max_tokens <= done:
        raise ValueError(f"max_tokens ({params.max_tokens}) must exceed the {done} tokens already sampled")
    rest = params.clone()
    rest.n = 1
    rest.max_tokens = params.max_tokens - done
    rest.min_tokens = max(0, params.min_tokens - done)
    if params.seed is not None:
        rest.seed = (params.seed + done) % SEED_RANGE
    return rest


def merge_segments(prefix: list[list[int]], continuation: list[list[int]], offset: int) -> list[list[int]]:
    """``[[first_token_index, version], ...]`` of a prefix of ``offset`` tokens followed by a
    continuation: the continuation's indices move by ``offset``, and its first segment joins the
    prefix's last when one version sampled both (an abort with no update in between).

    >>> merge_segments([[0, 3], [4, 4]], [[0, 5], [2, 6]], offset=6)
    [[0, 3], [4, 4], [6, 5], [8, 6]]
    >>> merge_segments([[0, 3]], [[0, 3]], offset=6)
    [[0, 3]]
    """
    merged = [list(seg) for seg in prefix]
    for index, version in continuation:
        if merged and merged[-1][1] == version:
            continue
        if merged and version < merged[-1][1]:
            raise ValueError(
                f"continuation version {version} is older than the prefix's last ({merged[-1][1]}): "
                "versions must not go back within an answer"
            )
        merged.append([index + offset, version])
    return merged


def merge_continuation(prefix: Completion, continuation: Completion, prefix_version: int, version: int) -> Completion:
    """The answer ``prefix`` (aborted: its tokens, logprobs and segments as the old weights
    sampled them) followed by ``continuation`` (sampled after the prompt + ``prefix``'s tokens).

    ``prefix_version``/``version``: the versions each was submitted under, for an engine that
    labels no segments. The result has the prefix's ``prompt_ids``, the two answers' tokens and
    logprobs end to end, the continuation's finish reason, ``resumed`` one more than the
    prefix's, and ``text`` the continuation's appended (callers that can decode the merged ids
    should: a multi-byte character may straddle the cut)."""
    offset = len(prefix.response_ids)
    if len(continuation.prompt_ids) != len(prefix.prompt_ids) + offset:
        raise ValueError(
            f"continuation prompt ({len(continuation.prompt_ids)} tokens) must be the prompt "
            f"({len(prefix.prompt_ids)}) + the prefix's {offset} tokens"
        )
    head = prefix.version_segments or ([[0, prefix_version]] if offset else [])
    tail = continuation.version_segments or ([[0, version]] if len(continuation.response_ids) else [])
    return replace(
        continuation,
        prompt_ids=prefix.prompt_ids,
        response_ids=np.concatenate([prefix.response_ids, continuation.response_ids]).astype(np.int32),
        logprobs=np.concatenate([prefix.logprobs, continuation.logprobs]).astype(np.float32),
        text=prefix.text + continuation.text,
        version_segments=merge_segments(head, tail, offset) or None,
        resumed=prefix.resumed + 1,
    )
