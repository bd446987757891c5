"""What the step's stages and the checkpoint's save and restore use of the policy trainer.

``PolicyTrainer`` (``asyncrl.learner.trainer``) composes the step's stages (``step``) and the
save and restore of its state (``checkpoint_io``); both take the trainer as their first argument.
They are typed by ``TrainerParts``, declared here below all three, not by ``PolicyTrainer``
itself: ``trainer`` imports ``step`` and ``checkpoint_io`` and neither imports ``trainer``
back, so the package has no import cycle, annotations included (``tests/test_layout.py``).

A ``PolicyTrainer`` is a ``TrainerParts`` by its attributes and two methods (structural typing:
it does not name this class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from asyncrl.learner.adapter import AdapterOffReference
    from asyncrl.learner.batch import TrainBatch
    from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
    from asyncrl.learner.critic import CriticTrainer
    from asyncrl.learner.data_parallel import DataParallel
    from asyncrl.learner.kl import AdaptiveKLController, FixedKLController
    from asyncrl.learner.logprobs import TokenDistribution, TokenScores
    from asyncrl.learner.packing import MicroBatchPlan
    from asyncrl.learner.reference import ColocatedReference, PartitionedReference, RemoteReference
    from asyncrl.learner.ulysses import SequenceParallel
    from asyncrl.models.lora import LoraConfig


class TrainerParts(Protocol):
    """The policy trainer's parts that a learner step and a checkpoint read and write."""

    cfg: TrainerConfig
    """The trainer's section of the config (``learner.trainer``)."""
    algo: AlgorithmConfig
    """What the step optimises (the run's ``algorithm`` section)."""
    dp: DataParallel
    """This rank's place in the learner's data-parallel group."""
    engine: Any
    """The policy's DeepSpeed engine."""
    device: torch.device
    """Where the engine's tensors live."""
    version: int
    """Learner steps taken: the policy version of the current weights."""
    updates: int
    """Optimizer updates taken: the index of the learning-rate schedule."""
    ppo_epochs: int
    """Passes over each batch."""
    mini_batches: int
    """Optimizer updates per pass."""
    pad_id: int
    """The token id that pads rows."""
    row_tokens: int | None
    """Token slots of a packed row, else None."""
    distribution: TokenDistribution
    """The generators' sampling distribution, which every token is scored under."""
    kl_controller: FixedKLController | AdaptiveKLController
    """The KL coefficient beta and its update."""
    critic: CriticTrainer | None
    """The value model's trainer (``gae``), else None."""
    reference: ColocatedReference | PartitionedReference | RemoteReference | AdapterOffReference | None
    """The frozen KL reference, else None."""
    lora: LoraConfig | None
    """The LoRA adapters' config; None: full fine-tuning."""
    sequence: SequenceParallel | None
    """This rank's sequence-parallel group (``asyncrl.learner.ulysses``); None: off."""

    def score(self, micro: TrainBatch, entropy: bool, plan: MicroBatchPlan | None = None) -> TokenScores:
        """pi_theta's log-probabilities (and entropy) of one micro batch's response tokens."""
        ...

    def optimizer_update(self) -> tuple[float, float]:
        """One optimizer update; its learning rate and the gradient norm before clipping."""
        ...
