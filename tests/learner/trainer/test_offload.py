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
