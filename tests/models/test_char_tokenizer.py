"""The character tokenizer round-trips text exactly, also as reloaded next to a Qwen2 model."""

import json

import pytest
from transformers import AutoTokenizer

from asyncrl.models.char_tokenizer import build_char_tokenizer, byte_symbols, char_vocabulary
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

TEXTS = ["07+45=52", "Question: a  b\n\nAnswer: 1,000 ~{}", "Janet’s ducks lay 16 eggs. é\t"]


def test_vocabulary_layout():
    vocab = char_vocabulary()
    assert vocab[:3] == ["<pad>", "<eos>", "<unk>"]
    symbols = byte_symbols()
    assert vocab[3] == symbols[ord(" ")] and vocab[97] == "~" and vocab[98] == symbols[ord("\n")]
    assert len(vocab) == len(set(vocab)) == 3 + 256
    assert sorted(symbols) == list(range(256)) and len(set(symbols.values())) == 256


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """The tokenizer as AutoTokenizer (and so vLLM) loads it from a tiny Qwen2 checkpoint."""
    out = build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny"))
    return AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tmp_path, reloaded, text):
    built = build_char_tokenizer(tmp_path)
    ids = built(text)["input_ids"]
    assert reloaded(text)["input_ids"] == ids
    assert built.decode(ids) == reloaded.decode(ids) == text


def test_one_token_per_ascii_char_and_no_bos(reloaded):
    text = TEXTS[1]
    ids = reloaded(text)["input_ids"]
    assert len(ids) == len(text)
    assert ids[:3] == [3 + ord("Q") - ord(" "), 3 + ord("u") - ord(" "), 3 + ord("e") - ord(" ")]
    assert reloaded("\n")["input_ids"] == [98]
    assert reloaded.unk_token_id not in reloaded(TEXTS[2])["input_ids"]


def test_special_tokens(reloaded):
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.unk_token_id) == (0, 1, 2)
    assert reloaded.bos_token_id is None
    ids = reloaded("52", add_special_tokens=False)["input_ids"] + [reloaded.eos_token_id]
    assert reloaded.decode(ids, skip_special_tokens=True) == "52"
    assert reloaded.decode(ids) == "52<eos>"


def test_saved_files(tmp_path):
    build_char_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert (config["eos_token"], config["pad_token"]) == ("<eos>", "<pad>")
    assert (tmp_path / "tokenizer.json").is_file()
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 259


def test_padded_vocabulary_keeps_the_characters_and_decodes_every_id(tmp_path):
    padded = build_char_tokenizer(tmp_path, vocab_size=1000)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(padded) == len(reloaded) == 1000
    plain = build_char_tokenizer(tmp_path / "plain")
    for text in TEXTS:  # no text encodes to a placeholder: the ids are the character tokenizer's
        assert reloaded(text)["input_ids"] == plain(text)["input_ids"]
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.decode([259, 999]) == "<|extra_0|><|extra_740|>"


def test_padded_vocabulary_smaller_than_the_characters_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size \(100\) must be >= the character vocabulary \(259\)"):
        build_char_tokenizer(tmp_path, vocab_size=100)
