"""Question -> prompt text: a template, then a tokenizer's chat template when asked for."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.tasks.prompt_tokenizer import load_prompt_tokenizer
from asyncrl.tasks.sources import MODEL_CHAT_TEMPLATE, DataConfig

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files whose presence says a model directory holds a tokenizer."""


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved in a model directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class PromptFormatter:
    """Question -> prompt text: the template, then a tokenizer's chat template when asked for.

    ``chat_template: model`` uses ``tokenizer``, the policy model's own (its owner passes it);
    a directory loads that tokenizer. A tokenizer without a chat template leaves the text plain,
    with a warning. The chat is ``[system?, user]`` rendered with ``add_generation_prompt=True``,
    so the text ends where the assistant's answer starts.
    """

    def __init__(self, cfg: DataConfig, default_template: str = "{question}", tokenizer=None):
        self.template = cfg.prompt_template or default_template
        self.system_prompt = cfg.system_prompt
        self.tokenizer = None
        if cfg.chat_template is None:
            return
        if cfg.chat_template == MODEL_CHAT_TEMPLATE:
            if tokenizer is None:
                raise ValueError(
                    "task.data.chat_template ('model') renders prompts with the policy model's tokenizer, "
                    "but none was given here: pass the model's tokenizer, or set chat_template to a model directory"
                )
            where = "the policy model"
        else:
            tokenizer, where = load_prompt_tokenizer(cfg.chat_template), cfg.chat_template
        if getattr(tokenizer, "chat_template", None):
            self.tokenizer = tokenizer
        else:
            log.warning("the tokenizer of %s has no chat template: prompts stay plain text", where)

    def __call__(self, question: str) -> str:
        text = self.template.format(question=question)
        if self.tokenizer is None:
            return text
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
