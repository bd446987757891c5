"""Agent programs, real subprocesses knowing only a URL, play a group's episodes end to end
against a fake engine: a posted reward is the episode's; a program that exits without one is left
to the run's rewards; one that hangs, crashes or makes no call is unscored with the reason, never
a silent 0; and no process outlives its episode."""

from __future__ import annotations

import ast
import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.generators.config import AgentConfig
from asyncrl.generators.gateway.agent_rollout import AgentGroups
from asyncrl.generators.sampling import SamplingConfig
from tests.generators.gateway.conftest import fake_params

AGENTS = Path(__file__).resolve().parents[2] / "fixtures" / "agents"
ROW = {"text": "What is 2+3?\n", "columns": {"question": "2+3"}, "answer": "5"}


def play(engine, command: list[str], n: int = 1, timeout_s: float = 60.0, row=ROW):
    cfg = AgentConfig(command=[sys.executable, *command], episode_timeout_s=timeout_s)
    sampling = SamplingConfig(n=n, max_tokens=8)

    async def main():
        groups = AgentGroups(engine, cfg, sampling, 256, params=fake_params)
        try:
            prompt_ids = engine.tokenizer.encode(row["text"])
            return await asyncio.wait_for(groups.sample("g", row, prompt_ids, seed=5), 120), groups
        finally:
            await groups.close()

    return asyncio.run(main())


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Every pid is gone, allowing an orphan the time to be reaped by init."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_fixture_agents_import_nothing_but_the_standard_library():
    for path in AGENTS.glob("*.py"):
        modules = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules.add((node.module or "").split(".")[0])
        assert modules and modules <= set(sys.stdlib_module_names), (path.name, modules - set(sys.stdlib_module_names))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--chat"]])
def test_a_posted_reward_is_the_episodes(engine, mode):
    completions, groups = play(engine, [str(AGENTS / "arithmetic_agent.py"), *mode], n=2)
    assert [c.episode_index for c in completions] == [0, 1]
    for c in completions:
        assert (c.env_reward, c.env_error, c.text, c.turns) == (1.0, None, "5", 1)
        assert c.loss_mask.tolist() == [1, 1] and c.response_ids.tolist() == engine.tokenizer.encode("5") + [1]
    # The raw agent sent the row's prompt as it is: the group's prompt ids. The chat agent's prompt
    # is the template's rendering of its message: its own.
    prompt = engine.tokenizer.encode(ROW["text"])
    assert {c.part for c in completions} == {0}
    assert all((c.prompt_ids.tolist() == prompt) == (not mode) for c in completions)
    assert groups.counts == {"episodes": 2, "ignored_sampling": 0, "timeouts": 0, "failures": 0, "no_call": 0}


@pytest.mark.slow
def test_a_wrong_answer_is_rewarded_0_by_the_program(engine):
    row = {**ROW, "answer": "6"}
    (completion,), _ = play(engine, [str(AGENTS / "arithmetic_agent.py")], row=row)
    assert (completion.env_reward, completion.env_error) == (0.0, None)


@pytest.mark.slow
def test_a_call_that_extends_the_last_merges_and_an_edit_splits(engine):
    (merged,), groups = play(engine, [str(AGENTS / "scripted_agent.py"), "merge"])
    assert (merged.turns, merged.part, merged.env_reward) == (2, 0, 0.5)
    assert int(merged.loss_mask.sum()) == 2 * 2  # "5" + EOS, twice; the follow-up message is out of the loss
    assert groups.counts["ignored_sampling"] == 1  # the program asked for temperature 0.2
    (text,), _ = play(engine, [str(AGENTS / "scripted_agent.py"), "text"])
    assert (text.turns, text.part) == (2, 0)
    first, second = play(engine, [str(AGENTS / "scripted_agent.py"), "split"])[0]
    assert (first.part, second.part) == (0, 1) and first.turns == second.turns == 1
    assert first.env_reward == second.env_reward == 0.5
    assert "be exact" in engine.tokenizer.decode(second.prompt_ids.tolist())


@pytest.mark.slow
def test_a_program_that_exits_without_a_reward_is_left_to_the_runs_rewards(engine):
    (completion,), _ = play(engine, [str(AGENTS / "scripted_agent.py"), "no-reward"])
    assert (completion.env_reward, completion.env_error, completion.turns) == (None, None, 1)


@pytest.mark.slow
def test_a_program_that_hangs_is_killed_with_its_children_and_its_episode_unscored(engine, tmp_path):
    pids = tmp_path / "pids"
    (completion,), groups = play(engine, [str(AGENTS / "scripted_agent.py"), "hang", str(pids)], timeout_s=3.0)
    assert completion.env_reward is None
    assert completion.env_error.startswith("agent_timeout: the program ran longer than 3 s")
    assert completion.turns == 1  # what it sampled before hanging is kept
    program, child = map(int, pids.read_text().split())
    assert gone([program, child])
    assert groups.counts["timeouts"] == 1


@pytest.mark.slow
def test_a_program_that_crashes_is_unscored_with_its_exit_code_and_stderr(engine):
    (completion,), groups = play(engine, [str(AGENTS / "scripted_agent.py"), "crash"])
    assert completion.env_reward is None
    assert completion.env_error == "agent_failed: exit code 3: the agent gave up: no plan"
    assert groups.counts["failures"] == 1


@pytest.mark.slow
def test_a_program_that_makes_no_call_is_unscored(engine):
    (completion,), groups = play(engine, [str(AGENTS / "scripted_agent.py"), "no-call"])
    assert completion.env_error.startswith("agent_made_no_call")
    assert completion.env_reward is None and len(completion.response_ids) == 0 and completion.turns == 0
    assert groups.counts["no_call"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("samples_k", [2, 0])
def test_held_out_episodes_follow_the_evaluation_request_greedy_first(engine, samples_k):
    cfg = AgentConfig(command=[sys.executable, str(AGENTS / "arithmetic_agent.py")], episode_timeout_s=60)
    # a request without samples carries no seeds
    seeds = [3, 4] if samples_k else []
    request = SimpleNamespace(samples_k=samples_k, temperature=0.7, top_p=0.9, seeds=seeds, max_new_tokens=4)
    rows = [ROW, {**ROW, "text": "What is 1+1?\n", "answer": "3"}]

    async def main():
        groups = AgentGroups(engine, cfg, SamplingConfig(n=8, max_tokens=8), 256, params=fake_params)
        try:
            ids = [engine.tokenizer.encode(r["text"]) for r in rows]
            return await asyncio.wait_for(groups.evaluate("eval/0/0", rows, ids, request), 120)
        finally:
            await groups.close()

    played = asyncio.run(main())
    assert [[e.env_reward for e in eps] for eps in played] == [[1.0] * (1 + samples_k), [0.0] * (1 + samples_k)]
    temperatures = sorted(params.temperature for _, params in engine.requests)
    assert temperatures == [0.0, 0.0] + [0.7] * 2 * samples_k  # one greedy episode per prompt, then samples_k sampled
    assert {params.max_tokens for _, params in engine.requests} == {4}


def test_a_command_that_is_not_a_program_is_refused_at_construction(engine):
    cfg = AgentConfig(command=["asyncrl-no-such-agent-program"])
    with pytest.raises(ValueError, match="is not an executable program"):
        AgentGroups(engine, cfg, SamplingConfig(n=1), 256, params=fake_params)
    with pytest.raises(ValueError, match="must name the agent program"):
        AgentGroups(engine, AgentConfig(), SamplingConfig(n=1), 256, params=fake_params)
