"""Rows -> token ids and the mask of learned tokens: only the assistant's tokens, as the chat
template renders them, each assistant turn closed by eos."""

import pytest

from asyncrl.configbase import UserValueError
from asyncrl.learner.offline.config import OfflineDataConfig
from asyncrl.learner.offline.data import ChatRenderer, addition_rows, build_examples, pair_example, sft_example
from tests.factories import chatml_char_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chatml_char_tokenizer(tmp_path_factory.mktemp("tok"))


def learned_text(tok, seq) -> str:
    return tok.decode([i for i, m in zip(seq.ids, seq.mask) if m])


def test_only_the_assistant_turns_are_learned_and_the_ids_are_the_templates_rendering(tok):
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    seq, prompt_ids = ChatRenderer(tok, "model").conversation(turns)
    # The ids are the template's rendering of the whole chat, token for token.
    assert tok.decode(seq.ids) == tok.apply_chat_template(turns, tokenize=False)
    # The learned tokens are each answer and its end of turn (eos), nothing of the template's headers.
    assert learned_text(tok, seq) == "2<eos>4<eos>"
    runs, previous = [], 0
    for i, m in enumerate(seq.mask):
        if m and not previous:
            runs.append(i)
        previous = m
    assert len(runs) == 2
    # The prompt of the last answer ends with the generation prompt: what a generator is given.
    assert tok.decode(prompt_ids) == tok.apply_chat_template(turns[:4], tokenize=False, add_generation_prompt=True)


def test_learn_last_masks_only_the_final_answer(tok):
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    turns += [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    seq, _ = ChatRenderer(tok, "model").conversation(turns, learn="last")
    assert learned_text(tok, seq) == "d<eos>"


def test_plain_rendering_is_prompt_answer_eos_as_the_warm_start(tok):
    cfg = OfflineDataConfig(train="addition", chat_template="none")
    example = sft_example({"prompt": "07+45=", "response": "52"}, 0, cfg, ChatRenderer(tok, "none"), "train")
    (seq,) = example.sequences
    assert seq.ids == tok("07+45=52", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert seq.mask == [0] * 6 + [1, 1, 1]
    assert example.prompt_ids == seq.ids[:6] and example.answer == "52"


def test_pairs_share_their_prompt_and_learn_only_their_response(tok):
    cfg = OfflineDataConfig(train="x", chat_template="model")
    example = pair_example({"prompt": "3+4=", "chosen": "7", "rejected": "8"}, 0, cfg, ChatRenderer(tok), "train")
    chosen, rejected = example.sequences
    n = len(example.prompt_ids)
    assert chosen.ids[:n] == rejected.ids[:n] == example.prompt_ids
    assert learned_text(tok, chosen) == "7<eos>" and learned_text(tok, rejected) == "8<eos>"
    assert example.answer == "7"


def test_conversational_pairs_take_their_shared_turns_as_the_prompt(tok):
    user = {"role": "user", "content": "q"}
    row = {
        "chosen": [user, {"role": "assistant", "content": "yes"}],
        "rejected": [user, {"role": "assistant", "content": "no"}],
    }
    cfg = OfflineDataConfig(train="x", prompt_key="absent")
    example = pair_example(row, 0, cfg, ChatRenderer(tok), "train")
    assert [learned_text(tok, s) for s in example.sequences] == ["yes<eos>", "no<eos>"]


def test_gsm8k_style_answers_are_scored_by_their_number(tok):
    cfg = OfflineDataConfig(train="x", prompt_key="question", response_key="answer")
    row = {"question": "How many?", "answer": "2 and 3 make 5.\n#### 5"}
    example = sft_example(row, 0, cfg, ChatRenderer(tok), "train")
    assert example.answer == "5"
    assert learned_text(tok, example.sequences[0]) == "2 and 3 make 5.\n#### 5<eos>"


def test_bad_rows_and_templates_are_errors_that_say_what_is_wrong(tok, tmp_path):
    cfg = OfflineDataConfig(train="x")
    with pytest.raises(KeyError, match="no column 'response'"):
        sft_example({"prompt": "p"}, 3, cfg, ChatRenderer(tok), "train")
    with pytest.raises(UserValueError, match="must end with an assistant turn"):
        ChatRenderer(tok).conversation([{"role": "user", "content": "x"}])
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    plain = build_char_tokenizer(tmp_path / "plain")
    with pytest.raises(UserValueError, match="has no chat template"):
        ChatRenderer(plain, "model")
    too_long = OfflineDataConfig(train="x", max_tokens=4)
    with pytest.raises(UserValueError, match="no example of at most data.max_tokens"):
        build_examples([{"prompt": "12345", "response": "6"}], too_long, ChatRenderer(plain, "none"), False, "train")


def test_generated_addition_pairs_have_a_wrong_rejected_sum_and_never_the_test_prompts():
    cfg = OfflineDataConfig(train="addition")
    train, test = addition_rows(cfg, "train", 0, pairs=True), addition_rows(cfg, "test", 0, pairs=True)
    assert len(train) == 9500 and len(test) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for row in train[:200]:
        a, b = int(row["prompt"][:2]), int(row["prompt"][3:5])
        assert row["chosen"] == str(a + b) and row["rejected"] != row["chosen"]
        assert 1 <= abs(int(row["rejected"]) - (a + b)) <= 10
