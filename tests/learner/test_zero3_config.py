"""``learner.trainer.zero3``: the DeepSpeed keys it writes, at ZeRO-3 only, and what it refuses."""

import pytest
from pydantic import ValidationError

from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.deepspeed_setup import deepspeed_config


def test_zero3_gathering_is_written_as_deepspeeds_stage3_keys():
    cfg = TrainerConfig(zero_stage=3, zero3=dict(max_live_elements=3_000_000, max_reuse_elements=0))
    zero = deepspeed_config(cfg)["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == 3_000_000
    assert zero["stage3_max_reuse_distance"] == 0
    # the others keep DeepSpeed's defaults
    assert zero["stage3_prefetch_bucket_size"] == 50_000_000
    assert zero["stage3_param_persistence_threshold"] == 100_000


def test_below_zero3_the_section_writes_nothing():
    zero = deepspeed_config(TrainerConfig(zero_stage=2, zero3=dict(max_live_elements=1)))["zero_optimization"]
    assert not any(key.startswith("stage3_") for key in zero)


@pytest.mark.parametrize("key", ["max_live_elements"])
def test_a_bound_below_one_element_is_refused_naming_the_key(key):
    with pytest.raises(ValidationError, match=key):
        TrainerConfig(zero_stage=3, zero3={key: 0})
