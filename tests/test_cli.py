import pytest
from pydantic import ValidationError

from asyncrl.cli import main
from asyncrl.config import load_config


def test_build_tiny_model_writes_a_loadable_model(tmp_path, capsys):
    assert main(["build-tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_show_config_prints_every_field_with_its_doc(capsys):
    assert main(["show-config", "configs/demo.yaml", "learner.total_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "learner.total_steps=7  # Optimizer steps to train" in out
    assert "buffer.max_staleness=" in out


def test_overrides_are_typed_and_typos_name_the_key():
    cfg = load_config("configs/demo.yaml", ["learner.trainer.lr=3e-5", "run.num_generators=3"])
    assert cfg.learner.trainer.lr == 3e-5 and cfg.run.num_generators == 3
    with pytest.raises(ValidationError, match="totl_steps"):
        load_config("configs/demo.yaml", ["learner.totl_steps=5"])
    with pytest.raises(ValidationError, match="zero_stage"):
        load_config(None, ["learner.trainer.zero_stage=4"])
    with pytest.raises(ValueError, match="must look like dotted.key=value"):
        load_config(None, ["learner.total_steps"])
