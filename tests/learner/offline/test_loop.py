"""The offline loop end to end on the tiny model: ZeRO stages, resume, DPO's reference, two ranks."""

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.cli import main

BASE = [
    "data.train=addition",
    "data.test_size=16",
    "data.max_train_rows=256",
    "training.batch_size=8",
    "learner.trainer.lr=1e-3",
    "learner.trainer.lr_warmup_steps=1",
    "learner.trainer.micro_batch_size=4",
    "eval.num_prompts=8",
    "eval.max_new_tokens=3",
    "logging.tensorboard=false",
    "logging.wandb='off'",
    "run.console=quiet",
]


def run(kind: str, tmp_path, name: str, *overrides: str) -> dict:
    """``asyncrl KIND`` on the recipe with the fast settings above, or ``--resume`` the run ``name``."""
    if overrides[:1] == ("--resume",):
        args = [kind, "--resume", str(tmp_path / name), *overrides[1:]]
    else:
        recipe = f"configs/{kind}_addition.yaml"
        args = [kind, recipe, *BASE, f"run.root={tmp_path}", f"run.name={name}", *overrides]
    assert main(args) == 0
    return json.loads((tmp_path / name / "summary.json").read_text())


def weights(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / name / "final" / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_checkpoints_and_exports(tmp_path, zero_stage):
    summary = run(
        "sft",
        tmp_path,
        f"z{zero_stage}",
        "training.steps=3",
        "checkpoint.every_steps=3",
        f"learner.trainer.zero_stage={zero_stage}",
        "learner.trainer.micro_batch_tokens=40",
    )
    assert summary["steps"] == 3 and summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    assert main(["export", str(tmp_path / f"z{zero_stage}"), "--step", "3", str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    final = weights(tmp_path, f"z{zero_stage}")
    assert all(torch.allclose(exported[k], final[k]) for k in final)


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    packed = ("learner.trainer.zero_stage=2", "learner.trainer.micro_batch_tokens=40", "checkpoint.every_steps=2")
    run("sft", tmp_path, "whole", "training.steps=4", *packed)
    run("sft", tmp_path, "split", "training.steps=2", *packed)
    resumed = run("sft", tmp_path, "split", "--resume", "training.steps=4")
    assert resumed["steps"] == 4 and resumed["before"] is None
    assert same(weights(tmp_path, "whole"), weights(tmp_path, "split"))
    lines = [json.loads(x) for x in (tmp_path / "split" / "offline_steps.jsonl").read_text().splitlines()]
    whole = [json.loads(x) for x in (tmp_path / "whole" / "offline_steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [x["loss"] for x in lines] == [x["loss"] for x in whole]


@pytest.mark.slow
def test_dpo_computes_its_reference_once_and_moves_the_margin(tmp_path):
    first = run("sft", tmp_path, "warm", "training.steps=3")
    assert first["after"]["eval_loss"] < first["before"]["eval_loss"]
    model = f"model.path={tmp_path / 'warm' / 'final'}"
    summary = run(
        "dpo", tmp_path, "dpo", model, "training.steps=8", "checkpoint.every_steps=4", "data.max_train_rows=8"
    )
    assert summary["before"]["eval_reward_margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference
    # Eight pairs, one batch, seen at every step: each step's figures (taken before its update)
    # show the margin the earlier steps opened on them.
    steps = [json.loads(line) for line in (tmp_path / "dpo" / "offline_steps.jsonl").read_text().splitlines()]
    assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["dpo_loss"] < steps[0]["dpo_loss"]
    cache = tmp_path / "dpo" / "reference_logprobs.json"
    written = cache.stat().st_mtime_ns
    run("dpo", tmp_path, "dpo", "--resume", "training.steps=9")
    assert cache.stat().st_mtime_ns == written  # read back, not computed again


@pytest.mark.slow
def test_two_ranks_train_the_same_model_as_one(tmp_path):
    common = ("training.steps=2", "learner.trainer.zero_stage=1", "eval.num_prompts=0")
    one = run("sft", tmp_path, "one", *common)
    two = run("sft", tmp_path, "two", *common, "training.ranks=2")
    assert two["steps"] == 2 and (tmp_path / "two" / "rank1.log").exists()
    # The ranks' gradients are summed in another order than one rank's: the same model up to
    # rounding, which Adam's first updates (about +-lr for every weight) may amplify to <= 2 lr.
    assert two["after"]["eval_loss"] == pytest.approx(one["after"]["eval_loss"], rel=1e-5)
    a, b = weights(tmp_path, "one"), weights(tmp_path, "two")
    assert all(torch.allclose(a[k], b[k], atol=2e-3) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_trains_adapters_only_resumes_and_exports_the_adapter(tmp_path, zero_stage):
    lora = (
        "model.lora.rank=8",
        "training.steps=2",
        "checkpoint.every_steps=2",
        f"learner.trainer.zero_stage={zero_stage}",
    )
    first = run("sft", tmp_path, "lora", *lora)
    assert first["after"]["eval_loss"] < first["before"]["eval_loss"]
    assert (tmp_path / "lora" / "final" / "adapter" / "adapter_config.json").exists()
    run("sft", tmp_path, "lora", "--resume", "training.steps=3")
    assert main(["export", str(tmp_path / "lora"), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_model_runs_the_configured_attention(tmp_path, monkeypatch):
    """learner.trainer.attn_implementation reaches the offline learner's model (and packs with eager)."""
    from transformers import AutoModelForCausalLM

    loaded, original = [], AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        model = original(*args, **kwargs)
        loaded.append(model.config._attn_implementation)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    overrides = (
        "training.steps=1",
        "learner.trainer.attn_implementation=eager",
        "learner.trainer.micro_batch_tokens=40",
    )
    summary = run("sft", tmp_path, "eager", *overrides)
    assert summary["steps"] == 1 and loaded == ["eager"]
