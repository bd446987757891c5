"""A simulated learner: the ``PolicyTrainer`` interface with a timing model instead of DeepSpeed.

``MockTrainer.train_step`` sleeps for

    t = step_overhead_s + s_per_token · tokens in the batch

(tokens = prompt + response tokens of every sample), counts staleness exactly as the real
trainer does, and advances ``version``. Its off-policy signals (what ``buffer.max_staleness:
auto`` steers by) follow a model: a sample d versions stale has behaviour KL d · κ per token
(``behaviour_kl_per_version``), its log-weights are normal (then KL = σ²/2 and E[w²] = e^{2 KL}),
so the batch's ESS is 1 / mean over tokens of e^{2 KL}. ``full_state_dict`` is a buffer of
``weight_bytes`` so the weight path carries real-sized payloads, or, with ``weights_from``, a real model's tensors,
so that real vLLM generators load every broadcast (``asyncrl bench pipeline --engine vllm``). With ``MockEngine`` it lets the whole control plane
be benchmarked at any scale without a GPU.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from asyncrl.learner.config import MockTrainerConfig
from asyncrl.learner.data_parallel import DataParallel
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group, token_versions


class MockTrainer:
    """Simulated ``PolicyTrainer``: ``train_step``, ``version``, ``full_state_dict``, ``save_pretrained``."""

    def __init__(self, cfg: MockTrainerConfig):
        self.cfg = cfg
        self.dp = DataParallel()  # one rank: simulated learners are not data-parallel
        self.version = 0
        self._tensors: dict | None = None

    def step_seconds(self, tokens: int) -> float:
        return self.cfg.step_overhead_s + self.cfg.s_per_token * tokens

    def train_step(self, groups: list[Group], weights=None) -> StepStats:
        """Sleep for the timing model's time for the batch (its prompt and response tokens); the
        stats count the response tokens, as the real trainer's do."""
        start = time.perf_counter()
        tokens = sum(len(g.prompt_ids) * len(g.samples) + g.num_tokens for g in groups)
        staleness, lengths, token_lags = [], [], Counter()
        for g in groups:
            for s in g.samples:  # from the oldest trained token, as the real trainer counts
                versions = token_versions(s, g.policy_version)[s.trained_from :]
                if len(s.response_ids) and not len(versions):
                    continue  # no token within the staleness bound: dropped, not trained
                staleness.append(self.version - (int(versions.min()) if len(versions) else g.policy_version))
                lengths.append(len(versions))
                token_lags.update((self.version - versions).tolist())
        time.sleep(self.step_seconds(tokens))
        self.version += 1
        rewards = [s.reward for g in groups for s in g.samples]
        return StepStats(
            **self.signals(lengths, staleness),
            version=self.version,
            loss=0.0,
            staleness=staleness,
            token_staleness=dict(token_lags),
            stale_tokens_masked=sum(s.trained_from for g in groups for s in g.samples),
            stale_samples_masked=sum(0 < len(s.response_ids) <= s.trained_from for g in groups for s in g.samples),
            staleness_mean=float(np.mean(staleness)) if staleness else float("nan"),
            staleness_max=int(max(staleness, default=0)),
            reward=float(np.mean(rewards)),
            tokens=sum(g.num_tokens for g in groups),
            step_s=time.perf_counter() - start,
        )

    def signals(self, lengths: list[int], staleness: list[int]) -> dict:
        """The modelled ``behaviour_kl_by_staleness`` and ``behaviour_ess`` of a batch (see the
        module docstring) from each trained sample's tokens in the loss and staleness,
        token-weighted."""
        tokens = np.array(lengths, dtype=np.float64)
        kl = self.cfg.behaviour_kl_per_version * np.asarray(staleness, dtype=np.float64)
        ess = float(tokens.sum() / max(float((tokens * np.exp(2 * kl)).sum()), 1e-12))
        return {
            "behaviour_ess": ess,
            "behaviour_kl_by_staleness": {d: self.cfg.behaviour_kl_per_version * d for d in sorted(set(staleness))},
        }

    def full_state_dict(self) -> dict:
        import torch

        if self.cfg.weights_from is None:
            return {"weights": torch.zeros(self.cfg.weight_bytes // 4, dtype=torch.float32)}
        if self._tensors is None:  # read once: the simulated policy never changes
            from safetensors.torch import load_file

            self._tensors = {}
            for path in sorted(Path(self.cfg.weights_from).glob("*.safetensors")):
                self._tensors.update(load_file(str(path)))
            if not self._tensors:
                raise ValueError(f"weights_from ({self.cfg.weights_from}) holds no *.safetensors file")
        return self._tensors

    def weight_buckets(self, bucket_bytes: int):
        from asyncrl.weights.buckets import state_dict_buckets

        return state_dict_buckets(self.full_state_dict(), bucket_bytes)

    def probe(self, max_len: int | None = None) -> None:
        """A simulated learner has no model to probe."""
        return None

    def save_state(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mock_trainer.json").write_text(json.dumps({"version": self.version}))

    def load_state(self, in_dir: str | Path) -> None:
        self.version = int(json.loads((Path(in_dir) / "mock_trainer.json").read_text())["version"])

    def save_pretrained(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "SIMULATED").write_text("a simulated learner has no model to save\n")
        return out
