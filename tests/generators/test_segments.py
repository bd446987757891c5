"""Version segments: groups are stamped with their oldest token's version, segments survive the
wire, and malformed segments are rejected with the rule they break."""

import numpy as np
import pytest

from asyncrl.generators.completion import Completion
from asyncrl.generators.groups import build_groups
from asyncrl.wire import WireError, decode, encode_group, validate_group

ROW = {"group_id": "g1", "prompt_uid": "p1", "task": "addition", "text": "1+1=", "answer": "2"}


def _completion(n_tokens, segments=None):
    return Completion(
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(n_tokens, dtype=np.int32),
        logprobs=np.full(n_tokens, -0.5, dtype=np.float32),
        text="x" * n_tokens,
        finish_reason="length",
        version_segments=segments,
    )


def test_a_group_is_stamped_with_its_oldest_version_and_keeps_only_informative_segments():
    comps = [_completion(6, [[0, 4], [3, 5]]), _completion(6, [[0, 4]]), _completion(6, [[0, 5]])]
    (group,) = build_groups([ROW], [comps], version=9, generator="gen-0", rollout_s=0.1)
    assert group.policy_version == 4
    assert [s.version_segments for s in group.samples] == [[[0, 4], [3, 5]], None, [[0, 5]]]
    _, body = decode(encode_group(group))
    assert [s.version_segments for s in body.group.samples] == [[[0, 4], [3, 5]], None, [[0, 5]]]


def test_unlabelled_completions_take_the_version_given():
    (group,) = build_groups([ROW], [[_completion(4), _completion(2)]], version=7, generator="gen-0", rollout_s=0.1)
    assert group.policy_version == 7 and all(s.version_segments is None for s in group.samples)


@pytest.mark.parametrize(
    "segments, rule",
    [
        ([[1, 4]], "must start at 0"),
        ([[0, 4], [6, 5]], "increase strictly below 6 tokens"),
        ([[0, 4], [2, 4]], "versions .* must increase strictly"),
        ([[0, 3]], r"at least the group's policy_version \(4\)"),
        ([[0, "4"]], "int pairs"),
        ([], "non-empty"),
    ],
)
def test_malformed_segments_are_rejected_naming_the_rule(segments, rule):
    (group,) = build_groups([ROW], [[_completion(6, [[0, 4], [3, 5]])]], version=4, generator="g", rollout_s=0.0)
    group.samples[0].version_segments = segments
    with pytest.raises(WireError, match=rule):
        validate_group(group)


def test_trained_from_survives_the_wire_and_must_lie_within_the_answer():
    (group,) = build_groups([ROW], [[_completion(6, [[0, 4], [3, 5]]), _completion(2)]], 4, "gen-0", 0.0)
    assert [s.trained_from for s in group.samples] == [0, 0]  # the default: every token trained
    group.samples[0].trained_from = 3
    group.samples[1].trained_from = 2  # an answer with no token trained
    _, body = decode(encode_group(group))
    assert [s.trained_from for s in body.group.samples] == [3, 2]
    for bad in (7, -1, "3"):
        group.samples[0].trained_from = bad
        with pytest.raises(WireError, match=r"trained_from .* must be an int in \[0, 6\]"):
            validate_group(group)
