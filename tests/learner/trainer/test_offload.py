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
    assert original.engine.zero_cpu_offload() == (offload.get("optimizer", "none") != "none")
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
    [(2, dict(optimizer="cpu")), (3, dict(optimizer="cpu")), (3, dict(optimizer="cpu", params="cpu"))],
    ids=["zero2-optimizer", "zero3-optimizer", "zero3-optimizer-params"],
)
def test_cpu_offload_trains_like_no_offload_and_resumes_bit_for_bit(
    stage, offload, model_dir, groups, reference_weights, tmp_path
):
    offload_round_trip(model_dir, groups, reference_weights, tmp_path, stage, offload)


@pytest.mark.skipif(libaio_dir() is None, reason="no libaio unpacked in .tools/libaio (scripts/setup.sh)")
def test_nvme_offload_trains_like_no_offload_and_resumes_bit_for_bit(model_dir, groups, reference_weights, tmp_path):
    """ZeRO-Infinity: optimizer state and parameters swapped to files (here on the local disk);
    the checkpoint carries the swapped optimizer state, and the swap folders are the engine's own."""
    swap = tmp_path / "nvme"
    offload_round_trip(model_dir, groups, reference_weights, tmp_path, 3, dict(NVME, nvme_path=str(swap)))
    assert len(list(swap.iterdir())) == 2  # one folder per engine: the original and the resumed one
    assert any((tmp_path / "ckpt" / "policy" / "offloaded_tensors").iterdir())
