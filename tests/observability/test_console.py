"""The console modes, the component states and the live panel."""

import io
import json
import types

import pytest
from rich.console import Console

from asyncrl.observability.console import ComponentStates, RunConsole, step_line
from asyncrl.observability.step_stats import StepStats


def event(type, source, role, **fields):
    return types.SimpleNamespace(type=type, source=source, role=role, final=type.endswith("_final"), **fields)


def stats(version, **extra):
    figures = dict(loss=0.01, reward=0.5, accuracy=0.25, samples=16, tokens=320, wait_s=0.1, step_s=0.2)
    return StepStats(version=version, staleness_mean=1.5, staleness_max=3, **{**figures, **extra})


STEPS = [(stats(1), 2.0), (stats(2), 4.0)]
EVENTS = [
    event("ready", "buffer", "buffer"),
    event("ready", "generator-0", "generator", version=0),
    event("version", "generator-0", "generator", version=2),
    event("step", "learner", "learner", version=1),
    event("step", "learner", "learner", version=2),
]


def feed(console):
    """The events, and each step's stats after its event, as the controller routes them."""
    steps = iter(STEPS)
    for ev in EVENTS:
        console.update(ev)
        if ev.type == "step":
            console.step(*next(steps))


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_prints_one_line_per_step_with_accuracy_and_tokens_per_s():
    out = io.StringIO()
    console = RunConsole("plain", total_steps=10, out=out)
    feed(console)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step    1/10") and "acc 0.250" in lines[0] and "staleness 1.50/3" in lines[0]
    assert "160 tok/s" in lines[0]  # 320 tokens in the 2 s since go
    assert "160 tok/s" in lines[1]  # 320 tokens between t=2 and t=4


def test_jsonl_is_one_json_object_per_step_with_component_states():
    out = io.StringIO()
    console = RunConsole("jsonl", total_steps=10, out=out)
    feed(console)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["version"] for r in records] == [1, 2] and all(r["type"] == "step" for r in records)
    assert records[-1]["tokens_per_s"] == 160 and records[-1]["samples_per_s"] == 8
    assert records[-1]["components"] == {"buffer": "ready", "generator-0": "serving v2", "learner": "at v2"}


def test_quiet_prints_nothing_and_live_falls_back_to_plain_off_a_terminal():
    out = io.StringIO()
    quiet = RunConsole("quiet", total_steps=10, out=out)
    feed(quiet)
    assert out.getvalue() == ""
    assert RunConsole("live", total_steps=10, out=io.StringIO()).mode == "plain"


def test_bad_mode_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"run.console \('fancy'\) must be one of"):
        RunConsole("fancy", total_steps=1)


def test_states_follow_events_restarts_and_exits():
    proc = lambda rc: types.SimpleNamespace(returncode=rc)  # noqa: E731
    fleet = types.SimpleNamespace(
        procs={"generator-0": proc(None), "reward-0": proc(None), "dispatcher": proc(None)},
        starts={"generator-0": 1, "reward-0": 1, "dispatcher": 1},
    )
    states = ComponentStates()
    states.fleet = fleet
    assert states.snapshot() == {"generator-0": "starting", "reward-0": "starting", "dispatcher": "starting"}
    for ev in EVENTS[:3]:
        states.update(ev)
    states.update(event("ready", "reward-0", "reward"))
    fleet.procs["dispatcher"] = proc(-9)  # killed, no final report
    fleet.starts["reward-0"] = 2  # started again after a death: restarting until it is ready
    snap = states.snapshot()
    assert snap["generator-0"] == "serving v2" and snap["reward-0"] == "restarting"
    assert snap["dispatcher"] == "exited (-9)"
    states.update(event("ready", "reward-0", "reward"))
    states.update(event("generator_final", "generator-0", "generator"))
    snap = states.snapshot()
    assert snap["reward-0"] == "ready" and snap["generator-0"] == "stopped"


def test_live_panel_shows_step_numbers_eval_and_processes():
    console = RunConsole("live", total_steps=10, run_name="demo", out=TTY())
    assert console.mode == "live"
    try:
        feed(console)
        console.set_eval(before=0.125)
        screen = io.StringIO()
        Console(file=screen, width=160).print(console.render())
        text = screen.getvalue()
    finally:
        console.close({"eval_before": 0.125, "eval_after": 0.5})
    for expected in ("demo", "step 2/10", "reward 0.500", "accuracy 0.250", "tokens/s 160", "before RL 0.125"):
        assert expected in text, expected
    assert "generator-0" in text and "serving v2" in text and "at v2" in text


def test_step_line_without_optional_fields():
    line = step_line(stats(3, accuracy=None), 5)
    assert "acc" not in line and "tok/s" not in line and "clip" not in line and line.startswith("step    3/5")
    assert "clip 0.125" in step_line(stats(3, clipfrac=0.125), 5)


def test_a_statistic_the_console_names_must_be_a_step_stat():
    from asyncrl.observability.step_stats import check_names

    with pytest.raises(AttributeError, match=r"\['clipfrc'\] are not StepStats fields"):
        check_names(("clipfrac", "clipfrc"), "console.LINE_EXTRAS")
    with pytest.raises(AttributeError, match="clipfrc"):
        _ = stats(1).clipfrc


EPISODES = dict(episodes=4, episode_turns=2.5, episode_tool_calls=1.25, episode_tool_errors=0.5)
EPISODES |= dict(episode_masked_frac=0.375, episode_masked_tokens=12.0, episode_tokens=40.0, episode_env_failed=0.0)


def test_a_step_of_episodes_shows_turns_tool_calls_and_masked_share_and_a_single_turn_step_does_not():
    line = step_line(stats(3, **EPISODES), 5)
    assert "turns/ep 2.50" in line and "tools/ep 1.25 (0.50 err)" in line and "masked 37.5%" in line
    single = step_line(stats(3), 5)
    assert "turns" not in single and "tools" not in single and "masked" not in single
    # a single-turn step's line is the one it was before episodes had figures
    assert single == ("step    3/5  loss +0.0100  reward 0.500  acc 0.250  staleness 1.50/3  wait 0.10s step 0.20s")


def test_live_panel_adds_the_episode_row_only_for_steps_of_episodes():
    def screen(steps) -> str:
        console = RunConsole("live", total_steps=10, run_name="demo", out=TTY())
        try:
            for s, t in steps:
                console.step(s, t)
            out = io.StringIO()
            Console(file=out, width=160).print(console.render())
            return out.getvalue()
        finally:
            console.close()

    with_episodes = screen([(stats(1, **EPISODES), 2.0)])
    for expected in ("turns/ep 2.50", "tools/ep 1.25 (0.50 err)", "masked 37.5%", "reward 0.500"):
        assert expected in with_episodes, expected
    single = screen([(stats(1), 2.0)])
    assert "turns/ep" not in single and "tools/ep" not in single and "reward 0.500" in single
