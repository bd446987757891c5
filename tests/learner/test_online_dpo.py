"""Online DPO's pairs and its config: pair selection by hand, the pair batch, the refusals."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from asyncrl.config import RunConfig, dump_config, load_run_config
from asyncrl.learner.config import AlgorithmConfig, OnlineDPOConfig
from asyncrl.learner.online_dpo import pair_batch, select_pairs, sequence_logprobs
from tests.factories import make_group


def test_best_against_worst_first_of_ties():
    assert select_pairs(np.array([0.5, 1.0, 0.0, 1.0, 0.0])) == [(1, 2)]


def test_a_group_scored_alike_gives_no_pair():
    assert select_pairs(np.array([1.0, 1.0, 1.0, 1.0])) == []
    assert select_pairs(np.array([0.0, 0.0])) == []


def test_all_pairs_every_best_against_every_worst():
    assert select_pairs(np.array([1.0, 0.0, 0.5, 1.0, 0.0]), "all") == [(0, 1), (0, 4), (3, 1), (3, 4)]


def test_min_reward_gap_treats_near_ties_as_ties():
    assert select_pairs(np.array([0.1, 0.0]), min_reward_gap=0.1) == []
    assert select_pairs(np.array([0.2, 0.0]), min_reward_gap=0.1) == [(0, 1)]


def test_only_eligible_answers_are_paired():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    assert select_pairs(rewards, eligible=np.array([False, True, True, True])) == [(3, 1)]
    assert select_pairs(rewards, eligible=np.array([True, False, False, False])) == []


def test_pair_batch_keeps_the_paired_answers_and_counts_groups_without_one():
    groups = [
        make_group("a", n=4, rewards=[0.0, 1.0, 1.0, 0.0]),
        make_group("b", n=4, rewards=[1.0, 1.0, 1.0, 1.0]),
        make_group("c", n=3, rewards=[0.0, 0.5, 1.0]),
    ]
    rewards = [np.array([s.reward for s in g.samples]) for g in groups]
    eligible = [np.ones(len(g.samples), bool) for g in groups]
    out = pair_batch(groups, rewards, eligible, OnlineDPOConfig(), weights=[1.0, 0.5, 2.0])
    assert out.unpaired == 1
    assert [g.group_id for g in out.groups] == ["a", "c"]
    assert [[s.uid for s in g.samples] for g in out.groups] == [["a/1", "a/0"], ["c/2", "c/0"]]
    assert out.pairs == [[(0, 1)], [(0, 1)]]
    assert out.weights == [1.0, 2.0]
    every = pair_batch(groups, rewards, eligible, OnlineDPOConfig(pairs="all"))
    assert [[s.uid for s in g.samples] for g in every.groups][0] == ["a/1", "a/2", "a/0", "a/3"]
    assert every.pairs[0] == [(0, 2), (0, 3), (1, 2), (1, 3)]


def test_sequence_logprobs_sum_or_mean_over_the_mask():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert sequence_logprobs(lp, mask, False).tolist() == [-5.0, -4.0]
    assert sequence_logprobs(lp, mask, True).tolist() == [-2.5, -4.0]


def test_length_normalise_defaults_to_ipo_only():
    assert OnlineDPOConfig(loss_type="ipo").normalise
    assert not OnlineDPOConfig().normalise
    assert OnlineDPOConfig(length_normalise=True).normalise


@pytest.mark.parametrize(
    "settings, names",
    [
        (dict(objective="online_dpo", policy_loss="gspo"), ("algorithm.policy_loss", "online_dpo")),
        (dict(objective="online_dpo", correction="tis"), ("algorithm.correction", "online_dpo")),
        (dict(objective="online_dpo", adv_estimator="gae"), ("gae", "online_dpo")),
        (dict(objective="online_dpo", critic={"lr": 1e-4}), ("algorithm.critic", "online_dpo")),
        (dict(objective="online_dpo", kl={"coef": 0.1}), ("algorithm.kl.coef", "online_dpo")),
        (dict(objective="online_dpo", entropy_coef=0.01), ("algorithm.entropy_coef", "online_dpo")),
        (dict(dpo={"beta": 0.2}), ("algorithm.dpo", "policy_gradient")),
        (
            dict(objective="online_dpo", dpo={"loss_type": "ipo", "label_smoothing": 0.1}),
            ("algorithm.dpo.label_smoothing", "ipo"),
        ),
        (dict(objective="online_dpo", dpo={"beta": 0.0}), ("beta",)),
    ],
)
def test_bad_combinations_are_refused_naming_both_keys(settings, names):
    with pytest.raises(ValidationError) as err:
        AlgorithmConfig(**settings)
    error = err.value.errors()[0]
    message = f"{'.'.join(map(str, error['loc']))}: {error['msg']}"  # not the input, which pydantic echoes
    for name in names:
        assert name in message


def test_online_dpo_uses_the_reference_without_a_kl_term():
    algo = AlgorithmConfig(objective="online_dpo", kl={"reference": "process"})
    assert algo.uses_reference and not algo.kl.enabled
    assert not AlgorithmConfig().uses_reference


def test_run_refusals_need_a_group_and_a_numeric_staleness_bound():
    with pytest.raises(ValidationError, match="sampling.n >= 2"):
        RunConfig(algorithm={"objective": "online_dpo"}, sampling={"n": 1})
    with pytest.raises(ValidationError, match="buffer.max_staleness 'auto'.*online_dpo"):
        RunConfig(algorithm={"objective": "online_dpo"}, buffer={"max_staleness": "auto"})
    assert RunConfig(algorithm={"objective": "online_dpo"}).algorithm.dpo.beta == 0.1


@pytest.mark.parametrize("algorithm", [{"objective": "online_dpo", "dpo": {"beta": 0.2}}, {}])
def test_the_resolved_config_loads_back(algorithm, tmp_path):
    """The run directory's config.yaml spells out every key, defaults included: it must load back
    (the processes read it), with online DPO and without."""
    cfg = RunConfig(algorithm=algorithm)
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_run_config(tmp_path / "config.yaml").algorithm == cfg.algorithm
