"""learner.trainer.attn_implementation: the names transformers accepts, refused when the config is
read if their package is missing, and which of them pack a micro batch into one row."""

import pytest
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # imported at collection (~5 s), not charged to a test

from asyncrl.learner.attention import DENSE, FLASH_PACKAGES, check_attn_implementation, installed, varlen_attention
from asyncrl.learner.trainer_config import TrainerConfig


def test_every_name_is_one_transformers_accepts():
    accepted = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    assert set(DENSE) | set(FLASH_PACKAGES) <= accepted
    assert TrainerConfig().attn_implementation == "sdpa"
    assert TrainerConfig(attn_implementation="eager").attn_implementation == "eager"


@pytest.mark.skipif(installed("flash-attn") or installed("kernels"), reason="flash-attention is installed here")
def test_flash_attention_without_its_package_is_refused_when_the_config_is_read():
    from asyncrl.config import RunConfig

    with pytest.raises(ValueError, match=r"attn_implementation \(flash_attention_2\) needs the flash-attn package.*"):
        RunConfig(learner={"trainer": {"attn_implementation": "flash_attention_2"}})
    with pytest.raises(ValueError, match=r"pip install flash-attn"):
        check_attn_implementation("flash_attention_2")
    with pytest.raises(
        ValueError, match=r"\(kernels-community/flash-attn3\) is a Hugging Face Hub kernel.*pip install kernels"
    ):
        check_attn_implementation("kernels-community/flash-attn3")


def test_an_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"attn_implementation \(flash\) must be one of sdpa, eager, flex_attention"):
        TrainerConfig(attn_implementation="flash")


def test_only_flash_attention_packs_a_micro_batch_into_one_row():
    assert [varlen_attention(name) for name in DENSE] == [False] * len(DENSE)
    assert all(varlen_attention(name) for name in FLASH_PACKAGES)
    assert varlen_attention("kernels-community/flash-attn3")
