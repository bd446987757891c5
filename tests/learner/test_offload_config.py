"""``learner.trainer.offload``: what it refuses (naming the value and the rule) and the DeepSpeed
keys it writes."""

import pytest
from pydantic import ValidationError

from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.offload_config import OffloadConfig


@pytest.mark.parametrize(
    "stage, offload, message",
    [
        (2, dict(params="cpu"), r"offload.params \(cpu\) needs zero_stage 3.*got 2"),
        (0, dict(optimizer="cpu"), r"offload.optimizer \(cpu\) needs zero_stage >= 1.*got 0"),
        (2, dict(optimizer="nvme", nvme_path="/x"), r"offload.optimizer \(nvme\) needs zero_stage 3.*got 2"),
        (3, dict(params="nvme"), r"offload.nvme_path \(None\) must name a folder"),
        (
            3,
            dict(optimizer_impl="deepspeed_cpu_adam"),
            r"optimizer_impl \(deepspeed_cpu_adam\).*needs optimizer cpu or nvme",
        ),
        (3, dict(max_in_cpu_params=0), r"max_in_cpu_params"),
    ],
)
def test_offload_refuses_what_deepspeed_cannot_run(stage, offload, message):
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(zero_stage=stage, offload=offload)


def test_cpu_adam_refuses_an_unfused_adamw():
    offload = dict(optimizer="cpu", optimizer_impl="deepspeed_cpu_adam")
    with pytest.raises(ValidationError, match=r"fused_adamw \(False\).*has only a fused kernel"):
        TrainerConfig(zero_stage=2, fused_adamw=False, offload=offload)
    assert TrainerConfig(zero_stage=2, offload=offload).offload.optimizer_impl == "deepspeed_cpu_adam"


def test_deepspeed_keys_of_each_offload(tmp_path):
    from asyncrl.learner.deepspeed_setup import deepspeed_config

    plain = deepspeed_config(TrainerConfig(zero_stage=3))
    assert "offload_optimizer" not in plain["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in plain

    cfg = TrainerConfig(zero_stage=3, offload=dict(optimizer="cpu", params="cpu", pin_memory=False))
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert ds["zero_optimization"]["sub_group_size"] == 1_000_000_000
    assert ds["zero_force_ds_cpu_optimizer"] is False  # torch's AdamW runs the offloaded update

    cpu_adam = TrainerConfig(zero_stage=2, offload=dict(optimizer="cpu", optimizer_impl="deepspeed_cpu_adam"))
    assert deepspeed_config(cpu_adam)["zero_force_ds_cpu_optimizer"] is True
    assert OffloadConfig().enabled is False and OffloadConfig(params="nvme").uses_nvme
