"""``PromptTokenizer`` renders and counts exactly as transformers' fast tokenizer of the same folder."""

import json

import pytest
from transformers import AutoTokenizer

from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
from asyncrl.tasks.prompt_tokenizer import PromptTokenizer, load_prompt_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime, please."}],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3 + 3 ?  it's  n't 's"},
    ],
]
TEXTS = ["12+30=", "Question: what's 7 times 8?\nAnswer:", "", "  spaces , and ! punctuation ."]
# A template that uses the special tokens a template is handed (bos_token, eos_token).
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def assert_same(folder):
    ours, theirs = PromptTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours(TEXTS)["input_ids"] == theirs(TEXTS)["input_ids"]
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    if theirs.chat_template:
        for chat in CHATS:
            for generation_prompt in (True, False):
                want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
                assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt) == want
    return ours


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny"))


def test_the_tiny_models_tokenizer_counts_and_decodes_alike(tiny_dir):
    assert_same(tiny_dir)


def test_a_template_with_special_tokens_renders_alike(tiny_dir, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_dir / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|bos|>", eos_token="<|eos|>", chat_template=BOS_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = assert_same(folder)
    assert ours.apply_chat_template(CHATS[0]).startswith("<|bos|>[user] What is 12 + 30?<|eos|>")


def test_a_folder_without_a_chat_template_is_refused_by_name(tiny_dir):
    ours = PromptTokenizer(tiny_dir)
    if ours.chat_template is None:
        with pytest.raises(ValueError, match="has no chat template"):
            ours.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="tokenize must be False"):
        ours.apply_chat_template(CHATS[0], tokenize=True)


def test_a_folder_without_tokenizer_json_gets_transformers(tmp_path):
    with pytest.raises((OSError, ValueError)):  # nothing to load either way: transformers says which
        load_prompt_tokenizer(tmp_path)


@pytest.mark.slow
def test_smollm2s_chatml_template_and_default_system_turn_render_alike(smollm2_dir):
    ours = assert_same(smollm2_dir)
    assert "<|im_start|>system" in ours.apply_chat_template(CHATS[0], add_generation_prompt=True)
