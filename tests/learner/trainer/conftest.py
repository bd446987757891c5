"""The trainer tests' fixtures, module-scoped: each module builds its own tiny model, batch and
reference steps."""

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.losses import decoupled_ppo_loss
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
from tests.learner.trainer.steps import GRAD_CLIP, LR, make_groups


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), out)


@pytest.fixture(scope="module")
def hf_state(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def groups(hf_state):
    return make_groups(hf_state[0].config.vocab_size)


@pytest.fixture(scope="module")
def reference_weights(model_dir, groups):
    """Two plain-torch AdamW steps on the whole batch at once: what every stage must reproduce.

    Returns the weights after them and the two gradient norms (before clipping).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    grad_norms = []
    for _ in range(2):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)
        loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, batch.response_mask)
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grad_norms
