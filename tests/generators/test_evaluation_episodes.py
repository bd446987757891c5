"""Held-out episodes answered by a generator: the ``eval_result`` carries, per prompt and greedy
first, each episode's environment reward and error, turns, tool calls and tool errors, and an
older sender's result (without the episode figures) still decodes."""

import asyncio
import concurrent.futures
import time
from types import SimpleNamespace

from asyncrl.generators.evaluation import EvalCounters, answer_eval_request
from asyncrl.wire import decode, encode, encode_map
from asyncrl.wire.messages import EvalRequest, EvalResult


def episode(text: str, turns: int, calls: int, errors: int, reward=1.0, error=None) -> SimpleNamespace:
    """A played episode as the engine returns it (the fields of a ``Completion`` the path reads)."""
    return SimpleNamespace(
        text=text,
        finish_reason="stop",
        turns=turns,
        tool_calls=calls,
        tool_errors=errors,
        env_reward=reward,
        env_error=error,
    )


PLAYED = [  # per prompt: the greedy episode, then one sampled
    [episode("4", 2, 1, 0), episode("5", 3, 2, 1, reward=None, error="environment_timeout: step 2")],
    [episode("9", 1, 0, 0), episode("8", 4, 3, 3)],
]


class Episodes:
    async def evaluate(self, key, rows, prompt_ids, request):
        return PLAYED


class Engine:
    version = 3

    def tokenize_prompts(self, prompts):
        return [{"prompt_token_ids": [1, 2]} for _ in prompts]

    def submit(self, coroutine):
        future = concurrent.futures.Future()
        future.set_result(asyncio.run(coroutine))
        return future


class Ctx:
    name = "generator-0"
    cfg = SimpleNamespace(eval=SimpleNamespace(timeout_floor_s=5.0))

    def __init__(self):
        self.reported = []

    def report(self, message):
        self.reported.append(message)


class Receiver:
    def __init__(self, request):
        self.request = request

    def take(self):
        request, self.request = self.request, None
        return request


def test_an_episode_answer_carries_each_episodes_turns_and_tool_calls_greedy_first():
    rows = [{"answer": "4", "columns": None, "prompt_uid": f"p{i}", "task": "guess"} for i in range(2)]
    request = EvalRequest(
        round="v2",
        chunk=0,
        version=2,
        prompts=["a", "b"],
        max_new_tokens=8,
        sent_at=time.time(),
        samples_k=1,
        seeds=[1, 2],
        rows=rows,
    )
    ctx = Ctx()
    assert answer_eval_request(Engine(), Receiver(request), ctx, EvalCounters(), episodes=Episodes())
    (result,) = ctx.reported
    assert result.texts == ["4", "9"] and result.samples == [["5"], ["8"]]
    assert result.env_rewards == [[1.0, None], [1.0, 1.0]]
    assert result.env_errors == [[None, "environment_timeout: step 2"], [None, None]]
    assert result.turns == [[2, 3], [1, 4]]
    assert result.tool_calls == [[1, 2], [0, 3]]
    assert result.tool_errors == [[0, 1], [0, 3]]
    kind, back = decode(encode(result))
    assert kind == "eval_result" and back.turns == result.turns and back.tool_errors == result.tool_errors


def test_an_eval_result_without_the_episode_figures_still_decodes():
    old = {"round": "v2", "chunk": 0, "generator": "g", "version": 2, "texts": ["4"], "seconds": 0.1, "queued_s": 0.0}
    old |= {"env_rewards": [[1.0]], "env_errors": [[None]]}  # a sender from before turns and tool calls
    kind, body = decode(encode_map("eval_result", old))
    assert isinstance(body, EvalResult) and body.turns == [] and body.tool_calls == [] and body.tool_errors == []
