"""The reference's logprobs and the critic's values on packed rows equal those on padded rows.

Each runs the policy's micro batches (``plan_micro_batches`` with ``micro_batch_tokens``), its
forward on sequences packed several to a row, the results moved back to the padded layout. The
two layouts differ only in the order of float32 sums inside attention, so they must agree to
float32 rounding of the values' own size (``TOL`` times their largest magnitude); each test also
checks that the packed forward really ran on fewer rows than sequences.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.learner.config import CriticConfig  # noqa: E402
from asyncrl.learner.critic import CriticTrainer, token_rewards  # noqa: E402
from asyncrl.learner.logprobs import TokenDistribution  # noqa: E402
from asyncrl.learner.packing import plan_micro_batches  # noqa: E402
from asyncrl.learner.reference import ColocatedReference, RemoteReference, answer, micro_logprobs  # noqa: E402
from asyncrl.learner.trainer_config import TrainerConfig  # noqa: E402
from asyncrl.wire import codec  # noqa: E402
from tests.learner.trainer.steps import make_groups  # noqa: E402

TOL = 1e-5
"""float32 rounding, relative to the largest value compared (a few ulps of a sum over 64 wide rows)."""
TOKENS = 24
"""The micro batches' token budget: two or three sequences to a row of the longest's length."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), tmp_path_factory.mktemp("tiny")
    )


@pytest.fixture(scope="module")
def batch(model_dir):
    from transformers import AutoConfig

    groups = make_groups(AutoConfig.from_pretrained(model_dir).vocab_size)
    return collate(groups, [np.zeros(len(g.samples), np.float32) for g in groups], pad_id=0)


def plans(batch, micro_batch_tokens):
    return plan_micro_batches(batch.attention_mask.sum(dim=1).tolist(), 5, micro_batch_tokens)


def close(packed: torch.Tensor, padded: torch.Tensor) -> None:
    torch.testing.assert_close(packed, padded, rtol=0, atol=TOL * float(padded.abs().max()))


def rows_seen(model: torch.nn.Module) -> list[int]:
    """The rows of every forward ``model`` runs from now on."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)
    return seen


def scored(reference, batch, micro_batch_tokens, dist):
    out = torch.zeros_like(batch.behaviour_logprobs)
    for plan in plans(batch, micro_batch_tokens):
        micro = batch.slice(plan.lo, plan.hi)
        lp = micro_logprobs(reference, micro, plan, 0, dist)  # (b, l-1)
        out[plan.lo : plan.hi, : lp.shape[1]] = lp
    return out


class LoopbackClient:
    """The reference process's side in this process: each request through the codec, both ways."""

    def __init__(self, reference: ColocatedReference):
        self.reference = reference

    def request(self, message, timeout):
        _, body = codec.decode(codec.encode(message))
        body.check()
        return None, codec.decode(codec.encode(answer(self.reference, body)))[1]


def test_reference_logprobs_on_packed_rows_equal_the_padded_ones(model_dir, batch):
    reference = ColocatedReference(str(model_dir), torch.device("cpu"), chunk_tokens=7)
    rows = rows_seen(reference.model)
    dist = TokenDistribution(temperature=0.7, top_k=5)
    padded = scored(reference, batch, None, dist)
    assert sum(rows) == len(batch)
    rows.clear()
    packed = scored(reference, batch, TOKENS, dist)
    assert sum(rows) < len(batch)  # several sequences to a row
    assert (packed != 0).sum() == (padded != 0).sum() == batch.response_mask.sum()
    close(packed, padded)

    # in its own process: the packed rows and their positions travel, the answer comes back padded
    remote = RemoteReference.__new__(RemoteReference)
    remote.client, remote.timeout_s = LoopbackClient(reference), 1.0
    close(scored(remote, batch, TOKENS, dist), padded)


def test_the_lora_reference_on_packed_rows_equals_the_padded_one(model_dir, batch):
    """With LoRA the reference is the policy's own base, its adapter off (``AdapterOffReference``)."""
    from asyncrl.learner.adapter import AdapterOffReference
    from asyncrl.learner.reference import load_frozen_model
    from asyncrl.models.lora import LoraConfig, apply_lora

    model = apply_lora(load_frozen_model(str(model_dir), torch.device("cpu"), torch.float32), LoraConfig(rank=4))
    for name, p in model.named_parameters():  # B starts at 0; a nonzero adapter shows it is off
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    reference = AdapterOffReference(model.train(), chunk_tokens=7)
    dist = TokenDistribution()
    padded = scored(reference, batch, None, dist)
    close(scored(reference, batch, TOKENS, dist), padded)
    base = ColocatedReference(str(model_dir), torch.device("cpu"))
    close(padded, scored(base, batch, None, dist))
    assert model.training  # back in the mode it was in


def test_a_packed_request_with_positions_of_another_shape_is_rejected():
    from asyncrl.wire.messages import WantRefLogprobs
    from asyncrl.wire.schema import WireError

    ids = np.zeros((2, 6), np.int32)
    request = WantRefLogprobs(
        input_ids=ids, attention_mask=ids, score_mask=ids[:, 1:], temperature=1.0, top_k=0, top_p=1.0
    )
    request.check()  # padded rows: no positions
    request.position_ids = np.zeros((2, 5), np.int32)
    with pytest.raises(WireError, match=r"position_ids shape \(2, 5\) is not input_ids' \(2, 6\)"):
        request.check()


@pytest.mark.slow  # DeepSpeed engines
def test_critic_values_and_its_step_on_packed_rows_equal_the_padded_ones(model_dir, batch):
    """Values from a value head that is not zero (it starts at zero, which would hide any layout
    error); then one critic step each way from the same start: the same advantages and figures."""

    def critic(micro_batch_tokens):
        trainer = CriticTrainer(
            model_dir, CriticConfig(lr=1e-3), TrainerConfig(micro_batch_size=5, micro_batch_tokens=micro_batch_tokens)
        )
        torch.manual_seed(1)
        torch.nn.init.normal_(trainer.engine.module.v_head.weight, std=0.5)
        return trainer

    def run(trainer, micro_batch_tokens):
        cut = plans(batch, micro_batch_tokens)
        micros = [batch.slice(p.lo, p.hi) for p in cut]
        with torch.no_grad():
            values = [trainer.values(m, p) for m, p in zip(micros, cut)]
        rewards = torch.arange(len(batch), dtype=torch.float32) % 3  # (B,)
        rewards_per_micro = [token_rewards(m, rewards[p.lo : p.hi]) for m, p in zip(micros, cut)]
        advantages, stats = trainer.advantages_and_step(
            micros, rewards_per_micro, [None] * len(cut), batch.num_tokens, plans=cut
        )
        out = torch.zeros_like(batch.behaviour_logprobs), torch.zeros_like(batch.behaviour_logprobs)
        for p, v, a in zip(cut, values, advantages):
            out[0][p.lo : p.hi, : v.shape[1]] = v * batch.response_mask[p.lo : p.hi, : v.shape[1]]
            out[1][p.lo : p.hi, : a.shape[1]] = a
        return out, stats

    (values, advantages), stats = run(critic(None), None)
    packed_critic = critic(TOKENS)
    rows = rows_seen(packed_critic.engine.module.backbone)
    (packed_values, packed_advantages), packed_stats = run(packed_critic, TOKENS)
    assert 0 < sum(rows) < 2 * len(batch)  # two passes (values, the step) on fewer rows than sequences
    assert float(values.abs().max()) > 0.1  # the values are not trivially 0
    close(packed_values, values)
    close(packed_advantages, advantages)
    assert packed_stats == pytest.approx(stats, rel=TOL, abs=1e-7)
