"""An agent's calls become samples token in, token out: a call that extends the previous one
merges into its sample (the sampled ids kept exactly, the new messages appended out of the loss);
any other call starts a new part with its own prompt; sampled ids are never decoded and encoded
again."""

from __future__ import annotations

import numpy as np

from asyncrl.generators.completion import Completion
from asyncrl.generators.gateway.recorder import EpisodeRecorder
from asyncrl.generators.rollouts.render import ChatRenderer


def turn(tokenizer, text: str, version: int = 3, eos: bool = True) -> Completion:
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    return Completion(
        np.zeros(0, np.int32), np.asarray(ids, np.int32), np.full(len(ids), -0.25, np.float32), text, "stop",
        [[0, version]],
    )  # fmt: skip


def recorder(tokenizer) -> EpisodeRecorder:
    return EpisodeRecorder(tokenizer, ChatRenderer(tokenizer), {tokenizer.eos_token_id})


def render(tokenizer, messages, generation_prompt=True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def check_alignment(sample: Completion, sampled: list[list[int]]) -> None:
    """Loss mask 1 exactly on the sampled ids (in order, contiguous runs), logprobs 0 off them."""
    mask = sample.loss_mask.astype(bool)
    assert sample.response_ids[mask].tolist() == [t for ids in sampled for t in ids]
    assert np.all(sample.logprobs[~mask] == 0.0) and np.all(sample.logprobs[mask] == -0.25)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])) == 1)
    assert len(runs) == len(sampled)  # each turn one contiguous run


def test_a_chat_call_that_extends_the_last_one_merges_into_its_sample(tokenizer):
    rec = recorder(tokenizer)
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+3?"}]
    first = rec.context_for_chat(question)
    assert first.ids == render(tokenizer, question) and first.observation is None
    t1 = turn(tokenizer, "5", version=3)
    rec.add_turn(first, t1)
    follow = question + [{"role": "assistant", "content": "5", "refusal": None}, {"role": "user", "content": "sure?"}]
    second = rec.context_for_chat(follow)
    # The engine is asked to continue the exact sampled ids (EOS included), then the new message.
    assert second.ids == first.ids + t1.response_ids.tolist() + second.observation
    t2 = turn(tokenizer, "yes", version=4)
    rec.add_turn(second, t2)
    (sample,) = rec.completions(episode_index=2)
    assert (sample.part, sample.episode_index, sample.turns) == (0, 2, 2)
    assert sample.prompt_ids.tolist() == first.ids
    check_alignment(sample, [t1.response_ids.tolist(), t2.response_ids.tolist()])
    # The learner's input (prompt + response ids) is the template's rendering of the whole conversation.
    whole = follow[:2] + [{"role": "assistant", "content": "5"}, follow[3], {"role": "assistant", "content": "yes"}]
    learner_input = sample.prompt_ids.tolist() + sample.response_ids.tolist()
    assert learner_input == render(tokenizer, whole, generation_prompt=False)[:-1]  # the template's last "\n"
    assert sample.version_segments == [[0, 3], [len(t1.response_ids) + len(second.observation), 4]]


def test_a_context_edit_starts_a_new_part_with_its_own_prompt(tokenizer):
    question = [{"role": "user", "content": "What is 2+3?"}]
    rec = recorder(tokenizer)
    first = rec.context_for_chat(question)
    rec.add_turn(first, turn(tokenizer, "5"))
    edited = [{"role": "system", "content": "be exact"}, question[0], {"role": "assistant", "content": "5"}]
    edited.append({"role": "user", "content": "sure?"})
    second = rec.context_for_chat(edited)
    assert second.observation is None and second.ids == render(tokenizer, edited)
    rec.add_turn(second, turn(tokenizer, "yes"))
    a, b = rec.completions(episode_index=0)
    assert (a.part, b.part) == (0, 1)
    assert b.prompt_ids.tolist() == render(tokenizer, edited)
    check_alignment(a, [turn(tokenizer, "5").response_ids.tolist()])
    check_alignment(b, [turn(tokenizer, "yes").response_ids.tolist()])
    # A reply sent back changed (here: trimmed) is an edit too.
    rec.add_turn(rec.context_for_chat(question + [{"role": "assistant", "content": " 5"}]), turn(tokenizer, "x"))
    assert [c.part for c in rec.completions(0)] == [0, 1, 2]


def test_raw_completions_merge_on_the_text_returned_and_keep_the_sampled_ids(tokenizer):
    prompt = "What is 2+3?\n"
    rec = recorder(tokenizer)
    first = rec.context_for_text(prompt)
    t1 = turn(tokenizer, "5")  # ids "5" + EOS, text "5": the text alone re-encodes without the EOS
    rec.add_turn(first, t1)
    second = rec.context_for_text(prompt + "5" + "\nsure?\n")
    assert second.ids == tokenizer.encode(prompt) + t1.response_ids.tolist() + tokenizer.encode("\nsure?\n")
    assert second.ids != tokenizer.encode(prompt + "5\nsure?\n")  # what decode-then-encode would have sent
    rec.add_turn(second, turn(tokenizer, "yes"))
    (sample,) = rec.completions(0)
    assert sample.part == 0 and sample.response_ids.tolist()[: len(t1.response_ids)] == t1.response_ids.tolist()
    check_alignment(sample, [t1.response_ids.tolist(), turn(tokenizer, "yes").response_ids.tolist()])
    # A prompt that does not start with the previous prompt and reply splits; so does a switch to chat.
    rec.add_turn(rec.context_for_text("What is 4+4?"), turn(tokenizer, "8"))
    rec.add_turn(rec.context_for_chat([{"role": "user", "content": "What is 4+4?8"}]), turn(tokenizer, "8"))
    parts = rec.completions(0)
    assert [p.part for p in parts] == [0, 1, 2]
    assert parts[1].prompt_ids.tolist() == tokenizer.encode("What is 4+4?")


def test_a_call_that_was_not_sampled_leaves_no_trace(tokenizer):
    rec = recorder(tokenizer)
    question = [{"role": "user", "content": "hi"}]
    first = rec.context_for_chat(question)
    rec.add_turn(first, turn(tokenizer, "ok"))
    extended = question + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    rec.context_for_chat(extended)  # computed, then the call failed: nothing recorded
    again = rec.context_for_chat(extended)
    rec.add_turn(again, turn(tokenizer, "fine"))
    (sample,) = rec.completions(0)
    assert sample.turns == 2 and int(sample.loss_mask.sum()) == 3 + 5  # "ok"+EOS, "fine"+EOS


def test_a_template_that_renders_earlier_turns_anew_splits_rather_than_refuses(tmp_path):
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path)
    # Past assistant turns lose their content once a message follows them (as templates that drop
    # past reasoning do): the sampled ids cannot be extended.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{% else %}{{ m.content }}{% endif %}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rec = recorder(tok)
    question = [{"role": "user", "content": "hi"}]
    rec.add_turn(rec.context_for_chat(question), turn(tok, "ok"))
    follow = question + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = rec.context_for_chat(follow)
    assert second.observation is None and second.ids == render(tok, follow)
    rec.add_turn(second, turn(tok, "fine"))
    assert [p.part for p in rec.completions(0)] == [0, 1]
