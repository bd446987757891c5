"""A character-level tokenizer, built locally, for the tiny test and demo models.

There is no internet on CI machines, so no pretrained tokenizer can be fetched. One token
per character keeps the vocabulary tiny (~100 ids), which keeps the tiny model near 1 M
parameters, and makes arithmetic tasks easy to learn (every digit is its own token).
The result is an ordinary ``PreTrainedTokenizerFast`` saved with ``save_pretrained``, so
``AutoTokenizer.from_pretrained(dir)`` and vLLM load it like any other tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)


def char_vocabulary() -> list[str]:
    """Special tokens, then every printable ASCII char from space to ``~``, then newline."""
    printable = [chr(code) for code in range(ord(" "), ord("~") + 1)]
    return [*SPECIAL_TOKENS, *printable, "\n"]


def build_char_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Build the character tokenizer, save it to ``out_dir`` and return it."""
    vocab = {token: index for index, token in enumerate(char_vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included: "." would skip it) becomes its own pre-token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the tokens with no separator, so decode(encode(s)) == s exactly.
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """``save_pretrained`` into ``out_dir`` (created if missing), naming a portable tokenizer class."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    name_tokenizer_class(out / "tokenizer_config.json")


def name_tokenizer_class(config_path: Path) -> None:
    """Record the class as ``PreTrainedTokenizerFast``, the name every transformers version knows.

    transformers 5 writes ``TokenizersBackend``, which transformers 4 (and tools that read the
    config themselves) cannot resolve; in 5 ``PreTrainedTokenizerFast`` is an alias of it.
    """
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
