"""One learner rank of the data-parallel equality tests (``test_ranks.py``).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.learner.rank_worker MODEL_DIR OUT_DIR CASE [CASE ...]

For each case it builds a ``PolicyTrainer`` with the case's ZeRO stage and algorithm, trains two
steps on the same ragged batch (groups of uneven lengths, an odd number of them: the ranks' token
counts differ), and rank 0 saves the weights after them and the step's figures to
``OUT_DIR/CASE.pt``. Run with one rank and with two, the files must agree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

FIGURES = ("loss", "policy_loss", "clipfrac", "entropy", "tokens", "sequences", "grad_norm", "behaviour_kl")
"""Step figures that must agree between one rank and several (each the whole batch's)."""

CRITIC = {"adv_estimator": "gae", "critic": {"lr": 1e-3}}
KL_LOSS = {"kl": {"coef": 0.1, "use_in": "loss"}}
KL_REWARD = {"kl": {"coef": 0.1, "use_in": "reward"}}

CASES: dict[str, tuple[int, dict, dict, int, int]] = {}
"""Case name -> (ZeRO stage, trainer overrides, algorithm overrides, ppo_epochs, mini_batches)."""
PER_STAGE = {
    "token-mean": ({}, 1, 1),
    "ppo-critic": (CRITIC, 1, 1),  # the critic is a second engine, partitioned like the policy
    "epochs-minis": ({"entropy_coef": 0.01}, 2, 2),  # several optimizer steps, accumulation boundaries
}
"""What the ZeRO stage changes: how gradients, optimizer states and parameters are split over the
ranks, for each DeepSpeed engine (policy, critic) and across optimizer steps. These run at every
stage. The losses (aggregations, KL to the frozen reference, a plain module outside DeepSpeed
below ZeRO-3) are computed before the backward and do not depend on it: they run at stage 2, the
default, only; and the KL once at stage 3, where the reference is partitioned too."""
for _stage in (1, 2, 3):
    for _name, (_algo, _epochs, _minis) in PER_STAGE.items():
        CASES[f"z{_stage}-{_name}"] = (_stage, {}, _algo, _epochs, _minis)
CASES |= {
    "z2-kl-loss": (2, {}, KL_LOSS, 1, 1),
    "z2-seq-mean-token-sum": (2, {}, {"loss_agg_mode": "seq-mean-token-sum"}, 1, 1),
    "z2-seq-mean-token-mean": (2, {}, {"loss_agg_mode": "seq-mean-token-mean"}, 1, 1),
    "z2-seq-mean-token-sum-norm": (2, {}, {"loss_agg_mode": "seq-mean-token-sum-norm"}, 1, 1),
    "z2-kl-reward": (2, {}, KL_REWARD, 1, 1),
}
CASES |= {
    # the reference partitioned over the ranks (ZeRO-3): its forwards are collective, the ranks'
    # row counts differ, so the smaller share runs filler passes
    "z3-kl-loss": (3, {}, KL_LOSS, 1, 1),
    "z0-token-mean": (0, {}, {}, 1, 1),
    "z2-packed": (2, {"micro_batch_tokens": 40}, {}, 1, 1),
    # the reference's and the critic's forwards on the policy's packed rows, the critic's fillers too
    "z2-packed-critic-kl": (2, {"micro_batch_tokens": 40}, {**CRITIC, **KL_REWARD}, 1, 1),
    "z3-packed-critic-kl": (3, {"micro_batch_tokens": 40}, {**CRITIC, **KL_LOSS}, 1, 1),
    "z2-reinforce-pp": (2, {}, {"adv_estimator": "reinforce_pp"}, 1, 1),
    "z2-token-sum-kl-entropy": (2, {}, {"loss_agg_mode": "token-sum", "entropy_coef": 0.01, **KL_LOSS}, 1, 1),
    # the importance weights' mean is the whole mini-batch's, gathered from both ranks
    "z2-batch-normalised-is": (
        2,
        {},
        {
            "correction": "tis",
            "is_cap": 2.0,
            "is_batch_normalise": True,
            "rejection": "token_k3",
            "rejection_threshold": 0.02,
        },
        2,
        2,
    ),
}


def ragged_groups(vocab_size: int, num_groups: int = 5, group_size: int = 4, seed: int = 0):
    """``num_groups`` groups of ``group_size`` answers of 2 to 12 tokens, rewards never constant."""
    from asyncrl.wire.schema import Group, Sample

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for i in range(group_size):
            length = int(rng.integers(2, 13))
            samples.append(
                Sample(
                    uid=f"g{g}/{i}",
                    response_ids=rng.integers(3, vocab_size, size=length).astype(np.int32),
                    logprobs=(-np.log(vocab_size) + 0.3 * rng.standard_normal(length)).astype(np.float32),
                    text="",
                    finish_reason="stop",
                    reward=float(rng.random()),
                )
            )
        prompt = rng.integers(3, vocab_size, size=int(rng.integers(2, 6))).astype(np.int32)
        groups.append(Group(f"g{g}", f"p{g}", "t", "", "", prompt, 0, "gen", samples))
    return groups


def run_case(model_dir: Path, out_dir: Path, case: str) -> None:
    from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer

    stage, trainer_overrides, algo_overrides, epochs, minis = CASES[case]
    cfg = TrainerConfig(zero_stage=stage, lr=1e-3, grad_clip=0.5, micro_batch_size=3, **trainer_overrides)
    algo = AlgorithmConfig(clip_low=0.05, clip_high=0.05, **algo_overrides)  # narrow: some tokens clip
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
