"""Multi-turn episodes through the whole pipeline (configs/guess_number.yaml, the demo-sized model
untrained), under each scheduler: a real vLLM generator plays the guessing game turn by turn, the environment's reward
scores each episode, the learner trains on the model's tokens only, and every episode is
accounted for by id."""

import json

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.slow  # a whole run of real processes: vLLM, DeepSpeed


@pytest.mark.parametrize("mode", ["continuous", "batch"])
def test_episodes_are_sampled_scored_trained_and_reconciled(tmp_path, mode):
    overrides = [
        f"generator.mode={mode}",  # both schedulers run the same multi-turn rollout
        f"run.root={tmp_path}",
        "run.name=guess",
        "run.console=quiet",
        "model.warm_start=false",  # untrained weights: the pipeline, not the learning (bench/learn.py)
        "environment.max_turns=4",
        "learner.total_steps=3",
        "learner.batch_groups=2",
        "sampling.n=4",
        "logging.samples_per_step=2",
        "eval.num_prompts=8",
        "eval.samples_k=2",
        # Untrained weights seldom end a turn by themselves (a turn cut at max_tokens ends its
        # episode): every printable character ends one here, so episodes run several turns.
        f"sampling.stop_token_ids={list(range(3, 99))}",
        "sampling.include_stop_str_in_output=true",
    ]
    assert main(["train", "configs/guess_number.yaml", *overrides]) == 0
    run = tmp_path / "guess"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["learner_steps"] == 3 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 4  # steps x groups a step x episodes a group
    assert all(s["reward"] is not None and s["reward_parts"].keys() == {"environment"} for s in samples)
    # Untrained weights rarely guess right at once: most episodes take several turns, each turn
    # followed by the environment's answer, which is out of the loss.
    multi = [s for s in samples if s["turns"] > 1]
    assert len(multi) > len(samples) / 2 and all(s["masked_tokens"] >= 2 * (s["turns"] - 1) for s in multi)
    assert all(1 <= s["turns"] <= 4 and s["env_error"] is None for s in samples)
    # each episode is readable whole: the model's turns, the environment's answers marked
    assert all(s["transcript"].count("⟦") == s["turns"] - 1 for s in samples)
    assert main(["inspect", str(run), "--samples", "1"]) == 0
    # held-out rows played as episodes by the generators, greedy and sampled, scored by the environment
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["before", "after"], evals
    assert all(e["completed"] is not None and 0 <= e["exact_match"] <= 1 and e["failed"] is None for e in evals)
    assert all(e["rewards"] == {"guess_number": "environment"} and 0 <= e["pass_at_k"] <= 1 for e in evals)
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and all(s["loss"] == s["loss"] for s in steps)  # finite
