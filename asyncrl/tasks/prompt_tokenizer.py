"""A model's tokenizer for rendering and measuring prompts, without importing torch.

The controller (held-out prompts) and the dispatcher (training prompts) only render chats and
count tokens. Loading ``transformers.AutoTokenizer`` for that imports torch and most of
transformers: 4.6 s of CPU per process here, at the start of every run, while the generators
and the learner import their own libraries on the same cores. ``PromptTokenizer`` reads the
same files (``tokenizer.json`` through ``tokenizers``, the chat template and special tokens of
``tokenizer_config.json`` or ``chat_template.jinja``) and renders with transformers' own
``render_jinja_template`` (0.9 s, no torch), passing the special tokens as
``apply_chat_template`` does, so its texts and counts are the fast tokenizer's
(``tests/tasks/test_prompt_tokenizer.py`` compares them). A folder without ``tokenizer.json``
(a SentencePiece-only model) gets ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers (>= 4.43) saves a chat template of its own, beside tokenizer_config.json."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens ``apply_chat_template`` hands a template (transformers 5's
``special_tokens_map``; extra special tokens are not among them)."""


class PromptTokenizer:
    """The subset of a Hugging Face fast tokenizer that prompts need: ``__call__`` (ids of each
    text, special tokens added), ``encode``, ``decode``, ``chat_template`` and
    ``apply_chat_template(..., tokenize=False)``."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        folder = Path(model_dir)
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        older = folder / "special_tokens_map.json"  # older saves keep the special tokens apart
        self.special_tokens = {
            **special_tokens(json.loads(older.read_text()) if older.is_file() else {}),
            **special_tokens(config),
        }
        self.chat_template = chat_template(folder, config)
        # transformers' default in 5.x is False; a config that says True gets its clean-up.
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=True)]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False, **kwargs
    ) -> str:
        """The chat as text, rendered as ``PreTrainedTokenizerBase.apply_chat_template`` renders
        one conversation (special tokens first, ``kwargs`` over them)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if tokenize:
            raise ValueError("PromptTokenizer.apply_chat_template renders text only: tokenize must be False")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json, chat_template.jinja)")
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return rendered[0]


def special_tokens(config: dict) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as the strings a chat template sees."""
    tokens = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = config.get(key)
        if value is not None:
            tokens[key] = value["content"] if isinstance(value, dict) else str(value)
    return tokens


def chat_template(folder: Path, config: dict) -> str | None:
    """The folder's default chat template: ``chat_template.jinja``, else the config's (a string,
    or a list of named templates of which ``default`` is the one ``apply_chat_template`` uses)."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(before, after)
    for before, after in ((" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def load_prompt_tokenizer(model_dir: str | Path):
    """``PromptTokenizer`` for a folder with ``tokenizer.json``, else transformers' tokenizer."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return PromptTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
