"""The warm start's demonstrations are the tokens a generator would hold: the prompt, each model
turn's text (with eos unless a stop string ended it), each answer as the generator renders it,
the loss mask on the model's turns only; a demonstration the generators could not replay fails,
naming the prompt and the turn."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.controller.demonstrations import Demonstrations
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.tasks.environments.calculator import Calculator, evaluate
from asyncrl.tasks.environments.guess_number import GuessNumber
from asyncrl.tasks.prompts import Prompt, load_prompts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def expected(tokenizer, prompt: str, parts: list[tuple[str, int, bool]]) -> tuple[list[int], list[int]]:
    """(ids, mask) built by hand: the prompt, then each (text, in the loss, ends with eos)."""
    ids, mask = tokenizer.encode(prompt), [0] * len(tokenizer.encode(prompt))
    for text, learned, eos in parts:
        part = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
        ids, mask = ids + part, mask + [learned] * len(part)
    return ids, mask


def guess_prompt(secret: int) -> Prompt:
    return Prompt(f"g/{secret}", "guess 1-16:", str(secret), "guess_number", {"low": 1, "high": 16})


def test_a_guessing_game_is_the_prompt_the_guesses_and_the_rendered_hints(tokenizer, monkeypatch):
    cfg = load_config("configs/guess_number.yaml")  # plain_template "{content}\n"
    turns = [{"role": "assistant", "content": "8"}, {"role": "user", "content": "higher"}]
    turns += [{"role": "assistant", "content": "12"}, {"role": "user", "content": "lower"}]
    turns += [{"role": "assistant", "content": "10"}]
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: turns)
    (example,) = Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])
    ids, mask = expected(
        tokenizer,
        "guess 1-16:",
        [("8", 1, True), ("higher\n", 0, False), ("12", 1, True), ("lower\n", 0, False), ("10", 1, True)],
    )
    assert example.ids == ids and example.mask == mask
    assert tokenizer.decode(example.ids) == "guess 1-16:8<eos>higher\n12<eos>lower\n10<eos>"


def test_a_tool_call_ends_at_its_stop_string_without_eos_and_its_result_is_out_of_the_loss(tokenizer):
    calls_only = ["environment.options.demonstration_calls=1.0", "environment.options.demonstration_slips=0.0"]
    cfg = load_config("configs/calculator.yaml", calls_only)
    prompt = Prompt("c/0", "23*47=", "1081", "calculator", {"expression": "23*47"})
    (example,) = Demonstrations(cfg, tokenizer, seed=0)([prompt])
    ids, mask = expected(
        tokenizer, "23*47=", [("<calc>23*47</calc>", 1, False), ("=1081\n", 0, False), ("1081", 1, True)]
    )
    assert example.ids == ids and example.mask == mask


def test_the_shipped_recipes_demonstrations_are_legal_and_leave_room_to_improve(tokenizer):
    cfg = load_config("configs/guess_number.yaml", ["environment.max_turns=4"])
    prompts = load_prompts(cfg.task, "train")[:200]
    examples = Demonstrations(cfg, tokenizer, seed=1)(prompts)
    found = 0
    for prompt, example in zip(prompts, examples):
        text = tokenizer.decode(example.ids, skip_special_tokens=False)
        guesses = [
            int(g)
            for g in text.removeprefix("guess 1-16:").replace("higher\n", "").replace("lower\n", "").split("<eos>")
            if g
        ]
        assert 1 <= len(guesses) <= cfg.environment.max_turns and all(1 <= g <= 16 for g in guesses), text
        found += guesses[-1] == int(prompt.answer)
    assert 0.4 < found / len(prompts) < 0.8  # legal, random guesses: about 58% found within 4 turns

    cfg = load_config("configs/calculator.yaml")
    prompts = load_prompts(cfg.task, "train")[:300]
    examples = Demonstrations(cfg, tokenizer, seed=1)(prompts)
    texts = [tokenizer.decode(e.ids[len(p.text) :], skip_special_tokens=True) for p, e in zip(prompts, examples)]
    calls = [(t, p.answer) for t, p in zip(texts, prompts) if t.startswith("<calc>")]
    assert 0.2 < len(calls) / len(texts) < 0.4  # demonstration_calls 0.3
    assert all(evaluate(t[6 : t.index("</calc>")]) == int(t.rsplit("\n", 1)[1]) for t, _ in calls)  # the result ...
    wrong = [t for t, answer in calls if not t.endswith(f"\n{answer}")]
    assert 0 < len(wrong) < len(calls) / 2  # ... of a mistyped call now and then (demonstration_slips 0.2)
    direct = [(t, p.answer) for t, p in zip(texts, prompts) if not t.startswith("<calc>")]
    assert all(t == answer for t, answer in direct)


def test_a_demonstration_the_environment_answers_otherwise_fails_naming_it(tokenizer, monkeypatch):
    cfg = load_config("configs/guess_number.yaml")
    turns = [{"role": "assistant", "content": "8"}, {"role": "user", "content": "lower"}]
    turns += [{"role": "assistant", "content": "10"}]
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: turns)
    with pytest.raises(
        ValueError, match=r"g/10: after turn 0 the environment answers .*higher.* the demonstration .*lower"
    ):
        Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])


def test_a_demonstration_that_goes_on_after_the_end_or_stops_early_fails(tokenizer, monkeypatch):
    cfg = load_config("configs/guess_number.yaml")
    found_then_more = [{"role": "assistant", "content": "10"}, {"role": "assistant", "content": "3"}]
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: found_then_more)
    with pytest.raises(ValueError, match=r"ended after turn 0 .* has 2 turns"):
        Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])
    unfinished = [{"role": "assistant", "content": "3"}, {"role": "user", "content": "higher"}]
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: unfinished)
    with pytest.raises(ValueError, match=r"ends after turn 0, and the environment asks for another"):
        Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])


def test_a_demonstration_longer_than_max_turns_is_cut_there(tokenizer, monkeypatch):
    cfg = load_config("configs/guess_number.yaml", ["environment.max_turns=2"])
    turns = [{"role": "assistant", "content": "1"}, {"role": "user", "content": "higher"}]
    turns += [{"role": "assistant", "content": "2"}, {"role": "user", "content": "higher"}]
    turns += [{"role": "assistant", "content": "10"}]
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: turns)
    (example,) = Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])
    assert tokenizer.decode(example.ids) == "guess 1-16:1<eos>higher\n2<eos>"  # no answer after the last turn


def test_a_turn_the_generators_would_cut_or_stop_early_fails(tokenizer, monkeypatch):
    cfg = load_config("configs/guess_number.yaml")  # sampling.max_tokens 4
    monkeypatch.setattr(GuessNumber, "demonstration", lambda self, row, rng: [{"role": "assistant", "content": "0010"}])
    with pytest.raises(ValueError, match=r"turn 0 \('0010'\) is 5 tokens, the generators leave it 4"):
        Demonstrations(cfg, tokenizer, seed=0)([guess_prompt(10)])
    cfg = load_config("configs/calculator.yaml")
    past = [{"role": "assistant", "content": "<calc>1+2</calc> and 3"}]
    monkeypatch.setattr(Calculator, "demonstration", lambda self, row, rng: past)
    prompt = Prompt("c/0", "1+2=", "3", "calculator", {"expression": "1+2"})
    with pytest.raises(ValueError, match=r"goes on past the stop string '</calc>'"):
        Demonstrations(cfg, tokenizer, seed=0)([prompt])


def test_an_environment_without_demonstrations_is_refused(tokenizer):
    cfg = load_config("configs/guess_number.yaml", ["environment.cls=asyncrl.tasks.environments.base:ToolEnvironment"])
    with pytest.raises(ValueError, match=r"needs the class's demonstration\(row, rng\) method"):
        Demonstrations(cfg, tokenizer, seed=0)


def test_a_calculator_demonstration_calls_in_the_recipes_tool_format(tokenizer):
    overrides = ["environment.options.demonstration_calls=1.0", "environment.options.demonstration_slips=0.0"]
    cfg = load_config(
        "configs/calculator.yaml",
        [*overrides, "environment.tool_format=hermes", "sampling.max_tokens=80", "engine.max_model_len=128"],
    )
    prompt = Prompt("c/0", "23*47=", "1081", "calculator", {"expression": "23*47"})
    (example,) = Demonstrations(cfg, tokenizer, seed=0)([prompt])
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "23*47"}}</tool_call>'
    # a hermes call is no stop string (the generators stop only at the tag format's): the model ends the turn
    ids, mask = expected(tokenizer, "23*47=", [(call, 1, True), ("=1081\n", 0, False), ("1081", 1, True)])
    assert example.ids == ids and example.mask == mask
