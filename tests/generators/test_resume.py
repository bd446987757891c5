"""Partial rollouts' pure parts: a continuation's sampling parameters and the merge of an aborted
prefix with its continuation (the real-engine round trip is in ``test_async_engine``)."""

from dataclasses import replace

import numpy as np
import pytest
from vllm import SamplingParams

from asyncrl.generators.completion import Completion
from asyncrl.generators.groups import build_groups
from asyncrl.generators.resume import continuation_params, merge_continuation, merge_segments, oldest_version


def _completion(prompt, tokens, logprob, segments, finish="abort", resumed=0):
    return Completion(
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        response_ids=np.asarray(tokens, dtype=np.int32),
        logprobs=np.full(len(tokens), logprob, dtype=np.float32),
        text="".join(chr(97 + t % 26) for t in tokens),
        finish_reason=finish,
        version_segments=segments,
        resumed=resumed,
    )


def test_a_continuation_samples_what_is_left_with_its_seed_moved_on():
    params = SamplingParams(n=4, max_tokens=10, min_tokens=6, seed=5, temperature=0.7, logprobs=0)
    rest = continuation_params(params, done=4)
    assert (rest.n, rest.max_tokens, rest.min_tokens, rest.seed, rest.temperature) == (1, 6, 2, 9, 0.7)
    assert continuation_params(params, done=8).min_tokens == 0
    assert (params.n, params.max_tokens, params.seed) == (4, 10, 5)  # the original is untouched
    with pytest.raises(ValueError, match=r"max_tokens \(10\) must exceed the 10 tokens"):
        continuation_params(params, done=10)


def test_merged_answer_keeps_each_parts_tokens_logprobs_and_versions():
    prefix = _completion([1, 2], [3, 4, 5], -1.0, [[0, 2], [1, 3]])
    cont = _completion([1, 2, 3, 4, 5], [6, 7], -2.0, [[0, 5]], finish="length")
    whole = merge_continuation(prefix, cont, prefix_version=2, version=5)
    assert whole.prompt_ids.tolist() == [1, 2] and whole.response_ids.tolist() == [3, 4, 5, 6, 7]
    assert whole.logprobs.tolist() == [-1.0, -1.0, -1.0, -2.0, -2.0]
    assert whole.version_segments == [[0, 2], [1, 3], [3, 5]] and whole.finish_reason == "length"
    assert whole.resumed == 1 and whole.text == prefix.text + cont.text
    assert oldest_version(whole, default=9) == 2
    # aborted again and resumed again: counted, and one version on both sides of the cut joins
    again = merge_continuation(
        replace(whole, finish_reason="abort"), _completion([1, 2, 3, 4, 5, 6, 7], [8], -3.0, [[0, 5]], "stop"), 2, 5
    )
    assert again.version_segments == [[0, 2], [1, 3], [3, 5]] and again.resumed == 2
    # the group built from it is stamped with its oldest version and keeps the segments
    row = {"group_id": "g", "prompt_uid": "p", "task": "t", "text": "", "answer": ""}
    (group,) = build_groups([row], [[again]], version=5, generator="gen", rollout_s=0.0)
    assert group.policy_version == 2 and group.samples[0].version_segments == [[0, 2], [1, 3], [3, 5]]


def test_an_answer_aborted_before_its_first_token_is_its_continuation():
    prefix = _completion([1, 2], [], 0.0, None)
    cont = _completion([1, 2], [6, 7], -2.0, [[0, 5]], finish="stop")
    whole = merge_continuation(prefix, cont, prefix_version=4, version=5)
    assert whole.response_ids.tolist() == [6, 7] and whole.version_segments == [[0, 5]]


def test_unlabelled_parts_take_the_versions_they_were_submitted_under():
    whole = merge_continuation(_completion([1], [3, 4], -1.0, None), _completion([1, 3, 4], [5], -1.0, None), 1, 2)
    assert whole.version_segments == [[0, 1], [2, 2]]


def test_a_continuation_that_does_not_follow_its_prefix_is_refused():
    with pytest.raises(ValueError, match=r"must be the prompt \(2\) \+ the prefix's 3 tokens"):
        merge_continuation(_completion([1, 2], [3, 4, 5], -1.0, None), _completion([1, 2], [6], -1.0, None), 0, 1)
    with pytest.raises(ValueError, match="older than the prefix's last"):
        merge_segments([[0, 4]], [[0, 3]], offset=2)
