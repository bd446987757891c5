"""An agent program that knows nothing of asyncrl (tests/fixtures/agents/arithmetic_agent.py: the
standard library's urllib and the gateway's URL) is trained through the OpenAI-compatible gateway
on the demo's task: real vLLM generators serve its calls, its posted rewards score its episodes,
the learner trains what the gateway recorded, and every episode is accounted for by id."""

import ast
import json
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.slow  # a whole run of real processes: vLLM, DeepSpeed, agent programs

AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "arithmetic_agent.py"


def test_the_agent_imports_nothing_of_asyncrl():
    tree = ast.parse(AGENT.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and all(name.split(".")[0] in sys.stdlib_module_names for name in names), names


def test_an_agent_program_trains_through_the_gateway(tmp_path):
    overrides = [
        f"run.root={tmp_path}",
        "run.name=agent",
        "run.console=quiet",
        "run.num_generators=1",
        "sft.steps=300",
        f"agent.command=[{sys.executable}, {AGENT}]",
        "agent.episode_timeout_s=60",
        "reward.rewards=[{kind: environment}]",
        "learner.total_steps=3",
        "learner.batch_groups=2",
        "sampling.n=4",
        "logging.samples_per_step=2",
        "eval.num_prompts=8",
        "eval.samples_k=0",
    ]
    assert main(["train", "configs/demo.yaml", *overrides]) == 0
    run = tmp_path / "agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["learner_steps"] == 3 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 4  # steps x groups a step x episodes a group (one call each: no split)
    # the rewards the agent posted, 1 for a right sum and 0 for a wrong one, through the environment reward
    assert all(s["reward_parts"].keys() == {"environment"} and s["reward"] in (0.0, 1.0) for s in samples)
    assert any(s["reward"] == 1.0 for s in samples)  # the warm-started model gets some sums right
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["before", "after"] and all(e["failed"] is None for e in evals), evals
    assert all(0 <= e["exact_match"] <= 1 for e in evals)
