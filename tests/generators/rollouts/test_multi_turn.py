"""Multi-turn episodes, token in, token out: the episode's tokens are the model's turns exactly as
sampled and the environment's rendered answers, in order; the loss mask marks the model's; limits
end an episode with ``length``; an environment that fails or hangs leaves it unscored, with the
reason, and nothing else fails."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from asyncrl.generators.completion import Completion
from asyncrl.generators.rollouts.multi_turn import EpisodeLimits, run_episode
from asyncrl.generators.rollouts.render import PlainRenderer
from asyncrl.tasks.environments.base import Step, ToolEnvironment
from asyncrl.tasks.environments.calculator import Calculator
from asyncrl.tasks.environments.guess_number import GuessNumber

EOS = 1


class CharTokenizer:
    """One id per character (ord), EOS = 1: enough to check which ids went where."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


class ScriptedModel:
    """Answers each turn with the next scripted text (+ EOS), logprob -0.1 a token, version 5;
    records every context it was asked to continue."""

    def __init__(self, turns: list[str], version: int = 5, cut: int | None = None):
        self.turns, self.version, self.cut = list(turns), version, cut
        self.contexts: list[list[int]] = []

    async def __call__(self, context: list[int], max_tokens: int, turn: int) -> Completion:
        self.contexts.append(list(context))
        text = self.turns[turn]
        ids = [ord(c) for c in text] + [EOS]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        return Completion(
            prompt_ids=np.asarray(context, np.int32),
            response_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.1, np.float32),
            text=text,
            finish_reason=finish,
            version_segments=[[0, self.version + turn]],
        )


def limits(**kw) -> EpisodeLimits:
    return EpisodeLimits(
        **{"max_turns": 4, "max_turn_tokens": 16, "max_episode_tokens": 200, "step_timeout_s": 1.0, **kw}
    )


def play(model, env, prompt="guess:", row=None, template="[{content}]", **kw) -> Completion:
    renderer = PlainRenderer(CharTokenizer(), template)
    ids = [ord(c) for c in prompt]
    return asyncio.run(run_episode(model, env, renderer, row or {"answer": "7"}, ids, limits(**kw), {EOS}))


def test_the_episode_is_the_sampled_turns_and_the_rendered_answers_in_order():
    model = ScriptedModel(["5", "9", "7"])
    episode = play(model, GuessNumber())
    turn = lambda text: [ord(c) for c in text] + [EOS]  # noqa: E731
    obs = lambda text: [ord(c) for c in f"[{text}]"]  # noqa: E731
    expected = turn("5") + obs("higher") + turn("9") + obs("lower") + turn("7")
    assert episode.response_ids.tolist() == expected
    mask = [1, 1] + [0] * 8 + [1, 1] + [0] * 7 + [1, 1]
    assert episode.loss_mask.tolist() == mask
    assert np.all(episode.logprobs[episode.loss_mask == 0] == 0) and np.all(
        episode.logprobs[episode.loss_mask == 1] < 0
    )
    # each turn was sampled after exactly the ids kept so far: nothing was tokenized again
    prompt = [ord(c) for c in "guess:"]
    assert model.contexts == [prompt, prompt + expected[:10], prompt + expected[:19]]
    assert (episode.finish_reason, episode.turns, episode.env_reward, episode.env_error) == ("stop", 3, 1.0, None)
    assert episode.text == "7"  # what the answer rewards read: the last turn
    assert episode.version_segments == [[0, 5], [10, 6], [19, 7]]  # each turn's version, where it starts
    assert episode.step_rewards == [[20, 1.0]]  # the finding step's reward, on its turn's last token (EOS)


class Opens(GuessNumber):
    async def reset(self, row):
        await super().reset(row)
        return [{"role": "user", "content": "4 tries"}]


def test_the_messages_reset_answers_open_the_episode_in_its_prompt():
    model = ScriptedModel(["7"])
    episode = play(model, Opens())
    opened = [ord(c) for c in "guess:[4 tries]"]
    assert model.contexts == [opened] and episode.prompt_ids.tolist() == opened
    assert episode.response_ids.tolist() == [ord("7"), EOS] and episode.loss_mask.tolist() == [1, 1]


def test_the_turn_limit_ends_the_episode_with_length_and_no_reward():
    episode = play(ScriptedModel(["1", "2", "3", "4"]), GuessNumber(), max_turns=2)
    assert (episode.finish_reason, episode.turns, episode.env_reward) == ("length", 2, 0.0)
    assert episode.loss_mask.tolist()[-2:] == [1, 1]  # no observation is left dangling after the last turn


def test_the_token_budget_ends_the_episode_before_an_answer_it_could_not_follow():
    # after "1<eos>" (2 tokens) the 8-token "[higher]" would leave no room in a budget of 10
    episode = play(ScriptedModel(["1", "2"]), GuessNumber(), max_episode_tokens=10)
    assert (episode.finish_reason, len(episode.response_ids), episode.turns) == ("length", 2, 1)


def test_a_turn_cut_at_its_token_limit_is_not_shown_to_the_environment():
    class Never(GuessNumber):
        async def step(self, text):
            raise AssertionError("asked about a cut turn")

    episode = play(ScriptedModel(["123456"]), Never(), max_turn_tokens=3)
    assert (episode.finish_reason, len(episode.response_ids), episode.env_error) == ("length", 3, None)


class Raises(GuessNumber):
    async def step(self, text):
        raise RuntimeError("the game server is down")


class Hangs(GuessNumber):
    async def step(self, text):
        await asyncio.sleep(3600)


@pytest.mark.parametrize(
    "env, reason",
    [
        (Raises(), "environment_failed: step raised RuntimeError: the game server is down"),
        (Hangs(), "environment_timeout"),
    ],
)
def test_a_failing_or_hanging_environment_leaves_the_episode_unscored_with_the_reason(env, reason):
    episode = play(ScriptedModel(["5"]), env, step_timeout_s=0.2)
    assert episode.env_error.startswith(reason) and episode.env_reward is None
    assert episode.turns == 1 and episode.loss_mask.tolist() == [1, 1]  # what was sampled is kept


def test_close_runs_whatever_happens():
    closed = []

    class Tracked(Raises):
        async def close(self):
            closed.append(True)

    play(ScriptedModel(["5"]), Tracked())
    assert closed == [True]


def test_tools_are_called_and_their_results_rendered_and_errors_counted():
    model = ScriptedModel(["<calc>12+34</calc>", "<calc>2+</calc><nope>1</nope>", "46"])
    episode = play(model, Calculator(), prompt="12+34=", template="{content}\n", max_turn_tokens=64)
    text = CharTokenizer().decode(episode.response_ids)
    assert (
        text
        == "<calc>12+34</calc>=46\n<calc>2+</calc><nope>1</nope>error: calc raised ValueError: cannot read '2+': invalid syntax\n46"
    )
    assert (episode.tool_calls, episode.tool_errors, episode.turns, episode.finish_reason) == (2, 1, 3, "stop")


def test_a_hermes_tool_call_with_bad_json_or_an_unknown_tool_is_an_error_observation():
    class Tools(ToolEnvironment):
        def add(self, a: int, b: int) -> int:
            return a + b

    env = Tools()
    step = asyncio.run(
        env.step(
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            "<tool_call>{oops</tool_call>"
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
        )
    )
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "5" and all(c.startswith("error") for c in contents[1:])
    assert "no tool named 'mul'" in contents[2] and "unexpected keyword argument" in contents[3]
    assert (step.tool_calls, step.tool_errors, step.done) == (4, 3, False)
    assert asyncio.run(env.step("the answer is 5")) == Step(done=True)


def test_a_hanging_sync_tool_times_the_episode_out_without_stalling_the_event_loop():
    class Slow(ToolEnvironment):
        tool_format = "tag"

        def wait(self, seconds: str) -> str:
            time.sleep(float(seconds))
            return "done"

    ticks = []

    async def both():
        async def ticker():
            for _ in range(5):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        renderer = PlainRenderer(CharTokenizer())
        episode = run_episode(
            ScriptedModel(["<wait>1.5</wait>"]),
            Slow(),
            renderer,
            {},
            [1],
            limits(max_turn_tokens=64, step_timeout_s=0.3),
            {EOS},
        )
        return (await asyncio.gather(episode, ticker()))[0]

    start = time.monotonic()
    episode = asyncio.run(both())
    assert episode.env_error.startswith("environment_timeout") and len(ticks) == 5
    assert ticks[-1] - start < 1.0  # the loop ran on while the tool slept in its thread


class Isolated(ToolEnvironment):
    """Tools in a child process: a good one, one that kills its process, one that hangs, one that hogs memory."""

    tool_timeout_s = 1.0
    tool_memory_bytes = 256 << 20
    process_tools = {
        name: f"tests.tasks.environments.tools_for_tests:{name}" for name in ("echo", "exits", "hangs", "hogs")
    }


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_process_tools_that_crash_hang_or_hog_memory_are_error_observations_and_the_episode_goes_on():
    turns = [
        call("echo", text="hi"),
        call("exits"),
        call("hangs"),
        call("hogs", mib=1024) + call("echo", text="ok"),
        "done",
    ]
    try:
        episode = play(
            ScriptedModel(turns),
            Isolated(),
            template="{content}|",
            max_turns=5,
            max_turn_tokens=200,
            max_episode_tokens=4000,
            step_timeout_s=30,
        )
        errors = dict(Isolated.runner().errors)
    finally:
        Isolated.runner().close()
    observations = CharTokenizer().decode(episode.response_ids[episode.loss_mask == 0]).split("|")[:-1]
    assert observations[0] == "hi" and observations[-1] == "ok", observations
    assert all(o.startswith("error") for o in observations[1:-1]), observations
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.env_error) == (5, 5, 3, None)
    assert episode.finish_reason == "stop"
    assert errors == {"crashed": 2, "timeout": 1}, errors  # the memory hog ran out of memory: its child ended
