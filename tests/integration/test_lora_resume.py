"""A LoRA run (``model.lora``) end to end: its learner publishes adapter-only versions, checkpoints
without the base, resumes from its checkpoint and trains every group once; the checkpointed step
exports as the final adapter. The generators are simulated (random tokens from the tiny model's
vocabulary), every other process is real."""

import json

import pytest
import torch

from asyncrl.cli import main
from asyncrl.models.tiny import CHAR_VOCAB_SIZE

pytestmark = pytest.mark.slow  # two whole runs with a DeepSpeed learner (~35 s)

LORA_RUN = [
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "learner.trainer.zero_stage=2",
    "learner.batch_groups=4",
    "model.warm_start=false",
    f"simulation.generator.vocab_size={CHAR_VOCAB_SIZE}",
    "run.num_generators=1",
    "eval.before=false",
    "eval.after=false",
    "run.console=quiet",
    "checkpoint.every_steps=5",
]


def test_lora_run_resumes_and_trains_each_group_once(tmp_path, capsys):
    from safetensors.torch import load_file

    overrides = [f"run.root={tmp_path}", "run.name=lora", "learner.total_steps=10", *LORA_RUN]
    assert main(["train", "configs/demo.yaml", *overrides]) == 0
    run_dir = tmp_path / "lora"
    policy = run_dir / "checkpoints" / "v00000010" / "learner" / "policy"
    base_bytes = (run_dir / "model" / "base" / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in policy.glob("*.pt")) < base_bytes / 2  # no base in it
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "learner.total_steps=20"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == 20 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0, summary["ledger"]
    assert summary["ledger"]["restores"] == 1
    versions = [json.loads(line)["version"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert versions == list(range(1, 21))

    # The checkpoint of the last step exports as the adapter the learner saved at the end.
    assert main(["export", str(run_dir), "--step", "20", str(tmp_path / "adapter")]) == 0
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    final = load_file(run_dir / "final" / "adapter" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(final) and all("lora_" in k for k in final)
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name
