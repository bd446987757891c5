"""PolicyTrainer with its optimizer state (and, at ZeRO-3, its parameters) offloaded
(``learner.trainer.offload``) on a tiny model: it trains like the plain-torch full-batch steps every
ZeRO stage must reproduce (``test_zero_stages``), and a checkpoint taken after one step resumes
into exactly the weights of the run that never stopped. All trainers share one gloo process group
in this process, as in ``test_zero_stages``.

On this CPU-only machine "offloaded" state is host memory either way, so these tests check the
bookkeeping (what DeepSpeed moves, partitions, swaps, saves and restores), not any speed.
"""

import pytest
import torch

from asyncrl.learner.offload import libaio_dir
from asyncrl.learner.trainer import PolicyTrainer
from tests.learner.trainer.steps import config

pytestmark = pytest.mark.slow  # DeepSpeed engines

NVME = dict(optimizer="nvme", params="nvme")


def offload_round_trip(model_dir, groups, reference_weights, tmp_path, stage, offload):
    """Two steps, a checkpoint after the first; a fresh trainer resumed from it takes the second."""
    cfg = config(stage, offload=offload)
    original = PolicyTrainer(model_dir, cfg)
    # the update runs on the CPU's copy (ZeRO-Offload); under nvme that copy is swapped to files
    assert original.engine.zero_use_cpu_optimizer() == (offload.get("optimizer", "none") != "none")
    assert original.engine.zero_nvme_offload_optimizer() == (offload.get("optimizer") == "nvme")
    if offload.get("optimizer_impl") == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert isinstance(original.engine.basic_optimizer, DeepSpeedCPUAdam)
    norms = [original.train_step(groups).grad_norm]
    original.save_state(tmp_path / "ckpt")
    norms.append(original.train_step(groups).grad_norm)
    uninterrupted = original.full_state_dict()

    # trains like no offload: the plain-torch steps, up to float reduction order
    weights, grad_norms = reference_weights
    assert norms == pytest.approx(grad_norms, rel=1e-4)
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)

    resumed = PolicyTrainer(model_dir, cfg)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.version == 1 and resumed.updates == 1
    assert resumed.train_step(groups).grad_norm == norms[1]
    for name, tensor in resumed.full_state_dict().items():
        assert torch.equal(tensor, uninterrupted[name]), name


@pytest.mark.parametrize(
    "stage, offload",
    [
        (2, dict(optimizer="cpu")),
        (3, dict(optimizer="cpu")),
        (3, dict(optimizer="cpu", params="cpu")),
        (2, dict(optimizer="cpu", optimizer_impl="deepspeed_cpu_adam")),
    ],
    ids=["zero2-optimizer", "zero3-optimizer", "zero3-optimizer-params", "zero2-deepspeed-cpu-adam"],
)
def test_cpu_offload_trains_like_no_offload_and_resumes_bit_for_bit(
    stage, offload, model_dir, groups, reference_weights, tmp_path
):
    """DeepSpeed's CPU Adam (its op compiled by scripts/setup.sh, else here on first use) rounds
    otherwise than torch's AdamW, within the same tolerance."""
    offload_round_trip(model_dir, groups, reference_weights, tmp_path, stage, offload)


@pytest.mark.skipif(libaio_dir() is None, reason="no libaio unpacked in .tools/libaio (scripts/setup.sh)")
def test_nvme_offload_trains_like_no_offload_and_resumes_bit_for_bit(tmp_path):
    """ZeRO-Infinity: optimizer state and parameters swapped to files (here on the local disk).
    The model is larger than the others here (0.5 M parameters): DeepSpeed swaps only tensors of
    at least its 1 MiB I/O block, and keeps smaller ones in memory. The checkpoint carries the
    swapped optimizer state; each engine swaps into a folder of its own."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
    from tests.learner.trainer.steps import make_groups

    model_dir = build_tiny_model(TinyModelConfig(hidden_size=128, num_layers=2), tmp_path / "model")
    groups = make_groups(AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size)
    plain = PolicyTrainer(model_dir, config(3))
    norms = [plain.train_step(groups).grad_norm for _ in range(2)]
    weights = plain.full_state_dict()

    swap = tmp_path / "nvme"
    cfg = config(3, offload=dict(NVME, nvme_path=str(swap)))
    original = PolicyTrainer(model_dir, cfg)
    assert original.engine.zero_nvme_offload_optimizer() and original.engine.optimizer._swappable_optimizer_subgroup(0)
    offloaded_norms = [original.train_step(groups).grad_norm]
    original.save_state(tmp_path / "ckpt")
    offloaded_norms.append(original.train_step(groups).grad_norm)
    uninterrupted = original.full_state_dict()
    assert offloaded_norms == pytest.approx(norms, rel=1e-4)
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)
    assert any((tmp_path / "ckpt" / "policy" / "offloaded_tensors").rglob("*exp_avg*"))  # the moments, swapped

    resumed = PolicyTrainer(model_dir, cfg)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.train_step(groups).grad_norm == offloaded_norms[1]
    for name, tensor in resumed.full_state_dict().items():
        assert torch.equal(tensor, uninterrupted[name]), name
    # a folder of its own for each DeepSpeed config made: the partitioned build's (zero.Init) and the
    # engine's, of the original and of the resumed trainer
    folders = list(swap.iterdir())
    assert len(folders) == 4 and all(f.name.startswith("asyncrl-policy-") for f in folders)


@pytest.mark.skipif(libaio_dir() is None, reason="no libaio unpacked in .tools/libaio (scripts/setup.sh)")
def test_nvme_parameters_leave_in_gathers_the_swapper_can_hold(tmp_path):
    """DeepSpeed reads each NVMe-swapped parameter of a gather into a buffer of its own (5 of
    them) and fails a larger gather; the weights still leave in buckets of any size (publication,
    the final export), cut where the buffers run out, and the export equals the trainer's weights."""
    from safetensors.torch import load_file

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    shape = TinyModelConfig(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1024)
    model_dir = build_tiny_model(shape, tmp_path / "model")
    # max_in_cpu_params 1: no host copy, every parameter of at least DeepSpeed's 1 MiB block on NVMe
    cfg = config(3, offload=dict(NVME, nvme_path=str(tmp_path / "nvme"), max_in_cpu_params=1))
    trainer = PolicyTrainer(model_dir, cfg)
    swapped = [p for p in trainer.engine.module.parameters() if getattr(p.ds_tensor, "final_location", None) == "nvme"]
    assert len(swapped) > 5  # more than one gather can hold
    names = [[name for name, _ in bucket] for bucket in trainer.weight_buckets(1 << 30)]  # one bucket planned
    assert len(names) > 1 and sum(len(n) for n in names) == len(list(trainer.engine.module.named_parameters()))
    weights = trainer.full_state_dict()
    exported = load_file(str(trainer.save_pretrained(tmp_path / "final") / "model.safetensors"))
    tied = {"lm_head.weight"} if trainer.hf_config.tie_word_embeddings else set()  # stored once
    assert set(exported) == set(weights) - tied
    for name, tensor in exported.items():
        assert torch.equal(tensor, weights[name]), name
    trainer.close()
