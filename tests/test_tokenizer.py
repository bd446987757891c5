"""The character tokenizer round-trips text exactly and reloads offline."""

import json

from transformers import AutoTokenizer

from asyncrl.tokenizer import build_char_tokenizer, char_vocabulary


def test_vocabulary_is_specials_then_printable_ascii_then_newline():
    vocab = char_vocabulary()
    assert vocab[:3] == ["<pad>", "<eos>", "<unk>"]
    assert vocab[3] == " " and vocab[-2] == "~" and vocab[-1] == "\n"
    assert len(vocab) == len(set(vocab)) == 3 + 95 + 1


def test_round_trip_is_exact_and_one_token_per_char(tmp_path):
    build_char_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "Question: a  b\n07+45=52 ~{}"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # no BOS, no EOS added, one id per character
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_unknown_chars(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.bos_token_id is None
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]
    ids = tokenizer("52", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "52"


def test_saved_config_names_a_portable_class(tmp_path):
    build_char_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tmp_path / "tokenizer.json").is_file()
