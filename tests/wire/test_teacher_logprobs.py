"""A sample's teacher log-probabilities are validated on the wire like its behaviour logprobs."""

import numpy as np
import pytest

from asyncrl.wire.schema import WireError, validate_group
from tests.factories import make_group


@pytest.mark.parametrize(
    "values, reason",
    [
        (np.zeros(2, np.float32), "bad_fields"),  # the answer has 3 tokens
        (np.zeros(3, np.int32), "bad_fields"),
        (np.array([-1.0, np.nan, 0.0], np.float32), "nonfinite_logprobs"),
        (np.array([-1.0, 0.5, 0.0], np.float32), "nonfinite_logprobs"),  # a log-probability is <= 0
    ],
)
def test_bad_teacher_logprobs_are_rejected_by_reason(values, reason):
    group = make_group("g", n=1)
    group.samples[0].teacher_logprobs = values
    with pytest.raises(WireError) as e:
        validate_group(group)
    assert e.value.reason == reason


def test_good_ones_and_none_pass():
    group = make_group("g", n=2)
    group.samples[0].teacher_logprobs = np.array([-1.0, -0.5, 0.0], np.float32)
    validate_group(group)
