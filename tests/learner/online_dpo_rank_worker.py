"""One learner rank of online DPO's data-parallel equality test (``test_online_dpo_ranks.py``).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.learner.online_dpo_rank_worker MODEL_DIR OUT_DIR CASE [CASE ...]

As ``rank_worker``, for ``algorithm.objective: online_dpo``: two steps on the same ragged batch
(``rank_worker.ragged_groups``: 5 groups, so two ranks get 3 and 2), rank 0 saving the weights
and the step's figures to ``OUT_DIR/CASE.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.learner.rank_worker import ragged_groups  # noqa: E402

torch.set_num_threads(1)

FIGURES = ("loss", "tokens", "sequences", "grad_norm", "dpo_pairs", "dpo_accuracy", "dpo_margin", "dpo_chosen_reward")
"""Step figures that must agree between one rank and two (each the whole batch's)."""

CASES: dict[str, tuple[int, dict, dict, int, int]] = {
    "z2-sigmoid": (2, {}, {"beta": 0.5}, 1, 1),
    "z3-ipo-all-epochs-minis": (3, {}, {"beta": 0.5, "loss_type": "ipo", "pairs": "all"}, 2, 2),
    "z2-packed-hinge-nll": (2, {"micro_batch_tokens": 40}, {"beta": 0.5, "loss_type": "hinge", "nll_coef": 0.5}, 1, 1),
}
"""Case name -> (ZeRO stage, trainer overrides, ``algorithm.dpo``, ppo_epochs, mini_batches)."""


def run_case(model_dir: Path, out_dir: Path, case: str) -> None:
    from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer

    stage, trainer_overrides, dpo, epochs, minis = CASES[case]
    cfg = TrainerConfig(zero_stage=stage, lr=1e-3, grad_clip=0.5, micro_batch_size=3, **trainer_overrides)
    algo = AlgorithmConfig(objective="online_dpo", dpo=dpo)
    trainer = PolicyTrainer(model_dir, cfg, algo, ppo_epochs=epochs, mini_batches=minis)
    groups = ragged_groups(trainer.hf_config.vocab_size)
    for _ in range(2):
        stats = trainer.train_step(groups)
    state = trainer.full_state_dict(rank0_only=True)  # collective under ZeRO-3
    if trainer.dp.rank == 0:
        figures = {name: getattr(stats, name) for name in FIGURES if getattr(stats, name) is not None}
        torch.save({"state": state, "figures": figures, "world": trainer.dp.world}, out_dir / f"{case}.pt")


def main(argv: list[str]) -> int:
    model_dir, out_dir, *cases = argv
    for case in cases:
        run_case(Path(model_dir), Path(out_dir), case)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
