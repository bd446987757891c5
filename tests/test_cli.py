import json

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
    assert "learner.total_steps=7  # Learner steps to train" in out
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


def subcommands():
    import argparse

    from asyncrl.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_command_documents_every_option_in_its_help(capsys):
    commands = subcommands()
    for name in ("train", "generator", "reward-worker", "bench", "export", "plot", "inspect", "show-config"):
        assert name in commands, name
    for name, parser in commands.items():
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare word runs
        for action in parser._actions:
            assert action.help, f"asyncrl {name}: {action.dest} has no help"
            assert " ".join(action.help.split()[:4]) in text, (name, action.dest)


def test_bench_pipeline_documents_its_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "pipeline", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in ("--engine", "--modes", "--out", "overrides"):
        assert option in out


@pytest.mark.parametrize(
    "override, expected",
    [
        ("learner.totl_steps=5", "config error: learner.totl_steps=5: unknown key"),
        (
            "learner.trainer.zero_stage=4",
            "config error: learner.trainer.zero_stage=4: zero_stage (4) must be 0, 1, 2 or 3",
        ),
        ("run.num_generators=0", "config error: run.num_generators=0: Input should be greater than or equal to 1"),
        (
            "run.console=fancy",
            "config error: run.console=\"fancy\": Input should be 'live', 'plain', 'quiet' or 'jsonl'",
        ),
        ("task.test_size=0", "config error: task.test_size=0: test_size (0) must be >= 1"),
    ],
)
def test_config_errors_name_the_key_the_value_and_the_rule(capsys, override, expected):
    assert main(["show-config", "configs/demo.yaml", override]) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_config_is_saved_resolved_in_the_run_directory(tmp_path):
    from asyncrl.config import load_run_config
    from asyncrl.controller.preparation import prepare_run_dir

    cfg = load_config("configs/demo.yaml", [f"run.root={tmp_path}", "run.name=saved", "learner.total_steps=7"])
    run_dir = prepare_run_dir(cfg)
    assert load_run_config(run_dir / "config.yaml") == cfg


@pytest.mark.slow  # a whole run of real processes
def test_train_jsonl_prints_only_json_lines(tmp_path, capsys):
    overrides = [f"run.root={tmp_path}", "run.console=jsonl", "learner.total_steps=3", "run.num_generators=1"]
    assert main(["train", "configs/bench_pipeline.yaml", *overrides]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["type"] for r in records] == ["step"] * 3 + ["summary"]
    assert [r["version"] for r in records[:3]] == [1, 2, 3]
    assert records[-1]["learner_steps"] == 3 and records[-1]["reconciles"]
    assert set(records[-1]) > {"generated", "trained", "staleness_hist"}
    assert records[2]["components"]["generator-0"].startswith(("serving v", "stopped"))
