"""What an environment answers, as the tokens appended after the model's turn: token in, token out.

A multi-turn episode is one growing token sequence: the prompt, the model's first turn exactly as
sampled, the observation, the second turn, and so on. The ids the engine sampled are kept as they
are; nothing earlier is ever decoded and encoded again (a decode-encode round trip can merge or
split tokens, and the learner would then train on ids the policy never sampled). Only the new
messages are rendered, to ids appended at the end.

- ``ChatRenderer`` uses the model's chat template. The delta after a model turn is what the
  template puts between the end of that turn and the start of the next assistant turn: render a
  fixed conversation with and without the new messages (and the generation prompt), and keep the
  suffix. The model's turn ends with its end-of-turn token when it stopped by itself (vLLM keeps
  the EOS id in the sampled ids); the delta starts right after it, with the template's own
  separator (a newline for ChatML).
- ``PlainRenderer`` is for a model without a chat template (the demo's character-level model):
  each message's content, formatted by ``template`` (``"{content}"`` by default), tokenized alone
  and appended.

Messages an environment answers to ``reset`` open the episode (``opening``): they go into the
prompt, before the model's first turn, where nothing is sampled yet.

Both tokenize without special tokens added (no BOS in the middle of an episode).
"""

from __future__ import annotations

from typing import Protocol

Message = dict[str, str]

_PROBE_USER = "asyncrl-probe-question"
_PROBE_ASSISTANT = "asyncrl-probe-answer"


class Renderer(Protocol):
    def observation(self, messages: list[Message], turn_closed: bool = True) -> list[int]:
        """Token ids of ``messages`` (observations, tool results) appended after a model turn,
        ending where the model's next turn begins. ``turn_closed``: the turn ended with the
        model's end-of-turn token (else it ended at a stop string, and the template's end of
        turn comes first)."""
        ...

    def opening(self, prompt_ids: list[int], messages: list[Message]) -> list[int]:
        """The prompt with ``messages`` (what an environment's ``reset`` answers) after it, before
        the model's first turn: the prompt's ids, nothing sampled yet."""
        ...


class PlainRenderer:
    """Each message's content, formatted by ``template`` and tokenized on its own.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: [ord(c) for c in text])
    >>> PlainRenderer(tok, template="|{content}|").observation([{"role": "user", "content": "hi"}])
    [124, 104, 105, 124]
    """

    def __init__(self, tokenizer, template: str = "{content}"):
        if "{content}" not in template:
            raise ValueError(f"template ({template!r}) must contain {{content}}")
        self.tokenizer, self.template = tokenizer, template

    def observation(self, messages: list[Message], turn_closed: bool = True) -> list[int]:
        text = "".join(self.template.format(content=m["content"], role=m.get("role", "user")) for m in messages)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def opening(self, prompt_ids: list[int], messages: list[Message]) -> list[int]:
        return list(prompt_ids) + self.observation(messages)


class ChatRenderer:
    """The chat template's rendering of new messages after a finished model turn (see the module
    docstring). ``tokenizer`` is a Hugging Face tokenizer with a chat template."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template: use PlainRenderer")
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.eos_token or ""
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        self._base = base
        rendered = self._render(base, generation_prompt=False)
        end = rendered.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT)
        self._closer = 0  # characters of the end-of-turn token the template puts after a turn
        if self.end_of_turn and rendered.startswith(self.end_of_turn, end):
            self._closer = len(self.end_of_turn)
            end += self._closer  # the model sampled its end-of-turn token itself
        self._turn_end = end
        self._prefix = rendered[:end]

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def observation(self, messages: list[Message], turn_closed: bool = True) -> list[int]:
        rendered = self._render(self._base + list(messages), generation_prompt=True)
        if not rendered.startswith(self._prefix):
            raise ValueError(
                "the chat template renders earlier turns differently once messages follow them; "
                "an episode under it cannot extend its tokens (use PlainRenderer or another template)"
            )
        start = self._turn_end if turn_closed else self._turn_end - self._closer
        return list(self.tokenizer.encode(rendered[start:], add_special_tokens=False))

    def opening(self, prompt_ids: list[int], messages: list[Message]) -> list[int]:
        """The prompt (rendered by the template with its generation prompt, ``G``) with
        ``messages`` put before ``G``: the prompt's ids without ``G``'s, then the template's
        rendering of the messages and ``G``. A prompt that does not end with ``G``'s ids (not
        rendered by this template) is a ValueError."""
        user = [{"role": "user", "content": _PROBE_USER}]
        asked = self._render(user, generation_prompt=True)
        closed = self._render(user, generation_prompt=False)
        if not asked.startswith(closed):
            raise ValueError("the chat template's generation prompt is not a suffix of the conversation it ends")
        header = list(self.tokenizer.encode(asked[len(closed) :], add_special_tokens=False))
        if not header or list(prompt_ids[-len(header) :]) != header:
            raise ValueError(
                "the prompt does not end with the chat template's generation prompt: an environment's "
                "first messages need a prompt rendered by the model's chat template"
            )
        grown = self._render(user + list(messages), generation_prompt=True)
        if not grown.startswith(closed):
            raise ValueError("the chat template renders a message differently once messages follow it")
        return list(prompt_ids[: -len(header)]) + list(
            self.tokenizer.encode(grown[len(closed) :], add_special_tokens=False)
        )


def build_renderer(tokenizer, plain_template: str | None = None) -> Renderer:
    """The chat template's renderer when the tokenizer has one and no plain template is asked
    for, else ``PlainRenderer``."""
    if plain_template is None and getattr(tokenizer, "chat_template", None):
        return ChatRenderer(tokenizer)
    return PlainRenderer(tokenizer, plain_template or "{content}")
