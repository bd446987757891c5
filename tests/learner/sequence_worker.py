"""One learner rank of the sequence-parallel equality test (``test_sequence_parallel.py``).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.learner.sequence_worker MODEL_ROOT OUT_DIR SEQUENCE_PARALLEL CASE [CASE ...]

For each case it builds a ``PolicyTrainer`` with the case's ZeRO stage, algorithm and
``sequence_parallel``, scores the whole ragged batch once (log-probabilities and entropies,
before any update), trains two steps on it, and rank 0 saves the scores, the weights after the
steps and the step's figures to ``OUT_DIR/CASE.pt``. One rank without sequence parallelism and
two ranks with ``sequence_parallel: 2`` must agree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from tests.learner.rank_worker import FIGURES, KL_LOSS, ragged_groups  # noqa: E402

CASES: dict[str, tuple[int, dict, dict, int, int]] = {
    "z2-token-mean": (2, {}, {}, 1, 1),
    # packed rows: the attention's mask is block-diagonal over the whole row, not causal alone
    "z2-packed-entropy": (2, {"micro_batch_tokens": 40}, {"entropy_coef": 0.01}, 1, 1),
    # per-sequence means over tokens of both shards; the reference scored by the group's first rank
    "z3-seq-mean-token-mean-kl": (3, {}, {"loss_agg_mode": "seq-mean-token-mean", **KL_LOSS}, 1, 1),
    # a sequence-level ratio over both shards' tokens; pi_prox's own forward; four updates
    "z1-gspo-epochs-minis": (1, {}, {"policy_loss": "gspo"}, 2, 2),
    # the backward recomputes the attention, exchanging shards again
    "z0-checkpointing": (0, {"gradient_checkpointing": True}, {}, 1, 1),
    # ZeRO-3 partitions the wide model's LM head (131,072 elements, above DeepSpeed's persistence
    # threshold of 1e5) and gathers it per call: with 4 tokens per call the shards need different
    # numbers of calls, which the ranks must still make equally often
    "z3-partitioned-head": (3, {"logits_chunk_tokens": 4}, {}, 1, 1),
}
"""Case name -> (ZeRO stage, trainer overrides, algorithm overrides, ppo_epochs, mini_batches)."""

WIDE_VOCAB = {"z3-partitioned-head"}
"""Cases run on the model with a 4,096-token vocabulary (``MODEL_ROOT/wide``), the others on ``MODEL_ROOT/tiny``."""


def run_case(model_root: Path, out_dir: Path, sequence_parallel: int, case: str) -> None:
    from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer

    stage, trainer_overrides, algo_overrides, epochs, minis = CASES[case]
    cfg = TrainerConfig(zero_stage=stage, lr=1e-3, grad_clip=0.5, micro_batch_size=3, **trainer_overrides)
    algo = AlgorithmConfig(clip_low=0.05, clip_high=0.05, **algo_overrides)  # narrow: some tokens clip
    model_dir = model_root / ("wide" if case in WIDE_VOCAB else "tiny")
    trainer = PolicyTrainer(
        model_dir, cfg, algo, ppo_epochs=epochs, mini_batches=minis, sequence_parallel=sequence_parallel
    )
    groups = ragged_groups(trainer.hf_config.vocab_size)
    batch = trainer.train_batch(groups)
    with torch.no_grad():
        scores = trainer.score(batch.to(trainer.device), entropy=True)
    for _ in range(2):
        stats = trainer.train_step(groups)
    state = trainer.full_state_dict(rank0_only=True)  # collective under ZeRO-3
    if trainer.dp.rank == 0:
        figures = {name: getattr(stats, name) for name in FIGURES if getattr(stats, name) is not None}
        torch.save(
            {
                "state": state,
                "figures": figures,
                "logprobs": scores.logprobs.cpu(),
                "entropy": scores.entropy.cpu(),
                "mask": batch.response_mask,
                "world": trainer.dp.world,
                "sequence_parallel": trainer.dp.seq_world,
            },
            out_dir / f"{case}.pt",
        )


def main(argv: list[str]) -> int:
    model_root, out_dir, sequence_parallel, *cases = argv
    for case in cases:
        run_case(Path(model_root), Path(out_dir), int(sequence_parallel), case)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
