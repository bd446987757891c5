"""The learner's ZeRO-3 section (``learner.trainer.zero3``, ``Zero3Config``): how many of the
partitioned parameters a rank gathers ahead of use and keeps gathered. Declarations only, beside
``trainer_config.py`` (which imports it); it imports only configbase.

The keys are DeepSpeed's ``zero_optimization.stage3_*`` (ZeRO, Rajbhandari et al. 2020, §5.3),
written by ``asyncrl.learner.deepspeed_setup.deepspeed_config`` when ``zero_stage`` is 3. Their
defaults are DeepSpeed's, sized for a GPU's memory: with 1e9 elements live and a reuse distance
of 1e9, a model under a billion parameters stays gathered whole through the step (4 GB in fp32),
which on one host's memory costs what partitioning saved (``docs/reference/memory.md``).
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Config


class Zero3Config(Config):
    """What ZeRO-3 gathers and keeps gathered (``stage3_*`` of DeepSpeed's config)."""

    prefetch_elements: int = Field(50_000_000, ge=0)
    """Elements gathered ahead of the module about to run (``stage3_prefetch_bucket_size``;
    DeepSpeed's 5e7); 0 gathers each module only when it runs."""
    max_live_elements: int = Field(1_000_000_000, ge=1)
    """Most gathered elements a rank holds at once before it releases what it can
    (``stage3_max_live_parameters``; DeepSpeed's 1e9)."""
    max_reuse_elements: int = Field(1_000_000_000, ge=0)
    """A parameter used again within this many elements of other parameters stays gathered
    (``stage3_max_reuse_distance``; DeepSpeed's 1e9). With gradient checkpointing each block is
    used again in the backward's recomputation: a distance below one block's size releases it."""
    persistence_threshold: int = Field(100_000, ge=0)
    """Parameters of at most this many elements are kept whole on every rank, never partitioned
    (``stage3_param_persistence_threshold``; DeepSpeed's 1e5: norms and biases)."""

    def deepspeed(self) -> dict:
        """The ``zero_optimization`` keys."""
        return {
            "stage3_prefetch_bucket_size": self.prefetch_elements,
            "stage3_max_live_parameters": self.max_live_elements,
            "stage3_max_reuse_distance": self.max_reuse_elements,
            "stage3_param_persistence_threshold": self.persistence_threshold,
        }
