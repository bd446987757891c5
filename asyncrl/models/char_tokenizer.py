"""A character-level tokenizer, built locally, for the tiny test and demo models.

There is no internet on CI machines, so no pretrained tokenizer can be fetched. One token
per character keeps the vocabulary tiny, which keeps the tiny model near 1 M parameters,
and makes arithmetic easy to learn (every digit is its own token).

It is a byte-level BPE with no merges, built as a ``Qwen2Tokenizer``, because transformers 5
loads *any* checkpoint whose config says ``model_type: qwen2`` as a ``Qwen2Tokenizer``
(whatever ``tokenizer_config.json`` names), and that class rebuilds the pipeline (NFC, the
Qwen split regex, byte-level pre-tokenizer, BPE over ``tokenizer.json``'s vocab). A plain
WordLevel tokenizer saved next to a Qwen2 model therefore came back silently dropping spaces
and newlines. Built this way, the tokenizer we save and the one ``AutoTokenizer`` and vLLM
load are the same. With no merges, each ASCII character is one token; any other character
is its UTF-8 bytes (so every string round-trips and ``<unk>`` is never produced).

``vocab_size`` pads the vocabulary with placeholder tokens ``<|extra_N|>`` that no text encodes
to (there are no merges to reach them), as real tokenizers leave ids between their last token and
the model's padded embedding size. A model of a real model's size can then be built around the
character tokenizer, and every id that model samples still decodes (to the placeholder's text).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map that byte-level BPE vocabularies are written in.

    Printable bytes stand for themselves; the rest (space, newline, controls, 0x7f-0xff
    gaps) are shifted to U+0100 onwards, e.g. space -> "Ġ", newline -> "Ċ".
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {byte: chr(byte) for byte in kept}
    shifted = (byte for byte in range(256) if byte not in symbols)
    for offset, byte in enumerate(shifted):
        symbols[byte] = chr(256 + offset)
    return symbols


def char_vocabulary() -> list[str]:
    """Vocabulary in id order: specials, printable ASCII (space..~), newline, then every other byte.

    Ids 0-98 are the character set (<pad>=0, <eos>=1, <unk>=2, " "=3, ..., "~"=97, "\\n"=98);
    ids 99-258 are the remaining bytes, only used by non-ASCII text such as GSM8K's "’".
    """
    symbols = byte_symbols()
    order = [*range(ord(" "), ord("~") + 1), ord("\n")]
    order += [byte for byte in range(256) if byte not in order]
    return [*SPECIAL_TOKENS, *(symbols[byte] for byte in order)]


def padded_vocabulary(vocab_size: int | None = None) -> list[str]:
    """``char_vocabulary()`` followed by placeholders ``<|extra_N|>`` up to ``vocab_size`` entries."""
    tokens = char_vocabulary()
    if vocab_size is None:
        return tokens
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size ({vocab_size}) must be >= the character vocabulary ({len(tokens)})")
    return tokens + [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]


def build_char_tokenizer(out_dir: str | Path, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Build the character tokenizer, save it to ``out_dir`` and return it (no BOS, no chat template).

    ``vocab_size`` pads it with placeholder tokens to that many ids (None: the 259 characters)."""
    vocab = {token: index for index, token in enumerate(padded_vocabulary(vocab_size))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """``save_pretrained`` into ``out_dir``, creating it if missing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
