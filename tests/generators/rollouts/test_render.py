"""Observations rendered with the model's chat template extend the episode token for token: the
prompt, the turns as sampled and the rendered observations decode to exactly what the template
renders for the whole conversation, so the model sees each new turn as it was tuned to."""

from __future__ import annotations

import pytest

from asyncrl.generators.rollouts.render import ChatRenderer, PlainRenderer, build_renderer
from asyncrl.models.char_tokenizer import build_char_tokenizer
from tests.factories import chatml_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chatml_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_episode_decodes_to_the_templates_rendering_of_the_conversation(tokenizer):
    renderer = ChatRenderer(tokenizer)
    question = [{"role": "user", "content": "guess 1-16"}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    conversation = list(question)
    for turn, answer in (("8", "higher"), ("12", "lower"), ("10", None)):
        ids += tokenizer.encode(turn, add_special_tokens=False) + [tokenizer.eos_token_id]  # as sampled, EOS kept
        conversation.append({"role": "assistant", "content": turn})
        if answer is not None:
            messages = [{"role": "user", "content": answer}]
            ids += renderer.observation(messages)
            conversation += messages
    whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) + "\n" == whole


def test_a_turn_cut_at_a_stop_string_is_closed_by_the_observation(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "tool", "content": "=46"}]
    closed, open_ = renderer.observation(messages), renderer.observation(messages, turn_closed=False)
    assert open_ == [tokenizer.eos_token_id] + closed
    assert (
        tokenizer.decode(closed, skip_special_tokens=False) == "\n<|im_start|>tool\n=46<eos>\n<|im_start|>assistant\n"
    )


def test_a_model_without_a_chat_template_gets_its_observations_plain(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    renderer = build_renderer(tok)
    assert isinstance(renderer, PlainRenderer)
    assert tok.decode(renderer.observation([{"role": "user", "content": "higher"}])) == "higher"
    assert tok.decode(build_renderer(tok, "\n{content}\n").observation([{"role": "user", "content": "x"}])) == "\nx\n"
    with pytest.raises(ValueError, match="must contain"):
        PlainRenderer(tok, "no placeholder")


def test_an_environments_opening_messages_go_before_the_generation_prompt(tokenizer):
    renderer = ChatRenderer(tokenizer)
    question = [{"role": "user", "content": "guess 1-16"}]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    opening = [{"role": "user", "content": "you have 4 tries"}]
    whole = tokenizer.apply_chat_template(question + opening, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(renderer.opening(prompt, opening), skip_special_tokens=False) == whole


def test_an_opening_needs_a_prompt_the_template_rendered(tokenizer):
    with pytest.raises(ValueError, match="generation prompt"):
        ChatRenderer(tokenizer).opening(
            tokenizer.encode("12+34=", add_special_tokens=False), [{"role": "user", "content": "x"}]
        )


def test_a_plain_opening_is_appended_to_the_prompt(tokenizer):
    renderer = PlainRenderer(tokenizer, template="{content}\n")
    assert renderer.opening([5, 6], [{"role": "user", "content": "hi"}]) == [5, 6] + tokenizer.encode(
        "hi\n", add_special_tokens=False
    )
