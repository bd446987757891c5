"""collate + token_logprobs: position t of every (B, L-1) tensor is about input_ids[:, t+1]."""

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM  # noqa: F401  imported at collection, not charged to the first test (~4 s)

from asyncrl.learner.batch import collate, fully_masked, stale_samples, token_logprobs
from asyncrl.wire.schema import Group, Sample
from tests.factories import small_qwen2

PAD = 0


def make_group(gid, prompt, responses, version=0, rewards=None):
    samples = []
    for i, resp in enumerate(responses):
        # behaviour logprobs -(i+1).(j+1): distinct, so misalignment shows
        lps = np.array([-(i + 1) - 0.1 * (j + 1) for j in range(len(resp))], dtype=np.float32)
        reward = None if rewards is None else rewards[i]
        samples.append(Sample(f"{gid}/{i}", np.array(resp, dtype=np.int32), lps, "", "stop", reward))
    return Group(gid, gid, "t", "", "", np.array(prompt, dtype=np.int32), version, "gen", samples)


@pytest.fixture(scope="module")
def groups():
    return [
        make_group("a", [5, 6, 7], [[8, 9], [10, 11, 12, 13]], version=3),
        make_group("b", [14], [[15, 16, 17], []], version=1),  # one-token prompt, an empty answer
    ]


@pytest.fixture(scope="module")
def model():
    return small_qwen2(32).eval()


def test_collate_layout(groups):
    batch = collate(groups, [[0.5, -0.5], [2.0, -2.0]], pad_id=PAD)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 8, 9, PAD, PAD],
        [5, 6, 7, 10, 11, 12, 13],
        [14, 15, 16, 17, PAD, PAD, PAD],
        [14, PAD, PAD, PAD, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
    ]
    # position t predicts input_ids[t+1]: the first response token is predicted from the prompt's last
    assert batch.response_mask.tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    torch.testing.assert_close(
        batch.behaviour_logprobs,
        torch.tensor(
            [
                [0, 0, -1.1, -1.2, 0, 0],
                [0, 0, -2.1, -2.2, -2.3, -2.4],
                [-1.1, -1.2, -1.3, 0, 0, 0],
                [0, 0, 0, 0, 0, 0],
            ]
        ),
    )
    assert batch.advantages[:, 0].tolist() == [0.5, -0.5, 2.0, -2.0]
    assert (batch.advantages == batch.advantages[:, :1]).all()  # broadcast along the row
    assert batch.policy_version.tolist() == [3, 3, 1, 1]
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.num_tokens == 2 + 4 + 3


def test_slice_trims_columns_that_are_all_padding(groups):
    batch = collate(groups, [[0.5, -0.5], [2.0, -2.0]], pad_id=PAD)
    tail = batch.slice(2, 4)
    assert tail.input_ids.tolist() == [[14, 15, 16, 17], [14, PAD, PAD, PAD]]
    assert tail.response_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert tail.behaviour_logprobs.shape == (2, 3)


def test_token_logprobs_equal_a_manual_loop(groups, model):
    temperature = 0.7
    batch = collate(groups, [[0.0, 0.0], [0.0, 0.0]], pad_id=PAD)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = token_logprobs(logits, batch.input_ids, temperature)  # (B, L-1)
        assert got.shape == batch.response_mask.shape and got.dtype == torch.float32
        b = 0
        for group in groups:
            for sample in group.samples:
                P = len(group.prompt_ids)
                for j, token in enumerate(sample.response_ids.tolist()):
                    # unpadded prefix: prompt + response[:j], last position predicts response[j]
                    prefix = torch.tensor([group.prompt_ids.tolist() + sample.response_ids[:j].tolist()])
                    last = model(input_ids=prefix).logits[0, -1] / temperature
                    expected = torch.log_softmax(last, dim=-1)[token]
                    assert batch.response_mask[b, P - 1 + j] == 1
                    torch.testing.assert_close(got[b, P - 1 + j], expected, atol=1e-5, rtol=1e-5)
                b += 1


def test_token_logprobs_by_hand():
    # one sequence [2, 0]; logits at position 0 = [0, ln 3, 0] -> softmax [1/5, 3/5, 1/5]
    logits = torch.tensor([[[0.0, float(np.log(3.0)), 0.0], [9.0, 9.0, 9.0]]])
    out = token_logprobs(logits, torch.tensor([[2, 0]]))
    torch.testing.assert_close(out, torch.tensor([[float(np.log(1 / 5))]]))
    # temperature 0.5 doubles the logits: [0, ln 9, 0] -> p(0) = 1/11
    out = token_logprobs(logits, torch.tensor([[2, 0]]), temperature=0.5)
    torch.testing.assert_close(out, torch.tensor([[float(np.log(1 / 11))]]))


def test_collate_errors_name_the_problem(groups):
    with pytest.raises(ValueError, match="one per group"):
        collate(groups, [[0.0, 0.0]], pad_id=PAD)
    with pytest.raises(ValueError, match=r"group b: advantages row has 1 entries, must have one per sample \(2\)"):
        collate(groups, [[0.0, 0.0], [0.0]], pad_id=PAD)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        collate([make_group("c", [], [[1]])], [[0.0]], pad_id=PAD)
    with pytest.raises(ValueError, match=r"temperature \(0.0\) must be > 0"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)


def test_each_token_carries_the_version_that_sampled_it():
    """A sample spanning an update: its segments become per-token versions, aligned with the
    response mask; the row's policy_version is its oldest token's, not the group's."""
    group = make_group("s", [5, 6], [[8, 9, 10, 11], [12, 13]], version=2)
    group.samples[0].version_segments = [[0, 2], [1, 3], [3, 5]]
    group.samples[1].version_segments = [[0, 4]]  # began after a swap: younger than its group
    batch = collate([group], [[0.0, 0.0]], pad_id=PAD)
    in_response = batch.response_mask > 0
    assert batch.behaviour_version[0][in_response[0]].tolist() == [2, 3, 3, 5]
    assert batch.behaviour_version[1][in_response[1]].tolist() == [4, 4]
    assert batch.policy_version.tolist() == [2, 4]
    assert batch.slice(1, 2).behaviour_version.tolist() == [[4, 4, 4]]


def test_tokens_before_trained_from_stay_as_context_out_of_the_loss():
    group = make_group("m", [5, 6], [[8, 9, 10, 11], [12, 13], [14]], version=2)
    group.samples[0].version_segments = [[0, 2], [2, 4]]
    group.samples[0].trained_from = 2  # version 2 past the bound: its two tokens are context
    group.samples[1].trained_from = 2  # every token past it
    batch = collate([group], [[0.0, 0.0, 0.0]], pad_id=PAD)
    assert batch.input_ids[0].tolist() == [5, 6, 8, 9, 10, 11]  # still in the sequence
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert batch.policy_version.tolist() == [4, 2, 2]  # from the oldest trained token
    assert stale_samples(group) == ["m/1"] and fully_masked([group]).tolist() == [False, True, False]
