"""``asyncrl sft`` / ``asyncrl dpo``: the recipe is read and checked before anything trains."""

import pytest

from asyncrl.cli import main
from asyncrl.learner.offline.config import load_offline_config


def test_show_config_prints_every_field_with_its_doc(capsys):
    assert main(["sft", "configs/sft_addition.yaml", "training.steps=70", "--show-config"]) == 0
    out = capsys.readouterr().out
    assert "training.steps=70  # Optimizer steps (one per batch)." in out
    assert "learner.trainer.zero_stage=0  # DeepSpeed ZeRO stage" in out
    assert "objective.kind=\"sft\"" in out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["sft", "configs/sft_addition.yaml", "training.stepz=5"], "config error: training.stepz=5: unknown key"),
        (
            ["sft", "configs/sft_addition.yaml", "learner.trainer.zero_stage=4"],
            "config error: learner.trainer.zero_stage=4: zero_stage (4) must be 0, 1, 2 or 3",
        ),
        (
            ["dpo", "configs/dpo_addition.yaml", "objective.loss_type=kto"],
            "config error: objective.loss_type=\"kto\": Input should be 'sigmoid', 'ipo' or 'hinge'",
        ),
        (
            ["sft", "configs/dpo_addition.yaml"],
            "error: objective.kind (dpo) is not this command's (sft): run `asyncrl dpo` for this recipe",
        ),
        (["sft", "configs/nope.yaml"], "error: recipe configs/nope.yaml does not exist"),
        (
            ["sft", "configs/sft_addition.yaml", "training.steps=5"],
            "config error: learner.trainer.lr_warmup_steps (20) must be <= training.steps (5)",
        ),
        (
            ["sft", "configs/sft_addition.yaml", "model.lora.rank=8", "model.lora.dropout=1.5"],
            "config error: model.lora.dropout=1.5: dropout (1.5) must be in [0, 1)",
        ),
    ],
)
def test_a_bad_recipe_is_one_line_that_names_the_key_and_the_rule(args, expected, capsys):
    assert main(args) == 2
    assert expected in capsys.readouterr().err


def test_sft_without_a_recipe_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["sft"])
    assert done.value.code == 2
    assert "sft needs a CONFIG recipe, or --resume RUN_DIR" in capsys.readouterr().err


def test_the_command_sets_the_objective_and_the_run_name():
    cfg = load_offline_config(None, ["data.train=addition"], kind="dpo")
    assert cfg.objective.kind == "dpo" and cfg.run.name == "dpo"
    assert cfg.trainer_config().lr_decay_steps == cfg.training.steps
